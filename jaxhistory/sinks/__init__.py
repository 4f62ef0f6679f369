"""Sinks: where records go besides the history's own files.

A sink has three methods, ``write(record)``, ``flush()`` and ``close()`` (the
:class:`Sink` protocol). :class:`~jaxhistory.History` hands every update to its
sinks as a :class:`Record` whose values are already on the host (from a
background thread: the training loop never waits for them), and
:mod:`jaxhistory.publish` can send published metrics to one. Sinks write from
process 0 only unless they have ``all_processes = True``.

Built in: :class:`ConsoleSink`, :class:`NullSink`, :class:`JsonlSink`,
:class:`TensorBoardSink` (``pip install 'jaxhistory[tensorboard]'``, no
TensorFlow) and :class:`WandbSink` (``pip install 'jaxhistory[wandb]'``); the
last two import their package only when created.

Example:
    >>> import io
    >>> from jaxhistory.sinks import ConsoleSink, Record
    >>> sink = ConsoleSink(stream=io.StringIO())
    >>> sink.write(Record(step=3, timestamp=0.0, metrics={"loss": 0.25}))
    >>> sink.stream.getvalue()
    'step=3 loss=0.250000\\n'
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "NullSink",
    "Record",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "is_sink",
    "scalars",
    "values",
    "writes_here",
]


@dataclasses.dataclass(frozen=True)
class Record:
    """One update, on the host.

    Attributes:
        step: the step (None for published metrics, which have none).
        timestamp: wall-clock seconds (``time.time()``) of the update.
        metrics: name -> Python number or NumPy array, as recorded.
        aggregated: name -> float: cross-device statistics (``loss/mean``, ...).
        process_index: the process that recorded it.
        group: the metric group of a published metric, else None.
    """

    step: int | None
    timestamp: float
    metrics: Mapping[str, Any]
    aggregated: Mapping[str, float] = dataclasses.field(default_factory=dict)
    process_index: int = 0
    group: str | None = None


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
    import jax

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


def _format(value: Any, precision: int) -> str:
    if isinstance(value, float):
        return f"{value:.{precision}f}" if math.isfinite(value) else str(value)
    return str(value)


class NullSink:
    """Drops every record."""

    all_processes = False

    def write(self, record: Record) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class ConsoleSink:
    """Prints one line per record: ``step=42 loss=0.123457 loss/mean=...``.

    Scalars only (an array metric shows as ``name=[n values]``); published
    metrics start with ``[group]``.
    """

    all_processes = False

    def __init__(self, stream=None, precision: int = 6):
        if type(precision) is not int or precision < 0:
            raise ValueError(f"precision must be a non-negative int, got {precision!r}")
        self.stream = stream
        self.precision = precision

    def write(self, record: Record) -> None:
        parts = [] if record.group is None else [f"[{record.group}]"]
        if record.step is not None:
            parts.append(f"step={record.step}")
        # The group is shown once, as [group], not as a prefix of every name.
        for name, number, arr in values(dataclasses.replace(record, group=None)):
            if arr is not None:
                parts.append(f"{name}=[{arr.size} values]")
            else:
                parts.append(f"{name}={_format(number, self.precision)}")
        print(" ".join(parts), file=self.stream or sys.stdout)

    def flush(self) -> None:
        stream = self.stream or sys.stdout
        stream.flush()

    def close(self) -> None:
        self.flush()


class JsonlSink:
    """Appends one JSONL line per record, in the format of History's log
    (``step``, ``timestamp``, ``process_index``, ``metrics``, ``aggregated``;
    ``group`` too for published metrics; NaN and infinities as strings)."""

    all_processes = False

    def __init__(self, path: str | os.PathLike, overwrite: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb" if overwrite else "ab")  # noqa: SIM115
        if not overwrite:  # a killed run's half line is ended, not joined
            from jaxhistory.export._jsonl import _end_partial_line

            _end_partial_line(self._file, self.path)
        self._keys: dict[str, bytes] = {}

    def write(self, record: Record) -> None:
        from jaxhistory.export._jsonl import record_line

        self._file.write(record_line(record, self._keys))

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


from jaxhistory.sinks._tensorboard import TensorBoardSink  # noqa: E402
from jaxhistory.sinks._wandb import WandbSink  # noqa: E402
