"""Benchmark: what memory reports cost.

Three measurements, each side by side in one run:

1. ``History.update`` of 10 Python floats with ``memory=False``, ``memory=True``
   (host RSS and device memory every update) and ``memory=10``, while 100 and
   1,000 JAX arrays are alive (on CPU, device memory in use is the bytes of the
   live arrays, so its cost grows with their number).
2. ``MemoryTracker`` stage ``start`` + ``stop`` (RSS and device memory read twice,
   the sampling thread started and joined).
3. The sampling thread's cost to the program it measures: a fixed NumPy workload
   timed with no stage running and inside a stage (5 ms sampling interval).

Run: ``make bench`` or ``python benchmarks/bench_memory.py [--out PATH]``;
``--quick`` is a smoke run.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine_info, report

import jaxhistory


def time_updates(memory, steps: int) -> float:
    """µs per History.update of 10 floats."""
    history = jaxhistory.History(distributed_history=False, memory=memory)
    rows = [{f"m{j}": float(i + j) for j in range(10)} for i in range(steps)]
    start = time.perf_counter()
    for row in rows:
        history.update(row, summarize=False)
    elapsed = time.perf_counter() - start
    if history.state.count("m0") != steps:
        raise AssertionError("not every step was recorded")
    return elapsed / steps * 1e6


def bench_history(steps: int, repeats: int) -> list[str]:
    rows = [
        "| live JAX arrays | `memory=False` µs/update | `memory=True` µs/update "
        "| `memory=10` µs/update | memory sample cost µs |",
        "|---:|---:|---:|---:|---:|",
    ]
    keep = []
    for live in (100, 1000):
        while len(keep) < live:
            keep.append(jnp.full((256,), float(len(keep))))
        jax.block_until_ready(keep)
        times = {m: [] for m in (False, True, 10)}
        for _ in range(repeats):  # settings interleaved
            for memory in times:
                times[memory].append(time_updates(memory, steps))
        off, on, tenth = (statistics.median(times[m]) for m in (False, True, 10))
        rows.append(
            f"| {len(jax.live_arrays())} | {off:.1f} | {on:.1f} | {tenth:.1f} "
            f"| {on - off:.0f} |"
        )
    return rows


def bench_tracker(repeats: int) -> list[str]:
    tracker = jaxhistory.MemoryTracker()
    times = []
    for i in range(repeats * 20):
        start = time.perf_counter()
        tracker.start(f"s{i % 3}")
        tracker.stop(f"s{i % 3}")
        times.append(time.perf_counter() - start)
    return [
        "| measurement | median ms | min ms | max ms |",
        "|---|---:|---:|---:|",
        f"| `MemoryTracker` start + stop | {statistics.median(times) * 1e3:.2f} "
        f"| {min(times) * 1e3:.2f} | {max(times) * 1e3:.2f} |",
    ]


def workload() -> float:
    a = np.random.default_rng(0).normal(size=(300, 300))
    start = time.perf_counter()
    for _ in range(60):
        a = np.tanh(a @ a.T / 300.0)
    return time.perf_counter() - start


def bench_sampler(repeats: int) -> list[str]:
    tracker = jaxhistory.MemoryTracker(interval=0.005)
    plain, sampled = [], []
    workload()  # warm up
    for _ in range(repeats):  # paired: the same workload without and with a stage
        plain.append(workload())
        with tracker.stage("work"):
            sampled.append(workload())
    ratios = [s / p for p, s in zip(plain, sampled, strict=True)]
    return [
        "| workload | median s | time ratio, in a stage / without (median of "
        "paired repeats) |",
        "|---|---:|---:|",
        f"| 60 x (300x300 matmul + tanh), no stage | {statistics.median(plain):.3f} "
        "| 1.000 |",
        f"| the same inside `tracker.stage(...)` | {statistics.median(sampled):.3f} "
        f"| {statistics.median(ratios):.3f} |",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    steps, repeats = (200, 2) if args.quick else (2000, 5)
    info = machine_info()
    print(info, flush=True)
    sections = [
        "## 1. History.update with memory metrics",
        "",
        f"10 Python floats per update, {steps} updates per timing, median of "
        f"{repeats} repeats, settings interleaved. The last column is the cost of "
        "one memory sample: `memory=True` minus `memory=False`.",
        "",
        *bench_history(steps, repeats),
        "",
        "## 2. Stage start and stop",
        "",
        *bench_tracker(repeats),
        "",
        "## 3. The sampling thread",
        "",
        *bench_sampler(repeats),
    ]
    report(info, args.quick, sections, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
