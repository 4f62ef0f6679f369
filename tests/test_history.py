"""History: summary lines, distributed history, settings, attach, run names and
the log each run owns, the dict view, resume, progress (steps/s, ETA, MFU)."""

import copy
import functools
import json
import threading
import time
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import orjson
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mp_workers import global_data

import jaxhistory as jh
from jaxhistory import _writer, export


def per_device(mesh, values):
    return jax.device_put(
        np.asarray(values, np.float32), NamedSharding(mesh, P("data"))
    )


def test_summary_line_formats_counters_and_floats():
    h = jh.History(distributed_history=False)
    line = h.update({"step": 42, "epoch": 3, "loss": 0.1234567, "lr": 1e-3})
    assert line == "step=42 epoch=3 loss=0.123457 lr=0.001000"
    assert h.update({"iter": 43, "loss": 0.5}, precision=2) == "iter=43 loss=0.50"
    assert h.state.steps("loss").tolist() == [42, 43]
    assert "step" not in h.state and "epoch" in h.state


def test_the_line_of_an_array_with_infinities_raises_no_numpy_warning():
    """Found by a randomized round trip: the mean the line shows for an array
    of more than four values holding inf and -inf (or values whose sum
    overflows) came with NumPy's "invalid value encountered in reduce", so
    under -W error update raised after the values were recorded."""
    h = jh.History(distributed_history=False)
    inf = float("inf")
    with warnings.catch_warnings():
        # (NumPy's warnings; not the ResourceWarning of an earlier test's
        # History the collector may finalize meanwhile)
        warnings.simplefilter("error", RuntimeWarning)
        line = h.update({"w": np.array([inf, -inf, 1.0, 2.0, 3.0])}, step=0)
        assert line == "step=0 w=nan(mean of 5)"
        big = np.full(5, 1.7e308)  # the sum overflows
        shown = h.update({"w": big}, step=1, precision=0)
        assert shown.startswith("step=1 w=") and shown.endswith("(mean of 5)")
        assert float(shown[9:-11]) == pytest.approx(1.7e308)
    assert h.state.count("w") == 2


def test_steps_auto_increment_and_keys_order_the_line():
    h = jh.History(keys=["lr"], distributed_history=False)
    assert h.update({"loss": 1.0, "lr": 0.5}) == "step=0 lr=0.500000 loss=1.000000"
    assert h.update({"loss": 2.0, "lr": 0.5}).startswith("step=1 ")
    assert h.update({"loss": 3.0}, step=10).startswith("step=10 ")


def test_distributed_metrics_inline_their_std(mesh):
    h = jh.History(distributed_history=True)
    line = h.update({"loss": per_device(mesh, np.arange(8.0)), "lr": 1e-3})
    std = np.std(np.arange(8.0))
    assert line == f"step=0 loss=3.500000(±{std:.6f}) lr=0.001000"
    stats = (*jh.STATS, *jh.PROVENANCE)
    assert set(h.state.keys) == {"lr", *(f"loss/{s}" for s in stats)}
    assert h.state.values("loss/max").tolist() == [7.0]


def test_one_fused_call_per_update(mesh):
    h = jh.History(distributed_history=True)
    metrics = {f"m{i}": per_device(mesh, np.arange(8.0) + i) for i in range(10)}
    h.update(metrics)
    (fn,) = h._recorder.job.reducer._fns.values()
    counts = jh.collective_counts(fn, metrics, None)  # no host scalars
    assert sum(counts.values()) <= 2
    assert h.state.values("m3/argmax").tolist() == [7]  # provenance, same cost


def test_replicated_arrays_and_scalars_are_recorded_as_they_are(mesh):
    h = jh.History(distributed_history=True)
    h.update({"acc": jnp.arange(3.0), "lr": jnp.float32(0.5)})
    assert h.state.shape("acc") == (3,) and "lr" in h.state


def test_a_mesh_of_one_device_records_the_names_of_many(mesh):
    """A value sharded over a mesh axis is per device on a mesh of one device
    too: a run on one GPU records the names it records on eight."""
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    per_example = jax.device_put(
        np.arange(4.0, dtype=np.float32), NamedSharding(one, P("data"))
    )
    loss = jax.jit(jh.per_shard)(per_example)
    assert loss.shape == (1,) and loss.sharding.is_fully_replicated
    assert loss.sharding.spec == P("data")  # the batch's axis, kept
    assert jh.per_shard(per_example).sharding.spec == P("data")
    h1 = jh.History(distributed_history=True)
    line = h1.update({"loss": loss, "lr": 0.5})
    assert line == "step=0 loss=1.500000(±0.000000) lr=0.500000"
    h8 = jh.History(distributed_history=True)
    h8.update({"loss": per_device(mesh, np.arange(8.0)), "lr": 0.5})
    assert set(h1.state.keys) == set(h8.state.keys)
    assert h1.state.values("loss/max").tolist() == [1.5]
    assert h1.state.values("loss/argmax").tolist() == [0]
    # Not sharded over an axis: recorded as it is, on one device or many.
    h = jh.History(distributed_history=True)
    h.update(
        {
            "replicated": jax.device_put(np.ones(3), NamedSharding(one, P())),
            "plain": jnp.ones(3),
        }
    )
    assert set(h.state.keys) == {"replicated", "plain"}
    assert h.state.shape("replicated") == (3,)


def test_distributed_history_off_records_per_device_arrays_whole(mesh):
    h = jh.History(distributed_history=False)
    line = h.update({"loss": per_device(mesh, np.arange(8.0))})
    assert h.state.shape("loss") == (8,)
    assert "loss=3.500000(mean of 8)" in line


