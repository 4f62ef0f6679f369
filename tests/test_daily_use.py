"""The rough edges of daily use: the command line, traces and the names users of
the carried-over systems reach for."""

import subprocess
import sys

import numpy as np
import pytest
from test_export import _cli as run_cli  # the command in a fresh process

import jaxhistory as jh
from jaxhistory import cli, export
from jaxhistory.export import _units


def saved_run(tmp_path, warmup=0.0):
    s = jh.HistoryState()
    for i in range(20):
        s = s.update({"loss": 10.0 if i < 10 else float(i)}, step=i)
    export.finalize(s, tmp_path / "run", run_id="r1", plot=False, warmup=warmup)
    return s


# ----- the command line ------------------------------------------------------------


def test_help_is_plain_text_and_every_option_is_explained(capsys):
    for args in (["--help"], ["report", "--help"], ["summary", "--help"]):
        with pytest.raises(SystemExit) as done:
            cli.main(args)
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text and ":func:" not in text
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = capsys.readouterr().out
    for option in ("--warmup", "--num-chains", "--run-name", "--max-plots"):
        line = next(ln for ln in text.splitlines() if option in ln)
        following = text[text.index(line) :].split("\n  -")[0]
        assert len(following.split()) > 3, f"{option} has no help:\n{text}"


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"jaxhistory {jh.__version__}"


