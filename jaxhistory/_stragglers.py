"""Straggler scores of a multi-process History.

Every update that reduces something also gives, at no extra collective, each
process's arrival lag: how many seconds after the median process it reached
the update. Here those lags are kept per process over a window of updates;
at the end of each window the median and 90th-percentile lag of every process
are recorded (``straggler/median_lag`` and ``straggler/p90_lag``, arrays of
one value per process, drawn as a process x step heatmap), with the slowest
process and its score (its median lag over the median time between updates).

A process whose median lag exceeds :data:`FLAG_SCORE` of the median time
between updates, and :data:`FLAG_MIN_S`, in a window is *consistently
slower*: a ``RuntimeWarning`` and a ``jaxhistory`` logger record name it (once
until it catches up), and ``straggler/flagged`` counts the flags.

The training thread only queues the lag arrays; they are read a window later,
when the devices are long done with them. The work per update does not depend
on the number of processes; per window it is one pass over the window.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from jaxhistory._dtypes import is_whole

__all__ = [
    "FLAG_MIN_S",
    "FLAG_SCORE",
    "LAG_BY_PROCESS",
    "StragglerScores",
    "check_window",
    "straggler_table",
]

FLAG_SCORE = 0.05  # a median lag of 5% of the time between updates, or more
FLAG_MIN_S = 0.002  # and at least 2 ms: below, clock noise
LAG_BY_PROCESS = ("straggler/median_lag", "straggler/p90_lag")
SLOWEST = ("straggler/slowest", "straggler/score", "straggler/flagged")
logger = logging.getLogger("jaxhistory")


def check_window(value: Any) -> int:
    """``straggler_window`` as a number of updates (an int of 2 or more)."""
    if not is_whole(value) or value < 2:
        raise ValueError(
            f"straggler_window must be an int of 2 or more (updates), got {value!r:.40}"
        )
    return int(value)


class StragglerScores:
    """Per-process arrival lags over windows of updates (not thread-safe: the
    History's lock guards it).

    Args:
        window: updates per window.
        processes: the process index of each entry of a lag array.
    """

    def __init__(self, window: int = 100):
        self.window = check_window(window)
        self._pending: list[tuple[int, float, Any, tuple]] = []
        self._flagged: set[int] = set()
        self.flags = 0

    def add(self, step: int, now: float, lags: Any, processes: tuple) -> None:
        """Queues one update's lag array (device or NumPy) of ``processes``."""
        self._pending.append((step, now, lags, processes))

    def due(self) -> bool:
        return len(self._pending) >= 2 * self.window

    def take(self, wait_all: bool = False) -> list[tuple[int, dict]]:
        """The rows to record for every full window queued a window ago (or
        every full window with ``wait_all``): ``(step, {name: value})``,
        at the window's last step. Warns for processes newly flagged."""
        rows = []
        while len(self._pending) >= (1 if wait_all else 2) * self.window:
            chunk = self._pending[: self.window]
            del self._pending[: self.window]
            rows.append(self._score(chunk))
        return rows

    def _score(self, chunk: list) -> tuple[int, dict]:
        processes = chunk[-1][3]
        same = [c[2] for c in chunk if c[3] is processes or c[3] == processes]
        # one conversion of the whole window (a row of a batch's lags each)
        lags = np.array(same, np.float64)  # (W, P)
        times = np.asarray([c[1] for c in chunk], np.float64)
        interval = float(np.median(np.diff(times))) if len(times) > 1 else 0.0
        median = np.median(lags, axis=0)
        p90 = np.quantile(lags, 0.9, axis=0)
        slowest = int(np.argmax(median))
        score = float(median[slowest] / interval) if interval > 0 else 0.0
        limit = max(FLAG_SCORE * interval, FLAG_MIN_S)
        slow = {processes[i] for i in np.flatnonzero(median > limit)}
        for process in sorted(slow - self._flagged):
            i = processes.index(process)
            message = (
                f"process {process} is consistently slower: over steps "
                f"{chunk[0][0]}-{chunk[-1][0]} it reached updates a median "
                f"{median[i] * 1e3:.1f} ms (p90 {p90[i] * 1e3:.1f} ms) after the "
                f"median process, {median[i] / interval:.0%} of the "
                f"{interval * 1e3:.1f} ms between updates"
            )
            logger.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            self.flags += 1
        self._flagged = slow  # a process that caught up may be flagged again
        values = {
            LAG_BY_PROCESS[0]: median.astype(np.float32),
            LAG_BY_PROCESS[1]: p90.astype(np.float32),
            SLOWEST[0]: processes[slowest],
            SLOWEST[1]: score,
            SLOWEST[2]: self.flags,
        }
        return chunk[-1][0], values


def straggler_table(state: Any, top: int = 10) -> list[str]:
    """Markdown lines: the processes with the largest median arrival lag over
    the run (from the recorded windows), with their p90 lag and the windows
    they were the slowest in; empty when there are no straggler scores."""
    if LAG_BY_PROCESS[0] not in state.keys:
        return []
    median = np.asarray(state.values(LAG_BY_PROCESS[0]), np.float64)
    if median.ndim != 2 or not median.size:
        return []
    p90 = np.asarray(state.values(LAG_BY_PROCESS[1]), np.float64)
    if p90.shape != median.shape:
        p90 = np.full_like(median, np.nan)
    overall = np.nanmedian(median, axis=0)
    worst = np.nanmax(p90, axis=0)
    slowest = np.argmax(median, axis=1)
    order = np.argsort(-overall, kind="stable")[:top]
    lines = [
        f"Arrival lag behind the median process, per window of updates "
        f"({median.shape[0]} window(s); the heatmap is "
        f"`{LAG_BY_PROCESS[0]}`).",
        "",
        "| process | median lag ms | worst p90 lag ms | slowest in windows |",
        "|---|---|---|---|",
    ]
    for i in order.tolist():
        lines.append(
            f"| {i} | {overall[i] * 1e3:.2f} | {worst[i] * 1e3:.2f} | "
            f"{int((slowest == i).sum())} of {median.shape[0]} |"
        )
    if "straggler/flagged" in state.keys:
        flags = np.asarray(state.values("straggler/flagged"))
        if flags.size and flags[-1] > 0:
            lines += ["", f"Flagged as consistently slower: {int(flags[-1])} time(s)."]
    return lines
