"""distributed_stats: mean, max, min, std of many metrics in two or three collectives.

Both forms compute, for every leaf ``name``, the entries ``name/mean``, ``name/max``,
``name/min`` and ``name/std`` (population std) over all the leaf's values across
devices, with the same algorithm:

1. one max-reduction of ``[x, -x]`` for every leaf at once gives the maxima and minima;
2. with the midrange ``c = (max + min) / 2`` as a shift, one sum-reduction of
   ``[x - c, (x - c)**2]`` for every leaf at once gives the mean and the variance.

Shifting by ``c`` keeps the variance accurate in float32: the cancellation in
``E[(x-c)^2] - E[x-c]^2`` is bounded by ``(mean - c)^2 / var``, which is at most
``N / 2`` for ``N`` values (and is usually near 1). Values ``1e4 +- 1`` give std 1.0
exactly, where the textbook ``E[x^2] - E[x]^2`` gives 2.83.

The two forms pack the same blocks for the two reductions and split the reduced
rows back the same way (``_two_pass``; ``_gathered`` for one value per device);
they differ only in how a reduction is issued (``_Issue``): the SPMD form reduces
global arrays and lets the compiler place the all-reduce, the shard_map form
reduces each shard's values and calls ``lax.pmax`` / ``lax.psum``.

How the bytes scale with the number ``S`` of devices holding a leaf. Up to
:data:`GATHER_DEVICES` of them, leaves with one value per device are gathered
whole (one all-reduce of ``K * S`` values) and provenance counts, per holder,
the elements equal to the max and the min in the sum (``2 * K * S`` values).
Above it every path takes ``O(K)`` values whatever ``S``: one value per device
takes the two passes too, and provenance takes a third, small max-reduction of
``where(x == max, -rank, -inf)`` (and the same for the min), whose result is
the lowest rank, so the lowest device index, holding the extreme; the NaN
device already rides in the first reduction the same way.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxhistory._collective import (
    AxisName,
    bound_axis_size,
    check_axis_name,
    pmax,
    psum,
    sharded_axes,
)
from jaxhistory._names import PROVENANCE, STATS
from jaxhistory._provenance import (
    Layout,
    check_provenance,
    layout_of,
    positional_layout,
    shard_tables,
)
from jaxhistory._quantiles import (
    WIDTH,
    check_quantiles,
    exact_quantiles,
    hist_block,
    hist_bounds,
    hist_quantiles,
)
from jaxhistory._tree import Leaf, acc_dtype, flatten_metrics

__all__ = [
    "GATHER_DEVICES",
    "PROVENANCE",
    "STATS",
    "Stats",
    "distributed_stats",
    "distributed_stats_collective",
    "per_shard",
    "pow2_scale",
    "shard_count",
    "shift_scale",
]


# bench_pod.py, K=100 on 8-64 simulated CPU devices: gathering wins to 32, loses at 64
GATHER_DEVICES = 32


def _gathers(holders: int) -> bool:
    """Whether ``holders`` devices are few enough for the forms whose bytes grow
    with them (one value per device gathered whole, per-holder provenance
    counts): at most :data:`GATHER_DEVICES`, read when a call is traced."""
    return holders <= GATHER_DEVICES


@jax.tree_util.register_pytree_node_class
class Stats(Mapping):
    """The flat mapping returned by :func:`distributed_stats`.

    It maps ``"name/mean"``, ``"name/max"``, ``"name/min"`` and ``"name/std"`` to
    values, like a dict, but holds them in one ``(4, K)`` array (rows in
    :data:`STATS` order, one column per metric); :func:`~jaxhistory.watch`
    returns one whose rows are the statistics it was asked for. As a pytree it
    has that one leaf, so a jitted step that returns it hands back one buffer
    instead of ``4 * K`` scalars, and ``jax.device_get(stats)`` fetches
    everything in one transfer.
    With provenance it also maps ``"name/argmax"``, ``"name/argmin"`` and
    ``"name/nan_device"`` to device indices, held in a second, int32 ``(3, K)``
    array (rows in :data:`PROVENANCE` order).

    Attributes:
        names: the metric names, one per column.
        table: the ``(4, K)`` array (``(len(rows), K)``).
        rows: the statistic of each row of ``table`` (:data:`STATS`).
        where: the ``(3, K)`` int32 array of device indices, or None.
    """

    __slots__ = ("_index", "names", "rows", "table", "where")

    def __init__(
        self,
        names: tuple[str, ...],
        table: Any,
        where: Any = None,
        rows: tuple[str, ...] = STATS,
    ):
        self.names = tuple(names)
        self.table = table
        self.where = where
        self.rows = tuple(rows)
        self._index: dict[str, tuple[int, int, int]] | None = None

    @classmethod
    def of(cls, metrics: Any) -> Stats:
        """Scalar metrics as one array: a step that returns
        ``Stats.of({"loss": loss, "acc": acc})`` hands back one buffer, and
        History fetches it to the host in one transfer and records ``loss``
        and ``acc`` (``name/loss`` under a key ``name``). On a GPU each
        transfer costs tens of µs of host time, so a step with many scalars
        is cheaper to record this way.

        Args:
            metrics: a dict of scalars (0-d JAX or NumPy arrays, Python numbers);
                nested dicts join names with ``/``, in the order ``jax.tree``
                flattens them (sorted keys, as for :func:`distributed_stats`).
                They are stacked in one dtype (``jnp.result_type`` of them:
                integers beside float32 values become float32, exact up to
                2**24).

        Raises:
            ValueError: no metric, a value that is not a scalar (named), or a
                bare scalar instead of a dict.
            TypeError: a value that is not a number (named).

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> import jaxhistory as jh
            >>> step = jax.jit(lambda x: jh.Stats.of({"loss": x, "acc": x / 2}))
            >>> dict(step(jnp.float32(0.5)))
            {'acc': Array(0.25, dtype=float32), 'loss': Array(0.5, dtype=float32)}
        """
        leaves, _ = flatten_metrics(metrics)
        if not leaves:
            raise ValueError("Stats.of needs at least one metric")
        for leaf in leaves:
            if not leaf.name:
                raise ValueError("Stats.of takes a dict of named scalars, not a value")
            if jnp.ndim(leaf.value) != 0:
                raise ValueError(
                    f"Stats.of takes scalars: {leaf.name!r} has shape "
                    f"{jnp.shape(leaf.value)}"
                )
        table = jnp.stack([jnp.asarray(leaf.value) for leaf in leaves])[:, None]
        return cls(("",), table, rows=tuple(leaf.name for leaf in leaves))

    def _keys(self) -> dict[str, tuple[int, int, int]]:
        if self._index is None:
            rows = [(0, self.rows)]
            if self.where is not None:
                rows.append((1, PROVENANCE))
            self._index = {
                (f"{name}/{stat}" if name else stat): (part, row, col)
                for col, name in enumerate(self.names)
                for part, stats in rows
                for row, stat in enumerate(stats)
            }
        return self._index

    def __getitem__(self, key: str) -> Any:
        part, row, col = self._keys()[key]
        return (self.where if part else self.table)[row, col]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        rows = len(self.rows) + (len(PROVENANCE) if self.where is not None else 0)
        return rows * len(self.names)

    def __repr__(self) -> str:
        if isinstance(self.table, np.ndarray | jax.Array) and not isinstance(
            self.table, jax.core.Tracer
        ):
            body = ", ".join(f"{k!r}: {float(v):.6g}" for k, v in self.items())
            return f"Stats({{{body}}})"
        return f"Stats(names={self.names!r}, table={self.table!r})"

    def tree_flatten(self):
        if self.where is None:
            return (self.table,), (self.names, False, self.rows)
        return (self.table, self.where), (self.names, True, self.rows)

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, provenance, rows = aux
        return cls(names, children[0], children[1] if provenance else None, rows)


def _check_nonempty(leaves: list[Leaf]) -> None:
    for leaf in leaves:
        if leaf.value.size == 0:
            raise ValueError(f"metric {leaf.name!r} is empty; it has no statistics")


# The two passes. Both forms pack the same blocks and split the reduced rows
# back the same way; they differ only in how a list of blocks becomes one
# all-reduced row vector (an _Issue).


class _Issue(NamedTuple):
    """How a form issues its all-reduces over blocks of rows.

    A block is an array whose first axis holds rows; every other axis is reduced.
    ``max`` and ``sum`` take a list of blocks and return the reduced rows of all
    of them, concatenated in order, with one all-reduce. ``squares`` turns a
    block of shifted values into the block that ``sum`` reduces to their sums of
    squares.
    """

    max: Callable[[list[jax.Array]], jax.Array]
    sum: Callable[[list[jax.Array]], jax.Array]
    squares: Callable[[jax.Array], jax.Array]


def _tail(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _spmd_reduce(fn: Callable) -> Callable[[list[jax.Array]], jax.Array]:
    def reduce(blocks: list[jax.Array]) -> jax.Array:
        x = jnp.concatenate(blocks)  # one shape: one reduction, one all-reduce
        return fn(x, axis=_tail(x))

    return reduce


# SPMD: the blocks are global arrays of one shape; reducing them is the
# all-reduce, placed by the compiler.
_SPMD = _Issue(_spmd_reduce(jnp.max), _spmd_reduce(jnp.sum), jnp.square)


def _centred_squares(d: jax.Array) -> jax.Array:
    # Centred on the shard's mean of the shifted values, so only the spread
    # between shards goes through the shifted sum: the rounding of a mean of
    # unshifted values would be multiplied by n * |mean - c| there.
    axes = _tail(d)
    local_mean = jnp.mean(d, axis=axes, keepdims=True)
    spread = jnp.sum(jnp.square(d - local_mean), axis=axes)
    return spread + math.prod(d.shape[1:]) * jnp.square(local_mean).reshape(-1)


def _collective_issue(axis_name: AxisName) -> _Issue:
    """The shard_map form: each block is reduced over this shard's values, and
    the rows of all blocks go through one ``lax.pmax`` / ``lax.psum``."""

    def issue(fn: Callable, collective: Callable) -> Callable:
        def reduce(blocks: list[jax.Array]) -> jax.Array:
            rows = [fn(b, axis=_tail(b)) for b in blocks]
            return collective(jnp.concatenate(rows), axis_name)

        return reduce

    return _Issue(issue(jnp.max, pmax), issue(jnp.sum, psum), _centred_squares)


def _shift(mx: jax.Array, mn: jax.Array) -> jax.Array:
    c = mx / 2 + mn / 2  # halves first: no overflow near the dtype's max
    return jnp.where(jnp.isfinite(c), c, jnp.zeros_like(c))


def _clean(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (x, -x) with NaN as -inf, for one max-reduction, and the NaN flags.

    Cross-device max all-reduces drop NaN, so NaN is counted in the sum pass instead.
    """
    isnan = jnp.isnan(x)
    return (
        jnp.where(isnan, -jnp.inf, x),
        jnp.where(isnan, -jnp.inf, -x),
        isnan.astype(x.dtype),
    )


