"""TensorBoard event files, written with tensorboardX's protocol buffers (no
TensorFlow)."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxhistory._files import check_target, open_log
from jaxhistory._names import printable
from jaxhistory._optional import import_optional
from jaxhistory._record import Batch, Record
from jaxhistory._writer import warn_quietly
from jaxhistory.sinks._base import values, written_after_close

__all__ = ["TensorBoardSink"]

# An event file is named by the second and the host, as tensorboardX names
# them; two sinks in one logdir within a second (a resumed run) would share the
# name, so each file also gets the process id and a number of its own.
_numbers = itertools.count()


def _buckets() -> list[float]:
    """TensorFlow's histogram bucket limits, as tensorboardX makes them (1e-12
    up by 10% to 1e20, mirrored, and 0), closed by -DBL_MAX and DBL_MAX as
    TensorFlow closes them: a value past 1e20 went uncounted, and an array of
    only such values raised, losing the record."""
    v, limits = 1e-12, []
    while v < 1e20:
        limits.append(v)
        v *= 1.1
    top = float(np.finfo(np.float64).max)
    return [-top, *(-x for x in reversed(limits)), 0.0, *limits, top]


class TensorBoardSink:
    """Writes every scalar of each record (metrics and aggregated statistics) as a
    TensorBoard scalar at the record's step; array metrics as histograms.

    Records without a step (published metrics) are numbered per tag. Event files
    go to ``logdir`` (view them with ``tensorboard --logdir``), one of its own
    for each sink (a resumed run adds one); once closed, the sink writes nothing
    more. Each batch of records goes to the operating system at once, and the
    file is synced to disk every ``flush_secs`` seconds and at :meth:`flush`.
    :attr:`path` is the event file being written. A write that fails (a full
    disk) never raises: the sink warns once, keeps :attr:`error`, counts the
    records it could not write in :attr:`lost`, cuts the file back to its last
    whole event, and tries the next records. An event file deleted during the
    run (its logdir removed) is started again, with one warning, for the
    events from there on. Nothing is written through a symbolic link: a
    ``logdir`` that is one is refused with an ``OSError`` naming it (as a
    JSONL or CSV path that is one), and one put in its place mid-run fails the
    writes as a full disk does, until a real folder is back. No TensorFlow is
    needed. Needs
    ``pip install 'jaxhistory[tensorboard]'``.

    Examples:
        >>> import tempfile
        >>> from jaxhistory.sinks import Record, TensorBoardSink
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 0.5}))
        >>> sink.close()
    """

    all_processes = False

    def __init__(self, logdir: str | os.PathLike, flush_secs: float = 10):
        import_optional("tensorboardX", "the TensorBoard sink")
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import masked_crc32c
        from tensorboardX.summary import make_histogram

        self._event, self._summary = Event, Summary
        self._crc, self._histogram = masked_crc32c, make_histogram
        self.logdir = os.fspath(logdir)
        self.flush_secs = flush_secs
        self._counts: dict[str, int] = {}
        self._bins = _buckets()
        self._lock = threading.Lock()
        self._file = self._open()
        self._synced = time.monotonic()
        self._closed = False
        self._broken = False  # a failed write left half an event: start a file
        self._told: set[str] = set()
        self.error: BaseException | None = None  # the last failed write
        self.lost = 0  # records not written because writing failed

    def _open(self) -> Any:
        """A new event file in the logdir, opened with its version event."""
        name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_numbers)}"
        )
        # never through a link, given or put in its place mid-run (NotAFile)
        check_target(Path(self.logdir), folder=True)
        path = Path(self.logdir) / name
        f = open_log(path, real_folder=True)
        self.path = path
        try:
            version = self._event(wall_time=time.time(), file_version="brain.Event:2")
            f.write(self._frame(version))
            f.flush()
        except BaseException:
            f.close()
            raise
        return f

    def _frame(self, event: Any) -> bytes:
        """``event`` as one TFRecord: length, its checksum, data, its checksum."""
        data = event.SerializeToString()
        head = struct.pack("<Q", len(data))
        crc = self._crc
        return b"".join(
            (head, struct.pack("<I", crc(head)), data, struct.pack("<I", crc(data)))
        )

    def _step(self, tag: str, step: int | None) -> int:
        if step is not None:
            return step
        n = self._counts.get(tag, 0)
        self._counts[tag] = n + 1
        return n

    def _events(self, record: Record) -> list[bytes]:
        """The framed events of ``record``: one for all the scalars of a record
        with a step, one per value otherwise and per histogram."""
        Value = self._summary.Value
        out, scalars = [], []
        for tag, number, arr in values(record):
            if number is not None:
                if record.step is None:
                    value = Value(tag=tag, simple_value=number)
                    out.append(self._one([value], self._step(tag, None), record))
                else:
                    scalars.append(Value(tag=tag, simple_value=number))
                continue
            assert arr is not None  # values gives an array where no number
            step = self._step(tag, record.step)
            finite = arr[np.isfinite(arr)].astype(np.float64).reshape(-1)
            if finite.size:
                with np.errstate(over="ignore"):  # sums past 1e308 are inf
                    histo = self._histogram(finite, self._bins)
                out.append(self._one([Value(tag=tag, histo=histo)], step, record))
        if scalars and record.step is not None:  # gathered only with a step
            out.append(self._one(scalars, record.step, record))
        return out

    def _one(self, values: list, step: int, record: Record) -> bytes:
        summary = self._summary(value=values)
        event = self._event(summary=summary, step=step, wall_time=record.timestamp)
        return self._frame(event)

    def write(self, record: Record) -> None:
        self.write_batch(Batch.of([record]))

    def write_batch(self, batch: Batch) -> None:
        """Writes the events of every record of ``batch`` in one go."""
        with self._lock:
            if self._closed:
                written_after_close(self, self.logdir)
                return
            records = list(batch.records())
            try:
                data = b"".join(e for r in records for e in self._events(r))
                if self._broken:
                    self._restart()
                elif os.fstat(self._file.fileno()).st_nlink == 0:
                    self._warn(
                        "deleted",
                        f"TensorBoard event file {printable(self.path)} was deleted "
                        "while the run wrote it; a new one is started in "
                        f"{self.logdir}, with the events from here on (the "
                        "history keeps every step)",
                    )
                    self._restart()
                self._append(data)
                if time.monotonic() - self._synced >= self.flush_secs:
                    self._sync()
            except Exception as err:  # a full disk must not stop the training
                self.lost += len(records)
                self.error = err
                self._warn(
                    "write",
                    f"TensorBoard {self.logdir}: writing failed ({err!r}); "
                    f"{len(records)} record(s) not written, later ones are tried",
                )

    def _append(self, data: bytes) -> None:
        """Appends ``data`` to the event file, past Python's buffer; where that
        fails, cuts the file back to where it ended (a reader stops at half an
        event), or, where that fails too, marks it broken: the next write
        starts a new one."""
        fd = self._file.fileno()
        end = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            try:
                os.ftruncate(fd, end)
            except Exception:
                self._broken = True
            raise

    def _restart(self) -> None:
        """Closes the event file and opens a new one (the caller holds the lock);
        where opening fails, the sink stays broken: the next write tries again."""
        self._broken = True
        old = self._file
        try:
            old.close()
        except Exception as err:  # its buffer may not reach a full disk
            self.error = err
        self._file = self._open()
        self._broken = False

    def _sync(self) -> None:
        self._synced = time.monotonic()
        os.fsync(self._file.fileno())

    def _warn(self, key: str, text: str) -> None:
        if key not in self._told:
            self._told.add(key)
            warn_quietly(text, stacklevel=4)

    def flush(self) -> None:
        with self._lock:
            if self._closed or self._broken:
                return
            try:
                self._sync()
            except Exception as err:
                self._broken, self.error = True, err

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            try:
                self._file.close()
            except Exception as err:
                self.error = err
