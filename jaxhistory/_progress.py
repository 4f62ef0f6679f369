"""Progress: steps per second, the time left and the model FLOPs utilisation
that History adds to the metrics of summarized steps."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

from jaxhistory._row import Row

__all__ = ["Progress"]


class Progress:
    """Steps per second, the time left and the model FLOPs utilisation, added
    to the metrics of summarized steps.

    ``perf/steps_per_sec`` is the rate since the previous summarized step;
    ``perf/eta_sec`` uses the median time a step took over the last
    :attr:`WINDOW` intervals, so one slow interval (a compilation, an
    evaluation, a checkpoint) does not throw it.
    """

    WINDOW = 32  # intervals the time left is estimated from

    def __init__(
        self,
        total: int | None,
        flops: float | None,
        peak: float | None,
        clock: Any = None,
    ):
        self.total, self.flops, self.peak = total, flops, peak
        self.clock = clock  # None: time.perf_counter
        self.last: tuple[int, float] | None = None
        self.per_step: collections.deque[float] = collections.deque(
            maxlen=self.WINDOW
        )  # seconds a step took, one entry per interval

    @classmethod
    def of(cls, total, flops, peak) -> Progress | None:
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int) or total < 1
        ):
            raise ValueError(f"total_steps must be a positive int, got {total!r}")
        for name, value in (("flops_per_step", flops), ("peak_flops", peak)):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not value > 0
                or value == float("inf")
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if (flops is None) != (peak is None):
            raise ValueError(
                "MFU needs both flops_per_step (jaxhistory.step_flops of the step) "
                "and peak_flops (the devices' peak FLOP/s)"
            )
        if total is None and flops is None:
            return None
        return cls(total, flops, peak)

    def add(self, row: Row, log_every: int) -> Row:
        """``row`` with the progress metrics added at a summarized step."""
        extra = self.at(row.step, log_every)
        return row.extended(tuple(extra), tuple(extra.values())) if extra else row

    def at(self, step: int, log_every: int) -> dict[str, float]:
        """The progress metrics of ``step`` (empty between summarized steps and
        at the first one, which has no rate yet)."""
        if not isinstance(step, int) or step % log_every:
            return {}
        now = time.perf_counter() if self.clock is None else self.clock()
        last, self.last = self.last, (step, now)
        if last is None or step <= last[0] or now <= last[1]:
            return {}  # the first line: no rate yet
        rate = (step - last[0]) / (now - last[1])
        out = {"perf/steps_per_sec": rate}
        if self.total is not None:
            self.per_step.append((now - last[1]) / (step - last[0]))
            out["perf/eta_sec"] = max(self.total - step, 0) * statistics.median(
                self.per_step
            )
        if self.flops is not None and self.peak is not None:  # given together
            out["perf/mfu"] = rate * self.flops / self.peak
        return out