def test_summary_piped_to_head_ends_quietly(tmp_path):
    s = jh.HistoryState().update({f"metric_{i:04d}": float(i) for i in range(3000)})
    export.to_netcdf(s, tmp_path / "big.nc")
    done = subprocess.run(
        f"{sys.executable} -m jaxhistory summary {tmp_path / 'big.nc'} | head -2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert len(done.stdout.splitlines()) == 2
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_summary_of_a_dataset_uses_its_recorded_warmup(tmp_path):
    saved_run(tmp_path, warmup=10)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| loss | 14.5 |" in report  # the first 10 steps (loss 10) left out
    out = run_cli("summary", tmp_path / "run" / "dataset.nc")
    assert out.returncode == 0 and "| loss | 14.5 |" in out.stdout, out.stdout
    out = run_cli("summary", tmp_path / "run" / "dataset.nc", "--warmup", "0")
    assert "| loss | 12.25 |" in out.stdout  # asked for: every step


def test_report_names_the_run_given_for_a_jsonl_log(tmp_path):
    saved_run(tmp_path)
    out = run_cli(
        "report", tmp_path / "run" / "r1.jsonl", "-o", tmp_path / "again",
        "--run-name", "baseline", "--no-plots",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "again" / "report.md").read_text()
    assert report.startswith("# Run report: baseline\n")
    assert "- run id: r1" in report


@pytest.mark.parametrize("content", ["", "not json\n", '{"step": 1, "metr'])
def test_a_log_with_no_complete_record_exits_2(tmp_path, content):
    log = tmp_path / "empty.jsonl"
    log.write_text(content)
    for args in (("summary", log), ("report", log, "-o", tmp_path / "out")):
        out = run_cli(*args)
        assert out.returncode == 2, out.stdout
        assert "holds no complete record" in out.stderr


def test_summary_rows_match_numpy(tmp_path):
    s = saved_run(tmp_path)
    out = run_cli("summary", tmp_path / "run", "--warmup", "0")
    mean = np.mean(s.values("loss"))
    assert f"| loss | {mean:g} |" in out.stdout


# ----- traces ----------------------------------------------------------------------


def traced_run(folder, run_name, spans=3):
    from jaxhistory import trace

    t = trace.JSONTraceHandler(
        folder=str(folder), run_name=run_name, merged_trace_filename="merged_trace.json"
    )
    with t:
        for _ in range(spans):
            with jh.StopWatch("step"):
                pass
    return t


def test_merging_a_folder_twice_or_with_its_merge_keeps_each_span_once(tmp_path):
    from jaxhistory import trace

    t = traced_run(tmp_path, "runA")
    merged = tmp_path / "merged_trace.json"
    assert merged.is_file()
    files = sorted(str(p) for p in tmp_path.glob("*.json"))  # the merge included
    out = run_cli("merge-traces", *files, *files, "-o", tmp_path / "again.json")
    assert out.returncode == 0, out.stderr
    spans = [e for e in trace.load_trace(tmp_path / "again.json") if e["ph"] == "X"]
    assert len(spans) == 3 == len({(e["ts"], e["dur"]) for e in spans})
    # One path works too (a str is one file, not a list of characters).
    one = trace.merge_traces(str(t.paths[0]), tmp_path / "one.json")
    assert len([e for e in trace.load_trace(one) if e["ph"] == "X"]) == 3


def test_merged_runs_are_labelled_by_run_name_and_spans_group_by_name(tmp_path):
    from jaxhistory import trace

    a = traced_run(tmp_path / "a", "baseline")
    b = traced_run(tmp_path / "b", "bigger-lr")
    out = trace.merge_traces([*a.paths, *b.paths], tmp_path / "both.json")
    events = trace.load_trace(out)
    labels = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert [label.split(":")[0] for label in labels] == ["baseline", "bigger-lr"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and all("args" not in e for e in spans)  # nothing varies
    t = trace.JSONTraceHandler(folder=str(tmp_path / "c"), run_name="c")
    with t, pytest.raises(ZeroDivisionError), jh.StopWatch("fails"):
        1 / 0  # noqa: B018
    failed = [e for e in trace.load_trace(t.paths[0]) if e["ph"] == "X"]
    assert failed[0]["args"] == {"error": "ZeroDivisionError"}


# ----- names users of the carried-over systems reach for --------------------------


def test_metric_stream_in_torchelastics_form_and_getstream():
    from jaxhistory import publish

    got = []

    class Keep(publish.MetricHandler):
        def emit(self, data):
            got.append((data.group_name, data.name, data.value))

    stream = publish.MetricStream("agent", Keep())
    stream.add_value("restarts", 1)
    assert got == [("agent", "restarts", 1)]
    with publish.scoped():
        publish.configure(Keep(), group="io")
        publish.getStream("io").add_value("bytes", 4096)
        publish.MetricStream("io").add_value("files", 2)  # the registry's handler
    assert got[1:] == [("io", "bytes", 4096), ("io", "files", 2)]
    with pytest.raises(TypeError, match="must be a MetricHandler or a sink"):
        publish.MetricStream("agent", object())
    with pytest.raises(ValueError, match="group_name must be a non-empty str"):
        publish.MetricStream("", Keep())
    with pytest.raises(ValueError, match="metric name must be a non-empty str"):
        stream.add_value(3, 1)


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


# ----- plots -----------------------------------------------------------------------


def capture_axes(monkeypatch):
    """Records what the matplotlib plots of this process draw."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    calls = []
    for cls, name in ((Axes, "fill_between"), (Axes, "plot"), (Axes, "set_yscale"),
                      (Axes, "set_ylabel"), (Figure, "text")):  # fmt: skip
        real = getattr(cls, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, args, kwargs))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    return calls


def test_the_std_band_stays_inside_the_min_max_envelope(tmp_path, monkeypatch):
    calls = capture_axes(monkeypatch)
    s = jh.HistoryState()
    for i in range(5):  # an accuracy: mean + std would pass 1
        s = s.update(
            {"acc/mean": 0.95, "acc/std": 0.1, "acc/min": 0.8, "acc/max": 1.0}, step=i
        )
    export.to_png(s, tmp_path)
    bands = [
        c for c in calls if c[0] == "fill_between" and c[2].get("label") == "mean ± std"
    ]
    _, (_, lower, upper), _ = bands[0]
    assert np.all(upper <= 1.0) and np.all(lower >= 0.8)
    assert np.allclose(upper, 1.0) and np.allclose(lower, 0.85)


def test_a_constant_is_shown_as_a_value(tmp_path, monkeypatch):
    calls = capture_axes(monkeypatch)
    s = jh.HistoryState()
    for i in range(10):
        s = s.update({"lr": 3e-3}, step=i)
    export.to_png(s, tmp_path / "png")
    texts = [c[1][2] for c in calls if c[0] == "text"]
    assert "0.003" in texts and not [c for c in calls if c[0] == "plot"]
    text = export.to_terminal(s, tmp_path / "txt")
    assert list(text.values()) == [
        "lr: constant 0.003 over 10 records (steps 0 to 9)\n"
    ]


def test_short_series_have_markers_decades_a_log_axis_timings_seconds(
    tmp_path, monkeypatch
):
    calls = capture_axes(monkeypatch)
    s = jh.HistoryState()
    for i in range(100):
        s = s.update({"train/loss": 10.0 ** (-i / 20), "timing/step": 0.1 + i}, step=i)
        if i % 25 == 0:
            s = s.update({"eval/loss": 1.0 / (i + 1)}, step=i)
    export.to_png(s, tmp_path)
    markers = [c[2].get("marker") for c in calls if c[0] == "plot"]
    # train vs eval (train, eval), train/loss, timing, eval/loss (4 points)
    assert markers == [None, "o", None, None, "o"]
    assert ("set_yscale", ("log",), {}) in calls  # train/loss spans 5 decades
    assert sum(c[0] == "set_yscale" for c in calls) == 2  # and train vs eval
    assert ("set_ylabel", ("seconds",), {}) in calls


def test_rates_and_durations_say_their_unit():
    from jaxhistory.export._units import unit_label

    assert unit_label("timing/data") == "seconds"
    assert unit_label("perf/eta_sec") == "seconds"
    assert unit_label("perf/steps_per_sec") == "steps per second"
    assert unit_label("perf/mfu") == "fraction of peak FLOP/s"
    assert unit_label("train/loss") is None and unit_label("timing") is None


def test_the_reports_plots_are_grouped_per_family(tmp_path):
    """Finding: the report's plots came in recording order, constants too."""
    s = jh.HistoryState()
    for i in range(1, 21):
        s = s.update(
            {
                "grad_norm": 1.0 / i,
                "lr": 3e-3,
                "train/loss": 1.0 / i,
                "timing/step": 0.1 * i,
                "train/acc": i / 20,
            },
            step=i,
        )
        if i % 5 == 0:
            s = s.update({"eval/loss": 1.2 / i}, step=i)
    export.finalize(s, tmp_path / "out", run_id="r", echo=False)
    report = (tmp_path / "out" / "report.md").read_text()
    plots = report[report.index("## Plots") : report.index("## Terminal plots")]
    order = [
        ln.strip("# ").replace("\\", "")
        for ln in plots.splitlines()
        if ln.startswith(("### ", "!["))
    ]
    names = [
        ln.split("]")[0].lstrip("![") if ln.startswith("![") else ln for ln in order
    ]
    assert names == [
        "train vs eval",
        "loss_train_vs_eval",
        "train",
        "train_loss",
        "train_acc",
        "timing",
        "timing_step",
        "eval",
        "eval_loss",
        "other",
        "grad_norm",
    ]  # lr is constant: listed once under the table, not plotted here
    assert (tmp_path / "out" / "plots" / "mplot" / "lr.png").is_file()
    # paths alone (no titles) stay one list, as before
    text = export.to_markdown(
        s, tmp_path / "r.md", images=[tmp_path / "a.png", tmp_path / "b.png"]
    ).read_text()
    assert "![a](<a.png>)" in text and "###" not in text.split("## Plots")[1]


# ----- report, log and summary: one metric's rows together -------------------------


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


def test_train_and_eval_of_one_metric_share_a_plot(tmp_path, monkeypatch):
    calls = capture_axes(monkeypatch)
    s = jh.HistoryState()
    for i in range(100):
        s = s.update(
            {"train/loss/mean": 1.0 / (i + 1), "train/loss/std": 0.01,
             "train/loss/min": 0.9 / (i + 1), "train/loss/max": 1.1 / (i + 1),
             "train/acc": i / 100},
            step=i,
        )  # fmt: skip
        if i % 20 == 0:
            s = s.update({"eval/loss": 1.2 / (i + 1), "val/acc": i / 120}, step=i)
    units = _units.plot_units(s)
    titles = [u.title for u in units]
    assert titles[:2] == ["loss: train vs eval", "train/loss"]
    assert "acc: train vs val" in titles and "eval/loss" in titles  # kept too
    paths = export.to_png(s, tmp_path / "png")
    assert (tmp_path / "png" / "loss_train_vs_eval.png") in paths
    labels = [c[2].get("label") for c in calls if c[0] == "plot"]
    assert "train mean" in labels and "eval" in labels and "val" in labels
    eval_line = next(c for c in calls if c[0] == "plot" and c[2].get("label") == "eval")
    assert eval_line[2]["marker"] == "o"  # 5 points
    text = export.to_terminal(s, tmp_path / "txt")
    compare = next(t for p, t in text.items() if p.name == "loss_train_vs_eval.txt")
    assert "eval" in compare and "mean" in compare


def test_the_terminal_legend_is_under_the_plot_not_over_the_data(tmp_path):
    s = jh.HistoryState()
    for i in range(100):
        s = s.update(
            {"loss/mean": 1 / (i + 1), "loss/std": 0.05, "loss/min": 0.5 / (i + 1),
             "loss/max": 2.5 if i == 3 else 1.5 / (i + 1)},
            step=i,
        )  # fmt: skip
    (text,) = export.to_terminal(s, tmp_path).values()
    lines = text.rstrip("\n").splitlines()
    assert lines[-1].split() == [
        "·", "mean", "-", "min", "+", "max", "*", "std", "(right", "axis)"
    ]  # fmt: skip
    top = next(ln for ln in lines if ln.startswith("2.5"))
    assert "+" in top  # the early spike is visible, not under a legend box


# ----- resume ---------------------------------------------------------------------


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


def test_every_log_line_carries_the_run_id(tmp_path):
    """Finding: the JSONL carried no run id; resume took it from the file name."""
    import json

    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="exp")
    for i in range(3):
        h.update({"loss": float(i)}, summarize=False)
    h.close()
    log = tmp_path / f"{h.run_id}.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3 and {r["run_id"] for r in lines} == {h.run_id}
    renamed = log.rename(tmp_path / "copied.jsonl")  # the name no longer says it
    assert dict(jh.HistoryState.from_jsonl(renamed).attrs)["run_id"] == h.run_id
    again = jh.History(distributed_history=False, resume=renamed)
    assert again.run_id == h.run_id
    again.close()
    assert run_cli(
        "report", str(renamed), "--outdir", str(tmp_path / "r"), "--no-plots"
    )
    assert f"# Run report: {h.run_id}" in (tmp_path / "r" / "report.md").read_text()
    # A whole state written out, and a stream of one's own
    export.to_jsonl(
        jh.HistoryState().update({"a": 1.0}), tmp_path / "w.jsonl", run_id="w1"
    )
    assert json.loads((tmp_path / "w.jsonl").read_text())["run_id"] == "w1"
    odd = 'a"b%s\\n'
    stream = export.JsonlStream(tmp_path / "s.jsonl", run_id=odd)
    stream.add(0, {"x": 1.0})
    stream.close()
    assert json.loads((tmp_path / "s.jsonl").read_text())["run_id"] == odd
    assert dict(jh.HistoryState.from_jsonl(tmp_path / "s.jsonl").attrs)["run_id"] == odd


# ----- steps: what was timed for a step is recorded at that step -------------------


def _log_lines(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_step_timed_after_its_update_shares_its_line(tmp_path):
    """Finding: in the demo's loop (update, then a timed wait-and-log, then an
    evaluation at the same step) the timing of step 10 landed at step 11, and
    step 200 had two lines in the JSONL."""
    log = tmp_path / "run.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    for step in range(1, 21):
        h.update({"step": step, "loss": 1.0 / step}, summarize=False)
        if step % 10 == 0:
            with jh.StopWatch("wait and log", history=h, step=step):
                pass
            h.update({"eval": {"loss": 0.5}}, step=step, summarize=False)
    h.close()
    lines = _log_lines(log)
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, 21))  # one line per step
    ten = lines[9]["metrics"]
    assert set(ten) == {"loss", "timing/wait_and_log", "eval/loss"}
    assert h.state.steps("timing/wait_and_log").tolist() == [10, 20]
    assert jh.HistoryState.from_jsonl(log).steps("eval/loss").tolist() == [10, 20]


