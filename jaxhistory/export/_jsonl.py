"""The JSONL log: one strict-JSON line per update, streamed during the run.

Each line is ``{"step":42,"timestamp":1732240000.123,"process_index":0,
"metrics":{...},"aggregated":{...}}``: ``metrics`` holds what was recorded as
given, ``aggregated`` the cross-device statistics (``name/mean``, ``name/max``,
``name/min``, ``name/std``). NaN and infinities are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (not bare tokens, which strict JSON
parsers reject); :func:`from_jsonl` turns them back into floats. Array metrics are
nested lists. Floats are written exactly: the shortest text that reads back as the
same float64 (orjson formats whole columns at a time).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import math
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orjson

from jaxhistory._stats import STATS, Stats, stat_names

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["JsonlStream", "from_jsonl", "jsonl_value", "to_jsonl"]

# repr(x) of a non-finite float -> its text in the logs (strict JSON has no NaN)
NONFINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_NONFINITE = {k: b'"' + v.encode() + b'"' for k, v in NONFINITE_TEXT.items()}
_FROM_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


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

    Floats are written exactly (the shortest text that reads back as the same
    float64); NaN and infinities as the strings ``"NaN"``, ``"Infinity"`` and
    ``"-Infinity"``; arrays as nested lists.

    Example:
        >>> import numpy as np
        >>> from jaxhistory.export._jsonl import jsonl_value
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


def _column_texts(values: np.ndarray) -> list[bytes]:
    """JSON texts of a column of records (one per row): whole columns at a time."""
    arr = _plain(values)
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


def aggregated_names(names) -> set[str]:
    """The names that belong to a complete ``name/{mean,max,min,std}`` group."""
    names = set(names)
    out = set()
    for name in names:
        base, _, stat = name.rpartition("/")
        if stat == "mean" and all(f"{base}/{s}" in names for s in STATS):
            out.update(f"{base}/{s}" for s in STATS)
    return out


def _key(name: str) -> bytes:
    """A JSON key, ready for %-formatting templates."""
    return orjson.dumps(name).replace(b"%", b"%%")


def _stamp(timestamp) -> bytes:
    return b"null" if timestamp is None else orjson.dumps(float(timestamp))


def _stamps(steps: list[int], timestamps: dict[int, float]) -> list[bytes]:
    """The timestamp text of each step (``null`` where unknown), in one call."""
    if not timestamps:
        return [b"null"] * len(steps)
    get = timestamps.get
    times = np.array([get(step, math.nan) for step in steps], np.float64)
    known = np.isfinite(times)
    texts = orjson.dumps(np.where(known, times, 0.0), option=_NUMPY)[1:-1].split(b",")
    for i in np.flatnonzero(~known).tolist():
        texts[i] = b"null"
    return texts


_CHUNK = 4096  # lines formatted by one %-operation
_LINE = (
    b'{"step":%d,"timestamp":%s,"process_index":%d,"metrics":{%s},"aggregated":{%s}}\n'
)


def to_jsonl(
    state: HistoryState,
    path: str | os.PathLike,
    timestamps: dict[int, float] | None = None,
    process_index: int = 0,
    overwrite: bool = True,
) -> Path:
    """Writes ``state`` as JSONL, one line per step; returns the path.

    ``timestamps`` maps steps to wall-clock times (``null`` where unknown).
    Complete ``name/{mean,max,min,std}`` groups go under ``aggregated``. With
    ``overwrite=False`` the lines are appended to an existing file.
    """
    path = Path(path)
    timestamps = timestamps or {}
    grouped = aggregated_names(state.keys)
    # One block per table: metrics recorded together share their steps, so each
    # row's text comes from one template, and each column is turned into text in
    # one call (much faster than value by value).
    blocks = []
    for keys, (table, n) in state.data.tables.items():
        if not n:
            continue
        steps, columns = table.view(n)
        order = [j for j, k in enumerate(keys) if k not in grouped]
        order += [j for j, k in enumerate(keys) if k in grouped]
        m = b",".join(_key(keys[j]) + b":%s" for j in order if keys[j] not in grouped)
        a = b",".join(_key(keys[j]) + b":%s" for j in order if keys[j] in grouped)
        texts = [_column_texts(columns[j]) for j in order]
        cut = sum(1 for j in order if keys[j] not in grouped)
        blocks.append((steps.tolist(), m, a, cut, texts))
    if len(blocks) == 1:
        steps, m, a, _, texts = blocks[0]
        width = 2 + len(texts)  # step, timestamp, then the values
        template = _LINE.replace(b"%d", b"%%d", 1).replace(b"%s", b"%%s", 1)
        template = template % (process_index, m, a)
        stamps = _stamps(steps, timestamps)
        # One %-format per chunk of lines: no Python loop per line.
        fields = zip(steps, stamps, *texts, strict=True)
        flat = itertools.chain.from_iterable(fields)
        lines = []
        for start in range(0, len(steps), _CHUNK):
            k = min(_CHUNK, len(steps) - start)
            lines.append((template * k) % tuple(itertools.islice(flat, k * width)))
    else:
        per_step: dict[int, list[list[bytes]]] = {}
        for steps, m, a, cut, texts in blocks:
            rows = zip(*texts, strict=True) if texts else [()] * len(steps)
            for step, row in zip(steps, rows, strict=True):
                entry = per_step.get(step)
                if entry is None:
                    entry = per_step[step] = [[], []]
                if m:
                    entry[0].append(m % row[:cut])
                if a:
                    entry[1].append(a % row[cut:])
        lines = [
            _LINE
            % (
                step,
                _stamp(timestamps.get(step)),
                process_index,
                b",".join(mm),
                b",".join(aa),
            )
            for step, (mm, aa) in sorted(per_step.items())
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    if overwrite:
        from jaxhistory.export._netcdf import atomic_write

        atomic_write(path, lambda tmp: tmp.write_bytes(b"".join(lines)))
    else:
        with open(path, "ab") as f:
            _end_partial_line(f, path)
            f.write(b"".join(lines))
    return path


def _end_partial_line(f, path: Path) -> None:
    """Starts a new line if the file ends in the middle of one (a killed run)."""
    if f.tell() == 0:
        return
    with open(path, "rb") as r:
        r.seek(-1, os.SEEK_END)
        if r.read(1) != b"\n":
            f.write(b"\n")


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


def from_jsonl(path: str | os.PathLike) -> HistoryState:
    """The history in a JSONL log written by History or :func:`to_jsonl`.

    Lines that are not complete JSON records (the last line of a killed run, or
    one cut off before a resumed run appended) are skipped with a warning; every
    other record is kept. Where several lines record a metric at the same step (a
    run resumed from an earlier checkpoint), the later line wins. Integers come
    back as int64, other numbers as float64.
    """
    from jaxhistory._table import Table, Tables
    from jaxhistory._history_state import HistoryState

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no JSONL log at {path}")
    columns: dict[str, tuple[list[int], list[Any]]] = {}
    bad = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
                step = record["step"]
                items = {**record.get("metrics", {}), **record.get("aggregated", {})}
                if type(step) is not int:
                    raise ValueError("no integer step")
                items = {k: _decode(v) for k, v in items.items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                bad.append(number)
                continue
            for name, value in items.items():
                steps, values = columns.setdefault(name, ([], []))
                steps.append(step)
                values.append(value)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        warnings.warn(
            f"{path}: skipped {len(bad)} incomplete line(s) (line {shown})",
            RuntimeWarning,
            stacklevel=2,
        )
    tables = {}
    next_step = 0
    for name, (steps, values) in columns.items():
        steps_arr = np.asarray(steps, np.int64)
        try:
            arr = np.asarray(values)
        except ValueError:
            raise ValueError(f"{path}: metric {name!r} changes shape") from None
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"{path}: metric {name!r} has non-numeric values")
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float64)
        order = np.argsort(steps_arr, kind="stable")
        steps_arr, arr = steps_arr[order], arr[order]
        keep = np.ones(len(steps_arr), bool)
        keep[:-1] = steps_arr[1:] != steps_arr[:-1]  # the later line wins
        steps_arr, arr = steps_arr[keep], arr[keep]
        tables[(name,)] = (Table.from_arrays((name,), steps_arr, [arr]), len(arr))
        next_step = max(next_step, int(steps_arr[-1]) + 1)
    return HistoryState(data=Tables(tables), next_step=next_step)


def _host(value: Any) -> Any:
    """A recorded value on the host: Python numbers stay, 0-d arrays become Python
    numbers, arrays NumPy arrays (this is where device values are waited for)."""
    if type(value) is float or type(value) is int:
        return value
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item() if arr.dtype.kind in "biuf" else float(arr)
    return arr


def record_line(record: Any, keys: dict[str, bytes] | None = None) -> bytes:
    """The JSONL line of a :class:`~jaxhistory.sinks.Record` (``keys`` caches the
    JSON text of names)."""
    keys = {} if keys is None else keys
    for k in (*record.metrics, *record.aggregated):
        if k not in keys:
            keys[k] = orjson.dumps(k) + b":"  # each name encoded once per log
    m = b",".join([keys[k] + jsonl_value(v) for k, v in record.metrics.items()])
    a = b",".join([keys[k] + jsonl_value(v) for k, v in record.aggregated.items()])
    step = b"null" if record.step is None else str(int(record.step)).encode()
    head = b'{"step":%s,"timestamp":%s,"process_index":%d' % (
        step,
        _stamp(record.timestamp),
        record.process_index,
    )
    if record.group is not None:
        head += b',"group":' + orjson.dumps(record.group)
    return head + b',"metrics":{%s},"aggregated":{%s}}\n' % (m, a)


class JsonlStream:
    """History's background writer: the JSONL log and the sinks, about twice a second.

    ``add`` only queues the record (device values are not waited for); the thread
    turns queued records into host values once they are ready, writes their lines
    and flushes the file (so a process killed with SIGKILL loses at most about a
    second of records and every complete line stays parseable), then hands them
    to each sink and, while one is active, to the Chrome trace handler (as
    counters). ``path`` None: sinks only.
    """

    INTERVAL = 0.5  # seconds between writes

    def __init__(
        self,
        path: str | os.PathLike | None,
        overwrite: bool = False,
        sinks: Any = (),
    ):
        self.path = None if path is None else Path(path)
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "wb" if overwrite else "ab")  # noqa: SIM115
            if not overwrite:
                _end_partial_line(self._file, self.path)
        self.sinks = list(sinks)
        self._sink_warned: set[int] = set()
        self._pending: collections.deque[tuple] = collections.deque()
        self._write_lock = threading.Lock()
        self._add_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._broken = False
        self._warned = False
        self._keys: dict[str, bytes] = {}  # metric name -> its JSON text
        self.error: BaseException | None = None  # the last failed write
        self.process_index = jax.process_index()
        self._thread = threading.Thread(
            target=self._run, name="jaxhistory-jsonl", daemon=True
        )
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (s := ref()) and s.close())
        from jaxhistory import _trace_state

        _trace_state.register_stream(self)

    def add(
        self,
        step: int,
        metrics: Any,
        aggregated: Any = None,
        timestamp: float | None = None,
    ) -> None:
        """Queues one record: ``metrics`` as (name, value) pairs, ``aggregated``
        as (names, packed values) or None; ``timestamp`` defaults to now."""
        if timestamp is None:
            timestamp = time.time()
        with self._add_lock:  # never after close() took the last records
            if self._closed:
                raise ValueError(f"the JSONL log {self.path} is closed")
            self._pending.append((step, timestamp, metrics, aggregated))

    def _run(self) -> None:
        while not self._wake.wait(self.INTERVAL):
            self.flush()
        self.flush()

    def flush(self) -> None:
        """Writes every queued record now (waiting for its device values)."""
        with self._write_lock:
            queue = self._pending  # appended to by add() without a lock
            pending = [queue.popleft() for _ in range(len(queue))]
            if not pending:
                return
            records = []
            for raw in pending:
                try:
                    records.append(self._resolve(*raw))
                except Exception as err:  # one bad record (a deleted array) only
                    self._warn(f"a record at step {raw[0]} was dropped: {err!r}")
            if self._file is not None and not self._file.closed and records:
                self._write([record_line(r, self._keys) for r in records])
            self._fan_out(records)

    def _write(self, lines: list[bytes]) -> None:
        try:
            if self._broken:  # the last write may have stopped mid-line
                self._file.write(b"\n")
                self._broken = False
            self._file.write(b"".join(lines))
            self._file.flush()
        except Exception as err:  # a full disk must not stop the training
            self._broken = True
            self.error = err
            self._warn(f"writing failed: {err!r}")

    def _fan_out(self, records: list) -> None:
        from jaxhistory import _trace_state

        targets = list(self.sinks)
        handler = _trace_state.active()
        if handler is not None:
            targets.append(handler)
        for sink in targets:
            for record in records:  # one bad record does not cost the rest
                self._try(sink, sink.write, record)
            self._try(sink, sink.flush)

    def _try(self, sink: Any, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:  # a failing sink must not stop the others
            if id(sink) not in self._sink_warned:
                self._sink_warned.add(id(sink))
                warnings.warn(
                    f"sink {type(sink).__name__} failed: {err!r}",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"JSONL log {self.path}: {text}", RuntimeWarning, stacklevel=3
            )

    def _resolve(self, step, timestamp, metrics, aggregated):
        from jaxhistory.sinks import Record

        items = metrics.items() if isinstance(metrics, dict) else metrics
        plain, stats = {}, {}
        for k, v in items:
            if isinstance(v, Stats):  # statistics computed in the step
                flat = np.asarray(v.table).reshape(-1).tolist()  # stat-major
                names = stat_names(v.names, f"{k}/" if k else "")
                stats.update(zip(names, flat, strict=True))
            else:
                try:
                    plain[k] = _host(v)
                except Exception as err:  # deleted or donated since it was recorded
                    kind = getattr(getattr(v, "dtype", None), "kind", "f")
                    fill = 0 if kind in "biu" else math.nan
                    shape = tuple(getattr(v, "shape", ()))
                    plain[k] = np.full(shape, fill) if shape else fill
                    self._warn(
                        f"{k!r} at step {step} could not be read ({err}); written "
                        "as NaN (0 for integers), as the history stores it"
                    )
        if aggregated is not None:
            names, packed = aggregated
            stats.update(
                zip(names, np.asarray(packed).reshape(-1).tolist(), strict=True)
            )
        return Record(step, timestamp, plain, stats, self.process_index)

    def close(self) -> None:
        """Writes what is queued, stops the thread and closes the file (not the
        sinks: they belong to the caller)."""
        with self._add_lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()
        if self._file is not None:
            self._file.close()
