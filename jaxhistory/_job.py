"""JobSync: what one History shares with the other processes of its job.

The reduction of per-device values and host scalars
(:class:`~jaxhistory._distributed.Reducer`, with its batches of host values
reduced every ``log_every`` updates and its check that values recorded as
they are agree everywhere), the hang watch
(:class:`~jaxhistory._hang.HangWatch`) and the straggler scores
(:class:`~jaxhistory._stragglers.StragglerScores`). History records the rows
these hand back; nothing here records or logs on its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxhistory import _trace_state
from jaxhistory._distributed import Reducer, client_is_current, distributed_client
from jaxhistory._hang import HangWatch, check_hang_timeout, hang_key
from jaxhistory._row import Row, RowKind
from jaxhistory._stragglers import StragglerScores, check_window

__all__ = ["JobSync"]

_HANG_NAMES = ("hang/process", "hang/last_step", "hang/seconds", "hang/processes")


class JobSync:
    """The cross-process parts of one History.

    Args:
        provenance: the reduction also records which device holds each max,
            min and first NaN.
        distributed_history: host scalars are reduced across processes (with
            several processes).
        hang_timeout: seconds before a process left behind is named (None:
            no hang watch).
        straggler_window: updates per window of the straggler scores.
        post: ``post(row)`` writes a hang report's row to the log, from the
            watch's thread.

    Not thread-safe: History calls it under its lock (the hang watch's thread
    only calls ``post``).
    """

    def __init__(
        self,
        provenance: bool,
        distributed_history: bool,
        hang_timeout: float | None,
        straggler_window: int,
        post: Callable[[Row], Any],
    ):
        self.hang_timeout = check_hang_timeout(hang_timeout)
        window = check_window(straggler_window)
        self.reducer = Reducer(provenance)
        multi = self.reducer.multi_process
        # host scalars are reduced across processes: no fast path then
        self.reduce_host = bool(distributed_history) and multi
        self._post = post
        # With several processes: a report when one stalls (started by the
        # first update, so a History never used posts nothing).
        self._hang: HangWatch | None = None
        self._hang_key = hang_key() if multi else None
        self._scores = StragglerScores(window) if self.reduce_host else None

    @property
    def plain(self) -> bool:
        """Whether rows of host values pass through untouched (nothing to
        watch, nothing reduced across processes)."""
        return self._hang_key is None and not self.reduce_host

    @property
    def watching(self) -> bool:
        """Whether :meth:`beat` has anything to do."""
        return self._hang_key is not None

    def beat(self, step: int) -> None:
        """Tells the hang watch this process reached ``step`` (started here
        the first time), before a reduction that may wait."""
        if self._hang_key is None:
            return
        hang = self._hang
        if hang is None:
            client = distributed_client()
            if self.hang_timeout is None or client is None:
                self._hang_key = None  # nothing to watch: never asked again
                return
            hang = self._hang = HangWatch(
                self.hang_timeout,
                client,
                self._hang_key,
                jax.process_index(),
                jax.process_count(),
                self._report,
                self.reducer.answer_names,
                functools.partial(client_is_current, client),
            )
        hang.beat(step)

    def _report(self, stalled: list, front: int) -> None:
        """A hang report (on the watch's thread): an instant event in the
        active trace and a ``hang/*`` row in the log."""
        first = stalled[0]
        handler = _trace_state.active()
        if handler is not None:
            args = {"process": first.process, "step": first.step, "span": first.span}
            handler.instant("hang", args, scope="g")
        values = (first.process, first.step, round(first.seconds, 3), len(stalled))
        self._post(Row(max(front, 0), _HANG_NAMES, values, RowKind.VALUES, time.time()))

    def stop_watch(self, settle: bool = False) -> None:
        """Stops the hang watch (the run is over, or paused); with ``settle``,
        once this process's reductions are done: one that waits for a process
        that closed before it (a device collective, which nothing cancels)
        is named by the watch meanwhile."""
        try:
            if settle and self._hang is not None:
                reduced = self.reducer.last_reduced
                if reduced is not None:
                    jax.block_until_ready(reduced)
        finally:  # (stopped also where the wait raised)
            hang, self._hang = self._hang, None
            if hang is not None:
                hang.stop()

    def scores(self, wait_all: bool = False) -> list[tuple[int, dict]]:
        """Hands the reduced arrival lags to the straggler scores and returns
        the rows, ``(step, {name: value})``, of every window due (``wait_all``:
        also the window in progress, at flush)."""
        scores = self._scores
        if scores is None:
            return []
        lags = self.reducer.lags
        if lags:
            for entry in lags:
                scores.add(*entry)
            lags.clear()
        if wait_all or scores.due():
            return scores.take(wait_all=wait_all)
        return []

    def finish_batch(self, log_every: int) -> list[Row]:
        """Reduces the values still waiting in a batch and fetches every batch
        (every process calls this at the same point: close and finalize);
        returns the rows of earlier updates they give."""
        if not (self.reduce_host and log_every > 1):
            return []
        self.reducer.run_batch(closing=True)
        rows, _ = self.reducer.collect(everything=True)
        return rows

    def raise_batch_error(self) -> None:
        """Raises what a batch failed with (processes that posted different
        updates: ValueError), once its earlier rows are recorded."""
        self.reducer.raise_batch_error()

    def check_same(self, wait_all: bool = False) -> None:
        """Raises ValueError where a value recorded as it is differed across
        processes (``wait_all``: waits for every batch's check), or where a
        batch failed."""
        if self.reduce_host:
            self.reducer.raise_batch_error()
            self.reducer.check_same(wait_all)
