"""examples/demo.py runs end to end and prints sensible, decreasing loss statistics."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import jaxhistory as jh

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"

NUM = r"([-+0-9.eEnaif]+)"
LINE = re.compile(
    rf"^step=\s*(\d+)\s+loss mean={NUM} min={NUM} max={NUM} std={NUM}(?:\s|$)"
)


def test_demo_runs_and_loss_decreases(tmp_path):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            str(DEMO),
            "--steps",
            "30",
            "--log-every",
            "10",
            "--eval-every",
            "10",
            "--outdir",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr}"

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step=")]
    assert len(lines) == 3, proc.stdout

    steps, means = [], []
    for ln in lines:
        m = LINE.match(ln)
        assert m, f"unexpected log line: {ln!r}"
        step = int(m.group(1))
        mean, mn, mx, std = (float(g) for g in m.groups()[1:])
        assert mn <= mean <= mx, ln
        assert std >= 0, ln
        steps.append(step)
        means.append(mean)

    assert steps == [10, 20, 30]
    assert means[-1] < means[0], proc.stdout
    assert "8 devices" in proc.stdout

    # finalize wrote the whole output tree and printed the summary plot
    out = tmp_path / "out"
    assert (out / "dataset.nc").is_file() and (out / "report.md").is_file()
    (log,) = out.glob("demo-seed0-*.jsonl")
    state = jh.HistoryState.from_jsonl(log)
    assert state.count("train/loss/mean") == state.count("grads/norm") == 30
    # watch: per layer (linear1, linear2, out) and over the model, per step
    for layer in ("linear1", "linear2", "out"):
        assert state.count(f"grads/{layer}/norm") == 30
        assert state.count(f"updates/{layer}/max_abs") == 30
    assert (out / "plots" / "mplot" / "grads_norm.layers.png").is_file()
    assert "## Per layer" in (out / "report.md").read_text()
    assert (out / "plots" / "mplot" / "train_loss.png").is_file()
    assert (out / "plots" / "tplot" / "train_loss.txt").is_file()
    assert "· mean" in proc.stdout and f"outputs: {out}" in proc.stdout
    state = jh.HistoryState.from_netcdf(out / "dataset.nc")
    assert state.steps("train/loss/mean").tolist() == list(range(1, 31))
    assert state.count("grads/norm") == 30
    # End-of-training report: the table on stdout and the result files.
    assert "***** train metrics *****" in proc.stdout
    assert re.search(r"  train_runtime +=  *\d+:\d\d:\d\d\.\d\d", proc.stdout)
    assert re.search(r"  train_mem_device_peaked_delta += +n/a", proc.stdout)
    results = json.loads((out / "all_results.json").read_text())
    assert results == json.loads((out / "train_results.json").read_text())
    assert results["init_mem_device_alloc_delta"] > 0  # parameters and Adam state
    # saved as the shortest decimal that reads back as the recorded float32
    assert np.float32(results["train_loss"]) == state.last("train/loss/mean")
    assert state.count("timing/wait_and_log") == 3
    # One log line per step, with the run id: the timing and the evaluation of
    # steps 10, 20 and 30 on the line of their step
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 31))
    assert {r["run_id"] for r in lines} == {log.stem}
    assert state.steps("timing/wait_and_log").tolist() == [10, 20, 30]
    assert state.steps("eval/loss").tolist() == [10, 20, 30]
    assert "timing/wait_and_log" in lines[9]["metrics"]
    assert "eval/loss" in lines[9]["metrics"]
    events = jh.trace.load_trace(out / "traces" / "merged_trace.json")
    spans = [e for e in events if e["ph"] == "X"]
    assert len([e for e in spans if e["name"] == "dispatch step"]) == 30
    loss = [e for e in events if e["ph"] == "C" and e["name"] == "train/loss/mean"]
    assert len(loss) == 30
