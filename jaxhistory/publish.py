"""Metric publishing: ``configure`` handlers per group, ``put_metric``, ``@prof``.

The metrics API of torchelastic, carried over with its known flaws fixed:
durations come from a monotonic clock in float milliseconds, a handler that
raises never turns a success into a failure nor hides the caller's exception or
return value, ``@prof("group")`` is a clear TypeError, and the registry is
thread-safe and can be reset or scoped.

Examples:
    >>> from jaxhistory import publish
    >>> with publish.scoped():  # a private registry, restored afterwards
    ...     publish.configure(publish.ConsoleMetricHandler(), group="app")
    ...     publish.put_metric("queue_depth", 3, metric_group="app")
    ...     publish.put_metric("ignored", 1)  # default group: the null handler
    [...][app]: queue_depth=3
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import logging
import sys
import threading
import time
import typing
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from jaxhistory._names import printable
from jaxhistory._record import Batch, Record
from jaxhistory._writer import AtExit
from jaxhistory.sinks._base import is_sink, writes_here
from jaxhistory.sinks._feed import SinkFeed

__all__ = [
    "ConsoleMetricHandler",
    "HistoryHandler",
    "MetricData",
    "MetricHandler",
    "MetricStream",
    "NullMetricHandler",
    "SinkHandler",
    "close",
    "configure",
    "flush",
    "getStream",
    "get_stream",
    "prof",
    "put_metric",
    "reset",
    "scoped",
]

DEFAULT_GROUP = "jaxhistory"


class MetricData(typing.NamedTuple):
    """One published value: wall-clock ``timestamp`` (seconds), its group, name.

    A named tuple, as torchelastic's is: a handler may read its fields by name
    or unpack it (``timestamp, group, name, value = metric_data``).
    """

    timestamp: float
    group_name: str
    name: str
    value: Any


class MetricHandler(abc.ABC):
    """Where published metrics go: implement :meth:`emit`."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None:
        """Receives one metric."""


class ConsoleMetricHandler(MetricHandler):
    """Prints ``[<timestamp>][<group>]: <name>=<value>`` to ``stream`` (stdout).

    Examples:
        >>> from jaxhistory import publish
        >>> publish.ConsoleMetricHandler().emit(
        ...     publish.MetricData(1700000000.5, "app", "latency.ms", 1.25))
        [1700000000.5][app]: latency.ms=1.25
    """

    def __init__(self, stream=None):
        self.stream = stream

    def emit(self, metric_data: MetricData) -> None:
        d = metric_data  # (control characters in what is shown as \\xNN)
        group, name, value = printable(d.group_name), printable(d.name), d.value
        print(
            f"[{d.timestamp}][{group}]: {name}={printable(value)}",
            file=self.stream if self.stream is not None else sys.stdout,
        )


class NullMetricHandler(MetricHandler):
    """Drops every metric (the default handler)."""

    def emit(self, metric_data: MetricData) -> None:
        return None


class HistoryHandler(MetricHandler):
    """Records published metrics into a :class:`~jaxhistory.History` as
    ``{group}/{name}``, with :meth:`History.attach <jaxhistory.History.attach>`:
    at the step of the history's next update (a metric published twice before it
    keeps the later value), on this process alone, from any thread, without
    moving the step counter.

    Examples:
        >>> import jaxhistory as jh
        >>> from jaxhistory import publish
        >>> h = jh.History(distributed_history=False)
        >>> with publish.scoped():
        ...     publish.configure(publish.HistoryHandler(h), group="agent")
        ...     publish.put_metric("restarts", 2, metric_group="agent")
        >>> h.update({"loss": 0.5})
        'step=0 loss=0.500000'
        >>> h.state.values("agent/restarts").tolist()
        [2]
    """

    def __init__(self, history: Any):
        if not hasattr(history, "attach"):
            raise TypeError(
                f"HistoryHandler needs a History, got {type(history).__name__}"
            )
        self.history = history

    def emit(self, metric_data: MetricData) -> None:
        name = f"{metric_data.group_name}/{metric_data.name}"
        self.history.attach({name: metric_data.value})


