"""The JSONL line codec: one strict-JSON line per record, a column at a time.

A line is ``{"step":42,"timestamp":1732240000.123,"process_index":0,
"run_id":"exp-20261123-153700","metrics":{...},"aggregated":{...}}`` (``run_id``
where the writer knows it; published metrics add ``"group"``):
``metrics`` holds what was recorded as given, ``aggregated`` the cross-device
statistics (``name/mean``, ``name/max``, ``name/min``, ``name/std``). NaN and
infinities are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (strict JSON has no bare tokens for them) and read back as floats.
Array metrics are nested lists. Floats are written exactly: the shortest text that
reads back as the same float64. A line holding uint64 metrics names them in a
``"uint64"`` list after ``aggregated`` (``"uint64":["tokens"]``): a JSON number
says nothing of its dtype, and without it a uint64 that int64 holds would come
back as int64.

Every JSONL line jaxhistory writes comes from :func:`encode_records`: a batch of
records is written by one orjson call (about half a microsecond per record of ten
floats), after :func:`jsonable` has turned the values orjson cannot write as we
want (non-finite floats, narrow floats, huge integers) into ones it can.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson

from jaxhistory._compiled import speedups
from jaxhistory._dtypes import as_step, first_inexact
from jaxhistory._names import printable
from jaxhistory._record import Batch

__all__ = [
    "NONFINITE_TEXT",
    "StepEntryError",
    "decode_line",
    "encode_records",
    "jsonable",
    "jsonl_value",
    "later_wins",
    "line_run_id",
    "line_step",
    "read_columns",
    "read_log",
    "read_run_id",
    "read_stamps",
]

# repr(x) of a non-finite float -> its text in the logs (strict JSON has no NaN)
NONFINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_FROM_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_U64 = 2**64
_UINT64 = np.dtype(np.uint64)
_ZEROS = itertools.repeat(0.0)


def _nonfinite(x: float) -> str:
    return NONFINITE_TEXT[repr(float(x))]


def _listed(arr: np.ndarray) -> list:
    """An array with non-finite values as nested lists, those as strings."""
    if arr.ndim == 1:
        return [v if math.isfinite(v) else _nonfinite(v) for v in arr.tolist()]
    return [_listed(a) for a in arr]


def jsonable(value: Any) -> Any:
    """``value`` as something orjson writes in the log's format: finite floats
    and ints as they are, non-finite floats as ``"NaN"``/``"Infinity"``/
    ``"-Infinity"``, integers beyond 64 bits as floats, NumPy and JAX values as
    numbers or (nested) lists; float arrays are widened to float64 first, so a
    float32 value is written as the float64 it reads back as."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else _nonfinite(value)
    if kind is int:
        return value if -_U64 < value < _U64 else float(value)
    if kind is bool or value is None:
        return value
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf" or (
        arr.dtype.kind == "f" and arr.dtype != np.float64
    ):  # bfloat16 and other ml_dtypes floats
        arr = arr.astype(np.float64)
    if arr.ndim == 0:
        return jsonable(arr.item())
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        return _listed(arr)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _clean(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``values`` itself when orjson can write every value as it is, else a copy
    with each value made :func:`jsonable`."""
    try:  # (callers hold np.errstate(all="ignore"): NumPy values may overflow)
        total = sum(values.values(), 0.0)  # NaN and Inf survive a sum
        if type(total) is float and total - total == 0.0:
            return values
    except Exception:  # arrays of other shapes, or not numbers
        pass
    return {k: jsonable(v) for k, v in values.items()}


def _uint64_names(values: Mapping[str, Any]) -> list[str]:
    """The names of the uint64 values (NumPy scalars and arrays) of a record's
    metrics. Only records :func:`_clean` had to clean can hold one: a uint64
    never passes its check."""
    return [k for k, v in values.items() if getattr(v, "dtype", None) == _UINT64]


def _uint64_mark(values: Mapping[str, Any]) -> bytes:
    """``,"uint64":[...]`` naming the uint64 values of a record's metrics, or
    nothing."""
    names = _uint64_names(values)
    return b',"uint64":' + orjson.dumps(names) if names else b""


def jsonl_value(value: Any) -> bytes:
    """The JSON text of one metric value (numbers, NumPy/JAX scalars and arrays).

    Examples:
        >>> import numpy as np
        >>> from jaxhistory._codec import jsonl_value
        >>> jsonl_value(0.1), jsonl_value(np.array([1.5, np.nan])), jsonl_value(3)
        (b'0.1', b'[1.5,"NaN"]', b'3')
    """
    if type(value) is int:
        return str(value).encode()
    return orjson.dumps(jsonable(value), option=_NUMPY)


def _dumped(dicts: list) -> bytes:
    """orjson's text of the list ``dicts``."""
    try:
        return orjson.dumps(dicts, option=_NUMPY)
    except orjson.JSONEncodeError:  # an int past 64 bits that a sum let through
        cleaned = [{k: jsonable(v) for k, v in d.items()} for d in dicts]
        return orjson.dumps(cleaned, option=_NUMPY)


def _bodies(dicts: list, k: int, text: bytes | None = None) -> list[bytes] | None:
    """The JSON text of each dict without its braces, from one orjson call for
    all of them (``text``: that call's result, made already); None where a
    name holds the '},{' that separates them."""
    parts = (_dumped(dicts) if text is None else text).split(b"},{")
    if len(parts) != k:
        return None
    parts[0] = parts[0][2:]
    parts[-1] = parts[-1][:-2]
    return parts


def _all_clean(dicts: list) -> tuple[list, list | None]:
    """``dicts``, with each one that orjson cannot write as it is cleaned, and
    each record's :func:`_uint64_mark` (None where no record has one)."""
    try:  # NaN and Inf survive a sum: one pass over every value finds them
        # (each record's sum starts at 0.0: NumPy uint64s summed as themselves
        # would overflow, with a warning; arrays and float32s beside large
        # floats still may, quietly)
        with np.errstate(all="ignore"):
            total = sum(map(sum, map(dict.values, dicts), _ZEROS), 0.0)
        if type(total) is float and total - total == 0.0:
            return dicts, None
    except Exception:  # arrays, or a mapping that is not a dict
        pass
    with np.errstate(all="ignore"):  # (one for the batch: each costs ~1 µs)
        cleaned = [_clean(d) for d in dicts]
    marks = [
        b"" if c is d else _uint64_mark(d) for c, d in zip(cleaned, dicts, strict=True)
    ]
    return cleaned, marks if any(marks) else None


def encode_records(batch: Batch) -> bytes:
    """The JSONL lines of the records of ``batch`` (timestamps None: unknown;
    groups only for published metrics).

    All the records' metrics go through one orjson call (and their aggregated
    values through another); the lines are then put together by slice
    assignments into one list and one join.

    Examples:
        >>> from jaxhistory._codec import encode_records
        >>> from jaxhistory._record import Batch
        >>> encode_records(Batch([1], [None], [{"loss": 0.25}]))
        b'{"step":1,"timestamp":null,"process_index":0,"metrics":{"loss":0.25},\
"aggregated":{}}\\n'
    """
    steps, stamps, aggregated = batch.steps, batch.stamps, batch.aggregated
    k = len(steps)
    if not k:
        return b""
    # (a batch of value tuples makes its dicts here, which the sinks then
    # share: the dicts' one orjson call and three fields a line write faster
    # than a field per number)
    metrics = batch.metrics
    if not batch.finite:  # (finite: History's own dicts)
        metrics = [m if type(m) is dict else dict(m) for m in metrics]
    if batch.groups is not None and any(g is not None for g in batch.groups):
        return _encode_each(batch)
    marks = None
    if not batch.finite:
        metrics, marks = _all_clean(metrics)
    bodies_text = _dumped(metrics)
    columns: list[list[bytes] | None] = []  # after the metrics' own column
    tail = [b'},"aggregated":{}']  # what follows each column
    if aggregated is not None and any(aggregated):
        columns.append(_bodies(_all_clean([dict(a) for a in aggregated])[0], k))
        tail = [b'},"aggregated":{', b"}"]
    if marks is not None:
        columns.append(marks)
        tail.append(b"")
    if not batch.finite:  # (finite: History's own times, Python floats)
        stamps = [t if t is None or type(t) is float else float(t) for t in stamps]
    head = [
        b'{"step":',
        b',"timestamp":',
        b',"process_index":%d' % batch.process_index
        + _run_id_field(batch.run_id)
        + b',"metrics":{',
    ]
    # steps and timestamps to text in one call
    both_text = orjson.dumps([steps, stamps])
    plain = marks is None and not (aggregated is not None and any(aggregated))
    if speedups is not None and plain:
        # the same lines, put together in one compiled pass
        joined = speedups.lines(bodies_text, both_text, k, *head, tail[0] + b"}\n")
        if joined is not None:
            return joined
    columns = [_bodies(metrics, k, bodies_text), *columns]
    if any(c is None for c in columns):
        return _encode_each(batch)
    both = both_text[2:-2].split(b"],[")
    texts = [both[0].split(b","), both[1].split(b","), *cast(list[list], columns)]
    # one line: head[0] steps[i] head[1] stamps[i] ... column[i] tail; the
    # lines are put together by slice assignments and one join, all in C
    between = [*head, *tail[:-1]]
    pattern: list[bytes | None] = []
    for text in between:
        pattern += [text, None]
    pattern.append(tail[-1] + b"}\n")
    width = len(pattern)
    out = pattern * k
    for j, column in enumerate(texts):
        out[2 * j + 1 :: width] = column
    return b"".join(cast(list[bytes], out))


def _run_id_field(run_id: str | None) -> bytes:
    """``,"run_id":"..."``, or nothing."""
    if run_id is None:
        return b""
    return b',"run_id":' + orjson.dumps(run_id)


def read_run_id(path: Path, tail: int = 1 << 20) -> str | None:
    """The run id on the last line of a JSONL log that has one, or None (a log
    without run ids). The last ``tail`` bytes are read first; where no complete
    line there has one (lines longer than that), the whole log line by line."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - tail))
        lines = f.read().split(b"\n")
    found = _last_run_id(reversed(lines))
    if found is None and size > tail:
        with open(path, "rb") as f:
            found = _last_run_id(list(f)[::-1])
    return found


def _last_run_id(lines) -> str | None:
    for line in lines:
        if b'"run_id"' not in line:
            continue
        try:
            run_id = orjson.loads(line).get("run_id")
        except (ValueError, AttributeError):
            continue  # a cut-off or damaged line
        if isinstance(run_id, str):
            return run_id
    return None


def _encode_each(batch: Batch) -> bytes:
    """:func:`encode_records` record by record (names holding '},{', groups)."""
    out = []
    for r in batch.records():
        record: dict[str, Any] = {
            "step": r.step,
            "timestamp": None if r.timestamp is None else float(r.timestamp),
            "process_index": r.process_index,
        }
        if batch.run_id is not None:
            record["run_id"] = batch.run_id
        if r.group is not None:
            record["group"] = r.group
        with np.errstate(all="ignore"):
            record["metrics"] = _clean(r.metrics)
            record["aggregated"] = _clean(r.aggregated) if r.aggregated else {}
        unsigned = [] if record["metrics"] is r.metrics else _uint64_names(r.metrics)
        if unsigned:
            record["uint64"] = unsigned
        out.append(orjson.dumps(record, option=_NUMPY) + b"\n")
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


class StepEntryError(ValueError):
    """A line whose metrics (or aggregated values) hold a ``step`` entry other
    than the line's step: two steps for one record."""


def decode_line(line: bytes | str) -> tuple[int, dict[str, Any], list[str]]:
    """The step, the values (metrics and aggregated) and the names the line marks
    as uint64 of one line.

    A ``step`` entry in the metrics or the aggregated values is the step of the
    record, as :meth:`~jaxhistory.HistoryState.update` takes one given beside
    an explicit step: it is left out where it is the line's step, and a
    :class:`StepEntryError` where it is not.

    Raises ValueError for a line that is not a complete record with an int64
    step (a line cut off by a killed run, for example). Steps may be negative,
    as :meth:`~jaxhistory.HistoryState.update` takes them.
    """
    try:
        record = orjson.loads(line)  # invalid UTF-8 is a JSONDecodeError
        step = record["step"]
        metrics = record.get("metrics", {})
        aggregated = record.get("aggregated", {})
        items = {**metrics, **aggregated}
        if type(step) is not int:
            raise ValueError("no integer step")
        if not -(2**63) <= step < 2**63:
            raise ValueError(f"step {step} is outside int64")
        unsigned = record.get("uint64", [])
        if type(unsigned) is not list or not all(type(n) is str for n in unsigned):
            raise ValueError("its 'uint64' is not a list of names")
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a record: {err}") from None
    if "step" in items:
        _check_step_entry(step, metrics, "metric")
        _check_step_entry(step, aggregated, "aggregated value")
        del items["step"]
    return step, {k: _decode(v) for k, v in items.items()}, unsigned


def _check_step_entry(step: int, values: dict, what: str) -> None:
    """A StepEntryError where ``values`` has a ``step`` entry that is not
    ``step``."""
    if "step" not in values:
        return
    entry = values["step"]
    try:
        same = as_step("step", _decode(entry)) == step
    except (ValueError, TypeError):  # not a whole number
        same = False
    if not same:
        shown = printable(repr(_shown(entry)))
        raise StepEntryError(
            f"its {what} 'step' is {shown:.60}, but the step of the line is "
            f"{step}: a 'step' entry is the step of its record, not a metric"
        )


def _shown(entry: Any) -> Any:
    """A JSON value as read back (``"NaN"`` as nan), or as it is."""
    try:
        return _decode(entry)
    except ValueError:  # a string that is not a number's
        return entry


def read_columns(
    path: Path,
) -> tuple[dict[str, tuple[list[int], list[Any]]], list[int], int, set[str]]:
    """Every metric's steps and values in a JSONL log, in line order, the
    numbers of the lines that are not complete records, how many are, and the
    names some line marks as uint64."""
    columns: dict[str, tuple[list[int], list[Any]]] = {}
    bad = []
    records = 0
    unsigned: set[str] = set()
    with open(path, "rb") as f:  # bytes: a damaged line costs only itself
        for number, line in enumerate(f, 1):
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]  # a UTF-8 byte order mark
            if not line.strip():
                continue
            try:
                step, items, marked = decode_line(line)
            except StepEntryError as err:  # a record, but with two steps
                raise ValueError(f"{printable(path)}, line {number}: {err}") from None
            except (ValueError, RecursionError):  # (JSON nested past the stack)
                bad.append(number)
                continue
            records += 1
            unsigned.update(marked)
            for name, value in items.items():
                steps, values = columns.setdefault(name, ([], []))
                steps.append(step)
                values.append(value)
    return columns, bad, records, unsigned


