"""The ``jaxhistory`` command: outputs and statistics of a saved run.

``jaxhistory report RUN -o OUTDIR`` regenerates every output (dataset, plots,
terminal plots, report, JSONL) from a run's JSONL log or ``dataset.nc``;
``jaxhistory summary RUN`` prints its statistics table; ``jaxhistory merge-traces
A.json B.json -o merged.json`` merges Chrome trace files onto one clock;
``jaxhistory launch -n 4 module:function`` runs a function in 4 local JAX
processes that form one job, their output prefixed with ``[process i]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import stat
import sys
import warnings
from pathlib import Path

from jaxhistory._dtypes import warmup_count
from jaxhistory._env import ENV_LABELS, check_run_id
from jaxhistory._files import atomic_write, kind_of
from jaxhistory._names import printable
from jaxhistory._version import __version__
from jaxhistory.export._finalize import finalize
from jaxhistory.export._load import load_run, run_file
from jaxhistory.export._markdown import md_escape, stats_table, terminal_cell
from jaxhistory.export._units import MAX_PLOTS
from jaxhistory.launch import LaunchError, launch_local
from jaxhistory.trace import merge_traces

__all__ = ["load_run", "main"]


def _warmup(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"warmup must be a number >= 0 (a fraction below 1 or a number of "
            f"steps), got {text!r}"
        )
    return value


def _num_chains(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"num-chains must be a whole number >= 1, got {text!r}"
        )
    return value


def _max_plots(text: str) -> int | None:
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"max-plots must be a number or 'all', got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError("max-plots must be >= 0")
    return value


WARMUP_HELP = (
    "steps left out of the {what}: a fraction of the steps below 1 "
    "(0.05) or a number of steps (10); default: the warmup recorded with the run "
    "(a dataset file), else 0"
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (control characters
    escaped), pointing at ``--help`` instead of printing the usage."""

    launch: argparse.ArgumentParser | None = None  # the launch command's

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {printable(message)} (see --help)\n")


def _parser() -> _Parser:
    parser = _Parser(
        prog="jaxhistory",
        description=__doc__.replace("``", ""),  # plain text, not reST, in --help
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"jaxhistory {__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="regenerate every output of a saved run")
    report.add_argument("run", help="a run's JSONL log, dataset.nc or output folder")
    report.add_argument("-o", "--outdir", required=True, help="where to write")
    report.add_argument(
        "--warmup",
        type=_warmup,
        default=None,
        help=WARMUP_HELP.format(what="statistics and plots"),
    )
    report.add_argument(
        "--num-chains",
        type=_num_chains,
        default=128,
        help="series drawn per array metric in its ridge and heatmap plots",
    )
    report.add_argument("--no-plots", action="store_true", help="skip the plots")
    report.add_argument(
        "--max-plots",
        type=_max_plots,
        default=MAX_PLOTS,
        help=f"plot at most this many metrics (default {MAX_PLOTS}; 'all' for all)",
    )
    report.add_argument(
        "--run-name", default=None, help="the run's name in the report's title"
    )
    summary = sub.add_parser("summary", help="print the statistics of a saved run")
    summary.add_argument("run", help="a run's JSONL log, dataset.nc or output folder")
    summary.add_argument(
        "--warmup",
        type=_warmup,
        default=None,
        help=WARMUP_HELP.format(what="statistics"),
    )
    merge = sub.add_parser(
        "merge-traces", help="merge Chrome trace files onto one clock"
    )
    merge.add_argument("traces", nargs="+", help="trace files (.json or .json.gz)")
    merge.add_argument("-o", "--output", required=True, help="the merged file")
    launch = sub.add_parser(
        "launch", help="run a function in N local JAX processes forming one job"
    )
    launch.add_argument("target", help="the function: package.module:function")
    launch.add_argument(
        "args",
        nargs="*",
        help="arguments for it (as strings), before or after the options; after "
        "'--', arguments that start with '-'",
    )
    launch.add_argument(
        "-n", "--num-processes", type=int, default=2, help="processes (default 2)"
    )
    launch.add_argument(
        "--devices-per-process",
        type=int,
        default=2,
        help="simulated CPU devices in each process (default 2)",
    )
    launch.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds for the whole job; past it every process is killed (600)",
    )
    launch.add_argument(
        "--output",
        default="stream",
        help="'stream' (every line as [process i] line, the default), a folder "
        "(process-{i}.log each) or 'none'",
    )
    parser.launch = launch
    return parser


