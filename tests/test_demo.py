"""examples/demo.py runs end to end and prints sensible, decreasing loss statistics."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"

NUM = r"([-+0-9.eEnaif]+)"
LINE = re.compile(
    rf"^step=\s*(\d+)\s+loss mean={NUM} min={NUM} max={NUM} std={NUM}(?:\s|$)"
)


def test_demo_runs_and_loss_decreases():
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "30", "--log-every", "10"],
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
