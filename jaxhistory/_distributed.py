"""History's distributed reduction: per-device values (and, with several
processes, per-process host scalars) become ``name/{mean,max,min,std}`` across
all devices or processes, in one fused jitted call per update (with several
processes and ``log_every`` > 1: per batch of updates, on the host, in
:mod:`jaxhistory._host_batches`)."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import threading
import time
import warnings
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhistory._env import env_flag
from jaxhistory._host_batches import (
    Combined,
    HostBatch,
    batch_key,
    combine,
    result_dtype,
    results,
)
from jaxhistory._names import COUNTER_KEYS
from jaxhistory._provenance import Layout, check_provenance, concrete_layout
from jaxhistory._row import Row, RowKind
from jaxhistory._stats import Stats, global_stats
from jaxhistory._tree import flatten_metrics

__all__ = [
    "ARRIVAL",
    "BATCH_MAX",
    "BATCH_VALUES",
    "SAME",
    "STRAGGLER",
    "Reducer",
    "agreed_run_id",
    "client_is_current",
    "distributed_client",
    "distributed_default",
    "is_per_device",
    "mesh_of",
]

NAMES_TIMEOUT_S = 120.0  # how long processes wait for each other's metric names
RUN_ID_TIMEOUT_S = 30.0  # how long a process waits to read the job's run id
_RUN_IDS: dict[str | None, int] = {}  # run name -> Histories made with it here
_RUN_IDS_LOCK = threading.Lock()
_REDUCERS = itertools.count()  # numbers History instances alike in every process
_OFF_VARS = ("JAXHISTORY_NO_DISTRIBUTED_HISTORY", "JAXHISTORY_LOCAL_HISTORY")
# With several processes: the wall-clock time at which each process reached the
# update (two host scalars reduced with the others, never recorded themselves:
# seconds // 1024 and the rest, exact in float32) gives the last process to
# arrive and its lag behind the median process.
ARRIVAL = ("straggler/arrival_hi", "straggler/arrival_lo")
ARRIVAL_UNIT = 1024.0
STRAGGLER = ("straggler/process", "straggler/lag")
# With several processes, a value recorded as it is (not reduced) must be the
# same on every process: a checksum of it rides in the reduction as a host
# scalar under this prefix (never recorded), and differs -> max != min.
SAME = "\x00same/"
LAGS = "\x00lags"  # each process's arrival lag (not recorded as such)
SAME_WINDOW = 8  # updates later the checksums are read (all processes alike)
BATCH_MAX = 64  # updates a batch of values to reduce holds at most
# values (updates x names) a batch holds at most: each process posts 64 bytes
# a value to the key-value store, so at most 1 MiB a batch
BATCH_VALUES = 16_384
# What Reducer.split makes of a value
_PLAIN, _REDUCED, _CHECKED = object(), object(), object()
_ARRAY_OR_STATS = (jax.Array, Stats)


def distributed_default() -> bool:
    """Whether distributed history is on when not set explicitly.

    Off when ``JAXHISTORY_NO_DISTRIBUTED_HISTORY`` or ``JAXHISTORY_LOCAL_HISTORY``
    is 1/true/yes; on otherwise, on any number of devices (above
    ``GATHER_DEVICES`` holder devices the reduction's all-reduce bytes no longer
    grow with the device count).

    Examples:
        >>> import jaxhistory as jh
        >>> jh.distributed_default()  # 8 devices here, no variable set
        True
    """
    return not any(env_flag(v) for v in _OFF_VARS)


def is_per_device(value: Any) -> bool:
    """A JAX array that holds different values on different devices; on a mesh
    of one device, one whose sharding names a mesh axis (``per_shard``'s
    ``(1,)``), so that a run on one device records the names it records on
    many."""
    if not isinstance(value, jax.Array) or value.ndim < 1:
        return False
    sharding = value.sharding
    if not sharding.is_fully_replicated:
        return True
    return (
        isinstance(sharding, jax.sharding.NamedSharding)
        and sharding.mesh.size == 1
        and any(axes is not None for axes in sharding.spec)
    )


def mesh_of(values: Any) -> jax.sharding.Mesh | None:
    """The mesh of the first value in ``values`` sharded over more than one
    device (of a :class:`~jaxhistory.Stats`, its table's), or None."""
    for value in values:
        array = value.table if isinstance(value, Stats) else value
        mesh = getattr(getattr(array, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1:
            return mesh
    return None


class Reducer:
    """Splits an update's values into those recorded as they are and those
    reduced across devices (and processes), and reduces the latter.

    Statistics come with provenance (which device holds each max, min and
    NaN): the layouts are read from the concrete arrays, so this works on any
    mesh, Auto axes included. With several processes, the time each process
    reached the update rides along in the same all-reduce and comes back
    as :data:`STRAGGLER`: arrival, not time between updates, because a
    synchronous step makes every process's time between updates the same
    (the fast ones wait for the slow one), while the slow one still arrives
    last.
    """

    def __init__(self, provenance: bool = True):
        self.multi_process = jax.process_count() > 1
        self.provenance = check_provenance(provenance, "History")
        self._fns: dict[tuple, Any] = {}  # jitted reductions per set of layouts
        self._id = next(_REDUCERS)
        self._agreed: set[tuple[str, ...]] = set()  # name sets all processes use
        # name -> (the sharding and type of its latest JAX array, what split
        # made of it)
        self._kinds: dict[str, tuple[Any, type, object]] = {}
        # (rounds of names agreed, the names, the step) of the latest reduction:
        # read by the hang watch's thread to answer a process whose names changed
        self.latest: tuple[int, tuple[str, ...], int] | None = None
        self._answered: set[int] = set()
        # (step, names, whether each differs across processes) per update, read
        # SAME_WINDOW updates later: at the same update on every process
        self._same: collections.deque = collections.deque()
        # (step, time, each process's arrival lag, the processes) per update
        # reduced and not yet taken by History's straggler scores
        self.lags: list[tuple[int, float, Any, tuple[int, ...]]] = []
        self._batch: list[tuple[int, float, list]] = []  # (step, time, items)
        self._batch_names: tuple[str, ...] = ()
        self._inflight: list[tuple] = []  # batches started, not yet fetched
        self._batches = itertools.count()  # numbers batches alike in every process
        self._last: HostBatch | None = None  # the latest batch started
        self._open = False  # whether updates were batched since the last close
        self.batch_error: Exception | None = None  # of a batch fetched, not raised
        # reductions (one per update, or per batch) so far: when checksums are due
        self._clock = 0
        # the latest reduction's statistics (a device array): done, every one
        # this process launched is (each device runs them in order)
        self.last_reduced: Any = None

    def split(self, items: list[tuple[str, Any]]) -> tuple[list, list]:
        """(recorded as they are, reduced across devices/processes)."""
        plain, reduce = [], []
        kinds = self._kinds
        for name, value in items:
            # A JAX array's kind depends on its sharding alone (a scalar is
            # replicated): kept per name, for as long as the sharding is the
            # same object (a jitted step returns the same one every call).
            sharding = getattr(value, "sharding", None)
            known = kinds.get(name)
            if (
                known is not None
                and known[0] is sharding
                and known[1] is type(value)
                and sharding is not None
            ):
                kind = known[2]
            else:
                kind = self._kind(name, value)
                if sharding is not None and isinstance(value, jax.Array):
                    if len(kinds) >= 4096:  # bounded: names that come and go
                        kinds.clear()
                    kinds[name] = (sharding, type(value), kind)
            if kind is _REDUCED:
                reduce.append((name, value))
            else:
                plain.append((name, value))
                if kind is _CHECKED:
                    reduce.append((SAME + name, _checksum(value)))
        return plain, reduce

    def _kind(self, name: str, value: Any) -> object:
        """Whether ``value`` is reduced, recorded as it is, or recorded as it
        is with a checksum (a value of this process alone)."""
        if name in COUNTER_KEYS:
            return _PLAIN
        if type(value) is float or type(value) is int:  # the common host scalar
            return _REDUCED if self.multi_process else _PLAIN
        if is_per_device(value) or (
            self.multi_process
            and not isinstance(value, _ARRAY_OR_STATS)
            and np.ndim(value) == 0
        ):
            return _REDUCED
        if self.multi_process and _process_local(value):
            return _CHECKED
        return _PLAIN

    def check_same(self, wait_all: bool = False) -> None:
        """Raises ValueError when a value recorded as it is differed across
        processes, read :data:`SAME_WINDOW` reductions after it was recorded
        (in batches: at the next batch), or all of them with ``wait_all``: at
        the same update on every process."""
        pending = self._same
        while pending and (wait_all or pending[0][0] <= self._clock):
            _, step, names, differs = pending.popleft()
            bad = [n for n, d in zip(names, np.asarray(differs), strict=True) if d]
            if bad:
                pending.clear()
                raise ValueError(
                    f"{bad[0]!r} differs across processes at step {step}"
                    + (f" (and {bad[1:]!r})" if bad[1:] else "")
                    + ": a value recorded as it is (a NumPy array, a JAX array "
                    "on this process's devices only) must be the same on every "
                    "process. Reduce it inside the step (jh.distributed_stats), "
                    "or pass it per device (jh.per_shard) to get its statistics "
                    "across devices; History.attach records a value of this "
                    "process alone"
                )

    def _arrived(
        self, items: list[tuple[str, Any]], step: int
    ) -> tuple[list[tuple[str, Any]], float]:
        """``items`` with this process's arrival time (with several processes),
        their names checked against the other processes' when they change;
        and the time."""
        now = time.time()
        if self.multi_process:
            hi = float(now // ARRIVAL_UNIT)
            items = [*items, (ARRIVAL[0], hi), (ARRIVAL[1], now - hi * ARRIVAL_UNIT)]
            names = tuple(sorted(n for n, _ in items))
            if names not in self._agreed:
                # Only when this process's names change: through the distributed
                # runtime's key-value store, never through the device queue.
                _check_same_names(self._id, len(self._agreed), names, step)
                self._agreed.add(names)
            self.latest = (len(self._agreed), names, step)
        return items, now

    def _program(self, items: list[tuple[str, Any]]) -> tuple[tuple, Any, bool]:
        """Runs one reduction of ``items``: its outputs, the mesh, and whether
        there were per-device values."""
        arrays, host = {}, []
        for n, v in items:
            if isinstance(v, jax.Array):
                arrays[n] = v
            else:
                host.append((n, v))
        # per-device values are sharded over a mesh (a NamedSharding)
        meshes = [v.sharding.mesh for v in arrays.values()]  # type: ignore[attr-defined]
        mesh = meshes[0] if meshes else _all_devices_mesh()
        # All host scalars in one global array: one transfer per local device.
        packed = _per_process_rows(host, mesh) if host else None
        host_names = tuple(n for n, _ in host)
        # Where every value is (from the concrete arrays, so any mesh works):
        # for provenance, and so per-device values take one all-reduce.
        layouts = {n: concrete_layout(v.sharding, v.shape) for n, v in arrays.items()}
        if host:
            column = jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names))
            )
            layouts.update(
                dict.fromkeys(host_names, concrete_layout(column, (mesh.size,)))
            )
        key = (host_names, tuple((n, lay.key) for n, lay in layouts.items()))
        fn = self._fns.get(key)
        if fn is None:
            if len(self._fns) >= 64:  # bounded: name sets that come and go
                self._fns.clear()
            fn = self._fns[key] = jax.jit(
                functools.partial(
                    _reduce,
                    host_names=host_names,
                    layouts=layouts,
                    provenance=self.provenance,
                )
            )
        return fn(arrays, packed), mesh, bool(meshes)

    def _finish(
        self,
        step: int,
        now: float,
        stats: Stats,
        straggler: dict,
        differs: Any,
        mesh: Any,
        names: tuple[str, ...],
        due: int,
    ) -> tuple[Stats, dict]:
        """Keeps one update's lags and checksum results (of the checksums among
        ``names``); returns its statistics (without provenance when it is off)
        and straggler values."""
        straggler = dict(straggler)
        if LAGS in straggler:  # every process's lag: for the straggler scores
            self.lags.append((step, now, straggler.pop(LAGS), _processes(mesh)))
        if differs is not None:
            same = tuple(n.removeprefix(SAME) for n in names if n.startswith(SAME))
            self._same.append((due, step, same, differs))
        if not self.provenance and stats.where is not None:
            stats = Stats(stats.names, stats.table)
        return stats, straggler

    def reduce(
        self, items: list[tuple[str, Any]], step: int = 0
    ) -> tuple[Stats, dict, Any]:
        """The statistics of ``items`` (one fused call), the straggler values
        (``{}`` with one process) and the mesh of the per-device values (None
        if there were none)."""
        items, now = self._arrived(items, step)
        (stats, straggler, differs), mesh, has = self._program(items)
        self.last_reduced = stats.table
        names = tuple(sorted(n for n, _ in items))
        self._clock += 1
        due = self._clock + SAME_WINDOW
        stats, straggler = self._finish(
            step, now, stats, straggler, differs, mesh, names, due
        )
        return stats, straggler, (mesh if has else None)

    def reduced_row(
        self, row: Row, every: int = 1, now_wanted: bool = True
    ) -> tuple[Row, list[Row], Any]:
        """``row`` with what needs it reduced into one :class:`~jaxhistory.Stats`
        named ``{name}/{stat}``, at the place of the first reduced value (the
        summary keeps the order); the rows of earlier updates reduced now (in
        batches); and the mesh of the per-device values (None if there were
        none).

        With several processes and ``every`` > 1, what needs reducing waits in
        a batch, reduced on the host (through the key-value store, on a
        background thread, no device program) at steps that are multiples of
        ``every``, after :data:`BATCH_MAX` updates (or :data:`BATCH_VALUES`
        values), or when the names change
        (the same updates on every process). A batch's results are fetched at
        the next batch, long computed by then, so the host keeps running
        ahead; with ``now_wanted`` (a summary line at this update) the
        batch this update closes is fetched at once and this update's values go
        into ``row``. Each update's values are recorded at its own step.
        """
        items = list(zip(row.names, row.values, strict=True))
        plain, reduce = self.split(items)
        batched = every > 1 and self.multi_process
        if not batched:
            if not reduce:
                return row, [], None
            stats, straggler, mesh = self.reduce(reduce, row.step)
            return _placed(row, items, plain, reduce, stats, straggler), [], mesh
        if reduce:
            for name, value in reduce:  # now: a batch never fails at its end
                if type(value) is not float and not isinstance(value, jax.Array):
                    _numeric(name, value)
            arrived, now = self._arrived(reduce, row.step)
            assert self.latest is not None  # _arrived set it
            names = self.latest[1]
            if self._batch and names != self._batch_names:
                self.run_batch()
            self._batch.append((row.step, now, arrived))
            self._open = True  # close posts a batch, empty or not
            self._batch_names = names
        closes = bool(self._batch) and (
            row.step % every == 0
            or len(self._batch) >= BATCH_MAX
            or len(self._batch) * len(self._batch_names) >= BATCH_VALUES
        )
        if closes:  # batches close at the same updates everywhere
            self._clock += 1
            self.run_batch()  # its checksums are read at the next one
        rows, mesh = self.collect(everything=closes and now_wanted)
        if reduce and rows and rows[-1].step == row.step and closes and now_wanted:
            last = rows.pop()  # this update's own values go into its row
            stats, *rest = last.values
            straggler = dict(zip(last.names[1:], rest, strict=True))
            row = _placed(row, items, plain, reduce, stats, straggler)
        elif reduce:
            row = row._replace(
                names=tuple(n for n, _ in plain),
                values=tuple(v for _, v in plain),
                kind=RowKind.VALUES,
            )
        return row, rows, mesh

    def run_batch(self, closing: bool = False) -> None:
        """Starts the reduction of the waiting batch (on the host, through the
        distributed runtime's key-value store, on a background thread: no
        device program; :meth:`collect` fetches it). With ``closing`` (close
        and finalize, on every process), an empty batch too where updates were
        batched since the last close: a process with nothing left still
        posts, so that one with updates the others lack fails naming them
        instead of waiting."""
        batch, self._batch = self._batch, []
        if closing:
            # nothing recorded since the last close: nothing to post (a close
            # after finalize on one process only must not wait for the others)
            closing, self._open = self._open, False
        if not batch and not closing:
            return
        updates, arrays = [], []
        for step, now, items in batch:  # host scalars checked at their update
            items = sorted(items, key=lambda item: item[0])
            arrays += [v for _, v in items if isinstance(v, jax.Array)]
            updates.append((step, now, items))
        mesh = getattr(arrays[0].sharding, "mesh", None) if arrays else None
        if not isinstance(mesh, jax.sharding.Mesh):
            mesh = _all_devices_mesh()
        client = _client()
        key, drop = batch_key(f"jaxhistory/reducer{self._id}", next(self._batches))
        handle = HostBatch(
            updates,
            key,
            drop,
            client,
            functools.partial(client_is_current, client),
            _combine_batch,
            _split_batch,
            mesh,
            self._last,
        )
        self._last = handle
        self._inflight.append(
            (batch, handle, mesh, bool(arrays), self._batch_names, self._clock + 1)
        )

    def collect(self, everything: bool = False) -> tuple[list[Row], Any]:
        """Fetches the batches started before the newest (all of them with
        ``everything``): one row of each update's statistics and straggler
        values at its step; and the mesh of the per-device values (None if
        there were none). A batch that failed stops the fetching: its error
        waits in :attr:`batch_error` (:meth:`raise_batch_error`)."""
        rows, found = [], None
        keep = 0 if everything else 1
        while len(self._inflight) > keep:
            batch, handle, mesh, has, names, due = self._inflight.pop(0)
            found = mesh if has else found
            try:
                results = handle.result()
            except Exception as err:  # raised once the rows before are recorded
                self.batch_error = err
                break
            for (step, now, _), (stats, straggler, differs) in zip(
                batch, results, strict=True
            ):
                stats, straggler = self._finish(
                    step, now, stats, straggler, differs, mesh, names, due
                )
                values = (stats, *straggler.values())
                rows.append(Row(step, ("", *straggler), values, RowKind.VALUES))
        return rows, found

    def raise_batch_error(self) -> None:
        """Raises what a batch fetched by :meth:`collect` failed with (once)."""
        err, self.batch_error = self.batch_error, None
        if err is not None:
            raise err

    def answer_names(self) -> str | None:
        """Answers, from another thread, a process whose metric names changed
        at a step this process has already reduced with its own names (so it
        will never post names for that step itself, and that process would
        wait for them): posts this process's names for that round. Returns the
        text of the difference (also raised there), or None."""
        latest, client = self.latest, _client()
        if latest is None or client is None:
            return None
        round_, names, step = latest
        if round_ in self._answered:
            return None
        prefix = f"jaxhistory/reducer{self._id}/names{round_}/"
        me = jax.process_index()
        try:
            entries = client.key_value_dir_get(prefix)
        except Exception:
            return None
        everyone = {me: (names, step)}
        for key, text in entries:
            other, posted = _read_names(key, text)
            if other is not None and other != me:
                everyone[other] = posted
        waiting = [s for p, (_, s) in everyone.items() if p != me]
        if not waiting or step < min(waiting) or f"{prefix}{me}" in dict(entries):
            return None  # nobody asks, or this process has not got there yet
        self._answered.add(round_)
        with contextlib.suppress(Exception):  # posted meanwhile: theirs stands
            client.key_value_set(f"{prefix}{me}", _names_text(names, step))
        return _difference(everyone)


def _placed(
    row: Row, items: list, plain: list, reduce: list, stats: Stats, straggler: dict
) -> Row:
    """``row`` with its reduced values replaced by ``stats`` (named ``""``, at
    the place of the first of them) and the straggler values at the end."""
    record = dict(plain)
    first = next(i for i, (n, _) in enumerate(items) if n == reduce[0][0])
    kept = [(n, v) for n, v in items[:first] if n in record]
    record = {**dict(kept), "": stats, **record, **straggler}
    return row._replace(
        names=tuple(record),
        values=tuple(record.values()),
        kind=RowKind.VALUES,
    )


def _names_text(names: tuple[str, ...], step: int) -> str:
    return json.dumps({"step": step, "names": list(names)})


def _read_names(key: Any, text: str) -> tuple[int | None, tuple]:
    """(process, (names, step)) of one posted entry; (None, ()) when unreadable."""
    try:
        process = int(str(key).rsplit("/", 1)[-1])
        posted = json.loads(text)
        return process, (tuple(map(str, posted["names"])), int(posted["step"]))
    except (ValueError, TypeError, KeyError):
        return None, ()


def _difference(everyone: dict[int, tuple[tuple[str, ...], int]]) -> str | None:
    """What differs among the processes' ``(names, step)``, or None."""
    if len({names for names, _ in everyone.values()}) < 2:
        return None
    common = set.intersection(*(set(names) for names, _ in everyone.values()))
    parts = [
        f"process {p} has {_shown(set(names) - common) or 'no other names'} "
        f"(at step {step})"
        for p, (names, step) in sorted(everyone.items())
    ]
    return (
        "processes passed different metrics to History.update: "
        + "; ".join(parts)
        + f" (all have {_shown(common)}). Every process must record the same "
        "names for distributed history"
    )


def _reduce(
    arrays: dict,
    packed: jax.Array | None,
    host_names: tuple[str, ...],
    layouts: dict[str, Layout],
    provenance: bool = True,
) -> tuple[Stats, dict, Any]:
    """The jitted reduction of one update's per-device ``arrays`` and host
    scalars (the columns of ``packed``, named ``host_names``): statistics
    (with provenance when ``layouts`` are given); when its two arrival scalars
    are among the host scalars, the last process to arrive, its lag behind the
    median process and every process's lag (``{}`` without), at no extra
    collective; and whether each checksum of a value recorded as it is (names
    ``{SAME}...``) differs across processes (None without checksums)."""
    metrics = dict(arrays)
    for j, name in enumerate(host_names):
        assert packed is not None  # host_names are its columns
        metrics[name] = packed[:, j]
    leaves, _ = flatten_metrics(metrics)
    lays = [layouts[lf.name] for lf in leaves]
    index = {lf.name: i for i, lf in enumerate(leaves)}
    pair = (index[ARRIVAL[0]], index[ARRIVAL[1]]) if ARRIVAL[0] in index else None
    picks = frozenset(pair or ())
    stats, gathered = global_stats(leaves, lays, picks, provenance=provenance)
    stats = _constants_stay(stats)
    checks = [index[n] for n in index if n.startswith(SAME)]
    # a checksum's max and min differ: so did the value
    differs = stats.table[1, checks] != stats.table[2, checks] if checks else None
    dropped = picks | set(checks)
    if dropped:
        keep = [i for i in range(len(leaves)) if i not in dropped]
        where = None if stats.where is None else stats.where[:, keep]
        stats = Stats(tuple(stats.names[i] for i in keep), stats.table[:, keep], where)
    if pair is None:
        return stats, {}, differs
    devices = jax.devices()
    first: dict[int, int] = {}  # process -> the slot of its first device
    for slot, holder in enumerate(lays[pair[0]].holders.tolist()):
        first.setdefault(devices[holder].process_index, slot)
    procs = sorted(first)
    slots = np.asarray([first[p] for p in procs])
    hi, lo = gathered[pair[0]][slots], gathered[pair[1]][slots]
    # Relative to the earliest whole unit: small, so exact enough in float32.
    arrival = (hi - jnp.min(hi)) * ARRIVAL_UNIT + lo
    last = jnp.argmax(arrival)
    lags = arrival - jnp.median(arrival)
    straggler = {
        STRAGGLER[0]: jnp.asarray(procs, jnp.int32)[last],
        STRAGGLER[1]: lags[last],
        LAGS: lags,
    }
    return stats, straggler, differs


def _combine_batch(items: list[tuple[str, Any]], everyone: dict) -> dict:
    """The arrays of a batch reduced on the host (``items`` the first
    update's, sorted by name: every update of a batch has the same names;
    ``everyone`` each process's partials)."""
    names = tuple(n for n, _ in items)
    return combine(
        names,
        tuple(result_dtype(v) for _, v in items),
        everyone,
        ARRIVAL if ARRIVAL[0] in names else None,
        ARRIVAL_UNIT,
        SAME,
    )


def _split_batch(items: list[tuple[str, Any]], arrays: dict) -> list[Combined]:
    """Each update's statistics, straggler values and checksum results from
    :func:`_combine_batch`'s arrays."""
    names = tuple(n for n, _ in items)
    arrival = ARRIVAL if ARRIVAL[0] in names else None
    return results(names, arrays, arrival, SAME, LAGS, STRAGGLER)


def _constants_stay(stats: Stats) -> Stats:
    """Where every value was the same (max == min), that value as the mean and
    0 as the std, exactly: a float32 mean of equal values can be an ulp off
    (0.003 on 3 processes x 2 devices: mean 0.0030000002589, std 2.3e-10),
    which would make a constant look like noise."""
    mean, mx, mn, std = stats.table[:4]
    same = mx == mn
    table = stats.table.at[0].set(jnp.where(same, mx, mean))
    table = table.at[3].set(jnp.where(same, 0, std))
    return Stats(stats.names, table, stats.where, stats.rows)


@functools.lru_cache(maxsize=16)
def _processes(mesh: jax.sharding.Mesh) -> tuple[int, ...]:
    """The processes holding ``mesh``'s devices, ascending: the order of the
    arrival lags."""
    return tuple(sorted({d.process_index for d in mesh.devices.flat}))


def _process_local(value: Any) -> bool:
    """Whether a value recorded as it is comes from this process alone (so
    may differ across processes): anything but a global JAX array."""
    if isinstance(value, Stats):
        return False
    if isinstance(value, jax.Array):
        return value.is_fully_addressable
    return True


def _checksum(value: Any) -> float:
    """24 bits of a CRC of the value's dtype, shape and bytes: exact in
    float32, the same on every process exactly when the values are (but for
    one chance in 16 million). A JAX array is fetched for it."""
    arr = np.ascontiguousarray(np.asarray(value))
    head = f"{arr.dtype.str}{arr.shape}".encode()
    return float(zlib.crc32(arr.tobytes(), zlib.crc32(head)) & 0xFFFFFF)


@functools.lru_cache(maxsize=1)
def _all_devices_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(jax.devices(), ("devices",))


def distributed_client() -> Any:
    """The distributed runtime's client with several processes, else None."""
    return _client() if jax.process_count() > 1 else None


def client_is_current(client: Any) -> bool:
    """Whether ``client`` is still the runtime's (False after
    ``jax.distributed.shutdown()``: a shut-down client must not be called)."""
    return client is not None and _client() is client


def _client() -> Any:
    """The distributed runtime's client (None before jax.distributed.initialize)."""
    from jax._src import distributed  # the key-value store has no public API

    return getattr(distributed.global_state, "client", None)


def agreed_run_id(candidate: str, run_name: str | None) -> str:
    """The run id every process of a multi-process job uses (``candidate``
    with one process, or before ``jax.distributed.initialize``).

    The k-th History made with ``run_name`` in each process shares one id: the
    first process to get there puts its ``candidate`` in the distributed
    runtime's key-value store, and every process reads it back. Nobody waits
    for a process that makes no History; a store that does not answer within
    :data:`RUN_ID_TIMEOUT_S` leaves this process its own id, with a warning.
    """
    client = _client() if jax.process_count() > 1 else None
    if client is None:
        return candidate
    with _RUN_IDS_LOCK:
        k = _RUN_IDS.get(run_name, 0)
        _RUN_IDS[run_name] = k + 1
    # The key holds the name as JSON would quote it: never a path separator.
    key = f"jaxhistory/run_id/{json.dumps(run_name)}/{k}"
    with contextlib.suppress(Exception):  # refused when another was first
        client.key_value_set(key, candidate)
    try:
        return client.blocking_key_value_get(key, int(RUN_ID_TIMEOUT_S * 1000))
    except Exception as err:
        warnings.warn(
            f"process {jax.process_index()} could not read the job's run id from "
            f"the distributed runtime ({type(err).__name__}); it uses "
            f"{candidate!r}, which other processes may not share",
            RuntimeWarning,
            stacklevel=3,
        )
        return candidate


def _check_same_names(
    reducer: int, round_: int, names: tuple[str, ...], step: int = 0
) -> None:
    """Raises ValueError, on every process, unless all processes reduce ``names``.

    Each process posts its names (and ``step``, where they changed) under a
    key of its own in the distributed runtime's key-value store and reads
    every other process's, waiting at most :data:`NAMES_TIMEOUT_S` for each.
    A process that has already reduced that step with other names answers
    from its hang watch's thread (:meth:`Reducer.answer_names`), so a metric
    added on one process mid-run is an error within seconds. ``reducer`` and
    ``round_`` (the number of name sets agreed on before) make the keys the
    same in every process.
    """
    client = _client()
    if client is None:  # several processes without the runtime: cannot happen
        raise RuntimeError("several JAX processes but no distributed runtime client")
    me, count = jax.process_index(), jax.process_count()
    prefix = f"jaxhistory/reducer{reducer}/names{round_}"
    client.key_value_set(f"{prefix}/{me}", _names_text(names, step), True)
    deadline = time.monotonic() + NAMES_TIMEOUT_S
    everyone = {me: (names, step)}
    for other in range(count):
        if other == me:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            text = client.blocking_key_value_get(f"{prefix}/{other}", left_ms)
        except Exception as err:  # the runtime's deadline error
            raise TimeoutError(
                f"process {other} did not send its metric names within "
                f"{NAMES_TIMEOUT_S:g} s (process {me} records {_shown(names)} from "
                f"step {step}): every process must call History.update with "
                "distributed history, with the same metric names "
                f"({type(err).__name__})"
            ) from None
        _, everyone[other] = _read_names(f"{prefix}/{other}", text)
    difference = _difference(everyone)
    if difference is not None:
        raise ValueError(difference)


def _shown(names: Any) -> list[str]:
    """The user's metric names among ``names``, sorted: without the arrival
    times History adds itself."""
    shown = (n.removeprefix(SAME) for n in names if n not in ARRIVAL)
    return sorted(set(shown))


def _numeric(name: str, value: Any) -> np.ndarray:
    """A host scalar as an array; TypeError naming it unless it is a number."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r} is not numeric ({type(value).__name__})")
    return arr


def _per_process_rows(
    host: list[tuple[str, Any]], mesh: jax.sharding.Mesh
) -> jax.Array:
    """A global ``(mesh.size, H)`` array over ``mesh``: on each of this process's
    devices, a row of this process's ``H`` host scalars.

    With the same number of devices per process, statistics over a column are
    statistics over processes. Sharing the per-device metrics' mesh keeps one
    fused call; one array for all scalars keeps one transfer per device.
    """
    row = [_numeric(name, value) for name, value in host]
    # float64 where JAX computes in it (jax_enable_x64), float32 otherwise
    # (jax's Config declares no attribute per option)
    dtype = np.float64 if jax.config.jax_enable_x64 else np.float32  # type: ignore[attr-defined]
    values = np.asarray(row, dtype)
    shape = (mesh.size, len(values))
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names), None)
    )
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.broadcast_to(values, shape)[index]
    )