def test_a_steps_line_waits_for_more_of_that_step_but_not_for_ever(tmp_path):
    from jaxhistory._fan_out import FanOut

    log = tmp_path / "s.jsonl"
    stream = export.JsonlStream(log)
    stream.add(1, {"a": 1.0})
    stream.writer.write_queued(final=False)  # the thread's write: step 1 may get more
    assert log.read_text() == ""
    stream.add(1, {"b": 2.0})
    stream.add(2, {"a": 3.0})
    stream.writer.write_queued(final=False)  # step 2 came: step 1 is over
    assert [(r["step"], r["metrics"]) for r in _log_lines(log)] == [
        (1, {"a": 1.0, "b": 2.0})
    ]
    stream.flush()  # flush writes the held line too
    assert [r["step"] for r in _log_lines(log)] == [1, 2]
    stream.add(2, {"late": 4.0})  # after its line was written: a line of its own
    stream.add(3, {"a": 5.0}, timestamp=0.0)  # an old record is never held
    stream.writer.write_queued(final=False)
    stream.add(4, {"a": 6.0}, timestamp=4e9)  # nor one with a time in the future
    stream.writer.write_queued(final=False)
    assert [r["step"] for r in _log_lines(log)] == [1, 2, 2, 3, 4]
    stream.close()
    back = jh.HistoryState.from_jsonl(log)
    assert back.steps("late").tolist() == [2] and back.values("a").tolist() == [
        1.0,
        3.0,
        5.0,
        6.0,
    ]
    assert FanOut.HOLD <= 1.0  # a SIGKILL loses at most about a second