# The start of every line jaxhistory writes: read without decoding the line.
_HEAD = re.compile(rb'^\{"step":(-?\d+),"timestamp":(-?\d[\d.eE+-]*)[,}]', re.M)


def line_run_id(line: bytes) -> str | None:
    """The run id of one JSONL line, or None (none there, or no complete
    record)."""
    return _last_run_id([line])


def line_step(line: bytes) -> int | None:
    """The step of one JSONL line (read from its head where jaxhistory wrote
    it), or None for a line that is no complete record."""
    head = _HEAD.match(line)
    if head is not None:
        return int(head.group(1))
    try:
        return decode_line(line)[0]
    except (ValueError, RecursionError):  # (a StepEntryError is a ValueError)
        return None


def read_stamps(path: Path) -> dict[int, float]:
    """Step -> timestamp of every line of a JSONL log that has one (the first
    line of a step wins).

    The lines jaxhistory writes start with ``{"step":N,"timestamp":T``: those
    are read in one pass over the file without decoding the rest of the line
    (20,000 lines in milliseconds); a log written another way is decoded line
    by line.
    """
    data = Path(path).read_bytes()
    stamps: dict[int, float] = {}
    heads = _HEAD.findall(data)
    for step, stamp in heads:
        try:
            stamps.setdefault(int(step), float(stamp))
        except ValueError:
            continue  # not a number after all
    unknown = data.count(b'"timestamp":null')
    if len(heads) + unknown == data.count(b'"timestamp":'):
        return stamps  # every line with a time was read by its head
    for line in data.splitlines():  # lines written another way
        if b'"timestamp"' not in line or _HEAD.match(line):
            continue
        try:
            record = orjson.loads(line)
            step, stamp = record["step"], record["timestamp"]
        except (ValueError, KeyError, TypeError):
            continue  # a cut-off or damaged line
        if type(step) is int and isinstance(stamp, float):
            stamps.setdefault(step, stamp)
    return stamps


