"""What gets one plot: a metric, or a metric's cross-device statistics together."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from jaxhistory._names import (
    PROVENANCE,
    STATS,
    WATCH_STATS,
    aggregated_names,
    file_stems,
    printable,
)

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = [
    "MAX_POINTS",
    "QUANTILE",
    "LayerFamily",
    "PlotStems",
    "PlotUnit",
    "bucket",
    "constant",
    "constant_unit",
    "family_matrix",
    "layer_families",
    "log_scale",
    "plot_stems",
    "plot_units",
    "printable",
    "quantile_keys",
    "row_stats",
    "same_value",
    "scale_exponent",
    "series",
    "shortened",
    "unit_label",
]

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


QUANTILE = re.compile(r"p\d+(\.\d+)?")  # a quantile's row: p50, p99.9


def quantile_keys(stats: dict[str, str]) -> list[str]:
    """The quantile rows of a unit's statistics, lowest first."""
    found = [k for k in stats if QUANTILE.fullmatch(k)]
    return sorted(found, key=lambda k: float(k[1:]))


class LayerFamily(NamedTuple):
    """The entries of one :func:`~jaxhistory.watch` statistic (``norm``, ...)
    under one prefix, drawn together as a heatmap (entry x step): the
    entries' labels (their paths, in natural order: ``layers/2`` before
    ``layers/10``) and metric names, and the total's metric name."""

    prefix: str
    stat: str
    labels: tuple[str, ...]
    names: tuple[str, ...]
    total: str

    @property
    def title(self) -> str:
        return (
            f"{self.prefix}: {self.stat} per entry"
            if self.prefix
            else (f"{self.stat} per entry")
        )


