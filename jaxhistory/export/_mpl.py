"""Matplotlib plots, one PNG per metric, drawn without pyplot or global state."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxhistory._optional import import_optional
from jaxhistory._stragglers import LAG_BY_PROCESS
from jaxhistory.export._units import (
    ARRAY_PLOTS,
    MARKERS_UP_TO,
    LayerFamily,
    PlotUnit,
    bucket,
    constant_unit,
    family_matrix,
    log_scale,
    plot_stems,
    plot_units,
    printable,
    quantile_keys,
    row_stats,
    scale_exponent,
    series,
    shortened,
    unit_label,
)

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["draw_job", "to_png"]

SIZE = (8.0, 4.5)  # inches
DPI = 110
RIDGES = 8  # time slices in a ridge plot


def _shown(text: object) -> str:
    """A name as matplotlib shows it: control characters escaped, and ``$``
    escaped too, so a name is drawn as written rather than parsed as math
    (where a stray ``\\foo`` between two ``$`` would fail the drawing)."""
    return printable(text).replace("$", r"\$")


def _title(fig, name: str, ax=None, suffix: str = "") -> None:
    """Sets ``ax``'s title (without ``ax``, the figure's) to ``name`` as
    :func:`_shown` shows it, then ``suffix``; the name shortened around an
    ellipsis where the title would be wider than the figure (a 200-character
    name would run off both sides)."""
    shown = printable(name)
    artist = (ax.set_title if ax is not None else fig.suptitle)(_shown(shown) + suffix)
    if len(shown) + len(suffix) <= 30:  # fits at any glyph width: not measured
        return
    box = ax.bbox if ax is not None else fig.bbox  # the title is centred on it
    center = box.x0 + box.width / 2
    room = 0.98 * 2 * min(center, fig.bbox.width - center)
    renderer = fig.canvas.get_renderer()
    for _ in range(4):  # glyphs differ in width: shortened until it fits
        width = artist.get_window_extent(renderer).width
        if width <= room:
            return
        keep = int((len(shown) + len(suffix)) * room / width) - len(suffix) - 1
        shown = shortened(shown, max(keep, 3))
        artist.set_text(_shown(shown) + suffix)


def _figure(left: float = 0.09, right: float = 0.97):
    import_optional("matplotlib", "to_png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI)  # fixed margins: a layout engine is slow
    fig.subplots_adjust(left=left, right=right, top=0.92, bottom=0.12)
    FigureCanvasAgg(fig)  # a canvas of its own: no pyplot, no backend switch
    return fig


def _axes(fig):
    """An axes with at most 6 major ticks per axis (each tick is a few text and
    line artists, the largest part of drawing a small figure), whole numbers on
    x: steps."""
    from matplotlib.ticker import MaxNLocator

    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(6))
    return ax


def _marker(x: np.ndarray) -> str | None:
    return "o" if len(x) <= MARKERS_UP_TO else None


def _draw_constant(unit: PlotUnit, x: np.ndarray, value: float, path: Path) -> None:
    """A metric that never changed: its value, not a line on a meaningless axis."""
    fig = _figure()
    fig.text(0.5, 0.58, f"{value:.6g}", ha="center", va="center", fontsize=28)
    fig.text(
        0.5,
        0.4,
        f"constant over {len(x)} records (steps {int(x[0])} to {int(x[-1])})",
        ha="center",
        va="center",
        fontsize=11,
        color="0.35",
    )
    _title(fig, unit.title)
    _save(fig, path)


def _draw_unit(
    data: dict[str, tuple[np.ndarray, np.ndarray]],
    unit: PlotUnit,
    marks: Sequence,
    path: Path,
) -> None:
    """Draws one unit from ``data``, its series by name (warmup left out).

    A unit whose lines are all one value (:func:`constant_unit`) is drawn as
    that value; values beyond ±1e300 are drawn divided by a power of ten, which
    the y label names."""
    value = constant_unit(unit, data)
    if value is not None:
        return _draw_constant(unit, data[unit.names[0]][0], value, path)
    exponent = scale_exponent(*(y for _, y in data.values()))
    if exponent:
        data = {n: (x, y / 10.0**exponent) for n, (x, y) in data.items()}
    fig = _figure()
    ax = _axes(fig)
    drawn: list[np.ndarray] = []
    who = "train " if unit.others else ""  # train vs eval: say which is which
    if unit.stats:
        x, mean = data[unit.stats["mean"]]
        _, std = data[unit.stats["std"]]
        _, lo = data[unit.stats["min"]]
        _, hi = data[unit.stats["max"]]
        if len(std) == len(mean) == len(lo) == len(hi):
            xb, lo_b = bucket(x, lo, "min")
            _, hi_b = bucket(x, hi, "max")
            _, mean_b = bucket(x, mean, "mean")
            _, std_b = bucket(x, std, "mean")
            ax.fill_between(
                xb, lo_b, hi_b, alpha=0.15, color="C0", lw=0, label=f"{who}min-max"
            )
            # mean ± std never leaves the min-max envelope (an accuracy above 1,
            # a loss below 0 would be drawn otherwise)
            ax.fill_between(
                xb,
                np.fmax(mean_b - std_b, lo_b),
                np.fmin(mean_b + std_b, hi_b),
                alpha=0.35,
                color="C0",
                lw=0,
                label=f"{who}mean ± std",
            )
            ax.plot(
                xb,
                mean_b,
                color="C0",
                lw=1.2,
                label=f"{who}mean",
                marker=_marker(xb),
                ms=3,
            )
            drawn += [lo_b, hi_b]
        quantiles = quantile_keys(unit.stats)
        if quantiles:  # across devices: the outer pair as a band, the median
            _, q_lo = bucket(*data[unit.stats[quantiles[0]]], "min")
            xq, q_hi = bucket(*data[unit.stats[quantiles[-1]]], "max")
            if len(quantiles) > 1 and len(q_lo) == len(q_hi):
                ax.fill_between(
                    xq,
                    q_lo,
                    q_hi,
                    alpha=0.25,
                    color="C2",
                    lw=0,
                    label=f"{quantiles[0]}-{quantiles[-1]}",
                )
            if "p50" in unit.stats:
                xm, med = bucket(*data[unit.stats["p50"]], "mean")
                ax.plot(xm, med, color="C2", lw=1.0, ls="--", label="median")
    if unit.raw is not None:
        x, y = data[unit.raw]
        if y.ndim > 1:
            chains = y.reshape(len(y), -1)
            mean, lo, hi = row_stats(chains)
            xb, mean_b = bucket(x, mean, "mean")
            _, lo_b = bucket(x, lo, "min")
            _, hi_b = bucket(x, hi, "max")
            ax.fill_between(
                xb,
                lo_b,
                hi_b,
                alpha=0.2,
                color="C1",
                lw=0,
                label=f"min-max of {chains.shape[1]}",
            )
            ax.plot(
                xb, mean_b, color="C1", lw=1.2, label="mean", marker=_marker(xb), ms=3
            )
            drawn += [lo_b, hi_b]
        else:
            xb, yb = bucket(x, y, "envelope")
            ax.plot(
                xb,
                yb,
                color="C1" if unit.stats else "C0",
                lw=1.0,
                label=_shown(unit.raw) if unit.stats or unit.others else None,
                marker=_marker(xb),
                ms=3,
            )
            drawn.append(yb)
    for i, (other_label, name) in enumerate(unit.others):
        x, y = data[name]
        xb, yb = bucket(x, y, "envelope")
        ax.plot(
            xb,
            yb,
            color=f"C{i + 2}",
            lw=1.4,
            label=_shown(other_label),
            marker=_marker(xb),
            ms=4,
        )
        drawn.append(yb)
    ax.set_xlabel("step")
    steps = np.concatenate([x for x, _ in data.values()])
    if steps.size and steps.min() == steps.max():  # one step: ticks around it
        ax.set_xlim(steps[0] - 1, steps[0] + 1)
    label = unit_label(unit.title)
    if exponent:
        label = f"{label or 'value'}, in units of 1e{exponent}"
    if label:
        ax.set_ylabel(_shown(label))
        fig.subplots_adjust(left=0.12)  # room for the label beside wide ticks
    _title(fig, unit.title, ax)  # after the margins are set
    if drawn and log_scale(*drawn, name=unit.title):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    # a line of NaN is a line too: the values say whether anything shows
    finite = any(np.isfinite(y).any() for _, y in data.values())
    if not finite:
        ax.text(
            0.5,
            0.5,
            "no finite values recorded",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_yticks([])  # an empty axis's ticks would be made up
        if not marks:  # steps where a sentinel fired keep theirs
            ax.set_xticks([])
    for i, step in enumerate(marks):  # where a sentinel fired on this metric
        label = "sentinel" if i == 0 else None
        ax.axvline(step, color="crimson", alpha=0.6, lw=0.9, ls="--", label=label)
    if ax.get_legend_handles_labels()[0] and (finite or marks):
        ax.legend(loc="best", fontsize="small")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    # zlib level 3: faster to encode than the default 6, files a little larger
    fig.savefig(path, pil_kwargs={"compress_level": 3})


def _pick(n: int, k: int) -> np.ndarray:
    """Up to ``k`` evenly spaced indices out of ``n``."""
    return np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(int))


def _draw_ridge(title, x, chains, path: Path) -> None:
    fig = _figure(left=0.15)
    ax = fig.add_subplot()
    rows = _pick(len(x), RIDGES)
    exponent = scale_exponent(chains)
    if exponent:
        chains = chains / 10.0**exponent
    finite = chains[np.isfinite(chains)]
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, 41)
        centers = (edges[:-1] + edges[1:]) / 2
        for i, r in enumerate(rows):
            vals = chains[r][np.isfinite(chains[r])]
            counts = np.histogram(vals, edges)[0].astype(float)
            if counts.max() > 0:
                counts = counts / counts.max() * 0.9
            ax.fill_between(
                centers, i, i + counts, alpha=0.6, color=f"C{i % 10}", lw=0.8
            )
        ax.set_yticks(range(len(rows)), [f"step {int(x[r])}" for r in rows])
    else:
        ax.text(
            0.5,
            0.5,
            "no finite values recorded",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    _title(fig, title, ax, f": distribution over {chains.shape[1]} series")
    ax.set_xlabel(f"value, in units of 1e{exponent}" if exponent else "value")
    _save(fig, path)


def _draw_heatmap(title, x, chains, path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    cols = _pick(len(x), 1000)
    data = chains[cols].T
    exponent = scale_exponent(data)
    if exponent:
        data = data / 10.0**exponent
    masked = np.ma.masked_invalid(data)
    extent = (float(x[0]) - 0.5, float(x[-1]) + 0.5, data.shape[0] - 0.5, -0.5)
    image = ax.imshow(masked, aspect="auto", interpolation="nearest", extent=extent)
    bar = fig.colorbar(image, ax=ax)
    if exponent:
        bar.set_label(f"in units of 1e{exponent}")
    from matplotlib.ticker import MaxNLocator

    what = ("process", "processes") if title in LAG_BY_PROCESS else ("series",) * 2
    _title(fig, title, ax, f": {data.shape[0]} {what[1]}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(what[0])
    _save(fig, path)


def _draw_layers(title, x, data, labels, path: Path) -> None:
    """A family of watch entries as a heatmap: one row per entry (layer, leaf
    or group), steps across; a log colour scale where the values are positive
    and span more than two decades; at most 40 row labels."""
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    rows = data.shape[0]
    height = max(SIZE[1], min(14.0, 1.6 + 0.055 * rows))
    fig = _figure()
    fig.set_size_inches(SIZE[0], height)
    longest = max(len(_shown(label)[-32:]) for label in labels)
    fig.subplots_adjust(  # room for the row labels, at 7 points
        left=min(0.3, 0.05 + 0.0085 * longest),
        right=0.9,
        top=1 - 0.45 / height,
        bottom=0.55 / height,
    )
    ax = fig.add_subplot()
    cols = _pick(len(x), 1000)
    shown = np.ma.masked_invalid(data[:, cols])
    finite = data[np.isfinite(data)]
    norm = None
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > 100:
        norm = LogNorm(vmin=float(finite.min()), vmax=float(finite.max()))
    extent = (float(x[0]) - 0.5, float(x[-1]) + 0.5, rows - 0.5, -0.5)
    image = ax.imshow(
        shown, aspect="auto", interpolation="nearest", extent=extent, norm=norm
    )
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    ticks = _pick(rows, 40)
    ax.set_yticks(ticks)
    ax.set_yticklabels([_shown(labels[i])[-32:] for i in ticks], fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _title(fig, title, ax, f" ({rows} entries)")
    ax.set_xlabel("step")
    _save(fig, path)


def to_png(
    state: HistoryState,
    outdir: str | os.PathLike,
    warmup: float = 0,
    num_chains: int = 128,
    progress=None,
) -> list[Path]:
    """Draws one PNG per metric into ``outdir``; returns the paths written.

    Each plot has the real steps on x. A metric with cross-device statistics
    (``name/mean|max|min|std``) is drawn as its mean with a ±std band and a
    min-max band (and the raw ``name`` if recorded too); other metrics as a line,
    with NaN as gaps. Series longer than about 5,000 points are reduced for
    drawing (per-bucket min and max, so spikes stay visible); the data are not.
    An array metric (per device, per chain) gets its mean with a min-max band,
    plus a ridge plot of its distribution at a few steps and a heatmap, over up to
    ``num_chains`` of its series (``{stem}.ridge.png``, ``{stem}.heatmap.png``).
    File stems come from :func:`~jaxhistory.export._units.plot_stems`, no two
    alike. Uses matplotlib's Agg renderer on figures of its own: pyplot, the
    backend and ``rcParams`` are left alone.
    ``progress``, if given, is called with each finished path.
    """
    return start_png(state, outdir, warmup, num_chains, progress).wait()


def start_png(
    state: HistoryState,
    outdir: str | os.PathLike,
    warmup: float = 0,
    num_chains: int = 128,
    progress=None,
    units: list[PlotUnit] | None = None,
    families: Sequence[LayerFamily] = (),
    marks: dict[str, list[int]] | None = None,
) -> PendingPlots:
    """:func:`to_png`, returning at once with the plots being drawn (in worker
    processes when there are many); ``.wait()`` returns the paths. ``units``
    (of :func:`plot_units`) draws only those; each of ``families`` (of
    :func:`layer_families`) is drawn as a heatmap, ``{stem}.layers.png``
    (numbered where a metric's plot has that name, as :func:`plot_stems` says);
    ``marks`` (metric -> steps) draws a dashed line at each step on the plots
    of those metrics (where a sentinel fired)."""
    if not isinstance(num_chains, int) or num_chains < 1:
        raise ValueError(f"num_chains must be a positive int, got {num_chains!r}")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    first = state.first_kept_step(warmup)
    units = plot_units(state) if units is None else units
    stems = plot_stems(units, families)
    # (kind, arguments, path): the data read here, drawn anywhere
    jobs: list[tuple[str, tuple, Path]] = []
    layers = {}  # family total -> the path of its heatmap
    owners = {}  # path -> the unit it draws (its own plot, ridge or heatmap)
    marks = marks or {}
    for unit, stem, extras in zip(units, stems.units, stems.extras, strict=True):
        data = {name: series(state, name, first) for name in unit.names}
        steps = sorted({s for n in unit.names for s in marks.get(n, ()) if s >= first})
        jobs.append(("unit", (data, unit, steps), outdir / f"{stem}.png"))
        owners[outdir / f"{stem}.png"] = unit
        if unit.raw is not None and state.shape(unit.raw):
            x, y = data[unit.raw]
            if len(x):
                chains = y.reshape(len(y), -1)
                chains = chains[:, _pick(chains.shape[1], num_chains)]
                for kind in ARRAY_PLOTS:
                    args: tuple = (unit.title, x, chains)
                    jobs.append((kind, args, outdir / f"{extras[kind]}.png"))
                    owners[outdir / f"{extras[kind]}.png"] = unit
    for family in families:
        x, matrix = family_matrix(state, family, first)
        if len(x):
            args = (family.title, x, matrix, family.labels)
            layers[family.total] = outdir / f"{stems.layers[family.total]}.png"
            jobs.append(("layers", args, layers[family.total]))
    return PendingPlots(jobs, progress, layers, owners)


PARALLEL_FROM = 48  # plots; fewer are drawn in this process
# The folder holding the jaxhistory package, and what a worker runs: argv[1] is
# that folder, argv[2] the job file.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
WORKER = (
    "import sys\n"
    "root = sys.argv[1]\n"
    "if root not in sys.path:\n"
    "    sys.path.append(root)\n"
    "from jaxhistory.export._draw_worker import main\n"
    "sys.exit(main(sys.argv[2]))\n"
)
_DRAW: dict[str, Callable[..., None]] = {
    "unit": _draw_unit,
    "ridge": _draw_ridge,
    "heatmap": _draw_heatmap,
    "layers": _draw_layers,
}


def draw_job(job: tuple) -> Path:
    """Draws one job of :func:`start_png` (``(kind, arguments, path)``); returns
    its path."""
    kind, args, path = job
    _DRAW[kind](*args, path)
    return path


class PendingPlots:
    """Plots being drawn: in worker processes (one per core, at most 8) when
    there are many (a figure costs tens of milliseconds of pure Python, so
    1,000 metrics would take a minute on one core), so the caller can do other
    work meanwhile; :meth:`wait` returns the paths once all are written.
    ``units`` maps each path of a unit's plots to that unit (two units may
    share a title: a metric named ``loss: train vs eval`` beside that
    comparison);
    ``layers`` maps the total of each watch family drawn to its heatmap's path."""

    def __init__(self, jobs: list[tuple], progress=None, layers=None, units=None):
        self.jobs, self.progress = jobs, progress
        self.layers: dict[str, Path] = dict(layers or {})
        self.units: dict[Path, PlotUnit] = dict(units or {})
        self._procs: list = []
        self._tmp = None
        workers = min(os.cpu_count() or 1, 8)
        if len(jobs) < PARALLEL_FROM or workers < 2:
            return
        # Worker processes started afresh, never forked (the parent runs JAX's
        # threads) nor spawned by multiprocessing (that re-runs the caller's
        # script, which need not guard it with __main__). Isolated (-I): the
        # working folder, PYTHON* variables and user site-packages are not on
        # their path, so a pickle.py where the user runs is never imported; the
        # folder this package was imported from is added (after the standard
        # library).
        self._tmp = tempfile.TemporaryDirectory(prefix="jaxhistory-plots-")
        for i in range(workers):
            job_file = Path(self._tmp.name) / f"jobs{i}.pickle"
            job_file.write_bytes(pickle.dumps(jobs[i::workers]))
            out = open(job_file.with_suffix(".out"), "w+")  # noqa: SIM115
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", WORKER, PACKAGE_ROOT, job_file],
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            except OSError:  # no interpreter to start: wait() draws them here
                out.close()
                continue
            self._procs.append((proc, out))

    def cancel(self) -> None:
        """Stops the workers and removes their files (a finalize that failed)."""
        for proc, out in self._procs:
            proc.kill()
            proc.wait()
            out.close()
        self._procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def wait(self) -> list[Path]:
        drawn: set[str] = set()
        for proc, out in self._procs:
            proc.wait()
            out.seek(0)
            for line in out.read().splitlines():
                drawn.add(line)
                if self.progress:
                    self.progress(Path(line))
            out.close()
        self._procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        # Inline, or what a failed worker left: drawn here (raising what the
        # worker would have raised).
        for job in self.jobs:
            if str(job[2]) not in drawn:
                draw_job(job)
                if self.progress:
                    self.progress(job[2])
        return [job[2] for job in self.jobs]
