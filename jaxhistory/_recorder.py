"""Recorder: what a History does with each update, under one lock.

It parses the update into a :class:`~jaxhistory._row.Row`, completes it
(progress), reduces it across devices and processes (:class:`JobSync`), appends
it to the newest state (:class:`~jaxhistory._history_state.Appender`) with the
values attached meanwhile (:class:`~jaxhistory._side_values.SideValues`), queues
it for the log and the sinks (:class:`~jaxhistory._run_log.RunLog`), runs the
sentinels and formats the summary line. :class:`~jaxhistory.History` holds the
options, the outputs and the documentation; this holds the run while it runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxhistory import _trace_state
from jaxhistory._compiled import speedups
from jaxhistory._distributed import is_per_device, mesh_of
from jaxhistory._history_state import Appender, HistoryState
from jaxhistory._host_copies import host_copies
from jaxhistory._job import JobSync
from jaxhistory._progress import Progress
from jaxhistory._row import Row, RowKind, owned, parse_row, queued
from jaxhistory._run_log import RunLog
from jaxhistory._side_values import SideValues
from jaxhistory._stats import Stats
from jaxhistory._summary import SummaryLine
from jaxhistory._table import STAGE
from jaxhistory._writer import WriterClosed, logger, warn_quietly
from jaxhistory.sentinels import Guard, SentinelError

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["Finished", "Recorder"]

_FINITE = RowKind.FINITE_FLOATS
# what the compiled update takes besides the recorder (see _speedups.c)
_COMPILED = (Row, _FINITE, STAGE, time.time, _trace_state.active, WriterClosed)


class Finished:
    """What a run's outputs are written from (:meth:`Recorder.finish`): the
    state, the streamed log where complete, each step's wall time and the
    sentinels' events."""

    __slots__ = ("events", "stamps", "state", "streamed")

    def __init__(self, state: HistoryState, streamed, stamps: dict, events: list):
        self.state, self.streamed = state, streamed
        self.stamps, self.events = stamps, events


