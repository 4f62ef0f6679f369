"""Record: one update on the host, as sinks receive it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, cast

__all__ = ["Batch", "Record"]


@dataclasses.dataclass(frozen=True)
class Record:
    """One update, on the host.

    Attributes:
        step: the step (None for published metrics, which have none).
        timestamp: wall-clock seconds (``time.time()``) of the update.
        metrics: name -> Python number or NumPy array, as recorded (a uint64
            scalar as a NumPy uint64).
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

    A batch made by :meth:`of_rows` (records of one set of names) keeps each
    record's values as a tuple beside the one tuple of names, and makes the
    metric dicts only when :attr:`metrics` is first read: the JSONL log writes
    it from the tuples (:meth:`uniform`). Where the dicts came with the tuples
    (History's copies of repeated dicts), the log writes it from those, which
    one orjson call turns into text at about half the cost.

    Sinks that define ``write_batch(batch)`` take it whole (the JSONL sink writes
    it with one encoder call); the others get :meth:`records`.
    """

    __slots__ = (
        "_metrics",
        "_records",
        "aggregated",
        "finite",
        "groups",
        "names",
        "process_index",
        "run_id",
        "stamps",
        "steps",
        "values",
    )

    def __init__(
        self,
        steps: list,
        stamps: list,
        metrics: list | None,
        aggregated: list | None = None,
        groups: list | None = None,
        process_index: int = 0,
    ):
        self.steps, self.stamps, self._metrics = steps, stamps, metrics
        self.aggregated, self.groups = aggregated, groups
        self.process_index = process_index
        self.finite = False  # every metric value is known to be a finite float
        self.run_id: str | None = None  # written on every JSONL line, where set
        self._records: list[Record] | None = None
        self.names: tuple | None = None  # (of_rows) every record's names
        self.values: list | None = None  # (of_rows) every record's values

    @classmethod
    def of_rows(
        cls,
        steps: list,
        stamps: list,
        names: tuple,
        values: list,
        process_index: int = 0,
    ) -> Batch:
        """A batch of records that all have ``names``, the k-th record's values
        the tuple ``values[k]`` (host numbers) in the order of ``names``."""
        batch = cls(steps, stamps, None, None, None, process_index)
        batch.names, batch.values = names, values
        return batch

    @property
    def metrics(self) -> list:
        """Each record's metrics as a dict (made on first read for a batch
        of :meth:`of_rows`)."""
        metrics = self._metrics
        if metrics is None:  # a batch of of_rows: its names and values are set
            names = itertools.repeat(cast(tuple, self.names))
            values = cast(list, self.values)
            metrics = self._metrics = list(map(dict, map(zip, names, values)))
        return metrics

    def uniform(self) -> tuple[tuple, list] | None:
        """(the names, each record's values) of a batch of :meth:`of_rows`
        whose dicts were never made; None for any other."""
        if self.names is None or self.values is None or self._metrics is not None:
            return None
        return self.names, self.values

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
