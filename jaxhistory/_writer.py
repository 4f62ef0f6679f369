"""Writer: the background thread that writes History's JSONL log and feeds the
trace handler and the user's sinks.

:class:`~jaxhistory.History` queues each update here (device values as they are:
nothing waits in the training loop); the thread turns queued updates into host
values once they are ready and writes them, in order, to its own ``sinks``
(History's JSONL log), then to an active Chrome trace handler, then queues them
for the user's sinks on a :class:`~jaxhistory.sinks._feed.SinkFeed`, which
writes each from a thread of its own: the thread never waits for a user's sink,
so one that is slow or hangs costs the log nothing.

How far behind it may fall is bounded. The thread writes at least every
:attr:`Writer.INTERVAL` seconds, and as soon as :attr:`Writer.WAKE_AT` updates are
queued. When :attr:`Writer.MAX_PENDING` updates are queued the training thread
waits (back-pressure) until the thread has taken them, so the log on disk stays a
fraction of a second behind even a loop that does nothing but record (the latest
step's record aside: see below). A log that hangs (a stuck file system) cannot
stop the training: after :attr:`Writer.MAX_WAIT` seconds of waiting the oldest
queued updates are dropped from the log (never from the history), with one
warning, and :attr:`Writer.dropped` counts them.

One line per step: records of the same step that follow each other (an update,
then a timing or an evaluation of that step) are merged into one record, the
later value winning. The thread holds the latest step's record until a record of
another step arrives, :meth:`Writer.flush` or :meth:`Writer.close` is called, or
it is :attr:`Writer.HOLD` seconds old; a record of that step arriving later
still gets a line of its own (readers merge them, the later value winning).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import operator
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxhistory import _trace_state
from jaxhistory._names import PROVENANCE, grouped, stat_names
from jaxhistory._record import Batch
from jaxhistory._stats import Stats

__all__ = ["Writer"]


def _host(value: Any) -> Any:
    """A recorded value on the host: Python numbers stay, 0-d arrays become Python
    numbers, arrays NumPy arrays (this is where device values are waited for)."""
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item() if arr.dtype.kind in "biuf" else float(arr)
    return arr


def _on_host(stats: Stats, values: list) -> Stats:
    """``stats`` rebuilt from the host ``values`` read from it (stat-major)."""
    rows, k = np.shape(stats.table)[0], len(stats.names)
    table = np.asarray(values[: rows * k], np.float64).reshape(rows, k)
    where = None
    if stats.where is not None:
        where = np.asarray(values[rows * k :], np.int64).reshape(-1, k)
    return Stats(stats.names, table, where)


class Writer:
    """Writes queued updates to ``sinks`` from a background thread, then queues
    them on ``feed`` (the user's sinks: anything with ``put(batch)``, never
    waited for).

    ``add`` is the only call on the training thread's path; ``flush`` writes what
    is queued now (from any thread), ``close`` writes the rest and stops the
    thread (the sinks and the feed stay open: they belong to the caller).
    """

    INTERVAL = 0.2  # seconds between writes when few updates are queued
    WAKE_AT = 2048  # queued updates that wake the thread at once
    MAX_PENDING = 8192  # queued updates at which the training thread waits
    MAX_WAIT = 10.0  # seconds it waits at most before updates are dropped
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
        # called as on_stats(step, stats, prefix) with each Stats on the host
        self.on_stats = on_stats
        self.process_index = jax.process_index()
        self.dropped = 0  # updates dropped from the log because it could not keep up
        # The queue, as parallel lists (see add)
        self._queue: list = []  # step, timestamp, metrics, stats, host, step, ...
        self._lock = threading.Lock()  # add() against close()
        self._drain_lock = threading.Lock()  # one drain at a time, in order
        self._space = threading.Condition()
        self._wake = threading.Event()
        self._closed = False
        self._warned: set[Any] = set()
        self._held: Batch | None = None  # the latest step's record, not yet written
        self._thread = threading.Thread(
            target=self._run, name="jaxhistory-writer", daemon=True
        )
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (w := ref()) and w.close())
        _trace_state.register_stream(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def add(
        self,
        step: int | None,
        timestamp: float,
        metrics: dict[str, Any],
        stats: tuple = (),
        host: bool = False,
    ) -> None:
        """Queues one update: ``metrics`` maps names to values (the writer keeps
        the dict: pass one nobody changes later); ``stats`` holds ``(prefix,
        Stats)`` pairs, written as aggregated ``{prefix}{name}/{stat}`` values;
        ``host``: true when every value is a Python number (nothing to
        convert), 3 when every one is a finite float (nothing to check either).
        Raises ValueError after :meth:`close`."""
        lock = self._lock
        lock.acquire()
        if self._closed:
            lock.release()
            raise ValueError("the writer is closed")
        # One flat list, not a tuple per update: nothing new for the garbage
        # collector to track while updates wait.
        queue = self._queue
        queue.append(step)
        queue.append(timestamp)
        queue.append(metrics)
        queue.append(stats)
        queue.append(host)
        n = len(queue)
        lock.release()
        if n >= 5 * self.WAKE_AT:
            self._backpressure()

    def pending(self) -> int:
        """Updates queued and not yet taken by the thread."""
        return len(self._queue) // 5

    def _backpressure(self) -> None:
        if not self._wake.is_set():
            self._wake.set()
        if self.pending() < self.MAX_PENDING:
            return
        deadline = time.monotonic() + self.MAX_WAIT
        with self._space:
            while self.pending() >= self.MAX_PENDING and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    self._drop(self.pending() - self.MAX_PENDING // 2)
                    return
                self._space.wait(min(left, 0.05))

    def _take(self, k: int | None = None) -> tuple[list, ...]:
        """Removes the first ``k`` (all) queued updates; returns their steps,
        timestamps, metrics, stats and host flags as five lists."""
        with self._lock:
            if k is None or 5 * k >= len(self._queue):
                taken, self._queue = self._queue, []
            else:
                taken = self._queue[: 5 * k]
                del self._queue[: 5 * k]
        return tuple(taken[i::5] for i in range(5))

    def _drop(self, k: int) -> None:
        dropped = len(self._take(k)[0])
        self.dropped += dropped
        self._warn_once(
            "dropped",
            f"the JSONL log fell {self.MAX_WAIT:.0f} s behind; {dropped} queued "
            "update(s) were not written to it (the history keeps every one, and "
            "finalize writes the log again from it)",
        )

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.INTERVAL)
            self._wake.clear()
            try:
                self._drain(hold=True)
            except Exception as err:  # never let the thread die
                self._warn_once("thread", f"writing failed: {err!r}")

    def flush(self) -> None:
        """Writes every queued update now (waiting for its device values), the
        latest step's record too, and flushes the sinks."""
        self._drain(hold=False)

    def _drain(self, hold: bool) -> None:
        with self._drain_lock:
            steps, stamps, metrics, stats, hosts = self._take()
            with self._space:
                self._space.notify_all()
            held, self._held = self._held, None
            if not steps and held is None:
                return
            batch = (
                self._resolve(steps, stamps, metrics, stats, hosts) if steps else None
            )
            batch = _merged(held, batch)
            if hold:
                self._held, batch = _hold_last(batch, self.HOLD)
            if batch is not None:
                self._fan_out(batch)

    def _resolve(self, steps, stamps, metrics, stats, hosts) -> Batch:
        """The queued updates with their values on the host (this waits for
        device values) and their statistics as aggregated values."""
        lost: list[str] = []
        aggregated = None
        if not all(hosts):
            metrics = [
                m if host else self._host_values(step, m, lost)
                for step, m, host in zip(steps, metrics, hosts, strict=True)
            ]
        if any(stats):
            aggregated = [
                self._stats_values(step, s, lost) if s else {}
                for step, s in zip(steps, stats, strict=True)
            ]
        if lost:
            shown = "; ".join(lost[:5]) + (
                f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            )
            warnings.warn(
                f"device values could not be read and are written as NaN (0 for "
                f"integers), as the history stores them: {shown}",
                RuntimeWarning,
                stacklevel=3,
            )
        batch = Batch(steps, stamps, metrics, aggregated, None, self.process_index)
        batch.finite = hosts.count(3) == len(hosts)
        batch.run_id = self.run_id
        return batch

    @staticmethod
    def _host_values(step, metrics: dict, lost: list[str]) -> dict:
        out = {}
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
            names = stat_names(s.names, prefix)
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
            self._warn_once(id(sink), f"sink {type(sink).__name__} failed: {err!r}")

    def _warn_once(self, key: Any, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """Writes what is queued and stops the thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        with self._space:
            self._space.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()


def _merged(held: Batch | None, batch: Batch | None) -> Batch | None:
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
    out_steps, out_stamps, out_metrics, out_agg = [], [], [], []
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
