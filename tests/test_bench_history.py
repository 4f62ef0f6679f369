"""Smoke test of benchmarks/bench_history.py: a --quick run in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_history.py"
TITLES = (
    "## 1. Host recording speed",
    "## 2. Memory",
    "## 3. Train loop on 8 simulated CPU devices",
)
HEADERS = (
    "| recorder | µs/step, 2k steps | µs/step, 20k steps |",
    "| measurement | steps | metrics | MiB | bytes per float64 | target |",
    "| variant | recording per step | steps/s | ms/step | ms/step range |",
)


@pytest.mark.slow
def test_bench_history_quick():
    env = dict(os.environ)
    env["JAX_NUM_CPU_DEVICES"] = "8"  # the subprocess starts its own JAX
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for text in (*TITLES, *HEADERS):
        assert text in out, f"missing {text!r} in:\n{out}"
    # | `HistoryState.nbytes()` | steps | metrics | MiB | bytes per float64 | target |
    row = re.search(
        r"^\| `HistoryState\.nbytes\(\)` \| [\d,]+ \| 16 \| [\d.]+ \| ([\d.]+) \|",
        out,
        re.MULTILINE,
    )
    assert row, out
    assert float(row.group(1)) <= 12, row.group(0)
    # Every train-loop variant has a positive rate; `history` recorded every step
    # (the script fails otherwise).
    for variant in ("baseline", "history", "history_per_device", "float_per_metric"):
        rate = re.search(rf"^\| `{variant}` \| [^|]+ \| ([\d.]+) \|", out, re.MULTILINE)
        assert rate and float(rate.group(1)) > 0, f"no steps/s for {variant}"
