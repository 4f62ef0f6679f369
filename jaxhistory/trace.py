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

Example:
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

import contextlib
import gzip
import itertools
import json
import math
import os
import random
import re
import socket
import string
import threading
import time
import warnings
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax

from jaxhistory import _trace_state
from jaxhistory._codec import NONFINITE_TEXT
from jaxhistory._env import check_run_name, new_run_id
from jaxhistory._files import atomic_write
from jaxhistory._trace_file import TraceFile
from jaxhistory._writer import Writer
from jaxhistory.sinks._base import scalars

__all__ = ["JSONTraceHandler", "load_trace", "merge_traces"]

FOLDER_VARS = (
    "run_name",
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
)
FILE_VARS = (*FOLDER_VARS, "epoch", "batch", "step")


def _check_template(
    template: str, allowed: tuple[str, ...], what: str, inside: bool = False
) -> None:
    """ValueError unless ``template`` is a format string of ``allowed`` variables;
    ``inside``: a path kept inside the folder (relative, no ``..`` part)."""
    if not isinstance(template, str) or not template:
        raise ValueError(f"{what} must be a non-empty str, got {template!r}")
    if inside and _leaves_folder(template):
        raise ValueError(
            f"{what} {template!r} leaves the trace folder (an absolute path or a "
            "'..' part); name a file inside the folder, and choose the folder with "
            "folder="
        )
    for _, field, _spec, _conv in string.Formatter().parse(template):
        if field is None:
            continue
        name = field.split(".")[0].split("[")[0]
        if name not in allowed:
            raise ValueError(
                f"{what} {template!r} uses an unknown variable {{{field}}}; "
                f"available: {', '.join('{' + v + '}' for v in allowed)}"
            )


def _leaves_folder(name: str) -> bool:
    """Whether a file name relative to a folder points outside it."""
    parts = re.split(r"[\\/]", name)
    return os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts


def _sanitize(value: Any) -> Any:
    """JSON-safe args: non-finite floats as strings, NumPy/JAX scalars as numbers."""
    if isinstance(value, Mapping):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else NONFINITE_TEXT[repr(value)]
    try:
        import numpy as np

        arr = np.asarray(value)
        if arr.dtype.kind in "biuf" or arr.dtype.kind == "V":
            return _sanitize(arr.astype(float).tolist() if arr.ndim else float(arr))
    except Exception:
        pass
    return str(value)


