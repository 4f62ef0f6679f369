"""What code written for ezpz's History finds here: data and groups views,
StopWatch.data, run config and env_info, update(use_wandb=...), sinks by name
and JAXHISTORY_SINKS, and the training_history table."""

import argparse
import dataclasses
import enum
import json
import math
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
import xarray as xr

import jaxhistory as jh
from jaxhistory._files import NotAFile, in_use
from jaxhistory.sinks import (
    ConsoleSink,
    CsvSink,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    training_history,
)


@pytest.fixture
def no_env_sinks(monkeypatch):
    monkeypatch.delenv("JAXHISTORY_SINKS", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)


# ----- History.data and History.groups ----------------------------------------------
def _stats_state():
    """A state with the cross-device statistics History records."""
    state = jh.HistoryState()
    for step in range(3):
        state = state.update(
            {
                "loss": {s: float(step) for s in jh.STATS},
                "train": {"loss": {s: 1.0 for s in jh.STATS}, "acc": 0.5},
                "eval/acc": 0.25,
                "lr": 0.1,
                "/odd": 1.0,
                "a//b": 2.0,
            },
            step=step,
        )
    return state


def test_data_is_a_read_only_view_of_the_history(no_env_sinks):
    h = jh.History(distributed_history=False)
    h.update({"train": {"loss": 0.5}, "lr": 0.1}, step=0)
    h.update({"train": {"loss": 0.25}}, step=1)
    data = h.data
    assert list(data) == ["train/loss", "lr"] and len(data) == 2
    assert data["train/loss"].tolist() == [0.5, 0.25]
    assert {k: v.tolist() for k, v in data.items()} == {
        k: v.tolist() for k, v in h.history.items()
    }
    assert "lr" in data and "nope" not in data
    with pytest.raises(KeyError):
        data["nope"]
    with pytest.raises(TypeError, match="History.data is a read-only view"):
        data["lr"] = [1.0]
    with pytest.raises(TypeError, match="read-only"):
        del data["lr"]
    with pytest.raises(TypeError, match="read-only"):
        h.data = {}
    with pytest.raises(ValueError):
        data["lr"][0] = 2.0  # the arrays are read-only too
    assert data.state.steps(data.name("lr")).tolist() == [0]
    h.update({"train": {"loss": 0.125}}, step=2)
    assert len(data["train/loss"]) == 2  # a view of the state when read
    assert len(h.data["train/loss"]) == 3
    assert repr(data) == "MetricsView(['train/loss', 'lr'])"


def test_groups_follow_ezpz_prefixes_and_keep_statistics_with_their_metric(
    no_env_sinks,
):
    h = jh.History(distributed_history=False)
    h.state = _stats_state()
    groups = h.groups
    assert list(groups) == ["", "train", "eval", "a"]
    assert list(groups[""]) == [*(f"loss/{s}" for s in jh.STATS), "lr", "/odd"]
    assert list(groups["train"]) == [*(f"loss/{s}" for s in jh.STATS), "acc"]
    assert list(groups["eval"]) == ["acc"] and list(groups["a"]) == ["/b"]
    assert groups["train"]["loss/mean"].tolist() == [1.0, 1.0, 1.0]
    assert groups[""]["loss/max"].tolist() == [0.0, 1.0, 2.0]
    assert groups["a"].name("/b") == "a//b"
    # every metric once, under one (group, key)
    names = [view.name(key) for view in groups.values() for key in view]
    assert sorted(names) == sorted(h.state.keys)
    with pytest.raises(TypeError, match=r"History.groups\['train'\] is a read-only"):
        groups["train"]["acc"] = 1
    with pytest.raises(TypeError, match="History.groups is a read-only"):
        groups["new"] = {}
    with pytest.raises(TypeError, match="read-only"):
        h.groups = {}
    assert jh.History(distributed_history=False).groups == {}


def test_groups_of_a_distributed_history(no_env_sinks, mesh):
    h = jh.History(distributed_history=True)
    x = jax.device_put(np.arange(8.0), jax.NamedSharding(mesh, jax.P("data")))
    h.update({"train": {"loss": jh.per_shard(x)}, "loss": jh.per_shard(x)})
    train = h.groups["train"]
    assert {"loss/mean", "loss/std", "loss/min", "loss/max"} <= set(train)
    assert {"loss/mean", "loss/max"} <= set(h.groups[""])


