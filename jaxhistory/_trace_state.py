"""The Chrome trace handler in use, if any (kept apart so hot paths import little)."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["activate", "active", "deactivate"]

_lock = threading.Lock()
_stack: list[Any] = []


def active() -> Any:
    """The most recently started trace handler that is still open, or None."""
    return _stack[-1] if _stack else None


def activate(handler: Any) -> None:
    with _lock:
        if handler in _stack:
            raise RuntimeError("this trace handler is already active")
        _stack.append(handler)


def deactivate(handler: Any) -> None:
    with _lock:
        if handler in _stack:
            _stack.remove(handler)