def _ranks() -> dict[str, int]:
    """rank, world_size and the node layout: one all-gather of host names (which
    is also the barrier the clock sync is taken at) when there are processes."""
    rank, world = jax.process_index(), jax.process_count()
    token = random.getrandbits(31)
    host = zlib.crc32(socket.gethostname().encode())
    if world == 1:
        return {
            "rank": 0,
            "world_size": 1,
            "local_rank": 0,
            "local_world_size": 1,
            "node_rank": 0,
            "sync_id": token,
        }
    import numpy as np
    from jax.experimental import multihost_utils

    table = np.asarray(
        multihost_utils.process_allgather(np.array([host, token], np.int64))
    ).reshape(world, 2)
    hosts = list(dict.fromkeys(table[:, 0].tolist()))
    mine = [i for i in range(world) if table[i, 0] == host]
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": mine.index(rank),
        "local_world_size": len(mine),
        "node_rank": hosts.index(host),
        "sync_id": int(table[0, 1]),  # rank 0's token names this sync
    }


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a barrier with several processes)."""
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([int(flag)], np.int32))
    return bool(np.asarray(flags).any())


class JSONTraceHandler:
    """Streams Chrome trace events to files while active (a context manager, or
    :meth:`start` / :meth:`close`).

    Args:
        folder: format string of the folder; variables ``{run_name}``,
            ``{rank}``, ``{local_rank}``, ``{world_size}``,
            ``{local_world_size}``, ``{node_rank}``.
        filename: format string of each trace file; the folder's variables plus
            ``{epoch}``, ``{batch}``, ``{step}`` (given to :meth:`start` and
            :meth:`rotate`). Include ``{rank}`` when several processes share a
            folder. An unknown variable, an absolute path or a ``..`` part is a
            ValueError naming it.
        merged_trace_filename: at :meth:`close`, local rank 0 of each node merges
            every trace file in the folder into this file (same variables as
            ``folder``, a name inside it); None to skip.
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
    Files are JSON arrays written one event per line and flushed about twice a
    second, so a file cut off by a crash still loads (:func:`load_trace`, and
    Perfetto, accept a missing ``]``). Times are microseconds on this process's
    monotonic clock; the clock sync is recorded in an ``M`` event named
    ``clock_sync``.
    """

    def __init__(
        self,
        folder: str = "{run_name}/traces",
        filename: str = "ep{epoch}-ba{batch}-rank{rank}.json",
        merged_trace_filename: str | None = "merged_trace.json",
        overwrite: bool = False,
        num_traces_to_keep: int = -1,
        run_name: str | None = None,
    ):
        _check_template(folder, FOLDER_VARS, "folder")
        _check_template(filename, FILE_VARS, "filename", inside=True)
        if merged_trace_filename is not None:
            _check_template(
                merged_trace_filename,
                FOLDER_VARS,
                "merged_trace_filename",
                inside=True,
            )
        if (
            isinstance(num_traces_to_keep, bool)
            or not isinstance(num_traces_to_keep, int)
            or num_traces_to_keep == 0
            or num_traces_to_keep < -1
        ):
            raise ValueError(
                "num_traces_to_keep must be -1 (keep every file) or a count >= 1 "
                f"(0 would leave no trace at all), got {num_traces_to_keep!r}"
            )
        check_run_name(run_name)
        if run_name is None:
            run_name = new_run_id(None)
        self.folder_template, self.filename_template = folder, filename
        self.merged_trace_filename = merged_trace_filename
        self.overwrite = bool(overwrite)
        self.num_traces_to_keep = num_traces_to_keep
        self.run_name = run_name
        self.paths: list[Path] = []  # every file this process wrote, oldest first
        self.folder: Path | None = None
        self.merged_path: Path | None = None
        self._vars: dict[str, Any] = {}
        self._lock = threading.Lock()  # the handler's state: threads, file names
        self._out = TraceFile()  # the open file (the writer's target)
        self._writer: Writer | None = None  # writes the queued events
        self._started = False
        self._threads: dict[int, tuple[int, str]] = {}
        self._sync: dict[str, Any] = {}
        self._counter_clock: tuple[float, int] = (0.0, 0)

    # ----- life cycle --------------------------------------------------------------
    def __enter__(self) -> JSONTraceHandler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    def start(self, epoch: int = 0, batch: int = 0, step: int = 0) -> Path:
        """Syncs the clocks, opens the first file and activates the handler."""
        if self.active:
            raise RuntimeError("this trace handler is already started")
        ranks = _ranks()  # one all-gather: ranks and the node layout
        self._vars = {k: ranks[k] for k in FOLDER_VARS if k in ranks}
        self._vars["run_name"] = self.run_name
        folder = Path(self.folder_template.format(**self._vars))
        problem = None if self.overwrite else _folder_problem(folder)
        if self.overwrite:  # before the barrier: no process has a file open yet
            _clear_earlier_files(
                folder, [self.filename_template, self.merged_trace_filename]
            )
        # Every process checks before anyone writes; all raise together (a
        # process that raised alone would leave the others in the next barrier).
        if _any_process(problem is not None):
            raise FileExistsError(
                problem
                or "a trace folder of another process is "
                "not empty; pass overwrite=True or use another folder"
            )
        sync_ns, sync_wall = time.perf_counter_ns(), time.time()  # after the barrier
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._sync = {
            "sync_ts": sync_ns / 1e3,
            "sync_wall": sync_wall,
            "sync_id": ranks["sync_id"],
            "process_index": ranks["rank"],
            "run_name": self.run_name,
        }
        self._counter_clock = (sync_wall, sync_ns)
        path = self._open(epoch, batch, step)
        # Events are queued on the one Writer, whose thread writes them and
        # flushes the file at least every Writer.INTERVAL seconds, also when no
        # event comes (a hung job killed later keeps every span that finished).
        self._writer = Writer(self._out, name="jaxhistory-trace", what="the trace file")
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
        vars_ = self._vars
        nxt = (
            vars_["epoch"] if epoch is None else epoch,
            vars_["batch"] if batch is None else batch,
            vars_["step"] if step is None else step,
        )
        self._next_path(*nxt)  # raises before anything is finished
        self._writer.flush()  # the events so far go to the finished file
        with self._lock, self._out.lock:  # no new thread's metadata between
            self._out.finish()
            path = self._open(*nxt, locked=True)
        self._prune()
        return path

    def close(self) -> None:
        """Finishes the file, deactivates the handler and, on local rank 0 of each
        node, merges the folder's traces into ``merged_trace_filename``."""
        if not self.active:
            return
        _trace_state.drain()  # counters History has queued reach this file first
        _trace_state.deactivate(self)
        self._started = False
        if self._writer is not None:
            self._writer.close()  # every queued event written
            self._writer = None
        with self._lock, self._out.lock:
            self._out.counting = False
            path = self._out.path
            empty = self._out.events == 0 and len(self.paths) > 1
            self._out.finish()
            if empty and path in self.paths:  # opened by rotate, never used
                path.unlink(missing_ok=True)
                self.paths.remove(path)
        self._prune()
        if self.merged_trace_filename is None:
            return
        if jax.process_count() > 1:  # every process has finished its files
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxhistory-trace-close")
        if self._vars.get("local_rank", 0) == 0:
            merged = self.folder / self.merged_trace_filename.format(**self._vars)
            sources = [
                p
                for p in sorted(self.folder.iterdir())
                if p != merged
                and not p.name.startswith(".")
                and p.name.endswith((".json", ".json.gz"))
            ]
            if sources:
                try:
                    merge_traces(sources, merged)
                except (OSError, ValueError) as err:  # runs in the traced program
                    with contextlib.suppress(Warning):
                        warnings.warn(
                            f"cannot write the merged trace {merged}: {err}",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                else:
                    self.merged_path = merged

    # ----- files -------------------------------------------------------------------
    def _next_path(self, epoch: int, batch: int, step: int) -> Path:
        for name, value in (("epoch", epoch), ("batch", batch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        names = dict(self._vars, epoch=epoch, batch=batch, step=step)
        name = self.filename_template.format(**names)
        if _leaves_folder(name):
            raise ValueError(f"trace file name {name!r} leaves the folder")
        path = self.folder / name
        if path in self.paths or (path.exists() and not self.overwrite):
            raise FileExistsError(
                f"trace file {path} exists; give rotate() a new epoch, batch or step "
                "(or a filename with {step})"
            )
        return path

    def _open(self, epoch: int, batch: int, step: int, locked: bool = False) -> Path:
        path = self._next_path(epoch, batch, step)
        self._vars.update(epoch=epoch, batch=batch, step=step)
        path.parent.mkdir(parents=True, exist_ok=True)
        if locked:  # the caller holds both locks
            self._start_file(path)
        else:
            with self._lock, self._out.lock:
                self._start_file(path)
        return path

    def _start_file(self, path: Path) -> None:
        """Opens ``path`` with the run's metadata (the caller holds the locks)."""
        pid = self._sync["process_index"]
        host = socket.gethostname()
        world = self._vars.get("world_size", 1)
        metadata = [
            {"name": name, "ph": "M", "pid": pid, "tid": 0, "args": args}
            for name, args in (
                ("process_name", {"name": f"{self.run_name}: process {pid} ({host})"}),
                ("process_sort_index", {"sort_index": pid}),
                ("process_labels", {"labels": f"rank {pid} of {world}"}),
                ("clock_sync", dict(self._sync)),
            )
        ]
        for tid, tname in self._threads.values():
            metadata += self._thread_metadata(tid, tname)
        if self._out.open(path, metadata):
            self.paths.append(path)

    def _thread_metadata(self, tid: int, tname: str) -> tuple[dict, dict]:
        pid = self._sync["process_index"]
        return (
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"name": tname},
            },
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            },
        )

    def _event(self, event: dict) -> None:
        """Queues one event for the writer's thread (written at once before
        the handler starts writing, or once it has closed)."""
        writer = self._writer
        if writer is not None:
            with contextlib.suppress(ValueError):  # closed meanwhile
                writer.add(event)
                return
        with self._out.lock:
            self._out.write_event(event)

    def _prune(self) -> None:
        keep = self.num_traces_to_keep
        if keep < 0:
            return
        finished = self.paths[:-1] if self.active else list(self.paths)
        for path in finished[: max(0, len(finished) - keep)]:
            path.unlink(missing_ok=True)
            self.paths.remove(path)

    def _tid(self) -> int:
        ident = threading.get_ident()
        entry = self._threads.get(ident)
        if entry is None:
            entry = (len(self._threads) + 1, threading.current_thread().name)
            self._threads[ident] = entry
            for event in self._thread_metadata(*entry):
                self._event(event)
        return entry[0]

    # ----- events ------------------------------------------------------------------
    def complete(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        cat: str = "span",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """An ``X`` event from ``start_ns`` to ``end_ns`` (``time.perf_counter_ns``)."""
        with self._lock:
            event = {
                "name": str(name),
                "cat": cat,
                "ph": "X",
                "ts": start_ns / 1e3,
                "dur": max(0, end_ns - start_ns) / 1e3,
                "pid": self._sync.get("process_index", 0),
                "tid": self._tid(),
            }
            if args:
                event["args"] = _sanitize(args)
            self._event(event)

    def instant(
        self, name: str, args: Mapping[str, Any] | None = None, scope: str = "t"
    ) -> None:
        """An ``i`` event now; ``scope`` ``"t"`` (thread), ``"p"`` or ``"g"``."""
        if scope not in ("t", "p", "g"):
            raise ValueError(f"scope must be 't', 'p' or 'g', got {scope!r}")
        with self._lock:
            event = {
                "name": str(name),
                "ph": "i",
                "s": scope,
                "ts": time.perf_counter_ns() / 1e3,
                "pid": self._sync.get("process_index", 0),
                "tid": self._tid(),
            }
            if args:
                event["args"] = _sanitize(args)
            self._event(event)

    def counter(
        self, name: str, values: Mapping[str, Any], timestamp: float | None = None
    ) -> None:
        """A ``C`` event: one track per key of ``values``. Non-finite values are
        left out (a counter needs numbers); ``timestamp`` is wall-clock seconds."""
        series = {}
        for key, value in values.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                series[str(key)] = number
        if not series:
            return
        with self._lock:
            if timestamp is None:
                ts = time.perf_counter_ns() / 1e3
            else:  # wall clock -> this handler's monotonic clock
                wall0, ns0 = self._counter_clock
                ts = ns0 / 1e3 + (timestamp - wall0) * 1e6
            self._event(
                {
                    "name": str(name),
                    "ph": "C",
                    "ts": ts,
                    "pid": self._sync.get("process_index", 0),
                    "args": series,
                }
            )

    # ----- as a sink (History's records become counters) ---------------------------
    all_processes = True  # every process traces its own metrics

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


def _clear_earlier_files(folder: Path, templates: list) -> None:
    """Deletes the files in ``folder`` named like ``templates`` (a trace file
    and the merged file: an earlier run's, of any rank and epoch)."""
    if not folder.is_dir():
        return
    for template in filter(None, templates):
        glob, pattern = _name_pattern(template)
        for path in folder.glob(glob):
            name = path.relative_to(folder).as_posix()
            if pattern.fullmatch(name) and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)


