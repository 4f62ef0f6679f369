"""The hang report of a multi-process History.

When one process stops (a stuck data loader, a deadlock, a process stopped by
a signal), the others wait in their next collective forever, with no word.
Here each process's background thread posts, every ``period`` seconds, the
latest step its History recorded and the innermost open
:class:`~jaxhistory.StopWatch` span of the thread that records, to the
distributed runtime's key-value store, and reads everyone's. A process that has
not reached the step the others are at, unchanged for ``timeout`` seconds (or,
when nobody moves, a process whose posts stopped too: it does not respond), is
named in a report: a ``RuntimeWarning``, a ``jaxhistory`` logger record, and
whatever ``report`` does with it (History writes it to its log and trace). So
is a process that closed (its last post says so, with its step) behind a step
where the others have stayed for ``timeout`` seconds: they wait for it in a
collective it will never join.

The training thread only stores the step (:meth:`HangWatch.beat`): no
collective, no I/O. So what a report says of a process (its step, its span) is
what it posted last, at most one period old. The store sees one write and
one read per process and period.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import numbers
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxhistory import _trace_state

__all__ = [
    "HANG_TIMEOUT_S",
    "HangWatch",
    "Stalled",
    "check_hang_timeout",
    "hang_key",
    "stop_all",
]

HANG_TIMEOUT_S = 300.0  # the default in multi-process runs
logger = logging.getLogger("jaxhistory")
_KEYS = itertools.count()  # alike in every process that makes its Histories alike
_LIVE: weakref.WeakSet[HangWatch] = weakref.WeakSet()  # watches not stopped yet
_LIVE_LOCK = threading.Lock()
_AT_EXIT = False  # whether stop_all is registered to run at exit


def stop_all() -> None:
    """Stops every watch still running (a History never closed), each posting
    that its process is done.

    Runs at exit, before the interpreter ends its daemon threads: a watch
    thread ended while inside the distributed runtime's client (native code)
    aborts the process. Call it before ``jax.distributed.shutdown()`` to have
    the posts arrive.
    """
    with _LIVE_LOCK:
        watches = list(_LIVE)
    for watch in watches:
        watch.stop()


def hang_key() -> str:
    """A key for the next History's watch: the k-th History made in each
    process shares the k-th key."""
    return str(next(_KEYS))


def check_hang_timeout(value: Any) -> float | None:
    """``hang_timeout`` as seconds, or None for off (``None``, ``0``, ``False``)."""
    if value is None or value is False or (type(value) is int and value == 0):
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"hang_timeout must be seconds (a number) or None, got {value!r:.40}"
        )
    # numbers.Real declares no comparison with int in typeshed
    if not value > 0 or value == float("inf"):  # type: ignore[operator]
        raise ValueError(f"hang_timeout must be positive and finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Stalled:
    """One process a report names."""

    process: int
    host: str
    step: int  # the latest step it recorded (-1: none yet)
    seconds: float  # how long it has been behind at that step, as seen here
    span: str | None  # its innermost open StopWatch span
    responding: bool  # whether its posts still arrive
    closed: bool = False  # its History was closed (step: the last it recorded)

    def text(self) -> str:
        if self.closed:
            at = f"at step {self.step}" if self.step >= 0 else "before any step"
            return f"process {self.process} ({self.host!r}) closed {at}"
        where = f" in {self.span!r}" if self.span else ""
        step = f"step {self.step}" if self.step >= 0 else "no step yet"
        state = "" if self.responding else ", not responding"
        return (
            f"process {self.process} ({self.host!r}) at {step}{where} for "
            f"{self.seconds:.0f} s{state}"
        )


@dataclass
class _Seen:
    step: int
    seq: int
    host: str
    span: str | None
    done: bool
    step_since: float  # monotonic time its step was first seen here
    seq_since: float  # and its latest post
    behind_since: float | None = None  # since another was seen at a later step


class HangWatch:
    """Posts this process's progress and reports processes that stall.

    Args:
        timeout: seconds a process may stay behind (or everyone may stay
            still) before it is reported.
        client: the distributed runtime's client (its key-value store).
        key: the same in every process for one History, different for another.
        me: this process's index; ``count``: how many processes there are.
        report: called on the watch thread with the stalled processes and the
            step the others are at, after the warning and the logger record.
        every_period: called on the watch thread every period; a text it
            returns is a problem to tell (a warning and a logger record).
        alive: whether ``client`` may still be used (False once the runtime
            is shut down); the watch ends itself when it is not.
    """

    def __init__(
        self,
        timeout: float,
        client: Any,
        key: str,
        me: int,
        count: int,
        report: Callable[[list[Stalled], int], None] | None = None,
        every_period: Callable[[], str | None] | None = None,
        alive: Callable[[], bool] = lambda: True,
    ):
        global _AT_EXIT
        self.timeout = timeout
        self.period = min(max(timeout / 5, 0.1), 5.0)
        self.step = -1  # the training thread's latest step
        self.thread_id: int | None = None
        self._client = client
        self._prefix = f"jaxhistory/hang/{key}/"
        self._me, self._count = me, count
        self._report = report
        self._every_period = every_period
        self._alive = alive
        self._host = socket.gethostname()
        self._seen: dict[int, _Seen] = {}
        self._reported: tuple | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="jaxhistory-hang-watch", daemon=True
        )
        with _LIVE_LOCK:
            _LIVE.add(self)
            if not _AT_EXIT:
                # Registered after jax.distributed.initialize: runs before
                # anything registered earlier, and before daemon threads end.
                atexit.register(stop_all)
                _AT_EXIT = True
        self._thread.start()

    def beat(self, step: int) -> None:
        """This process recorded ``step`` (the training thread; no I/O)."""
        self.step = step
        self.thread_id = threading.get_ident()

    def stop(self) -> None:
        """Posts that this process is done, at its latest step (reported only
        where the others wait at a later step: it closed behind them), and ends
        the thread, waiting for it at most one period. Stopping again does
        nothing."""
        with _LIVE_LOCK:
            if self._stop.is_set():
                return
            self._stop.set()
            _LIVE.discard(self)
        self._thread.join(self.period + 1.0)
        self._post(done=True)

    def _post(self, done: bool = False) -> None:
        self._seq += 1
        tid = self.thread_id
        span = None if tid is None else _trace_state.innermost_span(tid)
        value = json.dumps([self.step, self._seq, self._host, span, done])
        if not self._safe_alive():
            return
        with contextlib.suppress(Exception):  # slow or gone: next period
            self._client.key_value_set(
                self._prefix + str(self._me), value, allow_overwrite=True
            )

    def _safe_alive(self) -> bool:
        try:
            return bool(self._alive())
        except Exception:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if not self._safe_alive():
                return  # the runtime was shut down: nobody left to tell
            self._post()
            if self._every_period is not None:
                try:
                    problem = self._every_period()
                except Exception as err:  # its own trouble must not stop the watch
                    problem = f"the hang watch's periodic check failed: {err!r}"
                if problem:
                    logger.warning("%s", problem)
                    warnings.warn(problem, RuntimeWarning, stacklevel=1)
            try:
                entries = self._client.key_value_dir_get(self._prefix)
            except Exception:
                continue
            stalled, front = self.check(entries, time.monotonic())
            if stalled:
                self._tell(stalled, front)

    def check(self, entries: list, now: float) -> tuple[list[Stalled], int]:
        """The processes to report now (empty when none, or when they were
        reported already) from the store's ``(key, value)`` entries, and the
        step the others are at."""
        posted = {}
        for key, value in entries:
            try:
                process = int(str(key).rsplit("/", 1)[-1])
                step, seq, host, span, done = json.loads(value)
                posted[process] = (int(step), int(seq), str(host), span, bool(done))
            except (ValueError, TypeError):
                continue  # not ours, or cut: skipped
        for process in range(self._count):
            old = self._seen.get(process)
            step, seq, host, span, done = posted.get(
                process, (-1, -1, "?", None, False)
            )
            if old is None:
                old = self._seen[process] = _Seen(step, seq, host, span, done, now, now)
            if step != old.step:
                old.step, old.step_since = step, now
            if seq != old.seq:
                old.seq, old.seq_since = seq, now
            old.host, old.span, old.done = host, span, done
        live = {p: s for p, s in self._seen.items() if not s.done}
        if not live:
            return [], -1
        front = max(s.step for s in live.values())
        for s in self._seen.values():  # since when someone has been ahead of it
            if s.step >= front:
                s.behind_since = None
            elif s.behind_since is None:
                s.behind_since = now
        quiet = {p for p, s in live.items() if now - s.step_since >= self.timeout}
        if not quiet:
            self._reported = None  # re-armed once everyone moves
            return [], front
        named = [
            p
            for p, s in live.items()
            if s.behind_since is not None
            and now - max(s.step_since, s.behind_since) >= self.timeout
            and p != self._me
        ]
        if any(live[p].step == front for p in quiet):
            # Those at the front have waited there: for a process that closed
            # behind them, in a collective it will never join.
            named += [
                p
                for p, s in self._seen.items()
                if s.done
                and s.behind_since is not None
                and now - s.behind_since >= self.timeout
                and p != self._me
            ]
        if not named and quiet == set(live):  # nobody moves: a long pause, or
            # a process that stopped (its posts stopped too)
            named = [
                p
                for p in quiet
                if now - live[p].seq_since >= self.timeout and p != self._me
            ]
        if not named:
            return [], front
        episode = (front, tuple(sorted(named)))
        if episode == self._reported:
            return [], front
        self._reported = episode
        out = []
        for p in sorted(named):
            s = self._seen[p]
            if s.done:
                seconds = now - (s.behind_since or now)
                out.append(Stalled(p, s.host, s.step, seconds, None, True, True))
                continue
            responding = now - s.seq_since < 2 * self.period + 0.5
            since = max(s.step_since, s.behind_since or s.step_since)
            out.append(Stalled(p, s.host, s.step, now - since, s.span, responding))
        return out, front

    def _tell(self, stalled: list[Stalled], front: int) -> None:
        text = "; ".join(s.text() for s in stalled)
        message = (
            f"processes may hang: {text}; the others are at step {front} (hang_timeout="
            f"{self.timeout:g} s, seen from process {self._me})"
        )
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=1)
        if self._report is not None:
            try:
                self._report(stalled, front)
            except Exception as err:  # the report's own writing must not stop it
                logger.warning("could not write the hang report: %r", err)
