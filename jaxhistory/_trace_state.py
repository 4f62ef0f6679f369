"""The Chrome trace handler in use, if any (kept apart so hot paths import little)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["activate", "active", "deactivate", "drain", "register_stream"]

_lock = threading.Lock()
_stack: list[Any] = []
_streams: weakref.WeakSet = weakref.WeakSet()  # History background writers


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
