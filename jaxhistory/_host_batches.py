"""Batches of a multi-process History's values, reduced on the host.

With ``log_every`` > 1, the values a multi-process History reduces across
devices and processes (per-device arrays, host scalars, arrival times and
checksums) wait in a batch. A device program could reduce the batch, but on
XLA's CPU client launching a program on every device waits for the step before
it: the training thread would lose most of a step at every batch.

So a batch is reduced here instead, on a background thread, with no device
program. Each process sums up what its own devices hold of each value (count,
mean, squared deviations, max and min with the lowest device holding them, the
lowest device holding a NaN), posts that to the distributed runtime's
key-value store, reads every other process's, and combines them, in float64,
the same way on every process. The statistics and their provenance are those
of :func:`jaxhistory._stats.global_stats` (where every element counts once, at
the lowest device holding it); the statistics are float64 sums rounded to the
result's dtype, not float32 sums, so they can differ from the device
reduction's in the last bit.

Batches are reduced one after another, on one thread per process (so a
process posts batch ``n`` only after reading every process's batch ``n - 1``,
and can then delete its own post of batch ``n - 2``: at most two posts per
process stay in the store). The caller keeps at most two batches in flight.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxhistory._names import PROVENANCE, STATS
from jaxhistory._provenance import concrete_layout, global_index
from jaxhistory._stats import Stats
from jaxhistory._tree import acc_dtype

__all__ = [
    "Combined",
    "HostBatch",
    "Partial",
    "combine",
    "of_values",
    "partials",
    "result_dtype",
]

YIELD_S = 5e-5  # the pause between pieces of work (see _let_others_run)
POLL_S = 5.0  # how long one read of the store waits before checking for shutdown

# What one process holds of one value:
# (count, mean, sum of squared deviations, max, lowest device with it,
#  min, lowest device with it, lowest device with a NaN or -1)
Partial = tuple[float, float, float, float, int, float, int, int]
# One update combined: its statistics, its straggler values, and whether each
# checksum differs across processes (None without checksums)
Combined = tuple[Stats, dict, Any]
_NONE = 2**31 - 1  # no device: larger than any device index


def of_values(x: np.ndarray, devices: np.ndarray) -> Partial | None:
    """The partial of values ``x`` (float64) held by ``devices`` (one each)."""
    if x.size == 0:
        return None
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf pass on
        mean = float(np.mean(x))
        m2 = float(np.sum(np.square(x - mean)))
    nan = np.isnan(x)
    nan_device = int(devices[nan].min()) if nan.any() else -1
    clean, held = x[~nan], devices[~nan]
    if clean.size == 0:
        return (x.size, mean, m2, -np.inf, _NONE, np.inf, _NONE, nan_device)
    mx, mn = clean.max(), clean.min()
    return (
        x.size,
        mean,
        m2,
        float(mx),
        int(held[clean == mx].min()),
        float(mn),
        int(held[clean == mn].min()),
        nan_device,
    )


def _of_array(value: jax.Array, index: dict[int, int]) -> Partial | None:
    """The partial of the elements of ``value`` whose lowest holding device
    is one of this process's (waits for the array to be computed)."""
    layout = concrete_layout(value.sharding, value.shape)
    xs, devices = [], []
    for shard in value.addressable_shards:
        device = index[shard.device.id]
        owned = layout.holders[layout.rank[shard.index]] == device
        if owned.any():
            x = np.asarray(shard.data)[owned].astype(np.float64)
            xs.append(x)
            devices.append(np.full(x.shape, device, np.int64))
    if not xs:
        return None
    return of_values(np.concatenate(xs), np.concatenate(devices))


def partials(
    items: list[tuple[str, Any]], weight: int, holder: int, index: dict[int, int]
) -> list[Partial | None]:
    """This process's partial of each of ``items`` (sorted by name): a JAX
    array's from its own devices' shards, a host scalar as ``weight`` values
    (this process's devices in the mesh) held by device ``holder``."""
    out = []
    for _, value in items:
        if isinstance(value, jax.Array):
            out.append(_of_array(value, index))
        elif weight == 0:
            out.append(None)
        else:
            v = float(value)
            nan = v != v
            out.append(
                (
                    weight,
                    v,
                    0.0 if v - v == 0 else np.nan,  # inf: as the device sum gives
                    -np.inf if nan else v,
                    _NONE if nan else holder,
                    np.inf if nan else v,
                    _NONE if nan else holder,
                    holder if nan else -1,
                )
            )
    return out


