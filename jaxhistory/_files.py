"""File writes every output shares: whole files atomically, logs by appending.

Nothing here writes through a symbolic link it did not make: a target that is a
link, a folder, a device or a pipe is refused with an error naming it, and the
temporary files sit in a private folder with an unpredictable name, so a link
planted beside the target cannot redirect a write.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from jaxhistory._names import printable

try:
    import fcntl
except ImportError:  # Windows: logs are not guarded against a second writer
    fcntl = None  # type: ignore[assignment]  # checked for None where used

__all__ = [
    "LogInUse",
    "NotAFile",
    "WriteError",
    "as_path",
    "atomic_write",
    "check_folder",
    "check_target",
    "in_use",
    "kind_of",
    "open_log",
    "pid_alive",
    "read_regular",
    "remove_stale",
    "still_folder",
]

FULL_BELOW = 1 << 20  # bytes free under which a failed write is put down to space
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# a file opened inside a folder held open (where the system can): the folder
# checked and used in one step, so a link swapped in between is never followed
_IN_FOLDER = bool(_DIRECTORY and _NOFOLLOW) and os.open in os.supports_dir_fd
# The private folder of one atomic write: .{name}.{pid}.{random}.tmp
_TMP = re.compile(r"\.(?P<name>.*)\.(?P<pid>\d+)\.[A-Za-z0-9_]{8}\.tmp")


class NotAFile(OSError):
    """An output path that holds something other than a regular file (a
    symbolic link, a folder, a device, a pipe), or other than a folder where
    one is written into: never written through, left as it is."""

    def __init__(self, path: Path, what: str, expected: str = "a regular file"):
        super().__init__(
            f"refusing to write {path}: it is {what}, not {expected} (left as "
            "it is; remove it or choose another path)"
        )
        self.errno = errno.EEXIST  # set apart: the message reads without it
        self.path = path


def as_path(name: str, value: object) -> Path:
    """``value`` as a Path; a TypeError naming ``name`` unless it is a str or
    an ``os.PathLike``."""
    if isinstance(value, str | os.PathLike):
        return Path(value)
    raise TypeError(f"{name} must be a path (a str or os.PathLike), got {value!r:.60}")


def check_folder(name: str, path: Path) -> None:
    """:class:`NotAFile` naming ``name`` where ``path`` exists and is not a
    folder (a link to one is a folder here)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as failed:
        if failed.errno in (errno.ENAMETOOLONG, errno.ENOTDIR):  # never writable
            shown = printable(str(path))
            if len(shown) > 120:
                shown = f"{shown[:100]}... ({len(shown)} characters)"
            why = (
                "the path is longer than the system allows"
                if failed.errno == errno.ENAMETOOLONG
                else "a part of the path is a file, not a folder"
            )
            error = OSError(f"{name}: {why}: {shown}")
            error.errno = failed.errno
            raise error from None
        return  # absent (made when written) or unreadable (said when written)
    if not stat.S_ISDIR(mode):
        err = NotAFile(Path(path), kind_of(mode), "a folder")
        err.args = (f"{name}: {err}",)
        raise err


def still_folder(folder: Path, was_link: bool) -> None:
    """Raises :class:`NotAFile` where ``folder`` was no symbolic link when it
    was first written into (``was_link``) and is one now: a link put in its
    place during the run, by someone else, is never written or deleted
    through (a link the user gave is followed, as it was)."""
    if not was_link and os.path.islink(folder):
        raise NotAFile(
            Path(folder), "a symbolic link put in place of the folder", "a folder"
        )


def kind_of(mode: int) -> str:
    """What an ``os.lstat`` mode is, in words ("a symbolic link", ...)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "an unknown kind of file"


def check_target(path: Path, folder: bool = False) -> None:
    """Raises :class:`NotAFile` unless ``path`` is absent or a regular file (a
    folder, with ``folder=True``); a symbolic link is refused whatever it points
    to, so nothing is written or deleted through one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if folder and not stat.S_ISDIR(mode):
        raise NotAFile(Path(path), kind_of(mode), "a folder")
    if not folder and not stat.S_ISREG(mode):
        raise NotAFile(Path(path), kind_of(mode))