def read_log(path: str | os.PathLike) -> tuple[dict[str, tuple], int, str | None]:
    """The metrics of a JSONL log as ``{name: (steps, values)}`` arrays, the step
    after the last one, and the run id of its lines (see
    :meth:`HistoryState.from_jsonl <jaxhistory.HistoryState.from_jsonl>`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no JSONL log at {path}")
    raw, bad, records, unsigned = read_columns(path)
    if bad and not records and not _cut_first_line(path, bad):
        gzip = " (gzip data: decompress it first)" if _gzipped(path) else ""
        raise ValueError(
            f"{path} holds no complete record: its {len(bad)} line(s) are not "
            f"a jaxhistory JSONL log{gzip}"
        )
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        warnings.warn(
            f"{printable(path)}: skipped {len(bad)} incomplete or damaged line(s) "
            f"(line {shown})",
            RuntimeWarning,
            stacklevel=3,
        )
    columns = {}
    for name, (steps, values) in raw.items():
        try:
            arr = _log_column(name, values, name in unsigned)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        steps_arr = np.asarray(steps, np.int64)
        columns[name] = later_wins(steps_arr, arr)  # the later line wins
    # As update counts: one past the latest step, and never below 0.
    next_step = max((int(s[-1]) + 1 for s, _ in columns.values()), default=0)
    next_step = max(next_step, 0)
    run_id = read_run_id(path)
    return columns, next_step, run_id


def _log_column(name: str, values: list, unsigned: bool = False) -> np.ndarray:
    """The values of a metric read from a log, in the dtype that holds them all
    exactly (ValueError naming the metric where none does); ``unsigned``: a
    line marks it as uint64, which it is where every value is a whole number
    that uint64 holds."""
    try:
        arr = np.asarray(values)
    except ValueError:
        raise ValueError(f"metric {name!r} changes shape") from None
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"metric {name!r} has non-numeric values")
    if arr.dtype.kind != "f":
        if unsigned and arr.dtype.kind == "i" and not (arr < 0).any():
            return arr.astype(np.uint64)
        return arr  # integers within int64, or bools
    # NumPy turns ints beyond int64 (and ints beside floats) into float64.
    flat = values if arr.ndim == 1 else np.asarray(values, object).ravel().tolist()
    ints = [v for v in flat if type(v) is int]
    if not ints:
        return arr.astype(np.float64)
    if len(ints) == len(flat):  # every value an integer, some beyond int64
        low, high = min(ints), max(ints)
        if low >= 0:
            return np.array(values, np.uint64)
        raise ValueError(
            f"metric {name!r} holds the integers {high} and {low}: neither int64 "
            "nor uint64 holds both, and float64 would round them"
        )
    for v in ints:
        if first_inexact(v) is not None:
            raise ValueError(
                f"metric {name!r} mixes floats with the integer {v}, which float64 "
                "cannot hold exactly"
            )
    return arr.astype(np.float64)


def _gzipped(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _cut_first_line(path: Path, bad: list[int]) -> bool:
    """Whether a log's one line is a record cut off as it was written (a run
    killed before its first line was complete): an empty history, not a
    foreign file."""
    if len(bad) != 1:
        return False
    with open(path, "rb") as f:
        head = f.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
        f.seek(-1, os.SEEK_END)
        return head.startswith(b'{"step"') and f.read(1) != b"\n"


def later_wins(steps: np.ndarray, values: np.ndarray):
    """Records in step order, one per step: where several share a step, the one
    that came later in the input wins."""
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    keep = np.ones(len(steps), bool)
    keep[:-1] = steps[1:] != steps[:-1]
    return steps[keep], values[keep]
