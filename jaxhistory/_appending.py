"""Appending to a HistoryState: the checks a row passes before it is stored
(its shapes, steps, dtypes and integers), the table it goes to, and the bulk
appends (a packed row of statistics, many steps from arrays).

:class:`~jaxhistory.HistoryState` keeps the fast paths of ``append`` and calls
these for everything else. Each function returns what changes (the key set,
its table, its row count, the latest step); the state builds the new state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from jaxhistory._dtypes import (
    ALL_FLOATS,
    INT64_MAX,
    PY_SCALARS,
    as_step,
    as_steps,
    check_ints,
    common_dtype,
    device_storage_dtype,
    first_inexact,
    host_value,
)
from jaxhistory._names import PROVENANCE, check_nul, empty_name, stat_names
from jaxhistory._row import Row, RowKind
from jaxhistory._stats import Stats
from jaxhistory._table import Table, device_signature, needs_host_copy

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = [
    "adds_as_float",
    "append_row",
    "appended",
    "check_append",
    "extended",
    "floats_hold",
    "packed",
    "placed",
    "prepare",
    "with_stats",
    "writable",
]

_EXACT_F = float(2**53)  # beyond this magnitude not every integer is a float64
_INT_TYPES = (int, bool)  # Python ints and bools: float64 in a float metric
# (module constants: a member read through its enum class costs a lookup)
_FLOATS, _NUMBERS, _VALUES = RowKind.FLOATS, RowKind.NUMBERS, RowKind.VALUES


def check_append(state: HistoryState, names, shapes, step: int) -> dict[str, np.dtype]:
    """Refuses recording ``names`` (records of ``shapes``) at ``step``.

    Raises ValueError if one is empty, holds a NUL or is named ``step``,
    changes shape or already has a record at ``step`` or later. Returns the
    stored dtype of each that has records. A step past every record needs only
    each name's shape (O(names)); an earlier one, one pass over the tables.
    """
    if "" in names:
        empty_name()
    check_nul(names)
    if "step" in names:  # (update takes a 'step' entry as the step)
        raise ValueError(
            "a metric may not be named 'step': it is every record's step "
            "coordinate (give the steps as step= or steps=)"
        )
    if step >= state.next_step:
        meta, found = state.data.meta(), {}
        for name, shape in zip(names, shapes, strict=True):
            have = meta.get(name)
            if have is None:
                continue
            if have[0] != tuple(shape):
                raise ValueError(
                    f"metric {name!r} changed shape from {have[0]} to {tuple(shape)}"
                )
            found[name] = have[1]
        return found
    wanted = dict(zip(names, shapes, strict=True))
    found = {}
    for ks, (t, n) in state.data.tables.items():
        if not n or wanted.keys().isdisjoint(ks):
            continue
        last = t.step_at(n)
        assert last is not None  # n > 0 rows: a last step
        for j, name in enumerate(ks):
            if name not in wanted:
                continue
            if t.shapes[j] != tuple(wanted[name]):
                raise ValueError(
                    f"metric {name!r} changed shape from {t.shapes[j]} to "
                    f"{tuple(wanted[name])}"
                )
            if step <= last:
                raise ValueError(
                    f"metric {name!r} was already recorded at step {last}; "
                    f"step {step} must be later (merge() combines runs)"
                )
            found[name] = t.dtypes[j]
    return found


def writable(
    state: HistoryState, keys, dtypes, shapes, capacity: int = 0
) -> tuple[Table, int]:
    """The table for ``keys`` that this state may append to, and its row count.

    A new table if there is none; a copy of this state's rows if the table has
    grown past them (a branch) or its dtypes must widen.
    """
    entry = state.data.tables.get(keys)
    if entry is None:
        return Table(keys, dtypes, shapes, capacity), 0
    table, n = entry
    wider = (
        dtypes
        if dtypes == table.dtypes
        else tuple(
            np.result_type(a, b) for a, b in zip(table.dtypes, dtypes, strict=True)
        )
    )
    if wider != table.dtypes:
        check_widening(table, n, wider)
    if wider != table.dtypes or table.length != n:
        table = table.prefix(n, wider)
    return table, n


def placed(state: HistoryState, entry, keys, row, ptypes, step, owned=False):
    """Where a row of device values (or of values that need the checks) goes:
    ``(table, rows seen, values, on_device)``. The same JAX arrays (types,
    dtypes, shapes, shardings) as a row that passed the checks, at a step past
    everything recorded, skip them; their copies to the host start here.
    ``owned``: the row's NumPy arrays are copies of its own (not copied again)."""
    dsig = None if entry is None else entry[0].dsig
    if dsig is not None and step >= state.next_step and device_signature(row) == dsig:
        table, n = entry
        state.inflight.add(row, table.async_copy)
        return table, n, row, True
    table, n, values, on_device = prepare(state, keys, row, ptypes, step, owned)
    if on_device:
        arrays = [v for v in values if isinstance(v, jax.Array)]
        state.inflight.add(arrays, table.async_copy)
    return table, n, values, on_device