def test_the_latest_steps_line_reaches_the_log_within_the_hold(tmp_path):
    import time

    log = tmp_path / "run.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    h.update({"loss": 1.0}, step=0, summarize=False)
    deadline = time.monotonic() + 20
    while not log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["step"] for r in _log_lines(log)] == [0]  # without a flush
    h.close()


# ----- launching a local multi-process job ----------------------------------------


@pytest.mark.slow
def test_launched_processes_output_is_streamed_with_a_prefix(capsys, tmp_path):
    import mp_workers

    assert jh.launch_local(mp_workers.say, 2, args=("hey",), timeout=120) == [0, 1]
    out = capsys.readouterr().out
    for pid in (0, 1):
        assert f"[process {pid}] hey from {pid}" in out
        assert f"[process {pid}] hey on stderr" in out
    # To files it names instead, or nowhere.
    jh.launch_local(mp_workers.say, 2, timeout=120, output=tmp_path / "logs")
    assert capsys.readouterr().out == ""
    assert "hi from 1" in (tmp_path / "logs" / "process-1.log").read_text()
    jh.launch_local(mp_workers.say, 2, timeout=120, output=None)
    assert capsys.readouterr().out == ""
    with pytest.raises(TypeError, match="output must be 'stream', a folder or None"):
        jh.launch_local(mp_workers.say, 2, output=3)


