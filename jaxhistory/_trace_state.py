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
    "span_of",
    "span_opened",
]

# Reentrant: the GC may close a generator suspended in a span (ending the
# span here) on a thread that holds the lock, at any allocation under it.
_lock = threading.RLock()
_stack: list[Any] = []
_streams: weakref.WeakSet = weakref.WeakSet()  # History background writers
# thread id -> the thread's entry: [the thread, its open spans, its id, whether
# a trace wrote its spans as open at its close (an ended thread's)]. A span
# is (name, start in perf_counter_ns, its entry, its owner, the frame that
# opened it, the owner's data): it knows its thread's stack, so any thread can
# end it there. The entry goes when its last span closes (an entry a thread
# emptied of another thread's spans goes at the owner's next close, when it
# ended, or at the next thread's first span). The thread is held while it has a
# span open, so one that ended inside a span is still written, under its name,
# at a trace's close. Only the entry's own thread appends to its stack; the
# others remove from it under _lock.
_spans: dict[int, list] = {}
# entries of threads that ended inside spans, whose id Python has handed to a
# new thread since
_ended: list[list] = []
# entries of ended threads whose spans a trace has written (forget_ended):
# left out of open_spans, kept so that a span of theirs can still be ended
_written: list[list] = []


def span_opened(
    name: str, start_ns: int, owner: Any = None, frame: Any = None, data: Any = None
) -> tuple:
    """Notes that this thread entered the span ``name`` at ``start_ns``
    (opened by ``owner``, a StopWatch, called from ``frame``; ``data`` is kept
    for it); returns the span, for :func:`span_closed` and :func:`span_of`."""
    ident = threading.get_ident()
    entry = _spans.get(ident)
    thread = threading.current_thread()
    if entry is None or entry[0] is not thread:
        with _lock:  # (with forget_ended and other threads' closes)
            entry = _spans.get(ident)
            if entry is not None and entry[1]:  # an ended thread's, whose id
                _ended.append(entry)  # this one got
            for other in list(_spans.values()):  # (a copy: owners drop theirs)
                if not other[1] and not other[0].is_alive():
                    _spans.pop(other[2], None)  # emptied by another thread
            entry = _spans[ident] = [thread, [], ident, False]
    span = (name, start_ns, entry, owner, frame, data)
    entry[1].append(span)
    return span


def span_closed(span: tuple) -> None:
    """Notes that ``span`` ended, on whichever thread (it is taken off the
    stack of the thread that opened it). ``span[2][3]``: a trace has written
    it already (its thread ended inside it; :func:`forget_ended`)."""
    entry: list = span[2]
    spans = entry[1]
    ident = threading.get_ident()
    if ident == entry[2] and spans and spans[-1] is span:
        # Its own thread's innermost span (or an ended thread's, whose id this
        # one got): no other thread appends to this stack meanwhile.
        spans.pop()
        if spans:
            return
        if _spans.get(ident) is entry:  # the thread is not held past its spans
            _spans.pop(ident, None)
            return
    with _lock:  # (an ended thread's entry that emptied is dropped below)
        for i in range(len(spans) - 1, -1, -1):
            if spans[i] is span:
                del spans[i]
                break
        if spans or (ident != entry[2] and entry[0].is_alive()):
            return  # a live thread's entry is its own to drop
        if _spans.get(entry[2]) is entry:
            del _spans[entry[2]]
        else:
            _ended[:] = [e for e in _ended if e is not entry]
            _written[:] = [e for e in _written if e is not entry]


def span_of(owner: Any, frame: Any, here_only: bool = False) -> tuple | None:
    """The open span of ``owner`` that an exit called from ``frame`` ends, or
    None: the one opened from that frame (a generator, a coroutine or a block
    exited on another thread, or out of order), innermost first, on this
    thread or any other; else this thread's innermost span of ``owner``; else
    (unless ``here_only``) the latest one opened on another thread (an
    ExitStack closed there)."""
    entry = _spans.get(threading.get_ident())
    if entry is not None:
        try:
            top = entry[1][-1]
            if top[3] is owner and top[4] is frame:
                return top
        except IndexError:  # emptied by another thread
            pass
    with _lock:
        entries = list(_spans.values()) + _ended + _written
    thread = threading.current_thread()
    here = [e for e in entries if e[0] is thread]
    others = [e for e in entries if e[0] is not thread]
    for group in (here, others):
        for e in group:
            for span in reversed(list(e[1])):
                if span[3] is owner and span[4] is frame:
                    return span
    for e in here:
        for span in reversed(list(e[1])):
            if span[3] is owner:
                return span
    if here_only:
        return None
    theirs = [s for e in others for s in list(e[1]) if s[3] is owner]
    return max(theirs, key=lambda s: s[1], default=None)


def innermost_span(thread_id: int) -> str | None:
    """The innermost StopWatch span open on thread ``thread_id``, or None
    (also where that thread ended inside it)."""
    entry = _spans.get(thread_id)
    try:
        return entry[1][-1][0] if entry and entry[0].is_alive() else None
    except IndexError:  # emptied meanwhile
        return None


def open_spans() -> list[tuple[Any, str, int]]:
    """``(thread, name, start ns)`` of every StopWatch span open now, each
    thread's outermost first, those of threads that ended inside them too."""
    with _lock:
        entries = _ended + list(_spans.values())
    return [(e[0], span[0], span[1]) for e in entries for span in list(e[1])]


def forget_ended() -> None:
    """Drops the spans of threads that ended inside them from those
    :func:`open_spans` lists (once the last trace handler has written them:
    no later one shows them again); they can still be ended (a generator
    closed later)."""
    with _lock:
        for ended in _ended:
            ended[3] = True
        _written.extend(_ended)
        _ended.clear()
        for ident in list(_spans):
            entry = _spans.get(ident)
            if entry is not None and not entry[0].is_alive():
                del _spans[ident]
                if entry[1]:
                    entry[3] = True
                    _written.append(entry)


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
