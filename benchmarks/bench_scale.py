"""Benchmark: finalize on runs with many metrics and many key sets.

Two runs, each recorded into a HistoryState, then written by
``jaxhistory.export.finalize`` into a fresh folder:

* ``1,000 metrics x 200 steps, with plots``: 1,000 scalar metrics in 20 groups,
  one update per step with all of them; finalize with plots (the default
  ``max_plots=200``: 200 PNGs and 200 terminal plots, the rest named in the
  report; the dataset, the JSONL log, the report). Target: under 30 s on a
  2-core machine. Beside it, once, the same with every metric plotted
  (``max_plots=None``: 1,000 PNGs and 1,000 terminal plots), for its cost.
* ``10,000 key sets, no plots``: 10,000 updates, each with a metric of its own
  (``sample/{i}``) beside ``loss`` (a new key set every update); finalize without
  plots. Target: under 5 s.

Each figure is the median of ``--repeats`` runs (default 3), with the time to
record the updates beside it.

Run: ``make bench`` or ``python benchmarks/bench_scale.py [--out PATH]``;
``--quick`` is a smoke run (30 metrics, 1,000 key sets, one repeat, without the
every-metric-plotted row).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TITLE = "## finalize at scale"
HEADER = "| run | record s | finalize s (median) | target | files |"


def many_metrics(n: int, steps: int):
    import jaxhistory as jh

    s = jh.HistoryState()
    rng = np.random.default_rng(0)
    names = [f"g{i // 50}/m{i}" for i in range(n)]
    for step in range(steps):
        s = s.update(
            dict(zip(names, rng.normal(size=n).tolist(), strict=True)), step=step
        )
    return s


def many_key_sets(n: int):
    import jaxhistory as jh

    s = jh.HistoryState()
    for i in range(n):
        s = s.update({f"sample/{i}": float(i), "loss": 1.0 / (i + 1)}, step=i)
    return s


def measure(make, plot: bool, repeats: int, max_plots=200) -> tuple:
    from jaxhistory import export

    records, finals, files = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = make()
        records.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            written: list = []
            t0 = time.perf_counter()
            export.finalize(
                state,
                tmp,
                run_id="bench",
                plot=plot,
                echo=False,
                written=written,
                max_plots=max_plots,
            )
            finals.append(time.perf_counter() - t0)
            files = len(written)
    return statistics.median(records), statistics.median(finals), files


def bench(metrics: int, key_sets: int, repeats: int, every: bool = True) -> str:
    """The table; ``every``: with the every-metric-plotted row."""
    rows = [HEADER, "|---|---:|---:|---|---:|"]
    runs = (
        (
            f"{metrics:,} metrics x 200 steps, with plots",
            lambda: many_metrics(metrics, 200),
            True,
            30.0,
            200,
            repeats,
        ),
        (
            f"{metrics:,} metrics x 200 steps, every one plotted (max_plots=None)",
            lambda: many_metrics(metrics, 200),
            True,
            None,
            None,
            1,
        ),
        (
            f"{key_sets:,} key sets, no plots",
            lambda: many_key_sets(key_sets),
            False,
            5.0,
            200,
            repeats,
        ),
    )
    for label, make, plot, target, cap, times in runs if every else runs[::2]:
        record, final, files = measure(make, plot, times, cap)
        if target is None:
            verdict = "(one run, for its cost)"
        else:
            met = "met" if final < target else "**missed**"
            verdict = f"< {target:g} s: {met}"
        rows.append(f"| {label} | {record:.2f} | {final:.2f} | {verdict} | {files} |")
        print(rows[-1], flush=True)
    settings = (
        f"Median of {repeats} run(s) each. 'record s' is the time to build the "
        "state; 'finalize s' writes the dataset, the JSONL log, the report and, "
        "with plots, a PNG and a terminal plot per plotted metric (PNGs drawn by "
        "one worker process per core; at most max_plots=200 metrics by default)."
    )
    return "\n".join([TITLE, "", settings, "", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        table = bench(30, 1000, 1, every=False)
    else:
        table = bench(1000, 10000, args.repeats)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import machine_info, report

    report(machine_info(), args.quick, [table], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