def prepare(state: HistoryState, keys, row, ptypes, step, owned=False):
    """The slow path of update: validates every value; returns the table
    (``owned``: as for :func:`placed`)."""
    values, dtypes, shapes, on_device = [], [], [], False
    for name, value in zip(keys, row, strict=True):
        dtype = PY_SCALARS.get(type(value))
        if dtype is None:
            value, dtype, shape = host_value(name, value, not owned)
            on_device = on_device or isinstance(value, jax.Array)
        else:
            shape = ()
        values.append(value)
        dtypes.append(dtype)
        shapes.append(shape)
    found = check_append(state, keys, shapes, step)
    for i, value in enumerate(row):
        if (
            type(value) in _INT_TYPES
            and keys[i] in found
            and found[keys[i]].kind == "f"
        ):
            # a Python int or bool joins a float metric as float64 (a float32
            # metric widens: float32 would round ints past 2**24)
            dtypes[i] = np.result_type(found[keys[i]], np.float64)
    _check_mixing(state, keys, values, dtypes, found)
    table, n = writable(state, keys, tuple(dtypes), tuple(shapes))
    if ptypes is not ALL_FLOATS and int in ptypes:
        check_ints(keys, row, table.dtypes)
    check_exact(keys, values, table.dtypes, found)
    # Later rows with the same Python scalar types may skip these checks (not
    # where an ``iter`` entry was stored as a metric: it may be the step).
    if ptypes is ALL_FLOATS:
        scalars = all(d == np.float64 for d in table.dtypes)
    else:
        scalars = all(t in PY_SCALARS for t in ptypes)
    table.ptypes = ptypes if scalars and "iter" not in keys else None
    table.dsig = None
    if on_device:
        arrays = [v for v in values if isinstance(v, jax.Array)]
        table.async_copy = needs_host_copy(arrays)
        if len(arrays) == len(values) and "iter" not in keys:
            table.dsig = device_signature(tuple(values))
    return table, n, tuple(values), on_device


def _check_mixing(state: HistoryState, keys, values, dtypes, found) -> None:
    """Refuses a value whose dtype, beside the dtype its metric has in other
    key sets, would read back rounded: uint64 beside signed integers, or
    (host values) integers that float64 cannot hold beside floats."""
    for name, value, dtype in zip(keys, values, dtypes, strict=True):
        old = found.get(name)
        if old is None or old is dtype or old == dtype:  # (dtypes: singletons)
            continue
        if all(ks == keys for ks in state.data.index()[name]):
            continue  # its own table only: _writable checks the widening
        if np.result_type(old, dtype).kind != "f" or "f" == old.kind == dtype.kind:
            continue
        if old.kind in "iub" and dtype.kind in "iub":
            raise ValueError(
                f"metric {name!r} is stored as {old} and cannot take {dtype} "
                "values: float64 would round them; record it as "
                f"{old} (or merge histories, which keep integers exact)"
            )
        if not isinstance(value, jax.Array):  # (device values: not waited for)
            common_dtype(name, [np.asarray(state.values(name)), np.asarray(value)])


def _continues(state: HistoryState, names: tuple, step: int) -> bool:
    """Whether a packed row of ``names`` at ``step`` only continues their
    table: it has rows, all before ``step``, and no other table holds any of
    the names. Its first row was checked (unique names, each a scalar
    everywhere), so nothing is left to check: a packed row of thousands of
    statistics each step skips a pass over every table here."""
    data = state.data
    entry = data.tables.get(names)
    if (
        entry is None
        or not entry[1]
        # rows: a last step (step_at is None only for none)
        or not cast(int, entry[0].step_at(entry[1])) < step
    ):
        return False
    table, index = entry[0], data.index()
    if table.exclusive is index:  # checked against this very index before
        return True
    if set(map(len, map(index.__getitem__, names))) != {1}:
        return False
    table.exclusive = index
    return True


