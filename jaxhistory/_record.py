"""Record: one update on the host, as sinks receive it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Batch", "Record"]


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


class Batch:
    """Records handed to sinks together, as parallel lists (no object per
    record until :meth:`records` asks for them): steps, timestamps, metrics and
    aggregated dicts (values on the host), and groups (None: no record has one).

    Sinks that define ``write_batch(batch)`` take it whole (the JSONL sink writes
    it with one encoder call); the others get :meth:`records`.
    """

    __slots__ = (
        "_records",
        "aggregated",
        "finite",
        "groups",
        "metrics",
        "process_index",
        "run_id",
        "stamps",
        "steps",
    )

    def __init__(
        self,
        steps: list,
        stamps: list,
        metrics: list,
        aggregated: list | None = None,
        groups: list | None = None,
        process_index: int = 0,
    ):
        self.steps, self.stamps, self.metrics = steps, stamps, metrics
        self.aggregated, self.groups = aggregated, groups
        self.process_index = process_index
        self.finite = False  # every metric value is known to be a finite float
        self.run_id: str | None = None  # written on every JSONL line, where set
        self._records: list[Record] | None = None

    @classmethod
    def of(cls, records: list[Record]) -> Batch:
        """A batch of ready-made records (all from one process)."""
        groups = [r.group for r in records]
        batch = cls(
            [r.step for r in records],
            [r.timestamp for r in records],
            [r.metrics for r in records],
            [r.aggregated for r in records],
            groups if any(g is not None for g in groups) else None,
            records[0].process_index if records else 0,
        )
        batch._records = list(records)
        return batch

    def __len__(self) -> int:
        return len(self.steps)

    def records(self) -> list[Record]:
        """The batch as :class:`Record` s, in order (made once, on first use)."""
        if self._records is None:
            k = len(self.steps)
            aggregated = self.aggregated or [{}] * k
            groups = self.groups or [None] * k
            index = self.process_index
            self._records = [
                Record(step, stamp, metrics, agg, index, group)
                for step, stamp, metrics, agg, group in zip(
                    self.steps,
                    self.stamps,
                    self.metrics,
                    aggregated,
                    groups,
                    strict=True,
                )
            ]
        return self._records