def _short(name: str, limit: int = 100) -> str:
    """``name`` cut to at most ``limit`` bytes of UTF-8 (a whole character)."""
    return name.encode("utf-8", "surrogateescape")[:limit].decode("utf-8", "ignore")


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Calls ``write(tmp)`` then renames ``tmp`` to ``path``: never half a file.

    ``tmp`` has the name of ``path`` and lies in a new private folder beside it
    (same file system, so the rename is atomic; created with an unpredictable
    name, so nothing planted there is written through), removed afterwards or
    if ``write`` fails; the old file is then untouched. A ``path`` that is a
    symbolic link, a folder, a device or a pipe is refused (:class:`NotAFile`).
    A failure is a :class:`WriteError` naming ``path``; one on a full disk says
    "no space left on device". The private folders of writes to ``path`` that
    a killed process left are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_target(path)
    remove_stale(path.parent, path.name)
    try:
        folder = Path(
            tempfile.mkdtemp(
                prefix=f".{_short(path.name)}.{os.getpid()}.",
                suffix=".tmp",
                dir=path.parent,
            )
        )
    except OSError as err:
        raise WriteError(path, err) from err
    tmp = folder / path.name
    try:
        write(tmp)
        check_target(path)  # not made a link meanwhile
        os.replace(tmp, path)
    except NotAFile:
        raise
    except (OSError, RuntimeError) as err:  # RuntimeError: netCDF's "HDF error"
        error = WriteError(path, err)  # before the temporary frees its space
        raise error from err
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def disk_full(folder: Path, cause: BaseException) -> bool:
    """Whether ``cause``, an error writing into ``folder``, came from a full
    disk: its errno says so, or the file system has under 1 MiB free (libraries
    such as netCDF report a full disk as "HDF error" or "Permission denied")."""
    if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(folder).free < FULL_BELOW
    except OSError:
        return False


class WriteError(OSError):
    """An output file could not be written; the file that was there is intact."""

    def __init__(self, path: Path, cause: BaseException):
        code = getattr(cause, "errno", None)
        if disk_full(Path(path).parent, cause):
            code = errno.ENOSPC
            said = f"{type(cause).__name__}: {cause}"
            what = f"no space left on device (the write failed with {said})"
        else:
            what = f"{type(cause).__name__}: {cause}"
        message = (
            f"cannot write {path}: {what} (any earlier version of the file is "
            "unchanged)"
        )
        super().__init__(message)
        self.errno = code  # set apart: the message reads without "[Errno n]"
        self.path = path


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (this process counts)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or no way to tell: keep its files
        return True
    return True


def remove_stale(
    folder: Path, name: str | None = None, patterns: tuple[re.Pattern, ...] = ()
) -> list[Path]:
    """Removes from ``folder`` what writers killed before they finished left:
    the private folders of :func:`atomic_write` (of writes to ``folder/name``,
    or to any file when ``name`` is None), and the entries whose names match
    one of ``patterns`` (whose group ``pid`` is the writer's process id). Only real
    folders and files whose process is no longer alive; symbolic links are never
    followed nor removed. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    short = None if name is None else _short(name)
    for entry in entries:
        match = _TMP.fullmatch(entry.name)
        if match is not None and short is not None and match["name"] != short:
            match = None
        for pattern in patterns:
            if match is None:
                match = pattern.fullmatch(entry.name)
        if match is None or pid_alive(int(match["pid"])):
            continue
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                shutil.rmtree(entry.path)  # refuses a link; follows none inside
            elif stat.S_ISREG(mode):
                os.unlink(entry.path)
            else:
                continue
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


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
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file at ``path`` (a link to one is read).
    Anything else raises ValueError naming it: a pipe, which would block the
    reader until something writes into it, a device, a folder. Opened without
    blocking, then checked, so nothing swapped in after a check blocks either."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK)
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not a regular file") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is {kind_of(mode)}, not a regular file")
        if _NONBLOCK and fcntl is not None:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            fd = -1  # (closed with f)
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def _open_folder(folder: Path) -> int:
    """A descriptor of ``folder``, opened without following a link; one that
    is a link, or no folder, is :class:`NotAFile`."""
    try:
        return os.open(folder, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    check_target(folder, folder=True)  # says what it is
    raise NotAFile(folder, "a symbolic link", "a folder")  # swapped back since


def open_log(
    path: Path, overwrite: bool = False, real_folder: bool = False
) -> BinaryIO:
    """Opens a line log for writing: truncated, or appended to.

    A ``path`` that is a symbolic link (dangling or not), a folder, a device or
    a pipe is refused (:class:`NotAFile`): the log is opened without following
    a link. With ``real_folder``, so is a folder of the log that is a link
    (the log opened inside the folder held open, where the system allows, so a
    link swapped in after the check is refused too). When appending to a file
    whose last line was cut off (a killed run), a newline is written first, so
    the next line starts on a line of its own and the cut line stays the only
    damaged one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_target(path)
    if overwrite and in_use(path):  # truncating would cut a live writer's log
        raise LogInUse(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | _NOFOLLOW | _NONBLOCK
    folder_fd = None
    if real_folder and _IN_FOLDER:
        folder_fd = _open_folder(path.parent)
    elif real_folder:
        check_target(path.parent, folder=True)
    try:
        if folder_fd is None:
            fd = os.open(path, flags, 0o666)
        else:
            fd = os.open(path.name, flags, 0o666, dir_fd=folder_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:  # made a link since the check
            raise NotAFile(path, "a symbolic link") from None
        raise
    finally:
        if folder_fd is not None:
            os.close(folder_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFile(path, kind_of(mode))
        if _NONBLOCK and fcntl is not None:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    f = os.fdopen(fd, "a+b")
    try:
        _lock(f, path)
        if overwrite:
            f.truncate(0)  # only once the lock is ours
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")  # appended, wherever the position is
                f.flush()
    except BaseException:
        f.close()
        raise
    return f
