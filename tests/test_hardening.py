"""Hostile names, damaged files and values that cannot be stored: a clear error
at the call that received them, or an exact round trip; nothing recorded lost."""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory import MetricBuffer, export
from jaxhistory.cli import load_run
from jaxhistory.export import _units

# ----- names that collide with the dataset's own -------------------------------


def hostile_state():
    s = jh.HistoryState()
    long = "m" * 250
    s = s.update({"_recorded": 1.0, "_metric": 2.0, "x": np.arange(2.0)}, step=0)
    s = s.update({"x_dim_0": 3.0, long: 4.0, f"{long}/w": np.ones(3)}, step=1)
    s = s.update({"_recorded": math.nan, "x_dim_0": 5.0}, step=3)  # gaps and NaN
    return s


def assert_same(a, b):
    assert sorted(a.keys) == sorted(b.keys)
    for name in a.keys:
        assert a.steps(name).tolist() == b.steps(name).tolist(), name
        np.testing.assert_array_equal(a.values(name), b.values(name), err_msg=name)
        assert a.values(name).dtype == b.values(name).dtype, name


def test_names_the_dataset_uses_round_trip_through_xarray():
    s = hostile_state()
    assert_same(s, jh.HistoryState.from_xarray(s.to_xarray()))


def test_names_the_dataset_uses_round_trip_through_netcdf(tmp_path):
    s = hostile_state()
    export.to_netcdf(s, tmp_path / "d.nc")
    back = jh.HistoryState.from_netcdf(tmp_path / "d.nc")
    assert_same(s, back)
    names = set(export.read_netcdf(tmp_path / "d.nc").data_vars)
    assert "m" * 250 in names and "_recorded" in names


# ----- damaged JSONL logs --------------------------------------------------------


def test_damaged_jsonl_lines_are_skipped_exactly(tmp_path):
    good = b'{"step": 0, "metrics": {"a": 1.0}}\n'
    lines = [
        b"\xef\xbb\xbf" + good,  # a byte order mark on the first line
        b"\x00\x9f\xff garbage \xfe\n",  # binary
        b'{"step": 1, "metrics": {"a": "\xff\xfe"}}\n',  # invalid UTF-8
        '{"step": 2, "metrics": {"\u00e9": 1.0}}\n'.encode()[:-8] + b"\n",
        b'{"step": 9223372036854775808, "metrics": {"a": 3.0}}\n',  # 2**63
        b'{"step": 5, "metrics": {"a": 5.0}}\n',
        '{"step": 6, "metrics": {"\u00e9": 6.0}}'.encode()[:-3],  # cut, last
    ]
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.warns(RuntimeWarning, match=r"skipped 5 .*line 2, 3, 4, 5, 7\)"):
        s = export.from_jsonl(path)
    assert s.steps("a").tolist() == [0, 5]
    assert s.values("a").tolist() == [1.0, 5.0]


# ----- values that cannot be stored -----------------------------------------------


@pytest.mark.parametrize(
    "reduce",
    [jh.reduce_mean, jh.reduce_sum, jh.reduce_max, jh.distributed_stats],
)
def test_reducers_refuse_a_none_leaf(reduce):
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        reduce({"bad": None, "ok": jnp.ones(3)})


def test_collective_reducers_refuse_a_none_leaf(mesh):
    from jax.sharding import PartitionSpec as P

    f = jax.shard_map(
        lambda v: jh.collective.reduce_mean({"x": v, "n": {"bad": None}}, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    with pytest.raises(TypeError, match="metric 'n/bad' is None"):
        jax.jit(f)(jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("data"))))


def test_metric_buffer_refuses_none_and_values_it_would_wrap():
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        MetricBuffer.create(4, {"bad": None, "ok": 0.0})
    buf = MetricBuffer.create(4, {"loss": 0.0, "n": np.int32(0)})
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        buf.write(0, {"loss": 1.0, "n": 1, "bad": None})
    for step in (np.int64(2**31 + 5), jnp.uint32(3_000_000_000), -1, 2**40):
        with pytest.raises(ValueError, match="does not fit the buffer's int32 steps"):
            buf.write(step, {"loss": 1.0, "n": 1})
    for n in (np.int64(2**40), 2**40, np.uint32(3_000_000_000)):
        with pytest.raises(ValueError, match="metric 'n'"):
            buf.write(0, {"loss": 1.0, "n": n})
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1"):
        MetricBuffer.create(2**40, {"loss": 0.0})

    @jax.jit
    def traced(buf, step):
        return buf.write(step, {"loss": 1.0, "n": 1})

    with pytest.raises(TypeError, match="traced step of dtype uint32"):
        traced(buf, jnp.uint32(3))
    # Nothing was written by the refused calls; a good write still works.
    buf = traced(buf, jnp.int32(7))
    steps, values = buf.to_host()
    assert steps.tolist() == [7] and values["n"].tolist() == [1]


