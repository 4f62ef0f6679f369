"""HostCopies: many device scalars brought to the host in one transfer.

On an accelerator every transfer to the host costs tens of µs of host time
(starting a copy took about 30 µs a value on an H100), so a step that returns
10 scalars paid about 300 µs an update in copies alone. Instead, the scalars
History records wait here (:meth:`HostCopies.stage`) and every
:attr:`HostCopies.SEND_AT` of them, or as soon as one of them is read, one
jitted program stacks those of one dtype and device into one array, whose
copy to the host starts at once. Whoever reads a
recorded value (the history's tables, the JSONL log's writer, the summary
line, the sentinels) asks :func:`to_host`, which answers from that one array
(fetched once) and falls back to reading the value itself.

Only scalars of a numeric dtype take this path, each through one device's copy
of it (a scalar on several devices is replicated): the stacking program runs
on one device of this process, never across processes, so each process sends
its values on its own schedule. Anything else has its copy started at once, as
before. A value is forgotten when the array itself is freed (a weak
reference), so nothing here outlives what History keeps.

``JAXHISTORY_NO_STACKED_COPIES=1`` (read when jaxhistory is imported) turns
this off: every value's copy then starts at update.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhistory._env import env_flag

__all__ = ["HostCopies", "host_copies", "to_host"]

_BUCKETS = (8, 16, 32, 64)  # stacked lengths: few programs to compile


@jax.jit
def _stack(*values):
    return jnp.stack(values)


class _Sent:
    """One stacked array of scalars (on one device) and, once read, its host
    copy."""

    __slots__ = ("host", "stacked")

    def __init__(self, stacked: jax.Array):
        self.stacked, self.host = stacked, None

    def fetch(self) -> np.ndarray:
        host = self.host
        if host is not None:
            return host
        stacked = self.stacked
        if stacked is None:  # fetched meanwhile on another thread (host first)
            return self.host
        host = self.host = np.asarray(stacked)
        self.stacked = None  # the device array is not needed any more
        return host


@functools.cache
def _numeric(dtype: np.dtype) -> bool:
    """Booleans and numbers, bfloat16 and the other ML types included."""
    return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def _local(value: Any) -> Any:
    """The single-device array to stack for ``value``: itself where it lives on
    one device, else (a scalar is replicated) this process's first copy of
    it; None where ``value`` cannot go in a stacked transfer (not a scalar of
    a numeric dtype, deleted, a tracer, or with no copy on this process)."""
    try:
        if value.ndim != 0 or not _numeric(value.dtype) or value.is_deleted():
            return None
        if len(value.sharding.device_set) == 1:
            return value if value.is_fully_addressable else None
        return value.addressable_data(0)  # (replicated: every copy is the same)
    except Exception:  # a tracer, or anything else that is not a plain array
        return None


def _flag(name: str) -> bool:
    """An on/off variable; a value that is neither warns (naming it) and counts
    as not set: this is read at import, which must not fail."""
    try:
        return env_flag(name)
    except ValueError as err:
        warnings.warn(f"{err}; ignored", RuntimeWarning, stacklevel=2)
        return False


def _start_copy(value: Any) -> None:
    try:  # noqa: SIM105 (no context manager per metric per step)
        value.copy_to_host_async()
    except (AttributeError, RuntimeError):  # deleted, or not a JAX array
        pass


class HostCopies:
    """Device scalars waiting to go to the host together (see the module
    docstring). Every method may be called from any thread."""

    SEND_AT = 64  # scalars of one dtype and device that go in one program
    OFF = "JAXHISTORY_NO_STACKED_COPIES"

    def __init__(self):
        self.enabled = not _flag(self.OFF)
        self._lock = threading.Lock()
        # (dtype, the device's sharding) -> (array, its single-device copy)
        # pairs waiting, in order; and the arrays' ids
        self._groups: dict[tuple, list] = {}
        self._waiting: set[int] = set()
        # id -> (the stacked array it went out in, its index, a weak reference
        # whose callback forgets it when the array is freed)
        self._sent: dict[int, tuple[_Sent, int, Any]] = {}
        self.programs = 0  # stacking programs launched (for tests and benchmarks)

    def stage(self, arrays: list) -> None:
        """Queues the scalars among ``arrays`` for one transfer with others
        (sent once :attr:`SEND_AT` of one dtype and device wait), and starts
        the copy of every other array now."""
        if not self.enabled:
            for a in arrays:
                _start_copy(a)
            return
        with self._lock:
            groups, waiting = self._groups, self._waiting
            for a in arrays:
                local = _local(a)
                if local is None:
                    _start_copy(a)
                    continue
                key = (local.dtype, local.sharding)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = []
                group.append((a, local))
                waiting.add(id(a))
                if len(group) >= self.SEND_AT:
                    del groups[key]
                    self._send_group(group)

    def send(self) -> None:
        """Launches the stacking of every scalar waiting (one program per
        dtype and device and :attr:`SEND_AT` scalars) and starts its copy."""
        with self._lock:
            groups, self._groups = self._groups, {}
            for group in groups.values():
                for start in range(0, len(group), self.SEND_AT):
                    self._send_group(group[start : start + self.SEND_AT])

    def _send_group(self, group: list) -> None:
        """One stacking program for ``group`` (``(array, its single-device
        copy)`` pairs; the caller holds the lock); where it cannot run, each
        value's own copy is started instead."""
        waiting = self._waiting
        for a, _ in group:
            waiting.discard(id(a))
        # one deleted since it was staged is read (and reported) alone
        group = [
            (a, local)
            for a, local in group
            if not (a.is_deleted() or local.is_deleted())
        ]
        if not group:
            return
        size = next((b for b in _BUCKETS if b >= len(group)), len(group))
        values = [local for _, local in group]
        values += [values[-1]] * (size - len(values))
        try:
            stacked = _stack(*values)
            stacked.copy_to_host_async()
        except Exception:  # a layout the program refuses
            for a, _ in group:
                _start_copy(a)
            return
        self.programs += 1
        sent = _Sent(stacked)
        table = self._sent
        for i, (a, _) in enumerate(group):
            key = id(a)
            ref = weakref.ref(a, lambda _, key=key: table.pop(key, None))
            table[key] = (sent, i, ref)

    def read(self, value: Any) -> np.ndarray | None:
        """``value`` on the host (a 0-d array) where it went out in a stacked
        array (sending it first if it still waits); None where it did not."""
        key = id(value)
        entry = self._sent.get(key)
        if entry is None:
            if key not in self._waiting:
                return None
            self.send()
            entry = self._sent.get(key)
            if entry is None:
                return None
        sent, i, ref = entry
        if ref() is not value:
            return None
        return sent.fetch()[i, ...]

    def waiting(self) -> int:
        """Scalars staged and not yet sent."""
        return len(self._waiting)

    def remembered(self) -> int:
        """Scalars sent whose arrays are still alive."""
        return len(self._sent)


host_copies = HostCopies()


def to_host(value: Any) -> Any:
    """``value`` as a NumPy array: from its stacked transfer where it took one
    (see :class:`HostCopies`), else ``np.asarray(value)``."""
    if not isinstance(value, jax.Array):
        return np.asarray(value)
    host = host_copies.read(value)
    return np.asarray(value) if host is None else host
