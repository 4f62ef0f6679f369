"""What gets one plot: a metric, or a metric's cross-device statistics together."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jaxhistory._names import PROVENANCE, STATS, aggregated_names

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = ["MAX_POINTS", "PlotUnit", "bucket", "plot_units", "row_stats", "series"]

MAX_POINTS = 5000  # longer series are reduced (for drawing only) to about this
# Plots finalize draws by default: a figure costs about 0.1 s of CPU, so 1,000
# metrics would take most of a minute; the rest are summarised in the report.
MAX_PLOTS = 200


@dataclasses.dataclass(frozen=True)
class PlotUnit:
    """One plot. ``stats`` maps mean/max/min/std to metric names (may be empty);
    ``raw`` is the metric drawn as is (None when only statistics exist);
    ``others`` are ``(label, metric)`` lines drawn over them (train vs eval)."""

    title: str
    raw: str | None
    stats: dict[str, str]
    others: tuple[tuple[str, str], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        named = (self.raw, *self.stats.values(), *(n for _, n in self.others))
        return tuple(n for n in named if n is not None)


# Prefixes of metrics compared with ``train/...`` on one plot.
EVAL_PREFIXES = ("eval/", "val/", "valid/", "validation/", "test/")


def plot_units(state: HistoryState) -> list[PlotUnit]:
    """Plots for every metric of ``state``, in the order metrics were first recorded.

    ``name/mean``, ``name/max``, ``name/min`` and ``name/std`` share one plot
    (titled ``name``, with the metric ``name`` itself as its raw line if recorded);
    the group's device indices (:data:`~jaxhistory.PROVENANCE`) are not plotted.
    """
    keys = state.keys
    grouped = aggregated_names(keys)
    units, done = [], set()
    for name in keys:
        if name in done:
            continue
        if name in grouped:
            base = name.rpartition("/")[0]
            stats = {s: f"{base}/{s}" for s in STATS}
            raw = base if base in keys and base not in grouped else None
            units.append(PlotUnit(base, raw, stats))
            done.update(stats.values())
            done.update(f"{base}/{s}" for s in PROVENANCE)  # in the report
            if raw:
                done.add(raw)
        elif f"{name}/mean" in grouped:
            continue  # drawn with its statistics
        else:
            units.append(PlotUnit(name, name, {}))
            done.add(name)
    return _with_comparisons(state, units)


def _with_comparisons(state: HistoryState, units: list[PlotUnit]) -> list[PlotUnit]:
    """``units`` with, before each ``train/X``, a plot of ``train/X`` and
    ``eval/X`` (``val/X``, ``test/X``, ...) together: the comparison everybody
    wants. Scalar metrics only."""
    by_title = {u.title: u for u in units}

    def scalar(u: PlotUnit) -> bool:
        return all(not state.shape(n) for n in u.names)

    out = []
    for u in units:
        if u.title.startswith("train/") and scalar(u):
            suffix = u.title[len("train/") :]
            others = []
            for prefix in EVAL_PREFIXES:
                other = by_title.get(prefix + suffix)
                if other is not None and scalar(other):
                    others.append((prefix[:-1], other.stats.get("mean") or other.raw))
            if others:
                versus = " and ".join(label for label, _ in others)
                title = f"{suffix}: train vs {versus}"
                out.append(PlotUnit(title, u.raw, u.stats, tuple(others)))
        out.append(u)
    return out


def capped(
    units: list[PlotUnit], max_plots: int | None
) -> tuple[list[PlotUnit], list[PlotUnit]]:
    """(the units to draw, those left out) under a cap of ``max_plots`` (None:
    no cap). Metrics with cross-device statistics come first, then the others
    in recording order; both lists keep recording order."""
    if max_plots is not None and (
        isinstance(max_plots, bool) or not isinstance(max_plots, int) or max_plots < 0
    ):
        raise ValueError(f"max_plots must be an int >= 0 or None, got {max_plots!r}")
    if max_plots is None or len(units) <= max_plots:
        return list(units), []
    ranked = sorted(range(len(units)), key=lambda i: (not units[i].stats, i))
    chosen = set(ranked[:max_plots])
    return (
        [u for i, u in enumerate(units) if i in chosen],
        [u for i, u in enumerate(units) if i not in chosen],
    )


MARKERS_UP_TO = 50  # points: a series this short is drawn with markers
DECADES = 3  # a positive series spanning this many decades gets a log axis


def constant(y: np.ndarray) -> float | None:
    """The value of a series of 2 or more records whose finite values are all
    one value (a learning rate held fixed), else None."""
    if y.ndim != 1 or len(y) < 2:
        return None
    finite = y[np.isfinite(y)]
    if finite.size < 2 or finite.size != y.size or finite.min() != finite.max():
        return None
    return float(finite[0])


def log_scale(*ys: np.ndarray) -> bool:
    """Whether positive series span :data:`DECADES` decades or more."""
    finite = [y[np.isfinite(y)] for y in ys]
    values = np.concatenate(finite) if finite else np.empty(0)
    if values.size < 2 or values.min() <= 0:
        return False
    return values.max() / values.min() >= 10.0**DECADES


def unit_label(name: str) -> str | None:
    """The y axis label a metric's name implies: timings and ``*_sec`` in
    seconds, ``*_per_sec`` as a rate, ``*mfu`` as a fraction of the peak."""
    parts = name.split("/")
    last = parts[-1]
    if last.endswith("_per_sec"):
        return f"{last.removesuffix('_per_sec')} per second"
    if "timing" in parts[:-1] or last.endswith(("_sec", "_seconds")):
        return "seconds"
    if last == "mfu":
        return "fraction of peak FLOP/s"
    return None


def bucket(x: np.ndarray, y: np.ndarray, how: str, n: int = MAX_POINTS):
    """Reduces a long series to about ``n`` points for drawing.

    Consecutive points are grouped into buckets; ``how`` ("mean", "min", "max" or
    "envelope": the min and the max of each bucket, in turn) says what each bucket
    keeps; an all-NaN bucket stays NaN, so gaps still show.
    """
    if len(x) <= n:
        return x, y
    per = int(np.ceil(len(x) / (n // 2 if how == "envelope" else n)))
    pad = (-len(x)) % per
    xb = np.concatenate([x.astype(np.float64), np.full(pad, np.nan)]).reshape(-1, per)
    yb = np.concatenate([y.astype(np.float64), np.full(pad, np.nan)]).reshape(-1, per)
    empty = np.all(np.isnan(yb), axis=1)
    yb = np.where(empty[:, None], 0.0, yb)
    with np.errstate(invalid="ignore"):
        xs = np.nanmean(xb, axis=1)
        if how == "envelope":
            lo, hi = np.nanmin(yb, axis=1), np.nanmax(yb, axis=1)
            lo[empty] = hi[empty] = np.nan
            return np.repeat(xs, 2), np.stack([lo, hi], axis=1).reshape(-1)
        out = {"mean": np.nanmean, "min": np.nanmin, "max": np.nanmax}[how](yb, axis=1)
    out[empty] = np.nan
    return xs, out


def series(state: HistoryState, name: str, first: int):
    """(steps, float64 values) of ``name`` from step ``first`` on (steps sorted)."""
    steps, values = state._records(name)
    cut = int(np.searchsorted(steps, first))
    return steps[cut:], np.asarray(values[cut:], np.float64)


def row_stats(values: np.ndarray):
    """Mean, min and max of each record's finite elements (NaN where none is)."""
    flat = values.reshape(len(values), -1)
    finite = np.isfinite(flat)
    count = finite.sum(axis=1)
    none = count == 0
    mean = np.where(finite, flat, 0.0).sum(axis=1) / np.maximum(count, 1)
    lo = np.where(finite, flat, np.inf).min(axis=1, initial=np.inf)
    hi = np.where(finite, flat, -np.inf).max(axis=1, initial=-np.inf)
    for out in (mean, lo, hi):
        out[none] = np.nan
    return mean, lo, hi
