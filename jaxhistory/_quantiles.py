"""Quantiles across devices for :func:`~jaxhistory.distributed_stats`.

Two ways, by what a leaf holds:

* **One value per device** (the values are gathered whole already): the exact
  quantile of those values, NumPy's default (linear) rule, at no extra
  collective.
* **More values**: a histogram of each leaf between its min and max (known
  after the first all-reduce), its counts added up in the second (the sum)
  all-reduce with the other sums; bins are log-spaced where a leaf's values are
  positive and span more than three decades, and spaced by ``asinh`` where they
  straddle zero. The quantile is read from the
  cumulative counts, each bin's values taken as evenly spread within it; its
  rank is off by at most the share of values in that bin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "BINS",
    "check_quantiles",
    "exact_quantiles",
    "hist_block",
    "hist_quantiles",
    "histogram",
    "histogram_collective",
]

BINS = 2048  # histogram bins per leaf
LOG_SPAN = 1e3  # max/min above this (all values positive): log-spaced bins


def check_quantiles(quantiles: Any, caller: str) -> tuple[tuple[float, ...], tuple]:
    """The quantiles as floats in (0, 1), and their row names (``p50``,
    ``p99.9``); ValueError naming a bad one."""
    if isinstance(quantiles, int | float):
        quantiles = (quantiles,)
    try:
        qs = tuple(quantiles)
    except TypeError:
        raise TypeError(
            f"{caller}: quantiles must be a sequence of numbers in (0, 1), got "
            f"{quantiles!r:.60}"
        ) from None
    out = []
    for q in qs:
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 < q < 1:
            raise ValueError(
                f"{caller}: quantile {q!r:.30} is not a number strictly between 0 "
                "and 1 (use max and min for 1 and 0)"
            )
        out.append(float(q))
    names = tuple(f"p{100 * q:.10g}" for q in out)
    if len(set(names)) != len(names):
        raise ValueError(f"{caller}: quantiles {qs!r} repeat one")
    return tuple(out), names


def exact_quantiles(v: jax.Array, qs: Sequence[float]) -> jax.Array:
    """``(Q, k)``: the quantiles of each row of ``v`` (``(k, S)``), NumPy's
    linear rule (NaN where a row holds NaN)."""
    return jnp.quantile(v, jnp.asarray(qs, v.dtype), axis=1)


def _scale(x, mx, mn):
    """(t, lo, hi, inverse): the values on the binning scale of each leaf and
    the way back. Log where the values are positive and span more than three
    decades; ``asinh(x / s)`` where they straddle zero (linear near zero,
    logarithmic far from it, so a few huge values on either side do not
    squeeze the rest into one bin; ``s`` is 1e-4 of the largest magnitude);
    linear otherwise."""
    positive = mn > 0
    log = positive & (mx / jnp.where(positive, mn, 1) > LOG_SPAN)
    straddle = (mn < 0) & (mx > 0)
    s = jnp.maximum(jnp.abs(mn), jnp.abs(mx)) * 1e-4
    s = jnp.where(s > 0, s, 1)

    def forward(v):
        safe = jnp.where(v > 0, v, 1)
        return jnp.where(log, jnp.log(safe), jnp.where(straddle, jnp.arcsinh(v / s), v))

    def inverse(t):
        return jnp.where(log, jnp.exp(t), jnp.where(straddle, jnp.sinh(t) * s, t))

    return forward(x), forward(mn), forward(mx), inverse


def hist_block(x: jax.Array, mx: jax.Array, mn: jax.Array, bins: int = BINS):
    """``(k * bins, 1)``: this device's counts of the values of each of the
    ``k`` leaves of ``x`` (``(k, ...)``) per bin between ``mn`` and ``mx``
    (``(k,)``), NaN left out; a block for the sum all-reduce."""
    k = x.shape[0]
    flat = x.reshape(k, -1)
    t, lo, hi, _ = _scale(flat, mx.reshape(k, 1), mn.reshape(k, 1))
    width = jnp.where(hi > lo, hi - lo, 1)
    idx = jnp.clip(jnp.floor((t - lo) / width * bins), 0, bins - 1).astype(jnp.int32)
    keep = ~jnp.isnan(flat)
    rows = jnp.broadcast_to(jnp.arange(k)[:, None], flat.shape)
    counts = jnp.zeros((k, bins), x.dtype).at[rows, idx].add(keep.astype(x.dtype))
    return counts.reshape(k * bins, 1)


def hist_quantiles(
    counts: jax.Array, mx: jax.Array, mn: jax.Array, qs: Sequence[float]
) -> jax.Array:
    """``(Q, k)``: the quantiles read from the all-reduced ``counts`` (``(k,
    bins)``), NumPy's linear rule on ranks, each bin's values evenly spread
    within it; clipped to ``[mn, mx]``."""
    k, bins = counts.shape
    t_mx, t_mn = mx.reshape(k, 1), mn.reshape(k, 1)
    _, lo, hi, inverse = _scale(t_mx, t_mx, t_mn)
    n = jnp.sum(counts, axis=1, keepdims=True)
    cum = jnp.cumsum(counts, axis=1)
    before = cum - counts
    width = (hi - lo) / bins
    out = []
    for q in qs:
        rank = q * (n - 1)  # 0-based position among the sorted values
        # the two neighbours of the rank, each read where its bin puts it
        values = []
        for r in (jnp.floor(rank), jnp.ceil(rank)):
            b = jnp.sum(cum <= r, axis=1, keepdims=True)
            b = jnp.minimum(b, bins - 1)
            c = jnp.take_along_axis(counts, b, axis=1)
            j = r - jnp.take_along_axis(before, b, axis=1)
            pos = lo + (b + (j + 0.5) / jnp.where(c > 0, c, 1)) * width
            values.append(pos)
        frac = rank - jnp.floor(rank)
        t = values[0] + frac * (values[1] - values[0])
        value = inverse(t)
        out.append(jnp.clip(value, t_mn, t_mx).reshape(k))
    return jnp.stack(out)


def _check_histogram(bins: Any, range: Any, log: Any, caller: str) -> tuple:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{caller}: bins must be a positive int, got {bins!r:.30}")
    try:
        lo, hi = (float(v) for v in range)
    except (TypeError, ValueError):
        raise ValueError(
            f"{caller}: range must be (low, high), two numbers, got {range!r:.60}"
        ) from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(
            f"{caller}: range must be two finite numbers, low below high, got "
            f"{range!r:.60}"
        )
    if log not in (True, False):
        raise TypeError(f"{caller}: log must be a bool, got {log!r:.30}")
    if log and lo <= 0:
        raise ValueError(
            f"{caller}: log-spaced bins need a range above 0, got {range!r}"
        )
    return bins, lo, hi, bool(log)


def _local_counts(x: jax.Array, bins: int, lo: float, hi: float, log: bool):
    """This device's counts of ``x`` per bin (NumPy's rule: the last bin
    holds ``high``; values outside the range and NaN left out)."""
    v = jnp.ravel(x).astype(jnp.promote_types(x.dtype, jnp.float32))
    if log:
        t = jnp.log(jnp.where(v > 0, v, jnp.nan))
        t_lo, t_hi = math.log(lo), math.log(hi)
    else:
        t, t_lo, t_hi = v, lo, hi
    keep = (t >= t_lo) & (t <= t_hi)  # False for NaN
    idx = jnp.floor((t - t_lo) / (t_hi - t_lo) * bins)
    idx = jnp.clip(jnp.where(t == t_hi, bins - 1, idx), 0, bins - 1).astype(jnp.int32)
    return jnp.zeros(bins, jnp.float32).at[idx].add(keep.astype(jnp.float32))


def histogram(
    x: Any, bins: int = 64, range: Sequence[float] = (0.0, 1.0), *, log: bool = False
) -> jax.Array:
    """Counts of the values of ``x`` in ``bins`` bins over ``range``, across
    every device, inside ``jit`` (one all-reduce where ``x`` is sharded, none
    where it is replicated).

    Args:
        x: an array (activations, per-example losses, ...), any sharding.
        bins: how many bins.
        range: ``(low, high)``; the bins are equal (log-spaced with ``log``,
            which needs ``low > 0``). Fixed, so the counts of every step line
            up: :class:`~jaxhistory.History` records them as an array metric,
            drawn as a heatmap of bins over steps.
        log: log-spaced bins.

    Returns:
        A float32 ``(bins,)`` array of counts, NumPy's ``histogram`` rule: each
        bin holds its low edge, the last also ``high``; values outside the
        range and NaN are not counted (``sum(counts)`` says how many were).

    Raises:
        ValueError: ``bins`` not a positive int; ``range`` not two finite
            numbers in order; ``log`` with ``low <= 0``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jax.jit(lambda x: jh.histogram(x, 4, (0, 4)))(jnp.arange(5.0)).tolist()
        [1.0, 1.0, 1.0, 2.0]
    """
    bins, lo, hi, log = _check_histogram(bins, range, log, "histogram")
    x = jnp.asarray(x)
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    axes = tuple(
        a
        for entry in (spec or ())
        if entry is not None
        for a in (entry if isinstance(entry, tuple) else (entry,))
    )
    if not axes:
        return _local_counts(x, bins, lo, hi, log)

    def body(block: jax.Array) -> jax.Array:
        return jax.lax.psum(_local_counts(block, bins, lo, hi, log), axes)

    return jax.shard_map(
        body, mesh=sharding.mesh, in_specs=spec, out_specs=jax.sharding.PartitionSpec()
    )(x)


def histogram_collective(
    x: Any,
    axis_name: Any,
    bins: int = 64,
    range: Sequence[float] = (0.0, 1.0),
    *,
    log: bool = False,
) -> jax.Array:
    """:func:`histogram` inside ``jax.shard_map``: ``x`` is this device's
    block; the counts are added over ``axis_name`` in one ``lax.psum``. A
    block the same on every device (invariant, under ``check_vma=True``) is
    counted once per device, as ``lax.psum`` does."""
    bins, lo, hi, log = _check_histogram(bins, range, log, "collective.histogram")
    return jax.lax.psum(_local_counts(jnp.asarray(x), bins, lo, hi, log), axis_name)