def _per_stack(v: jax.Array, xs: list[jax.Array]) -> list[jax.Array]:
    """Splits one value per leaf into one column per stack, to broadcast."""
    out, offset = [], 0
    for x in xs:
        k = x.shape[0]
        out.append(v[offset : offset + k].reshape((k,) + (1,) * (x.ndim - 1)))
        offset += k
    return out


def _holder_block(mask: jax.Array, onehot: jax.Array) -> jax.Array:
    """``(k * S, ...)``: the elements of ``mask`` (``(k, ...)``) each holder has,
    with ``onehot`` ``(S, ...)`` marking each holder's elements (trailing axes of
    size 1 where a holder has them all)."""
    onehot = onehot.reshape(onehot.shape + (1,) * (mask.ndim - onehot.ndim))
    held = mask.astype(onehot.dtype)[:, None] * onehot[None]
    return held.reshape((-1, *held.shape[2:]))


def _slot_block(x: jax.Array, onehot: jax.Array) -> jax.Array:
    """``(k * S, ...)``: each row of ``x`` (``(k, ...)``) in its holder's slot and
    0 in the others, so summing over the holders puts every value in its slot."""
    onehot = onehot.reshape(onehot.shape + (1,) * (x.ndim - onehot.ndim))
    # where, not a product: NaN or inf times 0 would spread to every slot
    slots = jnp.where(onehot[None] > 0, x[:, None], 0)
    return slots.reshape((-1, *slots.shape[2:]))


