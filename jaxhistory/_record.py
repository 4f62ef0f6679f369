"""Record: one update on the host, as sinks receive it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Record"]


@dataclasses.dataclass(frozen=True)
class Record:
    """One update, on the host.

    Attributes:
        step: the step (None for published metrics, which have none).
        timestamp: wall-clock seconds (``time.time()``) of the update.
        metrics: name -> Python number or NumPy array, as recorded.
        aggregated: name -> float: cross-device statistics (``loss/mean``, ...).
        process_index: the process that recorded it.
        group: the metric group of a published metric, else None.
    """

    step: int | None
    timestamp: float
    metrics: Mapping[str, Any]
    aggregated: Mapping[str, float] = dataclasses.field(default_factory=dict)
    process_index: int = 0
    group: str | None = None


class Run:
    """Consecutive records that share their names: their steps, timestamps and
    rows of values (host values: Python numbers or NumPy arrays)."""

    __slots__ = (
        "agg_names",
        "agg_rows",
        "floats",
        "group",
        "names",
        "rows",
        "stamps",
        "steps",
    )

    def __init__(
        self,
        names: tuple,
        agg_names: tuple,
        group: str | None = None,
        floats: bool = False,
    ):
        self.names, self.agg_names, self.group = names, agg_names, group
        self.floats = floats  # every row holds Python floats only
        self.steps: list[int | None] = []
        self.stamps: list[float | None] = []
        self.rows: list[tuple] = []
        self.agg_rows: list[tuple] = []

    def columns(self) -> list[tuple]:
        """One tuple of values per name."""
        return list(zip(*self.rows, strict=True)) if self.names else []

    def agg_columns(self) -> list[tuple]:
        return list(zip(*self.agg_rows, strict=True)) if self.agg_names else []


class Batch:
    """Records handed to sinks together, grouped in :class:`Run` s.

    Sinks that define ``write_batch(batch)`` take it whole (the JSONL sink turns
    each run into text a column at a time); the others get :meth:`records`.
    """

    __slots__ = ("_records", "process_index", "runs")

    def __init__(self, runs: list[Run], process_index: int = 0):
        self.runs, self.process_index = runs, process_index
        self._records: list[Record] | None = None

    @classmethod
    def of(cls, records: list[Record]) -> Batch:
        """A batch of ready-made records (runs split where names change)."""
        runs: list[Run] = []
        index = records[0].process_index if records else 0
        for r in records:
            names, agg = tuple(r.metrics), tuple(r.aggregated)
            run = runs[-1] if runs else None
            if (
                run is None
                or run.names != names
                or run.agg_names != agg
                or run.group != r.group
                or r.process_index != index
            ):
                if run is not None and r.process_index != index:
                    index = r.process_index  # rare: keep one index per batch
                run = Run(names, agg, r.group)
                runs.append(run)
            run.steps.append(r.step)
            run.stamps.append(r.timestamp)
            run.rows.append(tuple(r.metrics.values()))
            run.agg_rows.append(tuple(r.aggregated.values()))
        batch = cls(runs, index)
        batch._records = list(records)
        return batch

    def __len__(self) -> int:
        return sum(len(run.steps) for run in self.runs)

    def records(self) -> list[Record]:
        """The batch as :class:`Record` s, in order (made once, on first use)."""
        if self._records is None:
            out = []
            index = self.process_index
            for run in self.runs:
                names, agg, group = run.names, run.agg_names, run.group
                for step, stamp, row, agg_row in zip(
                    run.steps, run.stamps, run.rows, run.agg_rows, strict=True
                ):
                    out.append(
                        Record(
                            step,
                            stamp,
                            dict(zip(names, row, strict=True)),
                            dict(zip(agg, agg_row, strict=True)),
                            index,
                            group,
                        )
                    )
            self._records = out
        return self._records
