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
    "innermost_span",
    "open_spans",
    "register_stream",
    "span_closed",
    "span_opened",
]

_lock = threading.Lock()
_stack: list[Any] = []
_streams: weakref.WeakSet = weakref.WeakSet()  # History background writers
# thread id -> its open StopWatch spans, (name, start in perf_counter_ns)
_spans: dict[int, list[tuple[str, int]]] = {}


def span_opened(name: str, start_ns: int) -> tuple[str, int]:
    """Notes that this thread entered the StopWatch span ``name`` at
    ``start_ns``; returns the span, for :func:`span_closed`."""
    span = (name, start_ns)
    _spans.setdefault(threading.get_ident(), []).append(span)
    return span


def span_closed(span: tuple[str, int]) -> None:
    """Notes that this thread left ``span`` (its innermost one, but for async
    calls interleaved on the thread)."""
    spans = _spans.get(threading.get_ident())
    if spans:
        for i in range(len(spans) - 1, -1, -1):
            if spans[i] is span:
                del spans[i]
                return


def innermost_span(thread_id: int) -> str | None:
    """The innermost StopWatch span open on thread ``thread_id``, or None."""
    spans = _spans.get(thread_id)
    try:
        return spans[-1][0] if spans else None
    except IndexError:  # emptied by its thread meanwhile
        return None


def open_spans() -> list[tuple[int, str, int]]:
    """``(thread id, name, start ns)`` of every StopWatch span open now, each
    thread's outermost first."""
    return [
        (ident, name, start)
        for ident, spans in list(_spans.items())
        for name, start in list(spans)
    ]


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
