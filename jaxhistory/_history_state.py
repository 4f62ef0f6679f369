"""HistoryState: an immutable, columnar record of per-step metrics on the host."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import jax
import numpy as np

from jaxhistory import _appending, _codec, _combining, _xarray
from jaxhistory._compiled import speedups
from jaxhistory._dtypes import (
    ALL_FLOATS,
    INT64_MAX,
    STEP_KEYS,
    warmup_count,
)
from jaxhistory._row import (
    LAST_REPEAT,
    Repeat,
    Row,
    RowKind,
    parse_row,
    repeat_of,
    repeated,
)
from jaxhistory._run_stats import column_summary
from jaxhistory._stats import Stats
from jaxhistory._table import (
    STAGE,
    InFlight,
    Table,
    Tables,
)

__all__ = ["STEP_KEYS", "Appender", "HistoryState", "warmup_count"]
# Groups of device values (one per table an update writes: its plain values, each
# Stats and its provenance) that may still be in flight; past this many the oldest
# are waited for. This bounds how far the host runs ahead of the device (simulated
# CPU devices deadlock when too many collective steps are queued).
MAX_INFLIGHT = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryState:
    """An immutable record of metrics: every record has an explicit step.

    ``update`` returns a new state and never changes the old one: updating an old
    state again starts an independent branch. Appends are amortized O(1): the newest
    state appends in place to storage it shares with its ancestors, which only ever
    see their own prefix of it (an old state that is updated again copies its rows
    once). Metrics recorded together share one step array.

    Safe to share between threads: a state never sees rows recorded after it, and
    two branches (or two threads extending one state) never see each other's rows.

    A JAX pytree whose leaves are each table's step and value arrays and
    ``next_step`` (``attrs`` and the metric names are its static structure, so the
    structure stays the same while the same metrics are recorded). Flattening
    never waits for the device: rows whose device values are not computed yet
    flatten to :class:`~jaxhistory._table.PendingColumn` leaves that read them
    when converted with ``np.asarray``. Good for ``jax.device_get(state)`` (all
    leaves as NumPy arrays), ``jax.tree.map`` over a state or two states of one
    run, ``jax.tree.unflatten`` back into a state, and checkpointing beside a
    train state (orbax ``StandardSave`` of ``jax.device_get(state)``).

    Examples:
        >>> import jaxhistory as jh
        >>> s0 = jh.HistoryState()
        >>> s1 = s0.update({"loss": 0.5, "lr": 1e-3})
        >>> s2 = s1.update({"loss": 0.25})
        >>> s2.values("loss").tolist(), s1.values("loss").tolist()
        ([0.5, 0.25], [0.5])
        >>> s3 = s2.update({"eval": {"acc": 0.9}}, step=100)
        >>> s3.steps("eval/acc").tolist(), s3.next_step
        ([100], 101)
    """

    data: Tables = dataclasses.field(default_factory=Tables)
    next_step: int = 0
    attrs: tuple[tuple[str, Any], ...] = dataclasses.field(
        default=(), metadata={"static": True}
    )
    if TYPE_CHECKING:  # per state, set in __post_init__ and _derive: no field
        _inflight: ClassVar[InFlight]

    def __post_init__(self):
        object.__setattr__(self, "_inflight", InFlight(MAX_INFLIGHT))
        step = self.next_step
        if type(step) is not int and np.ndim(step) == 0:
            try:  # a leaf brought back as a NumPy integer (tree_unflatten)
                if np.asarray(step).dtype.kind in "iu":
                    object.__setattr__(self, "next_step", int(step))
            except Exception:  # a tracer or a placeholder: kept as it is
                pass

    def _derive(
        self, tables: dict, next_step: int, attrs=None, appended=None, same=False
    ) -> HistoryState:
        """A state of ``tables``; ``appended`` names the one key set whose entry
        differs from this state's (its index is then carried over); ``same``:
        a row was appended in place to a table of this state's (same index)."""
        new = _new_state()  # (no __init__: a state is made per update)
        _set(new, "data", Tables.derived(self.data, tables, appended, same))
        _set(new, "next_step", next_step)
        _set(new, "attrs", self.attrs if attrs is None else attrs)
        _set(new, "_inflight", self._inflight)
        return new

    @property
    def inflight(self) -> InFlight:
        """The device values of this run still being copied to the host (shared
        by every state of the run; bounds how far the host runs ahead)."""
        return self._inflight

    # ----- reading -------------------------------------------------------------
    @property
    def keys(self) -> tuple[str, ...]:
        """Metric names, in the order they were first recorded."""
        return tuple(self.data.index())

    def __len__(self) -> int:
        return len(self.data.index())

    def __contains__(self, name: object) -> bool:
        return name in self.data.index()

    def records(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The steps and values of ``name`` together (read-only arrays; one read
        where :meth:`steps` and :meth:`values` read twice)."""
        return self.data.records(name)

    def steps(self, name: str) -> np.ndarray:
        """The steps at which ``name`` was recorded (read-only int64 array)."""
        return self.records(name)[0]

    def values(self, name: str) -> np.ndarray:
        """The values of ``name``, one per step (read-only; waits for device values)."""
        return self.records(name)[1]

    def dtype(self, name: str) -> np.dtype:
        """The storage dtype of ``name``."""
        return self.data.meta_of(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of one record of ``name``."""
        return self.data.meta_of(name)[1]

    def count(self, name: str) -> int:
        """How many records ``name`` has."""
        return sum(n for _, n, _ in self.data.parts(name))

    def last(self, name: str) -> Any:
        """The most recent value of ``name``."""
        values = self.values(name)
        if not len(values):
            raise KeyError(f"metric {name!r} has no records")
        return values[-1]

    def last_step(self, name: str) -> int | None:
        """The step of the most recent record of ``name`` (None if none)."""
        # parts have rows, so each a last step
        steps = cast(list[int], [t.step_at(n) for t, n, _ in self.data.parts(name)])
        return max(steps) if steps else None

    def blocks(self):
        """Each set of metrics recorded together, as ``(names, steps, columns)``:
        their shared steps and one read-only column per name (rows so far only).
        Writers that go row by row read the state this way, one block at a
        time."""
        for keys, (table, n) in self.data.tables.items():
            if n:
                steps, columns = table.view(n)
                yield keys, steps, columns

    def nbytes(self) -> int:
        """Bytes of NumPy storage held for this state's tables."""
        return sum(t.nbytes() for t, _ in self.data.tables.values())

    def select(self, *prefixes: str) -> HistoryState:
        """Only the metrics named ``prefix`` or ``prefix/...``, for any prefix given.

        Examples:
            >>> import jaxhistory as jh
            >>> s = jh.HistoryState().update({"train": {"loss": 1.0}, "eval/loss": 2.0})
            >>> s.select("train").keys
            ('train/loss',)
        """
        return self._derive(_combining.selected(self, prefixes), self.next_step)

    # ----- writing -------------------------------------------------------------
    def update(self, metrics: Any, step: int | None = None) -> HistoryState:
        """Records ``metrics`` at one step; returns the new state.

        Args:
            metrics: a dict (or pytree) of Python, NumPy or JAX scalars and arrays;
                nested names join with ``/``. JAX arrays are not waited for: their
                copy to the host starts now and they are fetched in batches later.
            step: the step. When None, a ``step`` (or ``iter``) entry of
                ``metrics`` is the step (and is not stored as a metric); otherwise
                ``next_step``, one past the latest step recorded.

        Raises:
            TypeError: a value is a string, an object or a JAX tracer.
            ValueError: a metric changed shape, or was already recorded at this or
                a later step: each metric's steps strictly increase, so a second
                record of a key at the same step is refused (combine runs with
                :meth:`merge`). The state is unchanged.
        """
        if step is None and speedups is not None:
            # A dict like the last one parsed, of finite floats, onto the end of
            # its table (the common case), compiled; NotImplemented: nothing done
            new = speedups.state_update(self, metrics, _STATE_COMPILED)
            if new is not NotImplemented:
                return new
        if type(metrics) is Stats:  # not isinstance: Mapping's ABC check is slow
            metrics = {"": metrics}
        return self.append(parse_row(metrics, step, self.next_step))

    def append(self, row: Row, owned: bool = False) -> HistoryState:
        """Records one parsed :class:`~jaxhistory._row.Row`; returns the new state
        (:meth:`update` parses and appends). Raises as :meth:`update` does.

        ``owned``: the row's NumPy arrays are copies nobody changes (as
        :func:`~jaxhistory._row.owned` makes for the log): the state keeps
        them rather than copying them again."""
        change = _appending.appended(self, row, owned)
        if isinstance(change, HistoryState):  # Stats values, piece by piece
            return change
        tables, next_step, names, same = change
        return self._derive(tables, next_step, appended=names, same=same)

    def update_packed(
        self, names: tuple[str, ...], vector: Any, step: int | None = None
    ) -> HistoryState:
        """Records ``len(names)`` scalars held in one array at one step.

        The array may be a device array straight out of a jitted step: it is stored
        without waiting and fetched with the other pending values, as one transfer
        instead of one per scalar. This is how :class:`History` records
        distributed statistics.
        """
        names, table, n, step = _appending.packed(self, names, vector, step)
        new = self.data.tables.copy()
        new[names] = (table, n)
        return self._derive(new, max(self.next_step, step + 1), appended=names)

    def extend(self, steps: Any, values: Mapping[str, Any]) -> HistoryState:
        """Records many steps at once from arrays (one host transfer for all).

        Args:
            steps: 1-D whole numbers within int64, strictly increasing (a
                fractional step is a ValueError, never truncated).
            values: metric name -> array whose first axis matches ``steps``.
        """
        change = _appending.extended(self, steps, values)
        if change is None:
            return self
        return self.extended_with(*change)

    def extended_with(
        self, keys: tuple[str, ...], table: Table, n: int, last: int
    ) -> HistoryState:
        """This state with ``keys``' table now ``table``, of ``n`` rows, the
        last at step ``last`` (appended by :mod:`~jaxhistory._appending`)."""
        new = self.data.tables.copy()
        new[keys] = (table, n)
        return self._derive(new, max(self.next_step, last + 1), appended=keys)

    def extend_from_buffer(self, buffer: Any) -> HistoryState:
        """Appends a :class:`~jaxhistory.MetricBuffer` in one device-to-host
        copy. A buffer that overwrote entries before it was read (more writes
        than its capacity) gives a RuntimeWarning saying how many steps are
        lost, and the entries it still holds are appended."""
        host = jax.device_get(buffer)  # one copy (to_host, dropped: none more)
        steps, values = host.to_host()
        dropped = host.dropped
        if dropped:
            warnings.warn(
                f"the MetricBuffer of capacity {host.capacity} was written "
                f"{dropped} times more than it holds before it was read: its "
                f"{dropped} oldest entries were overwritten and are not in the "
                f"history (it holds steps {steps[0]} to {steps[-1]}); read it "
                "more often or give it more capacity",
                RuntimeWarning,
                stacklevel=2,
            )
        return self.extend(steps, values)

    def merge(self, other: HistoryState) -> HistoryState:
        """Combines two histories in step order (a resumed run, for example).

        Where both record a metric at the same step, ``other``'s record wins.
        A metric stored with different dtypes keeps every value exactly (see
        :func:`~jaxhistory._dtypes.common_dtype`: integers join floats only where
        float64 holds them; uint64 and int64 values give int64 or uint64) or is
        a ValueError naming it; neither history changes.
        """
        if not isinstance(other, HistoryState):
            raise TypeError(f"merge takes a HistoryState, got {type(other).__name__}")
        tables = _combining.merged(self, other)
        return self._derive(tables, max(self.next_step, other.next_step))

    def before(self, step: int) -> HistoryState:
        """This history without its records at ``step`` and later (a run that
        restarts from a checkpoint of step ``step - 1`` records them again);
        ``next_step`` is ``step`` at most. A metric with no record before
        ``step`` is left out."""
        columns = _combining.before(self, step)
        out = self._from_columns(columns, min(self.next_step, step))
        return out.with_attrs(**dict(self.attrs)) if self.attrs else out

    def with_attrs(self, **attrs: Any) -> HistoryState:
        """A state with run metadata ``attrs`` added (carried into exports).

        Dicts, lists, tuples and sets among the values are copied, all the way
        down: changing the caller's objects later does not change the state.
        One that holds itself is a ValueError naming it (the state unchanged)."""
        merged = dict(self.attrs) | {k: _plain_copy(v, k) for k, v in attrs.items()}
        return self._derive(
            dict(self.data.tables), self.next_step, tuple(sorted(merged.items()))
        )

    # ----- analysis -----------------------------------------------------------
    def all_steps(self) -> np.ndarray:
        """The sorted union of every metric's steps (read-only; computed once)."""
        return self.data.step_union()

    def summary(self, warmup: float = 0) -> dict[str, dict[str, float]]:
        """Run-level statistics of every metric after ``warmup``.

        For each metric: mean, std, median, p10, p90, min and max of its finite
        values (all elements of array metrics), the last value (last element of the
        last record's mean for arrays), how many values were recorded and how many
        of them are NaN or infinite. An integer metric's min, max and last are
        Python ints, exact.
        """
        return {
            name: column_summary(values)
            for name, _, values, _, _ in self.columns(warmup)
        }

    def columns(self, warmup: float = 0):
        """Each metric after ``warmup`` as ``(name, steps, values, dtype,
        shape)``, in recording order: one read of the state for everything
        that writes it out (the dataset, plots, the report)."""
        first = self.first_kept_step(warmup)
        for name in self.keys:
            steps, values = self.records(name)
            if len(steps) and steps[0] < first:
                keep = steps >= first
                steps, values = steps[keep], values[keep]
            dtype, shape = self.data.meta_of(name)
            yield name, steps, values, dtype, shape

    def first_kept_step(self, warmup: float) -> int:
        """The first step kept after ``warmup`` (a fraction below 1 or a number
        of steps, counted over :meth:`all_steps`); past every step when warmup
        drops them all."""
        steps = self.all_steps()
        k = warmup_count(warmup, len(steps))
        if k >= len(steps):
            return INT64_MAX if len(steps) else 0
        return int(steps[k])

    def to_xarray(self, warmup: float = 0):
        """The history as an ``xarray.Dataset`` (layout: :mod:`jaxhistory._xarray`).

        ``warmup`` (a fraction below 1 or a number of steps) drops the first
        steps.
        """
        steps = self.all_steps()
        steps = steps[steps >= self.first_kept_step(warmup)]
        columns = list(self.columns(warmup))
        return _xarray.to_dataset(columns, steps, dict(self.attrs), self.next_step)

    @classmethod
    def from_xarray(cls, ds) -> HistoryState:
        """Rebuilds a state from :meth:`to_xarray`'s output, exactly."""
        columns, next_step, attrs = _xarray.from_dataset(ds)
        return cls._from_columns(columns, next_step, attrs)

    @classmethod
    def from_netcdf(cls, path) -> HistoryState:
        """The state saved in a dataset file by :func:`jaxhistory.export.to_netcdf`.

        A crafted or damaged file is a ValueError (OSError where it cannot be
        read at all) naming it and what is wrong: an attribute of the wrong type
        (``jaxhistory_name``, ``jaxhistory_next_step``, ...), two variables
        holding one metric, steps that are not steps, a
        ``jaxhistory_next_step`` at or before the last recorded step.
        """
        return cls._from_columns(*_xarray.read_state(path))

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike) -> HistoryState:
        """The history in a JSONL log written by History or
        :func:`jaxhistory.export.to_jsonl`.

        Lines that are not complete JSON records (the last line of a killed run,
        or one cut off before a resumed run appended) are skipped with a warning;
        every other record is kept. Where several lines record a metric at the
        same step (a run resumed from an earlier checkpoint), the later line wins.
        Integers come back as int64 (uint64 where a line marks the metric as
        uint64, as the log does for values recorded as uint64, or where some are
        beyond int64, and none is negative), other numbers as float64; a
        metric whose values no dtype holds exactly is a ValueError naming it.
        A ``step`` entry in a line's metrics (or aggregated values) is the
        step of its record, as
        :meth:`update` takes one beside an explicit step: left out where it is
        the line's step, a ValueError naming the file and the line where it is
        not. The run id of the log's lines
        (the last one) is in ``attrs["run_id"]``. A file with lines but no
        complete record (not a JSONL log: gzip data, another format) is a
        ValueError naming it; a log whose one line was cut off as it was written
        is an empty history (with the warning).
        """
        columns, next_step, run_id = _codec.read_log(path)
        return cls._from_columns(
            columns, next_step, {"run_id": run_id} if run_id else None
        )

    @classmethod
    def _from_columns(
        cls, columns: dict[str, tuple], next_step: int, attrs: dict | None = None
    ) -> HistoryState:
        """A state of one table per metric from ``{name: (steps, values)}``."""
        tables: dict[tuple[str, ...], tuple[Table, int]] = {
            (name,): (Table.from_arrays((name,), steps, [values]), len(steps))
            for name, (steps, values) in columns.items()
        }
        state = cls(data=Tables(tables), next_step=next_step)
        return state.with_attrs(**attrs) if attrs else state

    def __repr__(self) -> str:
        return f"HistoryState({len(self)} metrics, next_step={self.next_step})"

    def __eq__(self, other: object) -> bool:
        """Equal content: the same metrics (in any order) with the same steps,
        values (NaN equal to NaN), dtypes and shapes, and the same
        ``next_step`` and ``attrs`` (NaN equal to NaN there too, in arrays,
        scalars and containers alike), however the records are split into
        tables (a state equals the one :meth:`from_xarray` rebuilds from its
        dataset, and its pickled and deep copies). Reads device values not
        read yet."""
        if other is self:
            return True
        if not isinstance(other, HistoryState):
            return NotImplemented
        if self.next_step != other.next_step:
            return False
        if not _same_attr(dict(self.attrs), dict(other.attrs)):
            return False
        return self.data is other.data or _combining.same_records(self, other)

    def __hash__(self) -> int:
        # from what equal states share and costs nothing to read (attrs may
        # hold dicts, which have no hash)
        return hash((self.next_step, frozenset(self.keys)))

    def __copy__(self) -> HistoryState:
        return self  # never changes

    def __reduce__(self):
        """Pickles (and deep-copies) the rows this state sees, table by
        table, as NumPy arrays (device values are read now); the tables'
        locks and the run's values in flight stay behind."""
        return _unpickled, (self.data.pickled(), self.next_step, self.attrs)


