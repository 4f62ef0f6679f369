"""Quantiles across devices for :func:`~jaxhistory.distributed_stats`.

Two ways, by what a leaf holds:

* **One value per device** (the values are gathered whole already): the exact
  quantile of those values, NumPy's default (linear) rule, at no extra
  collective.
* **More values**: two histograms of each leaf between its smallest and
  largest finite value (known after the first all-reduce), their counts added
  up in the second (the sum) all-reduce with the other sums: one of equal
  bins, one of bins equal in ``sign(x) log(1 + |x| / s)``, ``s`` the smallest
  nonzero magnitude (logarithmic for values spanning decades, both signs
  included). Zeros and infinities are counted apart. A quantile is read from
  the cumulative counts of whichever histogram has fewer values in the bin
  that holds it, that bin's values taken as evenly spread within it: its rank
  is off by at most the share of values in that bin.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhistory._collective import psum, sharded_axes
from jaxhistory._dtypes import is_whole

__all__ = [
    "BINS",
    "HALF",
    "WIDTH",
    "check_quantiles",
    "exact_quantiles",
    "hist_block",
    "hist_bounds",
    "hist_quantiles",
    "histogram",
    "histogram_collective",
]

BINS = 2048  # histogram bins per leaf


def check_quantiles(quantiles: Any, caller: str) -> tuple[tuple[float, ...], tuple]:
    """The quantiles as floats in (0, 1), and their row names (``p50``,
    ``p99.9``); ValueError naming a bad one."""
    if isinstance(quantiles, numbers.Real) or getattr(quantiles, "shape", 0) == ():
        quantiles = (quantiles,)  # one number (a NumPy or JAX scalar too)
    try:
        if isinstance(quantiles, str | bytes):
            raise TypeError
        qs = tuple(quantiles)
    except TypeError:
        raise TypeError(
            f"{caller}: quantiles must be a sequence of numbers in (0, 1), got "
            f"{quantiles!r:.60}"
        ) from None
    out = []
    for q in qs:
        f = _real(q)
        if f is None or not 0 < f < 1:
            raise ValueError(
                f"{caller}: quantile {q!r:.30} is not a number strictly between 0 "
                "and 1 (use max and min for 1 and 0)"
            )
        out.append(f)
    names = tuple(map(_row_name, out))
    if len(set(names)) != len(names):
        raise ValueError(f"{caller}: quantiles {qs!r} repeat one")
    return tuple(out), names


def _row_name(q: float) -> str:
    """``p50``, ``p99.9``: the percent with up to 10 significant digits, more
    where fewer would round it to 0 or 100 (0.99999999999: ``p99.999999999``,
    not ``p100``, the max)."""
    for digits in range(10, 18):
        text = f"{100 * q:.{digits}g}"
        if 0 < float(text) < 100:
            return f"p{text}"
    return f"p{100 * q!r}"


def _real(q: Any) -> float | None:
    """``q`` as a float: a Python, NumPy or (concrete) JAX real number; None
    for anything else (a bool, a str, an array of several values)."""
    if isinstance(q, bool | np.bool_):
        return None
    if isinstance(q, numbers.Real):
        return float(q)
    dtype = getattr(q, "dtype", None)
    if getattr(q, "shape", None) != () or dtype is None:
        return None
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        return None
    try:
        return float(q)
    except Exception:  # a traced value: not known before the step runs
        return None


def exact_quantiles(v: jax.Array, qs: Sequence[float]) -> jax.Array:
    """``(Q, k)``: the quantiles of each row of ``v`` (``(k, S)``), NumPy's
    linear rule (NaN where a row holds NaN)."""
    return jnp.quantile(v, jnp.asarray(qs, v.dtype), axis=1)


HALF = BINS // 2  # bins of each of the two histograms of a leaf
# a leaf's counts: both histograms (finite nonzero values), then how many
# values are -inf, finite and negative, zero, +inf
NEG_INF, NEGATIVE, ZERO, POS_INF = range(2 * HALF, 2 * HALF + 4)
WIDTH = 2 * HALF + 4


def hist_bounds(x: jax.Array) -> list[jax.Array]:
    """Three blocks for the max all-reduce, ``(k, ...)`` each, of the leaves
    of ``x`` (``(k, ...)``): the largest finite value, minus the smallest, and
    minus the smallest nonzero finite magnitude (``-inf`` where there is none).
    They bound the histograms of :func:`hist_block`."""
    finite = jnp.isfinite(x)
    return [
        jnp.where(finite, x, -jnp.inf),
        jnp.where(finite, -x, -jnp.inf),
        jnp.where(finite & (x != 0), -jnp.abs(x), -jnp.inf),
    ]


class _Bins:
    """The two binnings of each leaf, from its all-reduced bounds (``(k, 1)``
    each): equal bins between the smallest and largest finite value, and bins
    equal in ``t = sign(x) log(1 + |x| / s)``, ``s`` the smallest nonzero
    finite magnitude (as fine near zero as the data are, logarithmic away from
    it: values spanning decades, or exact zeros among them, are not squeezed
    into one bin). A quantile is read from whichever of the two puts fewer
    values in the bin that holds it."""

    def __init__(self, fmx: jax.Array, neg_fmn: jax.Array, neg_tiny: jax.Array):
        fmn = -neg_fmn
        some = fmx >= fmn  # a finite value at all
        self.lo = jnp.where(some, fmn, 0)
        self.hi = jnp.where(some, fmx, 0)
        tiny = jnp.where(jnp.isfinite(neg_tiny), -neg_tiny, 1)
        normal = jnp.finfo(tiny.dtype).tiny  # (subnormals may read as zero)
        self.log_s = jnp.log(jnp.maximum(tiny, normal))
        self.s = jnp.exp(self.log_s)
        self.t_lo, self.t_hi = self.forward(self.lo), self.forward(self.hi)

    def forward(self, x: jax.Array) -> jax.Array:
        # log(s + |x|) - log(s), never overflowing
        mag = jnp.logaddexp(self.log_s, jnp.log(jnp.abs(x))) - self.log_s
        return jnp.where(x < 0, -mag, mag)

    def inverse(self, t: jax.Array) -> jax.Array:
        mag = jnp.exp(jnp.abs(t) + self.log_s) - self.s
        return jnp.where(t < 0, -mag, mag)

    @staticmethod
    def index(v: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
        """The bin (0 to HALF - 1) of ``v`` between ``lo`` and ``hi``."""
        span = hi / 2 - lo / 2  # halves: no overflow between -max and max
        span = jnp.where(span > 0, span, 1)
        # in units of a power of two near the span: XLA turns the division by
        # the span into a product by its reciprocal, which for a span past
        # about 8.5e37 is below float32's smallest normal number (read as 0
        # on CPU: every value in bin 0); a power of two's reciprocal is
        # exact, and the span in its units is near 1
        _, e = jnp.frexp(span)
        info = jnp.finfo(span.dtype)
        unit = jnp.ldexp(
            jnp.ones_like(span), jnp.clip(e, info.minexp + 1, info.maxexp - 2)
        )
        frac = ((v / 2 - lo / 2) / unit) / (span / unit)
        return jnp.clip(jnp.floor(frac * HALF), 0, HALF - 1).astype(jnp.int32)


def hist_block(x: jax.Array, bounds: jax.Array) -> jax.Array:
    """``(k * WIDTH, 1)``: this device's counts of the values of each of the
    ``k`` leaves of ``x`` (``(k, ...)``): the finite nonzero ones in both
    histograms, then the counts of ``-inf``, finite negative values, zeros and
    ``+inf`` (NaN left out); ``bounds`` is the all-reduced :func:`hist_bounds`
    (``(3, k)``). A block for the sum all-reduce."""
    k = x.shape[0]
    flat = x.reshape(k, -1)
    bins = _Bins(*(b.reshape(k, 1) for b in bounds))
    finite = jnp.isfinite(flat)
    binned = finite & (flat != 0)
    linear = bins.index(flat, bins.lo, bins.hi)
    logged = HALF + bins.index(bins.forward(flat), bins.t_lo, bins.t_hi)
    other = jnp.where(flat == 0, ZERO, jnp.where(flat > 0, POS_INF, NEG_INF))
    first = jnp.where(binned, linear, other)  # NaN: counted nowhere
    rows = jnp.broadcast_to(jnp.arange(k)[:, None], flat.shape)
    # int32 on the device: a float32 count stops at 2**24 (adding 1 rounds
    # back); the float sum across devices is off by at most a rounding
    counts = jnp.zeros((k, WIDTH), jnp.int32)
    counts = counts.at[rows, first].add((~jnp.isnan(flat)).astype(jnp.int32))
    counts = counts.at[rows, logged].add(binned.astype(jnp.int32))
    negative = jnp.sum(finite & (flat < 0), axis=1, dtype=jnp.int32)
    counts = counts.at[:, NEGATIVE].set(negative)
    return counts.astype(x.dtype).reshape(k * WIDTH, 1)


def _read(counts: jax.Array, r: jax.Array, lo: jax.Array, hi: jax.Array):
    """Where the ``r``-th (0-based) value falls in one histogram: its bin's
    count, the bin's edges, and the value's place in it, the bin's values taken
    as evenly spread."""
    cum = jnp.cumsum(counts, axis=1)
    b = jnp.minimum(jnp.sum(cum <= r, axis=1, keepdims=True), HALF - 1)
    c = jnp.take_along_axis(counts, b, axis=1)
    j = r - (jnp.take_along_axis(cum, b, axis=1) - c)
    width = hi / HALF - lo / HALF  # (no overflow)
    left = lo + b * width
    pos = left + (j + 0.5) / jnp.where(c > 0, c, 1) * width
    return c, left, left + width, pos


def hist_quantiles(
    counts: jax.Array, bounds: jax.Array, qs: Sequence[float], integer: bool = False
) -> jax.Array:
    """``(Q, k)``: the quantiles read from the all-reduced ``counts`` (``(k,
    WIDTH)``, :func:`hist_block`), NumPy's linear rule on ranks; between a
    finite value and an infinity, the infinity, and between ``-inf`` and
    ``+inf``, NaN (as ``jnp.quantile``); NaN for a leaf without values.
    ``integer``: the leaves' values are integers, so each end of the
    interpolation (one of the values) is rounded to one."""
    k = counts.shape[0]
    bins = _Bins(*(b.reshape(k, 1) for b in bounds))
    linear, logged = counts[:, :HALF], counts[:, HALF : 2 * HALF]
    neg_inf, negative, zeros, pos_inf = (
        counts[:, i : i + 1] for i in (NEG_INF, NEGATIVE, ZERO, POS_INF)
    )
    n = jnp.sum(linear, axis=1, keepdims=True) + neg_inf + zeros + pos_inf
    out = []
    for q in qs:
        rank = q * (n - 1)  # 0-based position among the sorted values
        ends = []
        for r in (jnp.floor(rank), jnp.ceil(rank)):
            f = r - neg_inf  # among the finite values
            zero = (f >= negative) & (f < negative + zeros)
            b = jnp.where(f >= negative + zeros, f - zeros, f)  # among the binned
            c1, a1, b1, e1 = _read(linear, b, bins.lo, bins.hi)
            c2, a2, b2, t2 = _read(logged, b, bins.t_lo, bins.t_hi)
            a2, b2, e2 = bins.inverse(a2), bins.inverse(b2), bins.inverse(t2)
            # both bins hold the value: the estimate of the one with fewer
            # values, within where the two bins overlap
            v = jnp.where(c2 < c1, e2, e1)
            v = jnp.clip(v, jnp.maximum(a1, a2), jnp.minimum(b1, b2))
            v = jnp.clip(v, bins.lo, bins.hi)
            if integer:  # (within the bounds: they are values too)
                v = jnp.round(v)
            v = jnp.where(zero, 0, v)
            v = jnp.where(f < 0, -jnp.inf, jnp.where(r >= n - pos_inf, jnp.inf, v))
            ends.append(v)
        frac = rank - jnp.floor(rank)
        v0, v1 = ends
        between = v0 + frac * (v1 - v0)
        value = jnp.where(
            (frac == 0) | (v0 == v1) | jnp.isinf(v0),
            v0,
            jnp.where(jnp.isinf(v1), v1, between),
        )
        # between -inf and +inf: undefined (NaN, as jnp.quantile gives)
        value = jnp.where(
            (frac > 0) & (v0 == -jnp.inf) & (v1 == jnp.inf), jnp.nan, value
        )
        out.append(jnp.where(n > 0, value, jnp.nan).reshape(k))
    return jnp.stack(out)


def _check_histogram(bins: Any, range: Any, log: Any, caller: str) -> tuple:
    if not is_whole(bins) or bins < 1:  # (a NumPy int is one)
        raise ValueError(f"{caller}: bins must be a positive int, got {bins!r:.30}")
    bins = int(bins)
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
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    largest = float(jnp.finfo(dtype).max)
    if max(abs(lo), abs(hi)) > largest:
        raise ValueError(
            f"histogram: range ({lo:g}, {hi:g}) is past the largest {dtype} value "
            f"({largest:g}), which the values are counted in"
        )
    v = jnp.ravel(x).astype(dtype)
    if log:
        t = jnp.log(jnp.where(v > 0, v, jnp.nan))
        t_lo, t_hi = math.log(lo), math.log(hi)
    else:
        t, t_lo, t_hi = v, lo, hi
    keep = (t >= t_lo) & (t <= t_hi)  # False for NaN
    # (t - lo) * bins / (hi - lo), as NumPy reckons it, one factor: a
    # division by the width would be folded into a factor 1 / width, below
    # float32's smallest normal number (read as 0) for widths past 8.5e37.
    # Over a width past 2**100, eighths: t - lo may overflow, and the factor
    # of a wide range and few bins be below the smallest normal number too.
    part = 8.0 if t_hi - t_lo > 2.0**100 else 1.0
    idx = jnp.floor((t / part - t_lo / part) * (bins * part / (t_hi - t_lo)))
    idx = jnp.clip(jnp.where(t == t_hi, bins - 1, idx), 0, bins - 1).astype(jnp.int32)
    counts = jnp.zeros(bins, jnp.int32).at[idx].add(keep.astype(jnp.int32))
    return counts.astype(jnp.float32)  # (int32: float32 counts stop at 2**24)


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
        Each device counts in int32 (exact to 2**31 values on a device); a
        count past 2**24 comes back rounded to float32, not stuck at 2**24.

    Raises:
        ValueError: ``bins`` not a positive int; ``range`` not two finite
            numbers in order, or past the largest value of the dtype the
            values are counted in (float32, or float64 for float64 values);
            ``log`` with ``low <= 0``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jax.jit(lambda x: jh.histogram(x, 4, (0, 4)))(jnp.arange(5.0)).tolist()
        [1.0, 1.0, 1.0, 2.0]
    """
    bins, lo, hi, log = _check_histogram(bins, range, log, "histogram")
    x = jnp.asarray(x)
    if x.size == 0:  # no values: nothing to count (nor devices to count on)
        return jnp.zeros(bins, jnp.float32)
    if not isinstance(x, jax.core.Tracer):  # outside jit: one cached program
        return _counts_jitted(x, bins, lo, hi, log)
    return _counts(x, bins, lo, hi, log)


def _counts(x: jax.Array, bins: int, lo: float, hi: float, log: bool) -> jax.Array:
    """:func:`histogram` of ``x`` (not empty): in a ``shard_map`` over the mesh
    ``x`` is sharded on, each device's counts in one psum."""
    sharding, axes = sharded_axes(x)
    if not axes:
        return _local_counts(x, bins, lo, hi, log)

    def body(block: jax.Array) -> jax.Array:
        return jax.lax.psum(_local_counts(block, bins, lo, hi, log), axes)

    return jax.shard_map(
        body,
        mesh=sharding.mesh,
        in_specs=sharding.spec,
        out_specs=jax.sharding.PartitionSpec(),
    )(x)


# (a shard_map called outside jit compiles again at every call)
_counts_jitted = jax.jit(_counts, static_argnums=(1, 2, 3, 4))


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
    return psum(_local_counts(jnp.asarray(x), bins, lo, hi, log), axis_name)
