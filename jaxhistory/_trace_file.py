"""TraceFile: the open file of a Chrome trace handler: one event per line in a
JSON array, flushed by the writer's thread, and what a failed write costs;
and the events every file of a run starts with."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from jaxhistory._codec import NONFINITE_TEXT
from jaxhistory._files import NotAFile, still_folder

__all__ = [
    "TraceFile",
    "clock_sync",
    "counter_values",
    "process_metadata",
    "sanitize",
    "thread_metadata",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def sanitize(value: Any) -> Any:
    """JSON-safe event values: non-finite floats as strings, NumPy and JAX
    scalars and arrays as numbers, anything else as its ``str``."""
    if isinstance(value, Mapping):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [sanitize(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else NONFINITE_TEXT[repr(value)]
    try:
        arr = np.asarray(value)
        if arr.dtype.kind in "biuf" or arr.dtype.kind == "V":
            return sanitize(arr.astype(float).tolist() if arr.ndim else float(arr))
    except Exception:
        pass
    return str(value)


def _utf8(value: Any) -> Any:
    """``value`` (an event) with every string UTF-8 can encode: a lone
    surrogate (``os.fsdecode`` of undecodable bytes) written as ``\\udcff``."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_utf8(v) for v in value]
    return value


def counter_values(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among ``values`` (a counter's tracks), keys as str."""
    series = {}
    for key, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            series[str(key)] = number
    return series


def clock_sync(layout: dict, run_name: str) -> dict:
    """The ``clock_sync`` arguments, taken now (just after the barrier every
    process passed): this process's monotonic time in microseconds, the wall
    clock, the sync's id and the process index from ``layout``."""
    sync_ns, sync_wall = time.perf_counter_ns(), time.time()
    return {
        "sync_ts": sync_ns / 1e3,
        "sync_wall": sync_wall,
        "sync_id": layout["sync_id"],
        "process_index": layout["rank"],
        "run_name": run_name,
    }


def process_metadata(sync: dict, world: int) -> list[dict]:
    """The ``M`` events naming this process: its name (run, index, host), sort
    index, labels and the clock sync (``sync``, from :func:`clock_sync`)."""
    pid, run_name = sync["process_index"], sync["run_name"]
    host = socket.gethostname()
    return [
        {"name": name, "ph": "M", "pid": pid, "tid": 0, "args": args}
        for name, args in (
            ("process_name", {"name": f"{run_name}: process {pid} ({host})"}),
            ("process_sort_index", {"sort_index": pid}),
            ("process_labels", {"labels": f"rank {pid} of {world}"}),
            ("clock_sync", dict(sync)),
        )
    ]


def thread_metadata(pid: int, tid: int, name: str) -> list[dict]:
    """The ``M`` events naming thread ``tid`` and keeping the threads in the
    order they first traced something."""
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
         "args": {"name": name}},
        {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
         "args": {"sort_index": tid}},
    ]  # fmt: skip