class Recorder:
    """Records a run's updates (see the module docstring). Every method may be
    called from any thread: one lock orders updates, ``flush`` and ``close``
    (``attach`` takes only the side values' own lock)."""

    def __init__(
        self,
        rec: Appender,
        out: RunLog,
        job: JobSync,
        side: SideValues,
        line: SummaryLine,
        progress: Progress | None,
        guard: Guard | None,
        log_every: int,
        distributed_history: bool,
    ):
        self.lock = threading.Lock()
        self.rec, self.out, self.job, self.side = rec, out, job, side
        self.line, self.progress, self.guard = line, progress, guard
        self.log_every = log_every
        self.distributed_history = distributed_history
        # the mesh of the per-device metrics, once one is seen
        self.mesh: Mesh | None = None
        self.updates = 0
        self.pending_found: list = []  # sentinel events of rows reduced in a batch

    def update(self, metrics: Any, precision: int, step: Any, summarize: bool) -> str:
        """:meth:`History.update <jaxhistory.History.update>`, its arguments
        checked."""
        if type(metrics) is Stats:  # one packed row, as HistoryState.update
            metrics = {"": metrics}
        if speedups is not None:
            # The common case below (a repeated dict of finite floats, nothing
            # else due), compiled whole; NotImplemented: nothing done.
            row = speedups.update(self, metrics, step, _COMPILED)
            if row is not NotImplemented:
                if not summarize or row[0] % self.log_every:
                    return ""
                return self.line.format_floats(row, precision)
        with self.lock:
            now = time.time()
            out = self.out
            logged = out.writing or _trace_state.active() is not None
            # A dict like the last one, of finite floats, with nothing else due:
            # parsed and appended in one call, then queued for the log as a
            # copy (see _row.queued: one the garbage collector does not track).
            # From the take on, a Ctrl-C may land after the row went into the
            # history and before its line is queued: finalize then writes the
            # log from the history.
            rec = self.rec
            try:
                if speedups is None:
                    row = rec.take(metrics, now, step)
                else:  # the same, compiled; NotImplemented: left to take
                    row = speedups.take(rec, metrics, now, step, Row, _FINITE, STAGE)
                    if row is NotImplemented:
                        row = rec.take(metrics, now, step)
                fast = row is not None and not self.side.due and self.guard is None
                if fast:
                    self.updates += 1
                    out.stamp_steps.append(row.step)
                    out.stamp_times.append(now)
                    if logged:
                        if speedups is None:
                            item = queued(row, metrics)
                        else:  # the same, compiled
                            item = speedups.queued(metrics, len(row[1]), row[0], row[4])
                        writer = out.writer
                        if writer is None:
                            out.add(item)  # (starts the writer)
                        else:
                            try:
                                if speedups is None:
                                    writer.add(item)
                                else:  # the same, compiled
                                    speedups.add(writer, item, WriterClosed)
                            except WriterClosed:  # a close a Ctrl-C cut short:
                                out.add(item)  # completed first
            except BaseException:  # Ctrl-C: maybe recorded, maybe not queued
                out.failed = True  # finalize writes the log from the state
                raise
            if fast:
                assert row is not None  # (fast says so)
                if not summarize or row.step % self.log_every:
                    return ""
                line = self.line.format_floats  # (out of the lock)
            else:
                row, token, found = self._update_locked(
                    row, metrics, step, now, summarize
                )
                line = None
        if line is not None:
            return line(row, precision)
        if found:
            self._act(found)
        if not summarize or row.step % self.log_every:
            return ""
        text = self.line.format(row, precision)
        return f"{text} {token}" if token else text

    def _update_locked(
        self, row: Row | None, metrics: Any, step: Any, now: float, summarize: bool
    ) -> tuple[Row, str, list | None]:
        """:meth:`update` under the lock, for everything but a repeated dict of
        floats with nothing else due: records ``metrics`` (``row``: recorded
        already), its side values, logs it and runs the sentinels. Returns the
        row, the memory token and the sentinels' events."""
        recorded = row
        try:
            if recorded is None:
                recorded = self._recorded(metrics, step, now, summarize)
            token = self._logged(recorded, now)
        except BaseException as err:
            # The row is in the history: where this stopped before it was
            # queued (Ctrl-C, which may also land just after the row went in;
            # the log cannot be opened), the log lacks it, and finalize writes
            # the log again from the history. (Bad input: nothing recorded.)
            if recorded is not None or not isinstance(err, Exception):
                self.out.failed = True
            raise
        row = recorded
        found = self._checked(row) if self.guard is not None else None
        if self.pending_found:  # from earlier rows reduced in a batch
            found = [*self.pending_found, *(found or [])]
            self.pending_found = []
        if self.job.reduce_host:
            self._same_everywhere()
        return row, token, found

    def _logged(self, row: Row, now: float) -> str:
        """Stamps the recorded ``row``, records its side values and queues its
        log line (the caller holds the lock). Returns the memory token."""
        self.updates += 1
        out = self.out
        out.stamp(row.step, now)
        token, logged = "", row
        if self.side.due:
            rec = self.rec
            state, token, side, earlier = self.side.at_update(
                rec.state, row.step, self.updates
            )
            rec.set(state)
            self._emit(earlier)
            if side:
                names, values = zip(*side, strict=True)
                logged = row._replace(
                    names=row.names + names,
                    values=row.values + values,
                    kind=RowKind.VALUES,
                )
        if out.writing or _trace_state.active() is not None:
            out.add(logged)
        return token

    def _recorded(self, metrics: Any, step: Any, now: float, summarize: bool) -> Row:
        """Parses, completes (progress), reduces and records one update (the
        caller holds the lock)."""
        rec, job = self.rec, self.job
        row = parse_row(metrics, step, rec.next_step, now)
        copied = row.kind is RowKind.VALUES
        if copied:
            # the log and the sentinels read it later; the history keeps the
            # same copies (one copy of an array in all)
            row = owned(row)
        if job.watching:
            job.beat(row.step)  # before the reduction, which may wait
        if self.progress is not None:
            row = self.progress.add(row, self.log_every)
        if self.distributed_history and (
            job.reduce_host
            or (row.kind is RowKind.VALUES and any(map(is_per_device, row.values)))
        ):
            row, earlier, mesh = job.reducer.reduced_row(row, self.log_every, summarize)
            if mesh is not None and self.mesh is None:
                self.mesh = mesh
            if earlier:
                self._record_reduced(earlier)
        rec.append(row, copied)
        if self.progress is None and job.plain:
            rec.remember(metrics, row)  # the next dict like it takes rec.take
        if job.reduce_host:
            self._record_scores(job.scores())
        if row.kind is RowKind.VALUES and self.mesh is None:
            self.mesh = mesh_of(row.values)
        return row

    def post_row(self, row: Row) -> None:
        """Writes a row of a hang report to the log, from the watch's thread.
        The recording thread may be the one waiting (holding the lock): the
        row goes straight to the log's writer, which takes rows from any
        thread; before the log has started, only if the lock comes free."""
        writer = self.out.writer
        if writer is not None:
            with contextlib.suppress(ValueError):  # closed meanwhile
                writer.add(row)
                return
        if self.lock.acquire(timeout=1.0):
            try:
                if self.out.writing:
                    self.out.add(row)
            finally:
                self.lock.release()

    def _checked(self, row: Row | None, wait: bool = False) -> list:
        """Runs the sentinels on ``row`` (and on earlier device rows now on the
        host) and records their counts (the caller holds the lock)."""
        guard = self.guard
        assert guard is not None  # called only with sentinels
        found = guard.ready(wait) if guard.pending else []
        if row is None:
            pass
        elif row.kind is not RowKind.VALUES:
            finite = row.kind is RowKind.FINITE_FLOATS
            found += guard.host_row(row.step, row.names, row.values, finite)
        else:
            guard.device_row(row.step, row.names, row.values)
            if wait:
                found += guard.ready(wait)
        if found:
            rows = []
            for step, name, total in guard.counted(found):
                state = self.rec.state
                if name in state:  # each metric's steps increase
                    step = max(step, int(state.steps(name)[-1]) + 1)
                self.rec.append(Row(step, (name,), (total,), RowKind.FINITE_FLOATS))
                rows.append((step, [(name, total)]))
            self._emit(rows)
        return found

    def _record_reduced(self, rows: list[Row]) -> None:
        """Records, logs and checks rows of earlier updates reduced in a batch
        (the caller holds the lock)."""
        if self.guard is None:
            self.rec.append_rows(rows)
        else:
            for r in rows:
                self.rec.append(r)
                self.pending_found += self._checked(r)
        self._emit([(r.step, list(zip(r.names, r.values, strict=True))) for r in rows])

    def _finish_batch(self) -> None:
        """Records what the batches still waiting give (every process calls
        this at the same point: close and finish; the caller holds the lock)."""
        rows = self.job.finish_batch(self.log_every)
        if rows:
            self._record_reduced(rows)
            self._record_scores(self.job.scores())
        self.job.raise_batch_error()

    def _record_scores(self, rows: list) -> None:
        """Records and logs straggler score rows (the caller holds the lock)."""
        emitted = []
        for step, values in rows:
            names, vals = tuple(values), tuple(values.values())
            self.rec.append(Row(step, names, vals, RowKind.VALUES))
            emitted.append((step, list(values.items())))
        self._emit(emitted)

    def _same_everywhere(self, wait_all: bool = False) -> None:
        """Raises ValueError (after the log has the step's line) when a value
        recorded as it is differed across processes (the caller holds the
        lock)."""
        try:
            self.job.check_same(wait_all)
        except ValueError:
            self._write_log()
            raise

    def _act(self, found: list, bounded: bool = False) -> None:
        """Warns, calls back, or raises for the sentinels' events (not under the
        lock: a callback may record); a callback or a raise once the step's
        line is in the log (a callback may hang, or end the process).
        ``bounded``: at finalize, callbacks are waited for a bounded time."""
        guard = self.guard
        assert guard is not None  # events come only from sentinels
        if guard.calls(found):
            self._write_log()
        error = guard.act(found, bounded)
        if error is not None:
            self._write_log()
            raise error

    def _write_log(self) -> None:
        writer = self.out.writer
        if writer is not None:
            writer.flush()

    def _record_leftover(self, with_step_only: bool = False) -> None:
        """Records the values still attached (the caller holds the lock)."""
        state, recorded = self.side.leftover(self.rec.state, with_step_only)
        self.rec.set(state)
        self._emit(recorded)

    def _emit(self, rows: list) -> None:
        """Queues log lines of ``(step, pairs)`` recorded apart from an update."""
        out = self.out
        if rows and (out.writing or _trace_state.active() is not None):
            now = time.time()
            for step, pairs in rows:
                names, values = zip(*pairs, strict=True)
                out.add(Row(step, names, values, RowKind.VALUES, now))

    @property
    def state(self) -> HistoryState:
        with self.lock:
            return self.rec.state

    @state.setter
    def state(self, state: HistoryState) -> None:
        with self.lock:
            self.rec.set(state)

    def flush(self, bounded: bool = False) -> None:
        """:meth:`History.flush <jaxhistory.History.flush>` (``bounded``: at
        finalize, the sentinels' callbacks are waited for a bounded time)."""
        with self.lock:
            self._record_leftover(with_step_only=True)
            if self.job.reduce_host:  # every process flushes: reads line up
                self._same_everywhere(wait_all=True)
                self._record_scores(self.job.scores(wait_all=True))
            found = self._checked(None, wait=True) if self.guard else None
            writer, feed = self.out.flush()
        if writer is not None:
            writer.flush()
        if feed is not None:  # waits a bounded time; warns naming a stuck sink
            feed.flush()
        if found:
            self._act(found, bounded)

    def close(self) -> None:
        """:meth:`History.close <jaxhistory.History.close>`."""
        failed = None
        with self.lock:
            try:
                self._finish_batch()
            except Exception as err:  # raised once the log and sinks are closed
                failed = err
        try:
            with self.lock:
                self._record_leftover()
                feed = self.out.close()
        finally:
            # Stopped once the last batch is in and the log has every value
            # (or closing it raised): while either waits, the watch names a
            # process that never gets there (or closed before) and answers
            # one whose names changed.
            self.job.stop_watch()
        host_copies.send()  # device scalars left waiting: none stays behind
        if feed is not None:
            # Not under the lock: a sink that records or closes from its write
            # must not wait on it. Bounded; a stuck sink gets a warning.
            feed.close()
        if failed is not None:
            raise failed

    def rewritten(self, path: Path) -> None:
        """Finalize wrote the log at ``path`` again from the history (the
        streamed one had failed), in place of the file the run still writes:
        later lines are appended to the new file."""
        with self.lock:
            log = self.out.log
            if log is None:  # closed: a later update opens the file at its path
                self.out.adopt(path)
                return
            with contextlib.suppress(OSError):
                if os.path.samefile(log.path, path):
                    log.follow()

    def finish(self) -> Finished:
        """Ends the run's recording for :meth:`History.finalize
        <jaxhistory.History.finalize>` (collective with several processes):
        stops the hang watch, reduces what waits in batches, flushes, and
        returns what the outputs are written from. A value that differed
        across processes and a sentinel's raise become warnings here: the
        run is over and its outputs still come. So do warnings, which go to
        the ``jaxhistory`` logger where the filters make them errors."""
        try:
            if self.job.reduce_host:
                with self.lock:
                    self._finish_batch()
                    self._same_everywhere(wait_all=True)
        except ValueError as err:
            warn_quietly(str(err), stacklevel=3)
        except BaseException:
            self.job.stop_watch()
            raise
        # After the last batch, as in close, and once the last reduction is
        # done: the outputs read every value, so a wait for it comes anyway.
        self.job.stop_watch(settle=True)
        try:
            self.flush(bounded=True)
        except SentinelError as err:
            warn_quietly(f"sentinel at finalize: {err}", stacklevel=3)
        except Warning as err:  # a "warn" sentinel's, made an error (-W error)
            logger.warning("%s", err)
        guard = self.guard
        if guard is not None:
            for sentinel in guard.unmatched():
                warn_quietly(
                    f"{sentinel!r} matched no recorded metric (metrics are named "
                    f"like {', '.join(map(repr, self.state.keys[:3]))})",
                    stacklevel=3,
                )
        with self.lock:
            self._record_leftover()
            writer = self.out.writer
        if writer is not None:
            writer.flush()
        with self.lock:
            state = self.rec.state
            self.out.check_failed()
            # The streamed log stays where it is (also after close()); one whose
            # writing failed is written again from the state.
            streamed = self.out.streamed_path()
            stamps = self.out.timestamps(state.all_steps())
        events = list(guard.events) if guard is not None else []
        return Finished(state, streamed, stamps, events)
