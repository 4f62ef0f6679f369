"""File writes every output shares: whole files atomically, logs by appending."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # Windows: logs are not guarded against a second writer
    fcntl = None

__all__ = ["LogInUse", "WriteError", "atomic_write", "in_use", "open_log"]


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Calls ``write(tmp)`` then renames ``tmp`` to ``path``: never half a file.

    The temporary file sits beside ``path`` (same file system, so the rename is
    atomic) and is removed if ``write`` fails; the old file is then untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # RuntimeError: netCDF's "HDF error"
        _unlink_quietly(tmp)
        raise WriteError(path, err) from err
    except BaseException:
        _unlink_quietly(tmp)
        raise


class WriteError(OSError):
    """An output file could not be written; the file that was there is intact."""

    def __init__(self, path: Path, cause: BaseException):
        message = (
            f"cannot write {path}: {type(cause).__name__}: {cause} (any earlier "
            "version of the file is unchanged)"
        )
        errno = getattr(cause, "errno", None)
        if errno is None:
            super().__init__(message)
        else:
            super().__init__(errno, message)
        self.path = path


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


class LogInUse(OSError):
    """A log another live writer (in this process or another) holds open."""

    def __init__(self, path: Path):
        super().__init__(
            f"{path} is being written by another live writer; two runs must not "
            "share one log (give each its own run_name or jsonl_path)"
        )
        self.path = path


def _lock(f: BinaryIO, path: Path) -> None:
    """Holds an exclusive advisory lock on ``f`` until it is closed (where the
    system has ``fcntl``); raises :class:`LogInUse` if another writer has it."""
    if fcntl is None:
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LogInUse(path) from None
    except OSError:  # a file system without locks: write unguarded
        return


def in_use(path: Path) -> bool:
    """Whether a live writer holds the log at ``path``."""
    if fcntl is None or not Path(path).is_file():
        return False
    try:
        with open(path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def open_log(path: Path, overwrite: bool = False) -> BinaryIO:
    """Opens a line log for writing: truncated, or appended to.

    When appending to a file whose last line was cut off (a killed run), a newline
    is written first, so the next line starts on a line of its own and the cut
    line stays the only damaged one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if overwrite and in_use(path):  # opening "wb" would truncate it first
        raise LogInUse(path)
    f = open(path, "wb" if overwrite else "ab")  # noqa: SIM115 (the caller closes)
    try:
        _lock(f, path)
        if not overwrite and f.tell():
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write(b"\n")
                    f.flush()
    except BaseException:
        f.close()
        raise
    return f
