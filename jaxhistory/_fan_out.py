"""FanOut: what History's writer thread does with the rows it takes: turns them
into host records and writes them, in order, to History's JSONL log, then to an
active Chrome trace handler, then queues them for the user's sinks on a
:class:`~jaxhistory.sinks._feed.SinkFeed` (each sink written from a thread of
its own: a slow or hung sink costs the log nothing).

One line per step: records of the same step that follow each other (an update,
then a timing or an evaluation of that step) are merged into one record, the
later value winning. The latest step's record is held until a record of another
step arrives, a final write (flush, close) comes, or it is :attr:`FanOut.HOLD`
seconds old; a record of that step arriving later still gets a line of its own
(readers merge them, the later value winning).
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np

from jaxhistory import _trace_state
from jaxhistory._host_copies import to_host
from jaxhistory._names import PROVENANCE, grouped, stat_names
from jaxhistory._record import Batch
from jaxhistory._row import Row, RowKind
from jaxhistory._stats import Stats
from jaxhistory._writer import warn_quietly

__all__ = ["FanOut", "merged"]

# The writer's queue holds Rows and, from History's fast path, dicts of finite
# floats with the step under 0 and the time under 1 (see _row.queued)
_STEP, _NAMES, _VALUES_OF, _KIND, _STAMP = map(operator.itemgetter, range(5))
_POP_STEP, _POP_STAMP = (operator.methodcaller("pop", k) for k in (0, 1))
_VALUES = RowKind.VALUES
_ALL_FINITE = {RowKind.FINITE_FLOATS}
_DICTS = {dict}
_TRIPLES = {tuple}
_UINT64 = np.dtype(np.uint64)


def _host(value: Any) -> Any:
    """A recorded value on the host: Python numbers stay, 0-d arrays become Python
    numbers (a uint64 a NumPy uint64, which the JSONL log marks as one), arrays
    NumPy arrays (this is where device values are waited for)."""
    arr = to_host(value)
    if arr.ndim == 0:
        if arr.dtype == _UINT64:
            return arr[()]
        return arr.item() if arr.dtype.kind in "biuf" else float(arr)
    return arr


def _on_host(stats: Stats, values: list) -> Stats:
    """``stats`` rebuilt from the host ``values`` read from it (stat-major)."""
    rows, k = np.shape(stats.table)[0], len(stats.names)
    table = np.asarray(values[: rows * k], np.float64).reshape(rows, k)
    where = None
    if stats.where is not None:
        where = np.asarray(values[rows * k :], np.int64).reshape(-1, k)
    return Stats(stats.names, table, where, stats.rows)


class FanOut:
    """Writes rows to ``sinks`` (on the calling thread: the writer's), then
    queues them on ``feed`` (the user's sinks: anything with ``put(batch)``,
    never waited for). ``on_stats(step, stats, prefix)`` sees each
    :class:`~jaxhistory.Stats` once its values are on the host. The sinks and
    the feed belong to the caller: nothing here closes them."""

    HOLD = 1.0  # seconds the latest step's record waits for more of that step

    def __init__(
        self,
        sinks: Sequence[Any] = (),
        on_stats: Any = None,
        run_id: str | None = None,
        feed: Any = None,
    ):
        self.sinks = list(sinks)
        self.feed = feed
        self.run_id = run_id  # on every JSONL line, where given
        self.on_stats = on_stats
        self.process_index = jax.process_index()
        self._warned: set[Any] = set()
        self._held: Batch | None = None  # the latest step's record, not yet written

    def write(self, rows: list[Row | dict | tuple], final: bool) -> None:
        """Writes ``rows`` (after any held record: Rows, and the items of
        :func:`~jaxhistory._row.queued`: its dicts, which this empties of their
        step and time, or its compiled form's ``(dict, step, time)``); unless
        ``final``, holds back the latest step's record while it is young."""
        held, self._held = self._held, None
        if not rows and held is None:
            return
        batch = merged(held, self._resolve(rows) if rows else None)
        if not final:
            self._held, batch = _hold_last(batch, self.HOLD)
        if batch is not None:
            self._fan_out(batch)

    def _resolve(self, rows: list[Row | dict | tuple]) -> Batch:
        """The rows with their values on the host (this waits for device values)
        and their statistics as aggregated values."""
        types = set(map(type, rows))
        if types == _TRIPLES:  # the compiled fast path's (dict, step, time)
            metrics, steps, stamps = map(list, zip(*rows, strict=True))
            batch = Batch(steps, stamps, metrics, None, None, self.process_index)
            batch.finite = True
            batch.run_id = self.run_id
            return batch
        if types == _DICTS:  # the fast path's own dicts of finite floats
            steps = list(map(_POP_STEP, rows))
            stamps = list(map(_POP_STAMP, rows))
            batch = Batch(steps, stamps, rows, None, None, self.process_index)
            batch.finite = True
            batch.run_id = self.run_id
            return batch
        only_rows = dict not in types and tuple not in types  # (no queued items)
        kinds = set(map(_KIND, rows)) if only_rows else {_VALUES}
        if _VALUES not in kinds:  # Python numbers only: built at C speed
            steps, stamps = list(map(_STEP, rows)), list(map(_STAMP, rows))
            names = _NAMES(rows[0])
            all_names = list(map(_NAMES, rows))
            if all_names.count(names) == len(rows):  # one set of names
                values = list(map(_VALUES_OF, rows))
                batch = Batch.of_rows(steps, stamps, names, values, self.process_index)
            else:
                metrics = list(map(dict, map(zip, all_names, map(_VALUES_OF, rows))))
                batch = Batch(steps, stamps, metrics, None, None, self.process_index)
            batch.finite = kinds == _ALL_FINITE
            batch.run_id = self.run_id
            return batch
        lost: list[str] = []
        steps, stamps, metrics = [], [], []
        aggregated: list[dict[str, Any]] | None = None
        finite = True
        for i, item in enumerate(rows):
            if isinstance(item, dict):
                steps.append(item.pop(0))
                stamps.append(item.pop(1))
                metrics.append(item)
                continue
            if type(item) is tuple:  # (dict, step, time): _row.queued compiled
                metrics.append(item[0])
                steps.append(item[1])
                stamps.append(item[2])
                continue
            row = cast(Row, item)
            step = row.step
            steps.append(step)
            stamps.append(row.timestamp)
            if row.kind is not RowKind.FINITE_FLOATS:
                finite = False
            if row.kind is not RowKind.VALUES:
                metrics.append(dict(zip(row.names, row.values, strict=True)))
                continue
            plain, stats = {}, []
            for name, value in zip(row.names, row.values, strict=True):
                if type(value) is Stats:
                    stats.append((f"{name}/" if name else "", value))
                else:
                    plain[name] = value
            metrics.append(self._host_values(step, plain, lost))
            if stats:
                if aggregated is None:
                    aggregated = [{}] * i
                aggregated.append(self._stats_values(step, stats, lost))
            elif aggregated is not None:
                aggregated.append({})
        if aggregated is not None and len(aggregated) < len(steps):
            aggregated += [{}] * (len(steps) - len(aggregated))
        if lost:
            shown = "; ".join(lost[:5]) + (
                f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            )
            warn_quietly(
                f"device values could not be read and are written as NaN (0 for "
                f"integers), as the history stores them: {shown}",
                stacklevel=3,
            )
        batch = Batch(steps, stamps, metrics, aggregated, None, self.process_index)
        batch.finite = finite
        batch.run_id = self.run_id
        return batch

    @staticmethod
    def _host_values(step, metrics: dict, lost: list[str]) -> dict:
        out: dict[str, Any] = {}
        for name, v in metrics.items():
            if type(v) is float or type(v) is int:
                out[name] = v
                continue
            try:
                out[name] = _host(v)
            except Exception as err:  # deleted or donated since it was recorded
                kind = getattr(getattr(v, "dtype", None), "kind", "f")
                fill = 0 if kind in "biu" else math.nan
                shape = tuple(getattr(v, "shape", ()))
                out[name] = np.full(shape, fill) if shape else fill
                lost.append(f"{name!r} at step {step} could not be read ({err})")
        return out

    def _stats_values(self, step, stats, lost: list[str]) -> dict:
        out: dict[str, float] = {}
        for prefix, s in stats:
            names = stat_names(s.names, prefix, s.rows)
            if s.where is not None:
                names += stat_names(s.names, prefix, PROVENANCE)
            try:
                values = np.asarray(s.table).reshape(-1).tolist()  # stat-major
                if s.where is not None:
                    values += np.asarray(s.where).reshape(-1).tolist()
            except Exception as err:
                values = [math.nan] * len(names)
                lost.append(f"statistics {names[0]!r}... at step {step} ({err})")
            else:
                if self.on_stats is not None:
                    # a warning turned into an error must not stop the log
                    with contextlib.suppress(Exception):
                        self.on_stats(step, _on_host(s, values), prefix)
            out.update(zip(names, values, strict=True))
        return {n: out[n] for n in grouped(tuple(out))}  # one metric's stats together

    def _fan_out(self, batch: Batch) -> None:
        targets = list(self.sinks)
        handler = _trace_state.active()
        if handler is not None:
            targets.append(handler)
        for sink in targets:
            write_batch = getattr(sink, "write_batch", None)
            if write_batch is not None:
                self._try(sink, write_batch, batch)
            else:
                for record in batch.records():  # one bad record costs only itself
                    self._try(sink, sink.write, record)
            self._try(sink, sink.flush)
        if self.feed is not None:
            self.feed.put(batch)  # copied there for each sink: the log's is kept

    def _try(self, sink: Any, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:  # a failing sink must not stop the others
            if id(sink) not in self._warned:
                self._warned.add(id(sink))
                warn_quietly(
                    f"sink {type(sink).__name__} failed: {err!r}", stacklevel=3
                )


def merged(held: Batch | None, batch: Batch | None) -> Batch | None:
    """``held`` then ``batch`` as one batch, with records of the same step that
    follow each other merged into one (the later value winning; the first
    timestamp kept). Without such records, lists are only joined."""
    if held is None or batch is None:
        joined = batch if held is None else held
        if joined is None or not _repeats(joined.steps):
            return joined
        return _merge_runs(joined)
    joined = _joined(held, batch)
    if held.steps[-1] != batch.steps[0] and not _repeats(batch.steps):
        return joined
    return _merge_runs(joined)


def _joined(a: Batch, b: Batch) -> Batch:
    aggregated = None
    if a.aggregated is not None or b.aggregated is not None:
        aggregated = (a.aggregated or [{}] * len(a.steps)) + (
            b.aggregated or [{}] * len(b.steps)
        )
    ua, ub = a.uniform(), b.uniform()
    if aggregated is None and ua is not None and ub is not None and ua[0] == ub[0]:
        out = Batch.of_rows(
            a.steps + b.steps,
            a.stamps + b.stamps,
            ua[0],
            ua[1] + ub[1],
            a.process_index,
        )
    else:
        out = Batch(
            a.steps + b.steps,
            a.stamps + b.stamps,
            a.metrics + b.metrics,
            aggregated,
            None,
            a.process_index,
        )
    out.finite, out.run_id = a.finite and b.finite, a.run_id
    return out


def _repeats(steps: list) -> bool:
    """Whether two records that follow each other share a step (C-speed scan)."""
    return any(map(operator.eq, steps[:-1], steps[1:]))


def _merge_runs(batch: Batch) -> Batch:
    """``batch`` with each run of records of one step merged into one."""
    steps, aggregated = batch.steps, batch.aggregated
    out_steps: list[int | None] = []
    out_stamps: list[Any] = []
    out_metrics: list[dict[str, Any]] = []
    out_agg: list[dict[str, Any]] = []
    for i, step in enumerate(steps):
        if out_steps and step is not None and step == out_steps[-1]:
            out_metrics[-1] = {**out_metrics[-1], **batch.metrics[i]}
            if aggregated is not None:
                out_agg[-1] = {**out_agg[-1], **aggregated[i]}
            continue
        out_steps.append(step)
        out_stamps.append(batch.stamps[i])
        out_metrics.append(batch.metrics[i])
        if aggregated is not None:
            out_agg.append(aggregated[i])
    out = Batch(
        out_steps,
        out_stamps,
        out_metrics,
        out_agg if aggregated is not None else None,
        None,
        batch.process_index,
    )
    out.finite, out.run_id = batch.finite, batch.run_id
    return out


def _hold_last(batch: Batch | None, seconds: float) -> tuple:
    """(the batch's last record, held back while younger than ``seconds``, or
    None; the rest of the batch, or None when nothing is left)."""
    if batch is None or batch.steps[-1] is None:
        return None, batch
    stamp = batch.stamps[-1]
    if stamp is None or not 0 <= time.time() - stamp < seconds:
        return None, batch  # old, or a time of the caller's own (in the future)
    k = len(batch.steps) - 1
    last = _slice(batch, k, k + 1)
    return last, (_slice(batch, 0, k) if k else None)


def _slice(batch: Batch, a: int, b: int) -> Batch:
    uniform = batch.uniform()
    if uniform is not None and batch.aggregated is None:
        out = Batch.of_rows(
            batch.steps[a:b],
            batch.stamps[a:b],
            uniform[0],
            uniform[1][a:b],
            batch.process_index,
        )
        out.finite, out.run_id = batch.finite, batch.run_id
        return out
    out = Batch(
        batch.steps[a:b],
        batch.stamps[a:b],
        batch.metrics[a:b],
        None if batch.aggregated is None else batch.aggregated[a:b],
        None,
        batch.process_index,
    )
    out.finite, out.run_id = batch.finite, batch.run_id
    return out
