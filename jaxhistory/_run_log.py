"""RunLog: where History's rows go after the history: the JSONL log streamed
during the run and the user's sinks, through the one background
:class:`~jaxhistory._writer.Writer`, and the wall time of every update."""

from __future__ import annotations

import array
import os
import weakref
from pathlib import Path
from typing import Any

import jax

from jaxhistory import _trace_state
from jaxhistory._codec import line_run_id, line_step, read_stamps
from jaxhistory._fan_out import FanOut
from jaxhistory._files import (
    NotAFile,
    atomic_write,
    check_target,
    in_use,
    open_log,
    read_regular,
)
from jaxhistory._names import printable
from jaxhistory._row import Row
from jaxhistory._writer import Writer, warn_quietly
from jaxhistory.sinks._feed import SinkFeed
from jaxhistory.sinks._jsonl import JsonlSink

__all__ = ["RunLog", "log_target", "set_aside"]


def log_target(
    jsonl_path: Path | None, report_dir: Path | None, run_id: str
) -> Path | None:
    """Where this process streams its JSONL log, or None.

    ``jsonl_path`` if given (each process writes its own file when the path
    holds ``{process_index}``, else only process 0 writes), else
    ``{report_dir}/{run_id}.jsonl`` on process 0 when ``report_dir`` is given.
    """
    index = jax.process_index()
    if jsonl_path is not None:
        text = str(jsonl_path)
        if "{process_index}" in text:
            return Path(text.replace("{process_index}", str(index)))
        return jsonl_path if index == 0 else None
    if report_dir is not None and index == 0:
        return report_dir / f"{run_id}.jsonl"
    return None


def set_aside(log: Path, step: int, run_id: str | None = None) -> Path | None:
    """Moves the lines of ``log`` at ``step`` and later (the attempt that a
    resume at ``step`` abandons) to ``{log}.from-step-{step}`` beside it, whole
    and in their order (appended where that file exists, as after a second
    restart at one step); ``log`` keeps the rest, so that it holds what the
    resumed run's dataset holds. With ``run_id``, only lines of that run (or
    of none: an older log's) move; another run's lines in the log stay.
    Returns that file, or None where no line was moved. A log that is a
    link, not a file or in use is left as it is; one that cannot be read or
    written is left with a warning."""
    if os.path.islink(log) or not os.path.isfile(log) or in_use(log):
        return None
    aside = log.with_name(f"{log.name}.from-step-{step}")
    try:
        data = read_regular(log)
        kept: list[bytes] = []
        moved: list[bytes] = []
        for line in data.splitlines(keepends=True):
            at = line_step(line)
            ours = run_id is None or line_run_id(line) in (run_id, None)
            (moved if at is not None and at >= step and ours else kept).append(line)
        if not moved:
            return None
        with open_log(aside) as f:  # (a link there is refused)
            f.write(b"".join(moved))
        atomic_write(log, lambda tmp: tmp.write_bytes(b"".join(kept)))
    except OSError as err:
        warn_quietly(
            f"could not set aside the lines of {printable(log)} from step {step} on "
            f"({err}); the log keeps them, and its readers show them"
        )
        return None
    return aside