# ----- HistoryState and History values ---------------------------------------------


def test_a_step_entry_must_be_one_number():
    s = jh.HistoryState().update({"a": 1.0})
    for entry in ([1, 2], (3,), {"x": 1}):
        with pytest.raises(ValueError, match="'step' must be a whole number"):
            s.update({"step": entry, "a": 2.0})
    with pytest.raises(ValueError, match="'iter' must be a whole number"):
        s.update({"iter": [4], "b": {"c": 1.0}})
    assert s.keys == ("a",) and s.next_step == 1  # nothing recorded


def test_names_that_would_collide_in_files_are_refused():
    s = jh.HistoryState()
    with pytest.raises(ValueError, match="two metrics are both named '1'"):
        s.update({1: 1.0, "1": 2.0})
    assert s.update({1: 1.0, 2: 3}).keys == ("1", "2")  # int names become str


def test_integers_are_never_rounded_silently():
    big = 2**63 - 1
    s = jh.HistoryState().update({"a": np.int64(big)})
    with pytest.raises(ValueError, match=f"'a' holds the integer {big}"):
        s.update({"a": 0.5})
    assert s.values("a").tolist() == [big] and s.dtype("a") == np.int64
    u = jh.HistoryState().update({"u": np.uint64(2**64 - 1)})
    with pytest.raises(ValueError, match="'u' holds the integer 18446744073709551615"):
        u.update({"u": np.int64(3)})  # uint64 with int64 widens to float64
    assert u.values("u").tolist() == [2**64 - 1]
    f = jh.HistoryState().update({"f": 0.5})
    for value in (2**60 + 1, np.int64(2**60 + 1)):
        with pytest.raises(
            ValueError, match="cannot hold the integer 1152921504606846977"
        ):
            f.update({"f": value})
    # Integers float64 holds exactly still join a float metric.
    assert f.update({"f": 2**70}).update({"f": 3}).values("f").tolist() == [
        0.5,
        float(2**70),
        3.0,
    ]
    h = jh.History(distributed_history=False)
    h.update({"f": 0.5})
    with pytest.raises(ValueError, match="cannot hold the integer"):
        h.update({"f": 2**60 + 1})  # the fast path sends large rows to the checks
    assert h.state.values("f").tolist() == [0.5]


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


# ----- files: names, shared logs, reruns, full disks ---------------------------------


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


def test_hostile_metric_names_stay_inside_the_output_folder(tmp_path):
    s = jh.HistoryState()
    for i, name in enumerate(["../../esc", "/abs/x", "a/../../b", "..", "~", "é/ü"]):
        s = s.update({name: float(i)}, step=i)
    out = tmp_path / "run" / "out"
    export.finalize(s, out, run_id="r", echo=False)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 6
    for path in files:
        assert path.resolve().is_relative_to(out.resolve()), path


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
    d = jh.History(jsonl_path=tmp_path / "shared.jsonl", distributed_history=False)
    d.update({"x": 4.0}, step=1)
    d.close()
    assert export.from_jsonl(tmp_path / "shared.jsonl").values("x").tolist() == [3, 4]


def test_a_rerun_of_finalize_replaces_the_plots_as_a_set(tmp_path):
    out = tmp_path / "out"
    old = jh.HistoryState().update({"old_metric": 1.0}).update({"old_metric": 2.0})
    export.finalize(old, out, run_id="a", echo=False)
    assert (out / "plots" / "mplot" / "old_metric.png").is_file()
    new = jh.HistoryState().update({"loss": 1.0}).update({"loss": 0.5})
    export.finalize(new, out, run_id="b", echo=False)
    pngs = sorted(p.name for p in (out / "plots" / "mplot").iterdir())
    assert pngs == ["loss.png"]
    assert not any(p.name.startswith(".") for p in out.iterdir())
    export.finalize(new, out, run_id="c", plot=False)
    assert not (out / "plots").exists()


