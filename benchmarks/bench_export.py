"""Benchmark: what finalize and the exporters cost.

Three measurements, side by side in one process:

1. ``History.finalize(plot=False)`` for 20,000 steps x 10 metrics: the dataset
   file, the JSONL log (written from the state) and the report.
2. ``History.finalize()`` with plots for the same history: also 10 PNGs and 10
   terminal plots.
3. ``jaxhistory.export.to_netcdf`` of 1,000,000 steps x 16 float64 metrics.

Each is repeated and the median wall time reported, with each part of finalize
timed on its own as well. Targets: 1. <= 0.1 s, 2. <= 5 s, 3. <= 5 s.

``python benchmarks/bench_export.py [--out PATH] [--repeats R] [--quick]``
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import numpy as np

import jaxhistory
from jaxhistory import export


def machine_info() -> str:
    return (
        f"jax {jax.__version__}, python {sys.version.split()[0]}, "
        f"{jax.device_count()} devices, platform {jax.default_backend()}, "
        f"os.cpu_count()={os.cpu_count()}"
    )


def make_history(steps: int, metrics: int, jsonl: Path) -> jaxhistory.History:
    """A History of ``steps`` updates whose JSONL log streamed to ``jsonl``."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=(steps, metrics)).cumsum(axis=0) / 100
    names = [f"train/m{j}" for j in range(metrics)]
    h = jaxhistory.History(distributed_history=False, jsonl_path=jsonl)
    for i in range(steps):
        h.update(dict(zip(names, values[i].tolist(), strict=True)), summarize=False)
    return h


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    if jax.device_count() != 8:
        print(f"expected 8 devices, got {jax.device_count()}", file=sys.stderr)
        return 1
    steps, big = (2_000, 100_000) if args.quick else (20_000, 1_000_000)
    repeats = args.repeats or (2 if args.quick else 5)
    big_repeats = args.repeats or (2 if args.quick else 3)
    print(machine_info(), flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        history = make_history(steps, 10, root / "stream.jsonl")
        history.flush()
        state = history.state
        state.values("train/m0")  # everything in NumPy before timing
        unstreamed = jaxhistory.History(distributed_history=False)
        unstreamed.state = state
        quiet = io.StringIO()

        def fin(h, plot: bool):
            with redirect_stdout(quiet):
                h.finalize(root / "fin", plot=plot)

        fin(history, True)  # warm-up: imports matplotlib, xarray, netCDF4, plotext
        parts = {
            "finalize(plot=False), JSONL streamed during the run": lambda: fin(
                history, False
            ),
            "finalize(plot=False), JSONL written by finalize": lambda: fin(
                unstreamed, False
            ),
            "finalize() with plots, JSONL streamed": lambda: fin(history, True),
            "  to_netcdf": lambda: export.to_netcdf(state, root / "d.nc"),
            "  to_jsonl": lambda: export.to_jsonl(state, root / "r.jsonl"),
            "  to_markdown": lambda: export.to_markdown(state, root / "r.md"),
            "  to_png (10 PNGs)": lambda: export.to_png(state, root / "png"),
            "  to_terminal (10 plots)": lambda: export.to_terminal(state, root / "t"),
        }
        times = {k: [] for k in parts}
        for r in range(repeats):  # interleaved
            for name, fn in parts.items():
                times[name] += timed(fn, 1)
            print(f"finalize: repeat {r + 1}/{repeats} done", flush=True)
        targets = {
            "finalize(plot=False), JSONL streamed during the run": 0.1,
            "finalize(plot=False), JSONL written by finalize": 0.1,
            "finalize() with plots, JSONL streamed": 5.0,
        }
        for name, ts in times.items():
            med = statistics.median(ts)
            target = targets.get(name)
            mark = f"≤ {target:g} s: {verdict(med <= target)}" if target else ""
            rows.append((f"{steps:,} x 10", name, med, min(ts), max(ts), mark))

        rng = np.random.default_rng(1)
        s = jaxhistory.HistoryState()
        block = rng.normal(size=(big, 16))
        s = s.extend(np.arange(big), {f"m{j}": block[:, j] for j in range(16)})
        ts = timed(lambda: export.to_netcdf(s, root / "big.nc"), big_repeats)
        size = (root / "big.nc").stat().st_size
        med = statistics.median(ts)
        rows.append(
            (
                f"{big:,} x 16",
                "to_netcdf",
                med,
                min(ts),
                max(ts),
                f"≤ 5 s: {verdict(med <= 5.0)}",
            )
        )
        back = jaxhistory.HistoryState.from_netcdf(root / "big.nc")
        if not np.array_equal(back.values("m3"), s.values("m3")):
            raise AssertionError("the 1M-step file does not read back exactly")

    lines = [
        machine_info(),
        f"{'--quick' if args.quick else 'full run'}; median of {repeats} repeats "
        f"({big_repeats} for the big file), parts interleaved",
        "",
        "| history | what | median s | min s | max s | target |",
        "|---|---|---:|---:|---:|---|",
        *(
            f"| {h} | {w} | {m:.3f} | {lo:.3f} | {hi:.3f} | {t} |"
            for h, w, m, lo, hi, t in rows
        ),
        "",
        f"The {big:,} x 16 file is {size / 2**20:.0f} MiB and reads back exactly.",
    ]
    text = "\n".join(lines) + "\n"
    print()
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