def test_views_are_safe_beside_updating_threads(no_env_sinks):
    h = jh.History(distributed_history=False)
    stop = threading.Event()
    errors = []

    def write(k):
        i = 0
        while not stop.is_set():
            h.update({f"g{k}": {"x": float(i)}}, summarize=False)
            i += 1

    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            try:
                groups = h.groups
                for view in groups.values():
                    for key in view:
                        assert view[key].ndim == 1
                data = h.data
                assert all(len(data[name]) >= 0 for name in data)
            except Exception as err:  # pragma: no cover - reported below
                errors.append(err)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert set(h.groups) == {"g0", "g1"}


# ----- StopWatch.data ----------------------------------------------------------------
def test_stopwatch_data_as_ezpz_reads_it():
    sw = jh.StopWatch("forward pass", wbtag="timing/fwd")
    assert sw.data == {}
    with sw:
        pass
    first = sw.data
    assert set(first) == {"timing/fwd/dt", "timing/fwd/count", "timing/fwd/total"}
    assert first["timing/fwd/dt"] == sw.seconds and first["timing/fwd/count"] == 1
    first["timing/fwd/count"] = 99  # a copy
    assert sw.data["timing/fwd/count"] == 1
    with pytest.raises(RuntimeError), sw:
        raise RuntimeError("not counted")
    assert sw.data["timing/fwd/count"] == 1
    plain = jh.StopWatch("data load", step=4)
    with plain:
        pass
    assert plain.data["timing/data_load/iter"] == 4
    assert set(plain.data) >= {"timing/data_load/dt", "timing/data_load/total"}


def test_stopwatch_data_counts_every_span_of_every_thread(no_env_sinks):
    h = jh.History(distributed_history=False)
    sw = jh.StopWatch("work", history=h)

    @sw
    def work():
        return 1

    def run():
        for _ in range(50):
            with sw:
                work()  # nested in itself

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = sw.data
    assert data["timing/work/count"] == 400
    assert 0 < data["timing/work/dt"] <= data["timing/work/total"]
    h.update({"x": 1.0})
    assert "timing/work" in h.state


# ----- config ------------------------------------------------------------------------
class Kind(enum.Enum):
    ADAM = "adam"


@dataclasses.dataclass
class Optimizer:
    kind: Kind = Kind.ADAM
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)


@dataclasses.dataclass
class Config:
    seed: int = 0
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    out: Path = Path("runs/x")
    note: str = "a|b *c* \x1b[2J"
    scale: float = math.inf
    sizes: np.ndarray = dataclasses.field(default_factory=lambda: np.arange(3))


EXPECTED = {
    "seed": 0,
    "optimizer": {"kind": "adam", "lr": 1e-3, "betas": [0.9, 0.999]},
    "out": "runs/x",
    "note": "a|b *c* \x1b[2J",
    "scale": "Infinity",
    "sizes": [0, 1, 2],
}


def test_config_goes_into_the_dataset_and_the_report(no_env_sinks, tmp_path):
    cfg = Config()
    h = jh.History(distributed_history=False, config=cfg)
    cfg.seed = 5  # recorded when given
    assert h.config == EXPECTED
    h.config["seed"] = 7  # a copy
    assert h.config["seed"] == 0
    h.update({"loss": 1.0})
    ds = h.finalize(tmp_path / "out", plot=False)
    assert json.loads(ds.attrs["config"]) == EXPECTED
    on_disk = xr.open_dataset(tmp_path / "out" / "dataset.nc")
    assert json.loads(on_disk.attrs["config"]) == EXPECTED
    on_disk.close()
    report = (tmp_path / "out" / "report.md").read_text()
    config = report.split("## Config")[1].split("## Metrics")[0]
    assert "| optimizer.lr | 0.001 |" in config
    assert "| optimizer.betas | \\[0.9, 0.999\\] |" in config
    assert "| note | a\\|b \\*c\\* \\\\x1b\\[2J |" in config  # escaped
    assert "\x1b" not in report


