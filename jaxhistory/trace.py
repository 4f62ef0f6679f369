"""Chrome traces (Trace Event Format, JSON) viewable in Perfetto and chrome://tracing.

:class:`JSONTraceHandler` streams events to ``{folder}/{filename}`` while it is
active: ``X`` complete events for :class:`~jaxhistory.StopWatch` spans (and
:meth:`~JSONTraceHandler.complete`), ``C`` counters for the metrics a
:class:`~jaxhistory.History` records (the loss shows as a track), ``i`` instants
and ``M`` metadata (process and thread names, sort indices, the process index,
and the clock sync). ``pid`` is the JAX process index. :func:`load_trace` reads
complete and truncated files (``.gz`` too); :func:`merge_traces` (and the
``jaxhistory merge-traces`` command) merges traces from several processes onto
one clock.

Examples:
    >>> import tempfile, jaxhistory as jh
    >>> from jaxhistory import trace
    >>> folder = tempfile.mkdtemp()
    >>> with trace.JSONTraceHandler(folder=folder, merged_trace_filename=None) as t:
    ...     with jh.StopWatch("load data"):
    ...         pass
    ...     t.instant("checkpoint saved")
    >>> events = trace.load_trace(t.paths[0])
    >>> sorted({e["ph"] for e in events})
    ['M', 'X', 'i']
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from jaxhistory import _trace_state
from jaxhistory._dtypes import as_flag
from jaxhistory._env import check_run_name, new_run_id
from jaxhistory._files import NotAFile, still_folder
from jaxhistory._trace_file import (
    TraceFile,
    clock_sync,
    counter_values,
    process_metadata,
    sanitize,
    thread_metadata,
)
from jaxhistory._trace_merge import merge_folder, merge_traces
from jaxhistory._trace_names import (
    FOLDER_VARS,
    check_keep,
    check_names,
    file_path,
    named_files,
    prepare_folder,
    ranks,
)
from jaxhistory._trace_read import load_trace
from jaxhistory._writer import Writer, warn_quietly
from jaxhistory.sinks._base import scalars

__all__ = ["JSONTraceHandler", "load_trace", "merge_traces"]


def _check_mapping(what: str, value: Any, none: bool = True) -> None:
    """TypeError naming ``what`` unless ``value`` is a mapping (or None, where
    ``none``): an event's args are a JSON object."""
    if not isinstance(value, Mapping) and not (none and value is None):
        raise TypeError(
            f"{what} must be a mapping (name -> value){' or None' if none else ''}, "
            f"got {type(value).__name__}"
        )


