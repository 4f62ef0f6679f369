"""Several runs opened together with plain xarray, as docs/compare-runs.md does.

The runs are generated here: three seeds of one configuration, one of them
stopped early, one that never evaluated (no ``eval`` group), and a metric with
cross-device statistics (a group of ``mean``, ``std``, ``min``, ``max``). The
helpers below are the page's, and every check is on values.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from packaging.version import Version

import jaxhistory as jh

xr = pytest.importorskip("xarray")

STEPS = {0: 30, 1: 20, 2: 30}  # seed 1 stopped early
EVALUATED = {0, 1}  # seed 2 never evaluated


def train_loss(seed: int, step: int) -> float:
    return (seed + 1) / (step + 1)


def eval_loss(seed: int, step: int) -> float:
    return 0.5 + seed + step / 100


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mesh):
    """{seed: run folder}; each folder holds dataset.nc and log-0.jsonl."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    base = tmp_path_factory.mktemp("runs")
    sharding = NamedSharding(mesh, P("data"))
    folders = {}
    for seed, steps in STEPS.items():
        name = f"lr0.1-seed{seed}"
        folder = base / name
        history = jh.History(
            report_dir=folder,
            jsonl_path=folder / "log-{process_index}.jsonl",
            run_name=name,
        )
        for step in range(steps):
            # one value per device: recorded as train/spread/mean|std|min|max
            spread = jax.device_put(np.arange(8.0) + step + seed, sharding)
            metrics = {
                "train": {"loss": train_loss(seed, step), "spread": spread},
                "lr": 0.1,
                "gnorm": float("nan") if step == 3 else 1.0,
            }
            if seed in EVALUATED and step % 10 == 9:
                metrics["eval"] = {"loss": eval_loss(seed, step)}
            history.update(metrics, step=step, summarize=False)
        history.finalize(plot=False)
        history.close()
        folders[seed] = folder
    return folders


@pytest.fixture
def trees(runs):
    opened = {
        seed: xr.open_datatree(folder / "dataset.nc") for seed, folder in runs.items()
    }
    yield opened
    for tree in opened.values():
        tree.close()


# ----- the page's helpers -------------------------------------------------------


def across_runs(trees, name: str):
    """Metric ``name`` of every run that recorded it, along a ``run`` dimension."""
    found = {}
    for tree in trees:
        try:
            found[tree.attrs["run_id"]] = tree[name]
        except KeyError:  # this run never recorded it
            continue
    arrays = xr.concat(list(found.values()), dim="run", join="outer")
    return arrays.assign_coords(run=list(found))


def with_configuration(arrays):
    config = [re.match(r"lr(.+?)-seed(\d+)-", r).groups() for r in arrays["run"].values]
    return arrays.assign_coords(
        lr=("run", [float(lr) for lr, _ in config]),
        seed=("run", [int(seed) for _, seed in config]),
    )


def read_log(path: Path):
    """The scalar metrics of one JSONL log along ``step``, with its run id and
    process index as scalar coordinates (the later line of a step wins)."""
    rows, run_id, process = {}, None, None
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line a killed run cut off
            continue
        run_id, process = record["run_id"], record["process_index"]
        row = rows.setdefault(record["step"], {})
        row.update(record["metrics"])
        row.update(record["aggregated"])
    steps = sorted(rows)
    names = list(dict.fromkeys(name for row in rows.values() for name in row))
    data = {
        name: ("step", [float(rows[s].get(name, "nan")) for s in steps])
        for name in names
    }
    return xr.Dataset(data, coords={"step": steps, "run": run_id, "process": process})


# ----- the datasets -------------------------------------------------------------


def test_open_mfdataset_needs_dask(runs):
    """The first thing people try: it needs dask, even with chunks=None."""
    paths = [runs[seed] / "dataset.nc" for seed in sorted(runs)]
    try:
        import dask  # noqa: F401
    except ImportError:
        # xarray before 2025.1 raises ValueError: unrecognized chunk manager dask
        for chunks in ({}, None):
            with pytest.raises((ImportError, ValueError), match="dask"):
                xr.open_mfdataset(
                    paths, combine="nested", concat_dim="run", chunks=chunks
                )
        return
    # With dask: the page's form skips the run without the eval group.
    ev = xr.open_mfdataset(
        paths,
        group="eval",
        combine="nested",
        concat_dim="run",
        join="outer",
        preprocess=lambda ds: ds.expand_dims(
            run=[Path(ds.encoding["source"]).parent.name]
        ),
        errors="ignore",
    )
    assert ev["run"].values.tolist() == ["lr0.1-seed0", "lr0.1-seed1"]
    assert float(ev["loss"].sel(run="lr0.1-seed1", step=19)) == eval_loss(1, 19)
    ev.close()


