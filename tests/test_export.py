"""Exporters: dataset file, JSONL, plots, terminal plots, report, finalize, CLI."""

import io
import json
import math
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory import _files, _writer, export
from jaxhistory import _names as names_mod
from jaxhistory.export import _finalize, _tplot, _units

NAMES = [
    "loss",
    "train/loss",
    "loss/std",
    "a%b",
    ".hidden",
    " lead",
    "trail ",
    "é/ü",
    "%2F",
    "_x",
    "-a",
    "a b",
    "g|*x",
]


# ----- fixtures: the same states for every exporter ---------------------------------
def _ragged():
    """Train every step, eval every 4th, an int counter, an array metric, NaN/Inf."""
    s = jh.HistoryState()
    rng = np.random.default_rng(0)
    for i in range(40):
        m = {
            "train": {"loss": 1.0 / (i + 1)},
            "tokens": 2**53 + i,
            "per_device": rng.normal(size=4).astype(np.float32),
        }
        if i == 7:
            m["train"]["loss"] = math.nan
        if i == 9:
            m["train"]["loss"] = math.inf
        s = s.update(m, step=i)
        if i % 4 == 3:
            s = s.update({"eval/acc": i / 40}, step=i)
    return s


def _stats_state():
    s = jh.HistoryState()
    for i in range(30):
        s = s.update(
            {
                "loss/mean": 1.0 / (i + 1),
                "loss/max": 2.0,
                "loss/min": 0.0,
                "loss/std": 0.1,
                "lr": 1e-3,
            },
            step=i,
        )
    return s


STATES = {
    "empty": jh.HistoryState,
    "ragged": _ragged,
    "stats": _stats_state,
    "single": lambda: jh.HistoryState().update({"x": 1.0}, step=5),
    "all_nan": lambda: (
        jh.HistoryState().update({"n": math.nan}).update({"n": math.nan})
    ),
    "bf16": lambda: (
        jh.HistoryState()
        .update({"h": jnp.bfloat16(1.5)})
        .update({"h": jnp.bfloat16(2.5)})
    ),
    "names": lambda: jh.HistoryState().update(
        {n: float(i) for i, n in enumerate(NAMES)}
    ),
}


def _same(a: jh.HistoryState, b: jh.HistoryState, dtypes: bool = True):
    assert a.keys == b.keys or set(a.keys) == set(b.keys)
    for k in a.keys:
        np.testing.assert_array_equal(a.steps(k), b.steps(k), err_msg=k)
        np.testing.assert_array_equal(a.values(k), b.values(k), err_msg=k)
        if dtypes:
            assert a.dtype(k) == b.dtype(k), k


# ----- names -----
@pytest.mark.parametrize("name", [*NAMES, "", "%", "/", "a\x01b", "__"])
def test_netcdf_names_round_trip(name):
    encoded = names_mod.encode_netcdf(name)
    assert "/" not in encoded and names_mod.decode_netcdf(encoded) == name
    assert encoded[0].isalnum() or encoded[0] == "_" or ord(encoded[0]) > 127
    assert not encoded[-1].isspace()


def test_file_stems_stay_inside_and_never_collide():
    names = ["../../x", "a/b", "a_b", "A_B", "", "...", "loss", "x"]
    stems = names_mod.file_stems(names)
    assert len({s.casefold() for s in stems.values()}) == len(names)
    for stem in stems.values():
        assert stem and "/" not in stem and not stem.startswith(".")
        assert Path(stem).name == stem
    assert stems["loss"] == "loss"
    # a name that is another name's stem with its CRC appended
    for names in (["a/b", "a_b", "a_b-07f4401c"], ["a_b-07f4401c", "a/b", "a_b"]):
        stems = names_mod.file_stems(names)
        assert len({s.casefold() for s in stems.values()}) == 3, stems


# ----- dataset file -----
@pytest.mark.parametrize("kind", STATES)
def test_netcdf_round_trip_is_exact(kind, tmp_path):
    state = STATES[kind]()
    path = tmp_path / "dataset.nc"
    ds = export.to_netcdf(state, path, attrs={"run_id": "r1", "flag": True})
    assert path.is_file() and ds.attrs["run_id"] == "r1"
    back = jh.HistoryState.from_netcdf(path)
    _same(state, back)
    assert back.next_step == state.next_step
    assert dict(back.attrs)["run_id"] == "r1"


def test_netcdf_keeps_64_bit_values_and_names_as_recorded(tmp_path):
    state = _ragged()
    export.to_netcdf(state, tmp_path / "d.nc")
    ds = export.read_netcdf(tmp_path / "d.nc")
    assert ds["tokens"].dtype == np.int64
    assert int(ds["tokens"].values[-1]) == 2**53 + 39  # exact, not rounded
    assert ds["train/loss"].dtype == np.float64
    assert ds["per_device"].dims == ("step", "per_device_dim_0")
    assert np.isnan(ds["eval/acc"].values[0])  # not recorded at step 0
    import xarray as xr

    with xr.open_datatree(tmp_path / "d.nc", engine="netcdf4") as raw:
        assert raw["train/loss"].attrs["long_name"] == "train/loss"


def test_netcdf_write_is_atomic_and_replaces(tmp_path):
    path = tmp_path / "dataset.nc"
    export.to_netcdf(jh.HistoryState().update({"a": 1.0}), path)
    import xarray as xr

    def crash(self, target, *args, **kwargs):
        Path(target).write_bytes(b"half a file")
        raise OSError("disk full")

    with mock.patch.object(xr.DataTree, "to_netcdf", crash), pytest.raises(OSError):
        export.to_netcdf(jh.HistoryState().update({"b": 2.0}), path)
    assert jh.HistoryState.from_netcdf(path).keys == ("a",)
    assert [p.name for p in tmp_path.iterdir()] == ["dataset.nc"]  # no temp left
    export.to_netcdf(jh.HistoryState().update({"b": 2.0}), path)
    assert jh.HistoryState.from_netcdf(path).keys == ("b",)  # replaced, not appended


def test_read_netcdf_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no dataset file"):
        export.read_netcdf(tmp_path / "none.nc")


