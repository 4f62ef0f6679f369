"""Exporters of a HistoryState: dataset file, JSONL log, plots and report.

Each takes a :class:`~jaxhistory.HistoryState` and writes one kind of output;
:meth:`jaxhistory.History.finalize` only composes them.
"""

from jaxhistory._env import environment, new_run_id
from jaxhistory._names import decode_netcdf, encode_netcdf, file_stems
from jaxhistory.export._finalize import finalize
from jaxhistory.export._jsonl import JsonlStream, from_jsonl, to_jsonl
from jaxhistory.export._markdown import md_escape, stats_table, to_markdown
from jaxhistory.export._mpl import to_png
from jaxhistory.export._netcdf import from_netcdf, read_netcdf, to_netcdf
from jaxhistory.export._tplot import summary_plots, to_terminal
from jaxhistory.export._units import PlotUnit, plot_units

__all__ = [
    "JsonlStream",
    "PlotUnit",
    "decode_netcdf",
    "encode_netcdf",
    "environment",
    "file_stems",
    "finalize",
    "from_jsonl",
    "from_netcdf",
    "md_escape",
    "new_run_id",
    "plot_units",
    "read_netcdf",
    "stats_table",
    "summary_plots",
    "to_jsonl",
    "to_markdown",
    "to_netcdf",
    "to_png",
    "to_terminal",
]
