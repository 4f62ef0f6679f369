"""HostCopies: many device scalars brought to the host in one transfer.

On an accelerator every transfer to the host costs tens of µs of host time
(starting a copy took about 30 µs a value on an H100), so a step that returns
10 scalars paid about 300 µs an update in copies alone. Instead, the scalars
History records wait here (:meth:`HostCopies.stage`), and every
:attr:`HostCopies.SEND_AT` of one kind (dtype, weak type, placement and
device: what one compiled program takes), or as soon as one of them is read,
one jitted program stacks them into one array, whose copy to the host starts
at once. Whoever reads a recorded value (the history's tables, the JSONL
log's writer, the summary line, the sentinels) asks :func:`to_host`, which
answers from that one array (fetched once) and falls back to reading the
value itself.

Only scalars of a numeric dtype take this path, each through one device's copy
of it (a scalar on several devices is replicated): the stacking program runs
on one device of this process, never across processes, so each process sends
its values on its own schedule. Anything else (an array of more values, a
scalar held as partial sums on several devices) has its copy started at once,
as before. A value sent is forgotten when the array itself is freed (a weak
reference); at most :attr:`HostCopies.SEND_AT` ``- 1`` scalars of one kind
wait unsent, until the next send (a read, :meth:`HostCopies.send`, or
``History.close``).

Nothing here may hang a thread: the lock is taken with a timeout, and a
thread that cannot take it (another one holds it, or this one does, deep in a
garbage-collection callback that closes a History) copies or reads its values
alone, as before.

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

__all__ = ["HostCopies", "host_copies", "is_done", "to_host"]

_BUCKETS = (8, 16, 32, 64)  # stacked lengths: few programs to compile
_WAIT = 0.05  # seconds to wait for the lock before going alone


@jax.jit
def _stack(*values):
    return jnp.stack(values)


@functools.lru_cache(maxsize=64)
def _device_mesh(device: Any) -> jax.sharding.Mesh:
    """A mesh of ``device`` alone: the stacking program runs under it, since
    under a user's ``jax.set_mesh`` jit refuses single-device inputs."""
    return jax.sharding.Mesh(np.array([device]), ("stacked",))


class _Sent:
    """One stacked array of scalars (on one device) and, once read, its host
    copy."""

    __slots__ = ("host", "stacked")
    stacked: jax.Array | None
    host: np.ndarray | None

    def __init__(self, stacked: jax.Array):
        self.stacked, self.host = stacked, None

    def fetch(self) -> np.ndarray:
        """The host copy (read once); raises where the stacked array cannot be
        read (then every value in it is read alone)."""
        host = self.host
        if host is not None:
            return host
        stacked = self.stacked
        if stacked is None:  # read meanwhile on another thread (host first)
            if self.host is None:
                raise RuntimeError("the stacked transfer could not be read")
            return self.host
        try:
            host = np.asarray(stacked)
        except Exception:
            self.stacked = None
            raise
        self.host = host
        self.stacked = None  # the device array is not needed any more
        return host


@functools.cache
def _numeric(dtype: np.dtype) -> bool:
    """Booleans and numbers, bfloat16 and the other ML types included."""
    return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def _local(value: Any) -> Any:
    """The single-device array to stack for ``value``: itself where it lives on
    one device, else (replicated) this process's first copy of it; None where
    ``value`` cannot go in a stacked transfer (not a scalar of a numeric
    dtype, deleted, held as different values on its devices, a tracer, or
    with no copy on this process)."""
    try:
        if value.ndim != 0 or not _numeric(value.dtype) or value.is_deleted():
            return None
        sharding = value.sharding
        if len(sharding.device_set) == 1:
            return value if value.is_fully_addressable else None
        if not sharding.is_fully_replicated:  # (partial sums: read as a whole)
            return None
        return value.addressable_data(0)  # every copy is the same
    except Exception:  # a tracer, or anything else that is not a plain array
        return None


def _key(local: Any) -> tuple:
    """What one stacking program takes alike: a program is compiled per dtype,
    weak type, placement and device."""
    committed = getattr(local, "_committed", True)
    return (local.dtype, local.weak_type, committed, local.sharding)


def _flag(name: str) -> bool:
    """An on/off variable; a value that is neither warns (naming it) and counts
    as not set: this is read at import, which must not fail."""
    try:
        return env_flag(name)
    except ValueError as err:
        warnings.warn(f"{err}; ignored", RuntimeWarning, stacklevel=2)
        return False


def is_done(value: Any) -> bool:
    """Whether reading ``value`` would not wait for the device: anything but
    a JAX array, a deleted one (reading it reports it), or one computed.
    ``is_ready()`` of a deleted array crashes the process: asked first."""
    try:
        if value.is_deleted():
            return True
        return value.is_ready()
    except AttributeError:  # not a JAX array
        return True
    except Exception:  # anything else a value may raise: reading will say
        return True


def _start_copy(value: Any) -> None:
    try:  # noqa: SIM105 (no context manager per metric per step)
        value.copy_to_host_async()
    except (AttributeError, RuntimeError):  # deleted, or not a JAX array
        pass