class RunLog:
    """History's JSONL log (at ``path``, None: none) and its sinks.

    The log is opened, and the writer thread started, by the first row that
    needs them. ``on_stats`` sees each :class:`~jaxhistory.Stats` on the host
    (History's non-finite watch). Not thread-safe on its own: History calls it
    under its lock.
    """

    def __init__(
        self,
        path: Path | None,
        overwrite: bool,
        run_id: str,
        sinks: tuple,
        on_stats: Any,
    ):
        if path is not None:
            try:
                check_target(path)  # a link, a folder, a device: refused now
            except NotAFile:
                raise
            except OSError:
                pass  # cannot be looked at now: the first row warns, and
                # recording goes on
        if path is not None and in_use(path):
            raise ValueError(
                f"the JSONL log {printable(path)} is being written by another live "
                "History or sink; two runs must not share one log (give this one "
                "its own jsonl_path, or close the other first: a History holds its "
                "log until close(), also after finalize(), which later updates "
                "append to)"
            )
        self.path, self.overwrite, self.run_id = path, overwrite, run_id
        # a folder that is no link now: one put in its place later is refused
        self.folder_was_link = path is not None and path.parent.is_symlink()
        self.sinks, self.on_stats = sinks, on_stats
        self.sinks_open = True  # False after close(): nothing more is written
        # the user's sinks, each written from a thread of its own (started
        # now): a slow or hung sink never holds the log back
        self.feed = SinkFeed(sinks) if sinks else None
        self.writer: Writer | None = None
        self.log: JsonlSink | None = None
        self._finalizer: weakref.finalize | None = None
        self.streamed = False  # a log was opened at path
        # (device, inode, size) of the log file last written: a log opened
        # again (after close) or read by finalize must still be that file
        # (an inode may be reused: a new file is told apart by its size)
        self.identity: tuple[int, int, int] | None = None
        self.failed = False  # then finalize writes it again from the state
        # Whether rows go to the writer (a log or open sinks; an active trace
        # handler is checked apart): one flag on the hot path.
        self.writing = path is not None or bool(sinks)
        # (step, wall time) per update, in arrays: no objects for the GC to scan
        self.stamp_steps = array.array("q")
        self.stamp_times = array.array("d")

    def add(self, row: Row | dict) -> None:
        """Queues ``row`` (or the dict :func:`~jaxhistory._row.queued` made of
        it) for the log and the sinks."""
        writer = self.writer
        if writer is not None and writer.closed:
            # A close() that a Ctrl-C cut short (History.close interrupted,
            # the user's loop going on): it is completed, and a new writer
            # appends to the log, as after a close that ran to its end.
            self._end_writer()
            writer = None
        if writer is None:
            self._start()
            writer = self.writer
            assert writer is not None  # _start made one
        writer.add(row)

    def live_feed(self) -> SinkFeed | None:
        return self.feed if self.sinks_open and self.sinks else None

    def _start(self) -> None:
        if self.path is not None and self.log is None:
            try:
                # (a folder that was no link at the start: one swapped in
                # since is refused, in the same step as the open)
                self.log = JsonlSink(
                    self.path,
                    overwrite=self.overwrite,
                    real_folder=not self.folder_was_link,
                )
                now = self.log.identity()
                if (
                    self.streamed
                    and not self.failed
                    and not _same_file(self.identity, now)
                ):
                    self._deleted("a new one is started there, and ")
                self.identity = now
                self.streamed = True
            except OSError as err:  # the step is recorded; only the log stops
                path, self.path = self.path, None
                self.failed = True
                self.writing = self.live_feed() is not None
                # (-W error: to the logger, never into the training thread)
                warn_quietly(
                    f"cannot write the JSONL log {printable(path)} ({err}); finalize "
                    "will write it from the history instead",
                    stacklevel=5,
                )
        feed = self.live_feed()
        sinks = [self.log] if self.log is not None else []
        fan_out = FanOut(sinks, self.on_stats, run_id=self.run_id, feed=feed)
        self.writer = Writer(
            fan_out,
            what="the JSONL log",
            kept=" (the history keeps every one, and finalize writes the log again "
            "from it)",
        )
        _trace_state.register_stream(self.writer)
        # Writes what is queued when this log goes (or at exit), closes the
        # log file, and hands the rest to the sinks, whose threads then close
        # them and end. (Detached by close(): one per open log.)
        self._finalizer = weakref.finalize(
            self, _close_quietly, self.writer, self.log, feed
        )

    def flush(self) -> tuple[Writer | None, SinkFeed | None]:
        """The writer and the feed to flush (outside the caller's lock)."""
        return self.writer, self.live_feed()

    def close(self) -> SinkFeed | None:
        """Writes what is queued and closes the log; returns the sinks' feed to
        close (outside the caller's lock) the first time."""
        self._end_writer()
        feed = None
        if self.sinks_open:
            feed, self.sinks_open = self.feed, False
        self.writing = self.path is not None
        return feed

    def _end_writer(self) -> None:
        """Writes what is queued, stops the writer and closes the log file."""
        if self._finalizer is not None:  # (closed here: nothing left for it)
            self._finalizer.detach()
            self._finalizer = None
        if self.writer is not None:
            self.writer.close()
            self.failed |= bool(self.writer.dropped) or self.writer.broken
            self.writer = None
        if self.log is not None:
            self.identity = self.log.identity() or self.identity
            self.log.close()
            self.failed |= self.log.error is not None
            self.log = None
            self.overwrite = False  # a later update appends

    def check_failed(self) -> None:
        """Notes a failed write or dropped lines (finalize then writes the log
        again from the history)."""
        if self.log is not None and self.log.error is not None:
            self.failed = True
        if self.writer is not None and (self.writer.dropped or self.writer.broken):
            self.failed = True
        path = self.path
        if self.streamed and not self.failed and path is not None:
            # Deleted after its last write (no later write noticed it): the
            # streamed log is gone, and finalize writes it again.
            ours = self.log.identity() if self.log is not None else None
            if not _same_file(ours or self.identity, _identity(path)):
                self._deleted("")

    def adopt(self, path: Path) -> None:
        """Finalize wrote the (closed) log again at ``path``: the file a later
        update opens there is this run's log, not a new one."""
        self.identity = _identity(path)

    def _deleted(self, then: str) -> None:
        """The log was deleted while this run wrote it (or between a close
        and the next update): finalize writes it again from the history."""
        self.failed = True
        warn_quietly(
            f"JSONL log {printable(self.path)} was deleted or cut short during "
            f"the run; {then}finalize writes the whole log again from the history",
            stacklevel=5,
        )

    def streamed_path(self) -> Path | None:
        """The log streamed during the run, where it is complete."""
        return self.path if self.streamed and not self.failed else None

    def stamp(self, step: int, now: float) -> None:
        self.stamp_steps.append(step)  # 16 bytes an update
        self.stamp_times.append(now)

    def timestamps(self, all_steps: Any) -> dict[int, float]:
        """Step -> wall time of the updates (the first at a step), for the
        dataset's time coordinate and a log written from the state; the log's
        times for steps this run did not record (a resumed run's)."""
        steps, times = self.stamp_steps, self.stamp_times
        n = min(len(steps), len(times))  # (Ctrl-C between the two appends)
        stamps = dict(zip(reversed(steps[:n]), reversed(times[:n]), strict=True))
        path = self.path
        if (
            path is not None
            and path.is_file()
            and not stamps.keys() >= set(all_steps.tolist())
        ):
            for step, stamp in read_stamps(path).items():
                stamps.setdefault(step, stamp)
        return stamps


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(device, inode, size) of the file at ``path`` (a link not followed), or
    None."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def _same_file(then: tuple | None, now: tuple | None) -> bool:
    """Whether ``now`` is the log file ``then`` was, with nothing cut off."""
    if then is None or now is None:
        return then is None
    return then[:2] == now[:2] and now[2] >= then[2]


def _close_quietly(
    writer: Writer, log: JsonlSink | None, feed: SinkFeed | None
) -> None:
    """Closes ``writer`` (what is queued for the log), the ``log`` file, and
    then ``feed`` (the sinks, bounded by :attr:`SinkFeed.TIMEOUT`) for a log
    dropped, or alive at exit, without :meth:`RunLog.close`."""
    writer.close()
    if log is not None:
        log.close()
    if feed is not None:
        feed.close()
