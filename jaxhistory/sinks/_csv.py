"""CsvSink: one CSV row per record, appended and handed to the OS at once."""

from __future__ import annotations

import csv
import io
import os
import re
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from jaxhistory._dtypes import as_flag
from jaxhistory._env import not_a_name
from jaxhistory._files import (
    LogInUse,
    atomic_write,
    check_target,
    in_use,
    open_log,
    still_folder,
)
from jaxhistory._names import printable
from jaxhistory._record import Batch, Record
from jaxhistory.sinks._base import FileSink, values

__all__ = ["CsvSink", "csv_column"]

FIRST = ("step", "timestamp")  # the columns every row starts with
_RESERVED = re.compile(r"(?:step|timestamp)_*")
# first characters of a cell a spreadsheet runs as a formula (and the quote
# that marks text)
_FORMULA = frozenset("=+-@\t\r'")
HEADER_LIMIT = 1 << 24  # bytes read looking for the end of an existing header


def csv_column(name: str) -> str:
    """The column of metric ``name``: the name itself, except that a metric
    named ``step`` or ``timestamp`` (or one of those with trailing ``_``) gets
    one more ``_``, so it never takes the place of the record's own step or
    timestamp (``step`` -> ``step_``, ``step_`` -> ``step__``), and a name
    that a spreadsheet would run as a formula (one starting with ``=``,
    ``+``, ``-``, ``@``, a tab or a carriage return; or with ``'``, so that
    two names stay two columns) gets a leading ``'``, which spreadsheets
    read as "text".

    Examples:
        >>> from jaxhistory.sinks._csv import csv_column
        >>> csv_column("train/loss"), csv_column("step"), csv_column("step_")
        ('train/loss', 'step_', 'step__')
        >>> csv_column("=HYPERLINK(1)"), csv_column("'=x")
        ("'=HYPERLINK(1)", "''=x")
    """
    if name[:1] in _FORMULA:
        return f"'{name}"
    return f"{name}_" if _RESERVED.fullmatch(name) else name


def _row_text(rows: Sequence[Sequence[Any]]) -> bytes:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue().encode("utf-8", "surrogatepass")


def _header_end(data: bytes) -> int | None:
    """Where the first CSV record of ``data`` ends (after its newline; a quoted
    field may hold newlines), or None if it does not end in ``data``."""
    quotes, start = 0, 0
    while True:
        newline = data.find(b"\n", start)
        if newline < 0:
            return None
        quotes += data.count(b'"', start, newline)
        if quotes % 2 == 0:
            return newline + 1
        start = newline + 1


def _cut_partial_row(path: Path) -> None:
    """Removes a row a killed writer cut off at the end of ``path`` (a CSV row
    has no way of saying it is incomplete: a cut number reads as another)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return
    with os.fdopen(fd, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        if not end:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        keep, chunk = end, 1 << 16
        while keep > 0:  # back to the last newline (or to nothing at all)
            start = max(keep - chunk, 0)
            f.seek(start)
            newline = f.read(keep - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        f.truncate(keep)


def _read_header(path: Path) -> tuple[list[str], int]:
    """The columns of the CSV file at ``path`` and where its header ends
    (``[], 0`` for no file or an empty one); ValueError naming the file if it
    is no CSV file of :class:`CsvSink` (its header must start
    ``step,timestamp``)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, by the with)
    except FileNotFoundError:
        return [], 0
    with f:
        data, end = b"", None
        while end is None and len(data) < HEADER_LIMIT:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            data += chunk
            end = _header_end(data)
    if not data:
        return [], 0
    why = None
    if end is None:
        why = "its first row does not end"
    else:
        try:
            header = next(csv.reader(io.StringIO(data[:end].decode("utf-8"))))
        except (UnicodeDecodeError, csv.Error, StopIteration) as err:
            why = f"its header cannot be read ({err})"
        else:
            if tuple(header[:2]) != FIRST:
                why = f"its header starts {header[:2]!r}, not ['step', 'timestamp']"
            elif len(set(header)) != len(header):
                why = "its header names a column twice"
    if why is not None:
        raise ValueError(
            f"cannot append to {printable(path)}: "
            f"{why}, so it is no CSV file of this sink; "
            "nothing was written (give another path, or overwrite=True)"
        )
    assert end is not None  # why is set where it is None
    return header, end


def _numbers(record: Record):
    """``(name, number, None)`` for each scalar of ``record``: at once where
    every value is a Python number (as History hands them over), else through
    :func:`~jaxhistory.sinks.values` (arrays left out)."""
    if record.group is None:
        out = []
        for part in (record.metrics, record.aggregated):
            for name, value in part.items():
                kind = type(value)
                if kind is not float and kind is not int and kind is not bool:
                    return [v for v in values(record) if v[1] is not None]
                out.append((name, value, None))
        return out
    return [v for v in values(record) if v[1] is not None]