class HostCopies:
    """Device scalars waiting to go to the host together (see the module
    docstring). Every method may be called from any thread."""

    SEND_AT = 64  # scalars of one kind that go in one program
    OFF = "JAXHISTORY_NO_STACKED_COPIES"

    def __init__(self):
        self.enabled = not _flag(self.OFF)
        self._lock = threading.Lock()
        # _key -> (array, its single-device copy) pairs waiting, in order;
        # and the arrays' ids
        self._groups: dict[tuple, list] = {}
        self._waiting: set[int] = set()
        # id -> (the stacked array it went out in, its index, a weak reference
        # whose callback forgets it when the array is freed)
        self._sent: dict[int, tuple[_Sent, int, Any]] = {}
        self._failed: set[tuple] = set()  # kinds whose program cannot run
        self.programs = 0  # stacking programs launched (for tests and benchmarks)

    def stage(self, arrays: list) -> None:
        """Queues the scalars among ``arrays`` for one transfer with others
        (sent once :attr:`SEND_AT` of one kind wait), and starts the copy of
        every other array now."""
        if not self.enabled or not self._lock.acquire(timeout=_WAIT):
            for a in arrays:
                _start_copy(a)
            return
        try:
            groups, waiting, failed = self._groups, self._waiting, self._failed
            for a in arrays:
                local = _local(a)
                key = None if local is None else _key(local)
                if key is None or key in failed:
                    _start_copy(a)
                    continue
                group = groups.get(key)
                if group is None:
                    group = groups[key] = []
                group.append((a, local))
                waiting.add(id(a))
                if len(group) >= self.SEND_AT:
                    del groups[key]
                    self._send_group(key, group)
        finally:
            self._lock.release()

    def send(self) -> None:
        """Launches the stacking of every scalar waiting and starts its copy."""
        if self._lock.acquire(timeout=_WAIT):
            try:
                self._send_all()
            finally:
                self._lock.release()

    def _send_all(self) -> None:
        """:meth:`send` for a caller that holds the lock."""
        groups, self._groups = self._groups, {}
        for key, group in groups.items():
            for start in range(0, len(group), self.SEND_AT):
                self._send_group(key, group[start : start + self.SEND_AT])

    def _send_older(self, key: int) -> None:
        """Sends the scalar of id ``key``, those of its kind staged before it,
        and those after it whose steps are done (the caller holds the lock):
        reading this one must not wait for a step still running."""
        for kind, group in self._groups.items():
            i = next((i for i, (a, _) in enumerate(group) if id(a) == key), None)
            if i is None:
                continue
            end = i + 1
            for a, local in group[end:]:
                if a.is_deleted() or not is_done(local):
                    break
                end += 1
            if end < len(group):
                self._groups[kind] = group[end:]
            else:
                del self._groups[kind]
            for start in range(0, end, self.SEND_AT):
                self._send_group(kind, group[start : min(start + self.SEND_AT, end)])
            return

    def _send_group(self, kind: tuple, group: list) -> None:
        """One stacking program for ``group`` (``(array, its single-device
        copy)`` pairs of one kind; the caller holds the lock); where it cannot
        run, each value's own copy is started instead, and so for that kind
        from then on."""
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
            (device,) = values[0].sharding.device_set
            with jax.set_mesh(_device_mesh(device)):
                stacked = _stack(*values)
            stacked.copy_to_host_async()
        except Exception:  # a layout or placement the program refuses
            self._failed.add(kind)
            for a, _ in group:
                _start_copy(a)
            return
        self.programs += 1
        sent = _Sent(stacked)
        table = self._sent
        for i, (a, _) in enumerate(group):
            key = id(a)
            # mypy cannot infer a lambda with a default argument as the callback
            ref = weakref.ref(a, lambda _, key=key: table.pop(key, None))  # type: ignore[misc]
            table[key] = (sent, i, ref)

    def read(self, value: Any, older_only: bool = False) -> np.ndarray | None:
        """``value`` on the host (a 0-d array) where it went out in a stacked
        array, sending it first if it still waits (with everything waiting,
        or with ``older_only`` only what was staged before it); None where it
        did not go (then read it alone)."""
        key = id(value)
        entry = self._sent.get(key)
        if entry is None:
            if key not in self._waiting or not self._lock.acquire(timeout=_WAIT):
                return None
            try:
                if older_only:
                    self._send_older(key)
                else:
                    self._send_all()
            finally:
                self._lock.release()
            entry = self._sent.get(key)
            if entry is None:
                return None
        sent, i, ref = entry
        if ref() is not value:
            return None
        try:
            host = sent.fetch()
        except Exception:  # one value of the stack failed: each is read alone
            return None
        return host[i, ...]

    def waits(self, value: Any) -> bool:
        """Whether ``value`` is staged and not yet sent."""
        return id(value) in self._waiting

    def waiting(self) -> int:
        """Scalars staged and not yet sent."""
        return len(self._waiting)

    def remembered(self) -> int:
        """Scalars sent whose arrays are still alive."""
        return len(self._sent)


host_copies = HostCopies()


def to_host(value: Any, older_only: bool = False) -> Any:
    """``value`` as a NumPy array: from its stacked transfer where it took one
    (see :meth:`HostCopies.read`), else ``np.asarray(value)``."""
    if not isinstance(value, jax.Array):
        return np.asarray(value)
    host = host_copies.read(value, older_only)
    return np.asarray(value) if host is None else host