def packed(state: HistoryState, names: Any, vector: Any, step: Any):
    """:meth:`HistoryState.update_packed`'s checks and append: (the key set,
    its table, its row count, the step)."""
    names = tuple(names)
    if isinstance(vector, jax.core.Tracer):
        host_value(names[0] if names else "<packed>", vector)  # raises
    shape = tuple(np.shape(vector))
    if math.prod(shape) != len(names):
        raise ValueError(
            f"a packed row for {len(names)} metrics needs {len(names)} values "
            f"(read in C order), got shape {shape}"
        )
    step = as_step("step", state.next_step if step is None else step)
    if not _continues(state, names, step):
        if len(set(names)) != len(names):
            raise ValueError("packed metric names must be unique")
        check_append(state, names, [()] * len(names), step)
    on_device = isinstance(vector, jax.Array)
    label = names[0] if names else "<packed>"
    if on_device:  # replicated statistics may span processes: read locally
        dtype = device_storage_dtype(label, vector.dtype, 4)
    else:
        vector, dtype, _ = host_value(label, np.asarray(vector))
    table, n = writable(state, names, (dtype,) * len(names), ((),) * len(names))
    table.ptypes = None
    if on_device:
        if not n:
            table.async_copy = needs_host_copy([vector])
        state.inflight.add([vector], table.async_copy)
        table = append_row(table, n, step, vector, True)
    else:
        table = append_row(table, n, step, tuple(np.ravel(vector.astype(dtype))))
    return names, table, n + 1, step


def extended(state: HistoryState, steps: Any, values: Mapping[str, Any]):
    """:meth:`HistoryState.extend`'s checks and append: (the key set, its
    table, its row count, the latest step), or None where nothing is added."""
    values = dict(values)
    if isinstance(steps, jax.Array) or any(
        isinstance(v, jax.Array) for v in values.values()
    ):
        steps, values = jax.device_get((steps, values))  # one transfer for all
    steps = as_steps(steps)
    if steps.ndim != 1:
        raise ValueError(f"steps must be 1-D, got shape {steps.shape}")
    back = steps[1:] <= steps[:-1]
    if back.any():
        at = int(np.argmax(back))
        raise ValueError(
            f"steps must be strictly increasing, but step {steps[at]} (at index "
            f"{at}) is followed by {steps[at + 1]}; nothing of "
            f"{', '.join(map(repr, list(values)[:3]))} was recorded"
        )
    if not len(steps) or not values:
        return None
    keys = tuple(values)
    columns, dtypes, shapes = [], [], []
    for name in keys:
        arr, dtype, shape = host_value(name, values[name])
        if not shape or shape[0] != len(steps):
            raise ValueError(
                f"metric {name!r} has {shape[0] if shape else 0} records for "
                f"{len(steps)} steps"
            )
        columns.append(np.asarray(arr, dtype))
        dtypes.append(dtype)
        shapes.append(shape[1:])
    return _columns_in(state, steps, keys, columns, tuple(dtypes), tuple(shapes))


def _columns_in(state: HistoryState, steps, keys, columns, dtypes, shapes):
    """Appends checked host ``columns`` of ``keys`` (stored as ``dtypes``,
    records of ``shapes``) at ``steps`` (int64, increasing): the key set, its
    table, its row count and the latest step, as :func:`extended` returns."""
    check_append(state, keys, shapes, int(steps[0]))
    table, n = writable(state, keys, dtypes, shapes, len(steps))
    with table.lock:
        if table.length != n:  # a branch, or another thread got there first
            table = table.prefix_locked(n)
        table.extend(steps, columns)
    return keys, table, n + len(steps), int(steps[-1])


def check_widening(table: Table, n: int, wider: tuple) -> None:
    """Refuses to turn an integer column into floats that would round it."""
    for i, (old, new) in enumerate(zip(table.dtypes, wider, strict=True)):
        if old.kind in "iu" and new.kind == "f" and n:
            bad = first_inexact(table.view(n)[1][i])
            if bad is not None:
                raise ValueError(
                    f"metric {table.keys[i]!r} holds the integer {bad}, which {new} "
                    "cannot hold exactly; record it as float from its first step, "
                    "or keep it integer"
                )


