"""Weights & Biases: metrics per step, and the finished run's history and plots."""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxhistory._optional import import_optional
from jaxhistory.sinks._base import values
from jaxhistory.sinks._training_history import training_history

__all__ = ["WandbSink", "wandb_run"]


def wandb_run() -> Any:
    """The active W&B run, if ``wandb`` was imported and a run is active (never
    imports wandb itself)."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


class WandbSink:
    """Logs each record's values to a W&B run with the record's step.

    ``run`` defaults to the active run (``wandb.run``). Scalars are logged as
    numbers, array metrics as ``wandb.Histogram``. W&B needs steps that never go
    back: a record at an earlier step than the run has reached (by this sink,
    another one, or ``wandb.log``) is left out of W&B (one RuntimeWarning). A
    record without a step (a published metric) joins the next step W&B
    commits. :meth:`log_outputs` logs a finished history as a
    ``wandb.Table`` and PNG plots as ``wandb.Image``. Needs
    ``pip install 'jaxhistory[wandb]'``.
    """

    all_processes = False

    def __init__(self, run: Any = None):
        self.wandb = import_optional("wandb", "the Weights & Biases sink")
        self.run = run if run is not None else self.wandb.run
        if self.run is None:
            raise ValueError("no active W&B run: call wandb.init() first or pass run=")
        self._last_step: int | None = None
        self._warned = False

    def write(self, record: Any) -> None:
        data = {}
        for name, number, arr in values(record):
            if number is not None:
                data[name] = number
            elif arr is not None and arr.size:  # values gives one or the other
                # in float64: binned in float32, a range past its largest value
                # raises ("Too many bins for data range"), losing the record
                finite = arr[np.isfinite(arr)].astype(np.float64)
                data[name] = self.wandb.Histogram(finite)
        if not data:
            return
        step = record.step
        if step is None:  # a published metric: joins the next step W&B commits
            self.run.log(data, commit=False)
            return
        last = self._last_step
        # the run's own step: another sink or the user's wandb.log may have
        # taken it further, and W&B drops what comes below it
        current = getattr(self.run, "step", None)
        if type(current) is int and (last is None or current > last):
            last = current
        if last is None or step >= last:
            self._last_step = step
            self.run.log(data, step=step)
        elif not self._warned:
            self._warned = True
            warnings.warn(
                f"W&B cannot log step {step} after step {last}: such "
                "records are left out of W&B (the history keeps them)",
                RuntimeWarning,
                stacklevel=2,
            )

    def log_outputs(self, state: Any, images: Sequence[str | os.PathLike] = ()) -> None:
        """Logs ``state`` (a HistoryState) as a ``wandb.Table`` named ``history``
        (:func:`~jaxhistory.sinks.training_history`: a ``step`` column and one
        per scalar metric, None where not recorded or NaN) and each PNG as a
        ``wandb.Image`` under ``plots/{file stem}``."""
        columns, table = training_history(state)
        rows = [[_cell(v) for v in row] for row in table]
        data: dict[str, Any] = {"history": self.wandb.Table(columns=columns, data=rows)}
        for path in images:
            data[f"plots/{Path(path).stem}"] = self.wandb.Image(os.fspath(path))
        self.run.log(data)

    def flush(self) -> None:
        return None  # wandb sends in the background

    def close(self) -> None:
        return None  # the run belongs to the caller: wandb.finish() ends it


def _cell(value: Any) -> Any:
    """A table cell for W&B: NaN as None (W&B tables hold no NaN)."""
    return None if isinstance(value, float) and math.isnan(value) else value
