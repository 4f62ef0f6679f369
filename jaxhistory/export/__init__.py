"""Exporters of a HistoryState: dataset file, JSONL log, plots and report.

Each takes a :class:`~jaxhistory.HistoryState` and writes one kind of output;
:meth:`jaxhistory.History.finalize` only composes them.
"""

from jaxhistory._moved import moved
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
    name: (home, name)
    for home, names in (
        ("jaxhistory._names", ("decode_netcdf", "encode_netcdf", "file_stems")),
        ("jaxhistory._env", ("environment", "new_run_id")),
        ("jaxhistory.export._markdown", ("md_escape", "stats_table")),
        ("jaxhistory.export._tplot", ("summary_plots",)),
        ("jaxhistory.export._units", ("plot_units", "PlotUnit")),
    )
    for name in names
}


def __getattr__(name: str):
    return moved("jaxhistory.export", name, _MOVED)
