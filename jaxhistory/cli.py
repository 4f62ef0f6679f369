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
import os
import shutil
import sys
from pathlib import Path

from jaxhistory._env import ENV_LABELS
from jaxhistory._version import __version__
from jaxhistory.export._finalize import finalize
from jaxhistory.export._load import load_run, run_file
from jaxhistory.export._markdown import stats_table
from jaxhistory.export._units import MAX_PLOTS
from jaxhistory.launch import LaunchError, launch_local
from jaxhistory.trace import merge_traces

__all__ = ["load_run", "main"]


def _warmup(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("warmup must be >= 0")
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
    "steps left out of the statistics and plots: a fraction of the steps below 1 "
    "(0.05) or a number of steps (10); default: the warmup recorded with the run "
    "(a dataset file), else 0"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    report.add_argument("--warmup", type=_warmup, default=None, help=WARMUP_HELP)
    report.add_argument(
        "--num-chains",
        type=int,
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
    summary.add_argument("--warmup", type=_warmup, default=None, help=WARMUP_HELP)
    merge = sub.add_parser(
        "merge-traces", help="merge Chrome trace files onto one clock"
    )
    merge.add_argument("traces", nargs="+", help="trace files (.json or .json.gz)")
    merge.add_argument("-o", "--output", required=True, help="the merged file")
    launch = sub.add_parser(
        "launch", help="run a function in N local JAX processes forming one job"
    )
    launch.add_argument("target", help="the function: package.module:function")
    launch.add_argument("args", nargs="*", help="arguments for it (as strings)")
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
        print(f"jaxhistory: {err}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as err:
        print(f"jaxhistory: {err}", file=sys.stderr)
        return 2
    for pid, result in enumerate(results):
        if result is not None:
            print(f"[process {pid}] returned {result!r}")
    return 0


def _merge(args) -> int:
    missing = [p for p in args.traces if not Path(p).is_file()]
    if missing:
        print(f"jaxhistory: no trace file {missing[0]}", file=sys.stderr)
        return 2
    try:
        out = merge_traces(args.traces, args.output)
    except (OSError, ValueError) as err:
        print(f"jaxhistory: {err}", file=sys.stderr)
        return 2
    print(f"merged {len(args.traces)} trace file(s) into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns its exit status (2: a bad or unreadable run)."""
    args = _parser().parse_args(argv)
    try:
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
    try:
        state, attrs = load_run(args.run)
    except (OSError, ValueError) as err:
        print(f"jaxhistory: {err}", file=sys.stderr)
        return 2
    if not len(state):
        print(f"jaxhistory: {args.run} holds no complete record", file=sys.stderr)
        return 2
    if args.warmup is None:  # the warmup the run's own report used
        args.warmup = float(attrs.get("warmup_steps", 0))
    if args.command == "summary":
        print("\n".join(stats_table(state, args.warmup)), flush=True)
        return 0
    source = run_file(args.run)
    outdir = Path(args.outdir)
    if source.suffix == ".jsonl":
        run_id = attrs.get("run_id") or source.stem  # older logs: the file name
        log = outdir / source.name  # the log keeps its timestamps: copy it
        outdir.mkdir(parents=True, exist_ok=True)
        if not log.exists() or not log.samefile(source):
            shutil.copyfile(source, log)
    else:
        run_id = attrs.get("run_id")
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
    )
    print(f"wrote the outputs of {args.run} to {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
