"""New states' tables made from whole states: a selection of metrics, and two
histories merged; and whether two states hold the same records."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from jaxhistory._codec import later_wins
from jaxhistory._dtypes import common_dtype
from jaxhistory._table import Table

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["before", "merged", "same_records", "selected"]


def same_records(a: HistoryState, b: HistoryState) -> bool:
    """Whether ``a`` and ``b`` hold the same metrics with the same steps, values
    (NaN equal to NaN), dtypes and shapes, however their records are split
    into tables. States from a tree transformation (placeholder leaves) are the
    same only where their leaves are the same objects."""
    if any(not isinstance(t, Table) for s in (a, b) for t, _ in s.data.tables.values()):
        if a.data.tables.keys() != b.data.tables.keys():
            return False
        left, right = a.data.tree_flatten()[0], b.data.tree_flatten()[0]
        return len(left) == len(right) and all(map(operator.is_, left, right))
    if set(a.keys) != set(b.keys):
        return False
    for name in a.keys:
        if a.dtype(name) != b.dtype(name) or a.shape(name) != b.shape(name):
            return False
        steps, values = a.records(name)
        other_steps, other_values = b.records(name)
        if not np.array_equal(steps, other_steps):
            return False
        nan = values.dtype.kind in "fc"
        if not np.array_equal(values, other_values, equal_nan=nan):
            return False
    return True


def selected(state: HistoryState, prefixes: tuple) -> dict:
    """The tables of the metrics under ``prefixes`` (``HistoryState.select``)."""
    for p in prefixes:
        if type(p) is not str:
            raise TypeError(
                "select takes metric name prefixes as str, got "
                f"{type(p).__name__} {p!r:.60}"
            )
    heads = [p.rstrip("/") for p in prefixes]

    def wanted(k: str) -> bool:
        return any(k == h or k.startswith(h + "/") for h in heads)

    tables: dict = {}
    parts: dict[tuple, list] = {}  # key set -> rows taken out of wider tables
    for ks, (t, n) in state.data.tables.items():
        idx = [j for j, k in enumerate(ks) if wanted(k)]
        if len(idx) == len(ks):
            tables[ks] = (t, n)
        elif idx:
            steps, values = t.view(n)
            sub = tuple(ks[j] for j in idx)
            tables.setdefault(sub, None)  # (its place in recording order)
            parts.setdefault(sub, []).append((steps, [values[j] for j in idx]))
    for sub, rows in parts.items():
        # a key set that is also a table of its own, or that several wider
        # tables narrow to, holds the rows of all of them, in step order
        whole = tables[sub]
        if whole is not None and whole[1]:
            rows.insert(0, whole[0].view(whole[1]))
        steps = np.concatenate([r[0] for r in rows])
        cols = [np.concatenate([r[1][j] for r in rows]) for j in range(len(sub))]
        if len(rows) > 1:
            order = np.argsort(steps, kind="stable")
            steps, cols = steps[order], [c[order] for c in cols]
        tables[sub] = (Table.from_arrays(sub, steps, cols), len(steps))
    return tables


def merged(state: HistoryState, other: HistoryState) -> dict:
    """The tables of ``state`` and ``other`` combined (``HistoryState.merge``)."""
    new = {}
    for name in dict.fromkeys((*state.keys, *other.keys)):
        parts = [h.records(name) for h in (state, other) if name in h]
        if len(parts) == 2 and parts[0][1].shape[1:] != parts[1][1].shape[1:]:
            raise ValueError(
                f"metric {name!r} has shape {parts[0][1].shape[1:]} here and "
                f"{parts[1][1].shape[1:]} in the other history"
            )
        dtype = common_dtype(name, [p[1] for p in parts])
        steps, values = later_wins(  # other's record wins
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts], dtype=dtype, casting="unsafe"),
        )
        new[(name,)] = (Table.from_arrays((name,), steps, [values]), len(steps))
    return new


def before(state: HistoryState, step: int) -> dict:
    """Each metric of ``state`` that has records before ``step``, as
    ``(steps, values)`` copies of them."""
    columns = {}
    for name in state.keys:
        steps, values = state.records(name)
        keep = steps < step
        if keep.any():
            columns[name] = (np.array(steps[keep]), np.array(values[keep]))
    return columns