def test_runs_of_different_lengths_line_up_by_step(trees):
    loss = across_runs(trees.values(), "train/loss")
    ids = [trees[s].attrs["run_id"] for s in sorted(trees)]
    assert loss["run"].values.tolist() == ids
    assert loss.sizes == {"run": 3, "step": 30}
    assert loss["step"].values.tolist() == list(range(30))
    for i, seed in enumerate(sorted(trees)):
        got = loss.isel(run=i).values
        want = [train_loss(seed, t) for t in range(STEPS[seed])]
        assert got[: STEPS[seed]].tolist() == want
        assert np.isnan(got[STEPS[seed] :]).all()
    assert loss.count("run").sel(step=[19, 20]).values.tolist() == [3, 2]
    late = float(loss.mean("run").sel(step=25))
    assert late == pytest.approx((train_loss(0, 25) + train_loss(2, 25)) / 2)
    # join="exact" (xarray's announced default) refuses runs of different lengths
    arrays = [tree["train/loss"] for tree in trees.values()]
    with pytest.raises(ValueError, match="exact"):
        xr.concat(arrays, dim="run", join="exact")


def test_a_run_without_a_metric_is_left_out_of_it(trees):
    assert "eval/loss" not in trees[0]  # `in` looks at the root's children only
    assert "eval" in trees[0] and "eval" not in trees[2]
    with pytest.raises(KeyError):
        trees[2]["eval/loss"]
    held_out = across_runs(trees.values(), "eval/loss")
    assert held_out["run"].values.tolist() == [trees[s].attrs["run_id"] for s in (0, 1)]
    evaluated = held_out.dropna("step", how="all")
    assert evaluated["step"].values.tolist() == [9, 19, 29]
    assert evaluated.sel(step=19).values.tolist() == [
        eval_loss(0, 19),
        eval_loss(1, 19),
    ]
    assert np.isnan(float(evaluated.isel(run=1).sel(step=29)))  # seed 1 had stopped
    # Whole trees concatenate only when every run has the same groups (and only
    # from xarray 2025.11: earlier ones do not concatenate trees at all).
    if Version(xr.__version__) >= Version("2025.11"):
        fault, match = ValueError, "isomorphic"
    else:
        fault, match = TypeError, "can only concatenate"
    with pytest.raises(fault, match=match):
        xr.concat(list(trees.values()), dim="run", join="outer")
    loss = across_runs(trees.values(), "train/loss")
    _, b = xr.align(loss, held_out, join="outer")
    assert b["run"].values.tolist() == loss["run"].values.tolist()
    assert np.isnan(b.isel(run=2)).all()


def test_a_group_of_statistics_across_runs(runs, trees):
    group = trees[0]["train/spread"].to_dataset()
    # the statistics across devices (and which device held the max, min, NaN)
    assert set(group.data_vars) >= {"mean", "std", "min", "max", "argmax"}
    stats = xr.concat(
        [tree["train/spread"].to_dataset() for tree in trees.values()],
        dim="run",
        join="outer",
    )
    assert stats.sizes == {"run": 3, "step": 30}
    assert float(stats["mean"].isel(run=2).sel(step=4)) == 3.5 + 4 + 2
    assert float(stats["max"].isel(run=1).sel(step=19)) == 7 + 19 + 1
    assert float(stats["std"].isel(run=0).sel(step=0)) == pytest.approx(
        np.std(np.arange(8.0))
    )
    # A group opened alone keeps its step coordinate, not the run's attributes.
    with xr.open_dataset(runs[0] / "dataset.nc", group="train/spread") as alone:
        assert alone["step"].values.tolist() == list(range(30))
        assert float(alone["min"].sel(step=7)) == 7.0
        assert "run_id" not in alone.attrs
    # The whole train group (plain metrics beside the stats group)
    train = xr.concat(
        [tree["train"].to_dataset() for tree in trees.values()], dim="run", join="outer"
    )
    assert list(train.data_vars) == ["loss"]
    assert float(train["loss"].isel(run=1).sel(step=0)) == train_loss(1, 0)


def test_attributes_of_concatenated_runs(trees):
    roots = [tree.to_dataset() for tree in trees.values()]
    ids = [root.attrs["run_id"] for root in roots]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        first = xr.concat(roots, dim="run", join="outer")
    assert first.attrs["run_id"] == ids[0]  # every run looks like the first
    assert "run" not in first.coords  # a dimension without labels
    shared = xr.concat(
        roots,
        dim="run",
        join="outer",
        coords="different",
        compat="equals",
        combine_attrs="drop_conflicts",
    )
    assert "run_id" not in shared.attrs
    assert shared.attrs["backend"] == "cpu"
    assert shared["time"].dims == ("run", "step")  # each run's own clock
    labelled = shared.assign_coords(run=ids)
    assert float(labelled["lr"].sel(run=ids[1], step=0)) == 0.1


