"""The compiled forms of the host path's busiest steps (``_speedups.c``), or
None where they are missing or turned off.

A wheel, or an install from source on a machine with a C compiler, builds
them; without them every step runs as Python, with the same results and about
twice the cost per update. ``JAXHISTORY_PURE_PYTHON=1`` in the environment
before jaxhistory is imported turns them off (to compare the two, or to rule
them out).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["speedups"]


try:
    import jaxhistory._speedups as _speedups  # type: ignore[import-not-found]
except ImportError:  # not built: no C compiler at install time
    _speedups = None

_off = os.environ.get("JAXHISTORY_PURE_PYTHON", "").strip() not in ("", "0")
# (Any: its functions are typed in _speedups.c's docstrings, not for mypy)
speedups: Any = None if _off else _speedups
