"""StopWatch: time a block or a function, on the host and on the devices."""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxhistory import _trace_state
from jaxhistory._dtypes import as_step
from jaxhistory._names import printable

__all__ = ["StopWatch"]

logger = logging.getLogger("jaxhistory")
_UNSAFE = re.compile(r"\s+")


class StopWatch:
    """Times a block (``with``) or every call of a function (decorator).

    On exit it logs ``"<msg> took 1.234 seconds"`` (INFO, logger ``jaxhistory``;
    control characters in ``msg`` as ``\\xNN``),
    records the seconds into ``history`` as ``timing/<tag>`` (``tag`` is ``wbtag``
    without a leading ``timing/``, else ``msg`` with spaces as ``_``), opens a
    ``jax.profiler.TraceAnnotation`` for the span (so it shows in XProf and
    TensorBoard profiles) and, while a :class:`~jaxhistory.trace.JSONTraceHandler`
    is active, writes it as a Chrome trace ``X`` event.

    JAX dispatches asynchronously: to time the device work and not just its
    dispatch, pass the arrays to wait for as ``block=`` or hand them to
    :meth:`wait` inside the block; as a decorator, ``block=True`` waits for the
    function's result. The time is taken after they are ready.

    The timing is recorded with :meth:`History.attach`: on this process alone
    (never reduced across processes, so only some processes may time a block),
    at the step of the history's next update (a timing taken twice before it
    keeps the later value), or at ``step`` if given; it never moves the
    history's step counter.

    :attr:`data` holds what it timed so far, with the keys ezpz's
    ``StopWatch.data`` uses (``{wbtag}/dt``, ...), with or without a history.

    One instance may be nested, reused recursively or shared between threads,
    and a block may end on another thread than the one it began on (a
    generator suspended in it closed, resumed or collected on another thread;
    a coroutine resumed there; an ``ExitStack`` closed there): the span ends
    where it began, taken off the opening thread's open spans (the exiting
    thread's own stay open), traced on the opening thread's track, from its
    start to the exit. The span an exit ends is the one entered from the
    exiting frame (a generator's or coroutine's wherever it runs; also when
    blocks end out of order on one thread), else the exiting thread's
    innermost one of this stop watch, else the latest one it opened on another
    thread. A generator closed inside the block ends it with ``GeneratorExit``
    (a block that raised). The profiler annotation ends on the exiting thread.

    Examples:
        >>> import jax.numpy as jnp, jaxhistory as jh
        >>> h = jh.History(distributed_history=False)
        >>> with jh.StopWatch("matmul", history=h) as sw:
        ...     out = sw.wait(jnp.ones((256, 256)) @ jnp.ones((256, 256)))
        >>> h.update({"loss": 0.5}, step=7)
        'step=7 loss=0.500000'
        >>> h.state.steps("timing/matmul").tolist(), sw.seconds > 0
        ([7], True)
    """

    def __init__(
        self,
        msg: str,
        wbtag: str | None = None,
        history: Any = None,
        block: Any = None,
        step: int | None = None,
    ):
        if not isinstance(msg, str) or not msg.strip():
            raise ValueError(f"msg must be a non-empty str, got {msg!r}")
        if wbtag is not None and (
            not isinstance(wbtag, str)
            or not wbtag.strip()
            or not wbtag.removeprefix("timing/").strip()
        ):
            raise ValueError(
                f"wbtag must be a non-empty str or None (a name after 'timing/'), "
                f"got {wbtag!r}"
            )
        if history is not None and not hasattr(history, "update"):
            raise TypeError(f"history must be a History, got {type(history).__name__}")
        if step is not None:  # refused now, not after the timed work has run
            try:
                step = as_step("step", step)
            except ValueError:
                raise ValueError(
                    f"step must be a whole number within int64 or None, got "
                    f"{step!r:.40}"
                ) from None
        self.msg = msg
        tag = wbtag if wbtag is not None else _UNSAFE.sub("_", msg.strip())
        self.tag = tag.removeprefix("timing/")
        self.history = history
        self.block = block
        self.step = step
        self.seconds: float | None = None  # of the latest finished span
        self._local = threading.local()
        # what .data reports: ezpz's keys are the wbtag as given
        self._key = wbtag if wbtag is not None else self.name
        # re-entrant: the garbage collector may end a span of this StopWatch
        # (a generator suspended in one) on a thread that holds it
        self._lock = threading.RLock()
        self._spans = 0  # spans finished (not those that raised)
        self._total = 0.0  # their seconds
        self._dt = 0.0  # the latest one's seconds

    @property
    def data(self) -> dict[str, float | int]:
        """What this stop watch timed so far, as ezpz's ``StopWatch.data``
        (a new dict at each read; empty before the first span ends):
        ``{key}/dt``, the seconds of the latest span timed, ``{key}/count`` the spans
        timed, ``{key}/total`` their seconds together, and ``{key}/iter``,
        the ``step`` given, if one was. ``key`` is ``wbtag`` as given (ezpz's
        spelling: ``wbtag="timing/fwd"`` gives ``timing/fwd/dt``), else the
        metric name (``timing/<tag>``). A span that raised is not counted.
        Consistent under threads: the four values are of the same spans.

        Examples:
            >>> import jaxhistory as jh
            >>> sw = jh.StopWatch("forward", wbtag="timing/fwd", step=3)
            >>> for _ in range(2):
            ...     with sw:
            ...         pass
            >>> sorted(sw.data)
            ['timing/fwd/count', 'timing/fwd/dt', 'timing/fwd/iter', 'timing/fwd/total']
            >>> sw.data["timing/fwd/count"], sw.data["timing/fwd/iter"]
            (2, 3)
        """
        with self._lock:
            if not self._spans:
                return {}
            key = self._key
            out: dict[str, float | int] = {
                f"{key}/dt": self._dt,
                f"{key}/count": self._spans,
                f"{key}/total": self._total,
            }
        if self.step is not None:
            out[f"{key}/iter"] = self.step
        return out

    @property
    def name(self) -> str:
        """The metric name the timing is recorded under."""
        return f"timing/{self.tag}"

    def wait(self, *arrays: Any) -> Any:
        """Makes the stop watch wait for ``arrays`` (any pytrees) before it stops;
        returns the (single) argument, so ``out = sw.wait(f(x))`` works."""
        span = _trace_state.span_of(self, sys._getframe(1), here_only=True)
        if span is None:
            raise RuntimeError(f"StopWatch {self.msg!r} is not running")
        span[5][1].extend(arrays)
        return arrays[0] if len(arrays) == 1 else arrays

    def __enter__(self) -> StopWatch:
        # Per entry: one instance may be nested, reused recursively or shared
        # between threads. The span keeps the frame that entered it, which is
        # the frame that exits it (of a generator or coroutine too, wherever
        # it is closed or resumed).
        annotation = jax.profiler.TraceAnnotation(self.msg)
        annotation.__enter__()
        start_ns = time.perf_counter_ns()
        frame = sys._getframe(1)
        _trace_state.span_opened(self.msg, start_ns, self, frame, (annotation, []))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        span = _trace_state.span_of(self, sys._getframe(1))
        if span is None:
            raise RuntimeError(f"StopWatch {self.msg!r} is not running")
        _trace_state.span_closed(span)
        start_ns, entry, (annotation, pending) = span[1], span[2], span[5]
        try:
            block = None if self.block is True else self.block
            wait = [a for a in (block, *pending) if a is not None]
            if wait and exc_type is None:
                jax.block_until_ready(wait)
        finally:
            end_ns = time.perf_counter_ns()
            annotation.__exit__(exc_type, exc, tb)
        # on the track of the thread it began on; not again where a trace
        # wrote it at its close (that thread had ended inside it)
        self._finished(start_ns, end_ns, exc_type, entry[0], traced=entry[3])

    def _finished(
        self,
        start_ns: int,
        end_ns: int,
        exc_type: Any,
        thread: Any = None,
        traced: bool = False,
    ) -> None:
        """Counts, traces, logs and records one span (``exc_type``: it raised;
        ``thread``: the one it began on, whose track it goes on; ``traced``:
        written by a trace already)."""
        seconds = (end_ns - start_ns) / 1e9
        self._local.last = seconds  # this call's, for a decorated function
        with self._lock:  # with the count: .data reads them together
            self.seconds = seconds
            if exc_type is None:
                self._spans += 1
                self._total += seconds
                self._dt = seconds
        handler = None if traced else _trace_state.active()
        if handler is not None:
            # The span's duration is its time: no per-span arguments, so
            # profilers (speedscope) group every span of one name together.
            args = {} if exc_type is None else {"error": exc_type.__name__}
            handler.complete(
                self.msg, start_ns, end_ns, cat="StopWatch", args=args, thread=thread
            )
        if exc_type is not None:
            return  # nothing recorded or logged for a block that raised
        logger.info("%s took %.3f seconds", printable(self.msg), self.seconds)
        if self.history is not None:
            # This process alone, never reduced across processes (only some may
            # time a block): at the next update's step, or at ``step``.
            self.history.attach({self.name: seconds}, step=self.step)

    def __call__(self, fn: Callable) -> Callable:
        """As a decorator: times each call of ``fn`` (of an ``async def``, the
        call and its await, each call on its own even where tasks overlap on
        one thread). The wrapper's ``last`` is the seconds of the latest call
        to finish. A generator function is a TypeError: its call
        only makes the generator."""
        if not callable(fn):
            raise TypeError(f"StopWatch decorates a function, got {fn!r}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"StopWatch cannot time generator function {fn.__qualname__!r}: "
                "calling it only makes the generator; time the loop that "
                "consumes it (with stop_watch: for x in gen(): ...)"
            )
        if inspect.iscoroutinefunction(fn):
            return self._timed_async(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:  # per call and per thread: safe to reuse
                out = fn(*args, **kwargs)
                if self.block is True:
                    self.wait(out)
            wrapper.last = self._local.last
            return out

        wrapper.last = None  # type: ignore[attr-defined]  # a function attribute
        return wrapper

    def _timed_async(self, fn: Callable) -> Callable:
        """The decorator's wrapper of a coroutine function: the span of each
        call is kept by the call itself (tasks interleave on one thread, so
        the per-thread stack of :meth:`__enter__` would mix their spans)."""

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            start_ns, exc_type = time.perf_counter_ns(), None
            span = _trace_state.span_opened(self.msg, start_ns)
            try:
                out = await fn(*args, **kwargs)
                if self.block is True:
                    jax.block_until_ready(out)
                return out
            except BaseException as err:
                exc_type = type(err)
                raise
            finally:
                _trace_state.span_closed(span)
                end_ns, (thread, _, _, traced) = time.perf_counter_ns(), span[2]
                self._finished(start_ns, end_ns, exc_type, thread, traced=traced)
                wrapper.last = self._local.last

        wrapper.last = None  # type: ignore[attr-defined]  # a function attribute
        return wrapper