def check_exact(keys: tuple, values: list, dtypes: tuple, before=None) -> None:
    """Refuses integers that a float column would round (``before``: each
    metric's dtype before this row, which the message names where the row
    widened it)."""
    for name, value, dtype in zip(keys, values, dtypes, strict=True):
        if dtype.kind != "f" or isinstance(value, jax.Array | float):
            continue
        bad = first_inexact(value)
        if bad is None:
            continue
        old = (before or {}).get(name)
        if old is not None and old.kind in "iub":  # (int64 and uint64: float64)
            raise ValueError(
                f"metric {name!r} is stored as {old}; a {np.asarray(value).dtype} "
                f"value would make it {dtype}, which cannot hold the integer {bad} "
                "exactly; record it in one integer type (or as float from its "
                "first step)"
            )
        raise ValueError(
            f"metric {name!r} is stored as {dtype} and cannot hold the integer "
            f"{bad} exactly; record it as float or keep it integer"
        )


def append_row(table: Table, n: int, step: int, row: Any, on_device: bool = False):
    """Appends ``row`` after the first ``n`` rows of ``table``; returns the table
    appended to: ``table`` itself when no state has rows past ``n`` in it, else a
    new table holding a copy of the ``n`` rows (a branch)."""
    with table.lock:
        if table.length == n:
            table.append(step, row, on_device)
            return table
        new = table.prefix_locked(n)
    new.ptypes, new.dsig, new.async_copy = table.ptypes, table.dsig, table.async_copy
    new.append(step, row, on_device)
    return new


def adds_as_float(values: tuple) -> bool:
    """Whether ``values`` add up as a Python float does (``sum`` returns an
    exact float only for Python floats and ints, or objects that act like
    them; NumPy and JAX values dispatch to their own arithmetic): a float64
    table takes them as it takes numbers."""
    if any(isinstance(v, np.generic) for v in values):
        # (never a Python float's sum; and summed, a float32 beside a float
        # past its range warned of an overflow in a cast)
        return False
    try:
        total = sum(values, 0.0)
    except Exception:  # strings, nested dicts, ints too large for a float
        return False
    return type(total) is float and -_EXACT_F < total < _EXACT_F


def floats_hold(values: tuple) -> bool:
    """Whether float64 holds every integer among ``values`` exactly (numbers
    only: a float64 table takes them without the checked path)."""
    return all(-_EXACT_F < v < _EXACT_F for v in values if type(v) is int)


def appended(state: HistoryState, row: Row, owned: bool = False):
    """What :meth:`HistoryState.append` of ``row`` changes: ``(tables,
    next_step, names, same)`` for the new state (``names``: the one key set
    whose entry changed, None for none; ``same``: the row went in place onto
    the end of a table of ``state``'s), or the new state itself where the row
    holds :class:`~jaxhistory.Stats` (recorded piece by piece). Raises as
    :meth:`HistoryState.update` does, nothing changed."""
    step, names, values, kind = row[:4]
    if step > INT64_MAX:  # the step after a record at the last int64 step
        raise ValueError(f"'step' is {step}, outside the int64 range of steps")
    tables = state.data.tables
    if not names:
        return dict(tables), max(state.next_step, step + 1), None, False
    entry = tables.get(names)
    if entry is not None and step >= state.next_step:
        table, n = entry
        if table.ptypes is ALL_FLOATS and (
            kind >= _FLOATS
            or (kind is _NUMBERS and floats_hold(values))
            or (kind is _VALUES and adds_as_float(values))
        ):
            # numbers into a float64 table that earlier all-float rows made: in
            # place where this state owns the table's end (not where an older
            # state appended again, or another thread first)
            in_place = table.append_at(n, step, values)
            if not in_place:
                table = append_row(table, n, step, values)
            new = tables.copy()
            new[names] = (table, n + 1)
            return new, step + 1, names, in_place and n > 0
    if kind is _VALUES and Stats in set(map(type, values)):
        # each Stats is one packed row (its whole table, still on device if it
        # is), named {key}/{metric}/{stat}
        return with_stats(state, row, owned)
    ptypes = ALL_FLOATS if kind >= _FLOATS else tuple(map(type, values))
    if entry is not None and entry[0].ptypes == ptypes and step >= state.next_step:
        # same metrics, same Python scalar types as last time, a step past
        # everything recorded
        table, n = entry
        if kind < _FLOATS:
            check_ints(names, values, table.dtypes)
        table = append_row(table, n, step, values)
        new = tables.copy()
        new[names] = (table, n + 1)
        return new, step + 1, names, False
    table, n, values, on_device = placed(
        state, entry, names, values, ptypes, step, owned
    )
    table = append_row(table, n, step, values, on_device)
    new = tables.copy()
    new[names] = (table, n + 1)
    return new, max(state.next_step, step + 1), names, False