def _combined(parts: list[Partial]) -> tuple[list[float], list[int]]:
    """The statistics (STATS order) and provenance (PROVENANCE order) of one
    value from every process's partial (Python floats: float64, a handful of
    them, faster than NumPy; ``d * d``, not ``** 2``, overflows to inf)."""
    nan_devices = [p[7] for p in parts if p[7] >= 0]
    if nan_devices:
        return [math.nan] * 4, [min(nan_devices)] * 3
    total = sum(p[0] for p in parts)
    mean = sum(p[0] * p[1] for p in parts) / total
    m2 = sum(p[2] for p in parts)
    for p in parts:
        d = p[1] - mean
        m2 += p[0] * (d * d)
    std = math.sqrt(max(m2 / total, 0.0)) if m2 == m2 else math.nan
    mx = max(p[3] for p in parts)
    mn = min(p[5] for p in parts)
    argmax = min(p[4] for p in parts if p[3] == mx)
    argmin = min(p[6] for p in parts if p[5] == mn)
    if mx == mn:  # a constant stays a constant, exactly
        mean, std = mx, 0.0
    return [mean, mx, mn, std], [argmax, argmin, -1]


def combine(
    names: tuple[str, ...],
    dtypes: tuple[Any, ...],
    everyone: dict[int, list[Partial | None]],
    arrival: tuple[str, str] | None,
    unit: float,
    same_prefix: str,
    lags_key: str,
    straggler: tuple[str, str],
) -> Combined:
    """One update's statistics from every process's partials of ``names``
    (sorted; ``dtypes`` the dtype each statistic comes in): the statistics of
    every name but the arrival times and checksums, the straggler values
    (``{}`` without ``arrival``) and whether each checksum differs."""
    columns, where, checks, arrivals = [], [], [], {}
    kept = []
    for j, name in enumerate(names):
        parts = [ps[j] for ps in everyone.values() if ps[j] is not None]
        if arrival is not None and name in arrival:
            for process, ps in everyone.items():
                if ps[j] is not None:
                    arrivals.setdefault(process, [0.0, 0.0])[arrival.index(name)] = ps[
                        j
                    ][1]
            continue
        stats, devices = _combined(parts)
        if name.startswith(same_prefix):
            checks.append(stats[1] != stats[2])
            continue
        kept.append(j)
        columns.append(stats)
        where.append(devices)
    dtype = np.result_type(np.float32, *(dtypes[j] for j in kept))
    table = np.asarray(columns, np.float64).reshape(-1, len(STATS)).T.astype(dtype)
    provenance = np.asarray(where, np.int32).reshape(-1, len(PROVENANCE)).T
    stats = Stats(tuple(names[j] for j in kept), table, provenance)
    found = {}
    if arrivals:
        procs = sorted(arrivals)
        hi = np.asarray([arrivals[p][0] for p in procs])
        lo = np.asarray([arrivals[p][1] for p in procs])
        times = (hi - hi.min()) * unit + lo
        lags = (times - np.median(times)).astype(np.result_type(np.float32, *dtypes))
        last = int(np.argmax(times))
        found = {
            straggler[0]: np.int32(procs[last]),
            straggler[1]: lags[last],
            lags_key: lags,
        }
    differs = np.asarray(checks, bool) if checks else None
    return stats, found, differs


def result_dtype(value: Any) -> Any:
    """The dtype a value's statistics come in: its accumulation dtype (a host
    scalar: float64 where JAX computes in it, float32 otherwise)."""
    if isinstance(value, jax.Array):
        return np.dtype(acc_dtype(value.dtype))
    return np.dtype(np.float64 if jax.config.jax_enable_x64 else np.float32)


def _let_others_run() -> None:
    """Sleeps a moment, between pieces of work of a tenth of a millisecond or
    so. A thread waiting for the GIL otherwise waits for the interpreter's
    switch interval (5 ms, and ``time.sleep(0)`` does not hand it over): the
    training thread must never wait that long for this one."""
    time.sleep(YIELD_S)