@pytest.mark.slow
def test_the_launch_command(tmp_path):
    import os
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    cmd = [sys.executable, "-m", "jaxhistory", "launch", "-n", "2"]
    done = subprocess.run(
        [*cmd, "mp_workers:say", "yo"], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[process 1] yo from 1" in done.stdout
    assert "[process 0] returned 0" in done.stdout
    failed = subprocess.run(
        [*cmd, "mp_workers:fail_on_process_one", "--timeout", "120"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert failed.returncode == 1 and "launched processes failed" in failed.stderr
    bad = subprocess.run(
        [*cmd, "no_colon"], capture_output=True, text=True, env=env, timeout=300
    )
    assert bad.returncode == 2 and "must look like" in bad.stderr


# ----- progress: steps/s, ETA, MFU --------------------------------------------------


def test_progress_steps_per_second_eta_and_mfu(monkeypatch):
    from jaxhistory import _history

    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(_history.time, "perf_counter", lambda: next(clock))
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


def test_step_flops_counts_the_work_of_every_device(mesh):
    """The same global matmul gives the same count on one device or with its
    batch sharded over 8; work repeated on every device counts on each."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    a, b = np.ones((1024, 256), np.float32), np.ones((256, 512), np.float32)
    matmul = 2 * 1024 * 256 * 512
    assert matmul == 268_435_456
    fn = jax.jit(lambda x, y: x @ y)
    assert jh.step_flops(fn, a, b) == matmul  # one device
    batch = jax.device_put(a, NamedSharding(mesh, P("data")))
    whole = jax.device_put(b, NamedSharding(mesh, P()))
    assert jh.step_flops(fn, batch, whole) == matmul  # 8 devices, 1/8 each
    copies = jax.device_put(a, NamedSharding(mesh, P()))
    assert jh.step_flops(fn, copies, whole) == 8 * matmul  # each device all of it
    # shard_map: each device's block, plus the all-reduce's additions
    summed = jax.shard_map(
        lambda x, y: jax.lax.psum(x @ y, "data"),
        mesh=mesh,
        in_specs=(P(None, "data"), P("data")),
        out_specs=P(),
    )
    cols = jax.device_put(a, NamedSharding(mesh, P(None, "data")))
    rows = jax.device_put(b, NamedSharding(mesh, P("data")))
    assert jh.step_flops(summed, cols, rows) == matmul + 8 * 1024 * 512


def test_step_flops_counts_the_devices_from_the_shardings_too(mesh, monkeypatch):
    """Where the compiled module's header names no device count (a JAX version
    that words it otherwise), the shardings of the arguments still give it."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxhistory import _hlo

    assert _hlo.devices_in_hlo("HloModule m, is_scheduled=true") == 1
    assert _hlo.devices_in_hlo("HloModule m, num_partitions=4, replica_count=2") == 8
    monkeypatch.setattr(_hlo, "devices_in_hlo", lambda text: 1)
    a = np.ones((1024, 256), np.float32)
    batch = jax.device_put(a, NamedSharding(mesh, P("data")))
    whole = jax.device_put(np.ones((256, 512), np.float32), NamedSharding(mesh, P()))
    fn = jax.jit(lambda x, y: x @ y)
    assert jh.step_flops(fn, batch, whole) == 2 * 1024 * 256 * 512
    assert jh.step_flops(fn, a, np.ones((256, 512), np.float32)) == 2 * 1024 * 256 * 512


# ----- the dataset -----------------------------------------------------------------


def test_the_dataset_has_the_wall_clock_time_of_each_step(tmp_path):
    import xarray as xr

    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(5):
        h.update({"loss": 1.0 / (i + 1), "time": float(i)}, summarize=False)
    h.finalize(tmp_path / "out", plot=False)
    h.close()
    with xr.open_dataset(tmp_path / "out" / "dataset.nc") as ds:  # plain xarray
        times = ds["time_"].values  # "time" is a metric here
        assert times.dtype.kind == "M" and len(times) == 5
        assert np.all(np.diff(times.astype("int64")) >= 0)
        year = times[0].astype("datetime64[Y]").astype(int) + 1970
        assert year >= 2024
    back = jh.HistoryState.from_netcdf(tmp_path / "out" / "dataset.nc")
    assert back.values("time").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    s = jh.HistoryState().update({"loss": 1.0}, step=3)
    export.to_netcdf(s, tmp_path / "no_times.nc")  # no timestamps: no coordinate
    with xr.open_dataset(tmp_path / "no_times.nc") as ds:
        assert "time" not in ds.coords


def test_plain_xarray_reads_each_metric_by_its_path(tmp_path):
    """Finding: ``xr.open_dataset`` named variables ``train%2Floss%2Fmean``, and
    ``ds["train/loss/mean"]`` raised KeyError. Each metric path is now a group."""
    import xarray as xr

    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(4):
        stats = {"mean": 1.0 / (i + 1), "std": 0.1, "min": 0.5, "max": 2.0}
        h.update({"train": {"loss": stats}, "lr": 1e-3}, summarize=False)
        if i % 2:
            h.update({"eval/loss": 0.7}, step=i, summarize=False)
    h.finalize(tmp_path / "out", plot=False)
    h.close()
    path = tmp_path / "out" / "dataset.nc"
    with xr.open_datatree(path) as tree:  # plain xarray, no jaxhistory call
        mean = tree["train/loss/mean"]
        assert mean.values.tolist() == [1.0, 0.5, 1 / 3, 0.25]
        assert mean.attrs["long_name"] == "train/loss/mean"
        group = tree["train/loss"].to_dataset()
        assert set(group.data_vars) == {"mean", "std", "min", "max"}
        assert group["max"].dims == ("step",)
        assert tree["time"].dtype.kind == "M" and tree["time"].dims == ("step",)
        assert group.coords["step"].values.tolist() == [0, 1, 2, 3]
        eval_loss = tree["eval/loss"].values
        assert np.isnan(eval_loss[0]) and eval_loss[1] == 0.7
    with xr.open_dataset(path, group="train/loss") as ds:
        assert ds["std"].values.tolist() == [0.1] * 4
    with xr.open_dataset(path) as ds:  # the root: metrics without a "/"
        assert ds["lr"].values.tolist() == [1e-3] * 4
        assert ds.attrs["jaxhistory_layout"] == "groups"


def test_the_dataset_file_keeps_names_that_cannot_be_groups(tmp_path):
    """A metric ``loss`` beside ``loss/std`` (netCDF has one namespace for groups
    and variables), ``x/step`` (the coordinate), empty or over-long parts: each
    round-trips exactly, in the history's order."""
    import xarray as xr

    names = ["loss/std", "loss", "x/step", "step/x", "a//b", "/a", "a/", "é/ü"]
    names += ["p" * 300 + "/y", "z/" + "q" * 300, "t/arr", "arr", "%2F/_x"]
    # found in review: a group named like a coordinate below the root; names
    # that reach netCDF's 255 bytes once made free or given a dimension; the
    # same name in two Unicode forms (netCDF stores NFC)
    names += ["a/step/x", "b/c/time/x", "M" * 255, "M" * 255 + "/x"]
    names += ["e\u0301", "\u00e9", "n/e\u0301/x", "L" * 250]
    s = jh.HistoryState()
    for i in range(3):
        row = {n: float(i + k) for k, n in enumerate(names)}
        row["t/arr"] = np.ones((2, 2)) * i
        row["arr"] = np.arange(3.0) + i
        row["L" * 250] = np.arange(2.0) + i  # its dimension's name is too long
        s = s.update(row, step=i)
    export.to_netcdf(s, tmp_path / "d.nc", timestamps={0: 1e9, 1: 1e9 + 1})
    back = jh.HistoryState.from_netcdf(tmp_path / "d.nc")
    assert back.keys == s.keys
    for name in names:
        np.testing.assert_array_equal(back.values(name), s.values(name), name)
    with xr.open_datatree(tmp_path / "d.nc") as tree:
        assert tree["loss/std"].values.tolist() == [0.0, 1.0, 2.0]
        assert tree["loss_"].attrs["jaxhistory_name"] == "loss"
        assert tree["x/step_"].attrs["jaxhistory_name"] == "x/step"
        assert tree["t/arr"].shape == (3, 2, 2) and tree["arr"].shape == (3, 3)
    flat = export.read_netcdf(tmp_path / "d.nc")
    assert flat["t/arr"].dims == ("step", "t/arr_dim_0", "t/arr_dim_1")
    assert flat["L" * 250].dims == s.to_xarray()["L" * 250].dims  # as in memory


def test_a_dataset_file_of_the_earlier_flat_layout_still_reads(tmp_path):
    import xarray as xr

    ds = xr.Dataset(
        {"train%2Floss": ("step", [0.5, 0.25]), "lr": ("step", [1.0, 1.0])},
        coords={"step": [0, 1]},
        attrs={"jaxhistory_next_step": 2},
    )
    ds.to_netcdf(tmp_path / "old.nc", engine="netcdf4")
    back = jh.HistoryState.from_netcdf(tmp_path / "old.nc")
    assert set(back.keys) == {"train/loss", "lr"}
    assert back.values("train/loss").tolist() == [0.5, 0.25]


def test_the_times_of_a_log_are_read_whatever_wrote_it(tmp_path):
    from jaxhistory._codec import read_stamps

    ours = tmp_path / "ours.jsonl"
    ours.write_text(
        '{"step":1,"timestamp":1700000000.5,"process_index":0,"metrics":{}}\n'
        '{"step":2,"timestamp":null,"process_index":0,"metrics":{}}\n'
        '{"step":1,"timestamp":1700000009.0,"process_index":0,"metrics":{}}\n'
        '{"step":3,"timestamp":1.7e9,"process_index":0,"metr'  # cut off
    )
    assert read_stamps(ours) == {1: 1700000000.5, 3: 1.7e9}  # the first wins
    other = tmp_path / "other.jsonl"  # keys in another order
    other.write_text('{"timestamp": 5.0, "step": 4}\nnot json\n{"step": 5}\n')
    assert read_stamps(other) == {4: 5.0}
    (tmp_path / "empty.jsonl").write_text("")
    assert read_stamps(tmp_path / "empty.jsonl") == {}


def test_records_of_one_step_merge_only_where_they_follow_each_other():
    from jaxhistory._fan_out import merged as _merged
    from jaxhistory._record import Batch

    def batch(steps, aggregated=None):
        out = Batch(
            steps,
            [float(i) for i in range(len(steps))],
            [{f"m{i}": i} for i in range(len(steps))],
            aggregated,
        )
        out.finite, out.run_id = True, "r"
        return out

    held = batch([3], [{"a/mean": 1.0}])
    new = batch([3, 3, 4, None, None, 3])
    out = _merged(held, new)
    assert out.steps == [3, 4, None, None, 3]  # a later record of 3: its own line
    assert out.metrics[0] == {"m0": 0, "m1": 1}  # held, then the batch's two
    assert out.aggregated[0] == {"a/mean": 1.0} and out.aggregated[1] == {}
    assert out.stamps[0] == 0.0 and out.run_id == "r" and out.finite
    plain = batch([1, 2, 3])
    assert _merged(None, plain) is plain  # nothing to merge: the same batch
    joined = _merged(batch([0]), plain)
    assert joined.steps == [0, 1, 2, 3] and joined.aggregated is None
    assert _merged(None, None) is None and _merged(held, None) is held


def test_the_run_id_of_a_log_whose_last_lines_are_long(tmp_path):
    """Found in review: a last line over the 1 MiB read from the end lost it."""
    path = tmp_path / "big.jsonl"
    stream = export.JsonlStream(path, run_id="exp-1")
    stream.add(0, {"loss": 1.0})
    stream.add(1, {"big": np.arange(200_000, dtype=np.float64)})
    stream.close()
    assert path.stat().st_size > 1 << 20
    assert dict(jh.HistoryState.from_jsonl(path).attrs)["run_id"] == "exp-1"
    h = jh.History(distributed_history=False, resume=path)
    assert h.run_id == "exp-1"
    h.close()


def test_the_times_of_a_log_mixing_its_lines_with_others(tmp_path):
    """Found in review: a log with both kinds of line lost the others' times."""
    from jaxhistory._codec import read_stamps

    path = tmp_path / "mixed.jsonl"
    path.write_text(
        '{"timestamp": 10.0, "step": 0}\n'
        '{"step":1,"timestamp":11.0,"process_index":0,"metrics":{}}\n'
        '{"step":2,"timestamp":null,"process_index":0,"metrics":{}}\n'
    )
    assert read_stamps(path) == {0: 10.0, 1: 11.0}


# ----- the command line: user errors, outputs that are links ------------------------


def _dataset_with_run_id(tmp_path, run_id):
    import xarray as xr

    saved_run(tmp_path)
    tree = xr.open_datatree(tmp_path / "run" / "dataset.nc").load()
    tree.attrs["run_id"] = run_id
    tree.to_netcdf(tmp_path / "crafted.nc")
    return tmp_path / "crafted.nc"


def test_cli_user_errors_are_one_line_and_status_2(tmp_path, capsys):
    """Bad option values, an output that is a file or a device, a dataset
    whose run id holds escapes: one line on stderr naming what was wrong
    (control characters escaped), status 2, no traceback, nothing written."""
    saved_run(tmp_path)
    run = tmp_path / "run" / "dataset.nc"
    crafted = _dataset_with_run_id(tmp_path, "r\x1b[2J\nid")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "dur": 1}]}')
    out = tmp_path / "out"
    cases = [
        (["summary", run, "--warmup", "nan"], "warmup must be a number >= 0"),
        (["summary", run, "--warmup", "inf"], "got 'inf'"),
        (["report", run, "-o", out, "--warmup", "-1"], "got '-1'"),
        (["report", run, "-o", out, "--num-chains", "0"], "num-chains must be a"),
        (["report", run, "-o", out, "--num-chains", "-5"], "got '-5'"),
        (["report", run, "-o", afile], f"{afile} exists and is a regular file"),
        (["report", run, "-o", "/dev/null"], "/dev/null exists and is a device"),
        (["report", crafted, "-o", out], "run id 'r\\x1b[2J\\nid' recorded in"),
        (["merge-traces", trace, "-o", "/dev/null"], "/dev/null"),
    ]
    for args, said in cases:
        try:
            status = cli.main([str(a) for a in args])
        except SystemExit as done:  # argparse's own exit
            status = done.code
        err = capsys.readouterr().err
        assert status == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("jaxhistory"), (args, err)
        assert said in err, (args, err)
        assert "\x1b" not in err and "Traceback" not in err
    assert afile.read_text() == "mine" and not out.exists()


