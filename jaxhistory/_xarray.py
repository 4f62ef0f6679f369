"""HistoryState <-> xarray.Dataset, exactly.

Layout: a ``step`` coordinate (the sorted union of every metric's steps), one data
variable per metric under its own name (``loss``, ``train/loss``, ``loss/std``), NaN
where a metric was not recorded. An array metric keeps its shape as extra dimensions
named ``{name}_dim_{i}``. Each variable's attrs hold its original dtype, so
``from_xarray`` restores integers that gaps turned into floats; where a metric both
has gaps and records NaN, a ``_recorded`` mask (dims ``step`` x ``_metric``) tells a
recorded NaN from a missing record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxhistory._table import Table, Tables
from jaxhistory._optional import import_optional

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["from_xarray", "to_xarray"]

DTYPE_ATTR = "jaxhistory_dtype"
GAPS_ATTR = "jaxhistory_gaps"
MASK = "_recorded"
MASK_DIM = "_metric"
NEXT_STEP_ATTR = "jaxhistory_next_step"
_GENERATED_ATTRS = (NEXT_STEP_ATTR, "jaxhistory_version", "jax_version")


def _fill_dtype(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def to_xarray(state: HistoryState, warmup: float = 0):
    xr = import_optional("xarray", "HistoryState.to_xarray")
    from jaxhistory import __version__

    first = state._first_kept_step(warmup)
    steps = state.all_steps()
    steps = steps[steps >= first]
    data_vars, masks = {}, {}
    for name in state.keys:
        dtype, shape = state.dtype(name), state.shape(name)
        keep = state.steps(name) >= first
        col_steps, values = state.steps(name)[keep], state.values(name)[keep]
        dims = ("step", *(f"{name}_dim_{i}" for i in range(len(shape))))
        gaps = len(col_steps) < len(steps)
        attrs = {DTYPE_ATTR: str(dtype), GAPS_ATTR: int(gaps)}
        if not gaps:
            full = np.array(values)
        else:
            where = np.searchsorted(steps, col_steps)
            recorded = np.zeros(len(steps), bool)
            recorded[where] = True
            huge = dtype.kind in "iu" and len(values) and np.abs(values).max() > 2**53
            if huge:
                # float64 would round these integers: keep int64, mark the gaps.
                full = np.zeros((len(steps), *shape), dtype)
                masks[name] = recorded
            else:
                full = np.full((len(steps), *shape), np.nan, _fill_dtype(dtype))
                if dtype.kind == "f" and np.isnan(values).any():
                    masks[name] = recorded
            full[where] = values
        data_vars[name] = xr.Variable(dims, full, attrs=attrs)
    coords = {"step": ("step", steps)}
    if masks:
        coords[MASK_DIM] = (MASK_DIM, list(masks))
        data_vars[MASK] = xr.Variable(
            ("step", MASK_DIM), np.stack(list(masks.values()), axis=1)
        )
    attrs = dict(state.attrs)
    attrs.update(
        {
            NEXT_STEP_ATTR: state.next_step,
            "jaxhistory_version": __version__,
            "jax_version": jax.__version__,
        }
    )
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


def from_xarray(ds) -> HistoryState:
    from jaxhistory._history_state import HistoryState

    if "step" not in ds.coords:
        raise ValueError("the dataset has no 'step' coordinate")
    steps = np.asarray(ds["step"].values, np.int64)
    masks = {}
    if MASK in ds.data_vars:
        names = [str(n) for n in ds[MASK_DIM].values]
        table = np.asarray(ds[MASK].values, bool)
        masks = {n: table[:, i] for i, n in enumerate(names)}
    columns = {}
    for name in ds.data_vars:
        if name == MASK:
            continue
        var = ds[name]
        if var.dims[0] != "step":
            raise ValueError(f"variable {name!r} is not indexed by step first")
        values = np.asarray(var.values)
        dtype = np.dtype(var.attrs.get(DTYPE_ATTR, values.dtype))
        if name in masks:
            recorded = masks[name]
        elif var.attrs.get(GAPS_ATTR, 0) and values.dtype.kind == "f":
            # Gaps but no mask: the metric recorded no NaN, so NaN means missing.
            flat = values.reshape(len(steps), -1)
            recorded = ~np.all(np.isnan(flat), axis=1)
        else:
            recorded = np.ones(len(steps), bool)
        kept = np.array(steps[recorded])
        key = (str(name),)
        columns[key] = (
            Table.from_arrays(key, kept, [values[recorded].astype(dtype)]),
            len(kept),
        )
    attrs = {k: v for k, v in ds.attrs.items() if k not in _GENERATED_ATTRS}
    next_step = int(ds.attrs.get(NEXT_STEP_ATTR, steps[-1] + 1 if len(steps) else 0))
    state = HistoryState(data=Tables(columns), next_step=next_step)
    return state.with_attrs(**attrs) if attrs else state
