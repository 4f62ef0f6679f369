"""Run-level statistics of one metric's recorded values (what
:meth:`HistoryState.summary <jaxhistory.HistoryState.summary>` reports)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["SUMMARY_STATS", "column_summary"]

SUMMARY_STATS = (
    "mean",
    "std",
    "median",
    "p10",
    "p90",
    "min",
    "max",
    "last",
    "count",
    "nonfinite",
)


def column_summary(values: np.ndarray) -> dict[str, float]:
    """Mean, std, median, p10, p90, min and max of the finite values (all
    elements of array metrics), the last value (the last record's mean for
    arrays), how many values there are and how many are NaN or infinite.
    Integers keep their min, max and last value exactly (Python ints), where
    float64 would round them past 2**53."""
    stats = _float_summary(np.asarray(values, np.float64))
    ints = np.asarray(values)
    if ints.dtype.kind in "iu" and ints.size:
        flat = ints.reshape(-1)
        low, high = (flat[0], flat[0]) if flat.size == 1 else (flat.min(), flat.max())
        stats.update(min=int(low), max=int(high))
        if ints.ndim == 1:
            stats["last"] = int(flat[-1])
    return stats


def _float_summary(values: np.ndarray) -> dict[str, float]:
    flat = values.reshape(-1)
    stats = dict.fromkeys(SUMMARY_STATS, math.nan)
    if flat.size == 1:  # one value (a metric per sample): no NumPy calls
        v = float(flat[0])
        if math.isfinite(v):
            stats.update(mean=v, std=0.0, median=v, p10=v, p90=v, min=v, max=v)
        stats.update(last=v, count=1, nonfinite=int(not math.isfinite(v)))
        return stats
    finite = flat[np.isfinite(flat)]
    if finite.size:
        with np.errstate(over="ignore", invalid="ignore"):
            spread = _spread(finite)
            if not all(map(math.isfinite, spread)):  # sums past float64's range:
                e = int(np.frexp(np.abs(finite).max())[1])  # scaled by 2**-e, exact
                spread = [float(np.ldexp(v, e)) for v in _spread(np.ldexp(finite, -e))]
        mean, std, p10, median, p90 = spread
        stats.update(
            mean=mean,
            std=std,
            median=median,
            p10=p10,
            p90=p90,
            min=float(finite.min()),
            max=float(finite.max()),
        )
    if len(values):
        last = values[-1]  # a scalar metric's as recorded (np.mean drops -0.0's sign)
        stats["last"] = float(last if last.ndim == 0 else _mean(last))
    stats["count"] = int(flat.size)
    stats["nonfinite"] = int(flat.size - finite.size)
    return stats


def _mean(values: np.ndarray) -> float:
    """The mean of one record of an array metric, without NumPy's warnings
    (inf and -inf together are NaN); finite values whose sum passes float64's
    range are scaled by a power of two first, exactly."""
    with np.errstate(over="ignore", invalid="ignore"):
        mean = float(np.mean(values))
        if not math.isfinite(mean) and np.isfinite(values).all():
            e = int(np.frexp(np.abs(values).max())[1])
            mean = float(np.ldexp(np.mean(np.ldexp(values, -e)), e))
    return mean


def _spread(finite: np.ndarray) -> list[float]:
    """Mean, std, p10, median and p90 of finite values."""
    return [float(finite.mean()), float(finite.std())] + [
        float(v) for v in np.percentile(finite, [10, 50, 90])
    ]
