"""Reading Chrome trace files: complete or cut off by a crash, plain or gzip."""

from __future__ import annotations

import gzip
import json
import os
import warnings
import zlib
from pathlib import Path

from jaxhistory._files import read_regular
from jaxhistory._names import printable

__all__ = ["load_trace", "read_trace"]


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The events of a trace file: a JSON array or ``{"traceEvents": [...]}``,
    plain or ``.gz``, complete or cut off anywhere (a missing ``]``, a trailing
    comma, half an event: the complete events before it are returned, with a
    warning naming the line where an event is cut off or damaged).

    Raises:
        ValueError: naming the file, for a file that is no trace (no event
            array, an object without ``traceEvents`` or with one that is not
            a list, or gzip data that is
            damaged rather than cut off).
    """
    return read_trace(Path(path))[0]


def read_trace(path: Path) -> tuple[list[dict], dict]:
    """(the events, the ``otherData`` object) of a trace file, read as
    :func:`load_trace` reads it."""
    raw = read_regular(path)  # (a pipe named *.json would block)
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error):  # cut off: what was written so far
            try:
                raw = zlib.decompressobj(wbits=31).decompress(raw)
            except zlib.error as err:
                raise ValueError(
                    f"{path} is not a Chrome trace: its gzip data is damaged ({err})"
                ) from None
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return [], {}  # cut off before the first byte of the array
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # (RecursionError: nested past the stack)
        data = None
    if isinstance(data, list):
        return [e for e in data if isinstance(e, dict)], {}
    if isinstance(data, dict):
        if "traceEvents" not in data:  # (any JSON object is not a trace)
            raise ValueError(
                f"{path} is not a Chrome trace (a JSON object without traceEvents)"
            )
        events = data["traceEvents"]
        if not isinstance(events, list):
            raise ValueError(
                f"{path} is not a Chrome trace: its traceEvents is a "
                f"{type(events).__name__}, not a list of events"
            )
        other = data.get("otherData")
        return [e for e in events if isinstance(e, dict)], (
            other if isinstance(other, dict) else {}
        )
    if data is not None:
        raise ValueError(
            f"{path} is not a Chrome trace (a JSON {type(data).__name__}, not an "
            "event array)"
        )
    start = text.find(
        "[", text.find('"traceEvents"') if text.lstrip().startswith("{") else 0
    )
    if start < 0:
        raise ValueError(f"{path} is not a Chrome trace (no event array)")
    decoder, pos, events = json.JSONDecoder(), start + 1, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            event, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # cut off or damaged in this event
            line = text.count("\n", 0, pos) + 1
            warnings.warn(
                f"{printable(path)}: the trace is cut off or damaged at line {line} "
                f"(character {pos + 1}); the {len(events)} complete event(s) before "
                "it are kept",
                RuntimeWarning,
                stacklevel=3,
            )
            break
        if isinstance(event, dict):
            events.append(event)
    return events, {}
