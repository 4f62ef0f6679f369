"""Sinks that print records, or drop them."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

from jaxhistory._names import printable
from jaxhistory._record import Record
from jaxhistory._summary import fixed
from jaxhistory.sinks._base import values

__all__ = ["ConsoleSink", "NullSink"]


def _format(value: Any, precision: int) -> str:
    if isinstance(value, float):
        return fixed(value, precision) if math.isfinite(value) else str(value)
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
    metrics start with ``[group]``. Control characters in names are shown as
    ``\\xNN``, never sent to the terminal.
    """

    all_processes = False

    def __init__(self, stream=None, precision: int = 6):
        if type(precision) is not int or precision < 0:
            raise ValueError(f"precision must be a non-negative int, got {precision!r}")
        self.stream = stream
        self.precision = precision

    def write(self, record: Record) -> None:
        parts = [] if record.group is None else [f"[{printable(record.group)}]"]
        if record.step is not None:
            parts.append(f"step={record.step}")
        # The group is shown once, as [group], not as a prefix of every name.
        for name, number, arr in values(dataclasses.replace(record, group=None)):
            name = printable(name)  # a terminal escape in a name stays text
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