def _folder_problem(folder: Path) -> str | None:
    """Why a trace may not start in ``folder`` without overwrite, or None."""
    if not folder.is_dir():
        return None
    visible = [p for p in folder.iterdir() if not p.name.startswith(".")]
    if visible:
        return (
            f"trace folder {folder} is not empty ({len(visible)} entries, e.g. "
            f"{visible[0].name}); pass overwrite=True or use another folder"
        )
    return None


def _name_pattern(template: str) -> tuple[str, re.Pattern]:
    """A glob and a regex matching the names ``template`` formats to: numbers
    where it has a number variable, any name where it has ``{run_name}``."""
    glob, regex = [], []
    for literal, field, _spec, _conv in string.Formatter().parse(template):
        glob.append(re.sub(r"([*?\[])", r"[\1]", literal))
        regex.append(re.escape(literal))
        if field is not None:
            glob.append("*")
            regex.append(r"[^/]+" if field.startswith("run_name") else r"-?\d+")
    return "".join(glob), re.compile("".join(regex))


# ----- reading and merging ---------------------------------------------------------
def load_trace(path: str | os.PathLike) -> list[dict]:
    """The events of a trace file: a JSON array or ``{"traceEvents": [...]}``,
    plain or ``.gz``, complete or cut off anywhere (a missing ``]``, a trailing
    comma, half an event: the complete events before it are returned, with a
    warning naming the line where an event is cut off or damaged).

    Raises:
        ValueError: naming the file, for a file that is no trace (no event
            array, ``traceEvents`` that is not a list, or gzip data that is
            damaged rather than cut off).
    """
    return _read_trace(Path(path))[0]