class SinkHandler(MetricHandler):
    """Sends published metrics to a sink (``write``/``flush``/``close``) as
    :class:`~jaxhistory.sinks.Record` values with ``group`` set and no step, and
    flushes it after each. Like every sink, from process 0 only unless the sink
    has ``all_processes = True``.

    The sink is the user's code, so it is written from a thread of its own, as
    History's sinks are: publishing never waits for it, and a ``write`` that
    raises warns once, naming the sink, instead of raising where the metric was
    published. :meth:`flush` and :meth:`close` wait at most ``timeout`` seconds
    (5 s by default), then warn naming a sink that did not finish; at exit,
    what was published is flushed the same way. A handler dropped (replaced by
    :func:`configure`, or by :func:`reset`) has its thread hand the sink what
    was published, flush it and end; the sink is not closed.
    """

    def __init__(self, sink: Any):
        self.sink = sink
        self._feed = SinkFeed([sink])
        self._at_exit = AtExit(self, "flush")
        # Dropped (configure replaced it, reset): the sink's thread writes what
        # was published, flushes the sink and ends, instead of idling forever.
        # (Not at exit: a close() at exit still closes the sink.)
        weakref.finalize(self, self._feed.retire).atexit = False

    def emit(self, metric_data: MetricData) -> None:
        if not writes_here(self.sink):
            return
        record = Record(
            step=None,
            timestamp=metric_data.timestamp,
            metrics={metric_data.name: metric_data.value},
            group=metric_data.group_name,
        )
        self._feed.put(Batch.of([record]), flush=True)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until the sink has written and flushed what was published
        (at most ``timeout`` seconds, default 5)."""
        self._feed.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes, then closes the sink (waiting at most ``timeout`` seconds,
        default 5); later metrics are not written to it."""
        self._feed.close(timeout)
        self._at_exit.cancel()


class MetricStream:
    """A group's stream of metrics: ``add_value(name, value)``.

    ``MetricStream(group, handler)`` (torchelastic's form) sends every value to
    ``handler`` (a :class:`MetricHandler` or a sink); :func:`get_stream` gives a
    stream that looks the group's handler up at each value, so configuring later
    still takes effect.
    """

    def __init__(self, group_name: str, handler: Any = None):
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group_name must be a non-empty str, got {group_name!r}")
        self.group_name = group_name
        # exactly one of the two is set: a fixed handler, or the registry's
        self._registry: _Registry | None
        self._fixed: MetricHandler | None
        if handler is None or isinstance(handler, _Registry):
            self._registry, self._fixed = handler or _registry(), None
        else:
            self._registry, self._fixed = None, _as_handler(handler)

    @property
    def handler(self) -> MetricHandler:
        """The handler this group's metrics go to now."""
        if self._fixed is not None:
            return self._fixed
        assert self._registry is not None  # set where _fixed is not
        return self._registry.handler(self.group_name)

    def add_value(self, metric_name: str, metric_value: Any) -> None:
        """Publishes one value to the group's handler."""
        if not isinstance(metric_name, str) or not metric_name:
            raise ValueError(
                f"metric name must be a non-empty str, got {metric_name!r}"
            )
        if self._fixed is not None:
            data = MetricData(time.time(), self.group_name, metric_name, metric_value)
            _emit(self._fixed, data)
        else:
            assert self._registry is not None  # set where _fixed is not
            self._registry.publish(self.group_name, metric_name, metric_value)