# ----- JSONL -----
def _strict(line: str):
    def refuse(token):
        raise ValueError(f"non-standard token {token}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("kind", STATES)
def test_jsonl_round_trip(kind, tmp_path):
    state = STATES[kind]()
    path = export.to_jsonl(state, tmp_path / "run.jsonl", timestamps={0: 12.5})
    lines = path.read_text().splitlines()
    assert len(lines) == len(state.all_steps())
    for line in lines:
        record = _strict(line)
        assert set(record) == {
            "step",
            "timestamp",
            "process_index",
            "metrics",
            "aggregated",
        }
    back = jh.HistoryState.from_jsonl(path)
    _same(state, back, dtypes=False)
    for k in state.keys:  # integers stay integers; floats come back as float64
        assert back.dtype(k).kind == ("i" if state.dtype(k).kind == "i" else "f")


def test_jsonl_writes_nonfinite_values_as_strings(tmp_path):
    s = jh.HistoryState().update({"a": math.nan, "b": math.inf, "c": -math.inf})
    line = export.to_jsonl(s, tmp_path / "r.jsonl").read_text()
    assert _strict(line)["metrics"] == {"a": "NaN", "b": "Infinity", "c": "-Infinity"}


def test_jsonl_puts_complete_stat_groups_under_aggregated(tmp_path):
    record = _strict(
        export.to_jsonl(_stats_state(), tmp_path / "r.jsonl")
        .read_text()
        .splitlines()[0]
    )
    assert set(record["aggregated"]) == {
        "loss/mean",
        "loss/max",
        "loss/min",
        "loss/std",
    }
    assert set(record["metrics"]) == {"lr"}


def test_from_jsonl_skips_broken_lines_with_a_warning_and_keeps_the_rest(tmp_path):
    path = tmp_path / "r.jsonl"
    good = [json.dumps({"step": i, "metrics": {"a": float(i)}}) for i in range(4)]
    path.write_text(
        good[0]
        + "\n"
        + '{"step": 1, "metr'
        + "\n"
        + "\n".join(good[1:])
        + "\n"
        + good[3][:10]
    )
    with pytest.warns(
        RuntimeWarning, match=r"skipped 2 incomplete or damaged line\(s\) \(line 2, 6"
    ):
        s = jh.HistoryState.from_jsonl(path)
    assert s.values("a").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_from_jsonl_later_lines_win_on_a_resumed_run(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [{"step": i, "metrics": {"a": 1.0}} for i in range(5)]
    lines += [{"step": i, "metrics": {"a": 2.0}} for i in range(3, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = jh.HistoryState.from_jsonl(path)
    assert s.steps("a").tolist() == [0, 1, 2, 3, 4, 5]
    assert s.values("a").tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


def test_from_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        jh.HistoryState.from_jsonl(tmp_path / "none.jsonl")
    bad = tmp_path / "shape.jsonl"
    bad.write_text(
        '{"step": 0, "metrics": {"a": [1, 2]}}\n{"step": 1, "metrics": {"a": 3}}\n'
    )
    with pytest.raises(ValueError, match="'a' changes shape"):
        jh.HistoryState.from_jsonl(bad)


def test_appending_after_a_killed_run_starts_a_new_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"step": 0, "metrics": {"a": 1.0}}\n{"step": 1, "met')
    export.to_jsonl(jh.HistoryState().update({"a": 5.0}, step=2), path, overwrite=False)
    with pytest.warns(RuntimeWarning, match="line 2"):
        s = jh.HistoryState.from_jsonl(path)
    assert s.steps("a").tolist() == [0, 2]


# ----- JSONL streamed by History -----
def test_history_streams_jsonl_during_the_run(tmp_path):
    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=path)
    for i in range(5):
        h.update(
            {"loss": 1.0 / (i + 1), "tok": i, "dev": jnp.float32(i)}, summarize=False
        )
    h.update({"eval/acc": 0.5}, step=100)
    h.flush()
    records = [_strict(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 100]
    assert records[2]["metrics"] == {"loss": 1 / 3, "tok": 2, "dev": 2.0}
    assert records[0]["process_index"] == 0 and records[0]["timestamp"] > 1e9
    h.close()
    _same(jh.HistoryState.from_jsonl(path), h.state, dtypes=False)


def test_history_jsonl_appends_unless_overwrite(tmp_path):
    path = tmp_path / "log.jsonl"
    for overwrite, expected in ((False, 1), (False, 2), (True, 1)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            h = jh.History(
                distributed_history=False, jsonl_path=path, jsonl_overwrite=overwrite
            )
        # appended to the first run's log: a warning says so
        assert [("holds the run" in str(w.message)) for w in said] == (
            [True] if expected == 2 else []
        )
        h.update({"a": 1.0})
        h.close()
        assert len(path.read_text().splitlines()) == expected


def test_history_jsonl_per_process_path_and_report_dir_default(tmp_path):
    h = jh.History(
        distributed_history=False, jsonl_path=tmp_path / "log-{process_index}.jsonl"
    )
    h.update({"a": 1.0})
    h.close()
    assert (tmp_path / "log-0.jsonl").is_file()
    h2 = jh.History(
        distributed_history=False, report_dir=tmp_path / "rep", run_name="exp"
    )
    h2.update({"a": 1.0})
    h2.close()
    assert (tmp_path / "rep" / f"{h2.run_id}.jsonl").is_file()
    assert h2.run_id.startswith("exp-")
    h3 = jh.History(distributed_history=False)  # nowhere to stream: no file
    h3.update({"a": 1.0})
    assert h3._recorder.out.writer is None


def test_history_jsonl_holds_distributed_stats(tmp_path, mesh):
    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=True, jsonl_path=path)
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P("data")))
    h.update({"loss": x, "lr": 0.1}, summarize=False)
    h.close()
    record = _strict(path.read_text())
    assert record["metrics"] == {"lr": 0.1}
    assert record["aggregated"]["loss/mean"] == 3.5
    assert record["aggregated"]["loss/max"] == 7.0


def test_jsonl_survives_sigkill_losing_at_most_about_a_second(tmp_path):
    path = tmp_path / "log.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        import jaxhistory as jh
        h = jh.History(distributed_history=False, jsonl_path={str(path)!r})
        for i in range(50):
            h.update({{"loss": 1.0 / (i + 1)}}, summarize=False)
        time.sleep(2.0)  # more than the stream's interval, less than a checkpoint
        h.update({{"loss": -1.0}}, summarize=False)  # may be lost
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], timeout=120, check=False)
    assert out.returncode == -signal.SIGKILL
    lines = path.read_text().splitlines()
    assert len(lines) >= 50
    assert [_strict(x)["step"] for x in lines[:50]] == list(range(50))


def test_closed_stream_refuses_records(tmp_path):
    stream = export.JsonlStream(tmp_path / "s.jsonl")
    stream.close()
    with pytest.raises(ValueError, match="is closed"):
        stream.add(0, [("a", 1.0)])


# ----- plots -----
@pytest.mark.parametrize("kind", STATES)
def test_png_per_metric_without_touching_pyplot_or_rcparams(kind, tmp_path):
    import matplotlib

    before = dict(matplotlib.rcParams)
    state = STATES[kind]()
    paths = export.to_png(state, tmp_path, warmup=0)
    assert len({p.name for p in paths}) == len(paths)
    for p in paths:
        assert p.parent == tmp_path and p.read_bytes()[:4] == b"\x89PNG"
    assert len([p for p in paths if p.name.count(".") == 1]) == len(
        _units.plot_units(state)
    )
    assert dict(matplotlib.rcParams) == before


