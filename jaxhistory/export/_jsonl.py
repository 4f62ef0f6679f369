"""The JSONL log of a history: written whole by :func:`to_jsonl`, read back by
:func:`from_jsonl`; :class:`JsonlStream` streams one during a run.

The line format is :mod:`jaxhistory._codec`'s: ``{"step":42,"timestamp":...,
"process_index":0,"metrics":{...},"aggregated":{...}}`` with NaN and infinities
as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxhistory._codec import encode_lines, join_lines, jsonl_value, row_fragments
from jaxhistory._files import atomic_write, open_log
from jaxhistory._history_state import HistoryState
from jaxhistory._names import aggregated_names
from jaxhistory._stats import Stats
from jaxhistory._writer import Writer
from jaxhistory.sinks._jsonl import JsonlSink

__all__ = ["JsonlStream", "from_jsonl", "jsonl_value", "to_jsonl"]


def to_jsonl(
    state: HistoryState,
    path: str | os.PathLike,
    timestamps: Mapping[int, float] | None = None,
    process_index: int = 0,
    overwrite: bool = True,
) -> Path:
    """Writes ``state`` as JSONL, one line per step; returns the path.

    ``timestamps`` maps steps to wall-clock times (``null`` where unknown).
    Complete ``name/{mean,max,min,std}`` groups go under ``aggregated``. With
    ``overwrite`` the file is replaced atomically; otherwise the lines are
    appended (after ending a cut-off last line).
    """
    path = Path(path)
    timestamps = timestamps or {}
    grouped = aggregated_names(state.keys)
    # One block per table: metrics recorded together share their steps, and each
    # column is turned into text in one call.
    blocks = []
    for keys, (table, n) in state.data.tables.items():
        if not n:
            continue
        steps, columns = table.view(n)
        m = [j for j, k in enumerate(keys) if k not in grouped]
        a = [j for j, k in enumerate(keys) if k in grouped]
        blocks.append((steps.tolist(), keys, columns, m, a))
    get = timestamps.get
    if len(blocks) == 1:
        steps, keys, columns, m, a = blocks[0]
        text = encode_lines(
            steps,
            [get(s) for s in steps],
            process_index,
            [keys[j] for j in m],
            [columns[j] for j in m],
            [keys[j] for j in a],
            [columns[j] for j in a],
        )
    else:  # several name sets: merge their fragments step by step
        per_step: dict[int, list[list[bytes]]] = {}
        for steps, keys, columns, m, a in blocks:
            k = len(steps)
            mf = row_fragments([keys[j] for j in m], [columns[j] for j in m], k)
            af = row_fragments([keys[j] for j in a], [columns[j] for j in a], k)
            for step, mm, aa in zip(steps, mf, af, strict=True):
                entry = per_step.get(step)
                if entry is None:
                    entry = per_step[step] = [[], []]
                if mm:
                    entry[0].append(mm)
                if aa:
                    entry[1].append(aa)
        order = sorted(per_step)
        text = join_lines(
            order,
            [get(s) for s in order],
            process_index,
            [b",".join(per_step[s][0]) for s in order],
            [b",".join(per_step[s][1]) for s in order],
        )
    if overwrite:
        atomic_write(path, lambda tmp: tmp.write_bytes(text))
    else:
        with open_log(path) as f:
            f.write(text)
    return path


def from_jsonl(path: str | os.PathLike) -> HistoryState:
    """The history in a JSONL log written by History or :func:`to_jsonl` (see
    :meth:`HistoryState.from_jsonl <jaxhistory.HistoryState.from_jsonl>`)."""
    return HistoryState.from_jsonl(path)


class JsonlStream(Writer):
    """A JSONL log written from a background thread, as History streams its own.

    ``add`` only queues the record (device values are not waited for); the thread
    writes the lines about five times a second, flushing them to the operating
    system, so a process killed with SIGKILL loses well under a second of records
    and every complete line stays readable. ``sinks`` get the same records.
    ``path`` None: sinks only.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        overwrite: bool = False,
        sinks: Any = (),
    ):
        self.path = None if path is None else Path(path)
        self.log = None if path is None else JsonlSink(self.path, overwrite)
        super().__init__([s for s in (self.log, *sinks) if s is not None])

    @property
    def error(self) -> BaseException | None:
        """The last failed write to the log, if any."""
        return None if self.log is None else self.log.error

    def add(
        self,
        step: int,
        metrics: Any,
        aggregated: Stats | Mapping[str, float] | None = None,
        timestamp: float | None = None,
    ) -> None:
        """Queues one record: ``metrics`` as a dict or (name, value) pairs,
        ``aggregated`` as :class:`~jaxhistory.Stats` or a name -> value dict;
        ``timestamp`` defaults to now."""
        items = dict(metrics)
        stats: tuple = ()
        if isinstance(aggregated, Stats):
            stats = (("", aggregated),)
        elif aggregated:
            items = {**items, **aggregated}
        stamp = time.time() if timestamp is None else timestamp
        super().add(step, stamp, tuple(items), tuple(items.values()), stats)

    def close(self) -> None:
        super().close()
        if self.log is not None:
            self.log.close()
