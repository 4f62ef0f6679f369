"""The JSONL line codec: one strict-JSON line per record, a column at a time.

A line is ``{"step":42,"timestamp":1732240000.123,"process_index":0,
"metrics":{...},"aggregated":{...}}`` (published metrics add ``"group"``):
``metrics`` holds what was recorded as given, ``aggregated`` the cross-device
statistics (``name/mean``, ``name/max``, ``name/min``, ``name/std``). NaN and
infinities are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (strict JSON has no bare tokens for them) and read back as floats.
Array metrics are nested lists. Floats are written exactly: the shortest text that
reads back as the same float64.

Every JSONL file jaxhistory writes goes through :func:`encode_lines`: records that
share their names are turned into text a column at a time (orjson formats a whole
NumPy column in one call) and into lines by one ``%``-format per few thousand
lines, which is what makes the log cheap enough to stream beside a fast loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

__all__ = [
    "NONFINITE_TEXT",
    "column_texts",
    "decode_line",
    "encode_lines",
    "float_rows",
    "jsonl_value",
    "read_columns",
    "stamp_texts",
]

# repr(x) of a non-finite float -> its text in the logs (strict JSON has no NaN)
NONFINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_NONFINITE = {k: b'"' + v.encode() + b'"' for k, v in NONFINITE_TEXT.items()}
_FROM_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_CHUNK = 4096  # lines formatted by one %-operation


def _nonfinite(x: float) -> bytes:
    return _NONFINITE[repr(float(x))]


def _plain(value: Any) -> np.ndarray:
    """``value`` as a NumPy array orjson can write: bool, int or float64."""
    arr = np.asarray(value)
    # float32 and narrower, and ml_dtypes floats (bfloat16 and friends)
    if arr.dtype.kind not in "biu" and arr.dtype != np.float64:
        arr = arr.astype(np.float64)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _nested(arr: np.ndarray) -> bytes:
    """An array with non-finite values, as nested lists with them as strings."""
    if arr.ndim == 0:
        return orjson.dumps(arr.item()) if np.isfinite(arr) else _nonfinite(arr)
    return b"[" + b",".join(_nested(a) for a in arr) + b"]"


def jsonl_value(value: Any) -> bytes:
    """The JSON text of one metric value (numbers, NumPy/JAX scalars and arrays).

    Example:
        >>> import numpy as np
        >>> from jaxhistory._codec import jsonl_value
        >>> jsonl_value(0.1), jsonl_value(np.array([1.5, np.nan])), jsonl_value(3)
        (b'0.1', b'[1.5,"NaN"]', b'3')
    """
    if type(value) is float:
        return orjson.dumps(value) if math.isfinite(value) else _nonfinite(value)
    if type(value) is int:
        return str(value).encode()
    arr = _plain(value)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        return _nested(arr)
    if arr.ndim == 0:
        return orjson.dumps(arr.item())
    return orjson.dumps(arr, option=_NUMPY)


def column_texts(values: Any) -> list[bytes]:
    """The JSON text of each record of a column (an array whose first axis is the
    records, or a sequence of values), a whole column per orjson call."""
    try:
        arr = _plain(values)
    except (ValueError, TypeError, OverflowError):  # ragged, or not numbers
        return [jsonl_value(v) for v in values]
    if arr.dtype.kind not in "biuf":  # objects: huge ints, mixed values
        return [jsonl_value(v) for v in values]
    if not len(arr):
        return []
    finite = None
    if arr.dtype.kind == "f":
        finite = np.isfinite(arr)
        if finite.all():
            finite = None
        elif arr.ndim > 1:
            return [_nested(a) for a in arr]
        else:
            arr = np.where(finite, arr, 0.0)
    if arr.ndim == 1:
        texts = orjson.dumps(arr, option=_NUMPY)[1:-1].split(b",")
        if finite is not None:
            for i in np.flatnonzero(~finite).tolist():
                texts[i] = _nonfinite(values[i])
        return texts
    return [orjson.dumps(a, option=_NUMPY) for a in arr]


def stamp_texts(timestamps: Sequence[float | None]) -> list[bytes]:
    """The text of each timestamp (``null`` where unknown), in one call."""
    times = np.array(
        [math.nan if t is None else t for t in timestamps], np.float64, ndmin=1
    )
    known = np.isfinite(times)
    if not len(times):
        return []
    texts = orjson.dumps(np.where(known, times, 0.0), option=_NUMPY)[1:-1].split(b",")
    if not known.all():
        for i in np.flatnonzero(~known).tolist():
            texts[i] = b"null"
    return texts


def _step_texts(steps: Sequence[int | None]) -> list[bytes]:
    if not len(steps):
        return []
    steps = steps.tolist() if isinstance(steps, np.ndarray) else list(steps)
    return orjson.dumps(steps)[1:-1].split(b",")


def _key(name: str) -> bytes:
    """A JSON key, ready for %-formatting templates."""
    return orjson.dumps(name).replace(b"%", b"%%") + b":%s"


def _template(
    process_index: int, group, metrics: bytes, aggregated: bytes = b""
) -> bytes:
    """The %-template of a line: step and timestamp, then ``metrics`` and
    ``aggregated`` (themselves templates, or ``%s`` for a fragment)."""
    head = b'{"step":%s,"timestamp":%s,"process_index":' + b"%d" % process_index
    if group is not None:
        head += b',"group":' + orjson.dumps(group).replace(b"%", b"%%")
    return head + b',"metrics":{' + metrics + b'},"aggregated":{' + aggregated + b"}}\n"


def _keys(names: Sequence[str]) -> bytes:
    return b",".join(_key(n) for n in names)


def encode_lines(
    steps: Sequence[int | None],
    timestamps: Sequence[float | None],
    process_index: int,
    names: Sequence[str],
    columns: Sequence[Any],
    agg_names: Sequence[str] = (),
    agg_columns: Sequence[Any] = (),
    group: str | None = None,
) -> bytes:
    """The lines of records that share their names: one column per name.

    Example:
        >>> from jaxhistory._codec import encode_lines
        >>> encode_lines([1, 2], [None, 0.5], 0, ["loss"], [[0.25, float("nan")]])
        b'{"step":1,"timestamp":null,"process_index":0,"metrics":{"loss":0.25},\
"aggregated":{}}\\n{"step":2,"timestamp":0.5,"process_index":0,"metrics":{"loss":\
"NaN"},"aggregated":{}}\\n'
    """
    k = len(steps)
    if not k:
        return b""
    template = _template(process_index, group, _keys(names), _keys(agg_names))
    if names and not agg_names and type(columns) is _FloatRows:
        # Rows of Python floats: all values to text in one orjson call (row
        # major), rows to text in one %-format, then lines in another.
        texts = _float_texts(columns.rows, len(names))
        if texts is not None:
            inner = _keys(names) + b"\0"
            frags = []
            for start in range(0, k, _CHUNK):
                n = min(_CHUNK, k - start)
                w = len(names)
                chunk = (inner * n) % tuple(texts[start * w : (start + n) * w])
                frags += chunk.split(b"\0")[:-1]
            head = _template(process_index, group, b"%s")
            fields = zip(
                _step_texts(steps), stamp_texts(timestamps), frags, strict=True
            )
            flat = itertools.chain.from_iterable(fields)
            out = []
            for start in range(0, k, _CHUNK):
                n = min(_CHUNK, k - start)
                out.append((head * n) % tuple(itertools.islice(flat, n * 3)))
            return b"".join(out)
        columns = list(zip(*columns.rows, strict=True))
    texts = [_step_texts(steps), stamp_texts(timestamps)]
    texts += [column_texts(c) for c in columns]
    texts += [column_texts(c) for c in agg_columns]
    width = len(texts)
    flat = itertools.chain.from_iterable(zip(*texts, strict=True))
    out = []
    for start in range(0, k, _CHUNK):
        n = min(_CHUNK, k - start)
        out.append((template * n) % tuple(itertools.islice(flat, n * width)))
    return b"".join(out)


class _FloatRows:
    """Rows of Python floats, one tuple per record (see :func:`float_rows`)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[tuple]):
        self.rows = rows


