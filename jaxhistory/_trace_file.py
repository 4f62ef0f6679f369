"""TraceFile: the open file of a Chrome trace handler: one event per line in a
JSON array, flushed by the writer's thread, and what a failed write costs."""

from __future__ import annotations

import contextlib
import threading
import warnings
from pathlib import Path

import orjson

__all__ = ["TraceFile"]


class TraceFile:
    """The file a :class:`~jaxhistory.trace.JSONTraceHandler` writes now.

    The :class:`~jaxhistory._writer.Writer` target of the handler's events:
    :meth:`write` takes the events queued since the last call, writes one line
    each and flushes the file. A write that fails (a full disk) closes the file,
    warns once, and from then on the file's events are counted in :attr:`lost`
    (while :attr:`counting`), never raised into the traced code; the next file
    is tried afresh. Methods other than :meth:`write` expect :attr:`lock` held.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.path: Path | None = None
        self.file = None
        self.first = True  # no event line yet: the next one opens the array
        self.events = 0  # events of the open file, metadata left out
        self.error: BaseException | None = None  # the last failed write
        self.lost = 0  # events not written because writing failed
        self.counting = False  # count lost events (the handler is active)
        self._warned = False

    def open(self, path: Path, metadata: list[dict]) -> bool:
        """Starts ``path`` with ``metadata`` events; False where it cannot be
        opened (then counted as a failed write)."""
        self.first, self.events, self.path = True, 0, path
        try:
            self.file = open(path, "wb")  # noqa: SIM115
        except OSError as err:
            self.file = None
            self.failed(err)
            return False
        for event in metadata:
            self.write_event(event)
        return True

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
        strings, which orjson writes as they are)."""
        if self.file is None:
            if self.error is not None and self.counting:
                self.lost += 1
            return
        try:
            self.file.write((b"[\n" if self.first else b",\n") + orjson.dumps(event))
            self.first = False
            if event["ph"] != "M":
                self.events += 1
        except OSError as err:
            self.lost += 1
            self.failed(err)

    def finish(self) -> None:
        """Closes the array and the file."""
        if self.file is not None:
            try:
                self.file.write(b"[\n]\n" if self.first else b"\n]\n")
                self.file.close()
            except OSError as err:
                self.failed(err)
            self.file = None

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
