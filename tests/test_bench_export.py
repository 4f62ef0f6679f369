"""Smoke test of benchmarks/bench_export.py: a --quick run in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_export.py"


@pytest.mark.slow
def test_bench_export_quick(tmp_path):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    out_file = tmp_path / "export.md"
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
    for part in (
        "finalize(plot=False), JSONL streamed during the run",
        "finalize(plot=False), JSONL written by finalize",
        "finalize() with plots, JSONL streamed",
        "to_jsonl",
        "to_png (10 PNGs)",
    ):
        row = re.search(rf"\|\s+{re.escape(part)} \| ([\d.]+) \|", text)
        assert row and float(row.group(1)) > 0, f"no time for {part}:\n{text}"
    assert "| 100,000 x 16 | to_netcdf |" in text
    assert "reads back exactly" in text