def test_summarize_false_and_log_every_do_not_wait(mesh):
    f = jax.jit(lambda x: x * 2)
    x = per_device(mesh, np.arange(8.0))
    h = jh.History(distributed_history=True)
    with mock.patch.object(jax, "device_get", wraps=jax.device_get) as get:
        assert h.update({"loss": f(x)}, summarize=False) == ""
        assert get.call_count == 0
    every3 = jh.History(distributed_history=True, log_every=3)
    with mock.patch.object(jax, "device_get", wraps=jax.device_get) as get:
        lines = [every3.update({"loss": f(x)}) for _ in range(6)]
        assert get.call_count == 2  # only the two summarized updates waited
    assert [bool(line) for line in lines] == [True, False, False, True, False, False]
    assert every3.state.count("loss/mean") == 6
    assert every3.state.values("loss/max").tolist() == [14.0] * 6


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, True),
        ({"JAXHISTORY_NO_DISTRIBUTED_HISTORY": "1"}, False),
        ({"JAXHISTORY_LOCAL_HISTORY": "yes"}, False),
        ({"JAXHISTORY_LOCAL_HISTORY": "TRUE"}, False),
        ({"JAXHISTORY_NO_DISTRIBUTED_HISTORY": "0"}, True),
        ({"JAXHISTORY_LOCAL_HISTORY": ""}, True),
        ({"JAXHISTORY_LOCAL_HISTORY": "false"}, True),
    ],
)
def test_environment_turns_distributed_history_off(env, expected, monkeypatch):
    for name in ("JAXHISTORY_NO_DISTRIBUTED_HISTORY", "JAXHISTORY_LOCAL_HISTORY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert jh.distributed_default() is expected
    assert jh.History().distributed_history is expected
    assert jh.History(distributed_history=True).distributed_history is True


def test_unclear_environment_value_is_an_error(monkeypatch):
    monkeypatch.setenv("JAXHISTORY_LOCAL_HISTORY", "maybe")
    with pytest.raises(ValueError, match="JAXHISTORY_LOCAL_HISTORY='maybe'"):
        jh.distributed_default()


def test_any_number_of_devices_keeps_it_on(monkeypatch):
    for name in ("JAXHISTORY_NO_DISTRIBUTED_HISTORY", "JAXHISTORY_LOCAL_HISTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax, "device_count", lambda: 4096)
    assert jh.distributed_default() is True


def test_bad_settings_and_input():
    with pytest.raises(TypeError, match="keys"):
        jh.History(keys="loss")
    with pytest.raises(ValueError, match="log_every"):
        jh.History(log_every=0)
    for bad in (np.int64(0), np.bool_(True), 2.0, "3"):
        with pytest.raises(ValueError, match="log_every"):
            jh.History(log_every=bad)
    # NumPy ints are whole numbers, as steps are (np.int64(3) was refused)
    every = jh.History(
        distributed_history=False, log_every=np.int64(3), memory=np.int32(2)
    )
    assert type(every.log_every) is int and every.log_every == 3
    assert [every.update({"a": 1.0}) != "" for _ in range(4)] == [
        True,
        False,
        False,
        True,
    ]
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    with pytest.raises(TypeError, match="'name'"):
        h.update({"loss": 2.0, "name": "x"})
    with pytest.raises(ValueError, match="precision"):
        h.update({"loss": 2.0}, precision=-1)
    assert h.state.values("loss").tolist() == [1.0]
    assert h.update({"loss": 3.0}) == "step=1 loss=3.000000"


@pytest.mark.slow
def test_two_processes_record_the_same_distributed_history_as_one():
    two = jh.launch_local("mp_workers:distributed_history_run", 2, 2, args=(3,))
    one = jh.launch_local("mp_workers:distributed_history_run", 1, 4, args=(3,))
    assert two[0]["records"] == two[1]["records"]
    assert two[0]["lines"] == two[1]["lines"]
    assert sum(two[0]["collectives"].values()) <= 2, two[0]["collectives"]
    for stat in jh.STATS:
        key = f"loss/{stat}"
        np.testing.assert_allclose(
            two[0]["records"][key], one[0]["records"][key], rtol=1e-6, err_msg=key
        )
        for step in range(3):
            want = getattr(np, stat)(global_data(step, 1, 4)["m0"].astype(np.float64))
            np.testing.assert_allclose(two[0]["records"][key][step], want, rtol=1e-5)
    # Host scalars: reduced across the 2 processes, recorded as is with one.
    np.testing.assert_allclose(two[0]["records"]["host/mean"], [1.5, 3.0, 4.5])
    np.testing.assert_allclose(two[0]["records"]["host/std"], [0.5, 1.0, 1.5])
    assert one[0]["records"]["host"] == [1.0, 2.0, 3.0]
    assert two[0]["steps"]["lr/mean"] == one[0]["steps"]["lr"] == [0, 1, 2]


@pytest.mark.slow
def test_processes_with_different_names_all_get_a_clear_error():
    results = jh.launch_local("mp_workers:mismatched_names", 2, 1, timeout=120)
    assert all("different metrics" in r for r in results), results
    for r in results:  # each names what differs
        assert "process 0 has ['loss']" in r and "process 1 has ['lost']" in r, r


@pytest.mark.slow
@pytest.mark.parametrize("procs", [2, 4])
def test_replicated_values_and_step_statistics_across_processes(procs):
    """procs processes x 2 devices: a replicated scalar and array out of the
    step are recorded from each process's own copy, statistics from the step
    as they are, host scalars reduced; the metric names are compared once, not
    with an all-gather per update."""
    steps, n = 4, 2 * procs
    results = jh.launch_local(
        "mp_workers:replicated_values_run", procs, 2, args=(steps,), timeout=240
    )
    assert all(r["records"] == results[0]["records"] for r in results)
    assert [r["gathers"] for r in results] == [0] * procs
    records = results[0]["records"]
    for k in range(steps):
        per = global_data(k, 1, n)["m0"].astype(np.float64) ** 2
        np.testing.assert_allclose(
            records["grad_norm"][k], np.sqrt(per.sum()), rtol=1e-5
        )
        np.testing.assert_allclose(records["w"][k], [per.min(), per.max()], rtol=1e-5)
        np.testing.assert_allclose(records["dist/loss/mean"][k], per.mean(), rtol=1e-5)
        host = (procs + 1) / 2 * (k + 1)
        np.testing.assert_allclose(records["host/mean"][k], host, rtol=1e-6)
        # the largest host value is the last process's: its first device
        assert records["host/argmax"][k] == n - 2
    assert all(0 <= p < procs for p in records["straggler/process"])
    lines = results[0]["lines"]
    assert all(line.startswith(f"step={k} ") for k, line in enumerate(lines))
    refused = results[0]["refused"]
    assert "'x' holds different values on the devices of other processes" in refused
    assert "History(distributed_history=True)" in refused


@pytest.mark.slow
def test_a_process_that_never_sends_its_names_is_an_error_in_bounded_time():
    results = jh.launch_local("mp_workers:names_timeout", 2, 1, timeout=120)
    first = results[0]
    assert first["error"].startswith("process 1 did not send its metric names"), first
    assert first["seconds"] < 30


def test_stats_from_the_step_are_recorded_and_summarized(mesh):
    step = jax.jit(lambda x: {"dist": jh.distributed_stats({"loss": x}), "lr": 0.5})
    h = jh.History()
    line = h.update(step(per_device(mesh, np.arange(8.0))))
    std = np.std(np.arange(8.0))
    assert line == f"step=0 dist/loss=3.500000(±{std:.6f}) lr=0.500000"
    assert h.state.values("dist/loss/max").tolist() == [7.0]


def test_the_line_shows_the_step_that_was_recorded(mesh):
    h = jh.History()
    h.update({"eval/loss": 1.0}, step=100)
    assert h.update({"step": 50, "train/loss": 2.0}) == "step=50 train/loss=2.000000"
    line = h.update({"step": np.int64(60), "loss": per_device(mesh, np.ones(8))})
    assert line.startswith("step=60 loss=1.000000(")
    assert h.state.steps("loss/mean").tolist() == [60]


def test_counters_print_step_epoch_iter_in_that_order():
    h = jh.History(distributed_history=False)
    line = h.update({"iter": 7, "epoch": 1, "lr": 0.5}, step=7)
    assert line == "step=7 epoch=1 iter=7 lr=0.500000"


def test_step_entries_are_parsed_once_and_rows_with_them_take_the_float_path():
    h = jh.History(distributed_history=False)
    for i in range(3):
        line = h.update({"iter": 10 + i, "loss": 1.0 / (i + 1)})
        assert line.startswith(f"iter={10 + i} ")
    assert h.state.steps("loss").tolist() == [10, 11, 12]
    assert "iter" not in h.state
    ((table, _),) = h.state.data.tables.values()
    assert table.ptypes is not None  # the float fast path's table signature


def test_stat_names_are_stat_major_and_shared():
    names = jh.Stats(("a", "b"), np.zeros((4, 2))).keys()
    assert list(names) == [
        "a/mean",
        "a/max",
        "a/min",
        "a/std",
        "b/mean",
        "b/max",
        "b/min",
        "b/std",
    ]
    from jaxhistory._names import stat_names

    assert stat_names(("a", "b"), "p/") == (
        "p/a/mean",
        "p/b/mean",
        "p/a/max",
        "p/b/max",
        "p/a/min",
        "p/b/min",
        "p/a/std",
        "p/b/std",
    )
    assert stat_names(("",)) == ("mean", "max", "min", "std")


def test_attach_from_another_thread_loses_nothing_and_flattens_names(tmp_path):
    import json
    import threading

    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=path)
    stop = threading.Event()
    sent = []

    def publisher():
        k = 0
        while not stop.is_set() and k < 2000:
            h.attach({"pub": {"x": float(k)}}, step=10_000 + k)
            sent.append(k)
            k += 1

    thread = threading.Thread(target=publisher)
    thread.start()
    for i in range(500):
        h.update({"loss": float(i)}, step=i, summarize=False)
    stop.set()
    thread.join()
    h.close()
    state = h.state
    assert state.steps("loss").tolist() == list(range(500))
    assert state.count("pub/x") == len(sent)  # nested names joined with "/"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    logged = [r["metrics"]["pub/x"] for r in lines if "pub/x" in r["metrics"]]
    assert sorted(logged) == [float(k) for k in sent]


def _log_with_run_id(path, run_id):
    import json

    line = {
        "step": 1,
        "timestamp": 1.0,
        "run_id": run_id,
        "process_index": 0,
        "metrics": {"loss": 0.5},
        "aggregated": {},
    }
    path.write_text(json.dumps(line) + "\n")
    return path


@pytest.mark.parametrize("run_id", ["../../escaped", "/ABS/escaped", "a\x1b[2Jb"])
def test_a_resumed_run_id_that_is_a_path_is_refused_before_any_file_is_written(
    tmp_path, run_id
):
    run_id = run_id.replace("/ABS", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    log = _log_with_run_id(tmp_path / "run.jsonl", run_id)
    report_dir = tmp_path / "a" / "b" / "rd"
    report_dir.mkdir(parents=True)
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="run id") as err:
        jh.History(resume=log, report_dir=report_dir, distributed_history=False)
    assert str(log) in str(err.value) and repr(run_id)[:40] in str(err.value)
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written


def test_an_absolute_resumed_run_id_never_truncates_an_unrelated_file(tmp_path):
    victim = tmp_path / "precious.jsonl"
    victim.write_text("keep me\n")
    log = _log_with_run_id(tmp_path / "run.jsonl", str(tmp_path / "precious"))
    report_dir = tmp_path / "rd"
    report_dir.mkdir()
    for overwrite in (True, False):
        with pytest.raises(ValueError, match=r"is not a name \(it contains '/'\)"):
            jh.History(
                resume=log,
                report_dir=report_dir,
                jsonl_overwrite=overwrite,
                distributed_history=False,
            )
    assert victim.read_text() == "keep me\n"
    assert list(report_dir.iterdir()) == []


def test_a_run_id_that_is_a_path_in_a_dataset_or_a_state_is_refused(tmp_path):
    state = jh.HistoryState().update({"loss": 0.5}, step=1)
    bad = state.with_attrs(run_id="../escaped")
    with pytest.raises(ValueError, match="HistoryState given as resume"):
        jh.History(resume=bad, report_dir=tmp_path / "rd", distributed_history=False)
    dataset = tmp_path / "dataset.nc"
    jh.export.to_netcdf(state, dataset, attrs={"run_id": "../escaped"})
    with pytest.raises(ValueError, match="dataset.nc"):
        jh.History(
            resume=dataset, report_dir=tmp_path / "rd", distributed_history=False
        )
    with pytest.raises(ValueError, match="dataset.nc"):
        jh.History(
            resume=tmp_path, report_dir=tmp_path / "rd", distributed_history=False
        )
    assert not (tmp_path / "rd").exists() and not (tmp_path / "escaped.jsonl").exists()


def test_int_metric_names_are_recorded_as_strings_and_logged(tmp_path):
    import json

    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=path)
    assert h.update({1: 0.5, "acc": 2.0}) == "step=0 1=0.500000 acc=2.000000"
    h.update({1: 0.25, "acc": 3.0}, summarize=False)
    h.update({"train": {2: 1.5}}, summarize=False)
    h.close()
    assert h.state.values("1").tolist() == [0.5, 0.25]
    assert h.state.values("train/2").tolist() == [1.5]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["metrics"] for line in lines] == [
        {"1": 0.5, "acc": 2.0},
        {"1": 0.25, "acc": 3.0},
        {"train/2": 1.5},
    ]


def test_metric_names_that_collide_once_made_strings_are_refused():
    h = jh.History(distributed_history=False)
    with pytest.raises(ValueError, match="'1'"):
        h.update({1: 0.5, "1": 0.25})
    assert len(h.state) == 0


def test_the_time_left_is_not_thrown_by_one_slow_interval():
    from jaxhistory._progress import Progress

    now = [0.0]
    progress = Progress(100, None, None, clock=lambda: now[0])
    etas = {}
    for step in range(60):
        now[0] += 76.0 if step == 20 else 0.1  # an evaluation compiles at step 20
        out = progress.at(step, 1)
        etas[step] = out.get("perf/eta_sec")
    assert etas[0] is None  # no rate before the second summarized step
    assert etas[1] == pytest.approx(99 * 0.1)
    assert etas[20] == pytest.approx(80 * 0.1)  # the 76 s interval is one of 20
    assert etas[21] == pytest.approx(79 * 0.1)
    assert etas[50] == pytest.approx(50 * 0.1)
    now[0] += 0.5  # the rate itself is still the last interval's
    assert progress.at(60, 1)["perf/steps_per_sec"] == 2.0


def test_control_characters_in_names_never_reach_the_terminal_raw():
    h = jh.History(distributed_history=False)
    name = "loss\x1b[2J\nx"
    assert h.update({name: 0.5}) == "step=0 loss\\x1b[2J\\x0ax=0.500000"
    assert h.update({name: 0.25}) == "step=1 loss\\x1b[2J\\x0ax=0.250000"  # fast path
    line = h.update({name: 1, "a\x07": np.float32(2.0)}, precision=1)
    assert line == "step=2 loss\\x1b[2J\\x0ax=1 a\\x07=2.0"
    assert "\x1b" not in line and "\x07" not in line
    assert h.state.values(name).tolist() == [0.5, 0.25, 1.0]  # recorded as given


def test_bidirectional_controls_in_names_are_escaped_where_shown(tmp_path):
    h = jh.History(distributed_history=False)
    name = "loss\u202egol"  # would show reversed on a terminal
    assert h.update({name: 0.5}) == "step=0 loss\\u202egol=0.500000"
    h.finalize(tmp_path, plot=False)
    report = (tmp_path / "report.md").read_text()
    assert "\u202e" not in report and "\\u202e" in report
    # line and paragraph separators break a line where shown, as a newline does
    line = h.update({"a\u2028b\u2029c": 1.0}, step=9)
    assert line == "step=9 a\\u2028b\\u2029c=1.000000", line


@pytest.mark.parametrize("where", ["update", "nested", "attach", "state"])
def test_a_name_with_a_lone_surrogate_is_refused_and_loses_nothing(where, tmp_path):
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    h.update({"loss": 1.0})
    bad = "bad\udc80"  # what os.fsdecode makes of an undecodable byte
    with pytest.raises(ValueError, match=r"bad\\\\udc80.*lone surrogate"):
        if where == "update":
            h.update({"loss": 2.0, bad: 1.0})
        elif where == "nested":
            h.update({"loss": 2.0, "a": {bad: 1.0}})
        elif where == "attach":
            h.attach({bad: 1.0})
        else:
            h.state.update({bad: 1.0})
    h.update({"loss": 3.0})
    ds = h.finalize()
    assert ds["loss"].values.tolist() == [1.0, 3.0]
    lines = [json.loads(x) for x in h.log_path.read_text().splitlines()]
    assert [x["metrics"] for x in lines] == [{"loss": 1.0}, {"loss": 3.0}]


