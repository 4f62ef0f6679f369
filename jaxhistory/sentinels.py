"""Sentinels: checks on the values a :class:`~jaxhistory.History` records that
act before a run crashes.

* :class:`NonFinite`: a NaN or infinite value of the metrics it watches.
* :class:`Spike`: a value far from the recent ones, by a robust z-score (the
  distance from the median of the last ``window`` values, in units of their
  median absolute deviation), so one spike does not hide the next.

Pass them as ``History(sentinels=[...])``. Each event names the metric and the
step and, where :func:`~jaxhistory.distributed_stats` provenance was recorded,
the device and its process. The action is ``"warn"`` (a ``RuntimeWarning`` and
a record on the ``jaxhistory`` logger), ``"raise"`` (:class:`SentinelError`) or
a callable that receives the :class:`Event`. The counts ``sentinel/nonfinite``
and ``sentinel/spike`` are recorded at the step of each event, and the report
lists the events. A callable runs on the thread whose update or flush found
the event, after the step's line is in the JSONL log (one that hangs holds
that thread); at finalize, on a thread of its own, waited for at most
:data:`ACTION_TIMEOUT` seconds for all the sentinels together (then the
events not reached are not acted on), with a warning naming the sentinel.

When they act: values of Python numbers at the update that records them;
device values (JAX arrays, ``Stats``) once they are on the host, at an update
within the bounded window of updates whose device values may still be in
flight (8), or at :meth:`~jaxhistory.History.flush` /
:meth:`~jaxhistory.History.finalize`. A ``"raise"`` comes after the step's
line is in the JSONL log.

Examples:
    >>> import warnings
    >>> import jaxhistory as jh
    >>> from jaxhistory.sentinels import NonFinite
    >>> h = jh.History(distributed_history=False, sentinels=[NonFinite("loss")])
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = h.update({"loss": float("nan")}, step=7)
    >>> str(caught[0].message)
    "step 7: 'loss' is NaN"
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import fnmatch
import logging
import math
import numbers
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxhistory._dtypes import is_whole
from jaxhistory._host_copies import host_copies, is_done, to_host
from jaxhistory._names import PROVENANCE, printable, stat_names
from jaxhistory._stats import STATS, Stats
from jaxhistory._summary import nonfinite_notes
from jaxhistory._writer import warn_quietly
from jaxhistory.sinks._feed import CallsInOrder

__all__ = ["Event", "Guard", "NonFinite", "Sentinel", "SentinelError", "Spike"]

logger = logging.getLogger("jaxhistory")
logger.addHandler(logging.NullHandler())  # shown where the user sets up logging
ACTIONS = ("warn", "raise")
MAX_EVENTS = 1000  # events kept for the report (the counts count them all)
ACTION_TIMEOUT = 60.0  # seconds finalize waits, in all, for the callable actions


@dataclasses.dataclass(frozen=True)
class Event:
    """What a sentinel found: its kind (``"nonfinite"`` or ``"spike"``), the
    metric, the step, the value, and a description (``"is NaN on device 3
    (process 1)"``, ``"spiked: 9.1 is 41.3 robust deviations from the median
    0.52 of the last 100 values"``)."""

    kind: str
    metric: str
    step: int
    value: float
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}: {printable(self.metric)!r} {self.detail}"


class SentinelError(RuntimeError):
    """Raised by a sentinel whose action is ``"raise"``; ``event`` says why."""

    def __init__(self, event: Event):
        super().__init__(str(event))
        self.event = event


def _check_action(action: Any) -> Any:
    if action in ACTIONS or callable(action):
        return action
    raise ValueError(
        f"a sentinel's action must be 'warn', 'raise' or a callable taking the "
        f"Event, got {action!r:.60}"
    )