def _natural(text: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def layer_families(keys: Sequence[str], min_rows: int = 3) -> list[LayerFamily]:
    """The watch statistics of ``keys`` with at least ``min_rows`` entries:
    ``{prefix}/{path}/{stat}`` beside a total ``{prefix}/{stat}`` (``{stat}``
    with no prefix), ``stat`` one of :data:`~jaxhistory.WATCH_STATS`."""
    present = set(keys)
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for name in keys:
        base, _, stat = name.rpartition("/")
        if stat not in WATCH_STATS or not base:
            continue
        parts = base.split("/")
        for cut in range(len(parts) - 1, -1, -1):
            prefix = "/".join(parts[:cut])
            if (f"{prefix}/{stat}" if prefix else stat) in present:
                entry = "/".join(parts[cut:])
                found.setdefault((prefix, stat), []).append((entry, name))
                break
    out = []
    for (prefix, stat), rows in found.items():
        if len(rows) >= min_rows:
            rows.sort(key=lambda r: _natural(r[0]))
            labels, names = zip(*rows, strict=True)
            total = f"{prefix}/{stat}" if prefix else stat
            out.append(LayerFamily(prefix, stat, labels, names, total))
    return out


def family_matrix(
    state: HistoryState, family: LayerFamily, first: int
) -> tuple[np.ndarray, np.ndarray]:
    """The steps from ``first`` on and the ``(entries, steps)`` values of a
    family (NaN where an entry has no record at a step)."""
    parts = [series(state, name, first) for name in family.names]
    x = parts[0][0]
    if not all(np.array_equal(p[0], x) for p in parts):
        x = np.unique(np.concatenate([p[0] for p in parts]))
    data = np.full((len(parts), len(x)), np.nan)
    for i, (steps, values) in enumerate(parts):
        values = np.asarray(values, np.float64).reshape(len(steps), -1)[:, 0]
        data[i, np.searchsorted(x, steps)] = values
    return x, data


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
    units: list[PlotUnit] = []
    done: set[str] = set()
    for name in keys:
        if name in done:
            continue
        if name in grouped:
            base = name.rpartition("/")[0]
            stats = {s: f"{base}/{s}" for s in STATS}
            # its quantiles across devices (distributed_stats(quantiles=...))
            stats.update(
                (n.rpartition("/")[2], n)
                for n in keys
                if n.startswith(f"{base}/p") and QUANTILE.fullmatch(n[len(base) + 1 :])
            )
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
                    # a unit has a mean or a raw line
                    line = cast(str, other.stats.get("mean") or other.raw)
                    others.append((prefix[:-1], line))
            if others:
                versus = " and ".join(label for label, _ in others)
                title = f"{suffix}: train vs {versus}"
                out.append(PlotUnit(title, u.raw, u.stats, tuple(others)))
        out.append(u)
    return out


ARRAY_PLOTS = ("ridge", "heatmap")  # an array metric's plots beside its own


class PlotStems(NamedTuple):
    """The file stems of a set of plots (see :func:`plot_stems`): ``units``, one
    per plot unit in order; ``extras``, per unit, the stems of its
    :data:`ARRAY_PLOTS` (used where the unit is an array metric); ``layers``,
    the stem of each watch family's heatmap by the family's total."""

    units: tuple[str, ...]
    extras: tuple[dict[str, str], ...]
    layers: dict[str, str]


def plot_stems(
    units: Sequence[PlotUnit], families: Sequence[LayerFamily] = ()
) -> PlotStems:
    """A file stem for every plot of ``units`` and ``families``, no two alike
    (also ignoring case), so that no metric name makes two plots share a file
    (``{stem}.png`` in one folder, ``{stem}.txt`` in another).

    A unit's stem is :func:`~jaxhistory._names.file_stems` of its title. Where
    a metric is named like a comparison (``loss: train vs eval``), the metric
    keeps the stem and the comparison takes ``{stem}-1``. An array metric's
    ridge plot and heatmap are ``{stem}.ridge`` and ``{stem}.heatmap``, a watch
    family's heatmap ``{stem of its total}.layers``; each of these, and a
    comparison's stem, becomes ``...-1`` (``-2``, ...) where a metric's plot
    already has it (a metric named ``w.ridge`` beside an array metric ``w``,
    ``grads/norm.layers`` beside the family of ``grads/norm``)."""
    by_title = file_stems(u.title for u in units)
    owner: dict[str, int] = {}  # the unit that keeps its title's stem
    for i, u in enumerate(units):
        j = owner.get(u.title)
        if j is None or (units[j].others and not u.others):
            owner[u.title] = i
    taken = {stem.casefold() for stem in by_title.values()}
    stems = tuple(
        by_title[u.title] if owner[u.title] == i else _free(by_title[u.title], taken)
        for i, u in enumerate(units)
    )
    extras = tuple(
        {kind: _free(f"{stem}.{kind}", taken) for kind in ARRAY_PLOTS} for stem in stems
    )
    totals = file_stems(f.total for f in families)
    layers = {f.total: _free(f"{totals[f.total]}.layers", taken) for f in families}
    return PlotStems(stems, extras, layers)


def _free(stem: str, taken: set[str]) -> str:
    """``stem``, or where it is taken ``{stem}-1`` (``-2``, ...); taken from then on."""
    candidate, i = stem, 1
    while candidate.casefold() in taken:
        candidate, i = f"{stem}-{i}", i + 1
    taken.add(candidate.casefold())
    return candidate


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
DECADES = 3  # a positive series whose middle 90% spans this many decades: log axis
# Values this close count as one (a float32 statistic of one value held on every
# process is off by a few float32 ulps: 0.003 comes back as 0.0030000000261).
RELATIVE_TOLERANCE = 1e-6
# ... where both are float32 values; others are float64 data, which that
# tolerance would flatten (a wall-clock time 1.7e9 + 3 s, a count 1e10 + 1):
# one value to within a few float64 ulps
FLOAT64_TOLERANCE = 1e-12
HUGE = 1e300  # values this large are drawn divided by a power of ten
# Names of schedules, never given a log axis: a cosine decay to ~0 would look
# like a cliff on one.
_SCHEDULE = re.compile(r"(^|[/_.])(lr|learning_rate)$", re.IGNORECASE)


def same_value(lo: float, hi: float, scale: float | None = None) -> bool:
    """Whether ``lo`` and ``hi`` are one value to within
    :data:`RELATIVE_TOLERANCE` of ``scale`` (default: the larger magnitude)
    where float32 holds both, else (float64 data) :data:`FLOAT64_TOLERANCE`."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return False
    if scale is None:
        scale = max(abs(lo), abs(hi))
    with np.errstate(over="ignore"):  # past float32's range: not float32 data
        float32 = float(np.float32(lo)) == lo and float(np.float32(hi)) == hi
    tolerance = RELATIVE_TOLERANCE if float32 else FLOAT64_TOLERANCE
    return bool(abs(hi - lo) <= tolerance * abs(scale))


def constant(y: np.ndarray) -> float | None:
    """The value of a series of 2 or more records whose values are all finite
    and one value to within :data:`RELATIVE_TOLERANCE` (a learning rate held
    fixed, or a float32 statistic of one; two whole numbers only if equal),
    else None. The value is their mean."""
    if y.ndim != 1 or len(y) < 2:
        return None
    if not np.isfinite(y).all():
        return None
    lo, hi = float(y.min()), float(y.max())
    if not same_value(lo, hi) or (lo != hi and lo.is_integer() and hi.is_integer()):
        return None  # (two whole numbers: a count that moved, never one value)
    mean = float(np.mean(y, dtype=np.float64))
    if not same_value(lo, hi, mean if mean else None):
        return None
    return mean


def constant_unit(unit: PlotUnit, data: dict[str, tuple]) -> float | None:
    """The one value of a plot whose every line is that value, else None: a
    metric never changing, or cross-device statistics whose mean, min and max are
    all one value at every step (a host scalar of a multi-process run, its std
    a float32 rounding error). ``data`` maps the unit's names to (steps, values)."""
    if unit.others:
        return None
    names = [unit.raw] if unit.raw is not None else []
    names += [unit.stats[s] for s in ("mean", "min", "max") if s in unit.stats]
    if not names:
        return None
    found = [constant(data[n][1]) for n in names]
    values = [v for v in found if v is not None]
    if len(values) < len(found):
        return None
    lo, hi = min(values), max(values)
    value = values[1] if unit.stats and unit.raw is not None else values[0]
    return value if same_value(lo, hi, value if value else None) else None


def log_scale(*ys: np.ndarray, name: str = "") -> bool:
    """Whether to draw positive series on a log axis.

    Only when every value is positive and the middle 90% of the values (the 5th
    to the 95th percentile) spans :data:`DECADES` decades or more: a loss falling
    exponentially gets one; a cosine schedule decaying to about 0 (a few steps
    near 0, most of them in one or two decades) stays linear, as does anything
    named ``lr`` or ``learning_rate`` (``train/lr``, ``opt_lr``).
    """
    if _SCHEDULE.search(name):
        return False
    finite = [y[np.isfinite(y)] for y in ys]
    values = np.concatenate(finite) if finite else np.empty(0)
    if values.size < 2 or values.min() <= 0:
        return False
    lo, hi = np.percentile(values, [5, 95])
    return bool(hi / lo >= 10.0**DECADES)


def scale_exponent(*ys: np.ndarray) -> int:
    """0, or the power of ten to divide values by for drawing when they are so
    large (beyond :data:`HUGE`) that their spread, or an axis margin, would
    overflow float64 (a metric spanning -1e308 to 1e308)."""
    finite = [np.abs(y[np.isfinite(y)]) for y in ys]
    values = np.concatenate(finite) if finite else np.empty(0)
    if not values.size or values.max() < HUGE:
        return 0
    return int(np.floor(np.log10(values.max())))


def shortened(text: str, width: int) -> str:
    """``text``, or where it is longer than ``width`` characters its start and
    its end around an ellipsis, ``width`` characters in all (the last parts of a
    metric's path tell it from its neighbours)."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return f"{text[:head]}\u2026{text[len(text) - (width - 1 - head) :]}"


def unit_label(name: str) -> str | None:
    """The y axis label a metric's name implies: timings, ``*_sec``,
    ``*_seconds`` and ``straggler/lag`` in seconds, ``*_per_sec`` as
    a rate, ``*mfu`` as a fraction of the peak, ``straggler/process`` as a
    process index."""
    parts = name.split("/")
    last = parts[-1]
    if last.endswith("_per_sec"):
        return f"{last.removesuffix('_per_sec')} per second"
    if "timing" in parts[:-1] or last.endswith(("_sec", "_seconds")):
        return "seconds"
    if "straggler" in parts[:-1] and last == "lag":
        return "seconds"
    if "straggler" in parts[:-1] and last == "process":
        return "process index"
    if last == "mfu":
        return "fraction of peak FLOP/s"
    return None


def bucket(x: np.ndarray, y: np.ndarray, how: str, n: int = MAX_POINTS):
    """Reduces a long series to about ``n`` points for drawing.

    Consecutive points are grouped into buckets; ``how`` ("mean", "min", "max" or
    "envelope": the min and the max of each bucket, in turn) says what each bucket
    keeps, at its mean step (the first and the last bucket at the first and the
    last step); an all-NaN bucket stays NaN, so gaps still show.
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
        # the ends at the first and the last step, not their buckets' middles:
        # the series spans the steps it was recorded at
        xs[0], xs[-1] = x[0], x[-1]
        if how == "envelope":
            lo, hi = np.nanmin(yb, axis=1), np.nanmax(yb, axis=1)
            lo[empty] = hi[empty] = np.nan
            return np.repeat(xs, 2), np.stack([lo, hi], axis=1).reshape(-1)
        reduce: dict[str, Callable[..., np.ndarray]] = {
            "mean": np.nanmean,
            "min": np.nanmin,
            "max": np.nanmax,
        }
        out = reduce[how](yb, axis=1)
    out[empty] = np.nan
    return xs, out


def series(state: HistoryState, name: str, first: int):
    """(steps, float64 values) of ``name`` from step ``first`` on (steps sorted)."""
    steps, values = state.records(name)
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
