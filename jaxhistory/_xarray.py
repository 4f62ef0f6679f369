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

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhistory._names import decode_netcdf
from jaxhistory._optional import import_optional
from jaxhistory._version import __version__

__all__ = ["MASK", "MASK_DIM", "from_dataset", "read_netcdf", "to_dataset"]

# A column: (name, steps, values, storage dtype, record shape)
Column = tuple[str, np.ndarray, np.ndarray, np.dtype, tuple[int, ...]]

DTYPE_ATTR = "jaxhistory_dtype"
GAPS_ATTR = "jaxhistory_gaps"
MASK = "_recorded"
MASK_DIM = "_metric"
NEXT_STEP_ATTR = "jaxhistory_next_step"
_GENERATED_ATTRS = (NEXT_STEP_ATTR, "jaxhistory_version", "jax_version")


def _fill_dtype(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def to_dataset(
    columns: Iterable[Column], steps: np.ndarray, attrs: dict[str, Any], next_step: int
):
    """The dataset of ``columns`` over the sorted union of their ``steps``."""
    xr = import_optional("xarray", "HistoryState.to_xarray")
    data_vars, masks = {}, {}
    for name, col_steps, values, dtype, shape in columns:
        dims = ("step", *(f"{name}_dim_{i}" for i in range(len(shape))))
        gaps = len(col_steps) < len(steps)
        attrs_ = {DTYPE_ATTR: str(dtype), GAPS_ATTR: int(gaps)}
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
        data_vars[name] = xr.Variable(dims, full, attrs=attrs_)
    coords = {"step": ("step", steps)}
    if masks:
        coords[MASK_DIM] = (MASK_DIM, list(masks))
        data_vars[MASK] = xr.Variable(
            ("step", MASK_DIM), np.stack(list(masks.values()), axis=1)
        )
    attrs = dict(attrs)
    attrs.update(
        {
            NEXT_STEP_ATTR: next_step,
            "jaxhistory_version": __version__,
            "jax_version": jax.__version__,
        }
    )
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


def from_dataset(ds) -> tuple[dict[str, tuple], int, dict[str, Any]]:
    """The columns ``{name: (steps, values)}``, next step and run attrs of a
    dataset made by :func:`to_dataset`."""
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
        columns[str(name)] = (kept, values[recorded].astype(dtype))
    attrs = {k: v for k, v in ds.attrs.items() if k not in _GENERATED_ATTRS}
    next_step = int(ds.attrs.get(NEXT_STEP_ATTR, steps[-1] + 1 if len(steps) else 0))
    return columns, next_step, attrs


def read_netcdf(path: str | os.PathLike):
    """The dataset in a file written by :func:`jaxhistory.export.to_netcdf`, with
    metric names decoded.

    The file is read into memory and closed.
    """
    xr = import_optional("xarray", "read_netcdf")
    import_optional("netCDF4", "read_netcdf")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset file at {path}")
    with xr.open_dataset(path, engine="netcdf4") as ds:
        ds = ds.load()
    ds.attrs = {
        k: v.item() if isinstance(v, np.generic) else v for k, v in ds.attrs.items()
    }
    return renamed(ds, decode_netcdf)


def renamed(ds, fn):
    """``ds`` with its metric variables and dimensions renamed by ``fn``."""
    names = {}
    for name in (*ds.data_vars, *ds.dims):
        if name not in ("step", MASK, MASK_DIM) and fn(str(name)) != name:
            names[name] = fn(str(name))
    return ds.rename(names) if names else ds
