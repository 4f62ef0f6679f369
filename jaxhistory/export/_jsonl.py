"""The JSONL log: one strict-JSON line per update, streamed during the run.

Each line is ``{"step": 42, "timestamp": 1732240000.123, "process_index": 0,
"metrics": {...}, "aggregated": {...}}``: ``metrics`` holds what was recorded as
given, ``aggregated`` the cross-device statistics (``name/mean``, ``name/max``,
``name/min``, ``name/std``). NaN and infinities are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (not bare tokens, which strict JSON
parsers reject); :func:`from_jsonl` turns them back into floats. Array metrics are
nested lists.
"""

from __future__ import annotations

import atexit
import collections
import json
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

from jaxhistory._stats import STATS, Stats, stat_names

if TYPE_CHECKING:
    from jaxhistory._history import HistoryState

__all__ = ["JsonlStream", "from_jsonl", "jsonl_value", "to_jsonl"]

_NONFINITE = {"nan": '"NaN"', "inf": '"Infinity"', "-inf": '"-Infinity"'}
_FROM_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float_text(x: float) -> str:
    text = repr(x)
    return _NONFINITE.get(text, text)


def jsonl_value(value: Any) -> str:
    """The JSON text of one metric value (numbers, NumPy/JAX scalars and arrays)."""
    if type(value) is float:
        return _float_text(value)
    if type(value) is int:
        return str(value)
    arr = np.asarray(value)
    if arr.ndim:
        return "[" + ", ".join(jsonl_value(v) for v in arr) + "]"
    if arr.dtype.kind == "b":
        return "true" if arr else "false"
    if arr.dtype.kind in "iu":
        return str(int(arr))
    return _float_text(float(arr))


def _column_texts(values: np.ndarray) -> list[str]:
    """JSON texts of a column of records, fast for scalar columns."""
    if values.ndim == 1 and values.dtype.kind == "f":
        texts = list(map(repr, values.astype(np.float64).tolist()))
        if not np.isfinite(values).all():
            texts = [_NONFINITE.get(t, t) for t in texts]
        return texts
    if values.ndim == 1 and values.dtype.kind in "iu":
        return list(map(str, values.tolist()))
    return [jsonl_value(v) for v in values]


def aggregated_names(names) -> set[str]:
    """The names that belong to a complete ``name/{mean,max,min,std}`` group."""
    names = set(names)
    out = set()
    for name in names:
        base, _, stat = name.rpartition("/")
        if stat == "mean" and all(f"{base}/{s}" in names for s in STATS):
            out.update(f"{base}/{s}" for s in STATS)
    return out


def _key(name: str) -> str:
    """A JSON key, ready for %-formatting templates."""
    return json.dumps(name).replace("%", "%%")


def _stamp(timestamp) -> str:
    return "null" if timestamp is None else repr(float(timestamp))