def test_config_of_every_kind_and_its_errors(no_env_sinks):
    ns = argparse.Namespace(lr=0.1, layers=[1, 2], nested={"a": None})
    assert jh.History(distributed_history=False, config=ns).config == {
        "lr": 0.1,
        "layers": [1, 2],
        "nested": {"a": None},
    }
    as_int = {1: np.float32(0.5), "t": np.bool_(True), "x": jax.numpy.int32(3)}
    assert jh.History(distributed_history=False, config=as_int).config == {
        "1": 0.5,
        "t": True,
        "x": 3,
    }
    cyclic = {"a": {}}
    cyclic["a"]["b"] = cyclic
    deep = {}
    leaf = deep
    for _ in range(150):
        leaf["x"] = {}
        leaf = leaf["x"]
    bad = [
        ([1, 2], TypeError, "config must be a dict, a dataclass instance"),
        (Config, TypeError, "config must be a dict"),
        ({"opt": {"fn": print}}, TypeError, r"config\['opt'\]\['fn'\] is a builtin_"),
        ({(1, 2): 3}, TypeError, r"the key \(1, 2\)"),
        ({1: 0, "1": 1}, ValueError, "both become '1'"),
        (cyclic, ValueError, r"config\['a'\]\['b'\] holds itself"),
        (deep, ValueError, "nests more than 100 levels"),
        ({"w": np.zeros(2000)}, ValueError, "array of 2000 elements"),
        ({"s": "x" * (1 << 20)}, ValueError, "more than the 1048576"),
        ({"b": b"bytes"}, TypeError, "is a bytes"),
    ]
    for config, error, match in bad:
        with pytest.raises(error, match=match):
            jh.History(distributed_history=False, config=config)


def test_the_report_command_keeps_config_and_env_info(no_env_sinks, tmp_path):
    h = jh.History(distributed_history=False, config={"lr": 0.5})
    h.update({"loss": 1.0})
    h.update({"loss": 0.5})
    h.finalize(tmp_path / "run", plot=False, env_info={"git": {"sha": "abc123"}})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxhistory",
            "report",
            str(tmp_path / "run" / "dataset.nc"),
            "-o",
            str(tmp_path / "again"),
            "--no-plots",
        ],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "again" / "report.md").read_text()
    assert "| lr | 0.5 |" in report and "| git.sha | abc123 |" in report


# ----- finalize(env_info=...) --------------------------------------------------------
def test_env_info_dict_is_recorded_and_escaped(no_env_sinks, tmp_path):
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    info = {"cluster": "a|b\x1b[31m", "Python": {"Version": "3.11"}, "nodes": 4}
    ds = h.finalize(tmp_path / "out", plot=False, env_info=info)
    assert json.loads(ds.attrs["env_info"]) == info
    report = (tmp_path / "out" / "report.md").read_text()
    env = report.split("## Environment")[1].split("## Metrics")[0]
    assert "| cluster | a\\|b\\\\x1b\\[31m |" in env
    assert "| Python.Version | 3.11 |" in env and "| nodes | 4 |" in env
    assert "\x1b" not in report


def test_env_info_true_collects_it(no_env_sinks, tmp_path):
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    ds = h.finalize(tmp_path / "out", plot=False, save=False, env_info=True)
    info = json.loads(ds.attrs["env_info"])
    assert info["jax_version"] == jax.__version__
    assert info["device_count"] == jax.device_count() and info["process_count"] == 1
    assert {"flax_version", "numpy_version", "hostname", "python"} <= set(info)
    report = (tmp_path / "out" / "report.md").read_text()
    env = report.split("## Environment")[1].split("## Metrics")[0]
    assert "| flax |" in env and env.count("| jax |") == 1  # not repeated
    assert not set(info) & {"PATH", "HOME", "environ"}  # no environment variables


def test_bad_env_info_is_refused_before_anything_is_written(no_env_sinks, tmp_path):
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    for bad, error in (
        ("yes", TypeError),
        ([1], TypeError),
        ({"f": print}, TypeError),
        ({"n": np.ones(5000)}, ValueError),
    ):
        with pytest.raises(error, match="env_info"):
            h.finalize(tmp_path / "out", plot=False, env_info=bad)
        assert not (tmp_path / "out").exists()
    h.update({"loss": 0.5})  # nothing lost: recording and finalize go on
    ds = h.finalize(tmp_path / "out", plot=False, env_info=False)
    assert "env_info" not in ds.attrs
    assert h.state.values("loss").tolist() == [1.0, 0.5]


