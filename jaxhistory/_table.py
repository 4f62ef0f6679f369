"""Append-only tables of metrics, shared between immutable history states.

Metrics recorded together (the same key set in one update) go to one :class:`Table`
and share its step array, so 16 float64 metrics per step cost a little over 8 bytes
each. New rows are staged as Python tuples (a ``list.append``) and moved into NumPy
arrays in bulk every few hundred rows.

A history state sees the first ``n`` rows of each table. Appending to the newest
state's table works in place; appending to an older state, whose table has since
grown past it, first copies its ``n`` rows into a new table, so every state keeps
exactly the rows it had. Device values are staged as they are (their copy to the
host already started, except on CPU devices, whose buffers are host memory) and
read when the stage is moved into the arrays.

Every table has a lock: appending, moving the stage and reading past the moved
rows hold it, so states on different threads (or branches of one state) never see
each other's rows and never lose one. Only the state whose row count equals the
table's length may append in place, and it checks that under the lock.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import warnings
from typing import Any

import jax
import numpy as np

from jaxhistory._compiled import speedups
from jaxhistory._host_copies import host_copies, is_done

__all__ = [
    "STAGE",
    "InFlight",
    "PendingColumn",
    "Table",
    "Tables",
    "device_signature",
    "needs_host_copy",
]

STAGE = 256  # rows staged before a bulk move into NumPy
_MIN_CAPACITY = 64
# Large rows (array metrics) start with room for fewer rows, bounded in bytes:
# 64 rows of a 400 MB array asked for 25 GiB at its first record.
_MIN_CAPACITY_BYTES = 1 << 24
# Past this many bytes a table grows by an eighth instead of doubling.
_DOUBLING_BYTES = 1 << 30


def _row_bytes(dtypes: tuple[np.dtype, ...], shapes: tuple) -> int:
    """Bytes of one row: its step and its values."""
    return 8 + sum(
        d.itemsize * math.prod(s) for d, s in zip(dtypes, shapes, strict=True)
    )


def _coerce(name: str, value, dtype: np.dtype):
    """One staged value that did not convert with its column: NaN, with a warning.

    Only a value that passed update's checks by acting like a number in arithmetic
    without being convertible to one gets here.
    """
    try:
        return np.asarray(value, dtype)
    except (TypeError, ValueError, OverflowError) as err:
        warnings.warn(
            f"metric {name!r}: {type(value).__name__} value could not be stored as "
            f"{dtype} ({err}); recorded as NaN",
            RuntimeWarning,
            stacklevel=4,
        )
        return np.nan if dtype.kind == "f" else 0


class Table:
    """Rows of one key set: a shared step array and one value array per key."""

    __slots__ = (
        "async_copy",
        "device_rows",
        "dsig",
        "dtypes",
        "exclusive",
        "fill",
        "keys",
        "last_step",
        "length",
        "lock",
        "ptypes",
        "row_steps",
        "rows",
        "scalar_dtype",
        "shapes",
        "steps",
        "values",
    )

    def __init__(
        self,
        keys: tuple[str, ...],
        dtypes: tuple[np.dtype, ...],
        shapes: tuple[tuple[int, ...], ...],
        capacity: int = 0,
    ):
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        room = _MIN_CAPACITY_BYTES // _row_bytes(self.dtypes, shapes)
        cap = max(capacity, min(_MIN_CAPACITY, room), 1)
        self.lock = threading.Lock()
        self.keys = keys
        self.shapes = shapes
        self.steps = np.empty(cap, np.int64)
        self.values = [
            np.zeros((cap, *s), d) for d, s in zip(self.dtypes, shapes, strict=True)
        ]
        self.fill = 0  # rows in the arrays
        # staged rows after them: tuples, or one array for a packed device row
        self.rows: list[tuple | jax.Array | np.ndarray] = []
        self.row_steps: list[int] = []
        self.device_rows: list[int] = []  # staged rows holding device arrays
        self.length = 0
        self.last_step: int | None = None
        self.ptypes: tuple | None = None  # Python types of the last fast-path row
        # (type, dtype, shape, sharding) of each value of the last all-device row
        # that passed the checks: later rows that match it skip them.
        self.dsig: tuple | None = None
        self.async_copy = True  # start copies to the host (not on CPU devices)
        self.scalar_dtype = _scalar_dtype(self.dtypes, shapes)
        # The name index (Tables.index) in which no other table held any of
        # these keys, when that was last checked: an index is never changed
        # once built, so the same object needs no second check.
        self.exclusive: dict | None = None

    @classmethod
    def from_arrays(
        cls, keys: tuple[str, ...], steps: np.ndarray, values: list[np.ndarray]
    ) -> Table:
        table = cls.__new__(cls)
        table.lock = threading.Lock()
        table.keys = keys
        table.dtypes = tuple(v.dtype for v in values)
        table.shapes = tuple(v.shape[1:] for v in values)
        table.steps = steps
        table.values = list(values)
        table.fill = table.length = len(steps)
        table.rows, table.row_steps, table.device_rows = [], [], []
        table.last_step = int(steps[-1]) if len(steps) else None
        table.ptypes = table.dsig = table.exclusive = None
        table.async_copy = True
        table.scalar_dtype = _scalar_dtype(table.dtypes, table.shapes)
        return table

    def append(
        self, step: int, row: tuple | jax.Array, on_device: bool = False
    ) -> None:
        """Stages one row (the caller holds :attr:`lock` and owns the table's end:
        its state sees all ``length`` rows)."""
        if on_device:
            self.device_rows.append(len(self.rows))
        self.rows.append(row)
        self.row_steps.append(step)
        self.last_step = step
        self.length += 1
        if len(self.rows) >= STAGE:
            self.move_stage()

    def append_at(self, n: int, step: int, row: tuple) -> bool:
        """Stages one row of host values after the first ``n`` rows, where the
        table has exactly ``n`` (the caller's state owns its end); False, and
        nothing done, where another state appended first (then copy: see
        :func:`~jaxhistory._appending.append_row`). Takes :attr:`lock`."""
        if speedups is not None:  # the same, compiled (2: staged, the stage full)
            staged = speedups.stage(self, n, step, row, STAGE)
            if staged == 2:
                self.flush()
            return staged > 0
        with self.lock:
            if self.length != n:
                return False
            self.rows.append(row)
            self.row_steps.append(step)
            self.last_step = step
            self.length = n + 1
            if len(self.rows) >= STAGE:
                self.move_stage()
            return True

    def extend(self, steps: np.ndarray, columns: list[np.ndarray]) -> None:
        """Appends many rows at once from host arrays, one per key (the caller
        holds :attr:`lock`)."""
        self.move_stage()
        k = len(steps)
        self._reserve(self.fill + k)
        self.steps[self.fill : self.fill + k] = steps
        for dst, src in zip(self.values, columns, strict=True):
            dst[self.fill : self.fill + k] = src
        self.fill += k
        self.length = self.fill
        if k:
            self.last_step = int(steps[-1])

    def flush(self) -> None:
        """Moves the staged rows into the arrays, fetching device values."""
        with self.lock:
            self.move_stage()

    def move_stage(self) -> None:
        """:meth:`flush` for a caller that holds :attr:`lock`."""
        if not self.rows:
            return
        rows = self.rows
        if self.device_rows:
            rows = list(rows)
            # Their copies to the host were started when they were recorded, so
            # reading them is cheap; jax.device_get would start each copy again.
            asarray = _host_array
            lost: dict[int, list[str]] = {}
            for i in self.device_rows:
                row = rows[i]
                try:
                    if type(row) is tuple:
                        rows[i] = tuple([asarray(v) for v in row])
                    else:  # a packed row (one array for the whole row), in C order
                        rows[i] = np.ravel(asarray(row))
                except Exception:
                    rows[i], lost[self.row_steps[i]] = self._unreadable(row)
            if lost:
                steps = ", ".join(map(str, list(lost)[:10]))
                more = f" and {len(lost) - 10} more" if len(lost) > 10 else ""
                names = sorted({n for ns in lost.values() for n in ns})
                warnings.warn(
                    f"device values recorded at step {steps}{more} could not be "
                    f"read and are stored as NaN (0 for integers): {'; '.join(names)}"
                    ". Keep recorded arrays alive (do not donate or delete them) "
                    "until the history reads them",
                    RuntimeWarning,
                    stacklevel=3,
                )
        k = len(rows)
        self._reserve(self.fill + k)
        a, b = self.fill, self.fill + k
        self.steps[a:b] = self.row_steps
        block = None
        if self.scalar_dtype is not None:
            # Scalar rows of one float dtype: convert them all in one pass.
            try:
                flat = itertools.chain.from_iterable(rows)
                block = np.fromiter(flat, self.scalar_dtype, count=k * len(self.keys))
            except (TypeError, ValueError, OverflowError):
                block = None
        if block is not None:
            block = block.reshape(k, len(self.keys))
            for j, dst in enumerate(self.values):
                dst[a:b] = block[:, j]
        else:
            for name, dst, column in zip(
                self.keys, self.values, zip(*rows, strict=True), strict=True
            ):
                if dst.ndim > 1:  # arrays: each straight into its row (stacking
                    _put_rows(name, dst, a, column)  # them first copied each twice)
                    continue
                try:
                    dst[a:b] = np.asarray(column, dst.dtype)
                except (TypeError, ValueError, OverflowError):
                    dst[a:b] = [_coerce(name, v, dst.dtype) for v in column]
        self.fill = b
        self.rows, self.row_steps, self.device_rows = [], [], []

    def _unreadable(self, row) -> tuple[tuple, list[str]]:
        """A staged row whose device values cannot be read any more (deleted or
        donated after it was recorded): those values become NaN (0 for integer
        metrics); returns the row and what was lost."""
        values = row if type(row) is tuple else (row,) * len(self.keys)
        out, lost = [], []
        for j, (name, value) in enumerate(zip(self.keys, values, strict=True)):
            try:
                v = np.asarray(value)
                out.append(v if type(row) is tuple else v.reshape(-1)[j])
            except Exception as err:
                dtype, shape = self.dtypes[j], self.shapes[j]
                out.append(np.full(shape, np.nan if dtype.kind == "f" else 0, dtype))
                lost.append(f"{name!r} ({err})")
        return tuple(out), lost

    def _reserve(self, need: int) -> None:
        cap = len(self.steps)
        if need <= cap:
            return
        # Double up to 262,144 rows or 1 GiB (each row is copied about once in
        # all), then grow by an eighth: at most 12.5% slack on long runs (1M
        # steps x 16 float64 metrics stay under 10 bytes per value).
        small = cap < 1 << 18 and cap * _row_bytes(self.dtypes, self.shapes) < (
            _DOUBLING_BYTES
        )
        cap = max(need, 2 * cap if small else cap + max(cap // 8, 1))
        steps = np.empty(cap, np.int64)
        steps[: self.fill] = self.steps[: self.fill]
        values = []
        for old in self.values:
            new = np.zeros((cap, *old.shape[1:]), old.dtype)
            new[: self.fill] = old[: self.fill]
            values.append(new)
        self.steps, self.values = steps, values

    def step_at(self, n: int) -> int | None:
        """The step of row ``n - 1``, the last one a view of ``n`` rows sees."""
        if n == 0:
            return None
        with self.lock:
            if n <= self.fill:
                return int(self.steps[n - 1])
            return self.row_steps[n - 1 - self.fill]

    def prefix(self, n: int, dtypes: tuple[np.dtype, ...] | None = None) -> Table:
        """A new table holding a copy of the first ``n`` rows (optionally retyped)."""
        with self.lock:
            return self.prefix_locked(n, dtypes)

    def prefix_locked(
        self, n: int, dtypes: tuple[np.dtype, ...] | None = None
    ) -> Table:
        """:meth:`prefix` for a caller that holds :attr:`lock`."""
        if n > self.fill:
            self.move_stage()
        new = Table(self.keys, dtypes or self.dtypes, self.shapes, 2 * n)
        new.steps[:n] = self.steps[:n]
        for dst, src in zip(new.values, self.values, strict=True):
            dst[:n] = src[:n]
        new.fill = new.length = n
        new.last_step = int(self.steps[n - 1]) if n else None
        return new

    def view(self, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Read-only arrays of the first ``n`` steps and of each key's values."""
        with self.lock:
            if n > self.fill:
                self.move_stage()
            out = [self.steps[:n].view(), *(v[:n].view() for v in self.values)]
        for a in out:
            a.flags.writeable = False
        return out[0], out[1:]

    def column(self, n: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Read-only arrays of the first ``n`` steps and of key ``j``'s values
        (one column: :meth:`view` of a table with many keys costs a view each)."""
        with self.lock:
            if n > self.fill:
                self.move_stage()
            steps, values = self.steps[:n].view(), self.values[j][:n].view()
        steps.flags.writeable = values.flags.writeable = False
        return steps, values

    def leaves(self, n: int) -> list[Any]:
        """The pytree leaves of a view of ``n`` rows (steps, then each key's
        values), without waiting for device values: NumPy arrays where every row
        is on the host (or ready), else :class:`PendingColumn` placeholders that
        read the rows when converted with ``np.asarray``."""
        with self.lock:
            if n > self.fill:
                if not self._stage_ready(n - self.fill):
                    return [
                        PendingColumn(self, n, j) for j in range(-1, len(self.keys))
                    ]
                self.move_stage()
            steps, values = self.steps[:n].view(), [v[:n].view() for v in self.values]
        for a in (steps, *values):
            a.flags.writeable = False
        return [steps, *values]

    def _stage_ready(self, k: int) -> bool:
        """Whether the device values of the first ``k`` staged rows are computed."""
        for i in self.device_rows:
            if i >= k:
                break
            row = self.rows[i]
            for v in row if type(row) is tuple else (row,):
                if not is_done(v):  # (deleted: reading it will say so)
                    return False
        return True

    def nbytes(self) -> int:
        return self.steps.nbytes + sum(v.nbytes for v in self.values)


def _add_meta(meta: dict, keys: tuple[str, ...], table: Table) -> None:
    for name, dtype, shape in zip(keys, table.dtypes, table.shapes, strict=True):
        have = meta.get(name)
        dtype = dtype if have is None else np.result_type(have[1], dtype)
        meta[name] = (tuple(shape), dtype)


def _put_rows(name: str, dst: np.ndarray, a: int, column: tuple) -> None:
    """Writes the staged array values ``column`` into ``dst`` from row ``a``."""
    for i, value in enumerate(column, a):
        try:
            dst[i] = value
        except (TypeError, ValueError, OverflowError):
            dst[i] = _coerce(name, value, dst.dtype)


def _scalar_dtype(dtypes, shapes) -> np.dtype | None:
    """The dtype shared by all columns if they are float scalars, else None."""
    one = dtypes and all(s == () for s in shapes) and len(set(dtypes)) == 1
    return dtypes[0] if one and dtypes[0].kind == "f" else None


@jax.tree_util.register_pytree_node_class
class Tables:
    """The data of one history state: each table and how many of its rows it sees.

    As a pytree, its leaves are each table's step array followed by its value
    arrays; the key sets are static.
    """

    __slots__ = ("_index", "_meta", "all_steps", "tables")
    _index: dict[str, list[tuple[str, ...]]] | None
    _meta: dict[str, tuple[tuple[int, ...], np.dtype]] | None

    def __init__(self, tables: dict[tuple[str, ...], tuple[Table, int]] | None = None):
        self.tables = {} if tables is None else tables
        self._index = self._meta = None
        self.all_steps: np.ndarray | None = None  # the union of steps, once read

    def index(self) -> dict[str, list[tuple[str, ...]]]:
        """Metric name -> the key sets of the tables holding it, in recording
        order; built on first use (a state's tables never change after it is
        made), so reading many metrics of a state with many tables is linear."""
        if self._index is not None:
            return self._index
        index: dict[str, list[tuple[str, ...]]] = {}
        meta: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for keys, (table, n) in self.tables.items():
            for name in keys:
                index.setdefault(name, []).append(keys)
            if n and isinstance(table, Table):
                _add_meta(meta, keys, table)
        # The meta first: a state derived on another thread copies the index
        # first, so seeing the index means seeing its meta too (never a torn pair).
        self._meta = meta
        self._index = index
        return index

    def meta(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Metric name -> (record shape, dtype its values read back as) over the
        tables with rows that hold it."""
        if self._meta is None:
            self.index()
        assert self._meta is not None  # index() sets it (before the index)
        return self._meta

    def _unknown(self, name: str) -> KeyError:
        known = ", ".join(self.index()) or "none"
        return KeyError(f"no metric {name!r}; recorded: {known}")

    def parts(self, name: str) -> list[tuple[Table, int, int]]:
        """(table, rows seen, column) of every table with rows holding ``name``
        (KeyError naming the recorded metrics where none holds it)."""
        tables = self.tables
        parts = []
        keysets = self.index().get(name)
        if keysets is None:
            raise self._unknown(name)
        for ks in keysets:
            t, n = tables[ks]
            if n:
                parts.append((t, n, ks.index(name)))
        return parts

    def records(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The steps and values of ``name`` in step order (read-only arrays)."""
        parts = self.parts(name)
        if len(parts) == 1:
            t, n, j = parts[0]
            return t.column(n, j)
        if not parts:
            ks = self.index()[name][0]
            return self.tables[ks][0].column(0, ks.index(name))
        step_parts, value_parts = [], []
        for t, n, j in parts:
            s, v = t.column(n, j)
            step_parts.append(s)
            value_parts.append(v)
        steps, values = np.concatenate(step_parts), np.concatenate(value_parts)
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
        steps.flags.writeable = values.flags.writeable = False
        return steps, values

    def meta_of(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype ``name`` reads back as (records in several tables are
        promoted to one) and the shape of one record."""
        found = self.meta().get(name)
        if found is not None:
            return found[1], found[0]
        index = self.index()
        if name not in index:
            raise self._unknown(name)
        table = self.tables[index[name][0]][0]  # no rows: its declared type
        j = index[name][0].index(name)
        return np.dtype(table.dtypes[j]), tuple(table.shapes[j])

    def step_union(self) -> np.ndarray:
        """The sorted union of every table's steps (read-only; computed once:
        the tables of a state never change)."""
        if self.all_steps is not None:
            return self.all_steps
        parts = [t.view(n)[0] for t, n in self.tables.values() if n]
        if not parts:
            steps = np.zeros(0, np.int64)
        elif len(parts) == 1:
            steps = parts[0]  # a table's steps strictly increase already
        else:
            steps = np.sort(np.concatenate(parts))  # faster than np.unique here
            keep = np.ones(len(steps), bool)
            keep[1:] = steps[1:] != steps[:-1]
            steps = steps[keep]
        steps.flags.writeable = False
        self.all_steps = steps
        return steps

    def pickled(self) -> list[tuple]:
        """The rows the state sees, table by table, as NumPy arrays (device
        values are read now), for pickling: the tables' locks stay behind."""
        out = []
        for keys, (table, n) in self.tables.items():
            if isinstance(table, Table):
                steps, values = table.view(n)
                out.append((keys, steps, values, table.dtypes, table.shapes))
            else:  # placeholders from a tree transformation
                out.append((keys, table, n, None, None))
        return out

    @classmethod
    def unpickled(cls, pickled: list[tuple]) -> Tables:
        """The tables :meth:`pickled` gave."""
        tables: dict = {}
        for keys, steps, values, dtypes, shapes in pickled:
            if dtypes is None:
                tables[keys] = (steps, values)
            elif len(steps):
                tables[keys] = (
                    Table.from_arrays(keys, steps, list(values)),
                    len(steps),
                )
            else:  # no rows yet: the declared types
                tables[keys] = (Table(keys, dtypes, shapes), 0)
        return cls(tables)

    @classmethod
    def derived(
        cls,
        parent: Tables,
        tables: dict,
        appended: tuple[str, ...] | None = None,
        same: bool = False,
    ) -> Tables:
        """``tables`` as the data of a state made from ``parent``'s:
        ``appended`` names the one key set whose entry differs from
        ``parent``'s (its index is then carried over); ``same``: a row was
        appended in place to a table of ``parent``'s (same index)."""
        data = _new_tables()
        data.tables = tables
        data.all_steps = None
        if same:
            data._index, data._meta = parent._index, parent._meta
        elif appended is None or parent._index is None:
            data._index = data._meta = None
        else:
            old = parent.tables.get(appended)
            if old is not None and old[1] and old[0] is tables[appended][0]:
                data._index, data._meta = parent._index, parent._meta  # appended
            else:
                data._index = data._meta = None
                data.carry(parent, appended)
        return data

    def carry(self, parent: Tables, keys: tuple[str, ...]) -> None:
        """Takes ``parent``'s index, where built, updated for a row appended to
        ``keys`` (this object is ``parent``'s tables with that one entry changed):
        recording a new key set costs O(its keys), not O(tables)."""
        index, meta = parent._index, parent._meta
        if index is None:
            return
        assert meta is not None  # set before the index (see index())
        table = self.tables[keys][0]
        old = parent.tables.get(keys)
        if old is not None and old[1] and old[0].dtypes == table.dtypes:
            self._index, self._meta = index, meta
            return
        if old is None:
            index = index.copy()
            for name in keys:
                index[name] = [*index.get(name, ()), keys]
        meta = meta.copy()
        _add_meta(meta, keys, table)
        self._index, self._meta = index, meta

    def tree_flatten(self):
        leaves = []
        for table, n in self.tables.values():
            if isinstance(table, Table):
                leaves += table.leaves(n)
            else:  # placeholders from a tree transformation
                leaves += list(table)
        return leaves, tuple(self.tables)

    @classmethod
    def tree_unflatten(cls, keysets, leaves):
        tables, i = {}, 0
        for keys in keysets:
            steps, values = leaves[i], list(leaves[i + 1 : i + 1 + len(keys)])
            i += 1 + len(keys)
            arrays = [steps, *values]
            source = _pending_source(arrays)
            if source is not None:  # flattened and rebuilt as it was
                tables[keys] = source
            elif all(map(_concrete, arrays)):
                # JAX arrays (a jitted function's output, device_put) are read
                # to the host: a state keeps its records in NumPy
                steps, *values = jax.device_get(arrays)
                # arrays the caller may change later are copied (this
                # state's own read-only views are not)
                steps = _kept(np.asarray(steps, np.int64))
                values = [_kept(np.asarray(v)) for v in values]
                tables[keys] = (Table.from_arrays(keys, steps, values), len(steps))
            else:
                tables[keys] = (tuple(arrays), None)
        return cls(tables)


class PendingColumn:
    """A leaf of a flattened history whose rows hold device values not computed
    yet: it reads them (waiting for the device) when converted with
    ``np.asarray``, as ``jax.device_get`` does. ``shape`` and ``dtype`` are
    known without waiting."""

    __slots__ = ("column", "n", "table")

    def __init__(self, table: Table, n: int, column: int):
        self.table, self.n, self.column = table, n, column

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int64) if self.column < 0 else self.table.dtypes[self.column]

    @property
    def shape(self) -> tuple[int, ...]:
        if self.column < 0:
            return (self.n,)
        return (self.n, *self.table.shapes[self.column])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.n

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        steps, values = self.table.view(self.n)
        arr = steps if self.column < 0 else values[self.column]
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)
        return np.array(arr) if copy else arr

    def __repr__(self) -> str:
        return f"PendingColumn(shape={self.shape}, dtype={self.dtype})"


def _kept(array: np.ndarray) -> np.ndarray:
    """``array``, copied where it is writable (the caller's own)."""
    return array.copy() if array.flags.writeable else array


def _concrete(leaf: Any) -> bool:
    """Whether ``leaf`` holds values: a NumPy array, or a JAX array that is
    not a tracer (not a placeholder of a tree transformation)."""
    if isinstance(leaf, np.ndarray):
        return True
    return isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def _pending_source(leaves: list) -> tuple[Table, int] | None:
    """(table, n) when ``leaves`` are all the placeholders of one table view."""
    first = leaves[0]
    if type(first) is not PendingColumn:
        return None
    for j, leaf in enumerate(leaves):
        if (
            type(leaf) is not PendingColumn
            or leaf.table is not first.table
            or leaf.n != first.n
            or leaf.column != j - 1
        ):
            return None
    return first.table, first.n


def _host_array(value: Any) -> np.ndarray:
    """A staged value as a NumPy array: from its stacked transfer where it
    took one (:func:`~jaxhistory._host_copies.to_host`). A JAX array
    replicated over several devices is read from one of them: ``np.asarray``
    of the whole array costs 2-3x more (21 against 15 µs on 8 CPU devices, 18
    against 8 µs with two processes)."""
    sharding = getattr(value, "sharding", None)
    if sharding is not None:
        host = host_copies.read(value)
        if host is not None:
            return host
    if (
        sharding is not None
        and sharding.is_fully_replicated
        and len(sharding.device_set) > 1
    ):
        value = value.addressable_data(0)
    return np.asarray(value)


def device_signature(row: tuple) -> tuple | None:
    """(type, dtype, shape, sharding) of each value, or None unless every value is a
    JAX array. Rows with the signature of a checked row need no checks again."""
    try:
        return tuple([(type(v), v.dtype, v.shape, v.sharding) for v in row])
    except Exception:  # host values have no sharding; tracers may raise anything
        return None


def needs_host_copy(arrays) -> bool:
    """Whether starting copies to the host helps: not for arrays on CPU devices."""
    for a in arrays:
        devices = getattr(a.sharding, "device_set", ())
        if any(d.platform != "cpu" for d in devices):
            return True
    return False


class InFlight:
    """Bounds how many groups of device values (one per table an update
    writes) may be unresolved at once."""

    __slots__ = ("limit", "lock", "updates")

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()
        self.updates: list[list[jax.Array]] = []

    def add(self, arrays: list[jax.Array], copy: bool = True) -> None:
        """Queues one update's device arrays, sending them to the host when
        ``copy`` (pointless for CPU devices, whose buffers are host memory:
        there it only costs host time): scalars go in one stacked transfer
        with others (:class:`~jaxhistory._host_copies.HostCopies`), anything
        else starts its own copy now."""
        if copy:
            host_copies.stage(arrays)
        with self.lock:
            self.updates.append(arrays)
            if len(self.updates) <= self.limit:
                return
            # Wait for the oldest half; their copies to the host started long ago.
            # They leave the queue first, so a failed wait cannot jam it.
            cut = len(self.updates) - self.limit // 2
            oldest = [a for u in self.updates[:cut] for a in u if not _deleted(a)]
            del self.updates[:cut]
            # A deleted (donated) array has nothing to wait for; it is reported
            # when its row is read.
            jax.block_until_ready(oldest)


def _deleted(a) -> bool:
    is_deleted = getattr(a, "is_deleted", None)
    return is_deleted is not None and is_deleted()


_new_tables = functools.partial(object.__new__, Tables)
