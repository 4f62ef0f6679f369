"""Benchmark: what publishing, timing, tracing and sinks cost per call.

Each row is the median over repeats of the mean time per call, the rows of a
table measured side by side in one run:

1. ``put_metric`` to the null default handler and to a handler that keeps the
   values; a ``@prof`` call of an empty function against the bare function.
2. ``StopWatch`` around an empty block: no trace handler, and with an active
   ``JSONTraceHandler`` (the span written as an ``X`` event); a trace
   ``counter`` event.
3. ``History.update`` of 10 Python floats on the training thread with no sinks,
   with a ``JsonlSink``, with a ``TensorBoardSink`` and with a ``CsvSink`` (the
   sinks are written by History's background thread; the table also gives the
   time until every record has been written and flushed, per record).
4. Untrusted sinks beside the crash-safe log: 12,000 updates into a History that
   streams its JSONL log, with no user sink, with a sink that takes 2 ms a record,
   and with a sink whose ``write`` never returns. For each: the time per update
   on the training thread, the lines in the log 1.5 s after the loop (before any
   ``flush`` or ``close``), how long ``close()`` takes, and the lines after it.

Run: ``make bench`` or ``python benchmarks/bench_publish.py [--out PATH]``;
``--quick`` is a smoke run.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from _common import machine_info, report

import jaxhistory
from jaxhistory import publish, sinks, trace


class Keep(publish.MetricHandler):
    def __init__(self):
        self.values = []

    def emit(self, metric_data):
        self.values.append(metric_data)


def per_call(fn, calls: int, repeats: int) -> float:
    """Median over repeats of the mean µs per call."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def bench_calls(calls: int, repeats: int, folder: Path) -> list[str]:
    rows = ["| call | µs/call |", "|---|---:|"]
    with publish.scoped():
        rows.append(
            f"| `put_metric` (null default handler) "
            f"| {per_call(lambda: publish.put_metric('x', 1.0), calls, repeats):.2f} |"
        )
        publish.configure(Keep())
        rows.append(
            f"| `put_metric` (a handler that keeps values) "
            f"| {per_call(lambda: publish.put_metric('x', 1.0), calls, repeats):.2f} |"
        )

        def empty():
            return None

        profiled = publish.prof(empty)
        bare = per_call(empty, calls, repeats)
        prof = per_call(profiled, calls, repeats)
        rows.append(f"| empty function | {bare:.2f} |")
        rows.append(f"| the same under `@prof` (3 metrics published) | {prof:.2f} |")

    def span():
        with jaxhistory.StopWatch("span"):
            pass

    rows.append(
        f"| `StopWatch` span, no trace handler | {per_call(span, calls, repeats):.2f} |"
    )
    with trace.JSONTraceHandler(folder=str(folder), merged_trace_filename=None) as t:
        traced = per_call(span, calls, repeats)
        counter = per_call(lambda: t.counter("loss", {"loss": 0.5}), calls, repeats)
    size = t.paths[0].stat().st_size
    events = len(trace.load_trace(t.paths[0]))
    rows.append(f"| `StopWatch` span, trace handler active | {traced:.2f} |")
    rows.append(f"| trace `counter` event | {counter:.2f} |")
    rows.append("")
    rows.append(
        f"Trace file: {events:,} events in {size / 2**20:.1f} MiB "
        f"({size / events:.0f} bytes per event)."
    )
    return rows


def bench_history(steps: int, repeats: int, folder: Path) -> list[str]:
    rows = [
        "| sinks | µs/update on the training thread | µs/record until written |",
        "|---|---:|---:|",
    ]
    data = [{f"m{j}": float(i + j) for j in range(10)} for i in range(steps)]
    makers = {
        "none": lambda i: [],
        "`JsonlSink`": lambda i: [sinks.JsonlSink(folder / f"s{i}.jsonl")],
        "`TensorBoardSink`": lambda i: [sinks.TensorBoardSink(folder / f"tb{i}")],
        "`CsvSink`": lambda i: [sinks.CsvSink(folder / f"c{i}.csv")],
    }
    results = {name: ([], []) for name in makers}
    for r in range(repeats):
        for name, make in makers.items():  # interleaved
            history = jaxhistory.History(
                distributed_history=False, sinks=make(f"{r}-{len(results[name][0])}")
            )
            start = time.perf_counter()
            for row in data:
                history.update(row, summarize=False)
            on_thread = time.perf_counter() - start
            history.flush()  # waits until the background thread has written all
            until_written = time.perf_counter() - start
            history.close()
            results[name][0].append(on_thread / steps * 1e6)
            results[name][1].append(until_written / steps * 1e6)
    for name, (thread, written) in results.items():
        rows.append(
            f"| {name} | {statistics.median(thread):.1f} "
            f"| {statistics.median(written):.1f} |"
        )
    return rows


class SlowSink:
    """A user sink that takes ``delay`` seconds a record."""

    def __init__(self, delay: float):
        self.delay, self.written = delay, 0

    def write(self, record):
        time.sleep(self.delay)
        self.written += 1

    def flush(self):
        pass

    def close(self):
        pass


class HungSink:
    """A user sink whose ``write`` does not return until ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()

    def write(self, record):
        self.release.wait()

    def flush(self):
        pass

    def close(self):
        pass


def count_lines(path: Path) -> int:
    """Complete lines in ``path`` (0 when it does not exist yet)."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def bench_untrusted(steps: int, folder: Path) -> list[str]:
    rows = [
        "| user sink | µs/update on the training thread | log lines 1.5 s after "
        "the loop | `close()` s | log lines after `close()` |",
        "|---|---:|---:|---:|---:|",
    ]
    data = [{f"m{j}": float(i + j) for j in range(10)} for i in range(steps)]
    makers = {
        "none": lambda: None,
        "2 ms a record": lambda: SlowSink(0.002),
        "`write` never returns": HungSink,
    }
    for k, (name, make) in enumerate(makers.items()):
        sink = make()
        report_dir = folder / f"untrusted{k}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the stuck sink's warning
            history = jaxhistory.History(
                distributed_history=False,
                report_dir=report_dir,
                sinks=[] if sink is None else [sink],
            )
            log = report_dir / f"{history.run_id}.jsonl"
            start = time.perf_counter()
            for row in data:
                history.update(row, summarize=False)
            on_thread = (time.perf_counter() - start) / steps * 1e6
            time.sleep(1.5)
            lines_after_loop = count_lines(log)
            start = time.perf_counter()
            history.close()
            closing = time.perf_counter() - start
        if isinstance(sink, HungSink):
            sink.release.set()
        rows.append(
            f"| {name} | {on_thread:.1f} | {lines_after_loop:,} of {steps:,} "
            f"| {closing:.2f} | {count_lines(log):,} of {steps:,} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    calls, steps, repeats = (500, 200, 2) if args.quick else (20_000, 5_000, 5)
    untrusted = 1_000 if args.quick else 12_000
    info = machine_info()
    print(info, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sections = [
            "## 1. Publishing, timing and tracing",
            "",
            f"{calls:,} calls per timing, median of {repeats} repeats.",
            "",
            *bench_calls(calls, repeats, folder / "trace"),
            "",
            "## 2. History with sinks",
            "",
            f"{steps:,} updates of 10 Python floats per timing, median of {repeats} "
            "repeats, settings interleaved.",
            "",
            *bench_history(steps, repeats, folder),
            "",
            "## 3. Untrusted sinks beside the crash-safe log",
            "",
            f"{untrusted:,} updates of 10 Python floats, one run per sink.",
            "",
            *bench_untrusted(untrusted, folder),
        ]
    report(info, args.quick, sections, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
