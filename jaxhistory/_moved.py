"""Names that moved: the old spelling keeps working for one release, with a
``DeprecationWarning`` naming where the name lives now."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["moved"]


def moved(module: str, name: str, moves: dict[str, tuple[str, str]]) -> Any:
    """``module.name`` looked up where it moved to (``moves``: old name ->
    (new module, new name)), with a DeprecationWarning; AttributeError for a
    name that never was there. For a module's ``__getattr__``."""
    if name not in moves:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, new = moves[name]
    warnings.warn(
        f"{module}.{name} is deprecated: use {home}.{new} (the same object); "
        f"it leaves {module} in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(home), new)
