"""Smoke test of benchmarks/bench_memory.py: a --quick run in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_memory.py"


@pytest.mark.slow
def test_bench_memory_quick(tmp_path):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    out_file = tmp_path / "memory.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out_file)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out_file.read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", text, re.M)
    assert len(rows) == 2 and all(float(r[1]) > 0 for r in rows), text
    assert re.search(r"start \+ stop \| [\d.]+ \|", text), text
    assert re.search(r"inside `tracker.stage\(...\)` \| [\d.]+ \| [\d.]+ \|", text)
