"""Every notebook's code cells run, in order, in a fresh interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted(
    (Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb")
)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_is_committed_without_outputs(path, tmp_path):
    nb = json.loads(path.read_text())
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") for c in code_cells), "strip outputs"
    script = tmp_path / "nb.py"
    script.write_text("\n\n".join("".join(c["source"]) for c in code_cells))
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_NUM_CPU_DEVICES="8"),
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
