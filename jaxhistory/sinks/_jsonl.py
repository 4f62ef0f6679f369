"""JsonlSink: records as JSONL lines, the format of History's own log."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO

from jaxhistory._codec import encode_records
from jaxhistory._dtypes import as_flag
from jaxhistory._files import open_log
from jaxhistory._names import printable
from jaxhistory._record import Batch, Record
from jaxhistory._writer import warn_quietly
from jaxhistory.sinks._base import FileSink

__all__ = ["JsonlSink"]


class JsonlSink(FileSink):
    """Appends one JSONL line per record, in the format of History's log
    (``step``, ``timestamp``, ``process_index``, ``metrics``, ``aggregated``;
    ``group`` too for published metrics; NaN and infinities as strings).

    History's own log is one of these, fed by its background thread. Each write
    goes to the operating system at once (``flush`` after every batch), so a
    process killed with SIGKILL leaves every complete line readable; a write that
    fails (a full disk) never raises: the sink warns once, keeps
    :attr:`error`, counts the records it could not write in :attr:`lost`, and
    starts the next write on a new line. With ``real_folder``, a folder of
    the log that is a symbolic link is refused (``NotAFile``, an
    OSError). Either way a link put in place of the folder after the sink
    began is never written through.

    Examples:
        >>> import tempfile, pathlib
        >>> from jaxhistory.sinks import JsonlSink, Record
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "log.jsonl"
        >>> sink = JsonlSink(path)
        >>> sink.write(Record(step=1, timestamp=0.5, metrics={"loss": 0.25}))
        >>> sink.close()
        >>> path.read_text()
        '{"step":1,"timestamp":0.5,"process_index":0,"metrics":{"loss":0.25},"aggregated":{}}\\n'
    """

    all_processes = False

    def __init__(
        self,
        path: str | os.PathLike,
        overwrite: bool = False,
        *,
        real_folder: bool = False,
    ):
        self.path = Path(path)
        real_folder = as_flag("real_folder", real_folder)
        self._file = open_log(self.path, as_flag("overwrite", overwrite), real_folder)
        # a folder that is no link now: one put in its place later is refused
        self._folder_was_link = self.path.parent.is_symlink() and not real_folder
        # the file's size as this sink left it (None: unknown after a failed
        # write): a file found shorter was cut by someone else
        self._size: int | None = os.fstat(self._file.fileno()).st_size
        self._lock = threading.Lock()
        self._broken = False  # the last write may have stopped mid-line
        self.error: BaseException | None = None  # the last failed write
        self.lost = 0  # records not written because writing failed

    def write(self, record: Record) -> None:
        self.write_batch(Batch.of([record]))

    def write_batch(self, batch: Batch) -> None:
        """Writes every record of ``batch`` (one encoder call for all; where
        that fails, one record at a time, so a record that cannot be encoded
        costs only itself: it is counted in :attr:`lost`, with a warning)."""
        try:
            text = encode_records(batch)
        except Exception:
            text = self._encode_each(batch)
        with self._lock:
            if self._file.closed:
                self._after_close()
                return
            try:
                size = self._size
                if self._broken:
                    self._file.write(b"\n")
                    self._broken = False
                    size = None
                self._file.write(text)
                self._file.flush()
                st = os.fstat(self._file.fileno())
                if st.st_nlink == 0:
                    self._reopen()
                    return
                if size is not None and st.st_size < size + len(text):
                    self._cut(size + len(text), st.st_size)
                self._size = st.st_size
            except Exception as err:  # a full disk must not stop the training
                self._broken = True
                self._size = None
                self.lost += len(batch)
                first = self.error is None
                self.error = err
                if first:
                    warn_quietly(
                        f"JSONL log {printable(self.path)}: writing failed ({err!r}); "
                        f"{len(batch)} record(s) not written, later ones are tried",
                    )

    def _reopen(self) -> None:
        """The log was deleted while this run wrote it (its folder removed, a
        clean-up): starts a new one at :attr:`path`, and keeps :attr:`error`
        so that History's ``finalize`` writes the whole log again from the
        history (the caller holds the lock)."""
        self.error = FileNotFoundError(f"{self.path} was deleted during the run")
        warn_quietly(
            f"JSONL log {printable(self.path)} was deleted while the run wrote "
            "it; a new one is started there, and finalize writes the whole log "
            "again from the history"
        )
        old, self._file = self._file, self._open_again()
        old.close()
        self._size = os.fstat(self._file.fileno()).st_size

    def _open_again(self) -> BinaryIO:
        """:attr:`path` opened to append to, never through a link put in
        place of its folder since this sink began (:class:`NotAFile`)."""
        return open_log(self.path, real_folder=not self._folder_was_link)

    def _cut(self, expected: int, size: int) -> None:
        """The log was cut short by someone else (a truncation, as a log
        rotation's copytruncate does): its earlier lines are gone, so
        :attr:`error` is kept for History's ``finalize`` to write the whole
        log again from the history (the caller holds the lock)."""
        self.error = OSError(f"{self.path} was cut short during the run")
        warn_quietly(
            f"JSONL log {printable(self.path)} was cut short while the run wrote "
            f"it ({size:,} of {expected:,} bytes left); later lines are appended "
            "to it, and finalize writes the whole log again from the history"
        )

    def identity(self) -> tuple[int, int, int] | None:
        """(device, inode, size) of the file written now, the size as this
        sink left it (so that a file cut short since is told apart); None
        once closed."""
        with self._lock:
            if self._file.closed:
                return None
            st = os.fstat(self._file.fileno())
            size = st.st_size if self._size is None else self._size
            return st.st_dev, st.st_ino, size

    def follow(self) -> bool:
        """Where a new file was put at :attr:`path` in place of the one this
        writes (History's ``finalize`` writing a failed log again, atomically),
        appends to that one from now on; returns whether it did. Without this
        the next write would find its file gone and report the log deleted."""
        with self._lock:
            if self._file.closed:
                return False
            try:
                now = os.fstat(self._file.fileno())
                there = os.stat(self.path, follow_symlinks=False)
            except OSError:
                return False  # nothing there: the next write reports it
            if (now.st_dev, now.st_ino) == (there.st_dev, there.st_ino):
                return False
            try:
                new = self._open_again()
            except OSError:
                return False  # the next write finds its file gone: reported
            old, self._file = self._file, new
            self._broken = False  # (a cut line stayed in the old file)
            old.close()
            self._size = os.fstat(new.fileno()).st_size
            return True

    def _encode_each(self, batch: Batch) -> bytes:
        parts = []
        for record in batch.records():
            try:
                one = Batch.of([record])
                one.run_id = batch.run_id
                parts.append(encode_records(one))
            except Exception as err:
                with self._lock:
                    self.lost += 1
                    first = self.error is None
                    self.error = err
                if first:
                    warn_quietly(
                        f"JSONL log {printable(self.path)}: the record of step "
                        f"{record.step} "
                        f"cannot be written ({err!r}); later records are",
                        stacklevel=3,
                    )
        return b"".join(parts)