def float_rows(rows: list[tuple]) -> Any:
    """Marks ``rows`` (tuples of Python floats, one per record) as the
    ``columns`` of :func:`encode_lines`, which then converts them in one pass."""
    return _FloatRows(rows)


def _float_texts(rows: list[tuple], width: int) -> list[bytes] | None:
    """The text of every value of ``rows``, row major; None if one is not finite
    or the rows are not all floats of the same width."""
    try:
        arr = np.array(rows, np.float64)
    except (ValueError, TypeError):
        return None
    if arr.shape != (len(rows), width) or not np.isfinite(arr).all():
        return None
    return orjson.dumps(arr.reshape(-1), option=_NUMPY)[1:-1].split(b",")


def row_fragments(names: Sequence[str], columns: Sequence[Any], k: int) -> list[bytes]:
    """``'"a":1,"b":2'`` for each of ``k`` records (for merging records of several
    name sets into one line)."""
    if not names:
        return [b""] * k
    template = _keys(names) + b"\0"
    texts = [column_texts(c) for c in columns]
    width = len(texts)
    flat = itertools.chain.from_iterable(zip(*texts, strict=True))
    out: list[bytes] = []
    for start in range(0, k, _CHUNK):
        n = min(_CHUNK, k - start)
        chunk = (template * n) % tuple(itertools.islice(flat, n * width))
        out += chunk.split(b"\0")[:-1]  # JSON text never holds a raw NUL
    return out


