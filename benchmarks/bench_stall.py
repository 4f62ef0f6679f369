"""Benchmark: how fast a multi-process History notices a stalled or slow process.

Real processes started with :func:`jaxhistory.launch_local` (JAX's
multi-controller runtime on 127.0.0.1), 1 simulated CPU device each.

* Hang report: 3 processes record a host scalar every 50 ms with
  ``History(hang_timeout=T)``; at step 20 process 1 stops inside a
  ``StopWatch`` span, by sleeping (``T + 6`` s) or by ``SIGSTOP`` (after
  ``T / 2`` s in the span; woken by process 0 once both others have reported).
  The figure is the time from entering the span (its last step) to the report
  on each other process (target: within ``T + 5`` s), for T = 2 and 5 s.
  Beside it, the training thread's cost of the watch: the time
  ``HangWatch.beat`` takes per update (measured alone, in this process).
* Straggler flags: 3 processes step every 50 ms with
  ``History(straggler_window=W)``; one process takes 10% (or 20%) longer before
  each update, or none does. The figures are the updates and seconds from the
  start to the first flag on process 0, and the number of flags raised in runs
  of equal processes (false alarms; target 0).

Run: ``make bench`` or ``python benchmarks/bench_stall.py [--out PATH]``;
``--quick`` is a smoke run (one case of each, fewer updates).
"""

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

STEP_S = 0.05
TITLE = "## Noticing a stalled or slow process"


def _hang_worker(how: str, timeout: float) -> dict:
    """Runs in every process: process 1 stops at step 20."""
    import logging
    import os
    import signal
    import threading

    import jax

    import jaxhistory as jh
    from jaxhistory._distributed import distributed_client

    client = distributed_client()
    me = jax.process_index()
    reports = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "may hang" in record.getMessage() and not reports:
                reports.append(time.time())
                client.key_value_set(f"bench/reported/{me}", "1")

    logging.getLogger("jaxhistory").addHandler(Catch())
    history = jh.History(distributed_history=True, hang_timeout=timeout)
    if me == 0 and how == "stop":

        def wake():  # once both others have reported
            for other in (0, 2):
                client.blocking_key_value_get(f"bench/reported/{other}", 120_000)
            pid = int(client.blocking_key_value_get("bench/pid", 120_000))
            os.kill(pid, signal.SIGCONT)

        threading.Thread(target=wake, daemon=True).start()
    for step in range(24):
        time.sleep(STEP_S)
        if me == 1 and step == 20:
            with jh.StopWatch("load batch"):  # no more steps from here
                client.key_value_set("bench/stopped", repr(time.time()))
                time.sleep(timeout / 2)  # after a post of the watch
                if how == "sleep":
                    time.sleep(timeout + 6)
                else:
                    client.key_value_set("bench/pid", str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
        history.update({"loss": float(step)}, step=step, summarize=False)
    history.close()
    stopped = float(client.blocking_key_value_get("bench/stopped", 120_000))
    return {"latency": reports[0] - stopped if reports else None}


def _straggler_worker(slow: int, extra: float, steps: int, window: int) -> dict:
    """Runs in every process: process ``slow`` (-1: none) is ``extra`` slower."""
    import logging

    import jax

    import jaxhistory as jh

    flags = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "consistently slower" in record.getMessage():
                flags.append(time.time())

    logging.getLogger("jaxhistory").addHandler(Catch())
    history = jh.History(distributed_history=True, straggler_window=window)
    start = time.time()
    first_flag_update = None
    for step in range(steps):
        time.sleep(STEP_S)
        if jax.process_index() == slow:
            time.sleep(STEP_S * extra)
        history.update({"loss": float(step)}, step=step, summarize=False)
        if flags and first_flag_update is None:
            first_flag_update = step + 1
    history.close()
    return {
        "flags": len(flags),
        "seconds": flags[0] - start if flags else None,
        "updates": first_flag_update,
    }


def bench_hang(cases: list[tuple[str, float]]) -> list[str]:
    import jaxhistory as jh

    rows = [
        "| process 1 | hang_timeout s | report after, s (process 0, process 2) "
        "| target |",
        "|---|---:|---|---|",
    ]
    for how, timeout in cases:
        results = jh.launch_local(
            "bench_stall:_hang_worker", 3, 1, args=(how, timeout), timeout=300
        )
        found = [results[p]["latency"] for p in (0, 2)]
        ok = all(f is not None and f <= timeout + 5 for f in found)
        shown = ", ".join("none" if f is None else f"{f:.2f}" for f in found)
        verdict = "met" if ok else "**missed**"
        label = "sleeps" if how == "sleep" else "is SIGSTOPped"
        rows.append(
            f"| {label} | {timeout:g} | {shown} | ≤ hang_timeout + 5 s: {verdict} |"
        )
    return rows


def bench_beat(n: int = 200_000) -> str:
    from jaxhistory._hang import HangWatch

    class Store:
        def key_value_set(self, key, value, allow_overwrite=False):
            pass

        def key_value_dir_get(self, prefix):
            return []

    watch = HangWatch(300.0, Store(), "bench", 0, 2)
    runs = [timeit.timeit(lambda: watch.beat(5), number=n) / n for _ in range(7)]
    watch.stop()
    return (
        f"`HangWatch.beat` (the training thread's share of the watch, per "
        f"update): median {statistics.median(runs) * 1e9:.0f} ns over 7 runs of "
        f"{n:,} calls (target ≤ 1 µs)."
    )


def bench_stragglers(cases: list[tuple[int, float]], steps: int, window: int) -> list:
    import jaxhistory as jh

    rows = [
        "| slow process | slower by | flagged after (updates, s) | flags |",
        "|---|---:|---|---:|",
    ]
    for slow, extra in cases:
        results = jh.launch_local(
            "bench_stall:_straggler_worker",
            3,
            1,
            args=(slow, extra, steps, window),
            timeout=600,
        )
        first = results[0]
        after = (
            "never"
            if first["updates"] is None
            else f"{first['updates']}, {first['seconds']:.1f}"
        )
        who = "none" if slow < 0 else str(slow)
        rows.append(
            f"| {who} | {extra:.0%} | {after} | "
            f"{sum(r['flags'] for r in results)} (all processes) |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the workers
    if args.quick:
        hang = bench_hang([("sleep", 2.0)])
        strag = bench_stragglers([(2, 0.1), (-1, 0.0)], steps=40, window=10)
        window, steps = 10, 40
    else:
        hang = bench_hang(
            [("sleep", 2.0), ("stop", 2.0), ("sleep", 5.0), ("stop", 5.0)]
        )
        window, steps = 20, 200
        strag = bench_stragglers(
            [(2, 0.1), (2, 0.2), (-1, 0.0), (-1, 0.0), (-1, 0.0)], steps, window
        )
    beat = bench_beat(20_000 if args.quick else 200_000)
    import jax
    from _common import report

    text = "\n".join(
        [
            TITLE,
            "",
            "3 processes x 1 CPU device; a host scalar recorded every "
            f"{STEP_S * 1e3:.0f} ms.",
            "",
            "### Hang report",
            "",
            *hang,
            "",
            beat,
            "",
            "### Straggler flags",
            "",
            f"Windows of {window} updates, {steps} updates per run; 'flags' counts "
            "the warnings on every process.",
            "",
            *strag,
        ]
    )
    info = f"jax {jax.__version__}, launch_local processes x 1 CPU device"
    report(info, args.quick, [text], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