def _launch(args) -> int:
    output = None if args.output == "none" else args.output
    try:
        results = launch_local(
            args.target,
            args.num_processes,
            args.devices_per_process,
            args=tuple(args.args),
            timeout=args.timeout,
            output=output,
        )
    except LaunchError as err:
        # One line a process, each escaped; the logs' tails only where they
        # were not streamed already.
        lines = err.summary.splitlines()
        if output is None:
            for pid, text in err.logs.items():
                lines += [f"----- process {pid} log -----", *text.splitlines()[-60:]]
        elif output != "stream":
            lines.append(f"each process's log: {output}/process-<i>.log")
        print(f"jaxhistory: {printable(lines[0])}", file=sys.stderr)
        for line in lines[1:]:
            print(printable(line), file=sys.stderr)
        return 1
    except (TypeError, ValueError) as err:
        return _fail(err)
    for pid, result in enumerate(results):
        if result is not None:
            print(f"[process {pid}] returned {result!r}")
    return 0


def _merge(args) -> int:
    for given in args.traces:
        if Path(given).is_dir():
            return _fail(
                f"{given} is a folder: give its trace files ({given}/*.json); "
                "a trace handler merges its own folder at close"
            )
        if not Path(given).is_file():
            return _fail(f"no trace file {given}")
    try:
        out = merge_traces(args.traces, args.output)
    except (OSError, ValueError) as err:
        return _fail(err)
    print(f"merged {len(args.traces)} trace file(s) into {printable(out)}")
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"jaxhistory: warning: {printable(message)}", file=sys.stderr)


def _fail(err: object) -> int:
    """Prints ``err`` as one line on stderr (control characters escaped);
    returns the status of a user error, 2."""
    print(f"jaxhistory: {printable(err)}", file=sys.stderr)
    return 2


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # the function's arguments may follow options
        assert parser.launch is not None  # _parser adds the launch command
        args = parser.launch.parse_intermixed_args(argv[1:])
        args.command = "launch"
        return args
    return parser.parse_args(argv)


def _check_not_poorer(run: str, outdir: Path) -> str | None:
    """Why a report from the JSONL log ``run`` must not go into ``outdir``: it
    holds a dataset.nc (finalize's, with the run's config, environment and
    dtypes, none of which a log records) that it would replace; or None."""
    try:
        source = run_file(run)
    except (OSError, ValueError):
        return None  # (said when it is loaded)
    dataset = outdir / "dataset.nc"
    if source.suffix != ".jsonl" or not dataset.is_file():
        return None
    return (
        f"{dataset} exists, and a report from the JSONL log {source} would "
        "replace it with less (a log records no config or environment, and "
        f"float32 metrics come back as float64): give another -o, or {outdir} "
        "itself as RUN; nothing was written"
    )


