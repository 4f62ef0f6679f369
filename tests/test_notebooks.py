"""Every notebook runs headless in a Jupyter kernel (nbclient), committed without
outputs; the analysis notebook runs on four freshly generated demo runs (two
learning rates, two seeds each)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"analysis.ipynb", "history.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code_cells
    assert all(
        not c.get("outputs") and c.get("execution_count") is None for c in code_cells
    ), "strip outputs"


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """Four demo runs, as `make demo` writes them: two learning rates (the
    first two runs, seed 0), then the same two with seed 1. The first runs
    alone and fills a compilation cache the other three, run at once, read:
    the four take about a third of the time they take all at once."""
    base = tmp_path_factory.mktemp("runs")
    configs = {
        "a": ["--lr", "3e-3"],
        "b": ["--lr", "1e-3"],
        "a-seed1": ["--lr", "3e-3", "--seed", "1"],
        "b-seed1": ["--lr", "1e-3", "--seed", "1"],
    }
    env = dict(
        os.environ,
        JAX_NUM_CPU_DEVICES="8",
        JAX_COMPILATION_CACHE_DIR=str(base / "compilation-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    demo = [sys.executable, str(ROOT / "examples" / "demo.py")]
    demo += ["--steps", "40", "--log-every", "20", "--eval-every", "20", "--no-plots"]
    procs = {}

    def start(name: str) -> None:
        with open(base / f"{name}.log", "w") as log:  # the child keeps it open
            procs[name] = subprocess.Popen(
                [*demo, "--outdir", str(base / name), *configs[name]],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait() -> None:
        for name, proc in procs.items():
            proc.wait(timeout=300)
            log = (base / f"{name}.log").read_text()
            assert proc.returncode == 0, log[-3000:]

    try:
        first, *rest = configs
        start(first)
        wait()
        for name in rest:
            start(name)
        wait()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [base / name for name in configs]


def execute(path: Path, run_dirs, monkeypatch, extra_cells=()) -> nbformat.NotebookNode:
    """The notebook at `path` run headless on the demo runs `run_dirs`, with the
    code cells `extra_cells` run after its own."""
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAXHISTORY_RUNS", os.pathsep.join(map(str, run_dirs)))
    nb = nbformat.read(path, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(source) for source in extra_cells]
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the traceback, on failure
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert not errors
    return nb


def output_text(nb: nbformat.NotebookNode, stream: str = "stdout") -> str:
    return "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("name") == stream
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_headless(path, demo_runs, monkeypatch):
    extra = history_notebook_checks() if path.name == "history.ipynb" else []
    nb = execute(path, demo_runs, monkeypatch, extra)
    assert not output_text(nb, "stderr")  # no warnings
    if path.name == "history.ipynb":
        # Each metric is kept to one model. The toy loop records eval/loss
        # every 10 steps; the classifier evaluated later is another model, and
        # its loss (about 1.06) must not land under the same name after the
        # loop's ten values near 0.01.
        steps, highest = nb.cells[-1].outputs[0]["text"].splitlines()
        assert ast.literal_eval(steps) == list(range(9, 100, 10))
        assert float(highest) < 1.0  # the loop's held-out loss, exp(-0.05 * 9) at most
    if path.name == "reducers.ipynb":
        # the distributed_stats heading states the count the cell below it shows
        i = next(
            i
            for i, c in enumerate(nb.cells)
            if c.cell_type == "markdown" and c.source.startswith("## distributed_stats")
        )
        heading = nb.cells[i].source.splitlines()[0]
        cell = next(
            c
            for c in nb.cells[i:]
            if "collective_counts(jh.distributed_stats" in c.source
        )
        counts = ast.literal_eval(cell.outputs[0]["data"]["text/plain"])
        words = {1: "one all-reduce", 2: "two all-reduces"}
        assert words[counts["all-reduce"]] in heading, (heading, counts)
        # the weighted and the masked mean, each printed beside NumPy's
        means = re.findall(r"(\w+) mean +(\S+), NumPy (\S+)", output_text(nb))
        assert [kind for kind, _, _ in means] == ["weighted", "masked"], means
        for _, ours, numpy in means:
            assert float(ours) == pytest.approx(float(numpy), rel=1e-5)
    if path.name == "analysis.ipynb":
        text = output_text(nb)
        assert "smoothed final loss" in text and "lower:" in text
        # the run's attributes as plain numbers, not NumPy 2's np.int64(8)
        assert "device_count: 8, mesh: data=8, warmup_steps: " in text
        assert "np.int" not in text and "np.float" not in text
        assert "eval/loss at steps" in text and "steps/s" in text
        # the time from the first step's record to the last's spans 39 of 40 steps
        assert "steps 1 to 40: 39 steps in " in text
        assert "seeds per lr: {0.001: 2, 0.003: 2}" in text
        assert text.count("over seeds") == 2
        # the file in plain xarray: the notebook never calls jaxhistory
        code = "".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "jaxhistory" not in code and "jh." not in code


@pytest.mark.slow
def test_analysis_notebook_names_the_root_metrics_the_demo_records(demo_runs):
    """The prose lists the metrics the root group holds: those of the file."""
    import xarray as xr

    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    prose = "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    listed = re.search(
        r"the metrics without a `/` \(([^)]*)\)", prose.replace("\n", " ")
    )
    with xr.open_datatree(demo_runs[0] / "dataset.nc") as tree:
        root = set(tree.ds.data_vars)
    assert set(re.findall(r"`([^`]+)`", listed.group(1))) == root


def history_notebook_checks() -> list[str]:
    """Code cells run after the history notebook's own: the cells that read
    the HistoryState ``state`` again (no later cell may rebind the name),
    then a cell printing the steps and the highest value of ``eval/loss``."""
    path = ROOT / "notebooks" / "history.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    start, end = (
        next(i for i, c in enumerate(cells) if c.source.startswith(heading))
        for heading in ("## Immutability", "## Eval metrics")
    )
    again = [c.source for c in cells[start:end] if c.cell_type == "code"]
    assert len(again) == 3 and all("state." in source for source in again)
    check = (
        "print(history.state.steps('eval/loss').tolist())\n"
        "print(max(history.state.values('eval/loss').tolist()))"
    )
    return [*again, check]


@pytest.mark.slow
def test_analysis_notebook_compares_runs_of_different_lengths(
    demo_runs, tmp_path, monkeypatch
):
    """The lr 1e-3 runs stopped at step 25 of 40: the runs are compared at the
    last step all of them reached, not at a step where a run has no loss."""
    import xarray as xr

    runs = list(demo_runs)
    for i in (1, 3):  # "b" and "b-seed1"
        short = tmp_path / f"{runs[i].name}-short"
        short.mkdir()
        with xr.open_datatree(runs[i] / "dataset.nc") as tree:
            tree.isel(step=slice(None, 25)).to_netcdf(short / "dataset.nc")
        runs[i] = short
    nb = execute(ROOT / "notebooks" / "analysis.ipynb", runs, monkeypatch)
    text = output_text(nb)
    assert not output_text(nb, "stderr")  # no FutureWarning from xr.concat
    assert "nan" not in text.lower(), text
    finals = re.findall(r"smoothed final loss (\S+)", text)
    assert len(finals) == 4 and all(float(v.split("±")[0]) > 0 for v in finals)
    assert "at step 25" in text and "lower:" in text