@pytest.mark.parametrize("where", ["update", "repeated", "nested", "attach", "state"])
def test_an_empty_metric_name_is_refused_and_loses_nothing(where, tmp_path):
    # An empty key showed as "=1.000000" in the summary and ": constant 1" in
    # the report, a row with no name.
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    h.update({"loss": 1.0})
    with pytest.raises(ValueError, match="empty"):
        if where == "update":
            h.update({"loss": 2.0, "": 1.0})
        elif where == "repeated":  # the names of the last row, then one empty
            h.update({"loss": 2.0, "": 1.0, "b": 1.0}, step=5)
        elif where == "nested":  # names that are not all str: flattened first
            h.update({"loss": 2.0, 1: 3.0, "": 1.0})
        elif where == "attach":
            h.attach({"": 1.0})
        else:
            h.state.update({"": 1.0})
    h.update({"loss": 3.0})
    ds = h.finalize()
    assert ds["loss"].values.tolist() == [1.0, 3.0]
    lines = [json.loads(x) for x in h.log_path.read_text().splitlines()]
    assert [x["metrics"] for x in lines] == [{"loss": 1.0}, {"loss": 3.0}]


def test_a_bare_stats_is_still_recorded_under_the_names_of_its_statistics(mesh):
    h = jh.History(distributed_history=False)
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    h.update(jh.distributed_stats(x))
    assert {"mean", "std", "min", "max"} <= set(h.state.keys)


@pytest.mark.parametrize("metrics", [None, 1.0, np.float32(2.0)])
def test_update_without_named_values_is_a_type_error_and_records_nothing(metrics):
    # update(None) recorded an empty step (a step function that returned
    # nothing), while update(1.0) was already a TypeError.
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    with pytest.raises(TypeError, match="named values"):
        h.update(metrics)
    with pytest.raises(TypeError, match="named values"):
        h.state.update(metrics)
    h.update({"loss": 2.0})
    assert h.state.steps("loss").tolist() == [0, 1]


def test_a_new_run_appending_to_the_log_of_another_is_told_so(tmp_path):
    """Finding: two runs given one jsonl_path, the second not resumed, shared
    the log without a word, and every reader merged them (count 10, mean 1.5
    over a=1 x 10 and a=2 x 5). The second run is warned, at History(...),
    naming the other run and the ways out (a restart that continues its
    steps by hand may mean it; resume= says so without a warning)."""
    log = tmp_path / "two.jsonl"
    first = jh.History(distributed_history=False, jsonl_path=log, run_name="run1")
    for _ in range(3):
        first.update({"a": 1.0})
    first.close()
    with pytest.warns(RuntimeWarning, match=f"holds the run {first.run_id}") as info:
        second = jh.History(distributed_history=False, jsonl_path=log, run_name="run2")
    said = str(info[0].message)
    assert "resume=" in said and "jsonl_overwrite=True" in said, said
    assert info[0].filename == __file__  # points at the caller's History(...)
    second.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resumed, replaced, empty: no warning
        again = jh.History(distributed_history=False, resume=log)  # continues run1
        again.update({"a": 2.0})
        again.close()
        assert jh.HistoryState.from_jsonl(log).values("a").tolist() == [1, 1, 1, 2]
        fresh = jh.History(
            distributed_history=False, jsonl_path=log, jsonl_overwrite=True
        )
        fresh.update({"a": 3.0})
        fresh.close()
        assert jh.HistoryState.from_jsonl(log).values("a").tolist() == [3.0]
        empty = tmp_path / "empty.jsonl"
        empty.write_bytes(b"")  # an empty file holds no run
        jh.History(distributed_history=False, jsonl_path=empty).close()


def test_arguments_of_the_wrong_kind_are_errors_naming_the_argument(tmp_path):
    """Finding: report_dir=3 and finalize(outdir=3) said only "expected str,
    bytes or os.PathLike object, not int" (the latter after ending the run),
    merge(3) an AttributeError, and a report_dir that is a file a bare
    NotADirectoryError for the CSV sink's file inside it."""
    for option in ("report_dir", "jsonl_path"):
        with pytest.raises(TypeError, match=f"{option} must be a path"):
            jh.History(distributed_history=False, **{option: 3})
    h = jh.History(distributed_history=False)
    h.update({"a": 1.0})
    with pytest.raises(TypeError, match="outdir must be a path"):
        h.finalize(3)
    h.update({"a": 2.0})  # the run goes on: nothing was finished
    with pytest.raises(TypeError, match="outdir must be a path"):
        export.finalize(h.state, 3)
    with pytest.raises(TypeError, match="merge takes a HistoryState, got int"):
        h.state.merge(3)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(
        OSError, match="report_dir: .*afile: it is a regular file, not a folder"
    ):
        jh.History(distributed_history=False, report_dir=afile, sinks="csv")
    assert afile.read_text() == "mine"
    # a path no folder can have: a raw "[Errno 36] File name too long" at
    # History(...) (or NotADirectoryError), now naming the option
    with pytest.raises(OSError, match=r"report_dir: the path is longer .*characters"):
        jh.History(distributed_history=False, report_dir=tmp_path / ("x" * 5000))
    with pytest.raises(OSError, match="report_dir: a part of the path is a file"):
        jh.History(distributed_history=False, report_dir=afile / "sub")
    assert h.finalize(tmp_path / "out", plot=False)["a"].values.tolist() == [1.0, 2.0]


def test_a_run_resumed_from_its_state_keeps_its_run_id(tmp_path):
    """Finding: History(resume=h.state), the checkpoint path the docs
    recommend, took a new run id, and run_name= could not restore it ("resume
    continues the run with its own run id"). The state carries the run id."""
    h = jh.History(distributed_history=False, run_name="myrun", report_dir=tmp_path)
    for _ in range(3):
        h.update({"a": 1.0})
    h.close()
    assert dict(h.state.attrs)["run_id"] == h.run_id
    again = jh.History(distributed_history=False, resume=h.state, report_dir=tmp_path)
    assert again.run_id == h.run_id
    again.update({"a": 2.0})
    again.close()  # the same log goes on
    assert jh.HistoryState.from_jsonl(h.log_path).values("a").tolist() == [1, 1, 1, 2]
    cut = jh.History(distributed_history=False, resume=h.state, resume_step=1)
    assert cut.run_id == h.run_id and len(cut.state) == 1


def test_a_name_with_a_nul_is_refused_and_never_cut_in_a_dataset(tmp_path):
    """Found by the random round trip: netCDF stores a name held as text (a
    long name's attribute, the long table's names) as a C string, so
    ``train/\\x00/x`` came back from dataset.nc as ``train/``, merged with
    another metric. Such a name is refused where it is recorded, and a state
    read from an older log holding one is refused by to_netcdf, never cut."""
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    h.update({"loss": 1.0})
    with pytest.raises(ValueError, match=r"train/\\\\x00/x.*NUL character"):
        h.update({"loss": 2.0, "train/\x00/x": 1.0})
    with pytest.raises(ValueError, match="NUL character"):
        h.update({"loss": 2.0, "a": {"\x00": 1.0}})
    h.update({"loss": 3.0})
    assert h.finalize(plot=False)["loss"].values.tolist() == [1.0, 3.0]
    old = tmp_path / "old.jsonl"
    old.write_text('{"step":0,"metrics":{"train/":1.0,"train/\\u0000/x":2.0}}\n')
    state = jh.HistoryState.from_jsonl(old)  # read as written
    assert set(state.keys) == {"train/", "train/\x00/x"}
    with pytest.raises(ValueError, match="NUL character"):
        export.to_netcdf(state, tmp_path / "old.nc")
    assert not (tmp_path / "old.nc").exists()


def test_a_warning_about_a_non_finite_metric_escapes_its_name(mesh):
    h = jh.History(distributed_history=True)
    values = per_device(mesh, [np.nan] + [1.0] * 7)
    with pytest.warns(RuntimeWarning) as caught:
        line = h.update({"bad\x1b[2J": values})
    texts = [str(w.message) for w in caught]
    assert any("bad\\x1b[2J/nan_device" in t for t in texts), texts
    assert not any("\x1b" in t for t in texts) and "\x1b" not in line


def _deep(levels: int, leaf: float = 1.0) -> dict:
    tree = {"x": leaf}
    for _ in range(levels - 1):
        tree = {"d": tree}
    return tree


@pytest.mark.parametrize("distributed", [False, True])
def test_update_refuses_a_2000_deep_tree_and_keeps_what_was_recorded(distributed):
    """A metrics dict nested 2000 levels is refused with a ValueError naming the
    limit, before anything walks it recursively; the records stay and the next
    update (and the next JAX call) works."""
    h = jh.History(distributed_history=distributed)
    h.update({"loss": 1.0, "acc": 0.5})
    h.update({"loss": jnp.float32(2.0), "acc": 0.25})
    with pytest.raises(ValueError, match=r"more than 100 levels") as err:
        h.update(_deep(2000))
    assert "metrics" in str(err.value)
    assert h.state.steps("loss").tolist() == [0, 1]
    assert h.state.values("loss").tolist() == [1.0, 2.0]
    assert h.state.next_step == 2
    assert h.update({"loss": 3.0, "acc": 0.125}) == (
        "step=2 loss=3.000000 acc=0.125000"
    )
    assert float(jnp.sum(jnp.arange(4.0))) == 6.0
    assert h.state.values("loss").tolist() == [1.0, 2.0, 3.0]


def test_history_state_update_refuses_a_2000_deep_tree():
    """HistoryState.update of a 2000-deep dict (or list nesting) raises a
    ValueError naming the limit; the state it was called on is unchanged."""
    s = jh.HistoryState().update({"loss": 1.0})
    nested_list: list = [0.0]
    for _ in range(1999):
        nested_list = [nested_list]
    for deep in (_deep(2000), {"l": nested_list}):
        with pytest.raises(ValueError, match=r"more than 100 levels"):
            s.update(deep)
    assert s.keys == ("loss",) and s.values("loss").tolist() == [1.0]
    s2 = s.update({"loss": 2.0})
    assert s2.values("loss").tolist() == [1.0, 2.0]


def test_update_takes_a_tree_at_the_depth_limit():
    """A dict nested exactly 100 levels is recorded under its joined name."""
    s = jh.HistoryState().update(_deep(100, 4.0))
    name = "/".join(["d"] * 99 + ["x"])
    assert s.keys == (name,) and s.values(name).tolist() == [4.0]
    h = jh.History(distributed_history=False)
    h.update(_deep(100, 4.0))
    assert h.state.values(name).tolist() == [4.0]


def test_a_resumed_run_id_of_any_accepted_length_is_finalized(tmp_path):
    """resume= and finalize take run ids up to the same length (the log's name
    {run_id}.jsonl within 255 bytes)."""
    run_id = "a" * 249
    state = jh.HistoryState().update({"loss": 1.0}, step=0).with_attrs(run_id=run_id)
    h = jh.History(distributed_history=False, resume=state, report_dir=tmp_path)
    h.update({"loss": 0.5}, step=1, summarize=False)
    ds = h.finalize(plot=False)
    h.close()
    assert ds.attrs["run_id"] == run_id
    assert (tmp_path / f"{run_id}.jsonl").exists()
    with pytest.raises(ValueError, match="not a name"):
        jh.History(
            distributed_history=False,
            resume=state.with_attrs(run_id="a" * 250),
            report_dir=tmp_path,
        )


def test_log_path_names_the_log_this_process_streams(tmp_path):
    assert jh.History(distributed_history=False).log_path is None
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    assert h.log_path == tmp_path / f"{h.run_id}.jsonl"
    h.update({"loss": 1.0})
    h.close()
    assert jh.HistoryState.from_jsonl(h.log_path).values("loss").tolist() == [1.0]
    per = jh.History(
        distributed_history=False, jsonl_path=tmp_path / "p{process_index}.jsonl"
    )
    assert per.log_path == tmp_path / "p0.jsonl"
    per.close()


