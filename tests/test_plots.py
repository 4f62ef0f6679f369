"""Plots (PNG and terminal), the markdown report, and the plot worker processes."""

import warnings

import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory import export
from jaxhistory.export import _mpl, _units


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
    assert len(_units.plot_units(state)) >= _mpl.PARALLEL_FROM

    def not_here(job):
        raise AssertionError(f"{job[2]} was drawn in the parent, not by a worker")

    pending = _mpl.start_png(state, tmp_path / "png")
    monkeypatch.setattr(_mpl, "draw_job", not_here)  # the workers have their own
    paths = pending.wait()
    assert not marker.exists()
    assert len(paths) == 60 and all(p.stat().st_size > 1000 for p in paths)


# ----- what the figures show --------------------------------------------------------
@pytest.fixture
def figures(monkeypatch):
    """The figures to_png draws, by file name (written to disk as usual)."""
    drawn = {}
    save = _mpl._save

    def keep(fig, path):
        drawn[path.name] = fig
        save(fig, path)

    monkeypatch.setattr(_mpl, "_save", keep)
    return drawn


def host_scalar_of_processes(state, name, value, steps, moving=None):
    """What a multi-process run records for a host scalar every process holds:
    float32 statistics (a mean a float32 ulp off, a rounding-error std)."""
    f32 = float(np.float32(value))
    off = float(np.nextafter(np.float32(value), np.float32(np.inf)))
    for step in steps:
        record = {
            f"{name}/mean": off,
            f"{name}/max": f32,
            f"{name}/min": f32,
            f"{name}/std": 2.3e-10,
            f"{name}/argmax": 0,
            f"{name}/argmin": 0,
            f"{name}/nan_device": -1,
        }
        if moving is not None:
            loss = moving(step)
            record.update(
                {
                    "loss/mean": loss,
                    "loss/max": loss * 1.5,
                    "loss/min": loss * 0.5,
                    "loss/std": loss * 0.2,
                    "loss/argmax": step % 4,
                    "loss/argmin": 3,
                    "loss/nan_device": -1,
                }
            )
        state = state.update(record, step=step)
    return state