# ----- update(use_wandb=...) ---------------------------------------------------------
def test_update_accepts_use_wandb_and_warns_once(no_env_sinks):
    h = jh.History(distributed_history=False)
    with pytest.warns(UserWarning, match=r"update\(use_wandb=False\) is ignored"):
        assert h.update({"loss": 1.0}, use_wandb=False) == "step=0 loss=1.000000"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.update({"loss": 0.5}, use_wandb=True)
        h.update({"loss": 0.25}, use_wandb=None)
    with pytest.raises(ValueError, match="use_wandb must be True, False or None"):
        h.update({"loss": 9.0}, use_wandb="no")
    assert h.state.values("loss").tolist() == [1.0, 0.5, 0.25]


# ----- sinks by name and JAXHISTORY_SINKS -------------------------------------------
def test_sinks_from_the_environment(no_env_sinks, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXHISTORY_SINKS", " Console , CSV,tensorboard")
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    kinds = [type(s) for s in h.sinks]
    assert kinds == [ConsoleSink, CsvSink, TensorBoardSink]
    h.update({"loss": 1.0}, summarize=False)
    h.finalize(plot=False)
    rows = (tmp_path / f"{h.run_id}.csv").read_text().splitlines()
    assert rows[0] == "step,timestamp,loss" and rows[1].startswith("0,")
    assert (tmp_path / "tensorboard" / h.run_id).is_dir()
    table = tmp_path / f"{h.run_id}.training_history.csv"
    assert table.read_text() == "step,loss\n0,1.0\n"
    # code wins over the environment
    assert jh.History(distributed_history=False, sinks=()).sinks == ()
    named = jh.History(distributed_history=False, sinks="console")
    assert [type(s) for s in named.sinks] == [ConsoleSink]
    monkeypatch.setenv("JAXHISTORY_SINKS", "none")
    assert jh.History(distributed_history=False).sinks == ()
    monkeypatch.setenv("JAXHISTORY_SINKS", " ")
    assert jh.History(distributed_history=False).sinks == ()
    monkeypatch.setenv("JAXHISTORY_SINKS", "csv")
    jsonl = tmp_path / "logs" / "run.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=jsonl)
    assert h.sinks[0].path == jsonl.parent / f"{h.run_id}.csv"
    h.close()


def test_bad_sink_names_are_clear_errors(no_env_sinks, monkeypatch, tmp_path):
    cases = [
        (
            "console,foo",
            ValueError,
            r"JAXHISTORY_SINKS='console,foo': unknown sink "
            r"'foo'; known sinks: console, csv, tensorboard, wandb \(or none\)",
        ),
        ("jsonl", ValueError, "History writes its JSONL log itself"),
        ("csv,CSV", ValueError, "the sink 'csv' is named twice"),
        ("none,console", ValueError, "'none' means no sinks"),
        ("csv", ValueError, "the csv sink writes into the run's folder"),
    ]
    for text, error, match in cases:
        monkeypatch.setenv("JAXHISTORY_SINKS", text)
        with pytest.raises(error, match=match):
            jh.History(distributed_history=False)
    monkeypatch.delenv("JAXHISTORY_SINKS")
    with pytest.raises(ValueError, match=r"sinks='console;csv': unknown sink"):
        jh.History(distributed_history=False, sinks="console;csv")
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxhistory\[tensorboard\]'"):
        jh.History(distributed_history=False, sinks="tensorboard", report_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing made


def test_named_sinks_are_closed_when_the_history_cannot_start(no_env_sinks, tmp_path):
    log = tmp_path / "run.jsonl"
    holder = JsonlSink(log)  # a live writer holds the log
    with pytest.raises(ValueError, match="being written by another live"):
        jh.History(distributed_history=False, jsonl_path=log, sinks="csv")
    holder.close()
    made = list(tmp_path.glob("*.csv"))
    assert made and not any(in_use(p) for p in made)


def test_the_tensorboard_folder_is_never_a_link(no_env_sinks, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").symlink_to(elsewhere)
    with pytest.raises(NotAFile, match="symbolic link"):
        jh.History(
            distributed_history=False, sinks="tensorboard", report_dir=tmp_path / "run"
        )
    assert not list(elsewhere.iterdir())


def test_wandb_by_name(no_env_sinks, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    monkeypatch.setattr(wandb, "run", None)
    with pytest.raises(ValueError, match="no active W&B run"):
        jh.History(distributed_history=False, sinks="wandb")
    monkeypatch.setenv("WANDB_DISABLED", "1")
    assert jh.History(distributed_history=False, sinks="wandb").sinks == ()
    monkeypatch.delenv("WANDB_DISABLED")
    run = wandb.init(project="jaxhistory-tests", dir=str(tmp_path))
    try:
        h = jh.History(distributed_history=False, sinks="console,wandb")
        assert [type(s) for s in h.sinks] == [ConsoleSink, WandbSink]
        # names are the whole list: an active run alone adds no W&B sink
        only = jh.History(distributed_history=False, sinks="console")
        assert [type(s) for s in only.sinks] == [ConsoleSink]
        off = jh.History(distributed_history=False, sinks="wandb", use_wandb=False)
        assert off.sinks == ()
    finally:
        run.finish()


# ----- training_history -------------------------------------------------------------
def test_training_history_is_aligned_by_step():
    state = jh.HistoryState()
    state = state.update({"loss": 1.0, "tokens": 2**53 + 1, "ok": True}, step=0)
    state = state.update({"loss": math.nan, "w": np.ones(3)}, step=1)
    state = state.update({"eval": {"acc": 0.5}}, step=10)
    columns, rows = training_history(state)
    assert columns == ["step", "loss", "tokens", "ok", "eval/acc"]
    assert rows[0] == [0, 1.0, 2**53 + 1, True, None]
    assert rows[1][0] == 1 and math.isnan(rows[1][1]) and rows[1][2:] == [None] * 3
    assert rows[2] == [10, None, None, None, 0.5]
    assert training_history(jh.HistoryState()) == (["step"], [])


class _Tables:
    """A generic sink that takes tables."""

    def __init__(self, fail=False):
        self.tables, self.fail = [], fail

    def write(self, record):
        pass

    def flush(self):
        pass

    def close(self):
        pass

    def log_table(self, key, columns, rows):
        if self.fail:
            raise OSError("the table store is down")
        self.tables.append((key, columns, rows))


def test_finalize_hands_training_history_to_sinks_that_take_tables(
    no_env_sinks, tmp_path
):
    good, bad = _Tables(), _Tables(fail=True)
    h = jh.History(distributed_history=False, sinks=[bad, good])
    h.update({"loss": 1.0}, step=0)
    h.update({"loss": 0.5, "acc": 0.9}, step=5)
    with pytest.warns(RuntimeWarning, match=r"sink _Tables \(sinks\[0\]\): log_table"):
        h.finalize(tmp_path / "out", plot=False)
    assert good.tables == [
        ("training_history", ["step", "loss", "acc"], [[0, 1.0, None], [5, 0.5, 0.9]])
    ]
    assert (tmp_path / "out" / "report.md").is_file()


def test_named_sinks_are_checked_everywhere_and_made_on_process_zero(
    no_env_sinks, tmp_path
):
    from unittest import mock

    with mock.patch.object(jax, "process_index", return_value=1):
        h = jh.History(
            distributed_history=False, sinks="console,csv", report_dir=tmp_path
        )
        assert h.sinks == ()
        with pytest.raises(ValueError, match="unknown sink 'cvs'"):
            jh.History(distributed_history=False, sinks="cvs", report_dir=tmp_path)
        with pytest.raises(ValueError, match="the csv sink writes into"):
            jh.History(distributed_history=False, sinks="csv")
    assert not list(tmp_path.glob("*.csv"))


def test_a_resumed_run_appends_to_its_csv(no_env_sinks, tmp_path):
    h = jh.History(distributed_history=False, sinks="csv", report_dir=tmp_path)
    for step in range(3):
        h.update({"loss": float(step)}, summarize=False)
    h.close()
    log, csv_file = h.log_path, tmp_path / f"{h.run_id}.csv"
    again = jh.History(
        distributed_history=False, sinks="csv", resume=log, resume_step=2
    )
    assert again.run_id == h.run_id and again.sinks[0].path == csv_file
    for step in range(2, 4):
        again.update({"loss": 10.0 + step, "acc": 0.5}, step=step, summarize=False)
    again.close()
    rows = csv_file.read_text().splitlines()
    assert rows[0] == "step,timestamp,loss,acc"
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2", "2", "3"]
    assert rows[-1].endswith(",13.0,0.5") and rows[1].endswith(",0.0,")