def _read_trace(path: Path) -> tuple[list[dict], dict]:
    """(the events, the ``otherData`` object) of a trace file."""
    raw = path.read_bytes()
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
    except ValueError:
        data = None
    if isinstance(data, list):
        return [e for e in data if isinstance(e, dict)], {}
    if isinstance(data, dict):
        events = data.get("traceEvents", [])
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
        except ValueError:  # cut off inside this event, or damaged there
            line = text.count("\n", 0, pos) + 1
            warnings.warn(
                f"{path}: the trace is cut off or damaged at line {line} (character "
                f"{pos + 1}); the {len(events)} complete event(s) before it are kept",
                RuntimeWarning,
                stacklevel=3,
            )
            break
        if isinstance(event, dict):
            events.append(event)
    return events, {}


def _identity(e: dict) -> tuple:
    """What makes two merged events the same (times to the nanosecond: a merged
    file's times were shifted and are shifted back)."""

    def when(key):
        v = e.get(key)
        return round(v, 3) if isinstance(v, int | float) else v

    args = json.dumps(e.get("args"), sort_keys=True, default=str)
    return (e.get("pid"), e.get("tid"), e.get("ph"), e.get("name"), when("ts"),
            when("dur"), e.get("id"), args)  # fmt: skip


def _processes(events: list[dict], path: Path) -> dict[int, dict]:
    """Each process's clock sync (its ``clock_sync`` args), by pid; a ValueError
    naming the file and the argument for a pid or a sync that is malformed."""
    syncs = {}
    for e in events:
        pid = e.get("pid", 0)
        if isinstance(pid, bool) or not isinstance(pid, int | str | None):
            raise ValueError(
                f"{path}: an event {str(e.get('name'))[:80]!r} has pid {pid!r:.80}; "
                "a pid is a number"
            )
        if e.get("ph") == "M" and e.get("name") == "clock_sync":
            args = e.get("args", {})
            if not isinstance(args, dict):
                raise ValueError(
                    f"{path}: the clock_sync of pid {pid} has args {args!r:.80}; "
                    "expected an object with sync_ts, sync_wall and sync_id"
                )
            for key in ("sync_ts", "sync_wall"):
                value = args.get(key, 0.0)
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                ):
                    raise ValueError(
                        f"{path}: the clock_sync of pid {pid} has {key} "
                        f"{value!r:.80}; it must be a finite number"
                    )
            if not isinstance(args.get("sync_id"), int | str | None):
                raise ValueError(
                    f"{path}: the clock_sync of pid {pid} has sync_id "
                    f"{args.get('sync_id')!r:.80}; it must be a number or a string"
                )
            syncs[pid] = dict(args)
    return syncs