class JSONTraceHandler:
    """Streams Chrome trace events to files while active (a context manager, or
    :meth:`start` / :meth:`close`).

    Args:
        folder: format string of the folder (a str or any ``os.PathLike``,
            such as a ``pathlib.Path``: its text is the format string);
            variables ``{run_name}``, ``{rank}``, ``{local_rank}``,
            ``{world_size}``, ``{local_world_size}``, ``{node_rank}``.
        filename: format string of each trace file (a str or a path, as
            ``folder``); the folder's variables plus
            ``{epoch}``, ``{batch}``, ``{step}`` (given to :meth:`start` and
            :meth:`rotate`). Include ``{rank}`` when several processes share a
            folder. An unknown variable, an absolute path or a ``..`` part is a
            ValueError naming it.
        merged_trace_filename: at :meth:`close`, local rank 0 of each node merges
            every trace file in the folder, and the files named like
            ``filename`` in its subfolders (none below a link), into this file
            (same variables as ``folder``, a name inside it); None to skip.
        overwrite: if False, a folder holding files (hidden ones ignored) is a
            FileExistsError at :meth:`start`. If True, :meth:`start` deletes the
            folder's files named like ``filename`` and ``merged_trace_filename``
            (an earlier run's, of any rank), so none of them is merged into this
            run's trace; other files are left alone.
        num_traces_to_keep: keep only this process's newest N >= 1 finished
            files (-1 keeps all); older ones it wrote are deleted on
            :meth:`rotate`.
        run_name: ``{run_name}``; default ``run-{YYYYmmdd-HHMMSS}``.

    Every process must call :meth:`start` and :meth:`close` (each holds one small
    all-gather in a multi-process run, the barrier the clocks are synced at).
    A file opened by :meth:`rotate` that gets no event before :meth:`close` (the
    file after the last epoch) is deleted there, not left holding only metadata.
    A :class:`~jaxhistory.StopWatch` span still open at :meth:`close` (on any
    thread, also one that ended inside it) is written ending at the close, on
    its thread's track, with ``"open_at_close": true`` in its args.
    Files are JSON arrays written one event per line by the one background
    writer, and flushed at least every ``Writer.INTERVAL`` (0.2) seconds, so a
    file cut off by a crash still loads (:func:`load_trace`, and Perfetto,
    accept a missing ``]``) and holds every span that ended a moment before.
    Times are microseconds on this process's monotonic clock; the clock sync is
    recorded in an ``M`` event named ``clock_sync``.
    """

    all_processes = True  # as a sink: every process traces its own metrics

    def __init__(
        self,
        folder: str | os.PathLike = "{run_name}/traces",
        filename: str | os.PathLike = "ep{epoch}-ba{batch}-rank{rank}.json",
        merged_trace_filename: str | os.PathLike | None = "merged_trace.json",
        overwrite: bool = False,
        num_traces_to_keep: int = -1,
        run_name: str | None = None,
    ):
        folder, filename, merged_trace_filename = check_names(
            folder, filename, merged_trace_filename
        )
        check_keep(num_traces_to_keep)
        check_run_name(run_name)
        self.folder_template, self.filename_template = folder, filename
        self.merged_trace_filename = merged_trace_filename
        self.overwrite = as_flag("overwrite", overwrite)
        self.num_traces_to_keep = num_traces_to_keep
        self.run_name = new_run_id(None) if run_name is None else run_name
        self.folder: Path | None = None
        self._folder_was_link = False  # (set by start)
        self.merged_path: Path | None = None
        self._vars: dict[str, Any] = {}  # the name variables' values now
        # the handler's state: threads, file names. Re-entrant: the garbage
        # collector may end a span (close a generator suspended in one) on a
        # thread that holds it, and that span's event takes it again
        self._lock = threading.RLock()
        self._out = TraceFile()  # the open file (the writer's target)
        self._writer: Writer | None = None  # writes the queued events
        self._started = False
        # tid -> (name, the thread): a finished thread's is left out of later files
        self._threads: dict[int, tuple[str, weakref.ref]] = {}
        self._at_exit: weakref.finalize | None = None
        self._tids = 0  # tids handed out
        # A thread's tid lives in a thread-local: get_ident() is handed again
        # to a thread started after another ended, which needs its own track.
        self._local = threading.local()
        self._metadata: list[dict] = []  # the process's, first in every file
        self._sync: dict[str, Any] = {"sync_ts": 0.0, "sync_wall": 0.0}
        self._pid = 0

    def __enter__(self) -> JSONTraceHandler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def paths(self) -> list[Path]:
        """Every file this process wrote, oldest first (less those pruned)."""
        return self._out.paths

    @property
    def error(self) -> BaseException | None:
        """The last failed write, if any."""
        return self._out.error

    @property
    def lost(self) -> int:
        """Events not written because writing failed."""
        return self._out.lost

    @property
    def active(self) -> bool:
        """Started and not closed (also while a failed write keeps it from
        writing: its events are then counted in :attr:`lost`)."""
        return self._started

    # ----- life cycle --------------------------------------------------------------
    def start(self, epoch: int = 0, batch: int = 0, step: int = 0) -> Path:
        """Syncs the clocks, opens the first file and activates the handler."""
        if self.active:
            raise RuntimeError("this trace handler is already started")
        layout = ranks()  # one all-gather: ranks and the node layout
        self._vars = {k: layout[k] for k in FOLDER_VARS if k in layout}
        self._vars["run_name"] = self.run_name
        folder = Path(self.folder_template.format(**self._vars))
        prepare_folder(
            folder, self.overwrite, [self.filename_template, self.merged_trace_filename]
        )
        self._sync = clock_sync(layout, self.run_name)  # after the barrier
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self._pid = folder, layout["rank"]
        self._folder_was_link = folder.is_symlink()
        self._metadata = process_metadata(self._sync, layout["world_size"])
        names = dict(self._vars, epoch=epoch, batch=batch, step=step)
        path = self._path(names)
        with self._lock, self._out.lock:
            self._open(path, names)
        # Events are queued on the one Writer, whose thread writes them and
        # flushes the file at least every Writer.INTERVAL seconds, also when no
        # event comes (a hung job killed later keeps every span that finished).
        self._writer = Writer(self._out, name="jaxhistory-trace", what="the trace file")
        # A handler never closed (a script that ends without close()) still
        # finishes its file at exit: every event, the array closed.
        self._at_exit = weakref.finalize(
            self, _finish_quietly, self._writer, self._out, self._lock
        )
        self._started = self._out.counting = True
        _trace_state.activate(self)
        return path

    def rotate(
        self,
        epoch: int | None = None,
        batch: int | None = None,
        step: int | None = None,
    ) -> Path:
        """Finishes the current file and starts the next one (new ``{epoch}``,
        ``{batch}``, ``{step}``); applies ``num_traces_to_keep``."""
        if not self.active:
            raise RuntimeError("the trace handler is not started")
        given = {"epoch": epoch, "batch": batch, "step": step}
        names = self._vars | {k: v for k, v in given.items() if v is not None}
        path = self._path(names)  # raises before anything is finished
        _trace_state.drain()  # counters History has queued reach this file first
        assert self._writer is not None  # set by start, while active
        self._writer.flush()  # the events so far go to the finished file
        with self._lock, self._out.lock:  # no new thread's metadata between
            self._out.finish()
            self._open(path, names)
            self._out.prune(self.num_traces_to_keep, finished=False)
        return path

    def close(self) -> None:
        """Finishes the file, deactivates the handler and, on local rank 0 of each
        node, merges the folder's traces into ``merged_trace_filename``."""
        if not self.active:
            return
        if self._at_exit is not None:
            self._at_exit.detach()
            self._at_exit = None
        _trace_state.drain()  # counters History has queued reach this file first
        _trace_state.deactivate(self)
        self._started = False
        self._write_open_spans()  # (deactivated first: none is written twice)
        if _trace_state.active() is None:  # the last handler open
            _trace_state.forget_ended()
        if self._writer is not None:
            self._writer.close()  # every queued event written
            self._writer = None
        with self._lock, self._out.lock:
            self._out.counting = False
            self._out.finish(drop_unused=True)
            self._out.prune(self.num_traces_to_keep, finished=True)
        if self.merged_trace_filename is None:
            return
        if jax.process_count() > 1:  # every process has finished its files
            multihost_utils.sync_global_devices("jaxhistory-trace-close")
        if self._vars.get("local_rank", 0) == 0:
            assert self.folder is not None  # set by start
            try:  # (a link put in the folder's place: not read or written)
                still_folder(self.folder, self._folder_was_link)
            except NotAFile as err:
                warn_quietly(f"the traces were not merged: {err}")
                return
            merged = self.folder / self.merged_trace_filename.format(**self._vars)
            own = named_files(self.folder, self.filename_template)  # subfolders
            done = merge_folder(self.folder, merged, own)
            self.merged_path = done or self.merged_path

    def _write_open_spans(self) -> None:
        """Writes the StopWatch spans open now (the close inside one, Ctrl-C on
        its way out, a thread still working, a thread that ended inside one),
        each ending now, with ``"open_at_close": true`` in its args, on its
        thread's track."""
        now = time.perf_counter_ns()
        for thread, name, start_ns in _trace_state.open_spans():
            ts, dur = start_ns / 1e3, max(0, now - start_ns) / 1e3
            event = {"name": name, "cat": "StopWatch", "ph": "X", "ts": ts}
            event.update(dur=dur, args={"open_at_close": True})
            with self._lock:
                event.update(pid=self._pid, tid=self._tid(thread))
                self._event(event)

    def _path(self, names: dict) -> Path:
        """The file ``names`` (``epoch``, ``batch``, ``step`` among them) name."""
        assert self.folder is not None  # set by start, before the first file
        return file_path(
            self.folder, self.filename_template, names, self.paths, self.overwrite
        )

    def _open(self, path: Path, names: dict) -> None:
        """Opens ``path`` with the run's metadata (the caller holds the locks)."""
        self._vars = names
        metadata = list(self._metadata)
        for tid, (name, thread) in list(self._threads.items()):
            if thread() is None:  # finished and gone: it traces nothing more
                del self._threads[tid]
            else:
                metadata += thread_metadata(self._pid, tid, name)
        self._out.open(path, metadata)

    # ----- events ------------------------------------------------------------------
    def _event(self, event: dict) -> None:
        """Queues one event for the writer's thread (written at once before
        the handler starts writing, or once it has closed)."""
        writer = self._writer
        if writer is not None:
            try:
                writer.add(event)
                return
            except ValueError:  # closed meanwhile
                pass
        with self._out.lock:
            self._out.write_event(event)

    def _tid(self, thread: Any = None) -> int:
        """This thread's (or ``thread``'s) id in the trace (1, 2, ... in the
        order threads first trace something), named in the metadata of this
        file and of later ones while it lives (the caller holds the lock)."""
        if thread is not None and thread is not threading.current_thread():
            for known, (_, ref) in self._threads.items():
                if ref() is thread:
                    return known
            return self._new_tid(thread)
        tid = getattr(self._local, "tid", None)
        if tid is None:
            tid = self._local.tid = self._new_tid(threading.current_thread())
        return tid

    def _new_tid(self, thread: Any) -> int:
        """A new trace id for ``thread``, its name in the metadata."""
        self._tids += 1
        tid = self._tids
        self._threads[tid] = (thread.name, weakref.ref(thread))
        for event in thread_metadata(self._pid, tid, thread.name):
            self._event(event)
        return tid

    def _on_thread(
        self, event: dict, args: Mapping[str, Any] | None, thread: Any = None
    ) -> None:
        """Queues ``event`` with this process, this thread (or ``thread``) and
        ``args``."""
        _check_mapping("args", args)
        args = sanitize(args) if args else None
        with self._lock:
            event.update(pid=self._pid, tid=self._tid(thread))
            if args:
                event["args"] = args
            self._event(event)

    def complete(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        cat: str = "span",
        args: Mapping[str, Any] | None = None,
        *,
        thread: Any = None,
    ) -> None:
        """An ``X`` event from ``start_ns`` to ``end_ns`` (``time.perf_counter_ns``),
        on the calling thread's track or on that of ``thread`` (a
        ``threading.Thread``: the one the span began on, also one that has
        ended since)."""
        if thread is not None and not callable(getattr(thread, "is_alive", None)):
            raise TypeError(f"thread must be a threading.Thread, got {thread!r:.60}")
        ts, dur = start_ns / 1e3, max(0, end_ns - start_ns) / 1e3
        event = {"name": str(name), "cat": cat, "ph": "X", "ts": ts, "dur": dur}
        self._on_thread(event, args, thread)

    def instant(
        self, name: str, args: Mapping[str, Any] | None = None, scope: str = "t"
    ) -> None:
        """An ``i`` event now; ``scope`` ``"t"`` (thread), ``"p"`` or ``"g"``."""
        if scope not in ("t", "p", "g"):
            raise ValueError(f"scope must be 't', 'p' or 'g', got {scope!r}")
        now = time.perf_counter_ns() / 1e3
        self._on_thread({"name": str(name), "ph": "i", "s": scope, "ts": now}, args)

    def counter(
        self, name: str, values: Mapping[str, Any], timestamp: float | None = None
    ) -> None:
        """A ``C`` event: one track per key of ``values``. Non-finite values are
        left out (a counter needs numbers); ``timestamp`` is wall-clock seconds."""
        _check_mapping("values", values, none=False)
        series = counter_values(values)
        if not series:
            return
        if timestamp is None:
            ts = time.perf_counter_ns() / 1e3
        else:  # wall clock -> this handler's monotonic clock (as at the sync)
            sync = self._sync
            ts = sync["sync_ts"] + (timestamp - sync["sync_wall"]) * 1e6
        self._event(
            {"name": str(name), "ph": "C", "ts": ts, "pid": self._pid, "args": series}
        )

    # ----- as a sink (History's records become counters) ---------------------------
    def write(self, record: Any) -> None:
        """Each scalar of a History record as a counter track at its time."""
        for name, value in scalars(record).items():
            self.counter(name, {name: value}, timestamp=record.timestamp)

    def flush(self) -> None:
        """Writes the queued events and flushes the file."""
        writer = self._writer
        if writer is not None:
            writer.flush()
        else:
            self._out.write([], True)


def _finish_quietly(writer: Writer, out: Any, lock: Any) -> None:
    """At exit (or when the garbage collector frees a handler never closed):
    writes what is queued and finishes the file, merging nothing (the other
    processes may be gone)."""
    writer.close()
    with lock, out.lock:
        out.counting = False
        out.finish()
