"""The sink protocol and the helpers every sink uses to read a record."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from jaxhistory._moved import moved
from jaxhistory._record import Record
from jaxhistory._writer import warn_quietly

__all__ = [
    "FileSink",
    "Sink",
    "is_sink",
    "moved_name",
    "scalars",
    "values",
    "writes_here",
    "written_after_close",
]


class FileSink:
    """flush and close of a sink that appends to one open file under ``_lock``:
    an error marks it broken (``error``; later writes are skipped) instead of
    reaching the thread that feeds it."""

    _lock: Any
    _file: Any
    _broken: bool
    error: BaseException | None

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.flush()
                except Exception as err:
                    self._broken, self.error = True, err

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.close()
                except Exception as err:
                    self.error = err

    def _after_close(self) -> None:
        """Warns, once, that records given after :meth:`close` are dropped."""
        written_after_close(self, getattr(self, "path", ""))


def written_after_close(sink: Any, where: Any = "") -> None:
    """Warns, once per sink, that ``sink`` was written after its close (two
    histories sharing it, the first closed it): those records are dropped."""
    if not getattr(sink, "_told_closed", False):
        sink._told_closed = True
        at = f" {where}" if where else ""
        warn_quietly(
            f"{type(sink).__name__}{at} was written after close(); those records "
            "are dropped from it (the history keeps them)",
            stacklevel=4,
        )


@runtime_checkable
class Sink(Protocol):
    """What a sink implements."""

    def write(self, record: Record) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def is_sink(obj: Any) -> bool:
    """Whether ``obj`` has callable ``write``, ``flush`` and ``close``."""
    return all(callable(getattr(obj, m, None)) for m in ("write", "flush", "close"))


def writes_here(sink: Any) -> bool:
    """Whether ``sink`` writes from this process: process 0, or any process for a
    sink with ``all_processes = True``."""
    if getattr(sink, "all_processes", False):
        return True
    return jax.process_index() == 0


def values(record: Record) -> Iterator[tuple[str, Any, np.ndarray | None]]:
    """``(name, number, array)`` for each value of the record (metrics, then
    aggregated): ``number`` is a Python int/float/bool for a scalar (else None),
    ``array`` a bool/int/float NumPy array for an array metric (else None).
    Group records prefix names with ``{group}/``. The one place sinks turn
    values into numbers."""
    prefix = f"{record.group}/" if record.group else ""
    for name, value in (*record.metrics.items(), *record.aggregated.items()):
        if type(value) is float or type(value) is int or type(value) is bool:
            yield prefix + name, value, None  # History hands scalars over as these
            continue
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":  # bfloat16 and other ml_dtypes floats
            arr = arr.astype(np.float64)
        if arr.ndim == 0:
            yield prefix + name, arr.item(), None
        else:
            yield prefix + name, None, arr


def scalars(record: Record) -> dict[str, float | int]:
    """The record's scalar values (metrics and aggregated) by name; arrays left
    out. Group records prefix names with ``{group}/``."""
    return {name: number for name, number, _ in values(record) if number is not None}


def moved_name(name: str) -> Any:
    """``jaxhistory.sinks.is_sink`` and ``writes_here``, internal helpers once
    exported there: they keep working for one release, with a warning."""
    home = "jaxhistory.sinks._base"
    moves = {"is_sink": (home, "is_sink"), "writes_here": (home, "writes_here")}
    return moved("jaxhistory.sinks", name, moves)