_EXACT_F = float(2**53)  # beyond this magnitude not every integer is a float64


def _plain_copy(value: Any, name: str, inside: frozenset = frozenset()) -> Any:
    """``value`` with its dicts, lists, tuples and sets copied, all the way
    down (anything else as it is); ValueError naming attr ``name`` where one
    holds itself."""
    kind = type(value)
    if kind not in (dict, list, tuple, set, frozenset):
        return value
    if id(value) in inside:
        raise ValueError(
            f"attr {name!r} holds itself (a {kind.__name__} inside itself): "
            "attrs must be plain data that can be copied and written out"
        )
    inside = inside | {id(value)}
    if kind is dict:
        return {k: _plain_copy(v, name, inside) for k, v in value.items()}
    return kind(_plain_copy(v, name, inside) for v in value)


def _same_attr(a: Any, b: Any) -> bool:
    """Whether attribute values ``a`` and ``b`` are equal: NumPy arrays by
    dtype, shape and values, dicts, lists and tuples item by item, sets by
    matching their items, anything else by ``==`` (one whose answer is no bool
    is unequal). NaN is equal to NaN at the same place (a float, complex or
    NumPy scalar, in an array or a container), NaT to a NaT of its kind."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same_array(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_attr(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_attr, a, b))
    if isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)):
        return type(a) is type(b) and _same_set(a, b)
    try:
        if bool(a == b):
            return True
    except Exception:  # (an array-like of several values)
        return False
    kind = _missing(a)
    return kind is not None and kind == _missing(b)


def _same_array(a: Any, b: Any) -> bool:
    """:func:`_same_attr` of two values, one of them a NumPy array."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.names:  # a structured array: field by field
        return all(_same_array(a[name], b[name]) for name in a.dtype.names)
    if a.dtype.kind == "O":
        return all(map(_same_attr, a.flat, b.flat))
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fcmM"))


