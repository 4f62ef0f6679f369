"""Sinks chosen by name: ``History(sinks="console,csv")`` or, when History is
given no ``sinks``, the ``JAXHISTORY_SINKS`` environment variable."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxhistory._files import check_target
from jaxhistory._optional import require_optional
from jaxhistory.sinks._console import ConsoleSink
from jaxhistory.sinks._csv import CsvSink
from jaxhistory.sinks._tensorboard import TensorBoardSink
from jaxhistory.sinks._wandb import WandbSink

__all__ = [
    "SINKS_VARIABLE",
    "SINK_NAMES",
    "check_folder",
    "env_sink_names",
    "named_sinks",
    "sink_names",
]

SINKS_VARIABLE = "JAXHISTORY_SINKS"
# name -> what it makes (files go into the run's folder: report_dir, else the
# folder of the JSONL log)
SINK_NAMES = {
    "console": "ConsoleSink(): a line per record on stdout",
    "csv": "CsvSink({folder}/{run_id}.csv)",
    "tensorboard": "TensorBoardSink({folder}/tensorboard/{run_id})",
    "wandb": "WandbSink(): the active W&B run",
}
_PACKAGES = {
    "tensorboard": ("tensorboardX", "the TensorBoard sink"),
    "wandb": ("wandb", "the Weights & Biases sink"),
}
_FILES = ("csv", "tensorboard")


def sink_names(text: str, source: str = "sinks") -> list[str]:
    """The sink names of ``text``, a comma-separated list (case and spaces do
    not matter; ``none`` alone: no sinks), each checked.

    Args:
        text: ``"console,csv,tensorboard,wandb"``, or ``"none"``.
        source: where ``text`` came from, for errors
            (``"JAXHISTORY_SINKS='csv,foo'"``).

    Raises:
        ValueError: an unknown name (named, with the known ones), a name given
            twice, or ``none`` beside other names.
        ImportError: a sink whose optional package is not installed; the
            message names the ``pip install`` that provides it.

    Examples:
        >>> from jaxhistory.sinks._named import sink_names
        >>> sink_names(" Console, csv ")
        ['console', 'csv']
        >>> sink_names("none")
        []
    """
    names = [part.strip().lower() for part in text.split(",")]
    names = [name for name in names if name]
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"{source}: 'none' means no sinks; name it alone")
        return []
    seen: set[str] = set()
    for name in names:
        if name not in SINK_NAMES:
            hint = ""
            if name == "jsonl":
                hint = (
                    " (History writes its JSONL log itself: give it report_dir or "
                    "jsonl_path)"
                )
            raise ValueError(
                f"{source}: unknown sink {name!r}{hint}; known sinks: "
                + ", ".join(SINK_NAMES)
                + " (or none)"
            )
        if name in seen:
            raise ValueError(f"{source}: the sink {name!r} is named twice")
        seen.add(name)
    for name in names:
        if name in _PACKAGES:
            require_optional(*_PACKAGES[name])
    return names


def env_sink_names() -> list[str] | None:
    """The sinks :data:`SINKS_VARIABLE` names (see :func:`sink_names`); None
    when it is not set or empty."""
    raw = os.environ.get(SINKS_VARIABLE, "")
    if not raw.strip():
        return None
    return sink_names(raw, f"{SINKS_VARIABLE}={raw!r}")


def check_folder(names: Sequence[str], folder: Path | None, source: str) -> None:
    """Raises ValueError when a sink of ``names`` writes files and the run has
    no folder for them."""
    files = [name for name in names if name in _FILES]
    if files and folder is None:
        raise ValueError(
            f"{source}: the {files[0]} sink writes into the run's folder, and "
            "this History has none: give it report_dir (or jsonl_path)"
        )


def named_sinks(
    names: Sequence[str],
    folder: Path | None,
    run_id: str,
    overwrite: bool = False,
    wandb: bool = True,
) -> list[Any]:
    """Makes the sinks ``names`` (checked by :func:`sink_names`): ``csv``
    writes ``{folder}/{run_id}.csv`` (appended to unless ``overwrite``),
    ``tensorboard`` ``{folder}/tensorboard/{run_id}`` (either folder a link or
    no folder: :class:`~jaxhistory._files.NotAFile`); ``wandb`` logs to the
    active run (ValueError without one), unless ``wandb`` is False. If one
    cannot be made, those made already are closed."""
    made: list[Any] = []
    try:
        for name in names:
            if name == "console":
                made.append(ConsoleSink())
            elif name == "csv":
                assert folder is not None  # check_folder ran on names
                made.append(CsvSink(Path(folder) / f"{run_id}.csv", overwrite))
            elif name == "tensorboard":
                # folders this names, as the plots folder: never written
                # through a link (NotAFile)
                assert folder is not None  # check_folder ran on names
                logdir = Path(folder) / "tensorboard" / run_id
                check_target(logdir.parent, folder=True)
                check_target(logdir, folder=True)
                made.append(TensorBoardSink(logdir))
            elif name == "wandb" and wandb:
                made.append(WandbSink())
    except BaseException:
        for sink in made:
            with contextlib.suppress(Exception):
                sink.close()
        raise
    return made