class TraceFile:
    """The files a :class:`~jaxhistory.trace.JSONTraceHandler` writes, one at a
    time.

    The :class:`~jaxhistory._writer.Writer` target of the handler's events:
    :meth:`write` takes the events queued since the last call, writes one line
    each and flushes the file. A write that fails (a full disk) closes the file,
    warns once, and from then on the file's events are counted in :attr:`lost`
    (while :attr:`counting`), never raised into the traced code; the next file
    is tried afresh. Methods other than :meth:`write` expect :attr:`lock` held.

    Attributes:
        paths: every file opened, oldest first (less those pruned).
        error: the last failed write, if any.
        lost: events not written because writing failed.
    """

    def __init__(self):
        # re-entrant, as the handler's: a span the garbage collector ends on a
        # thread holding it writes its event here once no writer runs
        self.lock = threading.RLock()
        self.paths: list[Path] = []
        self.path: Path | None = None
        self.file = None
        self.first = True  # no event line yet: the next one opens the array
        self.events = 0  # events of the open file, metadata left out
        self.error: BaseException | None = None
        self.lost = 0
        self.counting = False  # count lost events (the handler is active)
        self._warned = False
        # each folder written into -> whether it was a link then; each file
        # opened -> (device, inode): only those files are ever deleted
        self._folders: dict[Path, bool] = {}
        self._ids: dict[Path, tuple[int, int]] = {}

    def open(self, path: Path, metadata: list[dict]) -> None:
        """Starts ``path`` with ``metadata`` events (a file that cannot be
        opened counts as a failed write, and is not one of :attr:`paths`)."""
        self.first, self.events, self.path = True, 0, path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            was_link = self._folders.setdefault(path.parent, path.parent.is_symlink())
            still_folder(path.parent, was_link)
            self.file = os.fdopen(os.open(path, flags, 0o666), "wb")
            st = os.fstat(self.file.fileno())
        except OSError as err:
            self.file = None
            self.failed(err)
            return
        self._ids[path] = st.st_dev, st.st_ino
        self.paths.append(path)
        for event in metadata:
            self.write_event(event)

    def write(self, events: list, final: bool) -> None:
        """Writes ``events`` and flushes the file (the writer's thread calls
        this, at least every ``Writer.INTERVAL`` seconds)."""
        with self.lock:
            for event in events:
                self.write_event(event)
            if self.file is not None:
                try:
                    self.file.flush()
                except OSError as err:
                    self.failed(err)

    def write_event(self, event: dict) -> None:
        """Writes one event line (values already sanitized: finite numbers and
        strings, which orjson writes as they are; an event it cannot write, a
        lone surrogate or an int past 64 bits, goes through :mod:`json`)."""
        if self.file is None:
            if self.error is not None and self.counting:
                self.lost += 1
            return
        try:
            line = orjson.dumps(event)
        except TypeError:  # a lone surrogate, an int past 64 bits: this event's own
            try:
                text = json.dumps(_utf8(event), ensure_ascii=False, allow_nan=False)
                line = text.encode()
            except (TypeError, ValueError):
                self.lost += 1
                return
        try:
            self.file.write((b"[\n" if self.first else b",\n") + line)
            self.first = False
            if event["ph"] != "M":
                self.events += 1
        except OSError as err:
            self.lost += 1
            self.failed(err)

    def finish(self, drop_unused: bool = False) -> None:
        """Closes the array and the file; ``drop_unused``: deletes it instead
        when it holds no event but metadata and is not the only file (one a
        rotate opened after the last epoch)."""
        path = self.path
        unused = drop_unused and self.events == 0 and len(self.paths) > 1
        if self.file is not None:
            try:
                self.file.write(b"[\n]\n" if self.first else b"\n]\n")
                self.file.close()
            except OSError as err:
                self.failed(err)
            self.file = None
        if unused and path in self.paths:
            self._delete(path)
            self.paths.remove(path)

    def prune(self, keep: int, finished: bool) -> None:
        """Deletes all but the newest ``keep`` files (-1 keeps all);
        ``finished``: every file is finished, else the last is still open."""
        if keep < 0:
            return
        done = list(self.paths) if finished else self.paths[:-1]
        for path in done[: max(0, len(done) - keep)]:
            self._delete(path)
            self.paths.remove(path)

    def _delete(self, path: Path) -> None:
        """Deletes ``path`` where it is still the file :meth:`open` made there
        (not one reached through a folder swapped for a link since, nor one
        put in its place)."""
        made = self._ids.pop(path, None)
        try:
            st = os.lstat(path)
            if made == (st.st_dev, st.st_ino) and not self._moved(path.parent):
                os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to delete

    def _moved(self, folder: Path) -> bool:
        """Whether ``folder`` is now a link, where it was none when written."""
        try:
            still_folder(folder, self._folders.get(folder, True))
        except NotAFile:
            return True
        return False

    def failed(self, err: BaseException) -> None:
        """A write failed: the file is closed; warns once per handler."""
        self.error = err
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        if not self._warned:
            self._warned = True
            with contextlib.suppress(Warning):  # never raised into traced code
                warnings.warn(
                    f"trace file {self.path}: writing failed ({err!r}); later events "
                    "of this file are dropped and counted in JSONTraceHandler.lost",
                    RuntimeWarning,
                    stacklevel=4,
                )