class HostBatch:
    """One batch reduced on the background thread: ``result()`` waits for it.

    Args:
        updates: ``(step, time, items)`` per update, ``items`` sorted by name.
        key: the batch's key prefix in the store, the same on every process.
        previous: the batch before (this one waits for it), or None.
        client: the distributed runtime's client.
        current: whether ``client`` is still the runtime's (False once it
            was shut down: the thread stops waiting then).
        combine_update: ``combine_update(items, everyone)`` -> the update's
            :data:`Combined`.
        mesh: the mesh whose devices count a host scalar.

    Batches go to one thread per process, which starts with the first and
    ends when it has had nothing to do for :data:`IDLE_S`: starting a thread
    waits for it to be scheduled, milliseconds on busy cores, where handing
    it a batch does not wait.
    """

    def __init__(
        self,
        updates: list[tuple[int, float, list]],
        key: str,
        previous: HostBatch | None,
        client: Any,
        current: Callable[[], bool],
        combine_update: Callable[[list, dict], Combined],
        mesh: jax.sharding.Mesh,
    ):
        self.updates = updates
        self.key = key
        self._previous = previous
        self._client = client
        self._current = current
        self._combine = combine_update
        self._mesh = mesh
        self._done = threading.Event()
        self._result: list[Combined] | None = None
        self._error: BaseException | None = None
        _submit(self)

    def result(self) -> list[Combined]:
        """Each update's statistics, straggler values and checksum results
        (waits for every process to post the batch); raises what the thread
        met."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _run(self) -> None:
        try:
            previous, self._previous = self._previous, None
            if previous is not None:
                previous._done.wait()
            self._result = self._reduce(previous)
        except BaseException as err:  # the training thread raises it at collect
            self._error = err
        finally:
            self._done.set()

    def _reduce(self, previous: HostBatch | None) -> list[Combined]:
        me, index = jax.process_index(), global_index()
        mine = [d for d in self._mesh.devices.flat if d.process_index == me]
        holder = min((index[d.id] for d in mine), default=-1)
        posts = []
        for _, _, items in self.updates:
            posts.append(partials(items, len(mine), holder, index))
            _let_others_run()
        client = self._client
        client.key_value_set(f"{self.key}/{me}", json.dumps(posts))
        everyone = {me: posts}
        for other in sorted({d.process_index for d in self._mesh.devices.flat}):
            if other != me:
                everyone[other] = json.loads(self._read(f"{self.key}/{other}"))
        if previous is not None:  # every process has read it: posted this one
            # a store that refuses keeps two posts per process: harmless
            with contextlib.suppress(Exception):
                client.key_value_delete(f"{previous.key}/{me}")
        results = []
        for u, (_, _, items) in enumerate(self.updates):
            results.append(
                self._combine(items, {p: ps[u] for p, ps in everyone.items()})
            )
            _let_others_run()
        return results

    def _read(self, key: str) -> str:
        """Waits for ``key`` while the runtime lasts (a process left behind
        is the hang watch's to name, as a device reduction would wait too)."""
        while True:
            if not self._current():
                raise RuntimeError(
                    "the distributed runtime was shut down before every process "
                    f"sent its values for History's batch ({key})"
                )
            try:
                return self._client.blocking_key_value_get(key, int(POLL_S * 1000))
            except Exception as err:
                if "DEADLINE_EXCEEDED" not in str(err) and "eadline" not in str(err):
                    raise


_QUEUE: queue.SimpleQueue[HostBatch] = queue.SimpleQueue()
_WORKER: list[threading.Thread] = []  # the thread, while it runs
_WORKER_LOCK = threading.Lock()
IDLE_S = 30.0  # the thread ends after this long without a batch


def _submit(batch: HostBatch) -> None:
    """Hands ``batch`` to the background thread (started if none runs)."""
    with _WORKER_LOCK:
        _QUEUE.put(batch)
        if not (_WORKER and _WORKER[0].is_alive()):
            thread = threading.Thread(
                target=_work, name="jaxhistory-batches", daemon=True
            )
            _WORKER[:] = [thread]
            thread.start()


def _work() -> None:
    """The background thread: runs batches in the order they came."""
    me = threading.current_thread()
    while True:
        try:
            batch = _QUEUE.get(timeout=IDLE_S)
        except queue.Empty:
            with _WORKER_LOCK:  # nothing came: end, unless one comes now
                if _QUEUE.empty():
                    if _WORKER and _WORKER[0] is me:
                        _WORKER.clear()
                    return
            continue
        batch._run()
