"""The training_history table: a whole run, one row per step, for sinks that
take tables (``log_table``) at ``finalize``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxhistory.sinks._feed import call_extras

__all__ = ["TRAINING_HISTORY", "log_tables", "training_history"]

TRAINING_HISTORY = "training_history"  # the table's name, as ezpz calls it


def training_history(state: Any) -> tuple[list[str], list[list[Any]]]:
    """The run as one table: ``(columns, rows)``.

    ``columns`` is ``["step", *names]``: every scalar metric of ``state`` (a
    :class:`~jaxhistory.HistoryState`), in the order first recorded (array
    metrics are left out); ``rows`` holds one list per recorded step, in step
    order: the step, then each metric's value at that step as a Python
    number (an int stays an exact int, a bool a bool, NaN a float NaN) or None
    where the metric has no record at that step. Rows are aligned by step, so
    an evaluation every 100 steps sits at its own steps.

    :meth:`History.finalize <jaxhistory.History.finalize>` hands it to every
    sink that has ``log_table(key, columns, rows)``, with the key
    ``"training_history"``; :class:`~jaxhistory.sinks.CsvSink` writes it to a
    file, :class:`~jaxhistory.sinks.WandbSink` logs it as the ``wandb.Table``
    named ``history``.

    Examples:
        >>> import jaxhistory as jh
        >>> from jaxhistory.sinks import training_history
        >>> state = jh.HistoryState().update({"loss": 0.5}, step=0)
        >>> state = state.update({"loss": 0.25, "eval/acc": 0.75}, step=1)
        >>> training_history(state)
        (['step', 'loss', 'eval/acc'], [[0, 0.5, None], [1, 0.25, 0.75]])
    """
    names = [name for name in state.keys if state.shape(name) == ()]
    steps = np.asarray(state.all_steps())
    columns = []
    for name in names:
        cells = [None] * len(steps)
        these, values = state.records(name)
        values = np.asarray(values)
        if values.dtype.kind not in "biuf":  # bfloat16 and other ml_dtypes floats
            values = values.astype(np.float64)
        where = np.searchsorted(steps, np.asarray(these)).tolist()
        for k, value in zip(where, values.tolist(), strict=True):
            cells[k] = value
        columns.append(cells)
    by_step = zip(steps.tolist(), *columns, strict=True)
    rows = [list(row) for row in by_step]
    return ["step", *names], rows


def log_tables(sinks: Sequence[Any], state: Any) -> None:
    """Hands :func:`training_history` of ``state`` to every sink of ``sinks``
    that takes tables (see :func:`~jaxhistory.sinks._feed.call_extras`)."""
    takers = [s for s in sinks if callable(getattr(s, "log_table", None))]
    if takers:
        columns, rows = training_history(state)
        call_extras(sinks, "log_table", TRAINING_HISTORY, columns, rows)
