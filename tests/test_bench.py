"""Smoke test of benchmarks/bench_reducers.py: a --quick run in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_reducers.py"
HEADER = (
    "| K | implementation | collectives | compile s | median µs/call | ratio vs fused |"
)


@pytest.mark.slow
def test_bench_reducers_quick():
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
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert HEADER in proc.stdout
    fused = re.findall(r"^\| (\d+) \| fused \| (\d+) \|", proc.stdout, re.MULTILINE)
    assert [k for k, _ in fused] == ["1", "10", "100"], proc.stdout
    for k, collectives in fused:
        assert int(collectives) <= 2, f"fused uses {collectives} collectives at K={k}"