def test_a_metric_spanning_the_float64_range_is_plotted_and_reported(tmp_path):
    state = jh.HistoryState()
    for step, value in enumerate([1e308, -1e308, 0.0, 5.0, -1.7e308]):
        state = state.update({"huge": value, "w": np.array([value, -value])}, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the statistics overflow
        export.finalize(state, tmp_path, run_id="r", echo=False)
    png = tmp_path / "plots" / "mplot"
    assert {p.name for p in png.iterdir()} == {
        "huge.png",
        "w.png",
        "w.ridge.png",
        "w.heatmap.png",
    }
    text = (tmp_path / "plots" / "tplot" / "huge.txt").read_text()
    assert text.lstrip().startswith("huge (in units of 1e308)")
    assert "-1.0" in text and "1.0" in text
    assert "huge" in (tmp_path / "report.md").read_text()


def test_values_beyond_1e300_are_drawn_scaled_with_the_scale_on_the_axis(
    figures, tmp_path
):
    state = jh.HistoryState()
    for step, value in enumerate([1e308, -1e308, 2e307]):
        state = state.update({"timing/huge": value}, step=step)
    export.to_png(state, tmp_path)
    ax = figures["timing_huge.png"].axes[0]
    assert ax.get_ylabel() == "seconds, in units of 1e308"
    assert ax.get_ylim()[0] < -0.99 and ax.get_ylim()[1] > 0.99
    assert np.allclose(ax.lines[0].get_ydata(), [1.0, -1.0, 0.2])


def test_a_host_scalar_of_a_multi_process_run_is_shown_as_its_constant(
    figures, tmp_path
):
    """0.003 on every process: float32 statistics a few ulps apart are one
    value, not a flat line on a 1e-10 axis; the report lists it once and leaves
    it out of the Devices section, where the loss stays."""
    state = host_scalar_of_processes(
        jh.HistoryState(), "lr", 0.003, range(10), moving=lambda s: 1.0 / (s + 1)
    )
    export.finalize(state, tmp_path, run_id="r", echo=False)
    fig = figures["lr.png"]
    assert not fig.axes  # no axes: the value in large type
    texts = [t.get_text() for t in fig.texts]
    assert texts[0] == "0.003" and "constant over 10 records" in texts[1]
    assert figures["loss.png"].axes  # the loss is drawn as usual
    tplot = (tmp_path / "plots" / "tplot" / "lr.txt").read_text()
    assert tplot == "lr: constant 0.003 over 10 records (steps 0 to 9)\n"
    report = (tmp_path / "report.md").read_text()
    devices = report.split("## Devices", 1)[1].split("##", 1)[0]
    assert "loss" in devices and "lr" not in devices
    assert "Constant (the same at every record): lr = 0.003" in report
    assert "| lr/" not in report  # no rows for its four statistics
    assert "(<plots/mplot/lr.png>)" not in report  # no image of it
    assert "(<plots/mplot/loss.png>)" in report


def test_a_cosine_learning_rate_stays_on_a_linear_axis_and_a_loss_gets_a_log_one(
    figures, tmp_path
):
    steps = np.arange(1000)
    cosine = 1e-3 * 0.5 * (1 + np.cos(np.pi * steps / 999)) + 1e-12
    loss = 10.0 * np.exp(-steps / 100.0)  # 10 to 5e-4: exponential
    state = jh.HistoryState()
    for s in steps:
        state = state.update(
            {"lr": cosine[s], "schedule": cosine[s], "loss": loss[s]}, step=int(s)
        )
    export.to_png(state, tmp_path)
    assert figures["lr.png"].axes[0].get_yscale() == "linear"
    assert figures["schedule.png"].axes[0].get_yscale() == "linear"
    assert figures["loss.png"].axes[0].get_yscale() == "log"


def test_straggler_lag_is_labelled_in_seconds(figures, tmp_path):
    state = jh.HistoryState()
    for step in range(5):
        state = state.update(
            {"straggler/lag": 0.1 * step, "straggler/process": step % 2}, step=step
        )
    export.to_png(state, tmp_path)
    assert figures["straggler_lag.png"].axes[0].get_ylabel() == "seconds"
    assert figures["straggler_process.png"].axes[0].get_ylabel() == "process index"


# ----- names with control characters ------------------------------------------------
EVIL = "evil\x1b[2J\x07name"


def test_terminal_escapes_in_a_name_never_reach_the_report_or_the_plots(
    figures, tmp_path, capsys
):
    state = jh.HistoryState()
    for step in range(4):
        state = state.update({EVIL: float(step), "ok": step * 2.0}, step=step)
    export.finalize(state, tmp_path, run_id="r", max_plots=1)
    printed = capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    texts = [p.read_text() for p in (tmp_path / "plots" / "tplot").iterdir()]
    for text in [report, printed, *texts]:
        assert "\x1b" not in text and "\x07" not in text
    assert "evil\\\\x1b\\[2J\\\\x07name" in report  # shown, escaped for markdown
    assert any("evil\\x1b[2J\\x07name" in t for t in texts)
    titles = [fig.axes[0].get_title() for fig in figures.values() if fig.axes]
    assert titles and all("\x1b" not in t for t in titles)
    assert "evil\\x1b[2J\\x07name" in titles


def test_an_unplotted_name_with_escapes_is_listed_escaped(tmp_path):
    state = jh.HistoryState()
    for step in range(3):
        state = state.update({"a": float(step), EVIL: float(-step)}, step=step)
    export.finalize(state, tmp_path, run_id="r", max_plots=1, echo=False)
    report = (tmp_path / "report.md").read_text()
    assert "Not plotted" in report and "\x1b" not in report
    assert "`evil\\x1b[2J\\x07name`" in report


# ----- many plots: worker processes, or here where none can start -------------------


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
        "from test_plots import many_metrics\n"
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


# ----- what the plots show: bands, constants, markers, scales, units, families ------


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


def test_watch_entries_make_heatmaps_in_png_text_and_the_report(tmp_path):
    """Per-layer watch entries are drawn as one heatmap per statistic (entry x
    step), in PNG and text, in the report's "Per layer" section; they take no
    line plots of their own, their totals do."""
    import jax
    import jax.numpy as jnp

    from jaxhistory.export._tplot import layers_text
    from jaxhistory.export._units import layer_families

    rng = np.random.default_rng(0)
    h = jh.History(distributed_history=False)
    watch = jax.jit(lambda t: jh.watch(t, split_layers=True, stats=("norm", "rms")))
    for s in range(30):
        scale = np.exp(-np.arange(60) / 20.0)[:, None]
        grads = {"layers": {"w": jnp.float32(rng.normal(size=(60, 16)) * scale)}}
        h.update({"loss": 1.0 / (s + 1), "grads": watch(grads)}, step=s)
    families = layer_families(h.state.keys)
    assert [(f.prefix, f.stat, len(f.labels)) for f in families] == [
        ("grads", "norm", 60),
        ("grads", "rms", 60),
    ]
    assert families[0].labels[:3] == ("layers/w/0", "layers/w/1", "layers/w/2")
    assert families[0].labels[10] == "layers/w/10"  # natural order
    h.finalize(tmp_path, max_plots=None)
    mplot, tplot = tmp_path / "plots" / "mplot", tmp_path / "plots" / "tplot"
    assert (mplot / "grads_norm.layers.png").stat().st_size > 10_000
    text = (tplot / "grads_norm.layers.txt").read_text()
    assert text.startswith("grads: norm per entry (60 entries)")
    assert "layers/w/0..1 |" in text and "linear scale" in text  # 60 rows: pairs
    pngs = sorted(p.name for p in mplot.glob("*.png"))
    assert "grads_norm.png" in pngs and "loss.png" in pngs
    assert not any("layers_w_" in p for p in pngs)  # entries only in heatmaps
    report = (tmp_path / "report.md").read_text()
    assert "## Per layer" in report
    assert "![grads: norm per entry](<plots/mplot/grads_norm.layers.png>)" in report
    # 200 entries fold into at most 40 lines, each naming its range once
    many = layers_text(
        "x", np.arange(5), np.ones((200, 5)), [f"b/{i}" for i in range(200)]
    )
    assert len(many.splitlines()) == 1 + 40 + 2 and "b/0..4 |" in many


def test_layer_families_need_a_total_and_three_entries():
    from jaxhistory.export._units import layer_families

    assert layer_families(["a/x/norm", "a/y/norm", "a/z/norm"]) == []  # no total
    assert layer_families(["a/x/norm", "a/y/norm", "a/norm"]) == []  # two entries
    keys = ["x/norm", "y/norm", "z/norm", "norm", "x/rms"]
    (family,) = layer_families(keys)
    assert family.prefix == "" and family.total == "norm"
    assert family.title == "norm per entry"


# ----- one file per output, whatever the metric names ------------------------------
def watched_state(extra, steps=6):
    """A watch family (``grads/{0,1,2}/norm`` beside the total ``grads/norm``)
    and the metrics of ``extra`` (name -> value at step i)."""
    s = jh.HistoryState()
    for i in range(steps):
        record = {f"grads/{k}/norm": (k + 1.0) * (i + 1) for k in range(3)}
        record["grads/norm"] = 10.0 + i
        record.update({name: value(i) for name, value in extra.items()})
        s = s.update(record, step=i)
    return s


def title_of(fig) -> str:
    return fig.axes[0].get_title() if fig.axes else fig._suptitle.get_text()


def report_sections(folder) -> tuple[str, str]:
    """The "Per layer" and "Plots" sections of ``folder``'s report.md."""
    report = (folder / "report.md").read_text()
    per_layer = report[report.index("## Per layer") : report.index("## Plots")]
    plots = report[report.index("## Plots") : report.index("## Terminal plots")]
    return per_layer, plots


def test_a_metric_named_like_a_per_layer_heatmap_keeps_its_own_files(figures, tmp_path):
    """Finding: the text heatmap of a watch family was written as
    {stem}.layers.txt whatever was there, so a metric named grads/norm.layers
    (file stem grads_norm.layers) lost its terminal plot to it. The metric keeps
    its name; the heatmap takes a numbered one, the same in both folders."""
    s = watched_state({"grads/norm.layers": lambda i: 2.0 * i})
    export.finalize(s, tmp_path, run_id="r", echo=False)
    mplot, tplot = tmp_path / "plots" / "mplot", tmp_path / "plots" / "tplot"
    metric = (tplot / "grads_norm.layers.txt").read_text()
    assert "grads/norm.layers" in metric and "per entry" not in metric
    layers = (tplot / "grads_norm.layers-1.txt").read_text()
    assert layers.startswith("grads: norm per entry (3 entries)")
    assert title_of(figures["grads_norm.layers.png"]) == "grads/norm.layers"
    assert title_of(figures["grads_norm.layers-1.png"]).startswith(
        "grads: norm per entry"
    )
    assert (mplot / "grads_norm.layers.png").is_file()
    assert (mplot / "grads_norm.layers-1.png").is_file()
    per_layer, plots = report_sections(tmp_path)
    assert "(<plots/mplot/grads_norm.layers-1.png>)" in per_layer
    assert "(<plots/mplot/grads_norm.layers.png>)" in plots
    assert "grads_norm.layers-1" not in plots


def test_a_metric_named_like_a_comparison_keeps_its_own_files(figures, tmp_path):
    """Finding: a metric named "loss: train vs eval" had the file stem of the
    plot comparing train/loss with eval/loss, so one overwrote the other, PNG
    and text. The metric keeps its name; the comparison takes a numbered one."""
    s = jh.HistoryState()
    for i in range(6):
        s = s.update({"train/loss": 1.0 / (i + 1), "loss: train vs eval": 7.0 + i}, i)
        if i % 2 == 0:
            s = s.update({"eval/loss": 1.5 / (i + 1)}, step=i)
    export.finalize(s, tmp_path, run_id="r", echo=False)
    mplot, tplot = tmp_path / "plots" / "mplot", tmp_path / "plots" / "tplot"
    metric = (tplot / "loss_train_vs_eval.txt").read_text()
    assert "12.0" in metric and "eval" not in metric.splitlines()[-1]  # one line
    compare = (tplot / "loss_train_vs_eval-1.txt").read_text()
    assert "train" in compare.splitlines()[-1] and "eval" in compare.splitlines()[-1]
    metric = figures["loss_train_vs_eval.png"].axes[0].get_legend_handles_labels()
    assert metric[1] == []  # one line, no legend
    compare = figures["loss_train_vs_eval-1.png"].axes[0].get_legend_handles_labels()
    assert "eval" in compare[1]
    assert (mplot / "loss_train_vs_eval.png").is_file()
    assert (mplot / "loss_train_vs_eval-1.png").is_file()
    report = (tmp_path / "report.md").read_text()
    assert "(<plots/mplot/loss_train_vs_eval.png>)" in report
    assert "(<plots/mplot/loss_train_vs_eval-1.png>)" in report


def _named_like_a_comparison(value):
    """train/loss, eval/loss (every other step) and a metric literally named
    like their comparison's title, ``value(i)`` at step i."""
    s = jh.HistoryState()
    for i in range(6):
        s = s.update({"train/loss": 1.0 / (i + 1), "loss: train vs eval": value(i)}, i)
        if i % 2 == 0:
            s = s.update({"eval/loss": 1.5 / (i + 1)}, step=i)
    return s


def _section(report: str, start: str, end: str | None = None) -> str:
    tail = report[report.index(start) :]
    return tail[: tail.index(end)] if end else tail


def test_plots_sharing_a_title_each_keep_their_terminal_text(tmp_path):
    """Finding: the report's terminal plots were keyed by title, so of the
    comparison of train/loss and eval/loss and a metric named like it
    ("loss: train vs eval") only the metric's text was there. Each plot's
    text is there now, and the metric's PNG is with the other metrics, not
    in the comparison's section."""
    export.finalize(
        _named_like_a_comparison(lambda i: 7.0 + i), tmp_path, "r", echo=False
    )
    tplot = tmp_path / "plots" / "tplot"
    report = (tmp_path / "report.md").read_text()
    terminal = _section(report, "## Terminal plots", "## Files")
    assert terminal.count("### loss: train vs eval\n") == 2, terminal
    for stem in ("loss_train_vs_eval", "loss_train_vs_eval-1"):
        assert (tplot / f"{stem}.txt").read_text().rstrip() in terminal, stem
    plots = _section(report, "## Plots", "## Terminal plots")
    compare = _section(plots, "### train vs eval", "### train\n")
    assert "(<plots/mplot/loss_train_vs_eval-1.png>)" in compare
    assert "loss_train_vs_eval.png" not in compare
    assert "(<plots/mplot/loss_train_vs_eval.png>)" in _section(plots, "### other")


def test_a_constant_metric_titled_like_a_comparison_hides_only_its_own_plot(
    tmp_path,
):
    """Finding: the report left out the plots of constant metrics by title, so
    a constant metric named "loss: train vs eval" also hid the PNG comparing
    train/loss with eval/loss. Only the metric's own plot is left out (its
    value is listed under the table)."""
    export.finalize(_named_like_a_comparison(lambda i: 7.0), tmp_path, "r", echo=False)
    report = (tmp_path / "report.md").read_text()
    plots = _section(report, "## Plots", "## Terminal plots")
    assert "(<plots/mplot/loss_train_vs_eval-1.png>)" in plots
    assert "(<plots/mplot/loss_train_vs_eval.png>)" not in plots
    assert "loss: train vs eval = 7" in _section(report, "## Metrics", "## Plots")
    assert (tmp_path / "plots" / "mplot" / "loss_train_vs_eval.png").is_file()


def test_a_metric_titled_like_a_per_layer_heatmap_is_still_in_the_report(tmp_path):
    """Finding: the report told the heatmaps of watch families from the other
    plots by title, so a metric named "grads: norm per entry" was left out of
    its Plots section."""
    s = watched_state({"grads: norm per entry": lambda i: 1.0 / (i + 1)})
    export.finalize(s, tmp_path, run_id="r", echo=False)
    per_layer, plots = report_sections(tmp_path)
    assert "(<plots/mplot/grads_norm.layers.png>)" in per_layer
    assert "(<plots/mplot/grads_norm_per_entry.png>)" in plots
    assert "grads_norm.layers" not in plots


def test_dollar_signs_in_names_are_drawn_as_written_not_as_math(tmp_path):
    h = jh.History(distributed_history=False)
    names = ["a$\\foo{$b", "c$x^2$", "d$"]  # bad math, good math, a lone $
    for s in range(5):
        h.update({n: float(s + i) for i, n in enumerate(names)})
    h.update({"e": np.arange(4.0) + 1}, step=5)  # an array metric: ridge, heatmap
    h.finalize(tmp_path)
    pngs = sorted(p.name for p in (tmp_path / "plots" / "mplot").glob("*.png"))
    assert len(pngs) == 6, pngs
    assert _mpl._shown("c$x^2$") == "c\\$x^2\\$"


def test_an_all_nan_metric_says_so_on_its_png(figures, tmp_path):
    """Finding: the PNG of a metric with no finite value was an empty axes
    with made-up ticks (-0.04 to 0.04 on both axes): the NaN line counted as
    something drawn, so "no finite values recorded" was never written."""
    s = jh.HistoryState()
    for step in range(5):
        s = s.update({"n": float("nan"), "s/mean": float("nan")}, step=step)
        s = s.update({"s/max": float("nan"), "s/min": float("nan")}, step=step)
        s = s.update({"s/std": float("nan")}, step=step)
    export.to_png(s, tmp_path)
    for name in ("n.png", "s.png"):
        ax = figures[name].axes[0]
        texts = [t.get_text() for t in ax.texts]
        assert texts == ["no finite values recorded"], (name, texts)
        assert not ax.get_xticks().size and not ax.get_yticks().size
        assert ax.get_legend() is None


def test_a_long_name_is_shortened_to_fit_its_plots(figures, tmp_path):
    """Finding: a long metric name (200 characters) ran off both sides of its
    PNG, so neither end of it showed, and left its terminal plot without a
    title (plotext draws none wider than the plot). The title keeps the start
    and the end of the name around an ellipsis, within the figure."""
    long = "W" * 150 + "/tail/loss"
    s = jh.HistoryState()
    for step in range(4):
        s = s.update(
            {long: float(step), f"{long}/k": 1.0, f"{long}/a": np.arange(3.0) + step},
            step=step,
        )
    export.to_png(s, tmp_path / "png")
    assert len(figures) == 5  # a line, a constant, an array's three plots
    for name, fig in figures.items():
        fig.canvas.draw()
        title = fig.axes[0].title if fig.axes else fig._suptitle
        box = title.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (name, box)
        assert title.get_text().startswith("WWW") and "\u2026" in title.get_text()
        assert "/loss" in title.get_text(), title.get_text()  # its end
    (text, *_) = export.to_terminal(s, tmp_path / "txt").values()
    first = text.splitlines()[0]
    assert first.strip().startswith("WWW") and first.rstrip().endswith("/tail/loss")
    assert "\u2026" in first and len(first) <= 100


def test_steps_on_the_x_axis_are_whole_numbers(figures, tmp_path):
    """Finding: a short run's plots had steps that do not exist on the x axis
    (0.4, 0.8, 1.2 for steps 0 to 2; 0.33 in the terminal plot), and a metric
    recorded at step 77 alone had its point between ticks 76.5 and 78.0, the
    step it was recorded at named nowhere."""
    s = jh.HistoryState()
    for step in (0, 1, 2):
        s = s.update({"a": 1.0 / (step + 1)}, step=step)
    s = s.update({"once": 1.5, "w": np.arange(3.0)}, step=77)
    for step in (78, 79):
        s = s.update({"w": np.arange(3.0) * step}, step=step)
    export.to_png(s, tmp_path / "png")
    for name in ("a.png", "once.png", "w.png", "w.heatmap.png"):
        ax = figures[name].axes[0]
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(t == round(t) for t in ticks), (name, ticks)
        if name == "once.png":
            assert 77 in ticks
    text = export.to_terminal(s, tmp_path / "txt")
    for path, plot in text.items():
        lines = plot.splitlines()
        below = lines[1 + next(i for i, t in enumerate(lines) if "└" in t)]
        assert all(t.isdigit() for t in below.split()), (path.name, below)
    assert (tmp_path / "txt" / "once.txt").read_text().splitlines()[-2].split() == [
        "77"
    ]
    export.finalize(watched_state({}, steps=3), tmp_path / "w", echo=False)
    ax = figures["grads_norm.layers.png"].axes[0]
    assert [t for t in ax.get_xticks() if -0.5 <= t <= 2.5] == [0, 1, 2]