def test_png_drawing_never_imports_pyplot(tmp_path):
    code = (
        "import sys, jaxhistory as jh\n"
        "s = jh.HistoryState().update({'a': 1.0, 'b': [1.0, 2.0]})\n"
        f"jh.export.to_png(s, {str(tmp_path)!r})\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_png_names_and_array_plots(tmp_path):
    s = jh.HistoryState().update(
        {"../../evil": 1.0, "a/b": 2.0, "a_b": 3.0, "chains": np.arange(300.0)}
    )
    s = s.update({"../../evil": 2.0, "a/b": 2.0, "a_b": 3.0, "chains": np.ones(300)})
    out = tmp_path / "deep" / "plots"
    names = sorted(p.name for p in export.to_png(s, out, num_chains=16))
    assert all((out / n).is_file() for n in names)
    assert not list(tmp_path.glob("evil*"))
    assert "chains.ridge.png" in names and "chains.heatmap.png" in names
    assert len([n for n in names if n.startswith("a_b-")]) == 2
    with pytest.raises(ValueError, match="num_chains"):
        export.to_png(s, out, num_chains=0)


def test_a_metric_named_like_an_array_plot_keeps_its_own_file(tmp_path):
    s = jh.HistoryState()
    for i in range(3):
        s = s.update({"w": np.arange(4.0) + i, "w.ridge": float(i), "W.heatmap": 1.0})
    paths = export.to_png(s, tmp_path)
    names = sorted(p.name for p in paths)
    assert len(set(names)) == len(paths) == 5  # nothing written twice
    assert names == [
        "W.heatmap.png",
        "w.heatmap-1.png",
        "w.png",
        "w.ridge-1.png",
        "w.ridge.png",
    ]


def test_bucket_keeps_spikes_and_gaps():
    from jaxhistory.export._units import bucket

    x = np.arange(100_000)
    y = np.zeros(100_000)
    y[12_345] = 50.0
    y[50_000:60_000] = np.nan
    xb, yb = bucket(x, y, "envelope", 1000)
    assert len(xb) <= 1000 and np.nanmax(yb) == 50.0
    assert np.isnan(yb).any()  # the all-NaN stretch stays a gap
    short = bucket(x[:10], y[:10], "mean", 1000)
    assert short[0] is x[:10] or np.array_equal(short[0], x[:10])


def test_a_reduced_series_still_spans_its_first_and_last_step(tmp_path):
    """Finding: a series reduced for drawing put each bucket at its mean step,
    so the terminal plot of 100,000 steps (0 to 99,999) was drawn, and its
    axis labelled, from step 249 to 99,750: as if the run had started later
    and ended sooner."""
    from jaxhistory.export._units import bucket

    x = np.arange(100_000)
    y = np.sin(x / 1000.0)
    for how in ("mean", "min", "max", "envelope"):
        xb, _ = bucket(x, y, how, 1000)
        assert (xb[0], xb[-1]) == (0, 99_999), how
        assert np.all(np.diff(xb) >= 0), how
    s = jh.HistoryState().extend(x, {"loss": y})
    (text,) = export.to_terminal(s, tmp_path).values()
    lines = text.splitlines()
    ticks = lines[1 + next(i for i, t in enumerate(lines) if "└" in t)].split()
    assert (ticks[0], ticks[-1]) == ("0", "99999"), ticks


# ----- terminal plots -----
@pytest.mark.parametrize("kind", STATES)
def test_terminal_plots_are_plain_text_and_survive_nan(kind, tmp_path):
    state = STATES[kind]()
    texts = export.to_terminal(state, tmp_path)
    assert len(texts) == len(_units.plot_units(state))
    for path, text in texts.items():
        assert path.read_text(encoding="utf-8") == text
        assert "\x1b[" not in text


def test_summary_plot_overlays_the_four_statistics():
    plots = _tplot.summary_plots(_stats_state())
    assert list(plots) == ["loss"]
    text = plots["loss"]
    for marker, label in (("·", "mean"), ("-", "min"), ("+", "max"), ("*", "std")):
        assert f"{marker} {label}" in text


def test_summary_plots_without_statistics_fall_back_to_the_first_metrics():
    s = jh.HistoryState()
    for i in range(10):
        s = s.update({f"m{j}": float(i * j) for j in range(6)})
    assert list(_tplot.summary_plots(s)) == ["m0", "m1", "m2", "m3"]


def test_terminal_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXHISTORY_TPLOT_MAX_WIDTH", "50")
    monkeypatch.setenv("JAXHISTORY_TPLOT_MAX_HEIGHT", "12")
    monkeypatch.setenv("JAXHISTORY_TPLOT_MARKER", "hd")
    monkeypatch.setenv("JAXHISTORY_TPLOT_RAW_MARKER", "o")
    opts = _tplot.settings()
    assert opts["width"] <= 50 and opts["height"] <= 12
    assert (opts["marker"], opts["raw_marker"], opts["type"]) == ("hd", "o", "line")
    text = _tplot.summary_plots(_ragged())["train/loss"]
    assert max(len(line) for line in text.splitlines()) <= 50
    assert len(text.splitlines()) <= 12
    monkeypatch.setenv("JAXHISTORY_TPLOT_TYPE", "hist")
    assert "histogram" in _tplot.summary_plots(_ragged())["train/loss"]


@pytest.mark.parametrize(
    ("var", "value", "match"),
    [
        ("JAXHISTORY_TPLOT_TYPE", "pie", "line or hist"),
        ("JAXHISTORY_TPLOT_MAX_WIDTH", "wide", "must be an integer"),
        ("JAXHISTORY_TPLOT_MAX_HEIGHT", "2", "at least 8"),
        ("JAXHISTORY_TPLOT_MARKER", "sparkles", "single character"),
    ],
)
def test_bad_terminal_settings_name_the_variable(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match) as info:
        _tplot.settings()
    assert var in str(info.value)


# ----- report -----
def test_markdown_escapes_names_and_links_images_relatively(tmp_path):
    s = jh.HistoryState().update({"g|*x": 1.0, "[a](b)": 2.0})
    img = tmp_path / "plots" / "mplot" / "x.png"
    path = export.to_markdown(
        s,
        tmp_path / "report.md",
        run_id="r|1",
        environment={"jax_version": "0.10.2"},
        images=[img],
        terminal_plots={"x": "``` tricky"},
        files=[tmp_path / "dataset.nc"],
    )
    text = path.read_text()
    assert "| g\\|\\*x |" in text and "\\[a\\](b)" in text
    assert "](<plots/mplot/x.png>)" in text
    assert "````text\n``` tricky\n````" in text
    assert "- `dataset.nc`" in text
    rows = [r for r in text.splitlines() if r.startswith("| g")]
    assert rows[0].count(" | ") == 8  # 9 cells: the | in the name is escaped


def test_markdown_of_an_empty_history(tmp_path):
    text = export.to_markdown(jh.HistoryState(), tmp_path / "r.md").read_text()
    assert "No metrics were recorded." in text and "steps: none recorded" in text


# ----- finalize -----
def _names(root: Path):
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
    )