def _check_outdir(outdir: Path) -> str | None:
    """Why ``outdir`` cannot be the output folder (it exists and is not a
    folder, or is a link to nothing), or None."""
    try:
        mode = os.stat(outdir).st_mode
    except FileNotFoundError:
        if os.path.islink(outdir):
            return (
                f"the output folder {outdir} is a link to {os.readlink(outdir)}, "
                "which does not exist; nothing was written"
            )
        return None
    except OSError as err:
        return f"cannot use {outdir} as the output folder: {err.strerror}"
    if not stat.S_ISDIR(mode):
        return (
            f"the output folder {outdir} exists and is {kind_of(mode)}, not a "
            "folder; nothing was written"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns its exit status (2: a bad or unreadable run,
    an output that cannot be written)."""
    args = _parse(argv)
    try:
        with warnings.catch_warnings():
            # one line each, as the errors: no source line of jaxhistory's own
            warnings.showwarning = _show_warning
            return _main(args)
    except BrokenPipeError:  # `jaxhistory summary RUN | head`: the reader left
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error at exit
        return 0


def _main(args) -> int:
    if args.command == "merge-traces":
        return _merge(args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "report":
        why = _check_outdir(Path(args.outdir))
        if why is None:
            why = _check_not_poorer(args.run, Path(args.outdir))
        if why is not None:
            return _fail(why)
    try:
        state, attrs = load_run(args.run)
    except CRAFTED as err:
        return _fail(err)
    if not len(state):
        return _fail(f"{args.run} holds no complete record")
    if args.warmup is None:  # the warmup the run's own report used
        try:
            args.warmup = _recorded_warmup(attrs.get("warmup_steps", 0), args.run)
        except ValueError as err:
            return _fail(err)
    steps = len(state.all_steps())
    if steps and warmup_count(args.warmup, steps) >= steps:
        print(
            f"jaxhistory: warning: a warmup of {args.warmup:g} leaves none of the "
            f"run's {steps} steps: every statistic is over no records",
            file=sys.stderr,
        )
    if args.command == "summary":
        # markdown where it is piped (to paste); on a terminal, names as the
        # summary line shows them (max_abs, not max\_abs)
        escape = terminal_cell if sys.stdout.isatty() else md_escape
        table = stats_table(state, args.warmup, escape=escape)
        print("\n".join(table), flush=True)
        return 0
    try:
        _report(args, state, attrs)
    except CRAFTED as err:
        return _fail(err)
    print(f"wrote the outputs of {printable(args.run)} to {printable(args.outdir)}")
    return 0


# What a damaged or crafted log or dataset can raise while it is read or
# reported (an attribute of the wrong type, JSON nested past the stack): one
# line on stderr, never a traceback.
CRAFTED = (OSError, ValueError, TypeError, RecursionError)


def _recorded_warmup(value: object, source: object) -> float:
    """The ``warmup_steps`` recorded with a run: a number of steps (>= 0) or a
    fraction; ValueError naming ``source`` for anything else."""
    try:
        warmup = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        warmup = math.nan
    if not math.isfinite(warmup) or warmup < 0:
        raise ValueError(
            f"the warmup_steps recorded in {source} is {value!r:.40}, not a "
            "number of steps >= 0; pass --warmup"
        )
    return warmup


def _recorded(attrs: dict, name: str, source: Path) -> dict | None:
    """The config or env_info recorded with a run (JSON text in the dataset
    attribute ``name``); None where there is none, or where it is not a JSON
    object (with a note on stderr: the report leaves it out)."""
    text = attrs.get(name)
    if text is None:
        return None
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        print(
            f"jaxhistory: the {name} recorded in {printable(source)} is not a JSON "
            "object; the report leaves it out",
            file=sys.stderr,
        )
        return None
    return value


def _report(args, state, attrs) -> None:
    source = run_file(args.run)
    outdir = Path(args.outdir)
    run_id = check_run_id(attrs.get("run_id"), source)
    log: Path | None
    if source.suffix == ".jsonl":
        # older logs: the file name, checked before anything is written
        run_id = run_id or check_run_id(source.stem, source)
        log = outdir / source.name  # the log keeps its timestamps: copy it
        outdir.mkdir(parents=True, exist_ok=True)
        if not log.exists() or not log.samefile(source):
            atomic_write(log, lambda tmp: shutil.copyfile(source, tmp))
    else:
        log = outdir / f"{run_id}.jsonl" if run_id else None
        if log is not None and not log.is_file():
            log = None  # finalize writes one from the dataset
    finalize(
        state,
        outdir,
        run_id=run_id,
        environment={k: attrs[k] for k in ENV_LABELS if k in attrs},
        run_name=args.run_name,
        warmup=args.warmup,
        num_chains=args.num_chains,
        plot=not args.no_plots,
        max_plots=args.max_plots,
        echo=False,
        jsonl=log,
        config=_recorded(attrs, "config", source),
        env_info=_recorded(attrs, "env_info", source),
    )


if __name__ == "__main__":
    sys.exit(main())
