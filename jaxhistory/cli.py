"""The ``jaxhistory`` command: outputs and statistics of a saved run.

``jaxhistory report RUN -o OUTDIR`` regenerates every output (dataset, plots,
terminal plots, report, JSONL) from a run's JSONL log or ``dataset.nc``;
``jaxhistory summary RUN`` prints its statistics table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["load_run", "main"]


def load_run(path: str | Path):
    """The HistoryState in a JSONL log (``.jsonl``) or a dataset file (``.nc``)."""
    from jaxhistory._history import HistoryState

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run file: {path}")
    if path.is_dir():
        if (path / "dataset.nc").is_file():
            path = path / "dataset.nc"
        else:
            raise ValueError(f"{path} is a folder without a dataset.nc")
    if path.suffix == ".jsonl":
        return HistoryState.from_jsonl(path)
    if path.suffix in (".nc", ".nc4", ".netcdf"):
        return HistoryState.from_netcdf(path)
    raise ValueError(f"{path}: expected a .jsonl log or a .nc dataset")


_ENV_KEYS = (
    "python",
    "jax_version",
    "jaxlib_version",
    "backend",
    "device_kind",
    "device_count",
    "local_device_count",
    "process_count",
    "mesh",
    "hostname",
)


def _warmup(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("warmup must be >= 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxhistory", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="regenerate every output of a saved run")
    report.add_argument("run", help="a run's JSONL log, dataset.nc or output folder")
    report.add_argument("-o", "--outdir", required=True, help="where to write")
    report.add_argument("--warmup", type=_warmup, default=0.0)
    report.add_argument("--num-chains", type=int, default=128)
    report.add_argument("--no-plots", action="store_true", help="skip the plots")
    report.add_argument("--run-name", default=None)
    summary = sub.add_parser("summary", help="print the statistics of a saved run")
    summary.add_argument("run", help="a run's JSONL log, dataset.nc or output folder")
    summary.add_argument("--warmup", type=_warmup, default=0.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        state = load_run(args.run)
    except (OSError, ValueError) as err:
        print(f"jaxhistory: {err}", file=sys.stderr)
        return 2
    if args.command == "summary":
        from jaxhistory.export._markdown import stats_table

        print("\n".join(stats_table(state, args.warmup)))
        return 0
    from jaxhistory.export._finalize import finalize

    attrs = dict(state.attrs)
    run_id = Path(args.run).stem if Path(args.run).suffix == ".jsonl" else None
    recorded_env = {k: v for k, v in attrs.items() if k in _ENV_KEYS}
    finalize(
        state,
        args.outdir,
        run_id=run_id or attrs.get("run_id"),
        environment=recorded_env or None,
        run_name=args.run_name,
        warmup=args.warmup,
        num_chains=args.num_chains,
        plot=not args.no_plots,
        echo=False,
    )
    print(f"wrote the outputs of {args.run} to {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