def _same_set(a: Any, b: Any) -> bool:
    """Whether every item of set ``a`` matches one of set ``b`` (by
    :func:`_same_attr`, so a NaN matches a NaN) and none is left over."""
    if len(a) != len(b):
        return False
    if a == b:
        return True
    left = list(b)
    for item in a:
        for i, other in enumerate(left):
            if _same_attr(item, other):
                del left[i]
                break
        else:
            return False
    return True


def _missing(value: Any) -> str | None:
    """What kind of missing number ``value`` is: "nan" (a float, complex or
    NumPy scalar that is NaN), "datetime64" or "timedelta64" (a NaT); else
    None."""
    if isinstance(value, (float, complex, np.floating, np.complexfloating)):
        return "nan" if value != value else None
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return type(value).__name__ if np.isnat(value) else None
    return None


def _unpickled(tables: list, next_step: int, attrs: tuple) -> HistoryState:
    """The state :meth:`HistoryState.__reduce__` pickled."""
    return HistoryState(data=Tables.unpickled(tables), next_step=next_step, attrs=attrs)


_new_state = functools.partial(object.__new__, HistoryState)
_set = object.__setattr__  # how a frozen dataclass sets its fields
_FLOATS, _FINITE = RowKind.FLOATS, RowKind.FINITE_FLOATS
# What speedups.state_update reads and makes (see HistoryState.update)
_STATE_COMPILED = (
    LAST_REPEAT,
    Row,
    _FINITE,
    ALL_FLOATS,
    STAGE,
    _new_state,
    functools.partial(object.__new__, Tables),
)


