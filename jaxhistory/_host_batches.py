"""Batches of a multi-process History's values, reduced on the host.

With ``log_every`` > 1, the values a multi-process History reduces across
devices and processes (per-device arrays, host scalars, arrival times and
checksums) wait in a batch. A device program could reduce the batch, but on
XLA's CPU client launching a program on every device waits for the step before
it: the training thread would lose most of a step at every batch.

So a batch is reduced here instead, on a background thread, with no device
program. Each process sums up what its own devices hold of each value (count,
mean, squared deviations, max and min with the lowest device holding them, the
lowest device holding a NaN) and posts that to the distributed runtime's
key-value store; process 0 reads every post, combines them in float64 and
posts the result, which the others read (O(P) bytes through the store for P
processes, and the same numbers on every process). The statistics and their
provenance are those of :func:`jaxhistory._stats.global_stats` (where every
element counts once, at the lowest device holding it); the statistics are
float64 sums rounded to the result's dtype, not float32 sums, so they can
differ from the device reduction's in the last bit.

Batches are reduced one after another, on one thread per process: a process
posts batch ``n`` only after reading the result of batch ``n - 1``. Batches
are kept in the store in groups of :data:`GROUP` (under one key each,
:func:`batch_key`): once process 0 has read every post of the first batch of
a group, every process has read every result of the group before, and
process 0 deletes that group's keys (every post and result of its batches)
in one call. A batch whose posts and result came to more than
:data:`KEEP_BYTES` is deleted on its own at the next batch, so the store
holds at most two such batches, as well as the small ones of two groups. At
two processes a batch takes two calls to the store on every process (process
1: its post and reading the result; process 0: reading that post and posting
the result), plus one call on process 0 every ``GROUP`` batches (or the next
batch, for a large one). The caller keeps at most two batches in flight.
"""

from __future__ import annotations

import atexit
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

from jaxhistory._provenance import concrete_layout, global_index
from jaxhistory._stats import Stats
from jaxhistory._tree import acc_dtype

__all__ = [
    "FIELDS",
    "GROUP",
    "KEEP_BYTES",
    "Combined",
    "Exiting",
    "HostBatch",
    "batch_key",
    "combine",
    "of_rows",
    "of_values",
    "pack",
    "partials",
    "result_dtype",
    "results",
    "stop_worker",
    "unpack",
]

YIELD_S = 5e-5  # the pause between pieces of work (see _let_others_run)
POLL_S = 1.0  # how long one read of the store waits before checking for exit
LEADER = 0  # the process that combines every batch
GROUP = 8  # batches whose keys go in one delete (see the module's notes)
KEEP_BYTES = 256 << 10  # a batch larger than this (every post and the result)
# is deleted on its own at the next batch, not with its group

# What one process holds of one value at each of a batch's U updates: a
# float64 (8, U) array, in this order (device indices as floats, exact):
FIELDS = ("count", "mean", "m2", "max", "argmax", "min", "argmin", "nan_device")
COUNT, MEAN, M2, MAX, ARGMAX, MIN, ARGMIN, NAN_DEVICE = range(len(FIELDS))
# One update combined: its statistics, its straggler values, and whether each
# checksum differs across processes (None without checksums)
Combined = tuple[Stats, dict, Any]
NO_DEVICE = float(2**31 - 1)  # larger than any device index
_KINDS = "biuf"  # what a batch result holds: bools, integers, floats


def _empty(updates: int) -> np.ndarray:
    """The partial of nothing held (it changes no combination)."""
    part = np.zeros((len(FIELDS), updates))
    part[MAX], part[MIN] = -np.inf, np.inf
    part[[ARGMAX, ARGMIN]] = NO_DEVICE
    part[NAN_DEVICE] = -1
    return part


