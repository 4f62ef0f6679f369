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
"""

from __future__ import annotations

import itertools
import warnings

import jax
import numpy as np

__all__ = ["STAGE", "Table", "Tables"]

STAGE = 256  # rows staged before a bulk move into NumPy
_MIN_CAPACITY = 64


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
        "fill",
        "keys",
        "last_step",
        "length",
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
        cap = max(capacity, _MIN_CAPACITY)
        self.keys = keys
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = shapes
        self.steps = np.empty(cap, np.int64)
        self.values = [
            np.zeros((cap, *s), d) for d, s in zip(self.dtypes, shapes, strict=True)
        ]
        self.fill = 0  # rows in the arrays
        self.rows: list[tuple] = []  # staged rows after them
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

    @classmethod
    def from_arrays(
        cls, keys: tuple[str, ...], steps: np.ndarray, values: list[np.ndarray]
    ) -> Table:
        table = cls.__new__(cls)
        table.keys = keys
        table.dtypes = tuple(v.dtype for v in values)
        table.shapes = tuple(v.shape[1:] for v in values)
        table.steps = steps
        table.values = list(values)
        table.fill = table.length = len(steps)
        table.rows, table.row_steps, table.device_rows = [], [], []
        table.last_step = int(steps[-1]) if len(steps) else None
        table.ptypes = table.dsig = None
        table.async_copy = True
        table.scalar_dtype = _scalar_dtype(table.dtypes, table.shapes)
        return table

    def append(self, step: int, row: tuple, on_device: bool = False) -> None:
        if on_device:
            self.device_rows.append(len(self.rows))
        self.rows.append(row)
        self.row_steps.append(step)
        self.last_step = step
        self.length += 1
        if len(self.rows) >= STAGE:
            self.flush()

    def extend(self, steps: np.ndarray, columns: list[np.ndarray]) -> None:
        """Appends many rows at once from host arrays, one per key."""
        self.flush()
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
        if not self.rows:
            return
        rows = self.rows
        if self.device_rows:
            rows = list(rows)
            # Their copies to the host were started when they were recorded, so
            # reading them is cheap; jax.device_get would start each copy again.
            asarray = np.asarray
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
        # Double up to 262,144 rows (each row is copied about once in all), then
        # grow by an eighth: at most 12.5% slack on long runs (1M steps x 16
        # float64 metrics stay under 10 bytes per value).
        cap = max(need, 2 * cap if cap < 1 << 18 else cap + cap // 8)
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
        if n == self.length:
            return self.last_step
        if n <= self.fill:
            return int(self.steps[n - 1])
        return self.row_steps[n - 1 - self.fill]

    def prefix(self, n: int, dtypes: tuple[np.dtype, ...] | None = None) -> Table:
        """A new table holding a copy of the first ``n`` rows (optionally retyped)."""
        self.flush()
        new = Table(self.keys, dtypes or self.dtypes, self.shapes, 2 * n)
        new.steps[:n] = self.steps[:n]
        for dst, src in zip(new.values, self.values, strict=True):
            dst[:n] = src[:n]
        new.fill = new.length = n
        new.last_step = int(self.steps[n - 1]) if n else None
        return new

    def view(self, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Read-only arrays of the first ``n`` steps and of each key's values."""
        if n > self.fill:
            self.flush()
        out = [self.steps[:n].view(), *(v[:n].view() for v in self.values)]
        for a in out:
            a.flags.writeable = False
        return out[0], out[1:]

    def nbytes(self) -> int:
        return self.steps.nbytes + sum(v.nbytes for v in self.values)


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

    __slots__ = ("tables",)

    def __init__(self, tables: dict[tuple[str, ...], tuple[Table, int]] | None = None):
        self.tables = {} if tables is None else tables

    def tree_flatten(self):
        leaves = []
        for table, n in self.tables.values():
            if isinstance(table, Table):
                steps, values = table.view(n)
                leaves += [steps, *values]
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
            if all(isinstance(a, np.ndarray) for a in arrays):
                steps = np.asarray(steps, np.int64)
                tables[keys] = (Table.from_arrays(keys, steps, values), len(steps))
            else:
                tables[keys] = (tuple(arrays), None)
        return cls(tables)