def _two_pass(
    xs: list[jax.Array],
    issue: _Issue,
    counts: Any,
    provenance: tuple[jax.Array, jax.Array | None, jax.Array] | None = None,
    extra: Sequence[jax.Array] = (),
    quantiles: Sequence[float] = (),
    source: Any = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The statistics of stacked leaves in one max- and one sum-reduction
    (and a second max-reduction for provenance without a one-hot).

    Args:
        xs: stacks of leaves, ``(k_i, ...)`` each, of one dtype; ``k`` leaves in all.
        issue: how the two reductions are issued.
        counts: the number of values of each leaf (a scalar or ``(k,)``).
        provenance: ``(rank, onehot, holders)``: each element's holder as a
            position in ``holders`` (broadcast against a leaf, in the leaves'
            dtype), ``(S, ...)`` one-hot of the holders' elements, and the ``S``
            device indices, in ascending order; None for no device indices.
            With ``onehot`` None the lowest rank holding the max (min) comes
            from a third, max-reduction of ``2 k`` values instead of per-holder
            counts in the sum (``2 k S`` values).
        extra: more blocks for the sum-reduction, whose rows come back.
        quantiles: also these quantiles of each leaf, from histograms whose
            counts ride in the sum-reduction (an ``issue`` that reduces each
            block before the collective, as the shard_map form does).
        source: the dtype the leaves came in (the quantiles are rounded to it
            where it is narrower), or None.

    Returns:
        The ``(4, k)`` table of :data:`STATS` (then a row per quantile), the
        ``(3, k)`` int32 device indices (None without ``provenance``), and the
        reduced rows of ``extra`` (None without).
    """
    k = sum(x.shape[0] for x in xs)
    cleaned = [_clean(x) for x in xs]
    maxed = [hi for hi, _, _ in cleaned] + [lo for _, lo, _ in cleaned]
    if provenance is not None:
        rank = provenance[0]
        maxed += [jnp.where(isnan > 0, -rank, -jnp.inf) for *_, isnan in cleaned]
    if quantiles:  # the histograms' bounds
        leaf_bounds = [hist_bounds(x) for x in xs]
        maxed += [b[i] for i in range(3) for b in leaf_bounds]
    ext = issue.max(maxed)  # all-reduce 1
    mx, mn = ext[:k], -ext[k : 2 * k]
    c, scale = _shift(mx, mn), shift_scale(mx, mn)
    ds = [
        (x - cx) / sx
        for x, cx, sx in zip(xs, _per_stack(c, xs), _per_stack(scale, xs), strict=True)
    ]
    summed = ds + [issue.squares(d) for d in ds] + [isnan for *_, isnan in cleaned]
    ranked = provenance is not None and provenance[1] is None
    if provenance is not None:
        rank, onehot = provenance[:2]
        negated: list[jax.Array] = []
        for found in (mx, mn):
            pairs = zip(xs, _per_stack(found, xs), strict=True)
            if onehot is None:  # ranked
                negated += [jnp.where(x == f, -rank, -jnp.inf) for x, f in pairs]
            else:
                summed += [_holder_block(x == f, onehot) for x, f in pairs]
        if ranked:
            lowest = -issue.max(negated)  # all-reduce 3: the lowest ranks
    hist: list[jax.Array] = []
    if quantiles:  # each leaf's counts within its finite values
        bounds = ext[ext.shape[0] - 3 * k :].reshape(3, k)
        hist = [hist_block(x, b) for x, b in _per_leaf(xs, bounds)]
    sums = issue.sum(summed + list(extra) + hist)  # all-reduce 2
    table = _finish(c, ext[: 2 * k], sums[: 3 * k], counts, scale)
    if quantiles:
        counted = sums[sums.shape[0] - k * WIDTH :].reshape(k, WIDTH)
        integer = source is not None and not jnp.issubdtype(source, jnp.inexact)
        found = hist_quantiles(counted, bounds, quantiles, integer)
        if (
            source is not None
            and jnp.issubdtype(source, jnp.floating)
            and jnp.dtype(source) != found.dtype
        ):  # rounded to a narrower float dtype (integers are not rounded)
            found = found.astype(source).astype(found.dtype)
        nan = jnp.isnan(table[1])  # a NaN anywhere: NaN, as NumPy gives
        table = jnp.concatenate([table, jnp.where(nan, jnp.nan, found)])
        if extra:
            sums = sums[: sums.shape[0] - k * WIDTH]
    where, end = None, 3 * k
    if ranked and provenance is not None:  # ranked implies provenance
        where = _where(ext[2 * k : 3 * k], lowest[:k], lowest[k:], provenance[2])
    elif provenance is not None:
        holders = provenance[2]
        end += 2 * k * holders.shape[0]
        held = sums[3 * k : end].reshape(2, k, -1)
        first = [jnp.argmax(h > 0, axis=1) for h in held]  # the lowest holder
        where = _where(ext[2 * k : 3 * k], first[0], first[1], holders)
    return table, where, sums[end:] if extra else None


def _per_leaf(
    xs: list[jax.Array], rows: jax.Array
) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Each stack with its leaves' columns of ``rows`` (``(r, k)``)."""
    offset = 0
    for x in xs:
        k = x.shape[0]
        yield x, rows[:, offset : offset + k]
        offset += k


def _finish(
    c: jax.Array, ext: jax.Array, sums: jax.Array, counts: Any, scale: Any = 1
) -> jax.Array:
    """Turns one group's reduced partials into a ``(4, k)`` table of STATS.

    ``c`` is the shift of each of the ``k`` leaves and ``scale`` its divisor
    (:func:`shift_scale`), ``ext`` the reduced ``[max, -min]`` (``2k``), ``sums``
    the reduced ``[sum(d), sum(d^2), NaN count]`` with ``d = (x - c) / scale``
    (``3k``) and ``counts`` the number of values of each leaf.
    """
    k = c.shape[0]
    mx, mn = ext[:k], -ext[k:]
    s1, s2, nans = sums[:k], sums[k : 2 * k], sums[2 * k :]
    d = s1 / counts
    var = jnp.maximum(s2 / counts - jnp.square(d), 0)
    has_nan = nans > 0
    return jnp.stack(
        [
            c + d * scale,
            jnp.where(has_nan, jnp.nan, mx),
            jnp.where(has_nan, jnp.nan, mn),
            jnp.sqrt(var) * scale,
        ]
    )


def shift_scale(mx: jax.Array, mn: jax.Array) -> jax.Array:
    """:func:`pow2_scale` of half of each column's range: values shifted by
    the midrange and divided by it lie within (-4, 4), so their sums and sums
    of squares neither overflow (values near the dtype's largest) nor
    underflow (values near its smallest)."""
    return pow2_scale(mx / 2 - mn / 2)


def pow2_scale(size: jax.Array) -> jax.Array:
    """A power of two within a factor of two of ``size`` (>= 0), and 1 where
    ``size`` is 0 or not finite: dividing by it is exact. Kept, with its
    reciprocal, among the normal numbers (a compiler may multiply by the
    reciprocal, and a subnormal one may read as zero)."""
    info = jnp.finfo(size.dtype)
    _, e = jnp.frexp(size)  # size < 2**e
    e = jnp.clip(e - 1, info.minexp + 1, info.maxexp - 2)
    scale = jnp.ldexp(jnp.ones_like(size), e)
    return jnp.where(jnp.isfinite(size) & (size > 0), scale, 1).astype(size.dtype)


def _where(
    nan_ext: jax.Array, max_rank: jax.Array, min_rank: jax.Array, holders: jax.Array
) -> jax.Array:
    """The ``(3, k)`` int32 device indices from one group's reduced partials.

    ``nan_ext`` is the reduced ``max(-rank)`` over NaN elements (``-inf`` where
    none), ``max_rank``/``min_rank`` the lowest rank holding each leaf's
    max/min (``inf`` where none: no element equals it, as in a leaf of NaN
    only), and ``holders`` the ``S`` device indices in ascending order, so the
    lowest rank is the lowest device index; a NaN makes every index the NaN's
    device.
    """
    has_nan = nan_ext > -jnp.inf
    slots = holders.shape[-1]

    def pick(rank):  # rank 0 where none, as argmax over no count gives
        rank = jnp.where(rank < slots, rank, 0).astype(jnp.int32)
        return jnp.take(holders, rank, axis=-1)

    nan_device = jnp.where(has_nan, pick(jnp.where(has_nan, -nan_ext, 0)), -1)
    first_max, first_min = pick(max_rank), pick(min_rank)
    return jnp.stack(
        [
            jnp.where(has_nan, nan_device, first_max),
            jnp.where(has_nan, nan_device, first_min),
            nan_device,
        ]
    ).astype(jnp.int32)


def _gathered(
    x: jax.Array,
    issue: _Issue,
    onehot: jax.Array,
    holders: jax.Array | None,
    quantiles: Sequence[float] = (),
) -> tuple[jax.Array, Any, jax.Array]:
    """Statistics of leaves with one value per holder, in one sum-reduction.

    The reduction puts every value in its holder's slot (``onehot``, ``(S,
    ...)``, as for :func:`_slot_block`), on every device; the statistics and
    device indices (with ``holders``) are then computed locally. Returns them
    and the ``(k, S)`` values.
    """
    v = issue.sum([_slot_block(x, onehot)]).reshape(x.shape[0], -1)  # all-reduce 1
    return (*_summarise(v, holders, quantiles), v)


def _summarise(
    v: jax.Array, holders: jax.Array | None, quantiles: Sequence[float] = ()
) -> tuple[jax.Array, Any]:
    """The ``(4, k)`` statistics of ``k`` gathered rows of values, one value per
    holder (``holders``: their device indices in ascending order, or None for
    no indices), and the ``(3, k)`` device indices."""
    mx, mn = jnp.max(v, axis=1), jnp.min(v, axis=1)
    c, scale = _shift(mx, mn)[:, None], shift_scale(mx, mn)[:, None]
    d = (v - c) / scale  # (no overflow near the dtype's largest values)
    # the plain mean where it is finite (it rounds least); where its sum
    # overflowed, the mean of the shifted, scaled values
    direct = jnp.mean(v, axis=1, keepdims=True)
    mean = jnp.where(
        jnp.isfinite(direct), direct, c + jnp.mean(d, axis=1, keepdims=True) * scale
    )
    spread = jnp.square(d - (mean - c) / scale)
    std = jnp.sqrt(jnp.mean(spread, axis=1, keepdims=True)) * scale
    table = jnp.stack([mean[:, 0], mx, mn, std[:, 0]])
    if quantiles:  # exact: every value is here
        table = jnp.concatenate([table, exact_quantiles(v, quantiles)])
    if holders is None:
        return table, None
    isnan = jnp.isnan(v)
    has_nan = jnp.any(isnan, axis=1)
    clean = jnp.where(isnan, 0, v)
    nan_device = jnp.where(has_nan, holders[jnp.argmax(isnan, axis=1)], -1)
    where = jnp.stack(
        [
            jnp.where(has_nan, nan_device, holders[jnp.argmax(clean, axis=1)]),
            jnp.where(has_nan, nan_device, holders[jnp.argmin(clean, axis=1)]),
            nan_device,
        ]
    ).astype(jnp.int32)
    return table, where


def _assemble(leaves: list[Leaf], parts: list[tuple], provenance: bool) -> Stats:
    """Joins each group's tables into one, with columns in the order of
    ``leaves``. ``parts`` holds ``(indices, table, where)`` per group."""
    names = tuple(leaf.name for leaf in leaves)
    if not parts:
        where = jnp.zeros((len(PROVENANCE), 0), jnp.int32) if provenance else None
        return Stats(names, jnp.zeros((len(STATS), 0), jnp.float32), where)
    order = [i for idx, _, _ in parts for i in idx]
    table = jnp.concatenate([t for _, t, _ in parts], axis=1)
    where = jnp.concatenate([w for _, _, w in parts], axis=1) if provenance else None
    if order != sorted(order):
        perm = np.argsort(order)
        table = table[:, perm]
        where = None if where is None else where[:, perm]
    return Stats(names, table, where)


def distributed_stats(
    metrics: Any,
    provenance: bool = False,
    *,
    mesh: Any = None,
    quantiles: Sequence[float] = (),
) -> Stats:
    """Cross-device mean, max, min and std of every metric (SPMD, inside jit).

    Args:
        metrics: a pytree whose leaves hold the values to summarise, typically one
            value per device or shard (a per-shard loss of shape ``(num_shards,)``
            sharded over the mesh, made with :func:`per_shard`). Statistics are taken
            over all elements of each leaf; a scalar has std 0. bf16/fp16 values
            accumulate in float32.
        provenance: also say which device holds the extremes and the first NaN:
            ``name/argmax`` and ``name/argmin`` (the global index, in
            ``jax.devices()`` order, of the device holding the max / min; the
            lowest index on ties) and ``name/nan_device`` (the lowest index of a
            device holding a NaN, -1 when none; with a NaN, argmax and argmin
            name that device too, as max and min are NaN). Still two
            all-reduces per group of leaves on up to :data:`GATHER_DEVICES`
            devices; on more, a third of ``2 K`` values (the lowest rank
            holding each max and min) instead of ``2 K`` counts per device
            in the sum. Under jit it reads each value's sharding from its
            type, which is exact on Explicit mesh axes (``jax.make_mesh``'s
            default), and the mesh's devices from ``jax.set_mesh`` or
            ``mesh``. A value with no mesh in its type (an array on one
            device) is named, under jit, as the first device of that mesh,
            else JAX's default device: which device it is on is not in its
            type (outside jit it is read from the array).
        mesh: the mesh the values are on, for ``provenance`` under jit outside
            ``jax.set_mesh``. Its devices in another order than the values'
            mesh's (or other devices) make jit refuse to compile the call,
            rather than name the wrong device.
        quantiles: also ``name/p50``, ``name/p90``, ... for these quantiles in
            (0, 1) (``p99.9`` for 0.999). A leaf with one value per device:
            the exact quantile of those values (NumPy's linear rule), at no
            extra collective: every value is gathered for it, on more than
            :data:`GATHER_DEVICES` devices too, so its bytes grow with the
            device count. A larger leaf: read from two histograms of its
            finite nonzero values (equal bins, and bins equal in
            ``sign(x) log(1 + |x| / s)``), zeros and infinities counted
            apart, whose counts ride in the sum all-reduce; its rank is off
            by at most the share of values in one bin; values of a narrower
            float dtype (bfloat16) come back rounded to it, which keeps ties
            exact. Such a leaf is reduced in a ``shard_map`` over
            its mesh (still two all-reduces per group of leaves); with
            ``provenance`` too it is a ValueError.

    Returns:
        A :class:`Stats` mapping, read like a flat dict: ``name/mean``,
        ``name/max``, ``name/min`` and ``name/std`` for every leaf ``name`` (its
        ``/``-joined path), and the provenance entries when asked. NaN in a leaf
        makes all four statistics NaN. The values are float32 (float64 if a leaf
        is float64), in one ``(4, K)`` array; device indices are int32.

    Raises:
        ValueError: a leaf is empty; or, with provenance, the mesh's devices or
            a value's sharding cannot be known here, or ``mesh`` lists other
            devices than the mesh of ``jax.set_mesh``.
        TypeError: ``provenance`` is not a bool.

    Leaves of the same shape, dtype and sharding are stacked, so ``K`` of them
    compile to two all-reduces in total (one max, one sum), whatever ``K``;
    leaves with one value per device (what :func:`per_shard` returns) are
    gathered whole in one all-reduce instead and summarised on every device,
    on up to :data:`GATHER_DEVICES` (32) devices (``K * D`` values). On more, every
    all-reduce carries ``O(K)`` values whatever the device count ``D``: two
    passes, and a third small max-reduction for provenance (at most three
    all-reduces, ``8 K`` values in all with provenance, ``5 K`` without).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> stats = jax.jit(jh.distributed_stats)({"loss": jnp.array([1.0, 3.0])})
        >>> {k: float(v) for k, v in stats.items()}
        {'loss/mean': 2.0, 'loss/max': 3.0, 'loss/min': 1.0, 'loss/std': 1.0}
        >>> stats.table.shape
        (4, 1)
    """
    provenance = check_provenance(provenance, "distributed_stats")
    qs, q_names = check_quantiles(quantiles, "distributed_stats")
    leaves, _ = flatten_metrics(metrics)
    _check_nonempty(leaves)
    if provenance:
        layouts: list[Layout | None] = []
        for lf in leaves:
            layout, lf.value = layout_of(lf.value, mesh, "distributed_stats")
            layouts.append(layout)
    else:  # which values share a device: one collective for per-device values
        layouts = [positional_layout(lf.value) for lf in leaves]
    stats = global_stats(leaves, layouts, provenance=provenance, quantiles=qs)[0]
    if qs:
        stats = Stats(stats.names, stats.table, stats.where, STATS + q_names)
    return stats


def global_stats(
    leaves: list[Leaf],
    layouts: Sequence[Layout | None] | None,
    gather: frozenset = frozenset(),
    provenance: bool = True,
    quantiles: Sequence[float] = (),
) -> tuple[Stats, dict[int, jax.Array]]:
    """:func:`distributed_stats` on flattened leaves.

    ``layouts`` says where each leaf's elements are (None where unknown); with
    ``provenance`` every leaf needs one and the device indices are computed.
    A group of leaves with one element per holder (a per-device value, a host
    scalar per device) on at most :data:`GATHER_DEVICES` holders is gathered
    whole in one all-reduce and summarised on every device (on more, only to
    give exact ``quantiles``); others take the two-pass form, with provenance
    in a third all-reduce of ``O(K)`` values above :data:`GATHER_DEVICES`.
    ``gather``: indices of leaves whose per-holder values are also returned
    (``{index: (S,) values}``, the value each holder's elements share), at no
    extra collective (their ``S`` values per leaf ride in the sum).
    """
    layouts = layouts or [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        placed = layouts[i]
        if placed is not None:  # the same placement: stacked at no cost
            v = leaf.value
            key = (v.shape, acc_dtype(v.dtype), placed.key)
        else:
            key = _group_key(leaf)
        groups.setdefault(key, []).append(i)
    parts, gathered = [], {}
    for (_, acc, *_), idx in groups.items():
        stacked = jnp.stack([leaves[i].value.astype(acc) for i in idx])
        layout = layouts[idx[0]]
        picks = [j for j, i in enumerate(idx) if i in gather]
        wide = layout is not None and not _gathers(len(layout.holders))
        one_each = layout is not None and layout.rank.size == len(layout.holders)
        if layout is not None and one_each and (quantiles or not wide):
            holders = jnp.asarray(layout.holders)
            onehot = jnp.asarray(layout.onehot)
            table, where, v = _gathered(stacked, _SPMD, onehot, holders, quantiles)
            values = [v[j] for j in picks]
        elif quantiles:
            if provenance:
                raise ValueError(
                    "distributed_stats: quantiles of leaves with more than one "
                    "value per device cannot be given with provenance; ask for "
                    f"them in a call of their own ({leaves[idx[0]].name!r})"
                )
            source = _one_dtype(leaves[i].value.dtype for i in idx)
            if isinstance(stacked, jax.core.Tracer):
                table = _quantile_group(stacked, quantiles, source)
            else:  # outside jit: one cached program (a shard_map called
                # outside jit compiles again at every call: 44 s here)
                table = _quantile_group_jitted(stacked, tuple(quantiles), source)
            where, values = None, []
        else:
            table, where, values = _global_group(
                stacked,
                layout if provenance or picks else None,
                picks,
                wide,
                provenance,
            )
        parts.append((idx, table, where))
        gathered.update({idx[j]: v for j, v in zip(picks, values, strict=True)})
    return _assemble(leaves, parts, provenance), gathered


def _one_dtype(dtypes) -> Any:
    """The dtype all of ``dtypes`` are, or None."""
    found = set(map(jnp.dtype, dtypes))
    return found.pop() if len(found) == 1 else None


def _reducing_issue(pmax: Callable, psum: Callable) -> _Issue:
    """Each block reduced over this device's values, then ``pmax``/``psum``."""

    def issue(fn: Callable, collective: Callable) -> Callable:
        def reduce(blocks: list[jax.Array]) -> jax.Array:
            return collective(jnp.concatenate([fn(b, axis=_tail(b)) for b in blocks]))

        return reduce

    return _Issue(issue(jnp.max, pmax), issue(jnp.sum, psum), _centred_squares)


def _quantile_group(
    stacked: jax.Array, quantiles: Sequence[float], source: Any = None
) -> jax.Array:
    """The statistics and quantiles of a group of stacked leaves: two-pass in a
    ``shard_map`` over the mesh they are sharded on (each device's share of the
    histogram counts rides in the psum), or here where they are replicated."""
    count = math.prod(stacked.shape[1:])
    sharding, axes = sharded_axes(stacked)
    if not axes:
        local = _reducing_issue(lambda t: t, lambda t: t)
        return _two_pass([stacked], local, count, quantiles=quantiles, source=source)[0]

    def body(x: jax.Array) -> jax.Array:
        issue = _reducing_issue(
            lambda t: lax.pmax(t, axes), lambda t: lax.psum(t, axes)
        )
        return _two_pass([x], issue, count, quantiles=quantiles, source=source)[0]

    return jax.shard_map(
        body, mesh=sharding.mesh, in_specs=sharding.spec, out_specs=P()
    )(stacked)


_quantile_group_jitted = jax.jit(_quantile_group, static_argnums=(1, 2))


def _group_key(leaf: Leaf) -> tuple:
    sharding = getattr(jax.typeof(leaf.value), "sharding", None)
    spec = str(getattr(sharding, "spec", None))
    return (leaf.value.shape, acc_dtype(leaf.value.dtype), spec)


def _global_group(
    stacked: jax.Array,
    layout: Layout | None,
    picks: list[int],
    wide: bool = False,
    provenance: bool = True,
) -> tuple[jax.Array, Any, list[jax.Array]]:
    """One group of ``k`` stacked leaves: its ``(4, k)`` table, its ``(3, k)``
    device indices (with a layout and ``provenance``; None without) and the
    per-holder values of ``picks``. ``wide``: the device indices from the
    lowest ranks (a third all-reduce of ``2 k`` values) rather than per-holder
    counts (``2 k S`` values in the sum)."""
    count = math.prod(stacked.shape[1:])
    if layout is None:
        return _two_pass([stacked], _SPMD, count)[0], None, []
    dtype = stacked.dtype
    rank = jnp.asarray(layout.rank, dtype)
    slots = len(layout.holders)
    onehot = None
    if not wide:
        onehot = jnp.asarray(layout.onehot, dtype)
    elif picks:  # from the ranks on device: no (S, ...) constant
        at = jnp.arange(slots, dtype=dtype).reshape((-1,) + (1,) * rank.ndim)
        onehot = (rank[None] == at).astype(dtype)
    place = None
    if provenance:
        place = (rank, None if wide else onehot, jnp.asarray(layout.holders))
    # onehot is set above whenever there are picks
    extra = (
        [_slot_block(stacked[np.asarray(picks)], cast(jax.Array, onehot))]
        if picks
        else []
    )
    table, where, rest = _two_pass([stacked], _SPMD, count, place, extra)
    if not picks:
        return table, where, []
    assert rest is not None  # extra is not empty: its rows come back
    per_slot = np.maximum(np.bincount(layout.rank.ravel(), minlength=slots), 1)
    values = rest.reshape(len(picks), slots) / jnp.asarray(per_slot, dtype)
    return table, where, list(values)


def distributed_stats_collective(
    metrics: Any,
    axis_name: AxisName,
    provenance: bool = False,
    *,
    mesh: Any = None,
    quantiles: Sequence[float] = (),
) -> Stats:
    """Mean, max, min and std of every metric across ``axis_name`` (in shard_map).

    Each leaf is this shard's value (a per-shard loss is a scalar); statistics are
    taken over all elements of all shards. The whole pytree costs one ``pmax`` and
    one ``psum``, whatever the number of leaves (one pair per accumulation dtype, so
    two pairs only when float64 and float32 leaves mix); when every leaf is a
    scalar, one ``psum`` gathers them all and every shard summarises them, on up
    to :data:`GATHER_DEVICES` shards (on more, the two passes: their bytes do
    not grow with the shard count, except for exact ``quantiles``). Within
    a shard the spread is computed around the shard's own mean, so only the spread
    between shards goes through the shifted sum.

    Args:
        metrics: a pytree of this shard's values.
        axis_name: the mesh axis (or tuple of axes) to reduce over.
        provenance: also ``name/argmax``, ``name/argmin`` and ``name/nan_device``,
            as for :func:`distributed_stats`, in the same two collectives (a
            third ``pmax`` of ``2 K`` values above :data:`GATHER_DEVICES`). Every
            mesh axis must be manual in the shard_map; the mesh's devices come
            from ``jax.set_mesh`` or ``mesh`` (the mesh given to shard_map).
        mesh: the shard_map's mesh, for ``provenance`` outside ``jax.set_mesh``:
            the same devices in the same order (inside shard_map the devices
            cannot be checked against it; under ``jax.set_mesh`` a ``mesh``
            listing other devices is a ValueError).
        quantiles: also ``name/p50``, ... as for :func:`distributed_stats`:
            exact for scalars (one value per shard), from a histogram whose
            counts ride in the psum otherwise; provenance included.

    Returns:
        A :class:`Stats` mapping of ``name/mean``, ``name/max``, ``name/min`` and
        ``name/std`` (and the provenance entries), the same on every device of
        the axis.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxhistory as jh
        >>> n = jax.device_count()
        >>> mesh = jax.make_mesh((n,), ("data",))
        >>> x = jax.device_put(jnp.arange(1.0 * n), NamedSharding(mesh, P("data")))
        >>> f = jax.shard_map(
        ...     lambda v: jh.collective.distributed_stats({"loss": v[0]}, "data"),
        ...     mesh=mesh, in_specs=P("data"), out_specs=P())
        >>> float(jax.jit(f)(x)["loss/max"]) == n - 1
        True
    """
    caller = "distributed_stats_collective"
    provenance = check_provenance(provenance, caller)
    qs, q_names = check_quantiles(quantiles, caller)
    size = bound_axis_size(axis_name, caller)
    axis_name = check_axis_name(axis_name)
    leaves, _ = flatten_metrics(metrics)
    _check_nonempty(leaves)
    wide = not _gathers(size)
    if provenance:
        axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        rank, onehot, holders = _shard_place(shard_tables(axes, mesh, caller))
    else:
        onehot, holders = jnp.arange(size) == lax.axis_index(axis_name), None
    issue = _collective_issue(axis_name)
    # Leaves of one shape are stacked and reduced locally as one array; the local
    # partials of every shape are then joined per accumulation dtype, so each dtype
    # costs one pmax and one psum (and a second pmax, of the lowest ranks, for
    # provenance on more than GATHER_DEVICES shards).
    by_dtype: dict[Any, dict[tuple, list[int]]] = {}
    for i, leaf in enumerate(leaves):
        acc = acc_dtype(leaf.value.dtype)
        by_dtype.setdefault(acc, {}).setdefault(leaf.value.shape, []).append(i)
    parts = []
    for acc, shapes in by_dtype.items():
        idx = [i for group in shapes.values() for i in group]
        xs = [
            jnp.stack([leaves[i].value.astype(acc) for i in group])
            for group in shapes.values()
        ]
        if set(shapes) == {()} and (qs or not wide):  # gathered in one psum
            table, where, _ = _gathered(xs[0], issue, onehot, holders, qs)
        else:
            counts = [
                math.prod(x.shape[1:]) * size for x in xs for _ in range(x.shape[0])
            ]
            place = None
            if provenance:
                assert holders is not None  # from _shard_place with provenance
                place = (
                    rank.astype(acc),
                    None if wide else onehot.astype(acc),
                    holders,
                )
            table, where, _ = _two_pass(
                xs,
                issue,
                jnp.asarray(counts, acc),
                place,
                quantiles=qs,
                source=_one_dtype(leaves[i].value.dtype for i in idx),
            )
        parts.append((idx, table, where))
    stats = _assemble(leaves, parts, provenance)
    if qs:
        stats = Stats(stats.names, stats.table, stats.where, STATS + q_names)
    return stats


def _shard_place(tables) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This shard's rank among its group's devices, its one-hot over the group,
    and the group's device indices (ascending), from the mesh axis indices."""
    position: int | jax.Array = 0
    group: int | jax.Array = 0
    stride, gstride = 1, 1
    for name, size, reduced in reversed(
        list(zip(tables.names, tables.sizes, tables.reduced, strict=True))
    ):
        i = lax.axis_index(name)
        position = position + i * stride
        stride *= size
        if not reduced:
            group = group + i * gstride
            gstride *= size
    rank = jnp.asarray(tables.rank)[position]
    slots = tables.holders.shape[1]
    onehot = (jnp.arange(slots) == rank).astype(jnp.int32)
    holders = jnp.asarray(tables.holders)[group]
    return rank, onehot, holders


def _sharding_of(x: jax.Array) -> Any:
    """``x``'s sharding: from its type under jit, the real one of a concrete
    array (Auto axes included)."""
    if not isinstance(x, jax.core.Tracer) and isinstance(
        getattr(x, "sharding", None), jax.sharding.NamedSharding
    ):
        return x.sharding
    return getattr(jax.typeof(x), "sharding", None)


def shard_count(x: jax.Array) -> int | None:
    """How many devices ``x``'s first axis is split over (the product of the
    mesh axes its sharding names for that axis), or None when that is unknown
    (no named sharding, or a first axis that is not sharded)."""
    sharding = _sharding_of(x)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None or len(spec) == 0 or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return math.prod(mesh.shape[a] for a in axes)


def per_shard(
    x: Any, num_shards: int | None = None, *, reduce: str = "mean"
) -> jax.Array:
    """Turns a per-example array sharded over the batch into one value per shard.

    ``x`` has the batch on axis 0 (shape ``(B, ...)``). It is viewed as
    ``(num_shards, B // num_shards, ...)`` and reduced over everything but the first
    axis, which stays sharded like the batch: no data moves between devices. The
    result, shape ``(num_shards,)``, is what :func:`distributed_stats` expects.
    On a mesh of one device it keeps the batch's mesh axis in its sharding too
    (``P("data")``), which is how History tells it is per device there: one
    device and many record the same names. (Not inside jit on an ``Auto``
    mesh, whose axes are not part of the values' types: use Explicit axes,
    ``jax.make_mesh``'s default, or ``distributed_stats`` in the step.)

    Args:
        x: per-example values, batch first.
        num_shards: how many shards the batch is split into. When omitted it is read
            from ``x``'s sharding, which JAX knows for explicitly sharded arrays
            (``jax.make_mesh``'s default) and for concrete arrays. Under an ``Auto``
            mesh inside jit pass it, e.g. ``mesh.shape["data"]``.
        reduce: "mean" (default), "sum", "max" or "min" within each shard.

    Raises:
        ValueError: the shard count is unknown, disagrees with the sharding, or does
            not divide the batch; or ``reduce`` is unknown.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.per_shard(jnp.array([1.0, 3.0, 5.0, 7.0]), num_shards=2)
        Array([2., 6.], dtype=float32)
    """
    fns = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max, "min": jnp.min}
    if reduce not in fns:
        raise ValueError(
            f"unknown reduce {reduce!r} for per_shard; expected one of {sorted(fns)}"
        )
    leaves, _ = flatten_metrics(x)
    if len(leaves) != 1 or leaves[0].name:
        raise TypeError("per_shard takes one array, not a pytree of them")
    x = leaves[0].value
    if x.ndim == 0:
        raise ValueError(
            "per_shard needs an array with the batch on axis 0, got a scalar"
        )
    known = shard_count(x)
    kept = _one_device_batch_sharding(x) if known == 1 else None
    if num_shards is None:
        if known is None:
            raise ValueError(
                "per_shard cannot tell how many shards the batch has (its sharding is "
                "not known here); pass num_shards=, e.g. mesh.shape['data']"
            )
        num_shards = known
    elif known is not None and known != num_shards:
        raise ValueError(
            f"num_shards={num_shards} but the batch axis is sharded {known} ways"
        )
    if (
        isinstance(num_shards, bool)
        or not isinstance(num_shards, numbers.Integral)
        or num_shards < 1
    ):
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    batch = x.shape[0]
    if batch % num_shards:
        raise ValueError(
            f"a batch of {batch} does not split into {num_shards} equal shards"
        )
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(acc_dtype(x.dtype))
    num_shards = int(num_shards)
    grouped = x.reshape((num_shards, batch // num_shards, *x.shape[1:]))
    out = fns[reduce](grouped, axis=tuple(range(1, grouped.ndim)))
    if kept is not None:  # a mesh of one device: keep the axis the reshape drops
        if _explicit(kept.mesh):
            return jax.sharding.reshard(out, kept)
        return jax.lax.with_sharding_constraint(out, kept)
    return out


def _one_device_batch_sharding(x: jax.Array) -> Any:
    """The sharding of ``x``'s batch axis alone (``P(axes)`` on its mesh),
    where that mesh has one device; else None. The reshape in
    :func:`per_shard` drops a mesh axis of size 1, which tells History that
    the value is per device (on one device as on many)."""
    sharding = _sharding_of(x)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.size != 1 or not getattr(sharding, "spec", None):
        return None
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(sharding.spec[0])
    )


def _explicit(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(t == jax.sharding.AxisType.Explicit for t in types)
