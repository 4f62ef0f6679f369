"""The JSONL log of a history: written whole by :func:`to_jsonl`, read back by
:func:`from_jsonl`; :class:`JsonlStream` streams one during a run.

The line format is :mod:`jaxhistory._codec`'s: ``{"step":42,"timestamp":...,
"process_index":0,"metrics":{...},"aggregated":{...}}`` with NaN and infinities
as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxhistory._codec import encode_records, jsonable, jsonl_value
from jaxhistory._dtypes import as_flag
from jaxhistory._fan_out import FanOut
from jaxhistory._files import atomic_write, open_log
from jaxhistory._history_state import HistoryState
from jaxhistory._names import aggregated_names
from jaxhistory._record import Batch
from jaxhistory._row import Row, RowKind
from jaxhistory._stats import Stats
from jaxhistory._trace_state import register_stream
from jaxhistory._writer import Writer
from jaxhistory.sinks._jsonl import JsonlSink

__all__ = ["JsonlStream", "from_jsonl", "jsonl_value", "to_jsonl"]


def to_jsonl(
    state: HistoryState,
    path: str | os.PathLike,
    timestamps: Mapping[int, float] | None = None,
    process_index: int = 0,
    overwrite: bool = True,
    run_id: str | None = None,
) -> Path:
    """Writes ``state`` as JSONL, one line per step; returns the path.

    ``timestamps`` maps steps to wall-clock times (``null`` where unknown).
    Complete ``name/{mean,max,min,std}`` groups go under ``aggregated``. With
    ``overwrite`` the file is replaced atomically; otherwise the lines are
    appended (after ending a cut-off last line). ``run_id`` is written on every
    line where given.
    """
    path = Path(path)
    timestamps = timestamps or {}
    grouped = aggregated_names(state.keys)
    # Per table (metrics recorded together share their steps): each column to
    # Python values in one call, then one dict per row, built in C.
    blocks = []
    for keys, steps, columns in state.blocks():
        n = len(steps)
        lists = [_column_list(c) for c in columns]
        blocks.append(
            (
                steps.tolist(),
                _row_dicts([k for k in keys if k not in grouped], keys, lists, n),
                _row_dicts([k for k in keys if k in grouped], keys, lists, n),
            )
        )
    if len(blocks) == 1:
        order, metrics, aggregated = blocks[0]
    else:  # several name sets: one line per step, merged
        per_step: dict[int, list[dict]] = {}
        for steps, ms, ags in blocks:
            for step, m, a in zip(steps, ms, ags, strict=True):
                entry = per_step.get(step)
                if entry is None:
                    per_step[step] = [dict(m), dict(a)]
                else:
                    entry[0].update(m)
                    entry[1].update(a)
        order = sorted(per_step)
        metrics = [per_step[step][0] for step in order]
        aggregated = [per_step[step][1] for step in order]
    get = timestamps.get
    batch = Batch(
        order, [get(step) for step in order], metrics, aggregated, None, process_index
    )
    batch.run_id = run_id
    text = encode_records(batch)
    if as_flag("overwrite", overwrite):
        atomic_write(path, lambda tmp: tmp.write_bytes(text))
    else:
        with open_log(path) as f:
            f.write(text)
    return path


def _row_dicts(names: list[str], keys: tuple, lists: list[list], n: int) -> list:
    """One ``{name: value}`` dict per row, for ``names`` among ``keys``."""
    if not names:
        return [{}] * n
    columns = [lists[keys.index(name)] for name in names]
    return list(
        map(dict, map(zip, itertools.repeat(names), zip(*columns, strict=True)))
    )


def _column_list(column) -> list:
    """A column's values as Python numbers (nested lists for float array
    metrics, NumPy rows for integer ones, NumPy values for uint64), floats
    widened to float64 and non-finite ones as the log's strings."""
    if column.dtype.kind == "f" and column.dtype != "float64":
        column = column.astype("float64")
    if column.dtype.kind not in "biuf":
        column = column.astype("float64")
    if column.dtype.kind == "f" and column.ndim == 1:
        values = column.tolist()
        if not all(map(math.isfinite, values)):
            values = [jsonable(v) for v in values]
        return values
    if column.dtype.kind == "f":
        return [jsonable(row) for row in column]
    # rows stay NumPy: a list of ints past int64 would be read by NumPy (when
    # cleaned) as float64, rounded; uint64 values too: the log marks them
    if column.ndim > 1 or column.dtype == np.uint64:
        return list(column)
    return column.tolist()


def from_jsonl(path: str | os.PathLike) -> HistoryState:
    """The history in a JSONL log written by History or :func:`to_jsonl` (see
    :meth:`HistoryState.from_jsonl <jaxhistory.HistoryState.from_jsonl>`)."""
    return HistoryState.from_jsonl(path)


class JsonlStream:
    """A JSONL log written from a background thread, as History streams its own.

    ``add`` only queues the record (device values are not waited for); the thread
    writes the lines about five times a second, flushing them to the operating
    system, so a process killed with SIGKILL loses well under a second of records
    (and the latest step's line, which waits up to 1 s for more of its step) and
    every complete line stays readable. ``sinks`` get the same records.
    ``path`` None: sinks only. ``run_id`` is written on every line where given.
    Records of one step that follow each other share a line (see
    :class:`~jaxhistory._fan_out.FanOut`). It wraps the one
    :class:`~jaxhistory._writer.Writer` (:attr:`writer`).
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        overwrite: bool = False,
        sinks: Any = (),
        run_id: str | None = None,
    ):
        self.path = None if path is None else Path(path)
        self.log = None if self.path is None else JsonlSink(self.path, overwrite)
        self.sinks = [s for s in (self.log, *sinks) if s is not None]
        self.writer = Writer(FanOut(self.sinks, run_id=run_id))
        register_stream(self.writer)

    @property
    def error(self) -> BaseException | None:
        """The last failed write to the log, if any."""
        return None if self.log is None else self.log.error

    @property
    def dropped(self) -> int:
        """Records dropped because the log could not keep up."""
        return self.writer.dropped

    @property
    def closed(self) -> bool:
        return self.writer.closed

    def add(
        self,
        step: int,
        metrics: Any,
        aggregated: Stats | Mapping[str, float] | None = None,
        timestamp: float | None = None,
    ) -> None:
        """Queues one record: ``metrics`` as a dict or (name, value) pairs,
        ``aggregated`` as :class:`~jaxhistory.Stats` or a name -> value dict;
        ``timestamp`` defaults to now. Raises ValueError after :meth:`close`."""
        items = dict(metrics)
        if isinstance(aggregated, Stats):
            items[""] = aggregated
        elif aggregated:
            items = {**items, **aggregated}
        stamp = time.time() if timestamp is None else timestamp
        self.writer.add(
            Row(step, tuple(items), tuple(items.values()), RowKind.VALUES, stamp)
        )

    def pending(self) -> int:
        """Records queued and not yet written."""
        return self.writer.pending()

    def flush(self) -> None:
        """Writes every queued record now (waiting for device values)."""
        self.writer.flush()

    def close(self) -> None:
        """Writes what is queued, stops the thread and closes the log."""
        self.writer.close()
        if self.log is not None:
            self.log.close()
