"""Merging Chrome trace files (of several processes, rotations or earlier
merges) into one file on one clock."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jaxhistory._files import NotAFile, atomic_write, check_target
from jaxhistory._names import printable
from jaxhistory._trace_file import sanitize
from jaxhistory._trace_read import load_trace, read_trace

__all__ = ["MERGED_MARK", "merge_folder", "merge_traces"]

MERGED_MARK = "jaxhistory merged trace"  # otherData["merged"] of a merged file


def _identity(e: dict) -> tuple:
    """What makes two merged events the same (times to the nanosecond: a merged
    file's times were shifted and are shifted back)."""

    def when(key):
        v = e.get(key)
        return round(v, 3) if isinstance(v, int | float) else v

    args = json.dumps(e.get("args"), sort_keys=True, default=str)
    return (e.get("pid"), e.get("tid"), e.get("ph"), e.get("name"), when("ts"),
            when("dur"), e.get("id"), args)  # fmt: skip


def _processes(events: list[dict], path: Path) -> dict[int | str | None, dict]:
    """Each process's clock sync (its ``clock_sync`` args), by pid; a ValueError
    naming the file and the argument for a pid or a sync that is malformed."""
    syncs: dict[int | str | None, dict] = {}
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
    try:
        check_target(out_path)
    except NotAFile:
        kind = "a link" if out_path.is_symlink() else "not a plain file"
        raise ValueError(
            f"the merged trace's path {out_path} exists and is {kind}; it is "
            "left as it is: give the merged trace a new file name"
        ) from None
    if not out_path.exists() or out_path.stat().st_size == 0:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            events, other = read_trace(out_path)
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
                printable(e["args"].get("run_name", e["args"].get("sync_id")))
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
        FileNotFoundError: an input that does not exist (naming it, and the
            argument order when ``out_path`` exists: Composer's
            ``merge_traces(output, *inputs)`` is the other way round).
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files = [Path(p) for p in paths]
    if not files:
        raise ValueError("merge_traces needs at least one trace file")
    for path in files:
        if not os.path.lexists(path):
            order = (
                "; the inputs come first and the output second: "
                "merge_traces(paths, out_path)"
                if os.path.lexists(out_path)
                else ""
            )
            raise FileNotFoundError(f"{path}: no such trace file{order}")
    loaded = []
    for path in files:
        events = load_trace(path)
        loaded.append((events, _processes(events, path)))
    out_path = Path(out_path)
    runs = {s.get("sync_id") for _, syncs in loaded for s in syncs.values()}
    _check_output(out_path, files, runs)
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
        json.dumps(sanitize(e), allow_nan=False, separators=(",", ":"))
        for e in itertools.chain(meta, rest)
    )
    other = json.dumps({"merged": MERGED_MARK, "files": len(files)})
    text = f'{{"otherData":{other},\n"traceEvents":[\n{lines}\n]}}\n'
    if out_path.name.endswith(".gz"):
        atomic_write(
            out_path, lambda tmp: tmp.write_bytes(gzip.compress(text.encode()))
        )
    else:
        atomic_write(out_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out_path


def merge_folder(folder: Path, merged: Path, also: Iterable[Path] = ()) -> Path | None:
    """Merges every trace file in ``folder`` and the files ``also`` (a trace
    handler's own, in subfolders; hidden files and ``merged`` itself left
    out) into ``merged``; returns it, or None where there is no trace or the
    merge failed (a warning then: this runs in the traced program, never
    raising into it)."""
    found = [
        p
        for p in sorted(folder.iterdir())
        if not p.name.startswith(".")
        and p.name.endswith((".json", ".json.gz"))
        and p.is_file()  # (not a pipe or a folder named like a trace)
    ]
    found += [p for p in also if p not in found]
    sources = [p for p in found if p != merged]
    if not sources:
        return None
    try:
        return merge_traces(sources, merged)
    except (OSError, ValueError) as err:
        with contextlib.suppress(Warning):
            warnings.warn(
                f"cannot write the merged trace {merged}: {err}",
                RuntimeWarning,
                stacklevel=3,
            )
    return None
