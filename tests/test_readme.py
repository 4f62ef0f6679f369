"""The README's example runs as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_runs_and_the_loss_falls(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 5
    means = [float(re.search(r"loss/mean=([\d.]+)", line).group(1)) for line in lines]
    assert means[-1] < means[0]
    for line in lines:
        values = dict(re.findall(r"loss/(\w+)=([\d.]+)", line))
        assert float(values["min"]) <= float(values["mean"]) <= float(values["max"])