class _Registry:
    """Group -> handler, with a default; safe to use from several threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.default: MetricHandler = NullMetricHandler()
        self.groups: dict[str, MetricHandler] = {}

    def configure(self, handler: MetricHandler, group: str | None) -> None:
        with self._lock:
            if group is None:
                self.default = handler
            else:
                self.groups[group] = handler

    def handler(self, group: str) -> MetricHandler:
        with self._lock:
            return self.groups.get(group, self.default)

    def publish(self, group: str, name: str, value: Any) -> None:
        # Looked up at publish time: a handler configured late still gets metrics.
        _emit(self.handler(group), MetricData(time.time(), group, name, value))


def _emit(handler: MetricHandler, data: MetricData) -> None:
    """``handler.emit(data)``; an error the handler raises (a closed stream, a
    full disk; ``SystemExit`` and ``GeneratorExit`` too) is a RuntimeWarning
    naming the group and the metric, never an error in the caller's thread.
    A KeyboardInterrupt goes on: it may be the user's Ctrl-C."""
    try:
        handler.emit(data)
    except (Exception, SystemExit, GeneratorExit) as err:
        _handler_failed(data.group_name, data.name, err)


def _handler_failed(group: str, name: str, err: BaseException) -> None:
    text = (
        f"metric handler for group {printable(group)!r} failed on "
        f"{printable(name)!r}: {err!r}"
    )
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=4)
    except Exception:  # warnings turned into errors (-W error): log instead
        logging.getLogger("jaxhistory").warning("%s", text)


_state = threading.local()
_global = _Registry()


def _registry() -> _Registry:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else _global


def _as_handler(handler: Any) -> MetricHandler:
    if isinstance(handler, MetricHandler):
        return handler
    if is_sink(handler):
        return SinkHandler(handler)
    raise TypeError(
        f"a metric handler must be a MetricHandler or a sink (write/flush/close), "
        f"got {type(handler).__name__}"
    )


def configure(handler: Any, group: str | None = None) -> None:
    """Sends metrics of ``group`` to ``handler``; ``group=None`` sets the default.

    A group's own handler wins over the default, which starts as
    :class:`NullMetricHandler`. ``handler`` may also be a sink (``write`` /
    ``flush`` / ``close``), wrapped in :class:`SinkHandler`.

    Examples:
        >>> from jaxhistory import publish
        >>> with publish.scoped():
        ...     publish.configure(publish.ConsoleMetricHandler())  # the default
        ...     publish.put_metric("epochs", 1)
        [...][jaxhistory]: epochs=1
    """
    if group is not None and (not isinstance(group, str) or not group):
        raise ValueError(f"group must be a non-empty str or None, got {group!r}")
    _registry().configure(_as_handler(handler), group)


def get_stream(group: str = DEFAULT_GROUP) -> MetricStream:
    """A :class:`MetricStream` publishing to ``group`` (its handler looked up at
    each ``add_value``, so configuring later still takes effect).

    Examples:
        >>> from jaxhistory import publish
        >>> with publish.scoped():
        ...     stream = publish.get_stream("io")
        ...     publish.configure(publish.ConsoleMetricHandler(), group="io")
        ...     stream.add_value("bytes", 4096)
        [...][io]: bytes=4096
    """
    if not isinstance(group, str) or not group:
        raise ValueError(f"group must be a non-empty str, got {group!r}")
    return MetricStream(group, _registry())


getStream = get_stream  # torchelastic's name


def put_metric(name: str, value: Any, metric_group: str = DEFAULT_GROUP) -> None:
    """Publishes ``value`` as ``name`` in ``metric_group``.

    Examples:
        >>> from jaxhistory import publish
        >>> publish.put_metric("ready", 1)  # the null handler: nowhere
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric name must be a non-empty str, got {name!r}")
    if not isinstance(metric_group, str) or not metric_group:
        raise ValueError(
            f"metric_group must be a non-empty str, got {metric_group!r:.80}"
        )
    get_stream(metric_group).add_value(name, value)


def _sink_handlers() -> list[SinkHandler]:
    """The registry's sink handlers, each once."""
    registry = _registry()
    with registry._lock:
        handlers = [registry.default, *registry.groups.values()]
    seen = {id(h): h for h in handlers if isinstance(h, SinkHandler)}
    return list(seen.values())


