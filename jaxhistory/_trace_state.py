"""The Chrome trace handler in use, if any (kept apart so hot paths import little)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = [
    "activate",
    "active",
    "deactivate",
    "drain",
    "forget_ended",
    "innermost_span",
    "open_spans",
    "register_stream",
    "span_closed",
    "span_opened",
]

_lock = threading.Lock()
_stack: list[Any] = []
_streams: weakref.WeakSet = weakref.WeakSet()  # History background writers
# thread id -> (the thread, its open StopWatch spans: (name, start in
# perf_counter_ns)); the entry goes when its last span closes. The thread is
# held while it has a span open, so one that ended inside a span is still
# written, under its name, at a trace's close.
_spans: dict[int, tuple[Any, list[tuple[str, int]]]] = {}
# (thread, name, start ns) of spans left open by threads that ended, whose id
# Python has handed to a new thread since
_ended: list[tuple[Any, str, int]] = []


def span_opened(name: str, start_ns: int) -> tuple[str, int]:
    """Notes that this thread entered the StopWatch span ``name`` at
    ``start_ns``; returns the span, for :func:`span_closed`."""
    span = (name, start_ns)
    ident = threading.get_ident()
    entry = _spans.get(ident)
    thread = threading.current_thread()
    if entry is None or entry[0] is not thread:
        with _lock:  # (with forget_ended)
            entry = _spans.get(ident)
            if entry is not None:  # an ended thread's, whose id this one got
                _ended.extend((entry[0], n, s) for n, s in entry[1])
            entry = _spans[ident] = (thread, [])
    entry[1].append(span)
    return span


def span_closed(span: tuple[str, int]) -> None:
    """Notes that this thread left ``span`` (its innermost one, but for async
    calls interleaved on the thread)."""
    ident = threading.get_ident()
    entry = _spans.get(ident)
    if entry:
        spans = entry[1]
        for i in range(len(spans) - 1, -1, -1):
            if spans[i] is span:
                del spans[i]
                if not spans:  # the thread is not held past its spans
                    _spans.pop(ident, None)
                return


def innermost_span(thread_id: int) -> str | None:
    """The innermost StopWatch span open on thread ``thread_id``, or None
    (also where that thread ended inside it)."""
    entry = _spans.get(thread_id)
    try:
        return entry[1][-1][0] if entry and entry[0].is_alive() else None
    except IndexError:  # emptied by its thread meanwhile
        return None


def open_spans() -> list[tuple[Any, str, int]]:
    """``(thread, name, start ns)`` of every StopWatch span open now, each
    thread's outermost first, those of threads that ended inside them too."""
    with _lock:
        out = list(_ended)
    out += [
        (thread, name, start)
        for thread, spans in list(_spans.values())
        for name, start in list(spans)
    ]
    return out


def forget_ended() -> None:
    """Drops the spans of threads that ended inside them (once the last trace
    handler has written them: no later one shows them again)."""
    with _lock:
        _ended.clear()
        for ident in list(_spans):
            entry = _spans.get(ident)
            if entry is not None and not entry[0].is_alive():
                del _spans[ident]


def register_stream(stream: Any) -> None:
    """Remembers a History background writer, so a closing trace handler can
    have its queued records written first."""
    with _lock:
        _streams.add(stream)


def drain() -> None:
    """Writes the records every live History writer has queued (their counters
    reach an active trace handler)."""
    with _lock:
        streams = list(_streams)
    for stream in streams:
        stream.flush()


def active() -> Any:
    """The most recently started trace handler that is still open, or None."""
    return _stack[-1] if _stack else None


def activate(handler: Any) -> None:
    """Makes ``handler`` the active one (until :func:`deactivate`); a
    RuntimeError if it already is."""
    with _lock:
        if handler in _stack:
            raise RuntimeError("this trace handler is already active")
        _stack.append(handler)


def deactivate(handler: Any) -> None:
    """Ends ``handler``'s turn; the one started before it is active again."""
    with _lock:
        if handler in _stack:
            _stack.remove(handler)
