"""Terminal plots with plotext 6.x: one ``.txt`` per metric, and summary plots.

Settings come from the environment:

==============================  ============================================
``JAXHISTORY_TPLOT_MARKER``     marker of the main series: ``braille``
                                (default), ``hd``, ``fhd``, ``dot`` or any
                                single character
``JAXHISTORY_TPLOT_RAW_MARKER`` marker of the raw series drawn under
                                cross-device statistics (default ``·``)
``JAXHISTORY_TPLOT_TYPE``       ``line`` (default) or ``hist``
``JAXHISTORY_TPLOT_MAX_HEIGHT`` rows at most (default 24)
``JAXHISTORY_TPLOT_MAX_WIDTH``  columns at most (default 100)
==============================  ============================================

Plots are as large as the maxima, or the terminal when it is smaller.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from jaxhistory._optional import import_optional
from jaxhistory.export._units import (
    PlotUnit,
    bucket,
    constant_unit,
    family_matrix,
    plot_stems,
    plot_units,
    printable,
    row_stats,
    scale_exponent,
    series,
    shortened,
)

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["settings", "summary_plots", "to_terminal"]

NAMED_MARKERS = {"braille", "hd", "fhd", "dot", "sd"}
STAT_MARKERS = {"mean": "·", "min": "-", "max": "+", "std": "*"}
SUMMARY_FALLBACK = 4  # plots printed when no metric has cross-device statistics


def _env_int(name: str, default: int, low: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")
    return value


def _env_marker(name: str, default: str) -> str:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text in NAMED_MARKERS or len(text) == 1:
        return text
    raise ValueError(
        f"{name} must be one of {', '.join(sorted(NAMED_MARKERS))} or a single "
        f"character, got {text!r}"
    )


def settings() -> dict:
    """The terminal-plot settings from the environment (ValueError if invalid)."""
    kind = os.environ.get("JAXHISTORY_TPLOT_TYPE", "").strip().lower() or "line"
    if kind not in ("line", "hist"):
        raise ValueError(f"JAXHISTORY_TPLOT_TYPE must be line or hist, got {kind!r}")
    size = shutil.get_terminal_size((10_000, 10_000))
    return {
        "marker": _env_marker("JAXHISTORY_TPLOT_MARKER", "braille"),
        "raw_marker": _env_marker("JAXHISTORY_TPLOT_RAW_MARKER", "·"),
        "type": kind,
        "height": min(_env_int("JAXHISTORY_TPLOT_MAX_HEIGHT", 24, 8), size.lines),
        "width": min(_env_int("JAXHISTORY_TPLOT_MAX_WIDTH", 100, 30), size.columns),
    }


def _figure(width: int, height: int):
    plt = import_optional("plotext", "to_terminal")
    terminal = type(plt.terminal)()  # our own: plotext's global state is left alone
    terminal.limit(False, False)  # sizes are ours, not clamped to a terminal
    fig = type(plt.figure)(parent=terminal)
    fig.plot_size(width, height)
    return plt, fig


def _add_line(
    fig, label: str, x: np.ndarray, y: np.ndarray, marker: str, yside=None
) -> bool:
    """Draws a finite-only line with gaps where points are not finite."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    idx = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if not idx.size:
        return False
    # plotext aborts the process on NaN in a connected series: never pass one.
    # No plotext legend: its box covers the first tenth of the data (the legend
    # is a line under the plot instead, see render).
    series = fig.signal(x[idx].tolist(), y[idx].tolist(), marker=marker, yside=yside)
    series = series.lines()
    for k in np.flatnonzero(np.diff(idx) > 1) + 1:
        series.line(int(k), False)
    fig.draw(series)
    return True


def _render(
    plt,
    fig,
    title: str,
    xs: list[np.ndarray],
    xlabel: str = "step",
    legend=(),
    width: int = 100,
) -> str:
    # plotext draws no title wider than the plot: a long one is shortened
    fig.title(shortened(printable(title), width))
    fig.label(xlabel, "x")
    allx = np.concatenate(xs) if xs else np.empty(0)
    allx = allx[np.isfinite(allx)]
    if allx.size:  # steps: whole-number ticks, however few
        lo, hi = np.floor(allx.min()), np.ceil(allx.max())
        ticks = sorted({round(float(v)) for v in np.linspace(lo, hi, 5)})
        fig.ruler("x").ticks(ticks, [str(t) for t in ticks])
    text = plt.uncolorize(fig.build().string(colorless=True)).rstrip() + "\n"
    if len(legend) > 1:  # which marker is which line, under the plot
        shown = "   ".join(
            f"{'⠿' if m in NAMED_MARKERS else m} {printable(n)}" for m, n in legend
        )
        text += f"    {shown}\n"
    return text