def _line(step, timestamp, process_index, metrics: str, aggregated: str) -> str:
    ts = _stamp(timestamp)
    step = step if isinstance(step, str) else int(step)
    return (
        f'{{"step": {step}, "timestamp": {ts}, "process_index": '
        f'{process_index}, "metrics": {{{metrics}}}, "aggregated": {{{aggregated}}}}}\n'
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
    # row's text comes from one template (much faster than value by value).
    blocks = []
    for keys, (table, n) in state.data.tables.items():
        if not n:
            continue
        steps, columns = table.view(n)
        order = [j for j, k in enumerate(keys) if k not in grouped]
        order += [j for j, k in enumerate(keys) if k in grouped]
        m = ", ".join(f"{_key(keys[j])}: %s" for j in order if keys[j] not in grouped)
        a = ", ".join(f"{_key(keys[j])}: %s" for j in order if keys[j] in grouped)
        texts = [_column_texts(columns[j]) for j in order]
        cut = sum(1 for j in order if keys[j] not in grouped)
        blocks.append((steps.tolist(), m, a, cut, list(zip(*texts, strict=True))))
    if len(blocks) == 1:
        steps, m, a, _, rows = blocks[0]
        template = _line("%d", None, process_index, m, a).replace("null", "%s", 1)
        lines = [
            template % (step, _stamp(timestamps.get(step)), *row)
            for step, row in zip(steps, rows, strict=True)
        ]
    else:
        per_step: dict[int, list[list[str]]] = {}
        for steps, m, a, cut, rows in blocks:
            for step, row in zip(steps, rows, strict=True):
                entry = per_step.get(step)
                if entry is None:
                    entry = per_step[step] = [[], []]
                if m:
                    entry[0].append(m % row[:cut])
                if a:
                    entry[1].append(a % row[cut:])
        lines = [
            _line(
                step, timestamps.get(step), process_index, ", ".join(mm), ", ".join(aa)
            )
            for step, (mm, aa) in sorted(per_step.items())
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    if overwrite:
        from jaxhistory.export._netcdf import atomic_write

        atomic_write(path, lambda tmp: tmp.write_text("".join(lines)))
    else:
        with open(path, "a", encoding="utf-8") as f:
            _end_partial_line(f, path)
            f.write("".join(lines))
    return path


def _end_partial_line(f, path: Path) -> None:
    """Starts a new line if the file ends in the middle of one (a killed run)."""
    if f.tell() == 0:
        return
    with open(path, "rb") as r:
        r.seek(-1, os.SEEK_END)
        if r.read(1) != b"\n":
            f.write("\n")


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
    from jaxhistory._column import Table, Tables
    from jaxhistory._history import HistoryState

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
                record = json.loads(line)
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


class JsonlStream:
    """Writes History's JSONL log from a background thread, about twice a second.

    ``add`` only queues the record (device values are not waited for); the thread
    turns queued records into lines once their values are on the host, writes them
    and flushes the file, so a process killed with SIGKILL loses at most about a
    second of records and every complete line stays parseable.
    """

    INTERVAL = 0.5  # seconds between writes

    def __init__(self, path: str | os.PathLike, overwrite: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w" if overwrite else "a", encoding="utf-8")  # noqa: SIM115
        if not overwrite:
            _end_partial_line(self._file, self.path)
        self._pending: collections.deque[tuple] = collections.deque()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._broken = False
        self._warned = False
        self._keys: dict[str, str] = {}  # metric name -> its JSON text
        self.error: BaseException | None = None  # the last failed write
        self.process_index = jax.process_index()
        self._thread = threading.Thread(
            target=self._run, name="jaxhistory-jsonl", daemon=True
        )
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (s := ref()) and s.close())

    def add(self, step: int, metrics: Any, aggregated: Any = None) -> None:
        """Queues one record: ``metrics`` as (name, value) pairs, ``aggregated``
        as (names, packed values) or None."""
        if self._closed:
            raise ValueError(f"the JSONL log {self.path} is closed")
        self._pending.append((step, time.time(), metrics, aggregated))

    def _run(self) -> None:
        while not self._wake.wait(self.INTERVAL):
            self.flush()
        self.flush()

    def flush(self) -> None:
        """Writes every queued record now (waiting for its device values)."""
        with self._write_lock:
            queue = self._pending  # appended to by add() without a lock
            pending = [queue.popleft() for _ in range(len(queue))]
            if not pending or self._file.closed:
                return
            lines = []
            for record in pending:
                try:
                    lines.append(self._format(*record))
                except Exception as err:  # one bad record (a deleted array) only
                    self._warn(f"a record at step {record[0]} was dropped: {err!r}")
            if not lines:
                return
            try:
                if self._broken:  # the last write may have stopped mid-line
                    self._file.write("\n")
                    self._broken = False
                self._file.write("".join(lines))
                self._file.flush()
            except Exception as err:  # a full disk must not stop the training
                self._broken = True
                self.error = err
                self._warn(f"writing failed: {err!r}")

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"JSONL log {self.path}: {text}", RuntimeWarning, stacklevel=3
            )

    def _format(self, step, timestamp, metrics, aggregated) -> str:
        items = metrics.items() if isinstance(metrics, dict) else metrics
        plain, stats = [], []
        for k, v in items:
            if isinstance(v, Stats):  # statistics computed in the step
                flat = np.asarray(v.table).reshape(-1).tolist()  # stat-major
                stats += zip(
                    stat_names(v.names, f"{k}/" if k else ""), flat, strict=True
                )
            else:
                plain.append((k, v))
        if aggregated is not None:
            names, packed = aggregated
            flat = np.asarray(packed).reshape(-1).tolist()
            stats += zip(names, flat, strict=True)
        keys = self._keys
        for k, _ in (*plain, *stats):
            if k not in keys:
                keys[k] = json.dumps(k)  # each name is encoded once per log
        m = ", ".join(f"{keys[k]}: {jsonl_value(v)}" for k, v in plain)
        a = ", ".join(f"{keys[k]}: {jsonl_value(v)}" for k, v in stats)
        return _line(step, timestamp, self.process_index, m, a)

    def close(self) -> None:
        """Writes what is queued, stops the thread and closes the file."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()
        self._file.close()