MERGED_MARK = "jaxhistory merged trace"  # otherData["merged"] of a merged file


def _check_output(out_path: Path, paths: list[Path], runs: set) -> None:
    """ValueError unless ``out_path`` may receive the merge: a new file, or a
    merged trace of the same runs (a re-merge); never an input, a trace of one
    process (arguments in the wrong order), another run's merge, another kind of
    file, or something that is not a plain file (a device, a link)."""
    # An earlier merge among the inputs (traces/*.json picking up the merged
    # trace) may be merged again into itself; any other input may not.
    among = any(
        path.absolute() == out_path.absolute()
        or (out_path.exists() and path.exists() and os.path.samefile(path, out_path))
        for path in paths
    )
    if not os.path.lexists(out_path):
        return
    if out_path.is_symlink() or not out_path.is_file():
        kind = "a link" if out_path.is_symlink() else "not a plain file"
        raise ValueError(
            f"the merged trace's path {out_path} exists and is {kind}; it is "
            "left as it is: give the merged trace a new file name"
        )
    if out_path.stat().st_size == 0:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            events, other = _read_trace(out_path)
    except (OSError, ValueError):
        raise ValueError(
            f"the merged trace's path {out_path} exists and is not a trace; it is "
            "left as it is: give the merged trace a new file name"
        ) from None
    if other.get("merged") != MERGED_MARK:
        if among:
            raise ValueError(
                f"the merged trace's path {out_path} is also one of the traces to "
                "merge; merge_traces(paths, out_path) takes the inputs first and "
                "writes a new out_path: give it another name"
            )
        raise ValueError(
            f"the merged trace's path {out_path} is an existing trace that "
            "merge_traces did not write (a process's own trace?); it is left as it "
            "is. merge_traces(paths, out_path) takes the inputs first: give the "
            "merged trace a new file name"
        )
    theirs = {
        e.get("args", {}).get("sync_id")
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "clock_sync"
        and isinstance(e.get("args"), dict)
    }
    foreign = theirs - runs
    if foreign:
        names = sorted(
            {
                str(e["args"].get("run_name", e["args"].get("sync_id")))
                for e in events
                if e.get("name") == "clock_sync"
                and isinstance(e.get("args"), dict)
                and e["args"].get("sync_id") in foreign
            }
        )
        raise ValueError(
            f"the merged trace's path {out_path} holds the trace of another run "
            f"({', '.join(names)[:200]}) that the inputs do not; it is left as it "
            "is: give the merged trace a new file name, or delete that file"
        )