def flush(timeout: float | None = None) -> None:
    """Waits until every sink configured as a handler (:class:`SinkHandler`)
    has written and flushed what was published, at most ``timeout`` seconds
    (default 5) for each; a sink that does not finish gets a warning naming
    it."""
    for handler in _sink_handlers():
        handler.flush(timeout)


def close(timeout: float | None = None) -> None:
    """Flushes and closes every sink configured as a handler (waiting as
    :func:`flush` does), then resets the registry (:func:`reset`)."""
    for handler in _sink_handlers():
        handler.close(timeout)
    reset()


def reset() -> None:
    """Restores the registry in use to its start: null default, no groups."""
    registry = _registry()
    with registry._lock:
        registry.default = NullMetricHandler()
        registry.groups = {}


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """A fresh registry for the current thread inside the block (for tests)."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(_Registry())
    try:
        yield
    finally:
        stack.pop()


def _key(fn: Callable) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not hasattr(fn, "__name__"):  # an object with __call__: its class
        fn = type(fn)
    parts = getattr(fn, "__qualname__", fn.__name__).split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>":
        return ".".join(parts[-2:])  # Class.method
    module = getattr(fn, "__module__", None) or "__main__"
    return f"{module.rsplit('.', 1)[-1]}.{fn.__name__}"


def _publish_quietly(group: str, name: str, value: Any) -> None:
    try:
        put_metric(name, value, group)
    except Exception as err:  # a broken handler must not change the call's outcome
        _handler_failed(group, name, err)


@contextlib.contextmanager
def _outcome(group: str, key: str) -> Iterator[None]:
    """Publishes ``{key}.success`` or ``{key}.failure`` (1) and
    ``{key}.duration.ms`` for the block; its exception goes on."""
    start = time.perf_counter()
    outcome = "failure"
    try:
        yield
        outcome = "success"
    finally:
        elapsed = (time.perf_counter() - start) * 1e3
        _publish_quietly(group, f"{key}.{outcome}", 1)
        _publish_quietly(group, f"{key}.duration.ms", elapsed)


def prof(fn: Callable | None = None, *, group: str = DEFAULT_GROUP):
    """Publishes ``<key>.success`` or ``<key>.failure`` (1) and
    ``<key>.duration.ms`` for each call of the decorated function.

    ``<key>`` is the qualified name (``Class.method``) or ``leafmodule.func``
    (of the function a ``functools.partial`` calls, of the class of an object
    with ``__call__``).
    Use bare (``@prof``) or with a keyword (``@prof(group="agent")``). The
    duration is float milliseconds from a monotonic clock. A failing handler
    gives a RuntimeWarning; it never changes the function's result or exception.
    An ``async def`` is timed through its await (its exception a failure); a
    generator function is a TypeError.

    Examples:
        >>> from jaxhistory import publish
        >>> with publish.scoped():
        ...     publish.configure(publish.ConsoleMetricHandler(), group="agent")
        ...     @publish.prof(group="agent")
        ...     def step():
        ...         return 42
        ...     step()
        [...][agent]: ....step.success=1
        [...][agent]: ....step.duration.ms=...
        42
    """
    if fn is not None and not callable(fn):
        raise TypeError(
            f"prof takes the group as a keyword: @prof(group={fn!r}), not @prof({fn!r})"
        )
    if not isinstance(group, str) or not group:
        raise ValueError(f"group must be a non-empty str, got {group!r}")

    def decorate(f: Callable) -> Callable:
        key = _key(f)
        if inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
            raise TypeError(
                f"prof cannot time generator function {f.__qualname__!r}: calling "
                "it only makes the generator; time the function that consumes it"
            )
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def timed(*args, **kwargs):  # the call and its await
                with _outcome(group, key):
                    return await f(*args, **kwargs)

            return timed

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            with _outcome(group, key):
                return f(*args, **kwargs)

        return wrapper

    return decorate if fn is None else decorate(fn)
