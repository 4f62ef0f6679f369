"""What History's constructor works out before the first update: the run to
resume and the sinks this process writes to."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from jaxhistory._codec import read_run_id
from jaxhistory._distributed import agreed_run_id
from jaxhistory._dtypes import as_step, is_whole
from jaxhistory._env import check_run_id, check_run_name, env_flag, new_run_id
from jaxhistory._history_state import HistoryState
from jaxhistory._names import printable
from jaxhistory._run_log import RunLog, log_target, set_aside
from jaxhistory._writer import warn_quietly
from jaxhistory.export._load import load_run, run_file
from jaxhistory.sinks import WandbSink
from jaxhistory.sinks._base import is_sink, writes_here
from jaxhistory.sinks._named import (
    SINKS_VARIABLE,
    check_folder,
    env_sink_names,
    named_sinks,
    sink_names,
)
from jaxhistory.sinks._wandb import wandb_run

__all__ = [
    "check_not_erased",
    "check_options",
    "open_outputs",
    "resumed",
    "run_id_for",
    "run_identity",
    "sinks_here",
    "use_wandb_ignored",
]


def check_options(keys: Any, log_every: Any, memory: Any) -> int:
    """Checks History's ``keys``, ``log_every`` and ``memory``; returns how many
    updates apart memory is sampled (0: never)."""
    if keys is not None and (
        isinstance(keys, str) or not all(isinstance(k, str) for k in keys)
    ):
        raise TypeError(f"keys must be a sequence of metric names, got {keys!r}")
    if not is_whole(log_every) or log_every < 1:
        raise ValueError(f"log_every must be a positive int, got {log_every!r}")
    if memory is True or memory is False:
        return int(memory)
    if not is_whole(memory) or memory < 1:
        raise ValueError(
            f"memory must be True/False or a positive int (every N updates), "
            f"got {memory!r}"
        )
    return int(memory)


def check_not_erased(log: Path | None, jsonl_path: Path | None, overwrite: bool):
    """Refuses ``jsonl_overwrite`` of the log a run resumes from."""
    if log is not None and overwrite and jsonl_path == log:
        raise ValueError(
            f"jsonl_overwrite=True would erase {log}, the log this run resumes from"
        )


def run_identity(
    resume: Any,
    resume_step: int | None,
    run_name: str | None,
    jsonl_path: Path | None,
    report_dir: Path | None,
    overwrite: bool,
) -> tuple[HistoryState | None, str, Path | None]:
    """Who a new History is: the state it starts from (None: empty), its run
    id and its JSONL log's path. A resumed run keeps its id and, where neither
    ``jsonl_path`` nor ``report_dir`` says otherwise, appends to its own log;
    a new one takes an id no log under ``report_dir`` has, the same on every
    process of a job (:func:`~jaxhistory._distributed.agreed_run_id`)."""
    check_run_name(run_name)
    state = resumed_id = log = None
    if resume is not None or resume_step is not None:
        state, resumed_id, log = resumed(resume, resume_step, run_name)
        if log is not None and jsonl_path is None and report_dir is None:
            jsonl_path = log  # the run's own log goes on
        check_not_erased(log, jsonl_path, overwrite)
    run_id = resumed_id or agreed_run_id(
        run_id_for(run_name, None if jsonl_path is not None else report_dir),
        run_name,
    )
    if resume is None and resume_step is None and not overwrite:
        check_not_shared(log_target(jsonl_path, report_dir, run_id), run_id)
    # the abandoned attempt's lines leave the log the run appends to (the
    # log given as resume, or this run's own log where resume named its
    # dataset, its folder or a state)
    target = log_target(jsonl_path, report_dir, run_id)
    if (
        resume_step is not None
        and target is not None
        and (target == log or last_run(target) == (True, run_id))
    ):
        set_aside(target, as_step("resume_step", resume_step), run_id)
    return state, run_id, jsonl_path


def last_run(log: Path | None) -> tuple[bool, str | None]:
    """Whether ``log`` is a file (no link) that holds something, and the run
    id on its last line that has one (None: none); (False, None) for a log
    that cannot be read."""
    try:
        if log is None or not os.path.isfile(log) or os.path.islink(log):
            return False, None
        if not os.path.getsize(log):
            return False, None
        return True, read_run_id(log)
    except (OSError, ValueError):
        return False, None


def check_not_shared(log: Path | None, run_id: str) -> None:
    """Warns where a new (not resumed) run is to append to ``log`` and ``log``
    holds records of another run: every reader takes the lines of both for
    one run. (A restart that continues its steps by hand has done this on
    purpose; ``resume=`` says so.) A link, or a log that cannot be read, is
    left to :class:`RunLog` and the writer."""
    held_any, other = last_run(log)
    if not held_any or other == run_id:
        return
    held = f"the run {printable(other)}" if other else "records of another run"
    warn_quietly(
        f"the JSONL log {printable(log)} holds {held}; this run "
        f"({printable(run_id)}) appends to it, and every reader will take the "
        "two for one run. To continue that run pass "
        f"resume={printable(log)!r}; to replace its log, jsonl_overwrite=True; "
        "else give this run a jsonl_path of its own",
        stacklevel=4,  # (History(...) in the caller's code)
    )


def run_id_for(run_name: str | None, report_dir: Path | None) -> str:
    """A new run id; with ``report_dir`` (the log goes there) one whose log
    does not exist yet (an earlier run, or another process's started in the
    same second, has the id: the next one is taken)."""
    taken = None
    if report_dir is not None:
        taken = lambda run_id: (report_dir / f"{run_id}.jsonl").exists()
    return new_run_id(run_name, taken)


def resumed(resume: Any, resume_step: int | None, run_name: str | None):
    """(state, run id, log) of the run ``resume`` names: a HistoryState, a JSONL
    log (the run id on its lines, else its name; History goes on appending to
    it), a dataset file or a finalize folder; records at ``resume_step`` and
    later are left out (the steps a restart from an earlier checkpoint records
    again)."""
    log = None
    if resume is None:
        raise ValueError("resume_step needs resume= (the run to continue)")
    if isinstance(resume, HistoryState):
        state, run_id = resume, dict(resume.attrs).get("run_id")
        source: str | Path = "the HistoryState given as resume"
    elif isinstance(resume, str | os.PathLike):
        try:
            state, attrs = load_run(resume)  # as `jaxhistory report` reads a run
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"resume: no run log or dataset at {resume} ({err})"
            ) from None
        path = source = run_file(resume)
        if path.suffix == ".jsonl":  # the run id of its lines (older logs: its name)
            run_id, log = attrs.get("run_id") or path.stem, path
        else:
            run_id = attrs.get("run_id")
    else:
        raise TypeError(
            "resume takes a HistoryState, a JSONL log, a dataset file or a finalize "
            f"folder, got {type(resume).__name__}"
        )
    check_run_id(run_id, source)  # it names the log: never a path
    if run_name is not None:
        raise ValueError(
            "resume continues the run with its own run id; give run_name only to a "
            "new run"
        )
    if resume_step is not None:
        step = as_step("resume_step", resume_step)
        state = state.before(step)
    return state, run_id, log


def sinks_here(
    sinks: Sequence[Any] | str | None,
    use_wandb: bool | None,
    folder: Path | None = None,
    run_id: str = "run",
    overwrite: bool = False,
) -> tuple:
    """The sinks this process writes to (process 0 only, unless a sink says
    ``all_processes``), with a W&B sink added when ``use_wandb`` asks for one.

    ``sinks``: sinks; or sink names, ``"console,csv,tensorboard,wandb"``
    (:mod:`jaxhistory.sinks._named`: files go into ``folder``, named after
    ``run_id``, a CSV file appended to unless ``overwrite``); or None: the
    names in ``JAXHISTORY_SINKS``, else none. Names are the whole list: a W&B
    sink is added for ``wandb`` among them (unless ``use_wandb`` is False or
    ``WANDB_DISABLED`` is set), not for an active run alone. Names are checked
    on every process (so every process raises the same error), sinks made on
    process 0."""
    names = None
    if sinks is None:
        names = env_sink_names()
        source = f"{SINKS_VARIABLE}={os.environ.get(SINKS_VARIABLE)!r}"
        sinks = ()
    elif isinstance(sinks, str):
        source = f"sinks={sinks!r}"
        names = sink_names(sinks, source)
        sinks = ()
    if not isinstance(sinks, Sequence):
        raise TypeError(f"sinks must be a sequence of sinks, got {sinks!r}")
    for sink in sinks:
        if isinstance(sink, str):
            raise TypeError(
                f"sinks holds the name {printable(sink)!r}: names are given as one "
                "string, "
                f"sinks={printable(','.join(n for n in sinks if isinstance(n, str)))!r}"
                ", not in a list "
                "(a list holds sink objects)"
            )
        if not is_sink(sink):
            raise TypeError(
                f"{type(sink).__name__} is not a sink: it needs write, flush and close"
            )
    if use_wandb not in (None, True, False):
        raise ValueError(f"use_wandb must be True, False or None, got {use_wandb!r}")
    if names is not None:
        check_folder(names, folder, source)
    if use_wandb is None:
        if names is None:
            wanted = wandb_run() is not None and not env_flag("WANDB_DISABLED")
        else:
            wanted = "wandb" in names and not env_flag("WANDB_DISABLED")
    else:
        wanted = use_wandb
    out = list(sinks)
    if jax.process_index() != 0:
        return tuple(s for s in out if writes_here(s))
    made = named_sinks(names or (), folder, run_id, overwrite, wandb=False)
    out += made
    if wanted and not any(isinstance(s, WandbSink) for s in out):
        try:
            out.append(WandbSink())  # on process 0, where the run is
        except BaseException:
            for sink in made:
                sink.close()
            raise
    return tuple(s for s in out if writes_here(s))


def open_outputs(
    sinks: Sequence[Any] | str | None,
    use_wandb: bool | None,
    jsonl_path: Path | None,
    report_dir: Path | None,
    run_id: str,
    overwrite: bool,
    on_stats: Callable,
) -> tuple[tuple, RunLog]:
    """The sinks of this process (:func:`sinks_here`, named sinks writing into
    ``report_dir``, else the log's folder) and the :class:`RunLog` that feeds
    them and streams the JSONL log (:func:`log_target`). Where the log cannot
    be made, the sinks made here from names are closed again."""
    folder = report_dir
    if folder is None and jsonl_path is not None:
        folder = jsonl_path.parent
    made = sinks_here(sinks, use_wandb, folder, run_id, overwrite)
    given = () if sinks is None or isinstance(sinks, str) else tuple(sinks)
    try:
        log_path = log_target(jsonl_path, report_dir, run_id)
        return made, RunLog(log_path, overwrite, run_id, made, on_stats)
    except BaseException:
        for sink in made:  # the ones made here from names
            if not any(sink is s for s in given):
                with contextlib.suppress(Exception):
                    sink.close()
        raise


def use_wandb_ignored(use_wandb: Any, sinks: Sequence[Any]) -> str:
    """The warning that ``update(use_wandb=...)`` is ignored; a ValueError for
    anything but True/False."""
    if use_wandb not in (True, False):
        raise ValueError(f"use_wandb must be True, False or None, got {use_wandb!r}")
    has = any(isinstance(s, WandbSink) for s in sinks)
    now = "every update goes to" if has else "this History has no"
    return (
        f"update(use_wandb={use_wandb}) is ignored ({now} W&B sink): "
        "jaxhistory decides W&B once, with History(use_wandb=...) or "
        f"sinks= ({SINKS_VARIABLE}=wandb), and sends every update to "
        "every sink; this warning is given once per History"
    )