def merge_traces(
    paths: Iterable[str | os.PathLike], out_path: str | os.PathLike
) -> Path:
    """Merges trace files (from several processes, several rotations, or earlier
    merges) into one file on one clock; returns its path.

    Processes of one run (the same clock sync) are aligned at the barrier they
    synced at; separate runs are placed by wall clock. Each process keeps one
    pid (its process index, renumbered only where two runs share one).
    Truncated inputs are read as far as they go. An event already merged (the
    same process, thread, name, phase, time, duration and arguments: a file given
    twice, or beside a merge that holds it) is kept once. ``paths`` may be one
    path. The file is ``{"otherData": {"merged": ...}, "traceEvents": [...]}``.

    Raises:
        ValueError: an input that is no trace, or has a malformed ``clock_sync``
            (naming the file); an ``out_path`` that is one of ``paths``, an
            existing trace merge_traces did not write (a process's own file:
            ``merge_traces(out, inp)`` in the wrong order), a merged trace of a
            run the inputs do not hold, another existing file, or not a plain
            file (a device, a link). Nothing is written then.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("merge_traces needs at least one trace file")
    loaded = []
    for path in paths:
        events = load_trace(path)
        loaded.append((events, _processes(events, path)))
    out_path = Path(out_path)
    runs = {s.get("sync_id") for _, syncs in loaded for s in syncs.values()}
    _check_output(out_path, paths, runs)
    # A process is (sync_id, original pid); its shift puts its sync point on the
    # merged clock: 0 for the earliest run, later runs by their wall-clock start.
    walls: dict[Any, float] = {}
    for _, syncs in loaded:
        for sync in syncs.values():
            run = sync.get("sync_id")
            wall = sync.get("sync_wall", 0.0)  # the barrier's wall-clock time
            walls[run] = min(walls.get(run, math.inf), wall)
    first_wall = min(walls.values(), default=0.0)
    new_pid: dict[tuple, int] = {}
    used: set[int] = set()
    out_events, seen_meta, seen = [], set(), set()
    for index, (events, syncs) in enumerate(loaded):
        for e in events:
            pid = e.get("pid", 0)
            sync = syncs.get(pid, {})
            run = sync.get("sync_id")
            # A process without a clock sync (another tool's trace) is its own,
            # per file, and keeps its times as they are.
            key = (run, pid) if sync else ("file", index, pid)
            if key not in new_pid:
                target = (
                    pid
                    if isinstance(pid, int) and pid not in used
                    else max(used, default=-1) + 1
                )
                new_pid[key] = target
                used.add(target)
            shift = (
                -sync.get("sync_ts", 0.0)
                + (walls.get(run, first_wall) - first_wall) * 1e6
                if sync
                else 0.0
            )
            e = dict(e)
            e["pid"] = new_pid[key]
            if e.get("ph") == "M":
                if e.get("name") == "clock_sync":
                    args = dict(e.get("args", {}))
                    args["sync_ts"] = args.get("sync_ts", 0.0) + shift
                    e["args"] = args
                ident = (e["pid"], e.get("tid"), e.get("name"))
                if ident in seen_meta:
                    continue  # one of each metadata event per process/thread
                seen_meta.add(ident)
            else:
                if isinstance(e.get("ts"), int | float):
                    e["ts"] = e["ts"] + shift
                ident = _identity(e)
                if ident in seen:
                    continue  # the same span from another copy of its file
                seen.add(ident)
            out_events.append(e)
    meta = [e for e in out_events if e.get("ph") == "M"]
    timed = [e for e in out_events if e.get("ph") != "M"]
    # Sorted by time; events without a time keep their order at the end.
    rest = sorted(
        timed,
        key=lambda e: (0, e["ts"]) if isinstance(e.get("ts"), int | float) else (1, 0),
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(
        json.dumps(_sanitize(e), allow_nan=False, separators=(",", ":"))
        for e in itertools.chain(meta, rest)
    )
    other = json.dumps({"merged": MERGED_MARK, "files": len(paths)})
    text = f'{{"otherData":{other},\n"traceEvents":[\n{lines}\n]}}\n'
    if out_path.name.endswith(".gz"):
        atomic_write(
            out_path, lambda tmp: tmp.write_bytes(gzip.compress(text.encode()))
        )
    else:
        atomic_write(out_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out_path