def with_stats(state: HistoryState, row: Row, owned: bool = False) -> HistoryState:
    """``state`` with ``row``, which holds :class:`~jaxhistory.Stats` values:
    each recorded as one packed row named ``{key}/{metric}/{stat}``
    (``owned``: as for :meth:`HistoryState.append`)."""
    step = row.step
    plain = [
        (n, v)
        for n, v in zip(row.names, row.values, strict=True)
        if type(v) is not Stats
    ]
    out = state
    if plain:
        names, values = zip(*plain, strict=True)
        out = state.append(Row(step, names, values, RowKind.VALUES), owned=owned)
    for key, stats in zip(row.names, row.values, strict=True):
        if type(stats) is Stats:
            prefix = f"{key}/" if key else ""
            names = stat_names(stats.names, prefix, stats.rows)
            out = out.update_packed(names, stats.table, step=step)
            if stats.where is not None:  # provenance: device indices
                names = stat_names(stats.names, prefix, PROVENANCE)
                out = out.update_packed(names, stats.where, step=step)
    return out


def _layout(row: Row) -> tuple | None:
    """What makes rows extend the same tables in one call: a row of one
    host :class:`~jaxhistory.Stats` (named ``""``) and NumPy scalars, as a
    batch reduced on the host gives; None for any other row."""
    values = row.values
    if row.kind is not RowKind.VALUES or not row.names or row.names[0] != "":
        return None
    stats = values[0]
    if type(stats) is not Stats or not isinstance(stats.table, np.ndarray):
        return None
    if not all(type(v) is not Stats and isinstance(v, np.generic) for v in values[1:]):
        return None
    where = stats.where
    if where is not None and not isinstance(where, np.ndarray):
        return None
    return (row.names, stats.names, stats.rows, where is not None)


def rows_extended(state: HistoryState, rows: list[Row]) -> HistoryState | None:
    """``state`` with ``rows`` appended in one append of host columns per
    table (the tables, dtypes and records that appending them one by one
    gives); None (nothing done) unless they share one :func:`_layout` and
    their steps increase."""
    layout = _layout(rows[0])
    steps = [r.step for r in rows]
    if layout is None or any(b <= a for a, b in itertools.pairwise(steps)):
        return None
    if any(_layout(r) != layout for r in rows[1:]):
        return None
    names, metrics, stat_rows, provenance = layout
    at = np.asarray(steps, np.int64)
    blocks = []
    if len(names) > 1:  # first, as with_stats records them
        plain = [np.asarray([r.values[i] for r in rows]) for i in range(1, len(names))]
        blocks.append((names[1:], plain))
    tables = [r.values[0].table for r in rows]
    blocks.append((stat_names(metrics, "", stat_rows), _columns(tables, len(rows))))
    if provenance:
        wheres = [r.values[0].where for r in rows]
        blocks.append(
            (stat_names(metrics, "", PROVENANCE), _columns(wheres, len(rows)))
        )
    out = state
    for keys, columns in blocks:
        out = _columns_appended(out, at, tuple(keys), columns)
    return out


def _columns(tables: list[np.ndarray], count: int) -> list[np.ndarray]:
    """Each row's ``(a, b)`` table, stacked: ``a * b`` columns of ``count``."""
    stacked = np.stack(tables).astype(np.result_type(*tables), copy=False)
    return list(stacked.reshape(count, -1).T)


def _columns_appended(
    state: HistoryState, steps: np.ndarray, keys: tuple[str, ...], columns: list
) -> HistoryState:
    """:meth:`HistoryState.extend` for columns made here (numeric NumPy
    arrays, one record per step, steps int64 and increasing): the same checks
    of the names and steps, none of the values'. Where a column is not such an
    array, :meth:`HistoryState.extend` itself."""
    dtypes = []
    for name, column in zip(keys, columns, strict=True):
        kind = getattr(column, "dtype", None)
        try:  # what a host array of it is stored as, where it is kept as is
            dtype = None if kind is None else device_storage_dtype(name, kind, 4)
        except TypeError:
            dtype = None
        if (
            type(column) is not np.ndarray
            or dtype != kind
            or column.shape != steps.shape
        ):
            return state.extend(steps, dict(zip(keys, columns, strict=True)))
        dtypes.append(dtype)
    scalars = ((),) * len(keys)
    change = _columns_in(state, steps, keys, columns, tuple(dtypes), scalars)
    return state.extended_with(*change)
