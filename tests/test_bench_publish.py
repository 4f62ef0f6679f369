"""Smoke test of benchmarks/bench_publish.py: a --quick run in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_publish.py"


@pytest.mark.slow
def test_bench_publish_quick(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out_file = tmp_path / "publish.md"
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
    for part in ("`put_metric` (null default handler)", "trace `counter` event"):
        assert re.search(rf"\| {re.escape(part)} \| [\d.]+ \|", text), text
    for sink in ("none", "`JsonlSink`", "`TensorBoardSink`"):
        assert re.search(rf"\| {re.escape(sink)} \| [\d.]+ \| [\d.]+ \|", text), text