def of_rows(x: np.ndarray, devices: np.ndarray, ordered: bool = False) -> np.ndarray:
    """The ``(8, U)`` partial of ``U`` rows of values ``x`` (``(U, m)``,
    float64), the ``m`` values of each row held by ``devices`` (``(m,)``;
    ``ordered``: in increasing order, which lets a row's first maximum and
    minimum name the lowest device holding them)."""
    updates, m = x.shape
    if m == 0:
        return _empty(updates)
    part = np.empty((len(FIELDS), updates))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf pass on
        part[COUNT] = m
        part[MEAN] = mean = x.mean(axis=1)
        part[M2] = np.square(x - mean[:, None]).sum(axis=1)
        nan = np.isnan(x)
        if ordered and not nan.any():  # the first extreme is at the lowest device
            part[NAN_DEVICE] = -1
            part[MAX] = x.max(axis=1)
            part[ARGMAX] = devices[x.argmax(axis=1)]
            part[MIN] = x.min(axis=1)
            part[ARGMIN] = devices[x.argmin(axis=1)]
            return part
        held = devices.astype(np.float64)[None]
        part[NAN_DEVICE] = np.where(
            nan.any(axis=1), np.where(nan, held, NO_DEVICE).min(axis=1), -1
        )
        high = np.where(nan, -np.inf, x)
        part[MAX] = top = high.max(axis=1)
        part[ARGMAX] = np.where(high == top[:, None], held, NO_DEVICE).min(axis=1)
        low = np.where(nan, np.inf, x)
        part[MIN] = bottom = low.min(axis=1)
        part[ARGMIN] = np.where(low == bottom[:, None], held, NO_DEVICE).min(axis=1)
    return part


