"""The run's dataset file: netCDF-4, written atomically, names encoded losslessly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxhistory._optional import import_optional
from jaxhistory._xarray import MASK, MASK_DIM
from jaxhistory.export._env import netcdf_attrs
from jaxhistory.export._names import decode_netcdf, encode_netcdf

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["from_netcdf", "read_netcdf", "to_netcdf"]

_OURS = ("step", MASK, MASK_DIM)


def _renamed(ds, fn):
    names = {}
    for name in (*ds.data_vars, *ds.dims):
        if name not in _OURS and fn(str(name)) != name:
            names[name] = fn(str(name))
    return ds.rename(names) if names else ds


def atomic_write(path: Path, write) -> None:
    """Calls ``write(tmp)`` then renames ``tmp`` to ``path``: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def to_netcdf(
    state: HistoryState,
    path: str | os.PathLike,
    warmup: float = 0,
    attrs: dict[str, Any] | None = None,
):
    """Writes ``state`` to a netCDF-4 file at ``path``; returns the dataset written.

    The file holds ``state.to_xarray(warmup)``: a ``step`` coordinate, one variable
    per metric with its dtype kept (float64 and int64 stay 64-bit), NaN where a
    metric was not recorded, run metadata (``attrs``) as global attributes. netCDF
    forbids ``/`` in names, so names are percent-encoded (``train/loss`` is stored
    as ``train%2Floss``, with the original in its ``long_name`` attribute);
    :func:`read_netcdf` and :meth:`HistoryState.from_netcdf` decode them. The file
    is written to a temporary name and renamed, so a crash leaves the old file or
    the new one, never part of one, and a rerun replaces the file.

    Example:
        >>> import tempfile, pathlib, jaxhistory as jh
        >>> s = jh.HistoryState().update({"train": {"loss": 0.5}, "step": 3})
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "dataset.nc"
        >>> _ = jh.export.to_netcdf(s, path)
        >>> jh.HistoryState.from_netcdf(path).values("train/loss").tolist()
        [0.5]
    """
    import_optional("netCDF4", "to_netcdf")
    ds = state.to_xarray(warmup)
    if attrs:
        ds.attrs.update(attrs)
    ds.attrs = netcdf_attrs(ds.attrs)
    for name in state.keys:
        ds[name].attrs["long_name"] = name
    out = _renamed(ds, encode_netcdf)
    atomic_write(Path(path), lambda tmp: out.to_netcdf(tmp, engine="netcdf4"))
    return ds


def read_netcdf(path: str | os.PathLike):
    """The dataset in a file written by :func:`to_netcdf`, with metric names decoded.

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
    return _renamed(ds, decode_netcdf)


def from_netcdf(path: str | os.PathLike) -> HistoryState:
    """The HistoryState saved by :func:`to_netcdf`, exactly."""
    from jaxhistory._history_state import HistoryState

    ds = read_netcdf(path)
    for name in ds.data_vars:
        ds[name].attrs.pop("long_name", None)
    return HistoryState.from_xarray(ds)
