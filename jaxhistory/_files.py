"""File writes every output shares: whole files atomically, logs by appending."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "open_log"]


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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_log(path: Path, overwrite: bool = False) -> BinaryIO:
    """Opens a line log for writing: truncated, or appended to.

    When appending to a file whose last line was cut off (a killed run), a newline
    is written first, so the next line starts on a line of its own and the cut
    line stays the only damaged one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "wb" if overwrite else "ab")  # noqa: SIM115 (the caller closes)
    try:
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
