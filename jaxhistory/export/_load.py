"""Loading a saved run: its JSONL log, its dataset file or its finalize folder."""

from __future__ import annotations

import os
from pathlib import Path

from jaxhistory._history_state import HistoryState
from jaxhistory._xarray import read_netcdf

__all__ = ["load_run", "run_file"]


def run_file(path: str | os.PathLike) -> Path:
    """The file a run path names: a ``.jsonl`` log, a ``.nc`` dataset, or a
    folder's ``dataset.nc`` (a finalize folder), else its one JSONL log (the
    ``report_dir`` of a run that stopped before finalize; hidden files and
    links are not read). Raises
    FileNotFoundError or ValueError naming the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run file: {path}")
    if path.is_dir():
        if (path / "dataset.nc").is_file():
            return path / "dataset.nc"
        found, logs = _logs_in(path)
        if len(logs) == 1:
            return logs[0]
        if not logs:
            links = [p.name for p in found if p.is_symlink()]
            said = (
                f" ({links[0]} is a link, not followed: give the log itself)"
                if links
                else ""
            )
            raise ValueError(
                f"{path} is a folder without a dataset.nc or a JSONL log{said}"
            )
        shown = ", ".join(p.name for p in logs[:5])
        more = f" and {len(logs) - 5} more" if len(logs) > 5 else ""
        raise ValueError(
            f"{path} is a folder without a dataset.nc and with {len(logs)} JSONL "
            f"logs ({shown}{more}): give the log of the run"
        )
    if path.suffix not in (".jsonl", ".nc", ".nc4", ".netcdf"):
        raise ValueError(f"{path}: expected a .jsonl log or a .nc dataset")
    return path


def _logs_in(folder: Path) -> tuple[list[Path], list[Path]]:
    """The ``*.jsonl`` names in ``folder`` (hidden ones left out), and those
    of them that are files, not links: the logs a run folder is read from."""
    found = sorted(p for p in folder.glob("*.jsonl") if not p.name.startswith("."))
    return found, [p for p in found if p.is_file() and not p.is_symlink()]


def load_run(path: str | os.PathLike):
    """The HistoryState in a JSONL log (``.jsonl``), a dataset file (``.nc``) or a
    folder holding ``dataset.nc``, and the run's recorded attributes (run id,
    environment; a JSONL log's run id from its lines)."""
    path = run_file(path)
    if path.suffix == ".jsonl":
        state = HistoryState.from_jsonl(path)
        return state, dict(state.attrs)
    try:
        ds = read_netcdf(path)  # its attributes whole (the environment too)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as err:  # cut off or damaged: the folder's log may do
        logs = _logs_in(path.parent)[1]
        if len(logs) == 1:
            raise OSError(
                f"{err}; the run's JSONL log {logs[0]} beside it can be read "
                "instead: give that"
            ) from err
        raise
    attrs = dict(ds.attrs)
    for name in ds.data_vars:
        ds.variables[name].attrs.pop("long_name", None)
    try:
        return HistoryState.from_xarray(ds), attrs
    except ValueError as err:  # a crafted or damaged file: name it
        raise ValueError(f"{path}: {err}") from None
