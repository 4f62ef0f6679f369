"""SideValues: what History records beside each update's own metrics: values
attached from any thread (timings, published metrics) and memory samples."""

from __future__ import annotations

import threading
from typing import Any

from jaxhistory import _memory
from jaxhistory._dtypes import as_step, host_value
from jaxhistory._history_state import HistoryState
from jaxhistory._names import check_nul, empty_name, flatten
from jaxhistory._summary import memory_token
from jaxhistory._writer import warn_quietly

__all__ = ["SideValues"]


class SideValues:
    """Values waiting for History's next update, and the memory sampler.

    ``attach`` may run on any thread (it takes only this object's lock, never
    held while anything waits); the other methods run under History's lock.
    ``memory_every``: sample memory every N updates (0: never).
    """

    def __init__(self, memory_every: int):
        self.memory_every = memory_every
        self._lock = threading.Lock()
        self._waiting: dict[str, Any] = {}  # values for the next update's step
        self._at: list[tuple[int, dict]] = []  # ... with steps of their own
        # whether the next update has memory metrics or attached values to record
        self.due = bool(memory_every)
        self._mem_last_step: int | None = None
        self._rss_peak = 0

    def attach(self, metrics: Any, step: Any = None) -> None:
        """Queues host values (checked now: a bad one fails this call and never
        costs the values already waiting)."""
        items = {n: host_value(n, v)[0] for n, v in flatten(metrics)}
        if "" in items:
            empty_name()
        check_nul(items)
        if step is not None:
            step = as_step("step", step)
        with self._lock:
            if step is None:
                self._waiting.update(items)
            elif items:
                self._at.append((step, items))
            self.due = self.due or bool(items)

    def at_update(self, state: HistoryState, step: int, updates: int):
        """Records memory (when due) and the waiting values at ``step``.

        Returns (the state, the memory token, the (name, value) pairs recorded at
        ``step``, [(step, pairs)] recorded at steps of their own)."""
        token, side = "", ()
        if self.memory_every:
            state, token, side = self._memory(state, step, updates)
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            at, self._at = self._at, []
            self.due = bool(self.memory_every)
        earlier: list = []
        if waiting or at:
            state, now_items, earlier = _record(state, waiting, at, step)
            side = (*side, *now_items)
        return state, token, side, earlier

    def leftover(self, state: HistoryState, with_step_only: bool = False):
        """Records values still waiting (``with_step_only``: only those with a
        step of their own): those without a step at the latest step (no new step
        where the other metrics would be NaN), or at the next one where one of
        them already has a record there.

        Returns (the state, [(step, pairs)] recorded)."""
        with self._lock:
            if not (self._waiting or self._at):
                return state, []
            waiting: dict[str, Any] = {}
            if not with_step_only:
                waiting, self._waiting = self._waiting, {}
            at, self._at = self._at, []
            self.due = bool(self.memory_every or self._waiting)
        step = max(state.next_step - 1, 0)
        for name in waiting:
            last = state.last_step(name) if name in state else None
            if last is not None and last >= step:
                step = state.next_step
                break
        state, now_items, earlier = _record(state, waiting, at, step)
        if now_items:
            earlier.append((step, list(now_items)))
        return state, earlier

    def _memory(self, state: HistoryState, step: int, updates: int):
        """Records ``mem/*`` at ``step`` every ``memory_every`` updates."""
        if (updates - 1) % self.memory_every:
            return state, "", ()
        if self._mem_last_step is not None and step <= self._mem_last_step:
            return state, "", ()  # an update at an earlier step (another cadence)
        rss = _memory.host_rss()
        self._rss_peak = max(self._rss_peak, rss)
        sample = _memory.device_memory()
        mem = {"mem/host_rss": rss, "mem/device_in_use": sample.in_use}
        if sample.peak is not None:
            mem["mem/device_peak"] = sample.peak
        state = state.update(mem, step=step)
        self._mem_last_step = step
        token = memory_token(sample, rss, self._rss_peak)
        return state, token, tuple(mem.items())


def _record(state: HistoryState, waiting: dict, at: list, step: int):
    """Records ``waiting`` at ``step`` and ``at`` at their own steps. Returns
    (the state, pairs recorded at ``step``, [(step, pairs)] of the others)."""
    now_items: tuple = ()
    if waiting:
        state, ok = _record_local(state, waiting, step)
        if ok:
            now_items = tuple(waiting.items())
    earlier = []
    for s, values in at:
        state, ok = _record_local(state, values, s)
        if ok:
            earlier.append((s, list(values.items())))
    return state, now_items, earlier


def _record_local(state: HistoryState, values: dict, step: int):
    try:
        return state.update(values, step=step), True
    except (TypeError, ValueError) as err:  # e.g. already recorded there
        # (-W error: to the logger, never out of the update, flush or finalize
        # that records them)
        warn_quietly(
            f"attached values {sorted(values)} were not recorded at step {step}: {err}",
            stacklevel=4,
        )
        return state, False