def _series(state, name, first):
    x, y = series(state, name, first)
    return x, (row_stats(y)[0] if y.ndim > 1 else y)


def render(state: HistoryState, unit: PlotUnit, first: int, opts: dict) -> str:
    """The text of one plot (see the module doc for the settings). Names are
    shown with control characters escaped; a plot whose lines are all one value
    is that value in a line; values beyond ±1e300 are drawn divided by a power
    of ten, which the title names."""
    plt, fig = _figure(opts["width"], opts["height"])
    shown = printable(unit.title)
    points = 4 * opts["width"]
    xs = []
    drawn = False
    legend = []
    if opts["type"] == "hist":
        name = cast(str, unit.stats.get("mean") or unit.raw)  # one of them is set
        values = series(state, name, first)[1].reshape(-1)
        values = values[np.isfinite(values)]
        exponent = scale_exponent(values)
        values = values / 10.0**exponent if exponent else values
        if values.size:
            fig.draw(fig.hist(values.tolist(), bins=min(40, opts["width"] // 2)))
            drawn = True
        title = f"{shown} (histogram of {'mean' if unit.stats else 'values'})"
        xlabel = f"value, in units of 1e{exponent}" if exponent else "value"
        text = _render(plt, fig, title, [], xlabel=xlabel, width=opts["width"])
        return text if drawn else f"{title}: no finite values recorded\n"
    data = {name: _series(state, name, first) for name in unit.names}
    value = constant_unit(unit, data)
    if value is not None:  # a value, not a flat line at a 0.0 tick
        x = data[unit.names[0]][0]
        return (
            f"{shown}: constant {value:.6g} over {len(x)} records "
            f"(steps {int(x[0])} to {int(x[-1])})\n"
        )
    exponent = scale_exponent(*(y for _, y in data.values()))
    if exponent:
        data = {n: (x, y / 10.0**exponent) for n, (x, y) in data.items()}
    title = f"{unit.title} (in units of 1e{exponent})" if exponent else unit.title
    if unit.raw is not None:
        x, y = data[unit.raw]
        xb, yb = bucket(x, y, "envelope", points)
        marker = opts["raw_marker"] if unit.stats else opts["marker"]
        if _add_line(fig, unit.raw, xb, yb, marker):
            drawn = True
            legend.append((marker, "train" if unit.others else unit.raw))
        xs.append(xb)
    # the mean drawn last, on top of the min, max and std it lies among; the
    # legend in STAT_MARKERS' order
    stats_legend = {}
    for stat in sorted(STAT_MARKERS, key=lambda stat: stat == "mean"):
        marker = STAT_MARKERS[stat]
        if stat in unit.stats:
            x, y = data[unit.stats[stat]]
            how = stat if stat in ("min", "max") else "mean"
            xb, yb = bucket(x, y, how, points)
            # std on an axis of its own (right): on the values' axis it is a
            # flat line at the bottom
            side = "right" if stat == "std" else None
            if _add_line(fig, stat, xb, yb, marker, side):
                drawn = True
                name = f"train {stat}" if unit.others else stat
                stats_legend[stat] = (
                    marker,
                    f"{name} (right axis)" if side else name,
                )
            xs.append(xb)
    legend += [stats_legend[stat] for stat in STAT_MARKERS if stat in stats_legend]
    for label, name in unit.others:
        x, y = data[name]
        xb, yb = bucket(x, y, "envelope", points)
        if _add_line(fig, label, xb, yb, "x"):
            drawn = True
            legend.append(("x", label))
        xs.append(xb)
    if not drawn:
        return f"{shown}: no finite values recorded\n"
    return _render(plt, fig, title, xs, legend=legend, width=opts["width"])


def to_terminal(
    state: HistoryState,
    outdir: str | os.PathLike,
    warmup: float = 0,
    progress=None,
) -> dict[Path, str]:
    """Writes one plotext plot per metric to ``{outdir}/{stem}.txt``.

    Returns ``{path: text}``. A metric with cross-device statistics gets a summary
    plot overlaying its mean (``·``), min (``-``), max (``+``) and std (``*``),
    and its raw values (``JAXHISTORY_TPLOT_RAW_MARKER``) if recorded; other
    metrics one line (``JAXHISTORY_TPLOT_MARKER``); array metrics the mean over
    their elements. NaN and infinities are gaps. ``JAXHISTORY_TPLOT_TYPE=hist``
    draws histograms of the values instead. Plain text, no colour codes.
    """
    return {path: text for _, path, text in write_all(state, outdir, warmup, progress)}


def write_all(state, outdir, warmup=0, progress=None, units=None):
    """to_terminal's work: ``[(unit, path, text)]`` for every plot written
    (of ``units``, by default every metric's)."""
    opts = settings()
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    first = state.first_kept_step(warmup)
    units = plot_units(state) if units is None else units
    stems = plot_stems(units).units
    out = []
    for unit, stem in zip(units, stems, strict=True):
        path = outdir / f"{stem}.txt"
        text = render(state, unit, first, opts)
        path.write_text(text, encoding="utf-8")
        out.append((unit, path, text))
        if progress:
            progress(path)
    return out


SHADES = " .:-=+*#%@"  # low to high


def layers_text(
    title: str,
    x: np.ndarray,
    data: np.ndarray,
    labels,
    width: int = 72,
    height: int = 40,
) -> str:
    """A family of watch entries as a text heatmap: one line per entry (entries
    binned into at most ``height`` lines, each showing its bin's largest
    value), steps binned into at most ``width`` columns (their mean), shades
    from ``SHADES`` on a log scale where the values are positive and span more
    than two decades; ``?`` where there is no finite value."""
    rows, n = data.shape
    row_bins = np.array_split(np.arange(rows), min(rows, height))
    col_bins = np.array_split(np.arange(n), min(n, width))
    grid = np.full((len(row_bins), len(col_bins)), np.nan)
    with np.errstate(all="ignore"):
        finite = np.where(np.isfinite(data), data, np.nan)
        for i, rb in enumerate(row_bins):
            block = finite[rb]
            for j, cb in enumerate(col_bins):
                cell = block[:, cb]
                if np.isfinite(cell).any():
                    grid[i, j] = np.nanmax(np.nanmean(cell, axis=1))
    values = grid[np.isfinite(grid)]
    log = bool(values.size) and values.min() > 0 and values.max() / values.min() > 100
    scaled = np.log10(grid) if log else grid
    lo, hi = (np.nanmin(scaled), np.nanmax(scaled)) if values.size else (0.0, 1.0)
    span = hi - lo if hi > lo else 1.0
    names = []
    for rb in row_bins:
        first, last = printable(labels[rb[0]]), printable(labels[rb[-1]])
        if len(rb) == 1:
            names.append(first)
        else:  # layers/kernel/100..109: the shared folder once
            pairs = zip(first, last, strict=False)
            same = next(
                (i for i, (a, b) in enumerate(pairs) if a != b),
                min(len(first), len(last)),
            )
            cut = first.rfind("/", 0, same) + 1
            names.append(f"{first}..{last[cut:]}")
    pad = min(max(len(t) for t in names), 36)
    lines = [f"{printable(title)} ({rows} entries)"]
    for name, row in zip(names, scaled, strict=True):
        cells = "".join(
            "?"
            if not np.isfinite(v)
            else SHADES[min(int((v - lo) / span * len(SHADES)), len(SHADES) - 1)]
            for v in row
        )
        lines.append(f"{name[-pad:]:>{pad}} |{cells}|")
    lines.append(f"{'':>{pad}}  step {x[0]:g} .. {x[-1]:g}")
    low = 10**lo if log else lo
    high = 10**hi if log else hi
    scale = "log" if log else "linear"
    lines.append(
        f"{'':>{pad}}  '{SHADES[0]}' {low:.3g} .. '{SHADES[-1]}' {high:.3g} "
        f"({scale} scale; '?': no finite value)"
    )
    return "\n".join(lines) + "\n"


def write_layers(state, outdir, warmup, families, units=()) -> list[tuple]:
    """A text heatmap of each watch family (:func:`layers_text`):
    ``[(family, path, text)]``, written as ``{stem}.layers.txt`` beside the
    plots of ``units`` (numbered where one of those has that name, as
    :func:`~jaxhistory.export._units.plot_stems` says: the same name as the
    family's PNG heatmap)."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    first = state.first_kept_step(warmup)
    stems = plot_stems(units, families).layers
    out = []
    for family in families:
        x, data = family_matrix(state, family, first)
        if not len(x):
            continue
        text = layers_text(family.title, x, data, family.labels)
        path = outdir / f"{stems[family.total]}.txt"
        path.write_text(text, encoding="utf-8")
        out.append((family, path, text))
    return out


def summary_choice(units: list[PlotUnit]) -> list[PlotUnit]:
    """Every plot with cross-device statistics, or else the first four."""
    return [u for u in units if u.stats] or units[:SUMMARY_FALLBACK]


def summary_plots(state: HistoryState, warmup: float = 0) -> dict[str, str]:
    """The plots finalize prints: every metric with cross-device statistics, or,
    when there are none, the first four metrics."""
    opts = settings()
    first = state.first_kept_step(warmup)
    return {
        u.title: render(state, u, first, opts)
        for u in summary_choice(plot_units(state))
    }