def test_finalize_writes_every_output_with_the_documented_names(tmp_path, capsys):
    h = jh.History(distributed_history=False, run_name="exp")
    for i in range(20):
        h.update(
            {
                "loss/mean": 1.0 / (i + 1),
                "loss/max": 1.0,
                "loss/min": 0.0,
                "loss/std": 0.1,
                "lr": 0.1,
                "dev": np.arange(3.0) + i,
            },
            summarize=False,
        )
    ds = h.finalize(tmp_path, warmup=0.1)
    files = _names(tmp_path)
    assert "dataset.nc" in files and "report.md" in files
    assert f"{h.run_id}.jsonl" in files
    assert {
        "plots/mplot/loss.png",
        "plots/mplot/lr.png",
        "plots/mplot/dev.png",
        "plots/mplot/dev.ridge.png",
        "plots/mplot/dev.heatmap.png",
        "plots/tplot/loss.txt",
        "plots/tplot/lr.txt",
        "plots/tplot/dev.txt",
    } <= set(files)
    assert ds.attrs["run_id"] == h.run_id and ds.attrs["warmup_steps"] == 2
    assert ds.attrs["device_count"] == 8 and "jax_version" in ds.attrs
    assert ds.sizes["step"] == 20  # the dataset keeps the warmup steps
    assert "· mean" in capsys.readouterr().out  # the summary plot was printed
    report = (tmp_path / "report.md").read_text()
    for f in files:
        if f != "report.md":
            assert f in report, f
    _same(jh.HistoryState.from_netcdf(tmp_path / "dataset.nc"), h.state)
    _same(
        jh.HistoryState.from_jsonl(tmp_path / f"{h.run_id}.jsonl"),
        h.state,
        dtypes=False,
    )


@pytest.mark.parametrize("kind", STATES)
def test_finalize_copes_with_every_fixture(kind, tmp_path):
    h = jh.History(distributed_history=False)
    h.state = STATES[kind]()
    ds = h.finalize(tmp_path)
    assert (tmp_path / "report.md").is_file() and (tmp_path / "dataset.nc").is_file()
    assert set(ds.data_vars) >= set(h.state.keys)


def test_finalize_switches(tmp_path):
    h = jh.History(
        distributed_history=False,
        report_enabled=False,
        jsonl_path=tmp_path / "elsewhere" / "log.jsonl",
    )
    h.update({"a": 1.0})
    h.finalize(tmp_path / "out", plot=False, save=False)
    assert _names(tmp_path / "out") == []  # no dataset, plots, report or JSONL copy
    assert (tmp_path / "elsewhere" / "log.jsonl").is_file()  # left where it is
    with pytest.raises(ValueError, match="needs an outdir"):
        jh.History(distributed_history=False).finalize()


def test_finalize_writes_nothing_on_other_processes(tmp_path):
    h = jh.History(distributed_history=False)
    h.update({"a": 1.0})
    with mock.patch.object(_finalize.jax, "process_index", return_value=1):
        ds = h.finalize(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert float(ds["a"].values[0]) == 1.0


def test_progress_bar_on_a_terminal():
    class Tty:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    tty = Tty()
    bar = _finalize.Progress(4, "plots", stream=tty)
    for _ in range(4):
        bar()
    assert "4/4" in tty.text and tty.text.endswith("\n")
    bar.finish()  # already complete: nothing more
    assert tty.text.count("4/4") == 1
    short = _finalize.Progress(6, "plots", stream=tty)
    short()
    short.finish()  # plots skipped (warmup) still complete the bar
    assert tty.text.endswith("6/6\n")
    quiet = _finalize.Progress(4, "plots", stream=io.StringIO())  # not a terminal
    quiet()
    assert not quiet.enabled


# ----- command line -----
def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxhistory", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


run_cli = _cli  # the command in a fresh process


def test_cli_report_and_summary(tmp_path):
    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(10):
        h.update({"loss": 1.0 / (i + 1), "tok": i}, summarize=False)
    h.finalize(tmp_path / "orig", plot=False)
    out = _cli("report", tmp_path / "run.jsonl", "-o", tmp_path / "again")
    assert out.returncode == 0, out.stderr
    files = _names(tmp_path / "again")
    assert {
        "dataset.nc",
        "report.md",
        "run.jsonl",
        "plots/mplot/loss.png",
        "plots/tplot/tok.txt",
    } <= set(files)
    out = _cli(
        "report", tmp_path / "orig" / "dataset.nc", "-o", tmp_path / "nc", "--no-plots"
    )
    assert out.returncode == 0, out.stderr
    _same(jh.HistoryState.from_netcdf(tmp_path / "nc" / "dataset.nc"), h.state)
    summary = _cli("summary", tmp_path / "orig")
    assert summary.returncode == 0 and "| loss | 0.292897 |" in summary.stdout
    missing = _cli("summary", tmp_path / "none.jsonl")
    assert missing.returncode == 2 and "no such run file" in missing.stderr
    wrong = _cli("summary", tmp_path / "orig" / "report.md")
    assert wrong.returncode == 2 and "expected a .jsonl log or a .nc" in wrong.stderr


# ----- review fixes -----
def test_cli_report_keeps_the_logs_timestamps_and_the_recorded_environment(tmp_path):
    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(3):
        h.update({"loss": 1.0 / (i + 1)}, summarize=False)
    h.finalize(tmp_path / "orig", plot=False)
    h.close()
    assert _cli("report", tmp_path / "run.jsonl", "-o", tmp_path).returncode == 0
    for line in (tmp_path / "run.jsonl").read_text().splitlines():
        assert _strict(line)["timestamp"] > 1e9  # not rewritten with nulls
    assert _cli("report", tmp_path / "orig", "-o", tmp_path / "orig").returncode == 0
    report = (tmp_path / "orig" / "report.md").read_text()
    assert "| jax | 0\\.10" in report or f"| jax | {jax.__version__}" in report


def test_finalize_after_close_keeps_the_streamed_log(tmp_path):
    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "log.jsonl")
    h.update({"a": 1.0})
    h.close()
    h.finalize(tmp_path / "out", plot=False)
    assert not list((tmp_path / "out").glob("*.jsonl"))
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 1


def test_an_unwritable_log_path_warns_once_and_recording_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    h = jh.History(distributed_history=False, jsonl_path=blocker / "log.jsonl")
    with pytest.warns(RuntimeWarning, match="cannot write the JSONL log"):
        h.update({"a": 1.0})
    h.update({"a": 2.0})
    assert h.state.values("a").tolist() == [1.0, 2.0]
    h.finalize(tmp_path / "out", plot=False)
    assert jh.HistoryState.from_jsonl(tmp_path / "out" / f"{h.run_id}.jsonl").values(
        "a"
    ).tolist() == [1.0, 2.0]