class Appender:
    """The newest state of a run that one owner (a :class:`~jaxhistory.History`)
    keeps appending to.

    A row of floats with the names of the row before it, at a later step, goes
    onto the end of that row's table (in place, as :meth:`HistoryState.append`
    does; a copy where a state read from here was updated meanwhile), and the
    :class:`HistoryState` holding it is made when :attr:`state` is read: one
    object per read rather than one per update. Anything else goes through
    :meth:`HistoryState.append`. Not thread-safe: its owner holds a lock.

    :meth:`take` is the one-call form for a dict with the keys of the last one
    (:meth:`remember`): it parses it (:func:`~jaxhistory._row.repeated`) and
    appends it in place, or declines.
    """

    __slots__ = ("_n", "_names", "_repeat", "_state", "_table", "next_step")

    def __init__(self, state: HistoryState | None = None):
        self.set(HistoryState() if state is None else state)

    def set(self, state: HistoryState) -> None:
        """Makes ``state`` the newest."""
        self._state = state
        self.next_step = state.next_step
        self._names: tuple[str, ...] | None = None  # the names of the last row appended
        self._table: Table | None = None  # nothing appended since `state`
        self._repeat: Repeat | None = None  # how the dict of that row looked

    @property
    def state(self) -> HistoryState:
        """The newest state (made now if rows were appended since the last read)."""
        table = self._table
        if table is not None:
            names = self._names
            assert names is not None  # set with _table
            tables = self._state.data.tables.copy()
            tables[names] = (table, self._n)
            self._state = self._state._derive(tables, self.next_step, appended=names)
            self._table = None
        return self._state

    def append(self, row: Row, owned: bool = False) -> None:
        """Records ``row`` (raises as :meth:`HistoryState.append` does; nothing is
        recorded then; ``owned`` as there)."""
        step, names, values, kind = row[:4]
        if kind >= _FLOATS and self.append_floats(names, values, step):
            return
        state = self.state.append(row, owned)
        self._state, self.next_step = state, state.next_step
        entry = state.data.tables.get(names) if kind >= _FLOATS else None
        if entry is not None and entry[0].ptypes is ALL_FLOATS:
            self._names, self._n = names, entry[1]
        else:
            self._names = None
        self._repeat = None

    def append_rows(self, rows: list[Row]) -> None:
        """Records ``rows``: those of one layout (a batch reduced on the host)
        in one extend per table, others one by one (raises as :meth:`append`
        does)."""
        if len(rows) > 1:
            state = _appending.rows_extended(self.state, rows)
            if state is not None:
                self._state, self.next_step = state, state.next_step
                self._names = self._repeat = None
                return
        for row in rows:
            self.append(row)

    def append_floats(self, names: tuple, values: tuple, step: int) -> bool:
        """Appends a row of Python floats to the table of the last row appended;
        False (nothing done) where it must take :meth:`append`: other names, or
        a step not past everything recorded."""
        if names != self._names or not self.next_step <= step <= INT64_MAX:
            return False
        table = self._table
        if table is None:
            table = self._state.data.tables[names][0]
        # in place, unless another state appended to it first: then a copy
        staged = table.append_at(self._n, step, values)
        if not staged:
            table = _appending.append_row(table, self._n, step, values)
        self._table, self._n, self.next_step = table, self._n + 1, step + 1
        return True

    def remember(self, metrics: Any, row: Row) -> None:
        """Notes how ``metrics``, just parsed into ``row`` and appended,
        looked, for :meth:`take`: where it went onto the
        end of the table of the row before it (the names repeat; a run whose
        names change at every update never pays for :meth:`take`)."""
        if self._table is not None and row.names == self._names:
            self._repeat = repeat_of(metrics, row)

    def take(self, metrics: Any, timestamp: float, step: Any = None) -> Row | None:
        """Parses and appends ``metrics`` (at ``step``, None: its own or the
        next) where it has the keys of the dict :meth:`remember` saw, finite
        Python floats as values and no step (or a step past everything
        recorded) and returns its row, the one
        :func:`~jaxhistory._row.parse_row` makes; None (nothing done) for
        anything else: then parse and :meth:`append` it."""
        repeat = self._repeat
        if repeat is None:
            return None
        if speedups is None:
            row = repeated(repeat, metrics, self.next_step, timestamp, step)
        else:  # the same, compiled
            row = speedups.repeated(
                repeat, metrics, self.next_step, timestamp, step, Row, _FINITE
            )
        if row is None or not self.append_floats(repeat.names, row[2], row[0]):
            return None
        return row