def test_cli_report_never_writes_or_deletes_through_a_link(tmp_path, capsys):
    """OUT/RUN.jsonl a link to another file, OUT/plots a link to a folder: the
    command refuses, naming it, and what they point to is untouched."""
    saved_run(tmp_path)
    log = tmp_path / "run" / "r1.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "a.png").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "r1.jsonl").symlink_to(victim)
    assert cli.main(["report", str(log), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'r1.jsonl'}: it is a symbolic link" in err
    assert victim.read_text() == "keep"
    (out / "r1.jsonl").unlink()
    (out / "plots").symlink_to(folder)
    for extra in ([], ["--no-plots"]):
        assert cli.main(["report", str(log), "-o", str(out), *extra]) == 2
        assert f"{out / 'plots'}: it is a symbolic link" in capsys.readouterr().err
        assert [p.name for p in folder.iterdir()] == ["a.png"]
    (out / "plots").unlink()
    assert cli.main(["report", str(log), "-o", str(out), "--no-plots"]) == 0
    assert (out / "report.md").is_file() and (out / "r1.jsonl").is_file()


@pytest.mark.slow
def test_the_launch_command_takes_the_functions_arguments_after_its_options():
    import os
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    cmd = [sys.executable, "-m", "jaxhistory", "launch", "-n", "2", "mp_workers:say"]
    done = subprocess.run(
        [*cmd, "--devices-per-process", "2", "--timeout", "120", "yo"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[process 1] yo from 1" in done.stdout
    assert "[process 0] returned 0" in done.stdout