def test_with_warnings_as_errors_an_unwritable_log_never_stops_training(
    tmp_path, caplog
):
    blocker = tmp_path / "file"
    blocker.write_text("")
    h = jh.History(distributed_history=False, jsonl_path=blocker / "log.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest -W error does
        h.update({"a": 1.0})
        h.update({"a": 2.0})
    assert h.state.values("a").tolist() == [1.0, 2.0]
    assert any("cannot write the JSONL log" in r.getMessage() for r in caplog.records)
    h.finalize(tmp_path / "out", plot=False)
    assert jh.HistoryState.from_jsonl(tmp_path / "out" / f"{h.run_id}.jsonl").values(
        "a"
    ).tolist() == [1.0, 2.0]


def test_a_log_write_cut_short_by_ctrl_c_is_written_again_at_finalize(tmp_path):
    """Ctrl-C while flush writes the log on the training thread (waiting for
    device values, or in the write itself): the lines it was writing are not
    in the log, so finalize writes the log again from the history."""
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    h.update({"a": 0.0}, step=0)
    out = h._recorder.out
    out.writer.target.HOLD = 1e9  # the latest step waits for a final write
    for s in range(1, 6):
        h.update({"a": float(s)}, step=s)
    log = out.log

    def interrupted(batch):
        raise KeyboardInterrupt

    with (
        mock.patch.object(log, "write_batch", interrupted),
        pytest.raises(KeyboardInterrupt),
    ):
        h.flush()
    h.finalize(plot=False)
    logged = jh.HistoryState.from_jsonl(tmp_path / f"{h.run_id}.jsonl")
    assert logged.steps("a").tolist() == list(range(6))


@pytest.mark.parametrize("path", ["slow", "repeated dict"])
def test_ctrl_c_between_the_history_and_the_log_is_mended_at_finalize(tmp_path, path):
    """Ctrl-C landing in an update after its row joined the history and before
    it was queued for the log (recording the values attached meanwhile, or
    stamping the step): finalize writes a log that has the step, as the
    dataset does."""
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    for s in range(3):
        h.update({"a": float(s)})
    recorder = h._recorder
    if path == "slow":
        h.attach({"t": 0.5})
        target, name = recorder.side, "at_update"
        stand_in = mock.Mock(side_effect=KeyboardInterrupt)
    else:
        target, name = recorder.out, "stamp_times"  # (after stamp_steps)
        stand_in = mock.Mock(**{"append.side_effect": KeyboardInterrupt})
    with mock.patch.object(target, name, stand_in), pytest.raises(KeyboardInterrupt):
        h.update({"a": 3.0})
    assert h.state.steps("a").tolist() == [0, 1, 2, 3]
    h.update({"a": 4.0})
    h.finalize(plot=False)
    logged = jh.HistoryState.from_jsonl(tmp_path / f"{h.run_id}.jsonl")
    assert logged.steps("a").tolist() == [0, 1, 2, 3, 4]


def test_a_forked_child_never_writes_the_parents_log(tmp_path):
    """A child of os.fork() that closes the History it inherited (a
    ``finally:`` its exit runs through, atexit) must not write the parent's
    lines, which the parent writes itself, into the parent's log."""
    import os

    class Sink:
        def write(self, record):
            pass

        def flush(self):
            pass

        def close(self):
            pass

    h = jh.History(
        distributed_history=False, report_dir=tmp_path, run_name="r", sinks=[Sink()]
    )
    h.update({"a": 0.0}, step=0)
    h._recorder.out.writer.target.HOLD = 1e9  # step 6 waits for a final write
    for s in range(1, 4):
        h.update({"a": float(s)}, step=s)
    h.flush()  # (the sink's thread runs)
    for s in range(4, 7):
        h.update({"a": float(s)}, step=s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX's warning about fork
        pid = os.fork()
    if pid == 0:  # the child
        warned = [1]
        try:
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                h.close()  # (it waited for the parent's sink threads, and warned)
        finally:
            os._exit(min(len(warned), 100))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # no warning in the child
    h.update({"a": 7.0}, step=7)
    h.close()
    steps = [json.loads(line)["step"] for line in h.log_path.read_text().splitlines()]
    assert steps == list(range(8))


def test_a_dropped_history_closes_its_log(tmp_path):
    import gc
    import threading

    before = threading.active_count()
    for i in range(5):
        h = jh.History(distributed_history=False, jsonl_path=tmp_path / f"{i}.jsonl")
        h.update({"a": 1.0})
        del h
    gc.collect()
    deadline = time.time() + 10
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    for i in range(5):
        assert (tmp_path / f"{i}.jsonl").read_text().count("\n") == 1


def test_one_bad_record_does_not_lose_the_others(tmp_path):
    stream = export.JsonlStream(tmp_path / "s.jsonl")

    class Unreadable:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("deleted")

    stream.add(0, [("a", 1.0)])
    stream.add(1, [("a", Unreadable())])
    stream.add(2, [("a", 3.0)])
    with pytest.warns(RuntimeWarning, match="'a' at step 1 could not be read"):
        stream.flush()
    stream.close()
    back = jh.HistoryState.from_jsonl(tmp_path / "s.jsonl")
    assert back.steps("a").tolist() == [0, 1, 2]  # only the unreadable value is lost
    values = back.values("a")
    assert values[0] == 1.0 and np.isnan(values[1]) and values[2] == 3.0


def test_names_of_whitespace_alone_encode_for_netcdf(tmp_path):
    names = ["\u3000", " ", "a\u3000"]
    s = jh.HistoryState().update({n: 1.0 for n in names})
    export.to_netcdf(s, tmp_path / "d.nc")
    assert set(jh.HistoryState.from_netcdf(tmp_path / "d.nc").keys) == set(names)


# ----- JSONL text: exact floats, whole columns at a time ---------------------------
TRICKY = [0.1, -0.0, 5e-324, 1.7976931348623157e308, 1e-7, 2.0**53, 1 / 3, 1e22]


def test_jsonl_floats_read_back_bit_for_bit_from_both_writers(tmp_path):
    s, h = (
        jh.HistoryState(),
        jh.History(distributed_history=False, jsonl_path=tmp_path / "stream.jsonl"),
    )
    for i, x in enumerate(TRICKY):
        row = {"x": x, "f32": np.float32(i / 3), "i": i, "big": 2**62 + i}
        s = s.update(row)
        h.update(row, summarize=False)
    h.close()
    for path in (export.to_jsonl(s, tmp_path / "a.jsonl"), tmp_path / "stream.jsonl"):
        records = [_strict(line) for line in path.read_text().splitlines()]
        xs = [r["metrics"]["x"] for r in records]
        assert [np.float64(x).tobytes() for x in xs] == [
            np.float64(x).tobytes() for x in TRICKY
        ]
        assert [r["metrics"]["big"] for r in records] == [
            2**62 + i for i in range(len(TRICKY))
        ]
        back = jh.HistoryState.from_jsonl(path)
        assert back.values("f32").tolist() == s.values("f32").astype(float).tolist()
        assert back.dtype("big") == np.int64


def test_to_jsonl_writes_uint64_arrays_exactly(tmp_path):
    """Found by a round trip: a uint64 array written beside a value the line
    had to clean (a NaN, another key set) went through float64, so 2**64 - 1
    was written as 1.8446744073709552e+19 and read back as float64."""
    s = jh.HistoryState().update(
        {"u": np.array([2**64 - 1, 0], np.uint64), "a": math.nan}, step=0
    )
    s = s.update({"u": np.array([1, 2**63], np.uint64)}, step=1)
    path = export.to_jsonl(s, tmp_path / "u.jsonl")
    records = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["metrics"]["u"] for r in records] == [[2**64 - 1, 0], [1, 2**63]]
    back = jh.HistoryState.from_jsonl(path)
    assert back.dtype("u") == np.uint64
    assert back.values("u").tolist() == s.values("u").tolist()


def test_jsonl_value_texts():
    from jaxhistory.export._jsonl import jsonl_value

    assert jsonl_value(0.1) == b"0.1"
    assert jsonl_value(-math.inf) == b'"-Infinity"'
    assert jsonl_value(2**70) == str(2**70).encode()
    assert jsonl_value(np.bool_(True)) == b"true"
    assert jsonl_value(jnp.bfloat16(1.5)) == b"1.5"
    arr = np.array([[1.0, math.nan], [math.inf, 2.0]], np.float32)
    assert json.loads(jsonl_value(arr)) == [[1.0, "NaN"], ["Infinity", 2.0]]
    assert json.loads(jsonl_value(np.arange(6).reshape(2, 3)[:, ::2])) == [
        [0, 2],
        [3, 5],
    ]


def test_jsonl_columns_with_nonfinite_values_in_arrays_and_scalars(tmp_path):
    s = jh.HistoryState()
    for v in (1.0, math.nan, -math.inf):
        s = s.update({"a": v, "w": np.array([v, 2.0])})
    lines = export.to_jsonl(s, tmp_path / "r.jsonl", {1: 5.0}).read_text()
    records = [_strict(line) for line in lines.splitlines()]
    assert [r["metrics"]["a"] for r in records] == [1.0, "NaN", "-Infinity"]
    assert [r["metrics"]["w"] for r in records] == [
        [1.0, 2.0],
        ["NaN", 2.0],
        ["-Infinity", 2.0],
    ]
    assert [r["timestamp"] for r in records] == [None, 5.0, None]


@pytest.mark.slow
def test_two_processes_finalize_writes_once_and_per_process_logs_split(tmp_path):
    from mp_workers import global_data

    results = jh.launch_local(
        "mp_workers:finalize_run", 2, 2, args=(str(tmp_path), 4), timeout=240
    )
    assert [r["process_index"] for r in results] == [0, 1]
    expected = [float(np.mean(global_data(s, 1, 4)["m0"])) for s in range(4)]
    # Per-device loss and per-process host lr, both reduced across processes.
    rows = (*jh.STATS, *jh.PROVENANCE)
    stats = [f"{m}/{s}" for m in ("loss", "lr") for s in rows]
    straggler = ["straggler/lag", "straggler/process"]
    for r in results:  # every process returns the same dataset
        assert r["variables"] == sorted(stats + straggler)
        np.testing.assert_allclose(r["loss_mean"], expected, rtol=1e-6)
        assert r["process_count_attr"] == 2
    out = tmp_path / "out"
    # Only process 0 wrote the outputs: one dataset, one report, no stray files.
    assert sorted(p.name for p in out.iterdir()) == ["dataset.nc", "report.md"]
    shared = [_strict(x) for x in (tmp_path / "shared.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shared] == [0, 1, 2, 3]
    assert {r["process_index"] for r in shared} == {0}
    assert set(shared[0]["aggregated"]) == set(stats)
    assert shared[0]["aggregated"]["lr/std"] == 0.0
    for rank in (0, 1):  # {process_index} in the path: one log per process
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        records = [_strict(x) for x in lines]
        assert [r["process_index"] for r in records] == [rank] * 4
        assert [r["metrics"]["rank"] for r in records] == [float(rank)] * 4
    back = jh.HistoryState.from_netcdf(out / "dataset.nc")
    np.testing.assert_allclose(back.values("loss/mean"), expected, rtol=1e-6)


def test_markdown_escapes_names_that_would_render_as_something_else():
    from jaxhistory.export._markdown import md_escape

    assert md_escape("a&lt;b") == r"a\&lt;b"
    assert md_escape("x|y*z\n[l](u)") == r"x\|y\*z\\x0a\[l\](u)"
    assert md_escape("a\r\nb") == r"a\\x0d\\x0ab"


def test_names_that_differ_by_a_newline_are_two_rows_of_the_report(tmp_path):
    """Finding: the report wrote a newline in a name as a space, so metrics
    ``a b`` and ``a\\nb`` were two identical rows (the summary line shows
    ``a\\x0ab``; docs/outputs.md promises control characters as ``\\xNN``)."""
    h = jh.History(distributed_history=False)
    for step in range(3):
        h.update({"a b": 1.0 + step, "a\nb": 2.0 * step})
    h.finalize(tmp_path, plot=False)
    report = (tmp_path / "report.md").read_text()
    assert "| a b |" in report
    assert "| a\\\\x0ab |" in report  # the markdown text for a\x0ab


def test_jsonl_stream_add_racing_close_never_drops_an_accepted_record(tmp_path):
    import threading

    from jaxhistory.export._jsonl import JsonlStream

    for attempt in range(5):
        stream = JsonlStream(tmp_path / f"r{attempt}.jsonl", overwrite=True)
        accepted = []

        def writer(stream=stream, accepted=accepted):
            for i in range(10_000):
                try:
                    stream.add(i, [("a", float(i))])
                except ValueError:  # closed: refused, not lost
                    return
                accepted.append(i)

        thread = threading.Thread(target=writer)
        thread.start()
        time.sleep(0.01)
        stream.close()
        thread.join()
        lines = stream.path.read_text().splitlines()
        assert [_strict(x)["step"] for x in lines] == accepted


def test_a_deleted_array_loses_only_its_value_in_the_streamed_log(tmp_path):
    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=path)
    dev = jnp.arange(3.0) * 2
    with mock.patch.object(_writer.Writer, "INTERVAL", 3600):  # no early write
        h.update({"w": dev, "lr": 0.1}, summarize=False)
        dev.delete()
        with pytest.warns(RuntimeWarning, match="'w' at step 0 could not be read"):
            h.flush()
    record = _strict(path.read_text().splitlines()[0])
    assert record["metrics"] == {"w": ["NaN", "NaN", "NaN"], "lr": 0.1}
    h.close()
    with pytest.warns(RuntimeWarning, match="could not be read"):
        back = jh.HistoryState.from_jsonl(path).values("w")
        assert np.isnan(back).all() and back.shape == (1, 3)
        assert np.isnan(h.state.values("w")).all()  # the history agrees


def test_finalize_lists_the_files_it_wrote(tmp_path):
    s = jh.HistoryState()
    for k in range(5):
        s = s.update({"loss": 1.0 / (k + 1), "lr": 0.1})
    written = []
    jh.export.finalize(s, tmp_path, run_id="r", plot=True, echo=False, written=written)
    names = {p.relative_to(tmp_path).as_posix() for p in written}
    assert {"dataset.nc", "r.jsonl", "report.md"} <= names
    assert any(n.startswith("plots/mplot/") and n.endswith(".png") for n in names)
    assert all(p.is_file() for p in written)
    again = []
    jh.export.finalize(s, tmp_path, run_id="r", plot=False, echo=False, written=again)
    assert not any(p.suffix == ".png" for p in again)  # only this call's files


# ----- files: links, temporaries, a killed finalize's leftovers, a full disk --------
def _five_steps():
    s = jh.HistoryState()
    for k in range(5):
        s = s.update({"loss": 1.0 / (k + 1), "lr": 0.1}, step=k)
    return s


def test_finalize_never_writes_or_deletes_through_a_link(tmp_path):
    """A link at an output (report.md, the log, plots/, plots/mplot) is refused,
    naming it, before anything is written; what it points to is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "a.png").write_text("mine")
    cases = [
        ("report.md", victim, {}),
        ("r.jsonl", victim, {}),
        ("dataset.nc", tmp_path / "absent.nc", {}),  # a dangling link
        ("plots", folder, {}),
        ("plots", folder, {"plot": False}),  # would rmtree plots/mplot
        ("plots/mplot", folder, {"plot": False}),
    ]
    for name, target, kw in cases:
        out = tmp_path / f"out-{name.replace('/', '-')}-{len(kw)}"
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).symlink_to(target)
        with pytest.raises(OSError, match=f"{out / name}: it is a symbolic link"):
            jh.export.finalize(_five_steps(), out, run_id="r", echo=False, **kw)
        assert victim.read_text() == "keep"
        assert [p.name for p in folder.iterdir()] == ["a.png"]
        assert (folder / "a.png").read_text() == "mine"
        assert not (tmp_path / "absent.nc").exists()
        assert (out / name).is_symlink()  # left as it was
        assert not (out / "dataset.nc").is_file()  # refused before writing


def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path):
    """Temporary files have unpredictable names: links planted at the names
    .{name}.{pid}.tmp beside each output get nothing."""
    import os

    out = tmp_path / "out"
    out.mkdir()
    victims = {}
    for name in ("dataset.nc", "report.md", "r.jsonl"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("keep")
        (out / f".{name}.{os.getpid()}.tmp").symlink_to(victims[name])
    dangling = tmp_path / "created-through-a-link"
    (out / f".r.jsonl.{os.getpid()}.tmp.x").symlink_to(dangling)
    jh.export.finalize(_five_steps(), out, run_id="r", plot=False, echo=False)
    for name, victim in victims.items():
        assert victim.read_text() == "keep"
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert not dangling.exists()
    assert (
        jh.HistoryState.from_jsonl(out / "r.jsonl").values("lr").tolist() == [0.1] * 5
    )
    hidden = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert len(hidden) == 4  # the planted links alone: no temporary is left


def test_an_atomic_write_refuses_a_device_a_pipe_or_a_folder(tmp_path):
    import os

    (tmp_path / "pipe").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    called = []
    for path, what in [
        (Path("/dev/null"), "a device"),
        (tmp_path / "pipe", "a named pipe"),
        (tmp_path / "dir", "a folder"),
    ]:
        with pytest.raises(_files.NotAFile, match=f"{path}: it is {what}, not a re"):
            _files.atomic_write(path, lambda tmp: called.append(tmp))
    assert called == []
    # A regular file is replaced, with the permissions a new file gets.
    target = tmp_path / "f.txt"
    target.write_text("old")
    _files.atomic_write(target, lambda tmp: tmp.write_text("new"))
    umask = os.umask(0)
    os.umask(umask)
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "f.txt", "pipe"]


def test_the_log_is_never_opened_through_a_link(tmp_path):
    """A dangling link at the log's name does not get its target created; a
    link to a file does not get it appended to; a regular log still is."""
    absent = tmp_path / "absent.jsonl"
    (tmp_path / "dangling.jsonl").symlink_to(absent)
    other = tmp_path / "other.jsonl"
    other.write_text("theirs\n")
    (tmp_path / "link.jsonl").symlink_to(other)
    for name in ("dangling.jsonl", "link.jsonl"):
        for overwrite in (False, True):
            with pytest.raises(_files.NotAFile, match="symbolic link"):
                _files.open_log(tmp_path / name, overwrite)
    assert not absent.exists() and other.read_text() == "theirs\n"
    for name in ("dangling.jsonl", "link.jsonl"):  # refused before the run starts
        with pytest.raises(_files.NotAFile, match=f"{name}: it is a symbolic link"):
            jh.History(distributed_history=False, jsonl_path=tmp_path / name)
    # a link that shows up after History(...): a warning, never an error in
    # the training thread, and nothing written through it
    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "late.jsonl")
    (tmp_path / "late.jsonl").symlink_to(absent)
    with pytest.warns(RuntimeWarning, match="late.jsonl: it is a symbolic link"):
        h.update({"a": 1.0})
    h.close()
    assert not absent.exists() and other.read_text() == "theirs\n"
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"cut')  # a killed writer's last line
    with _files.open_log(log) as f:
        f.write(b"next\n")
    assert log.read_bytes() == b'{"cut\nnext\n'
    with _files.open_log(log, overwrite=True) as f:
        f.write(b"only\n")
    assert log.read_bytes() == b"only\n"


def test_finalize_refuses_a_run_name_that_is_a_path(tmp_path):
    for name in ("../x", "a/b", "..", "x\ny"):
        with pytest.raises(ValueError, match="run_name .* is not a name"):
            jh.export.finalize(
                _five_steps(), tmp_path / "out", run_id="r", run_name=name
            )
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


KILLED_FINALIZE = """
import sys
import jaxhistory as jh
s = jh.HistoryState()
for k in range(60):
    s = s.update({f"m{i}": float(k * i) for i in range(40)}, step=k)
print("ready", flush=True)
jh.export.finalize(s, sys.argv[1], run_id="r", echo=False, max_plots=None)
"""


def test_what_a_killed_finalize_leaves_goes_with_the_next_one(tmp_path):
    """A finalize killed while drawing leaves its hidden plot folder; the next
    finalize there removes it, with the temporaries and replaced plot folders of
    processes that are gone, but not a link of that naming nor its target."""
    import os

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_FINALIZE, str(out)], stdout=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"ready\n"
    deadline = time.monotonic() + 120
    while not list(out.glob(f".plots-{proc.pid}-*/*/*")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    left = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert left and all(n.startswith(f".plots-{proc.pid}-") for n in left)
    dead = proc.pid
    # Leftovers of each kind, by a process that is gone; one of a live one; a
    # link of the staging naming, to a folder that is not ours.
    (out / f".plots-{dead}-5" / "mplot").mkdir(parents=True)
    (out / f".dataset.nc.{dead}.abcd_123.tmp").mkdir()
    (out / f".dataset.nc.{dead}.abcd_123.tmp" / "dataset.nc").write_text("x")
    (out / f".report.md.{dead}.tmp").write_text("an earlier version's temporary")
    (out / "plots" / f".mplot-old-{dead}-3").mkdir(parents=True)
    live = out / f".plots-{os.getpid()}-9"
    live.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.png").write_text("keep")
    (out / f".plots-{dead}-7").symlink_to(theirs)
    jh.export.finalize(_five_steps(), out, run_id="r2", echo=False)
    hidden = {p.name for p in out.iterdir() if p.name.startswith(".")}
    assert hidden == {live.name, f".plots-{dead}-7"}
    assert [p.name for p in (out / "plots").iterdir()] != []
    assert not any(p.name.startswith(".") for p in (out / "plots").iterdir())
    assert (theirs / "keep.png").read_text() == "keep"
    assert (out / "plots" / "mplot").is_dir() and (out / "report.md").is_file()


def test_a_full_disk_is_named_as_such(tmp_path, monkeypatch):
    """The write's own ENOSPC, and a library's "HDF error" or "Permission denied"
    on a file system with no room left, say "no space left on device"."""
    import errno
    import shutil

    target = tmp_path / "dataset.nc"
    target.write_text("old")

    def full(tmp):
        tmp.write_text("part")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=f"cannot write {target}: no space left on"):
        _files.atomic_write(target, full)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["dataset.nc"]  # no temporary

    def hdf(tmp):
        raise RuntimeError("NetCDF: HDF error")

    def denied(tmp):
        raise PermissionError(errno.EACCES, "Permission denied")

    for write in (hdf, denied):  # with room: the library's own words
        with pytest.raises(OSError) as err:
            _files.atomic_write(target, write)
        assert "no space left" not in str(err.value)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: usage._replace(free=4096, used=usage.total)
    )
    for write in (hdf, denied):
        with pytest.raises(OSError) as err:
            _files.atomic_write(target, write)
        assert err.value.errno == errno.ENOSPC
        assert f"cannot write {target}: no space left on device" in str(err.value)
    import xarray as xr

    monkeypatch.setattr(xr.DataTree, "to_netcdf", lambda *a, **k: hdf(None))
    with pytest.raises(OSError, match="dataset.nc: no space left on device"):
        jh.export.finalize(_five_steps(), tmp_path / "out", run_id="r", echo=False)
    assert target.read_text() == "old"


# ----- finalize: hostile names, reruns, other files, max_plots, a full disk ---------


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


def test_finalize_leaves_other_files_under_plots_alone(tmp_path):
    mine = tmp_path / "plots" / "my_figure.png"
    mine.parent.mkdir()
    mine.write_bytes(b"user data")
    s = jh.HistoryState().update({"loss": 1.0}).update({"loss": 0.5})
    export.finalize(s, tmp_path, run_id="a", echo=False)
    export.finalize(s, tmp_path, run_id="b", plot=False)
    assert mine.read_bytes() == b"user data"
    assert not (tmp_path / "plots" / "mplot").exists()


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


# ----- report, log and summary: one metric's rows together --------------------------


def test_an_integer_metric_that_changed_is_never_listed_as_a_constant(tmp_path):
    """Found by a round trip: the report's constants allow float32 rounding
    (1e-6 of the value), so a counter of 10**10 that grew by 1 a step was
    listed as "the same at every record"; integers are compared exactly."""
    s = jh.HistoryState()
    for i in range(4):
        s = s.update({"samples": 10**10 + i, "fixed": 10**10, "lr": 3e-3})
    report = export.to_markdown(s, tmp_path / "r.md").read_text()
    assert f"| samples | {10**10 + 1.5:g} |" in report
    assert f"| {10**10} | {10**10 + 3} | {10**10 + 3} | 0 | 4 |" in report
    assert f"fixed = {10**10}, lr = 0.003" in report


def test_a_float64_metric_that_changed_is_never_listed_as_a_constant(tmp_path):
    """The constants' tolerance (1e-6 of the value) is float32 rounding: a
    float64 metric that moved by less, a wall-clock time (1.7e9 + 3 s) or a
    count held as a float (1e10 + i), was listed as "the same at every
    record", drawn as one value and left without a row or a plot. Values
    float32 cannot hold keep float64's tolerance; a float32 statistic a few
    ulps apart is still one value."""
    s = jh.HistoryState()
    for i in range(4):
        s = s.update(
            {
                "wall": 1.7e9 + i + 0.25,
                "count": 1e10 + i,
                "lr": 3e-3,
                "f32": float(
                    np.float32(0.003) if i % 2 else np.float32(0.003) * (1 + 2**-22)
                ),
            }
        )
    report = export.to_markdown(s, tmp_path / "r.md").read_text()
    assert "| wall |" in report and "| count |" in report
    constants = report.split("Constant (the same at every record): ", 1)[1]
    assert "wall" not in constants and "count" not in constants
    assert "lr = 0.003" in constants and "f32 = " in constants
    text = export.to_terminal(s, tmp_path / "txt")
    assert not any(
        t.startswith(("wall: constant", "count: constant")) for t in text.values()
    )
    assert any(t.startswith("f32: constant") for t in text.values())
    # whole numbers that float32 holds, one float32 step apart: a count that
    # moved (the report compares integers exactly, and so do the plots)
    s = jh.HistoryState()
    for i in range(4):
        s = s.update({"big": 2**30 + 128 * (i % 2), "same": 2**30})
    text = export.to_terminal(s, tmp_path / "ints")
    assert not any(t.startswith("big: constant") for t in text.values())
    assert any(t.startswith("same: constant") for t in text.values())


def test_one_metrics_statistics_stay_together_and_constants_print_once(tmp_path):
    import json

    from jaxhistory._stats import Stats

    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(3):
        table = np.array([[1.0, 0.5], [2.0, 0.7], [0.5, 0.4], [0.1, 0.05]]) + i
        # rows: mean, max, min, std; one column per metric
        h.update({"train": Stats(("loss", "acc"), table), "lr": 3e-3}, summarize=False)
    h.finalize(tmp_path / "out", plot=False)
    h.close()
    grouped = [
        "train/loss/mean", "train/loss/std", "train/loss/min", "train/loss/max",
        "train/acc/mean", "train/acc/std", "train/acc/min", "train/acc/max",
    ]  # fmt: skip
    line = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[0])
    assert list(line["aggregated"]) == grouped
    report = (tmp_path / "out" / "report.md").read_text().replace("\\", "")
    rows = [
        ln.split(" | ")[0][2:] for ln in report.splitlines() if ln.startswith("| train")
    ]
    assert rows == grouped
    assert "Constant (the same at every record): lr = 0.003" in report
    assert "| lr |" not in report
    out = run_cli("summary", tmp_path / "run.jsonl")
    assert out.stdout.index("train/loss/max") < out.stdout.index("train/acc/mean")


def test_a_nan_last_value_reads_nan_in_the_table_not_no_value():
    """Finding: a run whose last loss was NaN showed ``-`` as its last value
    (the mark of "no value"), while an inf last value showed ``inf``."""
    from jaxhistory.export._markdown import stats_table

    s = jh.HistoryState()
    for step, v in enumerate([0.5, 1.0, math.nan]):
        s = s.update({"loss": v, "other": v + 1.0, "up": [1.0, 2.0, math.inf][step]})
    rows = {r.split(" | ")[0]: r for r in stats_table(s)}
    assert rows["| loss"].split(" | ")[6] == "nan"  # last
    assert rows["| up"].split(" | ")[6] == "inf"
    lonely = jh.HistoryState().update({"x": math.nan}).update({"x": math.nan})
    (row,) = [r for r in stats_table(lonely) if r.startswith("| x")]
    assert row == "| x | - | - | - | - | - | nan | 2 | 2 |"