class CsvSink(FileSink):
    """Appends one CSV row per record: ``step``, ``timestamp``, then a column
    per scalar value (metrics, then cross-device statistics; published metrics
    as ``{group}/{name}`` with an empty step).

    The header is the first record's names. A later record with names the
    header lacks widens it: the file is rewritten once with the new columns at
    the end and the earlier rows given empty cells there (written beside it
    and renamed, so a crash leaves the old file or the new one), then
    appending goes on; a record without some column leaves its cell empty.
    Widening copies the file, so a run that adds names at every step pays for
    it; after :attr:`MAX_COLUMNS` columns, new names are left out of the file
    (one warning; the history keeps them). Array metrics are left out (the
    dataset has them). Numbers are written exactly (the shortest text that
    reads back as the same float), NaN and infinities as ``nan``, ``inf``,
    ``-inf``, booleans as ``True``/``False``. A metric named ``step`` or
    ``timestamp`` gets a ``_`` appended (:func:`csv_column`).

    Crash-safe like :class:`~jaxhistory.sinks.JsonlSink`: each batch goes to the
    operating system at once, so a process killed with SIGKILL leaves every
    complete row; appending to a file (``overwrite=False``, the default, so a
    resumed run continues its file, where a step recorded again gets a second
    row: the later one holds), first removes a row a killed run cut off,
    and reads the columns from the file's header, which must start with
    ``step,timestamp`` (else ValueError, nothing written). A file a live
    writer holds is refused (:class:`~jaxhistory._files.LogInUse`). Writing
    never raises: a failed write (a full disk) warns once, keeps
    :attr:`error`, counts the records it could not write in :attr:`lost` and
    starts the next row on a new line.

    :meth:`log_table` writes a whole table (History's ``training_history`` at
    ``finalize``) to ``{stem}.{key}.csv`` beside the file.

    Args:
        path: the CSV file.
        overwrite: truncate an existing file instead of appending to it.

    Examples:
        >>> import tempfile, pathlib
        >>> from jaxhistory.sinks import CsvSink, Record
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> sink = CsvSink(path)
        >>> sink.write(Record(step=1, timestamp=0.5, metrics={"loss": 0.25}))
        >>> second = {"loss": 0.125, "lr": 0.1}  # a new name widens the header
        >>> sink.write(Record(step=2, timestamp=1.5, metrics=second))
        >>> sink.close()
        >>> print(path.read_text(), end="")
        step,timestamp,loss,lr
        1,0.5,0.25,
        2,1.5,0.125,0.1
    """

    all_processes = False
    MAX_COLUMNS = 16384

    def __init__(self, path: str | os.PathLike, overwrite: bool = False):
        overwrite = as_flag("overwrite", overwrite)
        self.path = Path(path)
        columns: list[str] = []
        end = 0
        if not overwrite:
            check_target(self.path)
            if in_use(self.path):
                raise LogInUse(self.path)
            # checked before anything is changed: a file that is not ours is
            # left exactly as it is
            columns, end = _read_header(self.path)
            _cut_partial_row(self.path)
        self._file: BinaryIO = open_log(self.path, overwrite)
        # a folder that is no link now: one put in its place later is refused
        self._folder_was_link = self.path.parent.is_symlink()
        self._columns, self._header_end = columns, end
        self._index = {name: k for k, name in enumerate(self._columns)}
        self._column_of: dict[str, str] = {}  # metric name -> its column
        self._lock = threading.Lock()
        self._broken = False  # the last write may have stopped mid-row
        self._warned: set[str] = set()
        self.error: BaseException | None = None  # the last failed write
        self.lost = 0  # records not written because writing failed
        self.widened = 0  # times the header was widened

    @property
    def columns(self) -> tuple[str, ...]:
        """The file's columns so far (empty before the first record)."""
        with self._lock:
            return tuple(self._columns)

    # ----- writing -----------------------------------------------------------------
    def write(self, record: Record) -> None:
        self.write_batch(Batch.of([record]))

    def write_batch(self, batch: Batch) -> None:
        """Writes one row per record of ``batch`` (widening the header first
        where they bring new names), in one write."""
        parsed = [
            (record.step, record.timestamp, self._cells(record))
            for record in batch.records()
        ]
        with self._lock:
            if self._file.closed:
                self._after_close()
                return
            head = b""
            rows, new = self._rows(parsed)
            if new or not self._columns:
                room = self.MAX_COLUMNS - max(len(self._columns), len(FIRST))
                if len(new) > room:
                    self._warn(
                        "columns",
                        f"CSV {printable(self.path)}: more than {self.MAX_COLUMNS} "
                        "columns; "
                        "later new names are left out of it (the history keeps "
                        "them)",
                    )
                    new = new[: max(room, 0)]
                if not self._columns:
                    head = self._start(new)
                elif new:
                    self._widen(new)
                rows, _ = self._rows(parsed)  # with the columns they have now
            self._append(head + _row_text(rows), len(parsed))

    def _cells(self, record: Record) -> list[tuple[str, Any]]:
        """``(column, number)`` for each scalar of ``record``."""
        column_of = self._column_of
        cells = []
        for name, number, _ in _numbers(record):
            column = column_of.get(name)
            if column is None:
                column = column_of[name] = csv_column(name)
            cells.append((column, number))
        return cells

    def _rows(self, parsed: list) -> tuple[list[list[Any]], list[str]]:
        """The rows of ``parsed`` records in the current columns, and the
        columns they name that the file lacks, in order (the caller holds the
        lock)."""
        index, blank = self._index, [""] * (len(self._columns) - len(FIRST))
        rows: list[list[Any]] = []
        new: dict[str, None] = {}  # an ordered set
        for step, stamp, cells in parsed:
            row: list[Any] = [
                "" if step is None else step,
                "" if stamp is None else stamp,
                *blank,
            ]
            for column, number in cells:
                k = index.get(column)
                if k is None:
                    new[column] = None
                else:
                    row[k] = number
            rows.append(row)
        return rows, list(new)

    def _start(self, names: list[str]) -> bytes:
        """The header of a new file (the caller holds the lock)."""
        self._columns = [*FIRST, *names]
        self._index = {name: k for k, name in enumerate(self._columns)}
        head = _row_text([self._columns])
        self._header_end = len(head)
        return head

    def _append(self, text: bytes, count: int) -> None:
        try:
            if self._header_end and os.fstat(self._file.fileno()).st_nlink == 0:
                self._reopen()
            if self._broken:
                self._file.write(b"\n")
                self._broken = False
            self._file.write(text)
            self._file.flush()
        except Exception as err:  # a full disk must not stop the training
            self._broken = True
            self.lost += count
            self.error = err
            self._warn(
                "write",
                f"CSV {printable(self.path)}: writing failed ({err!r}); "
                f"{count} record(s) "
                "not written, later ones are tried",
            )

    def _reopen(self) -> None:
        """The file was deleted while this sink wrote it (its folder removed,
        a clean-up): starts a new one at :attr:`path` with the header, for
        the rows from here on (the caller holds the lock)."""
        self._warn(
            "deleted",
            f"CSV {printable(self.path)} was deleted while the run wrote it; "
            "a new one is "
            "started there, with the rows from here on (the history keeps "
            "every step)",
        )
        new = open_log(self.path, real_folder=not self._folder_was_link)
        self._file.close()
        head = _row_text([self._columns])
        new.write(head)
        self._file, self._header_end, self._broken = new, len(head), False

    def _widen(self, names: list[str]) -> None:
        """Rewrites the file with ``names`` added to the header and empty cells
        for them in every earlier row, then appends to the new file (the caller
        holds the lock). Where that fails the file stays as it was, and the
        rows are written without the new columns."""
        columns = [*self._columns, *names]
        head = _row_text([columns])
        pad = b"," * len(names)
        old = self._file

        def write(tmp: Path) -> None:
            old.flush()
            old.seek(self._header_end)
            with open(tmp, "wb") as out:
                out.write(head)
                for line in old:
                    if line.endswith(b"\r\n"):  # a row csv.writer ended
                        out.write(line[:-2] + pad + b"\n")
                    elif line.endswith(b"\n"):
                        out.write(line[:-1] + pad + b"\n")
                    else:  # a row cut by a failed write: ended, as appending does
                        out.write(line + b"\n")

        try:
            still_folder(self.path.parent, self._folder_was_link)
            atomic_write(self.path, write)
            new = open_log(self.path, real_folder=not self._folder_was_link)
        except Exception as err:
            self.error = err
            self._warn(
                "widen",
                f"CSV {printable(self.path)}: cannot add the columns {names[:3]!r}... "
                f"({err!r}); they are left out of the file until that works "
                "(the history keeps them)",
            )
            return
        old.close()
        self._file, self._broken = new, False
        self._columns = columns
        self._index = {name: k for k, name in enumerate(columns)}
        self._header_end = len(head)
        self.widened += 1

    def _warn(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence) -> Path:
        """Writes a whole table to ``{stem}.{key}.csv`` beside the file (None
        cells empty), replacing an earlier one at once (written beside it and
        renamed); returns its path. History calls it at ``finalize`` with
        the run's ``training_history``
        (:func:`~jaxhistory.sinks.training_history`).

        Raises:
            ValueError: ``key`` is not a plain name (a path, ``..``, control
                characters).
            OSError: the file cannot be written (its earlier version stays).
        """
        why = not_a_name(key, 100) if isinstance(key, str) else "it is not a str"
        if why is not None:
            raise ValueError(f"table name {key!r:.80} is not a name ({why})")
        path = self.path.with_name(f"{self.path.stem}.{key}.csv")
        text = _row_text(
            [list(columns), *([("" if c is None else c) for c in r] for r in rows)]
        )
        atomic_write(path, lambda tmp: tmp.write_bytes(text))
        return path
