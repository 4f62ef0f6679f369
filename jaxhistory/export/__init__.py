"""Exporters of a HistoryState: dataset file, JSONL log, plots and report.

Each takes a :class:`~jaxhistory.HistoryState` and writes one kind of output;
:meth:`jaxhistory.History.finalize` only composes them.
"""

import importlib as _importlib
import warnings as _warnings

from jaxhistory.export._finalize import finalize
from jaxhistory.export._jsonl import JsonlStream, from_jsonl, to_jsonl
from jaxhistory.export._markdown import to_markdown
from jaxhistory.export._mpl import to_png
from jaxhistory.export._netcdf import from_netcdf, read_netcdf, to_netcdf
from jaxhistory.export._tplot import to_terminal

__all__ = [
    "JsonlStream",
    "finalize",
    "from_jsonl",
    "from_netcdf",
    "read_netcdf",
    "to_jsonl",
    "to_markdown",
    "to_netcdf",
    "to_png",
    "to_terminal",
]

# Helpers the exporters share, once exported here; they live in their own
# modules now and keep working from here for one release.
_MOVED = {
    "decode_netcdf": "jaxhistory._names",
    "encode_netcdf": "jaxhistory._names",
    "file_stems": "jaxhistory._names",
    "environment": "jaxhistory._env",
    "new_run_id": "jaxhistory._env",
    "md_escape": "jaxhistory.export._markdown",
    "stats_table": "jaxhistory.export._markdown",
    "summary_plots": "jaxhistory.export._tplot",
    "plot_units": "jaxhistory.export._units",
    "PlotUnit": "jaxhistory.export._units",
}


def __getattr__(name: str):
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxhistory.export' has no attribute {name!r}")
    _warnings.warn(
        f"jaxhistory.export.{name} is deprecated (an internal helper, in {home} "
        "now); it leaves jaxhistory.export in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_importlib.import_module(home), name)
