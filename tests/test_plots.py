"""Plots (PNG and terminal), the markdown report, and the plot worker processes."""

import numpy as np

import jaxhistory as jh
from jaxhistory import export
from jaxhistory.export import _mpl


def many_metrics(n=60, steps=12):
    state = jh.HistoryState()
    rng = np.random.default_rng(0)
    names = [f"g{i // 10}/m{i}" for i in range(n)]
    for step in range(steps):
        values = dict(zip(names, rng.normal(size=n).tolist(), strict=True))
        state = state.update(values, step=step)
    return state


# ----- the plot workers -------------------------------------------------------------
def test_plot_workers_never_import_modules_from_the_working_folder(
    tmp_path, monkeypatch
):
    """A pickle.py or json.py where the user runs is not imported by the worker
    processes, and the workers (not this process) draw every plot."""
    marker = tmp_path / "imported.txt"
    for name in ("pickle", "json"):
        (tmp_path / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r})\nraise SystemExit(3)\n"
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    state = many_metrics()
    assert len(export.plot_units(state)) >= _mpl.PARALLEL_FROM

    def not_here(job):
        raise AssertionError(f"{job[2]} was drawn in the parent, not by a worker")

    pending = _mpl.start_png(state, tmp_path / "png")
    monkeypatch.setattr(_mpl, "draw_job", not_here)  # the workers have their own
    paths = pending.wait()
    assert not marker.exists()
    assert len(paths) == 60 and all(p.stat().st_size > 1000 for p in paths)
