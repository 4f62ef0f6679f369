"""Where a Chrome trace handler writes: its folder and file name templates,
the values of their variables on this process, and the files a template names.

A template is a format string of the variables below; :func:`check_template`
rejects any other variable, and a file name that leaves the folder.
"""

from __future__ import annotations

import os
import random
import re
import socket
import string
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxhistory._files import NotAFile, check_target

__all__ = [
    "FILE_VARS",
    "FOLDER_VARS",
    "check_keep",
    "check_names",
    "check_template",
    "clear_earlier_files",
    "file_path",
    "leaves_folder",
    "link_below",
    "named_files",
    "prepare_folder",
    "ranks",
]

FOLDER_VARS = (
    "run_name",
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
)
FILE_VARS = (*FOLDER_VARS, "epoch", "batch", "step")


def check_template(
    template: str, allowed: tuple[str, ...], what: str, inside: bool = False
) -> None:
    """Checks a name template.

    Args:
        template: the format string.
        allowed: the variables it may use.
        what: the argument's name, for the message.
        inside: a path kept inside the folder (relative, no ``..`` part).

    Raises:
        ValueError: naming the unknown variable, or the path that leaves the
            folder.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{what} must be a non-empty str or a path (os.PathLike), got "
            f"{template!r:.80}"
        )
    if inside and leaves_folder(template):
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


def check_names(
    folder: str | os.PathLike, filename: str | os.PathLike, merged: Any
) -> tuple[str, str, str | None]:
    """Checks a handler's ``folder``, ``filename`` and ``merged_trace_filename``
    templates (:func:`check_template`): the file names inside the folder.
    Returns them as str (a path, any ``os.PathLike``, is the template its text
    spells)."""
    folder, filename, merged = (
        os.fsdecode(t) if isinstance(t, os.PathLike) else t
        for t in (folder, filename, merged)
    )
    check_template(folder, FOLDER_VARS, "folder")
    check_template(filename, FILE_VARS, "filename", inside=True)
    if merged is not None:
        check_template(merged, FOLDER_VARS, "merged_trace_filename", inside=True)
    return folder, filename, merged


def check_keep(num_traces_to_keep: Any) -> None:
    """ValueError unless ``num_traces_to_keep`` is -1 or a count >= 1."""
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


def file_path(
    folder: Path, template: str, names: dict, taken: list, overwrite: bool
) -> Path:
    """The trace file ``template`` names with ``names`` in ``folder``.

    Args:
        folder: the trace folder.
        template: the file name template.
        names: the variables' values, ``epoch``, ``batch`` and ``step`` included.
        taken: the files of this handler so far.
        overwrite: whether an existing file may be replaced.

    Raises:
        TypeError: ``epoch``, ``batch`` or ``step`` is not an int.
        ValueError: the name leaves the folder.
        FileExistsError: the file is one of ``taken``, or exists without
            ``overwrite``.
        NotAFile: the path is a link, a folder, a device or a pipe.
    """
    for key in ("epoch", "batch", "step"):
        value = names[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key} must be an int, got {value!r}")
    name = template.format(**names)
    if leaves_folder(name):
        raise ValueError(f"trace file name {name!r} leaves the folder")
    path = folder / name
    if path in taken or (path.exists() and not overwrite):
        raise FileExistsError(
            f"trace file {path} exists; give rotate() a new epoch, batch or step "
            "(or a filename with {step})"
        )
    check_target(path)  # never written through a link
    link = link_below(folder, path)
    if link is not None:  # nor through a linked folder inside the trace folder
        raise NotAFile(link, "a symbolic link", "a folder")
    return path


def link_below(folder: Path, path: Path) -> Path | None:
    """The first folder between ``folder`` and the file ``path`` in it that is
    a symbolic link (which the trace handler did not make: never written or
    deleted through), or None."""
    here = folder
    for part in path.relative_to(folder).parts[:-1]:
        here = here / part
        if here.is_symlink():
            return here
    return None


def leaves_folder(name: str) -> bool:
    """Whether a file name relative to a folder points outside it."""
    parts = re.split(r"[\\/]", name)
    return os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts


def ranks() -> dict[str, int]:
    """The folder variables of this process (``rank``, ``world_size`` and the
    node layout) and ``sync_id``, a number naming this clock sync: one
    all-gather of host names (also the barrier the clocks are synced at) when
    there are several processes."""
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


def prepare_folder(folder: Path, overwrite: bool, templates: list) -> None:
    """Readies ``folder`` for a new trace on every process at once.

    Without ``overwrite`` a folder holding files (hidden ones ignored) is
    refused; with it, the files named like ``templates`` are deleted. Every
    process checks before any writes, and all raise together (a process that
    raised alone would leave the others in the next barrier).

    Raises:
        FileExistsError: this or another process's folder is not empty.
    """
    problem = None if overwrite else _folder_problem(folder)
    if overwrite:  # before the barrier: no process has a file open yet
        clear_earlier_files(folder, templates)
    if _any_process(problem is not None):
        raise FileExistsError(
            problem
            or "a trace folder of another process is not empty; pass "
            "overwrite=True or use another folder"
        )


def clear_earlier_files(folder: Path, templates: list) -> None:
    """Deletes the regular files in ``folder`` named like ``templates`` (a trace
    file and the merged file: an earlier run's, of any rank and epoch); None
    entries are skipped, links are left alone."""
    for template in filter(None, templates):
        for path in named_files(folder, template):
            path.unlink(missing_ok=True)


def named_files(folder: Path, template: str) -> list[Path]:
    """The regular files in ``folder`` (subfolders too, where ``template``
    names some) named like ``template``, of any rank and epoch: none that is
    a link or lies below a folder that is one."""
    if not folder.is_dir():
        return []
    glob, pattern = _name_pattern(template)
    return [
        path
        for path in sorted(folder.glob(glob))
        if pattern.fullmatch(path.relative_to(folder).as_posix())
        and path.is_file()
        and not path.is_symlink()
        and link_below(folder, path) is None
    ]


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a barrier with several processes)."""
    if jax.process_count() == 1:
        return flag
    flags = multihost_utils.process_allgather(np.array([int(flag)], np.int32))
    return bool(np.asarray(flags).any())


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