FULL_DISK = r"""
import resource, signal, sys, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
import jaxhistory as jh
from jaxhistory import export
out = {out!r}
old = jh.HistoryState().update({{"loss": 1.0}})
export.finalize(old, out, run_id="old", plot=False)
before = open(out + "/dataset.nc", "rb").read()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = 64 * 1024  # every file stops growing here: writes fail like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
warned = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tracer = jh.trace.JSONTraceHandler(folder=out + "/traces", run_name="t")
    tracer.start()
    for i in range(3000):
        with jh.StopWatch(f"span{{i % 7}}"):
            pass
    tracer.close()
    h = jh.History(jsonl_path=out + "/log.jsonl", distributed_history=False)
    for i in range(3000):
        h.update({{"loss": float(i), "acc": 0.5}}, summarize=False)
    h.close()
    try:
        h.finalize(out, plot=False)
        error = None
    except OSError as err:
        error = str(err)
warned = [str(w.message) for w in caught]
print(repr(dict(
    lost=tracer.lost,
    count=h.state.count("loss"),
    error=error,
    intact=open(out + "/dataset.nc", "rb").read() == before,
    warned=warned,
)))
"""


def test_a_full_disk_never_stops_training(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    script = FULL_DISK.format(root=root, out=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = eval(done.stdout.strip().splitlines()[-1])
    assert result["lost"] > 0 and result["count"] == 3000
    assert f"cannot write {tmp_path}/dataset.nc" in result["error"], result["error"]
    assert "any earlier version of the file is unchanged" in result["error"]
    assert result["intact"]
    trace = [w for w in result["warned"] if w.startswith("trace file")]
    log = [w for w in result["warned"] if w.startswith("JSONL log")]
    assert len(trace) == 1 and len(log) == 1, result["warned"]


# ----- scale ------------------------------------------------------------------------


def many_metrics(n=60, steps=20):
    s = jh.HistoryState()
    rng = np.random.default_rng(0)
    names = [f"g{i // 10}/m{i}" for i in range(n)]
    for step in range(steps):
        s = s.update(
            dict(zip(names, rng.normal(size=n).tolist(), strict=True)), step=step
        )
    return s


def test_many_plots_are_drawn_by_worker_processes(tmp_path):
    from jaxhistory.export import _mpl

    s = many_metrics()
    assert len(_units.plot_units(s)) >= _mpl.PARALLEL_FROM
    done = []
    paths = export.to_png(s, tmp_path / "png", progress=done.append)
    assert len(paths) == 60 == len(done) and all(p.stat().st_size for p in paths)
    assert sorted(paths) == sorted((tmp_path / "png").iterdir())


def test_plots_are_drawn_here_when_a_worker_cannot_start(tmp_path, monkeypatch):
    from jaxhistory.export import _mpl

    monkeypatch.setattr(_mpl.sys, "executable", "/bin/false")
    paths = export.to_png(many_metrics(), tmp_path / "png")
    assert len(paths) == 60 and all(p.is_file() for p in paths)


def test_a_script_without_a_main_guard_can_finalize_many_metrics(tmp_path):
    """Workers are fresh interpreters: the caller's script is never re-run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(root)!r}); sys.path.insert(0, "
        f"{str(root / 'tests')!r})\n"
        "from test_hardening import many_metrics\n"
        "from jaxhistory import export\n"
        f"export.finalize(many_metrics(), {str(tmp_path / 'out')!r}, run_id='r', "
        "echo=False)\n"
        "print('finished once')\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("finished once") == 1
    assert len(list((tmp_path / "out" / "plots" / "mplot").iterdir())) == 60


def test_a_damaged_dataset_file_is_named_with_its_cause(tmp_path):
    s = jh.HistoryState()
    for i in range(500):
        s = s.update({"a": float(i)})
    export.to_netcdf(s, tmp_path / "good.nc")
    data = (tmp_path / "good.nc").read_bytes()
    (tmp_path / "cut.nc").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.nc").write_bytes(b"\x00\x01 not a dataset")
    for name in ("cut.nc", "junk.nc"):
        with pytest.raises(OSError, match=f"cannot read the dataset .*{name}"):
            jh.HistoryState.from_netcdf(tmp_path / name)


# ----- found in review --------------------------------------------------------------


def test_integers_just_past_2_to_53_are_refused_on_every_path():
    big = 2**53 + 1
    for value in (np.int64(big), np.int64(-big)):
        s = jh.HistoryState().update({"a": value})
        with pytest.raises(ValueError, match="cannot hold exactly"):
            s.update({"a": 0.5})
    # a float metric that has taken an int before (its rows cache int types)
    s = jh.HistoryState().update({"x": 1.0}).update({"x": 3})
    with pytest.raises(ValueError, match=f"cannot hold the integer {big}"):
        s.update({"x": big})
    assert s.values("x").tolist() == [1.0, 3.0]


def test_finalize_leaves_other_files_under_plots_alone(tmp_path):
    mine = tmp_path / "plots" / "my_figure.png"
    mine.parent.mkdir()
    mine.write_bytes(b"user data")
    s = jh.HistoryState().update({"loss": 1.0}).update({"loss": 0.5})
    export.finalize(s, tmp_path, run_id="a", echo=False)
    export.finalize(s, tmp_path, run_id="b", plot=False)
    assert mine.read_bytes() == b"user data"
    assert not (tmp_path / "plots" / "mplot").exists()


def test_run_names_are_limited_in_bytes(tmp_path):
    with pytest.raises(ValueError, match="longer than 200 bytes"):
        jh.History(run_name="é" * 101, report_dir=tmp_path)
    jh.History(run_name="é" * 100, report_dir=tmp_path, distributed_history=False)


def test_provenance_refuses_a_mesh_with_any_auto_axis():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), (AxisType.Explicit, AxisType.Auto))
    x = jax.device_put(np.arange(4.0, dtype=np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="Auto axes"):
        jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=mesh))({"x": x})


def test_a_failing_trace_write_never_raises_even_with_warnings_as_errors(tmp_path):
    tracer = jh.trace.JSONTraceHandler(folder=str(tmp_path), run_name="t")
    tracer.start()

    class Broken:
        closed = False

        def write(self, data=None):
            raise OSError(28, "No space left on device")

        flush = close = write

    tracer._out.file = Broken()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jh.StopWatch("span"):
            pass
        tracer.close()
    assert tracer.lost >= 1 and tracer.error is not None
    # closed for good: no longer the active handler, though its file failed
    assert not tracer.active and jh.trace._trace_state.active() is None


# ----- scale: plots capped, sparse metrics in a long table, linear recording ----


def test_finalize_plots_at_most_max_plots_and_names_the_rest(tmp_path):
    s = jh.HistoryState()
    for step in range(3):
        s = s.update({f"m{i}": float(i + step) for i in range(5)}, step=step)
        s = s.update({"acc/mean": 0.5, "acc/std": 0.1, "acc/min": 0.4, "acc/max": 0.6})
    written = []
    export.finalize(s, tmp_path, run_id="r", echo=False, max_plots=2, written=written)
    pngs = sorted(p.name for p in (tmp_path / "plots" / "mplot").iterdir())
    txts = sorted(p.name for p in (tmp_path / "plots" / "tplot").iterdir())
    # Cross-device statistics first, then recording order.
    assert pngs == ["acc.png", "m0.png"] and txts == ["acc.txt", "m0.txt"]
    report = (tmp_path / "report.md").read_text()
    assert "Not plotted (4 metric(s), over finalize's max_plots=2" in report
    assert "`m1`, `m2`, `m3`, `m4`" in report
    assert "| m4 |" in report  # its statistics are still in the table
    export.finalize(s, tmp_path, run_id="r", echo=False, max_plots=None)
    assert len(list((tmp_path / "plots" / "mplot").iterdir())) == 6
    assert "Not plotted" not in (tmp_path / "report.md").read_text()
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="max_plots"):
            export.finalize(s, tmp_path / "bad", run_id="r", max_plots=bad)


def test_finalize_plots_200_metrics_by_default():
    import inspect

    from jaxhistory.export._units import MAX_PLOTS

    for fn in (export.finalize, jh.History.finalize):
        assert inspect.signature(fn).parameters["max_plots"].default == MAX_PLOTS
    assert MAX_PLOTS == 200  # capping itself: test_finalize_plots_at_most_max_plots


def test_cli_report_takes_max_plots(tmp_path):
    from jaxhistory import cli

    s = jh.HistoryState()
    for step in range(2):
        s = s.update({f"m{i}": float(step) for i in range(4)}, step=step)
    export.to_netcdf(s, tmp_path / "dataset.nc")
    out = tmp_path / "out"

    def report(cap):
        args = ["report", str(tmp_path / "dataset.nc"), "-o", str(out)]
        return cli.main([*args, "--max-plots", cap])

    assert report("1") == 0
    assert [p.name for p in (out / "plots" / "mplot").iterdir()] == ["m0.png"]
    assert report("all") == 0
    assert len(list((out / "plots" / "mplot").iterdir())) == 4
    with pytest.raises(SystemExit):
        report("many")


def key_sets(n):
    s = jh.HistoryState()
    for i in range(n):
        s = s.update({f"sample/{i}": float(i), "loss": 1.0 / (i + 1)}, step=i)
    return s


def test_sparse_metrics_in_bulk_go_to_one_long_table(tmp_path):
    from jaxhistory import _xarray

    n = 400  # > LONG_FROM sparse metrics
    s = key_sets(n)
    s = s.update({"sample/0": math.nan, "count/7": 2**53}, step=n)  # NaN, ints
    s = s.update({"sample/1": -math.inf, "w": np.ones(2)}, step=n + 1)
    ds = s.to_xarray()
    # Dense: loss and the array metric; the rest is one table of records.
    assert set(ds.data_vars) == {
        "loss",
        "w",
        "_long_step",
        "_long_index",
        "_long_value",
        "_long_dtype",
    }
    assert ds.sizes["_long"] == n + 3 and ds.sizes["_long_metric"] == n + 1
    assert ds.attrs[_xarray.LONG_ATTR].split(",")[2] == "_long_step"
    back = jh.HistoryState.from_xarray(ds)
    assert_same(s, back)
    assert back.dtype("count/7") == np.int64
    path = tmp_path / "dataset.nc"
    export.to_netcdf(s, path)
    assert_same(s, jh.HistoryState.from_netcdf(path))
    assert path.stat().st_size < 200_000  # not a 400 x 400 table of NaN
    # Warmup drops the first steps from the long table too (as from the others:
    # a metric all in the warmup keeps its name and no records).
    kept = jh.HistoryState.from_xarray(s.to_xarray(warmup=300))
    assert kept.steps("sample/299").tolist() == [] and kept.count("loss") == n - 300
    assert kept.values("sample/300").tolist() == [300.0]


def test_a_few_sparse_metrics_stay_variables_of_their_own():
    ds = key_sets(20).to_xarray()
    assert "sample/3" in ds.data_vars and "_long_value" not in ds.data_vars


def test_the_long_table_never_takes_a_metrics_name():
    s = key_sets(300).update({"_long_step": 1.0, "_long": 2.0}, step=300)
    ds = s.to_xarray()
    names = ds.attrs["jaxhistory_long"].split(",")
    assert names[0] == "_long_" and names[2] == "_long_step_"
    assert_same(s, jh.HistoryState.from_xarray(ds))


def test_a_damaged_long_table_is_named():
    ds = key_sets(300).to_xarray()
    ds.attrs["jaxhistory_long"] = "a,b"
    with pytest.raises(ValueError, match="does not name its long table"):
        jh.HistoryState.from_xarray(ds)


def test_a_new_key_set_at_a_new_step_never_scans_the_tables(monkeypatch):
    from jaxhistory._table import Table

    s = key_sets(50)
    calls = []
    real = Table.step_at
    monkeypatch.setattr(Table, "step_at", lambda t, n: calls.append(1) or real(t, n))
    for i in range(50, 100):
        s = s.update({f"sample/{i}": 1.0, "loss": 0.5}, step=i)
    assert not calls  # O(keys) per update, not O(tables)
    assert s.count("loss") == 100 and s.dtype("loss") == np.float64
    # The checks still hold across key sets: shape, and steps out of order.
    with pytest.raises(ValueError, match="'loss' changed shape"):
        s.update({"loss": np.ones(2), "new": 1.0}, step=100)
    with pytest.raises(ValueError, match="'loss' was already recorded at step 99"):
        s.update({"loss": 1.0, "new": 1.0}, step=99)
    t = s.update({"sample/3": 1, "n": 1}, step=100)  # an int joins a float metric
    assert t.dtype("sample/3") == np.float64 and t.dtype("n") == np.int64
    assert s.count("loss") == 100  # the refused updates changed nothing


def test_summary_of_single_values_matches_numpy():
    s = jh.HistoryState()
    for i, v in enumerate((2.5, math.nan, math.inf, -3)):
        s = s.update({f"m{i}": v}, step=i)
    got = s.summary()
    assert got["m0"] | {} == {
        "mean": 2.5,
        "std": 0.0,
        "median": 2.5,
        "p10": 2.5,
        "p90": 2.5,
        "min": 2.5,
        "max": 2.5,
        "last": 2.5,
        "count": 1,
        "nonfinite": 0,
    }
    assert got["m3"]["mean"] == -3.0 and got["m3"]["std"] == np.std([-3.0])
    for name in ("m1", "m2"):
        assert math.isnan(got[name]["mean"]) and got[name]["nonfinite"] == 1
    assert math.isnan(got["m1"]["last"]) and got["m2"]["last"] == math.inf


# ----- files read back as they were written, or refused ----------------------------


def eval_run():
    """train/loss every step 0..100, eval/loss every 50 steps (NaN between)."""
    s = jh.HistoryState()
    for t in range(101):
        s = s.update({"train": {"loss": 1.0 / (t + 1)}}, step=t)
        if t % 50 == 0:
            s = s.update({"eval": {"loss": 0.2014 + t}}, step=t)
    return s


def test_every_group_of_the_dataset_file_opens_with_its_step_coordinate(tmp_path):
    import xarray as xr

    path = tmp_path / "dataset.nc"
    export.to_netcdf(eval_run(), path)
    with xr.open_dataset(path, group="eval") as ds:
        assert "step" in ds.coords and ds["step"].values.tolist() == list(range(101))
        assert float(ds["loss"].sel(step=50)) == 0.2014 + 50
        assert np.isnan(float(ds["loss"].sel(step=51)))
    with xr.open_dataset(path, group="train") as ds:
        assert float(ds["loss"].sel(step=3)) == 0.25
    with xr.open_datatree(path) as tree:
        assert float(tree["eval"]["loss"].sel(step=100)) == 100.2014
        assert float(tree["eval/loss"].sel(step=0)) == 0.2014
    assert_same(eval_run(), jh.HistoryState.from_netcdf(path))


def test_a_nested_group_has_its_step_coordinate(tmp_path):
    import xarray as xr

    s = jh.HistoryState().update({"a": {"b": {"c": 1.0}}, "d": 0.5}, step=4)
    s = s.update({"a": {"b": {"c": 2.0}}}, step=9)
    path = tmp_path / "dataset.nc"
    export.to_netcdf(s, path, timestamps={4: 1.7e9, 9: 1.7e9 + 5})
    for group in ("a", "a/b"):
        with xr.open_dataset(path, group=group) as ds:
            assert ds["step"].values.tolist() == [4, 9], group
    with xr.open_dataset(path, group="a/b") as ds:
        assert float(ds["c"].sel(step=9)) == 2.0
    with xr.open_datatree(path) as tree:  # time: in the root group
        assert str(tree["time"].values[1])[:19] == "2023-11-14T22:13:25"
    assert_same(s, jh.HistoryState.from_netcdf(path))


def test_a_metric_named_like_the_mask_with_gaps_and_no_nan_round_trips(tmp_path):
    s = jh.HistoryState().update({"_recorded": 1.0, "y": 1.0}, step=0)
    s = s.update({"y": 2.0}, step=1).update({"_recorded": 3.0, "y": 2.0}, step=2)
    back = jh.HistoryState.from_xarray(s.to_xarray())
    assert_same(s, back)
    assert back.steps("_recorded").tolist() == [0, 2]
    export.to_netcdf(s, tmp_path / "d.nc")
    assert_same(s, jh.HistoryState.from_netcdf(tmp_path / "d.nc"))


def test_select_names_a_prefix_that_is_not_a_string():
    s = jh.HistoryState().update({"a": 1.0})
    with pytest.raises(TypeError, match=r"select.*prefix.*str.*int 5"):
        s.select(5)
    with pytest.raises(TypeError, match="bytes"):
        s.select("a", b"a")
    assert s.select("a").keys == ("a",)


def crafted(tmp_path, name, edit):
    """A dataset file of a small run, changed by ``edit(ds)`` and written flat."""
    s = jh.HistoryState().update({"a": 1.0, "i": 1}, step=0)
    s = s.update({"a": 2.0, "i": 2}, step=1).update({"a": 3.0}, step=2)
    ds = edit(s.to_xarray())
    path = tmp_path / name
    ds.to_netcdf(path, engine="netcdf4")
    return path


@pytest.mark.parametrize(
    "steps, what",
    [
        ([2, 1, 0], "strictly increasing"),
        ([0, 1, 1], "strictly increasing"),
        ([0.0, 0.5, 1.0], "whole numbers"),
    ],
)
def test_a_dataset_file_whose_steps_are_not_steps_is_named(tmp_path, steps, what):
    path = crafted(tmp_path, "bad.nc", lambda ds: ds.assign_coords(step=steps))
    with pytest.raises(ValueError, match=f"{path.name}.*step.*{what}"):
        jh.HistoryState.from_netcdf(path)
    with pytest.raises(ValueError, match=f"{path.name}.*step.*{what}"):
        load_run(path)


@pytest.mark.parametrize("dtype", ["object", "<U5", "V8", "V100000000", "M8[ns]"])
def test_a_dataset_file_with_a_dtype_that_is_no_number_is_named(tmp_path, dtype):
    def edit(ds):
        ds["a"].attrs["jaxhistory_dtype"] = dtype
        return ds

    path = crafted(tmp_path, "dtype.nc", edit)
    with pytest.raises(
        ValueError, match=rf"dtype.nc.*'a'.*{re.escape(dtype)}.*not a numeric"
    ):
        jh.HistoryState.from_netcdf(path)


def test_an_unreadable_dtype_attribute_is_named(tmp_path):
    def edit(ds):
        ds["i"].attrs["jaxhistory_dtype"] = "int65"
        return ds

    path = crafted(tmp_path, "dtype.nc", edit)
    with pytest.raises(ValueError, match="dtype.nc.*'i'.*int65"):
        jh.HistoryState.from_netcdf(path)


def long_run():
    s = key_sets(300)
    return s.to_xarray()


@pytest.mark.parametrize("fault", ["repeat", "backwards", "also a variable"])
def test_a_damaged_long_table_in_a_file_is_named(tmp_path, fault):
    ds = long_run()
    steps = ds["_long_step"].values.copy()
    index = ds["_long_index"].values.copy()
    if fault == "also a variable":
        metrics = ds["_long_metric"].values.astype(object)
        metrics[0] = "loss"
        ds = ds.assign_coords(_long_metric=metrics)
        match = "'loss'.*both"
    else:
        # give metric 0 two records: the step of metric 1's record, or an earlier one
        index[1] = index[0]
        steps[1] = steps[0] if fault == "repeat" else steps[0] - 1
        ds["_long_step"] = ("_long", steps)
        ds["_long_index"] = ("_long", index)
        match = "'sample/0'.*strictly increasing"
    with pytest.raises(ValueError, match=match):
        jh.HistoryState.from_xarray(ds)
    path = tmp_path / "long.nc"
    ds.to_netcdf(path, engine="netcdf4")
    with pytest.raises(ValueError, match=f"long.nc.*{match}"):
        jh.HistoryState.from_netcdf(path)


@pytest.mark.parametrize(
    "content",
    [
        b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4,  # gzip
        b"step,loss\n0,0.5\n1,0.25\n",  # a CSV file
        b'{"step": -1.5, "metrics": {"a": 1.0}}\n{"not": "a record"}\n',
    ],
)
def test_a_file_without_one_complete_record_is_not_a_log(tmp_path, content):
    path = tmp_path / "run.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path.name}.*no complete record"):
        jh.HistoryState.from_jsonl(path)
    with pytest.raises(ValueError, match=f"{path.name}.*no complete record"):
        jh.History(resume=path, report_dir=tmp_path / "out")
    assert path.read_bytes() == content  # untouched


def test_an_empty_log_is_an_empty_history(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"\n")
    assert jh.HistoryState.from_jsonl(path).keys == ()


def test_a_log_cut_off_in_its_first_line_is_an_empty_history(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"step":0,"timestamp":1.7e9,"metrics":{"lo')
    with pytest.warns(RuntimeWarning, match="line 1"):
        assert jh.HistoryState.from_jsonl(path).keys == ()
    path.write_bytes(b'{"step":0,"timestamp":1.7e9,"metrics":{"lo\n')  # complete
    with pytest.raises(ValueError, match="holds no complete record"):
        jh.HistoryState.from_jsonl(path)