def test_mean_and_std_over_seeds(trees):
    loss = with_configuration(across_runs(trees.values(), "train/loss"))
    assert loss["seed"].values.tolist() == [0, 1, 2]
    by_lr = loss.groupby("lr")
    mean, std, count = by_lr.mean(), by_lr.std(ddof=1), by_lr.count()
    for step in (0, 10, 19):
        values = [train_loss(s, step) for s in (0, 1, 2)]
        assert float(mean.sel(lr=0.1, step=step)) == pytest.approx(np.mean(values))
        assert float(std.sel(lr=0.1, step=step)) == pytest.approx(
            np.std(values, ddof=1)
        )
    values = [train_loss(s, 25) for s in (0, 2)]  # seed 1 had stopped
    assert float(std.sel(lr=0.1, step=25)) == pytest.approx(np.std(values, ddof=1))
    assert int(count.sel(lr=0.1, step=25)) == 2
    by_seed = loss.set_index(run=["lr", "seed"]).unstack("run")
    assert dict(by_seed.sizes) == {"step": 30, "lr": 1, "seed": 3}
    xr.testing.assert_allclose(by_seed.mean("seed").transpose("lr", "step"), mean)


# ----- the JSONL logs -----------------------------------------------------------


def test_logs_read_with_json_agree_with_the_datasets(runs, trees):
    logs = xr.concat(
        [read_log(runs[seed] / "log-0.jsonl") for seed in sorted(runs)],
        dim="run",
        join="outer",
    )
    assert logs["run"].values.tolist() == [
        trees[s].attrs["run_id"] for s in sorted(runs)
    ]
    assert logs["process"].values.tolist() == 0
    loss = across_runs(trees.values(), "train/loss")
    np.testing.assert_array_equal(logs["train/loss"], loss)
    np.testing.assert_array_equal(
        logs["train/spread/max"], across_runs(trees.values(), "train/spread/max")
    )
    # NaN is written as the string "NaN" and read back as NaN
    assert '"gnorm":"NaN"' in (runs[0] / "log-0.jsonl").read_text()
    gnorm = logs["gnorm"].isel(run=0).values
    assert np.isnan(gnorm[3]) and gnorm[[2, 4]].tolist() == [1.0, 1.0]
    # the eval line of a step merges into the step (seed 0: eval at 9, 19, 29)
    assert float(logs["eval/loss"].isel(run=0).sel(step=19)) == eval_loss(0, 19)
    assert np.isnan(logs["eval/loss"].isel(run=2)).all()


def test_a_damaged_log_keeps_its_complete_lines_and_the_later_line_wins(runs, tmp_path):
    log = tmp_path / "log-0.jsonl"
    text = (runs[0] / "log-0.jsonl").read_text()
    later = json.loads(text.splitlines()[5])
    later["metrics"] = {"train/loss": 42.0}
    log.write_text(
        text + json.dumps(later) + "\n" + "\xff\xfe garbage\n" + '{"step": 30, "met'
    )
    ds = read_log(log)
    assert ds["step"].values.tolist() == list(range(30))  # the cut line is skipped
    assert float(ds["train/loss"].sel(step=5)) == 42.0  # the later line wins
    assert float(ds["lr"].sel(step=5)) == 0.1  # what it did not repeat stays
    assert float(ds["train/loss"].sel(step=6)) == train_loss(0, 6)


@pytest.mark.slow
def test_the_logs_of_a_two_process_run_line_up_along_process(tmp_path):
    """A real 2-process run: each process writes its own log (the path holds
    ``{process_index}``); both carry the run's one id."""
    jh.launch_local(
        "mp_workers:finalize_run", 2, 2, args=(str(tmp_path), 4), timeout=240
    )
    logs = [read_log(tmp_path / f"rank{i}.jsonl") for i in (0, 1)]
    run = xr.concat(logs, dim="process", join="outer")
    assert run["process"].values.tolist() == [0, 1]
    assert run["step"].values.tolist() == [0, 1, 2, 3]
    assert logs[0]["run"].item() == logs[1]["run"].item()
    np.testing.assert_array_equal(run["rank"].values, [[0.0] * 4, [1.0] * 4])
    assert run["rank"].mean("process").values.tolist() == [0.5] * 4