class Sentinel(abc.ABC):
    """A check on recorded values: :class:`NonFinite`, :class:`Spike`."""

    kind = ""
    action: Any = "warn"
    patterns: tuple[str, ...] = ()

    def wants(self, name: str) -> bool:
        """Whether this sentinel looks at metric ``name``."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    @abc.abstractmethod
    def see(self, name: str, step: int, value: Any, note: str = "") -> Event | None:
        """Looks at ``value`` of metric ``name`` at ``step`` (``note``: where it
        is, for a non-finite statistic with provenance); the event, or None.
        ``value`` is a Python number or a NumPy array: device values arrive
        read to the host."""


class NonFinite(Sentinel):
    """Fires when a watched value is NaN or infinite (an array when any of its
    elements is).

    Args:
        metrics: glob patterns of the metric names to watch (``"*"``: all;
            ``"loss"``, ``"train/*"``); a distributed metric's statistics are
            ``loss/mean``, ``loss/max``, ... (``"loss*"`` matches them all).
        action: ``"warn"``, ``"raise"`` or a callable taking the :class:`Event`.
    """

    kind = "nonfinite"

    def __init__(self, metrics: str | Sequence[str] = "*", action: Any = "warn"):
        try:
            patterns = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        except TypeError:
            patterns = ()  # refused below, naming it
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise TypeError(
                f"NonFinite: metrics must be glob patterns (str), got {metrics!r:.60}"
            )
        self.patterns = patterns
        self.action = _check_action(action)

    def see(self, name: str, step: int, value: Any, note: str = "") -> Event | None:
        if type(value) is float:
            if value - value == 0.0:
                return None
            x = value
        else:
            arr = np.asarray(value, np.float64)
            if np.isfinite(arr).all():
                return None
            bad = arr[~np.isfinite(arr)].ravel()
            x = float(bad[0])
        what = "NaN" if math.isnan(x) else "inf" if x > 0 else "-inf"
        detail = f"is {note or what}"
        return Event(self.kind, name, step, x, detail)

    def __repr__(self) -> str:
        return f"NonFinite({list(self.patterns)!r}, action={self.action!r})"


class Spike(Sentinel):
    """Fires when a value is more than ``threshold`` robust deviations from the
    median of the last ``window`` values of the metric.

    The robust deviation is 1.4826 times the median absolute deviation of
    those values (the standard deviation, for normal noise), so a spike moves
    neither the median nor the deviation much and the next spike is still
    seen. Where half the values or more equal the median (the median
    absolute deviation is 0), 1.2533 times their mean absolute deviation
    from it stands in. It needs ``min_steps`` values first (default a tenth
    of the window, at least 10). A metric that was constant over the window
    fires at its first change larger than float32 rounding (``threshold``
    times 2**-22 of its value: 1.4e-6 of it by default). Non-finite values
    are :class:`NonFinite`'s, not counted here. The median and the
    deviation are refreshed every quarter window; a value past the threshold
    is judged against freshly computed ones.

    Args:
        metric: the metric name (a glob pattern: each metric it matches has
            its own window).
        window: how many recent values (at least 3).
        threshold: robust deviations from the median (above 0).
        action: ``"warn"``, ``"raise"`` or a callable taking the :class:`Event`.
        min_steps: values seen before it may fire.
    """

    kind = "spike"
    window: int
    threshold: float
    min_steps: int
    _refresh: int

    def __init__(
        self,
        metric: str,
        window: int = 100,
        threshold: float = 6.0,
        action: Any = "warn",
        min_steps: int | None = None,
    ):
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"Spike: metric must be a name (str), got {metric!r:.60}")
        if not is_whole(window) or window < 3:
            raise ValueError(
                f"Spike: window must be an int of at least 3, got {window!r}"
            )
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, numbers.Real)
            or not threshold > 0
        ):
            raise ValueError(f"Spike: threshold must be above 0, got {threshold!r}")
        if min_steps is None:
            min_steps = min(window, max(10, window // 10))
        if not is_whole(min_steps) or not 2 <= min_steps <= window:
            raise ValueError(
                f"Spike: min_steps must be an int from 2 to window ({window}), "
                f"got {min_steps!r}"
            )
        self.patterns = (metric,)
        self.window, self.threshold = int(window), float(threshold)
        self.min_steps = int(min_steps)
        self.action = _check_action(action)
        self._refresh = max(1, window // 4)
        self._seen: dict[str, list] = {}  # name -> [values, median, scale, age]

    def see(self, name: str, step: int, value: Any, note: str = "") -> Event | None:
        if type(value) is not float:
            arr = np.asarray(value)
            if arr.size != 1:
                return None  # a spike is judged on one value per step
            value = float(arr.reshape(()))
        if value - value != 0.0:
            return None  # NaN or inf: NonFinite's to report
        seen = self._seen.get(name)
        if seen is None:
            seen = [collections.deque(maxlen=self.window), 0.0, 0.0, 0]
            self._seen[name] = seen
        values = seen[0]
        event = None
        if len(values) >= self.min_steps:
            if seen[3] >= self._refresh or seen[3] == len(values):
                self._measure(seen)
            if abs(value - seen[1]) > self.threshold * seen[2]:
                event = self._judged(name, step, value, seen)
        values.append(value)
        seen[3] += 1
        return event

    def _judged(self, name: str, step: int, value: float, seen: list) -> Event | None:
        """The event for a value past the threshold, judged against freshly
        computed figures (None if it is not past them)."""
        if seen[3]:
            self._measure(seen)
        median, scale = seen[1], seen[2]
        z = abs(value - median) / scale
        if z <= self.threshold:
            return None
        return Event(
            self.kind,
            name,
            step,
            value,
            f"spiked: {value:.6g} is {z:.1f} robust deviations from the median "
            f"{median:.6g} of the last {len(seen[0])} values",
        )

    @staticmethod
    def _measure(seen: list) -> None:
        values = seen[0]
        median = statistics.median(values)
        off = [abs(v - median) for v in values]
        scale = 1.4826 * statistics.median(off)
        if scale == 0:  # half the values or more at the median: their mean
            scale = 1.2533 * statistics.fmean(off)  # deviation (Iglewicz-Hoaglin)
        # a floor: a constant window still gives a finite deviation, above
        # float32 rounding (2**-23 of a value): a change by a few rounding
        # steps is no spike
        seen[1] = median
        seen[2] = max(scale, 2**-22 * abs(median), 1e-12)
        seen[3] = 0

    def __repr__(self) -> str:
        return (
            f"Spike({self.patterns[0]!r}, window={self.window}, "
            f"threshold={self.threshold:g}, action={self.action!r})"
        )


class Guard:
    """Runs a History's sentinels: checks rows, keeps the events, counts them
    and acts. Used by :class:`~jaxhistory.History` under its lock."""

    INFLIGHT = 8  # device rows waited for at most this many updates later

    def __init__(self, sentinels: Sequence[Any]):
        if isinstance(sentinels, Sentinel):
            raise TypeError(
                f"sentinels must be a list of NonFinite or Spike objects: "
                f"sentinels=[{sentinels!r}], not sentinels={sentinels!r}"
            )
        sentinels = list(sentinels)
        for s in sentinels:
            if not isinstance(s, Sentinel):
                raise TypeError(
                    f"sentinels must be NonFinite or Spike objects, got "
                    f"{type(s).__name__}"
                )
        self.sentinels = sentinels
        self.events: collections.deque[Event] = collections.deque(maxlen=MAX_EVENTS)
        self.counts = {"nonfinite": 0, "spike": 0}
        self.matched: set[int] = set()  # sentinels that matched a recorded metric
        self._plan: dict[tuple, list] = {}  # names -> [(index, sentinels)]
        self._last: tuple = (None, None, None)  # the last names, finite, plan
        self.pending: collections.deque = collections.deque()  # device rows
        self._spikes = [s for s in sentinels if isinstance(s, Spike)]

    def _targets(self, names: tuple, finite: bool = False) -> list:
        """``[(index, sentinels)]`` of the names some sentinel watches (with
        ``finite``, leaving out the NonFinite ones: nothing for them to see)."""
        last = self._last
        if last[0] is names and last[1] is finite:  # rows parsed alike share names
            return last[2]
        key = (names, finite)
        plan = self._plan.get(key)
        if plan is None:
            if len(self._plan) > 256:
                self._plan.clear()
            plan = []
            for i, name in enumerate(names):
                who = [s for s in self.sentinels if s.wants(name)]
                self.matched.update(id(s) for s in who)
                if finite:
                    who = [s for s in who if s.kind != "nonfinite"]
                if who:
                    plan.append((i, who))
            self._plan[key] = plan
        self._last = (names, finite, plan)
        return plan

    def host_row(self, step: int, names: tuple, values: tuple, finite: bool) -> list:
        """Checks a row of Python numbers now (``finite``: known finite)."""
        events = []
        for i, who in self._targets(names, finite):
            for s in who:
                event = s.see(names[i], step, values[i])
                if event is not None:
                    events.append((s, event))
        return events

    def device_row(self, step: int, names: tuple, values: tuple) -> None:
        """Queues a row with device values, checked once they are on the host."""
        self.pending.append((step, names, values))

    def ready(self, wait: bool = False) -> list:
        """Checks the queued device rows whose values are on the host (all of
        them with ``wait``; the oldest ones past :attr:`INFLIGHT` in any case)."""
        events = []
        queue = self.pending
        while queue:
            step, names, values = queue[0]
            if not (wait or len(queue) > self.INFLIGHT or _ready(values)):
                break
            queue.popleft()
            try:
                events += self._check_device(step, names, values)
            except Exception as err:  # deleted or donated since: nothing to check
                warnings.warn(
                    f"sentinels could not read the values of step {step} ({err})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return events

    def _check_device(self, step: int, names: tuple, values: tuple) -> list:
        flat_names: list[str] = []
        flat_values, notes = [], {}
        for name, value in zip(names, values, strict=True):
            if type(value) is Stats:
                prefix = f"{name}/" if name else ""
                host = Stats(
                    value.names,
                    np.asarray(value.table),
                    None if value.where is None else np.asarray(value.where),
                    value.rows,
                )
                cells = stat_names(host.names, prefix, host.rows)
                flat_names += cells
                flat_values += np.asarray(host.table).reshape(-1).tolist()
                if host.rows[:4] == STATS:
                    for metric, note in nonfinite_notes(host, prefix).items():
                        for stat in STATS:
                            notes[f"{metric}/{stat}"] = note
                if host.where is not None:
                    flat_names += stat_names(host.names, prefix, PROVENANCE)
                    flat_values += np.asarray(host.where).reshape(-1).tolist()
            else:
                flat_names.append(name)
                flat_values.append(value)
        names = tuple(flat_names)
        events = []
        for i, who in self._targets(names):
            value = flat_values[i]
            if type(value) is not float:  # (of a step already done: no wait)
                value = to_host(value, older_only=True)
            for s in who:
                event = s.see(names[i], step, value, notes.get(names[i], ""))
                if event is not None:
                    events.append((s, event))
        return events

    def counted(self, events: list) -> list[tuple[int, str, float]]:
        """Keeps the ``(sentinel, event)`` pairs' events and returns the
        counters to record: ``[(step, "sentinel/nonfinite", total so far)]``,
        one per kind, at the latest step of that kind's events here."""
        out: dict[str, tuple[int, float]] = {}
        for _, event in events:
            self.events.append(event)
            self.counts[event.kind] += 1
            step = max(event.step, out.get(event.kind, (event.step,))[0])
            out[event.kind] = (step, float(self.counts[event.kind]))
        return [(step, f"sentinel/{kind}", n) for kind, (step, n) in out.items()]

    @staticmethod
    def calls(events: list) -> bool:
        """Whether the action of any of the ``(sentinel, event)`` pairs is a
        callable (the user's code: it may hang, or end the process)."""
        return any(s.action not in ACTIONS for s, _ in events)

    def act(self, events: list, bounded: bool = False) -> SentinelError | None:
        """Warns and calls the callables for ``events``; returns the error to
        raise for the first event whose action is ``"raise"`` (the caller
        raises it once the step's line is in the log). ``bounded`` (at
        finalize): see :meth:`_call_bounded`."""
        error = None
        calls: dict[int, tuple[Sentinel, list]] = {}  # bounded: id -> events
        for s, event in events:
            if s.action == "warn":
                logger.warning("sentinel: %s", event)
                warnings.warn(str(event), RuntimeWarning, stacklevel=4)
            elif s.action == "raise":
                error = error or SentinelError(event)
            elif bounded:
                calls.setdefault(id(s), (s, []))[1].append(event)
            else:
                try:
                    s.action(event)
                except Exception as err:  # the user's code: reported, not fatal
                    warnings.warn(
                        f"the action of {s!r} raised {err!r} for {event}; "
                        "recording goes on",
                        RuntimeWarning,
                        stacklevel=4,
                    )
        if calls:
            self._call_bounded(list(calls.values()))
        return error

    @staticmethod
    def _call_bounded(calls: list[tuple[Sentinel, list]]) -> None:
        """At finalize: each sentinel's action is called for its events, in
        order, on a thread of its own, the sentinels side by side, all waited
        for :data:`ACTION_TIMEOUT` seconds in all. What an action raises
        (SystemExit too) is a warning; one that has not returned by then is
        left to its thread, and the events not reached are not acted on, with
        a warning naming the sentinel."""
        deadline = time.monotonic() + ACTION_TIMEOUT
        runs = [
            (s, CallsInOrder(s.action, found, "jaxhistory-sentinel-action"))
            for s, found in calls
        ]
        for _, run in runs:
            run.join(deadline)
        for s, run in runs:
            running, never = run.stop()
            for event, err in list(run.errors):
                warn_quietly(
                    f"the action of {s!r} raised {err!r} for {event}; finalize goes on",
                    stacklevel=5,
                )
            if running is not None:
                warn_quietly(
                    f"the action of {s!r} did not return within "
                    f"{ACTION_TIMEOUT:g} s (finalize's time for all the "
                    f"sentinels' actions) for {running}; finalize went on "
                    "without it (it is left to its thread, and not called "
                    "for this finalize's later events)",
                    stacklevel=5,
                )
            if never:
                n = len(never)
                warn_quietly(
                    f"{n} event{'s' if n > 1 else ''} of {s!r} not acted on: "
                    f"the {ACTION_TIMEOUT:g} s finalize gives the sentinels' "
                    "actions were spent (the events are counted, and listed "
                    "in the report)",
                    stacklevel=5,
                )

    def unmatched(self) -> list[Sentinel]:
        """Sentinels that matched no recorded metric."""
        return [s for s in self.sentinels if id(s) not in self.matched]


def _ready(values: tuple) -> bool:
    """Whether the device values of a row can be read without waiting: done,
    and sent to the host (not still waiting to go in a stacked transfer). A
    deleted array counts as ready: reading it reports it."""
    for value in values:
        arrays = (value.table, value.where) if type(value) is Stats else (value,)
        for a in arrays:
            if host_copies.waits(a) or not is_done(a):
                return False
    return True


Action = str | Callable[[Event], Any]