def join_lines(
    steps: Sequence[int],
    timestamps: Sequence[float | None],
    process_index: int,
    metrics: Sequence[bytes],
    aggregated: Sequence[bytes],
) -> bytes:
    """Lines from per-record fragments made by :func:`row_fragments`."""
    if not len(steps):
        return b""
    template = b'{"step":%s,"timestamp":%s,"process_index":' + b"%d" % process_index
    template += b',"metrics":{%s},"aggregated":{%s}}\n'
    fields = zip(
        _step_texts(steps), stamp_texts(timestamps), metrics, aggregated, strict=True
    )
    flat = itertools.chain.from_iterable(fields)
    out = []
    for start in range(0, len(steps), _CHUNK):
        n = min(_CHUNK, len(steps) - start)
        out.append((template * n) % tuple(itertools.islice(flat, n * 4)))
    return b"".join(out)


def _decode(value: Any) -> Any:
    if isinstance(value, str):
        if value in _FROM_TEXT:
            return _FROM_TEXT[value]
        raise ValueError(f"unexpected string {value!r}")
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if value is None:
        return math.nan
    return value


def decode_line(line: bytes | str) -> tuple[int, dict[str, Any]]:
    """The step and the values (metrics and aggregated) of one line.

    Raises ValueError for a line that is not a complete record with an integer
    step (a line cut off by a killed run, for example).
    """
    try:
        record = orjson.loads(line)
        step = record["step"]
        items = {**record.get("metrics", {}), **record.get("aggregated", {})}
        if type(step) is not int:
            raise ValueError("no integer step")
        return step, {k: _decode(v) for k, v in items.items()}
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a record: {err}") from None


def read_columns(
    path: Path,
) -> tuple[dict[str, tuple[list[int], list[Any]]], list[int]]:
    """Every metric's steps and values in a JSONL log, in line order, and the
    numbers of the lines that are not complete records."""
    columns: dict[str, tuple[list[int], list[Any]]] = {}
    bad = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                step, items = decode_line(line)
            except ValueError:
                bad.append(number)
                continue
            for name, value in items.items():
                steps, values = columns.setdefault(name, ([], []))
                steps.append(step)
                values.append(value)
    return columns, bad
