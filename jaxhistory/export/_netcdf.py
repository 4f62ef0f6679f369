"""The run's dataset file: netCDF-4, a group per metric path, written atomically."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxhistory import _xarray
from jaxhistory._env import netcdf_attrs
from jaxhistory._files import atomic_write
from jaxhistory._history_state import HistoryState
from jaxhistory._names import check_nul
from jaxhistory._optional import import_optional

__all__ = ["from_netcdf", "read_netcdf", "to_netcdf"]


def to_netcdf(
    state: HistoryState,
    path: str | os.PathLike,
    warmup: float = 0,
    attrs: dict[str, Any] | None = None,
    timestamps: Mapping[int, float] | None = None,
):
    """Writes ``state`` to a netCDF-4 file at ``path``; returns the dataset written.

    The file holds ``state.to_xarray(warmup)``: a ``step`` coordinate, one variable
    per metric with its dtype kept (float64 and int64 stay 64-bit), NaN where a
    metric was not recorded (sparse metrics in bulk, a metric per sample, go in one
    long table instead: :mod:`jaxhistory._xarray`), run metadata (``attrs``) as
    global attributes. Each metric path is a netCDF group, so plain xarray reads a
    metric by its name: ``xr.open_datatree(path)["train/loss/mean"]``, or
    ``xr.open_dataset(path, group="train/loss")["mean"]``, each group with its
    own ``step`` coordinate, so ``.sel(step=50)`` selects by step in a group
    opened alone; the root group holds the metrics without ``/`` (see
    :func:`jaxhistory._xarray.to_tree` for names that cannot be groups). Each
    variable's ``long_name`` is the metric's name. :func:`read_netcdf` returns the
    flat dataset of :meth:`HistoryState.to_xarray`, and
    :meth:`HistoryState.from_netcdf` the state, exactly. The file
    is written to a temporary name and renamed, so a crash leaves the old file or
    the new one, never part of one, and a rerun replaces the file.

    ``timestamps`` (step -> wall-clock seconds since the epoch, as History and
    its JSONL log record them) add a ``time`` coordinate along ``step`` (NaT
    where unknown; ``time_`` if a metric is named ``time``), which plain xarray
    opens as datetimes.

    Examples:
        >>> import tempfile, pathlib, jaxhistory as jh
        >>> s = jh.HistoryState().update({"train": {"loss": 0.5}, "step": 3})
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "dataset.nc"
        >>> _ = jh.export.to_netcdf(s, path)
        >>> jh.HistoryState.from_netcdf(path).values("train/loss").tolist()
        [0.5]
    """
    import_optional("netCDF4", "to_netcdf")
    check_nul(state.keys)  # (netCDF would cut a name it stores as text there)
    ds = state.to_xarray(warmup)
    if timestamps:
        steps = np.asarray(ds["step"].values)
        stamps = np.array([timestamps.get(int(t), np.nan) for t in steps], np.float64)
        name = "time"
        while name in ds.variables:
            name += "_"
        ds = ds.assign_coords(
            {
                name: (
                    "step",
                    stamps,
                    {
                        "units": "seconds since 1970-01-01",
                        "long_name": "wall-clock time of the step's record",
                    },
                )
            }
        )
    if attrs:
        ds.attrs.update(attrs)
    ds.attrs = netcdf_attrs(ds.attrs)
    variables = ds.variables  # not ds[name]: that builds a DataArray per name
    for name in state.keys:
        if name in variables:  # not a metric of the long table
            variables[name].attrs["long_name"] = name
    tree = _xarray.to_tree(ds)
    atomic_write(Path(path), lambda tmp: _xarray.write_tree(tree, tmp))
    return ds


def read_netcdf(path: str | os.PathLike):
    """The dataset in a file written by :func:`to_netcdf`, with metric names decoded.

    The file is read into memory and closed. A damaged file is an OSError naming
    it; a crafted one (an attribute jaxhistory reads holding the wrong type, two
    variables holding one metric) a ValueError naming the file and what is wrong.
    """
    return _xarray.read_netcdf(path)


def from_netcdf(path: str | os.PathLike) -> HistoryState:
    """The HistoryState saved by :func:`to_netcdf`, exactly (raises as
    :func:`read_netcdf` does, and a ValueError naming the file where its steps,
    dtypes or attributes are not ones :func:`to_netcdf` writes)."""
    return HistoryState.from_netcdf(path)