def of_values(x: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """The ``(8, 1)`` partial of values ``x`` held by ``devices`` (one each)."""
    return of_rows(np.asarray(x, np.float64)[None], np.asarray(devices))


def _owned(value: jax.Array, index: dict[int, int]) -> list[tuple[Any, Any, int]]:
    """For each of this process's shards of ``value`` that holds elements
    counted here (those whose lowest holding device is the shard's): its
    position among the addressable shards, which of its elements count (None:
    all of them) and that device, in the order of the devices. Kept for the
    latest layout (every update of a name has the same)."""
    sharding, shape = value.sharding, value.shape
    last = _OWNED[0]
    if (
        last is not None
        and last[0] is sharding
        and last[1] == shape
        and (last[2] is index or last[2] == index)
    ):
        return last[3]
    layout = concrete_layout(sharding, shape)
    out = []
    for k, shard in enumerate(value.addressable_shards):
        device = index[shard.device.id]
        owned = layout.holders[layout.rank[shard.index]] == device
        if owned.any():
            out.append((k, None if owned.all() else owned, device))
    out.sort(key=lambda entry: entry[2])
    _OWNED[0] = (sharding, shape, index, out)
    return out


# (sharding, shape, device index, _owned's answer) of the latest layout read
_OWNED: list[tuple | None] = [None]


def _of_arrays(values: list[jax.Array], index: dict[int, int]) -> np.ndarray:
    """The partial of a batch's arrays of one name (each waited for): the
    elements of each whose lowest holding device is one of this process's."""
    first = values[0]
    sharding, shape = first.sharding, first.shape
    if all(
        v.shape == shape and (v.sharding is sharding or v.sharding == sharding)
        for v in values[1:]
    ):  # one layout: all rows at once, a shard's rows in one block
        owned = _owned(first, index)
        if not owned:
            return _empty(len(values))
        count, blocks = len(values), []
        for k, mask, _ in owned:
            # addressable_data(k) is addressable_shards[k].data without making
            # every Shard (their indices): a third of the reading's time
            block = np.stack([np.asarray(v.addressable_data(k)) for v in values])
            blocks.append(block.reshape(count, -1) if mask is None else block[:, mask])
        x = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
        devices = np.concatenate(
            [np.full(b.shape[1], d) for b, (_, _, d) in zip(blocks, owned, strict=True)]
        )
        return of_rows(x.astype(np.float64), devices, ordered=True)
    return np.concatenate([_of_arrays([v], index) for v in values], axis=1)


def partials(
    updates: list[list[tuple[str, Any]]],
    weight: int,
    holder: int,
    index: dict[int, int],
) -> np.ndarray:
    """This process's ``(K, 8, U)`` partials of a batch's ``U`` updates, whose
    items are ``K`` values under the same names (sorted): a JAX array's from
    its own devices' shards, a host scalar as ``weight`` values (this
    process's devices in the mesh) held by device ``holder``."""
    count = len(updates)
    out = np.empty((len(updates[0]), len(FIELDS), count))
    host = []  # the host scalars' positions: their partials in one pass
    for j, (_, first) in enumerate(updates[0]):
        if isinstance(first, jax.Array):
            out[j] = _of_arrays([items[j][1] for items in updates], index)
        else:
            host.append(j)
    if not host:
        return out
    if weight == 0:
        out[host] = _empty(count)
        return out
    v = np.asarray([[float(items[j][1]) for j in host] for items in updates]).T
    nan = np.isnan(v)  # (H, U), as every field below
    part = np.empty((len(FIELDS), *v.shape))
    part[COUNT] = weight
    part[MEAN] = v
    part[M2] = np.where(np.isinf(v), np.nan, 0.0)  # inf: as the device sum gives
    part[MAX] = np.where(nan, -np.inf, v)
    part[MIN] = np.where(nan, np.inf, v)
    part[[ARGMAX, ARGMIN]] = np.where(nan, NO_DEVICE, holder)
    part[NAN_DEVICE] = np.where(nan, holder, -1)
    out[host] = part.transpose(1, 0, 2)
    return out


def _combined(parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``(K, 4, U)`` statistics (STATS order) and ``(K, 3, U)`` provenance
    (PROVENANCE order) from every process's partials, ``(P, K, 8, U)``."""
    n, means = parts[:, :, COUNT], parts[:, :, MEAN]
    everyone_holds = bool((n > 0).all())
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        total = n.sum(axis=0)
        if everyone_holds:
            mean = (n * means).sum(axis=0) / total
            spread = (n * np.square(means - mean)).sum(axis=0)
        else:
            mean = np.where(n > 0, n * means, 0).sum(axis=0) / total
            spread = np.where(n > 0, n * np.square(means - mean), 0).sum(axis=0)
        std = np.sqrt(np.maximum((parts[:, :, M2].sum(axis=0) + spread) / total, 0))
    top, bottom = parts[:, :, MAX].max(axis=0), parts[:, :, MIN].min(axis=0)
    argmax = np.where(parts[:, :, MAX] == top, parts[:, :, ARGMAX], NO_DEVICE)
    argmin = np.where(parts[:, :, MIN] == bottom, parts[:, :, ARGMIN], NO_DEVICE)
    same = top == bottom  # a constant stays a constant, exactly
    stats = np.stack(
        [np.where(same, top, mean), top, bottom, np.where(same, 0.0, std)], axis=1
    )
    nans = parts[:, :, NAN_DEVICE]
    if not (nans >= 0).any():  # no NaN anywhere
        where = np.stack(
            [argmax.min(axis=0), argmin.min(axis=0), np.full_like(top, -1)], axis=1
        )
        return stats, where.astype(np.int32)
    nan_device = np.where(nans >= 0, nans, NO_DEVICE).min(axis=0)
    has_nan = nan_device < NO_DEVICE
    stats[np.broadcast_to(has_nan[:, None], stats.shape)] = np.nan
    nan_device = np.where(has_nan, nan_device, -1)
    where = np.stack(
        [
            np.where(has_nan, nan_device, argmax.min(axis=0)),
            np.where(has_nan, nan_device, argmin.min(axis=0)),
            nan_device,
        ],
        axis=1,
    )
    return stats, where.astype(np.int32)


def _kept(
    names: tuple[str, ...], arrival: tuple[str, str] | None, same_prefix: str
) -> tuple[list[int], list[int]]:
    """The positions among ``names`` of the values recorded (all but the
    arrival times and checksums) and of the checksums."""
    picks = set(arrival) if arrival is not None else set()
    checks = [j for j, n in enumerate(names) if n.startswith(same_prefix)]
    kept = [
        j
        for j, n in enumerate(names)
        if n not in picks and not n.startswith(same_prefix)
    ]
    return kept, checks


def combine(
    names: tuple[str, ...],
    dtypes: tuple[Any, ...],
    everyone: dict[int, np.ndarray],
    arrival: tuple[str, str] | None,
    unit: float,
    same_prefix: str,
) -> dict[str, np.ndarray]:
    """A batch's statistics from every process's ``(K, 8, U)`` partials of
    ``names`` (sorted; ``dtypes`` the dtype each statistic comes in), as
    arrays (what :func:`results` splits into updates): ``table`` (U, 4, K')
    and ``where`` (U, 3, K') of every name but the arrival times and
    checksums, ``differs`` (U, C) of the checksums, and with ``arrival``
    ``lags`` (U, P') of the P' processes ``ids`` and the ``last`` (U,) to
    arrive."""
    procs = sorted(everyone)
    parts = np.stack([everyone[p] for p in procs])
    stats, where = _combined(parts)
    kept, checks = _kept(names, arrival, same_prefix)
    dtype = np.result_type(np.float32, *(dtypes[j] for j in kept))
    out = {
        "table": stats[kept].transpose(2, 1, 0).astype(dtype),
        "where": where[kept].transpose(2, 1, 0),
        "differs": (stats[checks, 1] != stats[checks, 2]).T,
    }
    if arrival is not None:
        hi, lo = (parts[:, names.index(a)] for a in arrival)
        holds = hi[:, COUNT, 0] > 0  # the processes in the mesh
        hi, lo = hi[holds, MEAN], lo[holds, MEAN]  # (P', U)
        times = (hi - hi.min(axis=0)) * unit + lo
        lags = times - _median(times)
        out["lags"] = lags.T.astype(np.result_type(np.float32, *dtypes))
        out["ids"] = np.asarray(procs, np.int32)[holds]
        out["last"] = np.argmax(times, axis=0)
    return out


def _median(x: np.ndarray) -> np.ndarray:
    """``np.median(x, axis=0)``, the same numbers at a fraction of its
    time on the few rows of a batch (NaN where a column has one)."""
    if np.isnan(x).any():
        return np.median(x, axis=0)
    ordered = np.sort(x, axis=0)
    half = len(x) // 2
    if len(x) % 2:
        return ordered[half]
    return (ordered[half - 1] + ordered[half]) / 2


def results(
    names: tuple[str, ...],
    arrays: dict[str, np.ndarray],
    arrival: tuple[str, str] | None,
    same_prefix: str,
    lags_key: str,
    straggler: tuple[str, str],
) -> list[Combined]:
    """Each update's statistics, straggler values (``{}`` without
    ``arrival``) and checksum results (None without checksums) from what
    :func:`combine` gave."""
    kept, checks = _kept(names, arrival, same_prefix)
    kept_names = tuple(names[j] for j in kept)
    table, where, differs = arrays["table"], arrays["where"], arrays["differs"]
    out = []
    for u in range(table.shape[0]):
        extra = {}
        if arrival is not None:
            lags, last = arrays["lags"][u], int(arrays["last"][u])
            extra = {
                straggler[0]: arrays["ids"][last],
                straggler[1]: lags[last],
                lags_key: lags,
            }
        found = differs[u] if checks else None
        out.append((Stats(kept_names, table[u], where[u]), extra, found))
    return out


_HEAD = 4  # bytes of the header's length, little-endian


def pack(arrays: dict[str, np.ndarray]) -> bytes:
    """What :func:`combine` gave, as bytes for the key-value store: a JSON
    header (each array's name, dtype and shape), then the arrays' bytes in
    that order. (``np.savez`` took 250 µs to write and 670 µs to read such a
    result, a fifth of a batch's time on the thread.)"""
    spec, parts = [], []
    for name, value in arrays.items():
        arr = np.asarray(value)
        if arr.dtype.kind not in _KINDS:
            raise TypeError(f"batch result {name!r} is not numeric ({arr.dtype})")
        spec.append([name, arr.dtype.str, list(arr.shape)])
        parts.append(arr.tobytes())
    header = json.dumps(spec).encode()
    return b"".join([len(header).to_bytes(_HEAD, "little"), header, *parts])


def unpack(raw: bytes) -> dict[str, np.ndarray]:
    """:func:`pack`'s arrays back (writable); ValueError for bytes that are
    not a batch result."""
    try:
        n = int.from_bytes(raw[:_HEAD], "little")
        spec = json.loads(raw[_HEAD : _HEAD + n]) if len(raw) >= _HEAD + n else None
        at, out = _HEAD + n, {}
        # spec None (a short header): its TypeError is reported below
        for name, dtype, shape in spec:  # type: ignore[union-attr]
            dtype = np.dtype(dtype)
            if dtype.kind not in _KINDS or not all(d >= 0 for d in shape):
                raise ValueError(f"{name!r}: {dtype}, shape {shape}")
            size = dtype.itemsize * math.prod(shape)
            if at + size > len(raw):
                raise ValueError(f"{name!r} is cut off")
            flat = np.frombuffer(raw, dtype, math.prod(shape), at)
            out[name] = flat.reshape(shape).copy()
            at += size
        if at != len(raw):
            raise ValueError(f"{len(raw) - at} bytes after the arrays")
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(
            f"not a batch result from the key-value store: {err}"
        ) from None
    return out


def result_dtype(value: Any) -> Any:
    """The dtype a value's statistics come in: its accumulation dtype (a host
    scalar: float64 where JAX computes in it, float32 otherwise)."""
    if isinstance(value, jax.Array):
        return np.dtype(acc_dtype(value.dtype))
    # jax's Config declares no attribute per option
    return np.dtype(np.float64 if jax.config.jax_enable_x64 else np.float32)  # type: ignore[attr-defined]


def batch_key(prefix: str, n: int) -> tuple[str, str | None]:
    """The key of batch ``n`` (from 0) under ``prefix``, and the keys
    process 0 deletes once every process has posted it: the group before,
    at the first batch of a group (None otherwise)."""
    group, place = divmod(n, GROUP)
    drop = f"{prefix}/group{group - 1}" if place == 0 and group > 0 else None
    return f"{prefix}/group{group}/batch{n}", drop


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
        drop: the keys process 0 deletes (the group before:
            :func:`batch_key`) once every process has posted this batch, or
            None. Batches run in order, on one thread.
        client: the distributed runtime's client.
        current: whether ``client`` is still the runtime's (False once it
            was shut down: the thread stops waiting then).
        combine_batch: ``combine_batch(items, everyone)`` -> the arrays of
            :func:`combine`, from the first update's items and every
            process's partials (run by process 0).
        split_batch: ``split_batch(items, arrays)`` -> each update's
            :data:`Combined` (:func:`results`).
        mesh: the mesh whose devices count a host scalar.
        previous: the batch before, or None: process 0 deletes its keys once
            every process has posted this batch where they came to more than
            :data:`KEEP_BYTES` (and it is not in the group ``drop`` names).

    Batches go to one thread per process, which starts with the first and
    ends when it has had nothing to do for :data:`IDLE_S`: starting a thread
    waits for it to be scheduled, milliseconds on busy cores, where handing
    it a batch does not wait.
    """

    def __init__(
        self,
        updates: list[tuple[int, float, list]],
        key: str,
        drop: str | None,
        client: Any,
        current: Callable[[], bool],
        combine_batch: Callable[[list, dict], dict],
        split_batch: Callable[[list, dict], list[Combined]],
        mesh: jax.sharding.Mesh,
        previous: HostBatch | None = None,
    ):
        self.updates = updates
        self.key = key
        self._drop = drop
        self.size = 0  # (process 0) the bytes of every post and the result
        self._previous = previous  # read (and let go) when this batch runs
        self._client = client
        self._current = current
        self._combine = combine_batch
        self._results = split_batch
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

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._done.set()

    def _run(self) -> None:
        try:
            self._result = self._reduce()
        except BaseException as err:  # the training thread raises it at collect
            self._error = err
        finally:
            self._done.set()

    def _reduce(self) -> list[Combined]:
        """Process 0 reads every other process's partials, combines them and
        posts the result; the others post theirs and read it: the store
        carries O(P) bytes a batch, not every process's posts to every
        process."""
        # the batch before ran earlier on this thread: its size is known
        previous, self._previous = self._previous, None
        me, index = jax.process_index(), global_index()
        mine = [d for d in self._mesh.devices.flat if d.process_index == me]
        holder = min((index[d.id] for d in mine), default=-1)
        items = [items for _, _, items in self.updates]
        steps = np.asarray([step for step, _, _ in self.updates], np.int64)
        if items:
            posted = partials(items, len(mine), holder, index)
        else:  # a process with nothing left at close still posts, so that
            posted = np.zeros((0, len(FIELDS), 0))  # the others' extra steps show
        client, result = self._client, f"{self.key}/result"
        if me != LEADER:
            mine_post = pack({"parts": posted, "steps": steps})
            client.key_value_set_bytes(f"{self.key}/{me}", mine_post)
            _let_others_run()
            arrays = unpack(self._read(result))
            _check_alike(arrays)
            return self._results(items[0], arrays) if items else []
        everyone, their_steps, size = {me: posted}, {me: steps}, 0
        for other in range(jax.process_count()):
            if other != me:
                _let_others_run()
                raw = self._read(f"{self.key}/{other}")
                size += len(raw)
                theirs = unpack(raw)
                everyone[other], their_steps[other] = theirs["parts"], theirs["steps"]
        # Every process posted this batch, so has read every result before
        # it: the batch before's keys where they are large, and the group
        # before's (posts and results), each in one call. A store that
        # refuses keeps them: harmless.
        drop, drop_before = self._drop, None
        if previous is not None and previous.size > KEEP_BYTES:
            in_drop = drop is not None and previous.key.startswith(f"{drop}/")
            drop_before = None if in_drop else previous.key  # (else: its group's)
        for key in (drop_before, drop):
            if key is not None:
                with contextlib.suppress(Exception):
                    client.key_value_delete(key)
        _let_others_run()
        alike = all(
            np.array_equal(their_steps[p], steps) and everyone[p].shape == posted.shape
            for p in everyone
        )
        if not alike:  # every process raises, naming each one's steps
            arrays = {f"steps/{p}": s for p, s in sorted(their_steps.items())}
        elif not items:
            arrays = {}
        else:
            arrays = self._combine(items[0], everyone)
        raw = pack(arrays)
        client.key_value_set_bytes(result, raw)
        self.size = size + len(raw)
        _check_alike(arrays)
        return self._results(items[0], arrays) if items else []

    def _read(self, key: str) -> bytes:
        """Waits for ``key`` while the runtime lasts (a process left behind
        is the hang watch's to name, as a device reduction would wait too)."""
        while True:
            if _EXITING.is_set():
                raise Exiting(f"the process is exiting ({key})")
            if not self._current():
                raise RuntimeError(
                    "the distributed runtime was shut down before every process "
                    f"sent its values for History's batch ({key})"
                )
            try:
                return self._client.blocking_key_value_get_bytes(
                    key, int(POLL_S * 1000)
                )
            except Exception as err:
                if "DEADLINE_EXCEEDED" not in str(err) and "eadline" not in str(err):
                    raise


def _check_alike(arrays: dict[str, np.ndarray]) -> None:
    """Raises ValueError when the leader found that the processes posted
    different updates (or different values) for one batch: their steps are
    then all the result holds."""
    posts = {k: v for k, v in arrays.items() if k.startswith("steps/")}
    if not posts:
        return
    each = "; ".join(
        f"process {key.removeprefix('steps/')} at steps {_steps_text(steps)}"
        for key, steps in sorted(posts.items(), key=lambda kv: int(kv[0][6:]))
    )
    raise ValueError(
        "the processes recorded different updates for one batch of History's "
        f"log_every reduction: {each}. With distributed history every process "
        "must call History.update for the same steps with the same metric names, "
        "and close or finalize at the same point"
    )


def _steps_text(steps: np.ndarray) -> str:
    """Steps as a list, the middle of a long one left out."""
    shown = [int(s) for s in steps]
    if len(shown) <= 8:
        return str(shown)
    return f"[{shown[0]}, {shown[1]}, ..., {shown[-1]}] ({len(shown)} updates)"


_QUEUE: queue.SimpleQueue[HostBatch] = queue.SimpleQueue()
_WORKER: list[threading.Thread] = []  # the thread, while it runs
_WORKER_LOCK = threading.Lock()
_EXITING = threading.Event()  # set at interpreter exit: the thread ends
_AT_EXIT: list[bool] = []  # whether stop_worker is registered
IDLE_S = 30.0  # the thread ends after this long without a batch


class Exiting(RuntimeError):
    """What a batch raises when the process exits before it was reduced."""


def _submit(batch: HostBatch) -> None:
    """Hands ``batch`` to the background thread (started if none runs)."""
    with _WORKER_LOCK:
        if _EXITING.is_set():
            batch._fail(Exiting("the process is exiting"))
            return
        _QUEUE.put(batch)
        if not (_WORKER and _WORKER[0].is_alive()):
            thread = threading.Thread(
                target=_work, name="jaxhistory-batches", daemon=True
            )
            _WORKER[:] = [thread]
            if not _AT_EXIT:
                # Registered after jax.distributed.initialize: runs before the
                # runtime's own shutdown, and before daemon threads end.
                atexit.register(stop_worker)
                _AT_EXIT.append(True)
            thread.start()


def stop_worker() -> None:
    """Ends the background thread, waiting for it at most :data:`POLL_S` and
    a second; batches not reduced yet fail with :class:`Exiting`.

    Runs at exit, before the interpreter ends its daemon threads: a thread
    ended while inside the distributed runtime's client (native code) aborts
    the process ("exception not rethrown").
    """
    _EXITING.set()
    with _WORKER_LOCK:
        thread = _WORKER[0] if _WORKER else None
    if thread is not None and thread is not threading.current_thread():
        thread.join(POLL_S + 1.0)
    while True:
        try:
            _QUEUE.get_nowait()._fail(Exiting("the process is exiting"))
        except queue.Empty:
            return


def _work() -> None:
    """The background thread: runs batches in the order they came."""
    me, last = threading.current_thread(), time.monotonic()
    while not _EXITING.is_set():
        try:
            batch = _QUEUE.get(timeout=POLL_S)  # short: sees the exit soon
        except queue.Empty:
            with _WORKER_LOCK:  # nothing came for long: end, unless one comes now
                if _QUEUE.empty() and time.monotonic() - last > IDLE_S:
                    if _WORKER and _WORKER[0] is me:
                        _WORKER.clear()
                    return
            continue
        batch._run()
        last = time.monotonic()