def test_a_step_entry_and_explicit_step_take_the_same_path():
    """{"step": s, **metrics} is parsed once: the step leaves the dict (the
    caller's dict is unchanged), and the row is recorded as an explicit step."""
    h = jh.History(distributed_history=False)
    metrics = {"step": 7, "loss": 0.5}
    assert h.update(metrics) == "step=7 loss=0.500000"
    assert metrics == {"step": 7, "loss": 0.5}
    assert h.update({"loss": 0.25}, step=8) == "step=8 loss=0.250000"
    assert h.state.keys == ("loss",) and h.state.steps("loss").tolist() == [7, 8]
    with pytest.raises(ValueError, match="two steps given"):
        h.update({"step": 9, "loss": 1.0}, step=10)
    assert h.state.count("loss") == 2


# ----- the line, attach, run names, logs of their own -------------------------------


def test_a_fractional_epoch_is_shown_as_it_is():
    h = jh.History(distributed_history=False)
    assert h.update({"epoch": 1.5, "loss": 0.25}) == "step=0 epoch=1.5 loss=0.250000"
    assert h.update({"epoch": 2.0, "loss": 0.25}) == "step=1 epoch=2 loss=0.250000"


def test_attach_refuses_bad_values_at_once_and_keeps_the_good_ones():
    h = jh.History(distributed_history=False)
    h.attach({"t/good": 0.5})
    for bad in ("hello", None, b"x", object()):
        with pytest.raises(TypeError, match="'t/bad'"):
            h.attach({"t/bad": bad, "t/other": 1.0})

    @jax.jit
    def traced(x):
        h.attach({"t/bad": x})
        return x

    with pytest.raises(TypeError, match="'t/bad' is a JAX tracer"):
        traced(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.update({"loss": 1.0}, step=3)
    assert h.state.values("t/good").tolist() == [0.5]
    assert "t/other" not in h.state.keys and "t/bad" not in h.state.keys


@pytest.mark.parametrize(
    "name", ["../../../x", "/abs/path/x", "a/b", "a\\b", "..", "", "x\n", "n" * 201]
)
def test_a_run_name_is_a_name_never_a_path(name, tmp_path):
    with pytest.raises(ValueError, match="is not a name"):
        jh.History(run_name=name, report_dir=tmp_path)
    with pytest.raises(ValueError, match="is not a name"):
        jh.trace.JSONTraceHandler(folder=str(tmp_path), run_name=name)
    if len(name) <= 200:  # a run id may be longer: the name plus a time stamp
        with pytest.raises(ValueError, match="is not a name"):
            export.finalize(
                jh.HistoryState(), tmp_path / "out", run_id=name, plot=False
            )
    assert list(tmp_path.iterdir()) == []


def test_run_names_are_limited_in_bytes(tmp_path):
    with pytest.raises(ValueError, match="longer than 200 bytes"):
        jh.History(run_name="é" * 101, report_dir=tmp_path)
    jh.History(run_name="é" * 100, report_dir=tmp_path, distributed_history=False)


def test_two_histories_never_share_a_log(tmp_path):
    a = jh.History(run_name="same", report_dir=tmp_path, distributed_history=False)
    b = jh.History(run_name="same", report_dir=tmp_path, distributed_history=False)
    assert a.run_id != b.run_id
    a.update({"x": 1.0})
    b.update({"x": 2.0})
    a.close()
    b.close()
    assert export.from_jsonl(a.log_path).values("x").tolist() == [1.0]
    assert export.from_jsonl(b.log_path).values("x").tolist() == [2.0]
    # A log a live writer holds is refused, not appended to.
    c = jh.History(jsonl_path=tmp_path / "shared.jsonl", distributed_history=False)
    c.update({"x": 3.0})
    with pytest.raises(ValueError, match="being written by another live"):
        jh.History(jsonl_path=tmp_path / "shared.jsonl")
    c.close()  # closed: a later run may append (a resume)
    with pytest.warns(RuntimeWarning, match="holds the run"):  # not resumed
        d = jh.History(jsonl_path=tmp_path / "shared.jsonl", distributed_history=False)
    d.update({"x": 4.0}, step=1)
    d.close()
    assert export.from_jsonl(tmp_path / "shared.jsonl").values("x").tolist() == [3, 4]


# ----- the dict view of the values, log_every ---------------------------------------


def test_history_has_a_dict_view_of_its_values():
    h = jh.History(distributed_history=False)
    for i in range(3):
        h.update({"loss": 1.0 / (i + 1), "acc": i}, summarize=False)
    view = h.history
    assert list(view) == ["loss", "acc"]
    np.testing.assert_array_equal(view["loss"], [1.0, 0.5, 1 / 3])
    assert view["acc"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        view["acc"][0] = 5  # read-only: the record is not changed through it
    h.close()


def test_log_every_n_summarizes_at_n_2n():
    h = jh.History(distributed_history=False, log_every=10)
    lines = {step: h.update({"loss": 1.0, "step": step}) for step in range(1, 31)}
    assert [step for step, line in lines.items() if line] == [10, 20, 30]
    assert lines[20].startswith("step=20")
    h.close()


# ----- resume -----------------------------------------------------------------------


def test_a_log_resumed_at_an_earlier_step_agrees_with_the_dataset(tmp_path):
    """Finding: after History(resume=log, resume_step=5) the dataset held
    steps 0-7 but the log kept the abandoned attempt's steps 8-19 (and
    `jaxhistory summary log` gave count 20, mean 24.5 against 8 and 41). The
    lines at resume_step and later are set aside, whole, in a file beside
    the log before the run goes on, so that every reader of the log reads
    what the dataset holds."""
    first = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    for i in range(20):
        first.update({"loss": float(i), **({"late": 1.0} if i >= 10 else {})})
    first.close()
    log = first.log_path
    lines = log.read_bytes().splitlines(keepends=True)
    again = jh.History(distributed_history=False, resume=log, resume_step=5)
    for i in range(5, 8):
        again.update({"loss": 100.0 + i})
    ds = again.finalize(tmp_path / "out", plot=False)
    again.close()
    back = jh.HistoryState.from_jsonl(log)
    assert back.keys == ("loss",) and ds["loss"].values.tolist() == back.values(
        "loss"
    ).tolist() == [0, 1, 2, 3, 4, 105, 106, 107]
    aside = log.with_name(f"{log.name}.from-step-5")
    assert aside.read_bytes() == b"".join(lines[5:])  # the abandoned lines, whole
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == [log.name]
    # a second restart at the same step appends to the lines set aside
    third = jh.History(distributed_history=False, resume=log, resume_step=5)
    third.close()
    assert aside.read_bytes() == b"".join(lines[5:]) + b"".join(
        log_line for log_line in aside.read_bytes().splitlines(keepends=True)[15:]
    )
    assert len(aside.read_bytes().splitlines()) == 15 + 3
    assert len(log.read_bytes().splitlines()) == 5


@pytest.mark.parametrize("source", ["folder", "dataset", "state"])
def test_a_run_resumed_from_its_dataset_folder_or_state_sets_its_log_aside_too(
    tmp_path, source
):
    """Finding: the lines at resume_step and later were set aside only where
    resume named the log: resumed from the folder, dataset.nc or a state with
    report_dir the run's folder, the log it appends to kept the abandoned
    steps (loss [0,1,2,3,100,101,6,7] and 'x' at 0-7, where the dataset held
    [0,1,2,3,100,101] and 'x' at 0-3)."""
    out = tmp_path / "out"
    h = jh.History(distributed_history=False, report_dir=out, run_name="r")
    for s in range(8):
        h.update({"loss": float(s), "x": 1.0}, summarize=False)
    h.finalize(plot=False)
    state = h.state
    h.close()
    log = h.log_path
    resume = {"folder": out, "dataset": out / "dataset.nc", "state": state}[source]
    again = jh.History(
        distributed_history=False, report_dir=out, resume=resume, resume_step=4
    )
    assert again.run_id == h.run_id
    for s in range(2):
        again.update({"loss": 100.0 + s}, summarize=False)
    ds = again.finalize(plot=False)
    again.close()
    back = jh.HistoryState.from_jsonl(log)
    assert back.values("loss").tolist() == ds["loss"].values.tolist()
    assert back.values("loss").tolist() == [0, 1, 2, 3, 100, 101]
    assert back.steps("x").tolist() == [0, 1, 2, 3]
    aside = log.with_name(f"{log.name}.from-step-4")
    assert len(aside.read_bytes().splitlines()) == 4


def test_a_resume_step_leaves_another_runs_log_alone(tmp_path):
    """Only this run's own log is set aside: a jsonl_path holding another
    run's lines (given by hand) is appended to, its lines left where they are."""
    first = jh.History(distributed_history=False, report_dir=tmp_path / "a")
    for s in range(8):
        first.update({"loss": float(s)}, summarize=False)
    first.close()
    other = jh.History(distributed_history=False, report_dir=tmp_path / "b")
    for s in range(8):
        other.update({"loss": float(s)}, summarize=False)
    other.close()
    before = other.log_path.read_bytes()
    again = jh.History(
        distributed_history=False,
        resume=first.state,
        resume_step=4,
        jsonl_path=other.log_path,
    )
    again.close()
    assert other.log_path.read_bytes() == before
    assert not list(tmp_path.glob("*/*.from-step-*"))


def test_a_crashed_run_resumes_from_its_log_with_its_run_id(tmp_path):
    first = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    for i in range(10):
        first.update({"loss": float(i)}, step=i, summarize=False)
    first.close()  # the crash: the checkpoint is of step 5
    log = tmp_path / f"{first.run_id}.jsonl"
    again = jh.History(distributed_history=False, resume=log, resume_step=6)
    assert again.run_id == first.run_id and again.state.steps("loss").tolist() == list(
        range(6)
    )
    for i in range(6, 12):
        again.update({"loss": 100.0 + i}, step=i, summarize=False)
    again.finalize(tmp_path / "out", plot=False)
    again.close()
    back = jh.HistoryState.from_jsonl(log)  # the same log, appended to
    assert back.steps("loss").tolist() == list(range(12))
    assert back.values("loss").tolist() == [
        *range(6),
        *(100.0 + i for i in range(6, 12)),
    ]
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith(f"# Run report: {first.run_id}")
    import xarray as xr

    with xr.open_dataset(tmp_path / "out" / "dataset.nc") as ds:
        times = ds["time"].values  # the first run's from its log, then its own
        assert len(times) == 12 and not np.isnat(times).any()
        assert np.all(np.diff(times.astype("int64")) >= 0)
    # From a dataset or a state, and what is refused.
    from_nc = jh.History(distributed_history=False, resume=tmp_path / "out")
    assert from_nc.run_id == first.run_id and from_nc.state.count("loss") == 12
    from_nc.close()
    state = jh.History(distributed_history=False, resume=back).state
    assert state.count("loss") == 12
    with pytest.raises(ValueError, match="give run_name only to a new run"):
        jh.History(resume=log, run_name="other")
    with pytest.raises(ValueError, match="resume_step needs resume="):
        jh.History(resume_step=3)
    with pytest.raises(FileNotFoundError, match="no run log or dataset"):
        jh.History(resume=tmp_path / "missing.jsonl")
    with pytest.raises(TypeError, match="resume takes a HistoryState"):
        jh.History(resume=3)
    with pytest.raises(ValueError, match="would erase"):
        jh.History(resume=log, jsonl_path=log, jsonl_overwrite=True)
    with pytest.raises(ValueError, match="already recorded at step 11"):
        h = jh.History(distributed_history=False, resume=back)
        h.update({"loss": 1.0}, step=11)


# ----- progress: steps/s, ETA, MFU --------------------------------------------------


def test_progress_steps_per_second_eta_and_mfu(monkeypatch):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    flops = jh.step_flops(lambda a, b: a @ b, np.ones((4, 8)), np.ones((8, 2)))
    assert flops == 128.0
    h = jh.History(
        distributed_history=False, log_every=10, total_steps=100,
        flops_per_step=flops, peak_flops=1024.0,
    )  # fmt: skip
    lines = [h.update({"loss": 1.0}, step=i) for i in range(1, 31)]
    state = h.state
    assert state.steps("perf/steps_per_sec").tolist() == [20, 30]  # not at step 10
    # 10 steps per 1 s of the fake clock (one reading per summarized step)
    assert state.values("perf/steps_per_sec").tolist() == [10.0, 10.0]
    assert state.values("perf/eta_sec").tolist() == [8.0, 7.0]
    assert state.values("perf/mfu").tolist() == [1.25, 1.25]  # 10 * 128 / 1024
    assert "perf/eta_sec=7" in lines[29] and "perf/mfu=1.25" in lines[29]
    assert state.steps("loss").tolist() == list(range(1, 31))
    h.close()
    for bad, match in (
        ({"total_steps": 0}, "total_steps must be a positive int"),
        ({"flops_per_step": 1.0}, "MFU needs both"),
        ({"peak_flops": -1.0, "flops_per_step": 1.0}, "peak_flops must be a positive"),
    ):
        with pytest.raises(ValueError, match=match):
            jh.History(**bad)


def test_state_can_be_replaced_and_refuses_what_is_no_state():
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    h.state = jh.HistoryState().update({"acc": 0.5}, step=10)
    assert h.update({"loss": 2.0}) == "step=11 loss=2.000000"
    assert h.state.keys == ("acc", "loss")
    with pytest.raises(TypeError, match="HistoryState"):
        h.state = {"loss": [1.0]}
    assert h.state.keys == ("acc", "loss")  # nothing lost


def test_a_state_read_during_the_run_never_changes():
    h = jh.History(distributed_history=False)
    for s in range(4):
        h.update({"step": s, "loss": float(s)})
    before = h.state
    for s in range(4, 8):
        h.update({"step": s, "loss": float(s)})
    assert before.steps("loss").tolist() == [0, 1, 2, 3]
    assert h.state.steps("loss").tolist() == list(range(8))


@pytest.mark.slow
def test_every_process_of_a_job_uses_one_run_id():
    """Processes that start a second apart (their clocks name different
    seconds) agree on one id per History; a process that makes no History
    holds nobody up."""
    results = jh.launch_local("mp_workers:run_ids", 3, 1, args=(1, 1.2), timeout=120)
    ids = [r["ids"] for r in results if r["ids"]]
    assert len(ids) == 2 and ids[0] == ids[1], results
    named, unnamed = ids[0]
    assert named.startswith("mp-") and unnamed.startswith("run-"), ids


@pytest.mark.slow
def test_a_metric_added_on_one_process_mid_run_fails_fast_naming_it():
    """Process 1 adds a metric at step 3; process 0 goes on with the old ones.
    Process 1 gets a clear ValueError within seconds (not a 120 s timeout
    blaming process 0), and the job ends."""
    start = time.monotonic()
    with pytest.raises(jh.LaunchError) as info:
        jh.launch_local(
            "mp_workers:metric_added_on_one_process", 2, 1, args=(2.0,), timeout=90
        )
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "did not send" not in text, text
    assert "process 1 has ['extra'] (at step 3)" in text, text
    assert "process 0 has no other names (at step 3)" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["np", "jax"])
def test_a_value_recorded_as_is_that_differs_across_processes_is_an_error(kind):
    """A NumPy array (or a single-device JAX array) that differs on process 1
    from step 5 on: every process raises ValueError at the same update, within
    the checking window, naming the metric, the step and both ways out."""
    results = jh.launch_local(
        "mp_workers:differing_plain_values", 2, 1, args=(kind,), timeout=120
    )
    raised = [r["raised"] for r in results]
    assert raised[0] is not None and raised[0][0] == raised[1][0], raised
    step, text = raised[0]
    assert 5 <= step <= 5 + 8, raised
    assert "'w'" in text and "step 5" in text, text
    assert "distributed_stats" in text and "per_shard" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("log_every", [1, 4])
def test_values_the_same_on_every_process_pass_and_a_constant_stays_constant(
    log_every,
):
    """3 processes, each update reduced (log_every=1) or batches reduced on
    the host, process 0 combining the other two's posts (log_every=4)."""
    results = jh.launch_local(
        "mp_workers:differing_plain_values",
        3,
        2,
        args=("same", log_every),
        timeout=120,
    )
    assert [r["raised"] for r in results] == [None] * 3
    lr = results[0]["lr"]
    assert set(lr["lr/std"]) == {0.0}, lr
    assert set(lr["lr/mean"]) == set(lr["lr/max"]) == {float(np.float32(0.003))}, lr


@pytest.mark.slow
def test_a_process_ten_percent_slower_is_flagged_and_tabled(tmp_path):
    results = jh.launch_local(
        "mp_workers:straggler_scores_run", 3, 1, args=(2, str(tmp_path)), timeout=180
    )
    first = results[0]
    assert first["steps"] == [9, 19, 29, 39], first
    assert all(s == 2 for s in first["slowest"][1:]), first
    medians = np.asarray(first["median"])
    assert medians.shape == (4, 3) and (medians[1:, 2] > 0.005).all(), medians
    for r in results:  # every process sees the same and warns
        assert r["flagged"] and "process 2 is consistently slower" in r["flagged"][0]
    report = (tmp_path / "report.md").read_text()
    assert "## Stragglers" in report and "| 2 |" in report, report
    assert (tmp_path / "plots" / "mplot" / "straggler_median_lag.heatmap.png").exists()


@pytest.mark.slow
def test_equal_processes_are_never_flagged(tmp_path):
    results = jh.launch_local(
        "mp_workers:straggler_scores_run", 3, 1, args=(-1, str(tmp_path)), timeout=180
    )
    assert [r["flagged"] for r in results] == [[], [], []], results


@functools.cache
def _one_program_per_update() -> list:
    return jh.launch_local("mp_workers:batched_run", 2, 2, args=(1, 10), timeout=180)


def one_program_per_update() -> list:
    """The reference the batched runs are compared with: 2 processes x 2
    devices, 10 updates, one device program each (log_every=1). The run is
    deterministic, so it is launched once per test process; each test gets a
    copy of its results."""
    return copy.deepcopy(_one_program_per_update())


@pytest.mark.slow
def test_with_log_every_values_are_reduced_in_batches_and_recorded_at_their_steps():
    """2 processes x 2 devices, log_every=4, 10 updates: 4 batches reduced on
    the host (at steps 0, 4 and 8, and the rest at close) and no device
    program, instead of 10 programs; the same records at the same steps as one
    program per update, summary lines at 0, 4 and 8."""
    each = one_program_per_update()
    batched = jh.launch_local("mp_workers:batched_run", 2, 2, args=(4, 10), timeout=180)
    assert [(r["programs"], r["batches"]) for r in each] == [([1] * 10, [])] * 2
    assert [(r["programs"], r["batches"]) for r in batched] == [([], [1, 4, 4, 1])] * 2
    # the four batches are one group (deleted at the next group's first): its
    # keys stay, process 1's posts and the results
    kept = [f"group0/batch{n}/{k}" for n in range(4) for k in ("1", "result")]
    assert batched[0]["store"] == kept, batched[0]["store"]
    one, many = each[0], batched[0]
    for name in ("loss/mean", "loss/std", "loss/argmax", "host/mean", "host/max"):
        assert many["steps"][name] == list(range(10)), name
        # float64 sums rounded to float32 against float32 sums: one rounding
        np.testing.assert_allclose(
            many["records"][name], one["records"][name], rtol=2.5e-7, err_msg=name
        )
    # ... and the batch's are the float64 statistics, rounded once
    data = [global_data(step, 1, 4)["m0"].astype(np.float64) for step in range(10)]
    for stat, fn in (("mean", np.mean), ("std", np.std), ("max", np.max)):
        exact = [float(np.float32(fn(d))) for d in data]
        assert many["records"][f"loss/{stat}"] == exact, stat
    assert many["steps"]["straggler/process"] == list(range(10))
    assert [bool(x) for x in many["lines"]] == [k % 4 == 0 for k in range(10)]
    head = [line.split(" straggler")[0] for line in (many["lines"][4], one["lines"][4])]
    assert head[0] == head[1], head
    assert "loss=" in many["lines"][4] and "host=" in many["lines"][4]


@pytest.mark.slow
@pytest.mark.parametrize("summarize", ["none", "first"])
def test_batches_fetched_later_record_the_same(summarize):
    """Without a summary line at a batch's last update (on every process, or
    only on process 0), a batch is fetched at the next one or at close: the
    records are the same."""
    each = one_program_per_update()
    late = jh.launch_local(
        "mp_workers:batched_run", 2, 2, args=(4, 10, summarize), timeout=180
    )
    for r in late:
        assert (r["programs"], r["batches"]) == ([], [1, 4, 4, 1])
        for name in ("loss/mean", "loss/argmin", "host/mean", "host/std"):
            assert r["steps"][name] == list(range(10)), name
            np.testing.assert_allclose(
                r["records"][name], each[0]["records"][name], rtol=2.5e-7, err_msg=name
            )


@pytest.mark.slow
def test_a_batch_of_many_values_closes_early_and_records_the_same():
    """A batch holds at most BATCH_VALUES values (what each process posts to
    the key-value store): with 4 names (the loss, the host scalar, the two
    arrival times) and a cap of 12, a batch closes after 3 updates, or at a
    step that is a multiple of log_every=8 (steps 0 | 1-3 | 4-6 | 7-8 | 9)."""
    capped = jh.launch_local(
        "mp_workers:batched_run", 2, 2, args=(8, 10, "all", 12), timeout=180
    )
    data = [global_data(step, 1, 4)["m0"].astype(np.float64) for step in range(10)]
    for r in capped:
        assert (r["programs"], r["batches"]) == ([], [1, 3, 3, 2, 1])
        for name in ("loss/mean", "loss/argmax", "host/mean"):
            assert r["steps"][name] == list(range(10)), name
        assert r["records"]["loss/mean"] == [float(np.float32(d.mean())) for d in data]
        assert r["records"]["loss/argmax"] == [int(np.argmax(d)) for d in data]
        # host: (process + 1) * (step + 1) on 2 devices of each process
        assert r["records"]["host/mean"] == [1.5 * (s + 1) for s in range(10)]


@pytest.mark.slow
def test_a_process_exits_cleanly_while_a_batch_waits_in_the_store():
    """The batch thread blocked in the runtime's client at exit: stopped at
    exit (within a poll of the store), not ended inside native code, which
    aborts the process ("exception not rethrown")."""
    got = jh.launch_local("mp_workers:exit_while_a_batch_waits", 2, 1, timeout=60)
    assert got == ["waiting", "waiting"]


@pytest.mark.slow
def test_in_batches_a_value_that_is_no_number_raises_at_its_update_and_costs_nothing():
    for got in jh.launch_local("mp_workers:bad_host_value_in_a_batch", 2, 1):
        [(step, text)] = got["raised"]
        assert step == 5 and "'host' is not numeric (str)" in text
        assert got["steps"] == [0, 1, 2, 3, 4, 6, 7]


@pytest.mark.slow
def test_in_batches_a_differing_value_raises_at_the_same_update_everywhere():
    results = jh.launch_local(
        "mp_workers:differing_plain_values", 2, 1, args=("np", 4), timeout=120
    )
    raised = [r["raised"] for r in results]
    assert raised[0] is not None and raised[0][0] == raised[1][0], raised
    assert "'w' differs across processes at step 5" in raised[0][1]


@pytest.mark.slow
def test_host_scalars_are_reduced_in_float64_where_jax_allows_it():
    got = jh.launch_local("mp_workers:host_scalars_in_float64", 2, 1, timeout=120)[0]
    assert got["x/max"] == 1234567.891 + 1e-6 and got["x/min"] == 1234567.891
    assert got["x/mean"] == pytest.approx(1234567.891 + 0.5e-6, abs=1e-9)
    assert got["lr/mean"] == 0.003 and got["lr/std"] == 0.0


# ----- a dict like the last one: the one-call path -----------------------------------


def _updates_of_every_kind(rng):
    """A mixed run: repeated dicts of floats (the one-call path), and, between
    them, everything that must leave it (other values, steps, names, attach,
    bad input, state read and set, precision, summarize)."""
    keys = ("loss", "lr", "a/b", 'q"%s')
    base = dict.fromkeys(keys, 0.5)
    # each right after a dict that the one-call path can follow
    ops = [("update", {**base, "loss": v}) for v in (1.0, 2.0, 3.0)]
    for odd in (float("nan"), float("inf"), -float("inf"), 3, True, np.float32(2)):
        ops += [("update", base), ("update", {**base, "loss": odd}), ("flush",)]
    ops += [("update", {"step": s, **base}) for s in (20, 21, 21, 19, 2**63, 22)]
    ops += [("update", {**base, "step": s}) for s in (30, 31, 31.0, 29, "x", 32)]
    step = 40
    for i in range(400):
        values = {k: float(rng.normal()) for k in keys}
        r = rng.integers(40)
        if r == 0:
            values["loss"] = float("nan")
        elif r == 1:
            values["lr"] = 3  # an int: no longer all floats
        elif r == 2:
            values["loss"] = np.float32(0.5)
        elif r == 3:
            values["extra"] = 1.0  # another set of names
        elif r == 4:
            del values["lr"]
        elif r == 5:
            values = dict(reversed(values.items()))
        elif r == 6:
            ops.append(("attach", {"t/x": float(i)}))
        elif r == 7:
            ops.append(("bad", {**values, "loss": "oops"}))
        elif r == 8:
            ops.append(("read_and_set", None))
        elif r == 9:
            values["loss"] = float("inf")
        elif r == 10:
            values["lr"] = jnp.float32(0.25)
        elif r < 14:
            ops.append(("flush",))  # the log's batches end anywhere
        form = rng.integers(6)
        kwargs = {}
        if form == 1:
            values = {"step": step, **values}
        elif form == 2:
            values = {**values, "step": step}
        elif form == 3:
            kwargs["step"] = step
        elif form == 4 and i > 50:
            values = {"step": step - 3, **values}  # a step already recorded
        if rng.integers(10) == 0:
            kwargs["precision"] = int(rng.integers(0, 9))
        if rng.integers(7) == 0:
            kwargs["summarize"] = False
        ops.append(("update", values, kwargs))
        step += 1 + int(rng.integers(2))
    return ops


def _run(ops, tmp_path, name, one_call):
    log = tmp_path / f"{name}.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log, log_every=3)
    lines, errors = [], []
    with mock.patch.object(
        jh._history_state.Appender,
        "take",
        jh._history_state.Appender.take if one_call else lambda *a: None,
    ):
        for op in ops:
            if op[0] == "attach":
                h.attach(op[1])
            elif op[0] == "flush":
                h.flush()
            elif op[0] == "read_and_set":
                state = h.state
                state.update({"branch": 1.0})  # another branch of it, not seen
                h.state = state
            else:
                metrics = op[1]
                kwargs = op[2] if len(op) > 2 else {}
                try:
                    lines.append(h.update(metrics, **kwargs))
                except (TypeError, ValueError) as err:
                    errors.append(type(err).__name__)
        h.close()
    rows = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    for row in rows:
        row.pop("timestamp"), row.pop("run_id")
    return h.state, lines, errors, rows


def test_a_dict_like_the_last_records_logs_and_shows_what_the_full_parse_does(
    tmp_path,
):
    """Every update of a mixed run, through the one-call path where it applies,
    gives the same summary lines, errors, state and log lines as with every
    update fully parsed."""
    ops = _updates_of_every_kind(np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fast = _run(ops, tmp_path, "fast", True)
        full = _run(ops, tmp_path, "full", False)
    (state, lines, errors, rows), (state0, lines0, errors0, rows0) = fast, full
    assert lines == lines0 and errors == errors0 and rows == rows0
    assert len(errors) > 5 and sum(bool(line) for line in lines) > 50
    assert state.keys == state0.keys
    for key in state.keys:
        np.testing.assert_array_equal(state.steps(key), state0.steps(key))
        np.testing.assert_array_equal(state.values(key), state0.values(key))
        assert state.values(key).dtype == state0.values(key).dtype


def test_the_one_call_path_is_taken_by_repeated_dicts(host_path):
    h = jh.History(distributed_history=False)
    taken = []
    take = jh._history_state.Appender.take

    def counting(self, metrics, now, *copy):
        row = take(self, metrics, now, *copy)
        taken.append(row is not None)
        return row

    class Counted:  # the compiled path: one call, or NotImplemented and take
        def __getattr__(self, name):
            return getattr(host_path, name)

        def update(self, *args):
            row = host_path.update(*args)
            taken.append(row is not NotImplemented)
            return row

    patched = mock.patch.object(jh._recorder, "speedups", Counted())
    if host_path is None:
        patched = mock.patch.object(jh._history_state.Appender, "take", counting)
    with patched:
        for s in range(5):
            h.update({"loss": 1.0 / (s + 1), "lr": 0.1})
        for s in range(5, 10):
            h.update({"step": s, "loss": 0.5, "lr": 0.1})
    # the second dict goes onto the end of the first's table, then each takes
    # one call (a step entry first is another form of dict: once more)
    assert taken == [False] * 2 + [True] * 3 + [False] + [True] * 4
    assert h.state.steps("loss").tolist() == list(range(10))


@pytest.mark.usefixtures("host_path")
def test_repeated_dicts_from_threads_are_all_recorded_and_logged(tmp_path):
    log = tmp_path / "t.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    n, k = 2_000, 4

    def work(t):
        for i in range(n):
            h.update({f"t{t}/loss": float(i), f"t{t}/lr": 0.5}, summarize=i % 2 == 0)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(k)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    h.close()
    state = h.state
    for t in range(k):
        assert state.values(f"t{t}/loss").tolist() == [float(i) for i in range(n)]
    assert len(log.read_bytes().splitlines()) == n * k


@pytest.mark.usefixtures("host_path")
def test_a_value_that_only_adds_like_a_float_is_recorded_and_shown_as_nan():
    """A dict like the last one takes the fast path, which accepts what adds
    like a float (stored as NaN with a warning when it cannot be converted,
    as for HistoryState.update): its summary line shows what is stored
    instead of raising after the value was recorded."""

    class AddsLikeAFloat:
        def __radd__(self, other):
            return other + 1.0

    h = jh.History(distributed_history=False)
    for v in (1.0, 2.0, 3.0):
        h.update({"a": v, "b": v})
    line = h.update({"a": AddsLikeAFloat(), "b": 4.0})
    assert line == "step=3 a=nan b=4.000000"
    with pytest.warns(RuntimeWarning, match="'a'.*recorded as NaN"):
        values = h.state.values("a")
    assert values[:3].tolist() == [1.0, 2.0, 3.0] and np.isnan(values[3])


@pytest.mark.usefixtures("host_path")
def test_a_state_read_and_updated_aside_does_not_share_rows_with_the_history():
    """The one-call path appends in place to the table the last state read from
    the History also ends with; a branch made from that state (updated with the
    same names) and the History's later rows never see each other."""
    h = jh.History(distributed_history=False)
    for s in range(4):
        h.update({"loss": float(s), "lr": 0.5})
    snapshot = h.state
    branch = snapshot.update({"loss": 100.0, "lr": 0.25})  # same table, step 4
    for s in range(4, 7):
        h.update({"loss": float(s), "lr": 0.5})
    assert h.state.values("loss").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert branch.values("loss").tolist() == [0.0, 1.0, 2.0, 3.0, 100.0]
    assert branch.values("lr").tolist()[-1] == 0.25
    assert snapshot.values("loss").tolist() == [0.0, 1.0, 2.0, 3.0]
    more = branch.update({"loss": 200.0, "lr": 0.25})
    assert more.steps("loss").tolist() == [0, 1, 2, 3, 4, 5]
    assert h.state.steps("loss").tolist() == list(range(7))


@pytest.mark.usefixtures("host_path")
def test_a_repeated_dict_after_the_last_int64_step_is_refused_and_nothing_is_lost():
    h = jh.History(distributed_history=False)
    for _ in range(3):
        h.update({"a": 1.0, "b": 2.0})
    h.update({"a": 1.0, "b": 2.0}, step=2**63 - 1)
    for _ in range(2):
        with pytest.raises(ValueError, match="int64"):
            h.update({"a": 1.0, "b": 2.0})
    assert h.state.steps("a").tolist() == [0, 1, 2, 2**63 - 1]
    state = h.state
    with pytest.raises(ValueError, match="int64"):
        state.update({"a": 1.0, "b": 2.0})
    assert state.count("a") == 4


@pytest.mark.usefixtures("host_path")
def test_the_log_holds_a_repeated_dicts_values_at_its_update(tmp_path):
    """The log is written later, from a copy: a dict the caller changes (or
    reuses) after ``update`` is logged as it was at the update."""
    log = tmp_path / "m.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    m = {"loss": 0.0, "lr": 0.5}
    stepped = {"step": 100, "loss": 0.0}
    for s in range(6):
        m["loss"] = float(s)
        h.update(m, summarize=s % 2 == 0)
    h.close()
    h2 = jh.History(distributed_history=False, jsonl_path=tmp_path / "s.jsonl")
    for s in range(100, 106):
        stepped["step"], stepped["loss"] = s, s / 2
        h2.update(stepped)
    stepped.clear()
    h2.close()
    lines = [orjson.loads(x) for x in log.read_bytes().splitlines()]
    assert [x["metrics"] for x in lines] == [
        {"loss": float(s), "lr": 0.5} for s in range(6)
    ]
    lines = [orjson.loads(x) for x in (tmp_path / "s.jsonl").read_bytes().splitlines()]
    assert [(x["step"], x["metrics"]) for x in lines] == [
        (s, {"loss": s / 2}) for s in range(100, 106)
    ]


def test_a_numpy_buffer_refilled_after_the_update_is_logged_as_it_was(tmp_path):
    seen = []

    class Sink:
        def write(self, record):
            if "v" in record.metrics:  # (not the sentinel's count)
                seen.append(np.array(record.metrics["v"]).tolist())

        def flush(self):
            pass

        def close(self):
            pass

    events = []
    h = jh.History(
        distributed_history=False,
        report_dir=tmp_path,
        sinks=[Sink()],
        sentinels=[jh.sentinels.NonFinite("v", action=events.append)],
    )
    buf, scalar = np.zeros(3), np.zeros(())
    for i in range(5):
        buf[:], scalar[()] = i, i
        if i == 3:
            buf[1] = np.nan
        h.update({"v": buf, "s": scalar}, step=i)
    buf[:], scalar[()] = -1, -1  # the loop's buffers, refilled later
    h.close()
    want = [[float(i)] * 3 for i in range(5)]
    want[3][1] = None  # NaN, as the log writes it
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    lines = [x for x in lines if "v" in x["metrics"]]  # (not the sentinel's count)
    got = [[None if v == "NaN" else v for v in x["metrics"]["v"]] for x in lines]
    assert got == want
    assert [x["metrics"]["s"] for x in lines] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [np.nan_to_num(v, nan=-9).tolist() for v in map(np.array, seen)] == [
        [-9 if v is None else v for v in row] for row in want
    ]
    assert [(e.metric, e.step) for e in events] == [("v", 3)]


def test_an_int_past_64_bits_joining_a_float_metric_keeps_its_log_line(tmp_path):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    h.update({"loss": 0.5, "lr": 0.1}, step=0)
    h.update({"loss": 0.4, "lr": 2**70}, step=1)  # float64 holds it exactly
    h.update({"loss": 0.3, "lr": 0.1}, step=2)
    h.close()
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    assert [x["metrics"]["loss"] for x in lines] == [0.5, 0.4, 0.3]
    assert [x["metrics"]["lr"] for x in lines] == [0.1, float(2**70), 0.1]
    assert h.state.values("lr").tolist() == [0.1, float(2**70), 0.1]


def test_with_warnings_as_errors_a_failing_sink_costs_the_log_nothing(tmp_path, caplog):
    class Broken:
        def write(self, record):
            raise OSError("disk gone")

        def flush(self):
            pass

        def close(self):
            pass

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest -W error does, on every thread
        h = jh.History(distributed_history=False, report_dir=tmp_path, sinks=[Broken()])
        for s in range(300):
            h.update({"loss": float(s)}, summarize=False)
        h.flush()
        writer = h._recorder.out.writer
        assert writer._thread.is_alive()
        h.close()
    assert len(h.log_path.read_bytes().splitlines()) == 300
    assert any("disk gone" in r.getMessage() for r in caplog.records)


def test_with_warnings_as_errors_an_unrecordable_attach_costs_the_update_nothing(
    tmp_path, caplog
):
    """Attached values that cannot be recorded at their step (the metric has
    a later record) are a warning: with warnings as errors, that warning must
    not raise out of the update that records them (its row already in the
    history, not yet in the log), nor out of flush or finalize."""
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    h.attach({"t": 1.0}, step=5)
    h.update({"loss": 0.5}, step=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest -W error does
        h.attach({"t": 2.0}, step=2)  # before t's record at 5
        h.update({"loss": 0.25}, step=6)
        h.attach({"t": 3.0}, step=3)
        h.flush()
        h.attach({"t": 4.0}, step=4)
        h.finalize(plot=False)
    assert h.state.steps("loss").tolist() == [5, 6]
    logged = jh.HistoryState.from_jsonl(h.log_path)
    assert logged.steps("loss").tolist() == [5, 6]
    assert (tmp_path / "dataset.nc").is_file()
    assert any("were not recorded at step 2" in r.getMessage() for r in caplog.records)


def test_a_log_deleted_mid_run_is_started_again_and_rewritten_whole(tmp_path):
    import shutil

    folder = tmp_path / "run"
    h = jh.History(distributed_history=False, report_dir=folder)
    for s in range(50):
        h.update({"loss": float(s)}, summarize=False)
    h.flush()
    shutil.rmtree(folder)  # a clean-up script, mid-run
    with pytest.warns(RuntimeWarning, match="was deleted while the run wrote it"):
        for s in range(50, 100):
            h.update({"loss": float(s)}, summarize=False)
        h.flush()
    assert h.log_path.is_file()  # streaming on: a crash now keeps these lines
    h.finalize(plot=False)
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    assert [x["step"] for x in lines] == list(range(100))


@pytest.mark.parametrize("when", ["mid-run", "while closed"])
def test_a_report_dir_swapped_for_a_link_is_never_written_through(tmp_path, when):
    """Finding: report_dir removed and a link to another folder put in its
    place mid-run: the log was started again through the link, and finalize
    wrote dataset.nc and report.md there. Now the log is not started there
    (a warning) and finalize refuses the folder before writing anything;
    finalize(outdir=...) elsewhere still writes every step."""
    import shutil

    folder, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    h = jh.History(distributed_history=False, report_dir=folder, run_name="r")
    for s in range(10):
        h.update({"loss": float(s)}, summarize=False)
    if when == "while closed":
        h.close()
    else:
        h.flush()
    shutil.rmtree(folder)
    folder.symlink_to(elsewhere)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for s in range(10, 20):
            h.update({"loss": float(s)}, summarize=False)
        h.flush()
        with pytest.raises(OSError, match="symbolic link put in place of the folder"):
            h.finalize(plot=False)
    assert list(elsewhere.iterdir()) == []
    h.finalize(outdir=tmp_path / "out", plot=False)
    h.close()
    assert list(elsewhere.iterdir()) == []
    back = jh.HistoryState.from_netcdf(tmp_path / "out" / "dataset.nc")
    assert back.steps("loss").tolist() == list(range(20))


def test_a_report_dir_given_as_a_link_is_followed(tmp_path):
    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "run").symlink_to(real)
    h = jh.History(distributed_history=False, report_dir=tmp_path / "run")
    h.update({"loss": 1.0})
    h.finalize(plot=False)
    h.close()
    assert (real / "dataset.nc").is_file() and (real / f"{h.run_id}.jsonl").is_file()


def test_a_close_that_gives_up_on_a_slow_write_has_finalize_rewrite_the_log(
    tmp_path, monkeypatch
):
    """A write slower than close()'s bound (a slow disk): close returns
    without it and closes the file under it, so its lines never arrive; the
    log must then count as failed, and finalize write it from the history
    (it kept the incomplete log as the streamed one: 0 of 10 lines)."""
    import time

    from jaxhistory.sinks import _jsonl

    monkeypatch.setattr(_writer.Writer, "MAX_WAIT", 0.3)
    write = _jsonl.JsonlSink.write_batch
    slow = [True]

    def slow_write(self, batch):
        if slow[0]:
            slow[0] = False
            time.sleep(0.6)
        write(self, batch)

    monkeypatch.setattr(_jsonl.JsonlSink, "write_batch", slow_write)
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    for s in range(10):
        h.update({"loss": float(s)}, summarize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.close()
        h.finalize(plot=False)
        time.sleep(0.5)  # the slow write ends meanwhile (warned): changes nothing
    steps = [orjson.loads(x)["step"] for x in h.log_path.read_bytes().splitlines()]
    assert steps == list(range(10))


@pytest.mark.usefixtures("host_path")
@pytest.mark.parametrize("cut_to", ["empty", "half"])
@pytest.mark.parametrize("when", ["mid-run", "after the last write"])
def test_a_log_cut_short_mid_run_is_noticed_and_rewritten_whole(tmp_path, cut_to, when):
    """Finding: a log truncated by someone else (a log rotation's
    copytruncate) was kept by finalize as the streamed log, without a word:
    it held steps 100-199 of 200 (the dataset all of them), or half a line
    and 50 lines fewer."""
    folder = tmp_path / "run\x1b[31m"
    h = jh.History(distributed_history=False, report_dir=folder, run_name="r")
    for s in range(100):
        h.update({"loss": float(s)}, summarize=False)
    h.flush()
    log = h.log_path
    with open(log, "r+b") as f:
        f.truncate(0 if cut_to == "empty" else log.stat().st_size // 2)
    with pytest.warns(RuntimeWarning, match="cut short") as caught:
        if when == "mid-run":
            for s in range(100, 200):
                h.update({"loss": float(s)}, summarize=False)
            h.flush()
        h.finalize(plot=False)
    texts = [str(w.message) for w in caught]
    assert all("\x1b" not in t for t in texts), texts  # the path escaped
    steps = [orjson.loads(x)["step"] for x in log.read_bytes().splitlines()]
    n = 200 if when == "mid-run" else 100
    assert steps == list(range(n))
    assert jh.HistoryState.from_jsonl(log).count("loss") == n
    h.close()


@pytest.mark.parametrize("when", ["before close", "after close"])
def test_a_log_deleted_after_its_last_write_is_rewritten_whole(tmp_path, when):
    """Finding: a log deleted once its last line was written (no later write
    to notice it) was taken by finalize as streamed and complete: finalize
    left no log at all."""
    import shutil

    folder = tmp_path / "run"
    h = jh.History(distributed_history=False, report_dir=folder)
    for s in range(20):
        h.update({"loss": float(s)}, summarize=False)
    if when == "after close":
        h.close()
    else:
        h.flush()
    shutil.rmtree(folder)  # a clean-up script
    with pytest.warns(RuntimeWarning, match="was deleted"):
        h.finalize(plot=False)
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    assert [x["step"] for x in lines] == list(range(20))
    h.update({"loss": 20.0}, summarize=False)  # later updates append to it
    h.close()
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    assert [x["step"] for x in lines] == list(range(21))


def test_a_closed_log_deleted_before_the_next_update_is_rewritten_whole(tmp_path):
    """Finding: a log deleted while closed (between a close() and the next
    update) was started again empty by that update and kept by finalize as
    the streamed log: every line before the deletion was gone."""
    import shutil

    folder = tmp_path / "run"
    h = jh.History(distributed_history=False, report_dir=folder)
    for s in range(10):
        h.update({"loss": float(s)}, summarize=False)
    h.close()
    shutil.rmtree(folder)
    with pytest.warns(RuntimeWarning, match="was deleted"):
        for s in range(10, 20):
            h.update({"loss": float(s)}, summarize=False)
        h.flush()
    h.finalize(plot=False)
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    assert [x["step"] for x in lines] == list(range(20))
    h.close()


def test_a_log_rewritten_by_finalize_is_appended_to_not_reported_deleted(
    tmp_path, caplog
):
    """finalize writes a failed log again, atomically: a new file in place of
    the open one. Updates after it go on in that file, with no warning that
    the log was deleted, and no line lost to the replaced file."""
    import shutil

    folder = tmp_path / "run"
    h = jh.History(distributed_history=False, report_dir=folder)
    for s in range(50):
        h.update({"loss": float(s)}, summarize=False)
    h.flush()
    shutil.rmtree(folder)
    with pytest.warns(RuntimeWarning, match="was deleted while the run wrote it"):
        h.update({"loss": 50.0}, summarize=False)
        h.flush()
    h.finalize(plot=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(51, 60):
            h.update({"loss": float(s)}, summarize=False)
        h.flush()
        lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
        assert [x["step"] for x in lines] == list(range(60))
        h.close()
    assert not any("deleted" in r.getMessage() for r in caplog.records)
    h.finalize(plot=False)
    lines = [orjson.loads(x) for x in h.log_path.read_bytes().splitlines()]
    assert [x["step"] for x in lines] == list(range(60))


@pytest.mark.slow
@pytest.mark.parametrize(("updates", "extra_on"), [(6, 1), (5, 1), (5, 0)])
def test_in_batches_processes_that_reduce_different_steps_fail_clearly(
    updates, extra_on
):
    """log_every=4, one process records one update more than the other before
    close: the extra update in the last batch (6: steps 5 against 5-6) or in
    a batch of its own (5: none against step 5). Every process's close raises
    ValueError naming each process's steps, at once, instead of waiting
    forever for a batch the other never posts (or failing to reshape it)."""
    results = jh.launch_local(
        "mp_workers:uneven_batches", 2, 1, args=(updates, extra_on), timeout=60
    )
    for r in results:
        text = r["raised"]
        assert text is not None and "different updates" in text, r
        ahead = list(range(5, updates + 1))
        assert f"process {extra_on} at steps {ahead}" in text, text
        assert r["seconds"] < 10, r
        # what was reduced before stays recorded
        assert r["steps"][:5] == [0, 1, 2, 3, 4], r


@pytest.mark.slow
def test_in_batches_a_metric_added_on_one_process_fails_fast_naming_it():
    """log_every=4: process 0 never waits in a reduction before close, so
    its hang watch must still answer from close: process 1 gets the names'
    ValueError within seconds (not the 120 s timeout blaming process 0), and
    both closes end with an error instead of waiting."""
    results = jh.launch_local("mp_workers:metric_added_in_batches", 2, 1, timeout=90)
    first, second = results
    assert "update" not in first["raised"], first
    assert "different updates" in first["raised"].get("close", ""), first
    text = second["raised"].get("update", "")
    assert text.startswith("ValueError"), second
    assert "process 1 has ['extra'] (at step 4)" in text, text
    for r in results:
        assert r["seconds"] < 30, r


@pytest.mark.slow
def test_processes_recording_different_steps_in_batches_fail_naming_the_step():
    """In batches (log_every=4), process 1 one step ahead of process 0: each
    update's statistics would mix two steps, recorded at a different step on
    each process. Every process raises ValueError saying so at the first
    batch."""
    results = jh.launch_local(
        "mp_workers:steps_that_differ", 2, 1, args=(4,), timeout=120
    )
    for r in results:
        text = r["raised"]
        assert text is not None and "steps" in text, r
        assert "History.update for the same steps" in text, text


@pytest.mark.slow
def test_in_batches_a_close_with_nothing_new_on_one_process_does_not_wait(tmp_path):
    results = jh.launch_local(
        "mp_workers:close_after_finalize_on_one_process",
        2,
        1,
        args=(str(tmp_path),),
        timeout=60,
    )
    assert results == [list(range(6))] * 2


@pytest.mark.parametrize("before", ["nothing", "flush", "close and update"])
def test_a_history_dropped_without_close_closes_its_log_file(tmp_path, before):
    """A History dropped without close() (freed by the garbage collector)
    writes every queued line and closes its log file: the file object was left
    for the collector, an 'unclosed file' ResourceWarning."""
    import gc

    path = tmp_path / "run.jsonl"
    history = jh.History(jsonl_path=path, distributed_history=False)
    for s in range(40):
        history.update({"loss": float(s)}, step=s, summarize=False)
    if before == "flush":
        history.flush()
    elif before == "close and update":
        history.close()
        history.update({"loss": 40.0}, step=40, summarize=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del history
        gc.collect()
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed, [str(w.message) for w in unclosed]
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    expected = list(range(41 if before == "close and update" else 40))
    assert steps == expected


@pytest.mark.usefixtures("host_path")
def test_rows_queued_for_the_log_are_let_go_by_the_garbage_collector(tmp_path):
    """Finding: with a JSONL log, the fast path queued each update as a Row (a
    tuple subclass holding an enum member) and the dict's copy: objects the
    garbage collector tracks for as long as they wait, up to thousands of
    updates. Every collection walked them and moved them into the oldest
    generation, bringing on full collections: 1.8 µs of an update's 5-6 µs
    on the training thread (200,000 updates of 10 floats)."""
    import gc

    from jaxhistory._writer import Writer

    with mock.patch.object(Writer, "INTERVAL", 60.0):  # the thread waits
        h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
        m = {f"m{i}": 0.5 + i for i in range(10)}
        for _ in range(300):
            h.update(dict(m), summarize=False)
        writer = h._recorder.out.writer
        queued = list(writer._queue)
        gc.collect()
        assert len(queued) >= 298  # the fast path's rows, none written yet
        tracked = [q for q in queued[2:] if gc.is_tracked(q)]
        assert not tracked, f"{len(tracked)} queued rows stay tracked: {tracked[0]!r}"
        h.close()
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert len(lines) == 300
    last = orjson.loads(lines[-1])
    assert last["step"] == 299 and last["metrics"] == m


def test_an_explicit_step_takes_the_cheap_path_and_records_what_the_full_parse_does(
    tmp_path,
):
    """Finding: ``update(m, step=s)``, a common way to pass the step, parsed
    every dict in full (8.3 µs an update with a log against 5.5-6 µs for the
    same dict without ``step=``). A dict like the last one now takes the
    cheap path with an int step past every recorded one; the history, the log
    and the summary lines are those of the full parse. A step that goes back
    or is not an int still takes the full parse, which refuses or records it
    as before."""
    from jaxhistory import _recorder

    calls = []
    real = _recorder.parse_row

    def counted(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("step"))
        return real(*args, **kwargs)

    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    lines = []
    with mock.patch.object(_recorder, "parse_row", counted):
        for s in (0, 10, 11, 30, 31):
            lines.append(h.update({"loss": s / 4, "lr": 0.5}, step=s))
        assert calls == [0, 10]  # the first two dicts (the second finds the table)
        lines.append(h.update({"loss": 2.0, "lr": 0.5}, step=np.int64(40)))
        lines.append(h.update({"loss": 3.0, "lr": 0.5}))  # the next step: 41
        assert calls == [0, 10, 40]  # (a NumPy int: the full parse)
        with pytest.raises(ValueError):
            h.update({"loss": 3.0, "lr": 0.5}, step=-1)
    assert lines[1] == "step=10 loss=2.500000 lr=0.500000"
    assert lines[-1] == "step=41 loss=3.000000 lr=0.500000"
    assert h.state.steps("loss").tolist() == [0, 10, 11, 30, 31, 40, 41]
    assert h.state.values("loss").tolist() == [0, 2.5, 2.75, 7.5, 7.75, 2.0, 3.0]
    h.close()
    logged = [orjson.loads(x) for x in (tmp_path / "run.jsonl").read_bytes().split()]
    assert [r["step"] for r in logged] == [0, 10, 11, 30, 31, 40, 41]
    assert logged[3]["metrics"] == {"loss": 7.5, "lr": 0.5}


def test_a_float_that_decimals_would_show_as_zero_is_shown_in_scientific_notation():
    """Finding: the summary line (and ConsoleSink) showed a learning rate of
    3e-8 as lr=0.000000, on every path: the first row, a repeated dict of
    floats (one template), NumPy and device values, a distributed metric."""
    import io

    from jaxhistory.sinks import ConsoleSink

    h = jh.History(distributed_history=False)
    first = h.update({"lr": 3e-8, "tiny": np.float32(1e-9), "z": 0.0, "big": 1e12})
    assert first == (
        "step=0 lr=3.000000e-08 tiny=1.000000e-09 z=0.000000 big=1000000000000.000000"
    )
    lines = [h.update({"lr": lr, "loss": 0.5}) for lr in (3e-3, 3e-3, -2e-9, 0.25)]
    assert lines == [
        "step=1 lr=0.003000 loss=0.500000",
        "step=2 lr=0.003000 loss=0.500000",
        "step=3 lr=-2.000000e-09 loss=0.500000",  # the repeated-dict template too
        "step=4 lr=0.250000 loss=0.500000",
    ]
    assert h.update({"lr": 0.4}, precision=0) == "step=5 lr=4e-01"
    assert h.update({"lr": -0.0, "n": 3}, precision=2) == "step=6 lr=-0.00 n=3"
    assert h.update({"g": jnp.float32(5e-9)}) == "step=7 g=5.000000e-09"
    stats = jh.distributed_stats(jnp.full((8,), 2e-9))
    assert h.update({"g": stats}).startswith("step=8 g=2.000000e-09(±")
    out = io.StringIO()
    sink = ConsoleSink(out)
    sink.write(jh.sinks.Record(step=1, timestamp=0.0, metrics={"lr": 3e-8}))
    assert "lr=3.000000e-08" in out.getvalue()
    # 5e-07 rounds to 0.000000 (it is a shade below 5e-07): e-notation too
    assert h.update({"lr": 5e-07}) == "step=9 lr=5.000000e-07"


@pytest.mark.usefixtures("host_path")
def test_an_exact_zero_keeps_the_template_of_a_repeated_dict(monkeypatch):
    """A float that is exactly 0.0 (a warmup's first learning rate) shows as
    0.000000, and its line comes from the template, not value by value."""
    from jaxhistory._summary import SummaryLine

    h = jh.History(distributed_history=False)
    h.update({"lr": 0.0, "loss": 0.5})
    general = []
    make = SummaryLine._general
    monkeypatch.setattr(
        SummaryLine, "_general", lambda self, *a: general.append(a) or make(self, *a)
    )
    lines = [h.update({"lr": 0.0, "loss": 0.5}) for _ in range(3)]
    assert lines[-1] == "step=3 lr=0.000000 loss=0.500000" and general == []
    assert h.update({"lr": 1e-9, "loss": 0.5}) == "step=4 lr=1.000000e-09 loss=0.500000"
    assert len(general) == 1


def test_a_resume_step_moves_only_this_runs_lines_of_a_shared_log(tmp_path):
    """Two runs appended to one jsonl_path (the second with a warning); a
    resume of the second at step 4 moves its lines from step 4 on and leaves
    the first run's lines where they are (they moved too)."""
    shared = tmp_path / "shared.jsonl"
    a = jh.History(distributed_history=False, jsonl_path=shared, run_name="a")
    for s in range(16):
        a.update({"loss": float(s)}, summarize=False)
    a.close()
    with pytest.warns(RuntimeWarning, match="holds the run"):
        b = jh.History(distributed_history=False, jsonl_path=shared, run_name="b")
    for s in range(8, 16):
        b.update({"loss": float(s)}, step=s, summarize=False)
    b.finalize(tmp_path / "b", plot=False)
    b.close()
    again = jh.History(
        distributed_history=False,
        jsonl_path=shared,
        resume=tmp_path / "b" / "dataset.nc",
        resume_step=12,
    )
    again.close()
    runs = [orjson.loads(x)["run_id"] for x in shared.read_bytes().splitlines()]
    steps = [orjson.loads(x)["step"] for x in shared.read_bytes().splitlines()]
    assert runs == [a.run_id] * 16 + [b.run_id] * 4
    assert steps == [*range(16), *range(8, 12)]
    aside = shared.with_name("shared.jsonl.from-step-12")
    assert [orjson.loads(x)["step"] for x in aside.read_bytes().splitlines()] == [
        12,
        13,
        14,
        15,
    ]


@pytest.mark.usefixtures("host_path")
def test_the_summary_lines_template_agrees_with_the_general_path():
    """Rows of floats go through a cached template (the repeated-dict fast
    path); every line must read as summary_line writes it value by value:
    tiny, zero, negative, whole and huge values, precisions 0 to 8."""
    from jaxhistory._summary import summary_line

    rng = np.random.default_rng(0)
    pool = [0.0, -0.0, 1e-9, -3e-7, 5e-7, 0.4, 0.5, 10.0, -10.0, 1e12, 123.456]
    for precision in range(9):
        h = jh.History(distributed_history=False)
        names = ("a", "b=0.0", "c")
        for step in range(40):
            values = [
                float(rng.choice(pool)) * float(rng.choice([1, 1e-3])) for _ in names
            ]
            line = h.update(dict(zip(names, values, strict=True)), precision=precision)
            items = list(zip(names, values, strict=True))
            assert line == summary_line(("step", step), items, precision, (), True)
