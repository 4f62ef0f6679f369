"""distributed_stats: mean, max, min and std of many metrics in two collectives.

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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhistory._collective import AxisName, bound_axis_size, check_axis_name
from jaxhistory._names import PROVENANCE, STATS
from jaxhistory._provenance import (
    Layout,
    check_provenance,
    layout_of,
    positional_layout,
    shard_tables,
)
from jaxhistory._tree import Leaf, acc_dtype, flatten_metrics

__all__ = [
    "PROVENANCE",
    "STATS",
    "Stats",
    "distributed_stats",
    "distributed_stats_collective",
    "per_shard",
    "shard_count",
]


def _check_nonempty(leaves: list[Leaf]) -> None:
    for leaf in leaves:
        if leaf.value.size == 0:
            raise ValueError(f"metric {leaf.name!r} is empty; it has no statistics")


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


def _finish(c: jax.Array, ext: jax.Array, sums: jax.Array, counts: Any) -> jax.Array:
    """Turns one group's reduced partials into a ``(4, k)`` table of STATS.

    ``c`` is the shift of each of the ``k`` leaves, ``ext`` the reduced
    ``[max, -min]`` (``2k``), ``sums`` the reduced ``[sum(x - c), sum((x - c)^2),
    NaN count]`` (``3k``) and ``counts`` the number of values of each leaf.
    """
    k = c.shape[0]
    mx, mn = ext[:k], -ext[k:]
    s1, s2, nans = sums[:k], sums[k : 2 * k], sums[2 * k :]
    d = s1 / counts
    var = jnp.maximum(s2 / counts - jnp.square(d), 0)
    has_nan = nans > 0
    return jnp.stack(
        [
            c + d,
            jnp.where(has_nan, jnp.nan, mx),
            jnp.where(has_nan, jnp.nan, mn),
            jnp.sqrt(var),
        ]
    )


@jax.tree_util.register_pytree_node_class
class Stats(Mapping):
    """The flat mapping returned by :func:`distributed_stats`.

    It maps ``"name/mean"``, ``"name/max"``, ``"name/min"`` and ``"name/std"`` to
    values, like a dict, but holds them in one ``(4, K)`` array (rows in
    :data:`STATS` order, one column per metric). As a pytree it has that one leaf,
    so a jitted step that returns it hands back one buffer instead of ``4 * K``
    scalars, and ``jax.device_get(stats)`` fetches everything in one transfer.
    With provenance it also maps ``"name/argmax"``, ``"name/argmin"`` and
    ``"name/nan_device"`` to device indices, held in a second, int32 ``(3, K)``
    array (rows in :data:`PROVENANCE` order).

    Attributes:
        names: the metric names, one per column.
        table: the ``(4, K)`` array.
        where: the ``(3, K)`` int32 array of device indices, or None.
    """

    __slots__ = ("_index", "names", "table", "where")

    def __init__(self, names: tuple[str, ...], table: Any, where: Any = None):
        self.names = tuple(names)
        self.table = table
        self.where = where
        self._index: dict[str, tuple[int, int, int]] | None = None

    def _keys(self) -> dict[str, tuple[int, int, int]]:
        if self._index is None:
            rows = [(0, STATS)] + ([(1, PROVENANCE)] if self.where is not None else [])
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
        rows = len(STATS) + (len(PROVENANCE) if self.where is not None else 0)
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
            return (self.table,), (self.names, False)
        return (self.table, self.where), (self.names, True)

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, provenance = aux
        return cls(names, children[0], children[1] if provenance else None)


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


def _where(
    nan_ext: jax.Array, at_max: jax.Array, at_min: jax.Array, holders: jax.Array
) -> jax.Array:
    """The ``(3, k)`` int32 device indices from one group's reduced partials.

    ``nan_ext`` is the reduced ``max(-rank)`` over NaN elements (``-inf`` where
    none), ``at_max``/``at_min`` the reduced ``(k, S)`` counts, per holder, of
    elements equal to the max/min, and ``holders`` the ``S`` device indices in
    ascending order (or ``(k, S)``). The first holder with a count is the lowest
    device index; a NaN makes every index the NaN's device.
    """
    has_nan = nan_ext > -jnp.inf
    nan_rank = jnp.where(has_nan, -nan_ext, 0).astype(jnp.int32)
    holders = jnp.broadcast_to(holders, at_max.shape)

    def pick(rank):
        return jnp.take_along_axis(holders, rank[:, None], axis=1)[:, 0]

    nan_device = jnp.where(has_nan, pick(nan_rank), -1)
    first_max = pick(jnp.argmax(at_max > 0, axis=1).astype(jnp.int32))
    first_min = pick(jnp.argmax(at_min > 0, axis=1).astype(jnp.int32))
    return jnp.stack(
        [
            jnp.where(has_nan, nan_device, first_max),
            jnp.where(has_nan, nan_device, first_min),
            nan_device,
        ]
    ).astype(jnp.int32)


def _group_key(leaf: Leaf) -> tuple:
    sharding = getattr(jax.typeof(leaf.value), "sharding", None)
    spec = str(getattr(sharding, "spec", None))
    return (leaf.value.shape, acc_dtype(leaf.value.dtype), spec)


def distributed_stats(
    metrics: Any, provenance: bool = False, *, mesh: Any = None
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
            all-reduces per group of leaves. Under jit it reads each value's
            sharding from its type, which is exact on Explicit mesh axes
            (``jax.make_mesh``'s default), and the mesh's devices from
            ``jax.set_mesh`` or ``mesh``.
        mesh: the mesh the values are on, for ``provenance`` under jit outside
            ``jax.set_mesh``. Its devices in another order than the values'
            mesh's (or other devices) make jit refuse to compile the call,
            rather than name the wrong device.

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
    gathered whole in one all-reduce instead and summarised on every device.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> stats = jax.jit(jh.distributed_stats)({"loss": jnp.array([1.0, 3.0])})
        >>> {k: float(v) for k, v in stats.items()}
        {'loss/mean': 2.0, 'loss/max': 3.0, 'loss/min': 1.0, 'loss/std': 1.0}
        >>> stats.table.shape
        (4, 1)
    """
    provenance = check_provenance(provenance, "distributed_stats")
    leaves, _ = flatten_metrics(metrics)
    _check_nonempty(leaves)
    if provenance:
        layouts = []
        for lf in leaves:
            layout, lf.value = layout_of(lf.value, mesh, "distributed_stats")
            layouts.append(layout)
    else:  # which values share a device: one collective for per-device values
        layouts = [positional_layout(lf.value) for lf in leaves]
    return global_stats(leaves, layouts, provenance=provenance)[0]


def global_stats(
    leaves: list[Leaf],
    layouts: list[Layout | None] | None,
    gather: frozenset = frozenset(),
    provenance: bool = True,
) -> tuple[Stats, dict[int, jax.Array]]:
    """:func:`distributed_stats` on flattened leaves.

    ``layouts`` says where each leaf's elements are (None where unknown); with
    ``provenance`` every leaf needs one and the device indices are computed.
    A group of leaves with one element per holder (a per-device value, a host
    scalar per device) is gathered whole in one all-reduce and summarised on
    every device; others take the two-pass form. ``gather``: indices of leaves
    whose per-holder values are also returned (``{index: (S,) values}``, the
    value each holder's elements share), at no extra collective.
    """
    layouts = layouts or [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if layouts[i] is not None:  # the same placement: stacked at no cost
            v = leaf.value
            key = (v.shape, acc_dtype(v.dtype), layouts[i].key)
        else:
            key = _group_key(leaf)
        groups.setdefault(key, []).append(i)
    parts, gathered = [], {}
    for (shape, acc, *_), idx in groups.items():
        stacked = jnp.stack([leaves[i].value.astype(acc) for i in idx])
        layout = layouts[idx[0]]
        picks = [j for j, i in enumerate(idx) if i in gather]
        if layout is not None and layout.rank.size == len(layout.holders):
            table, where, values = _gathered_group(stacked, shape, layout, picks)
        else:
            table, where, values = _global_group(
                stacked, shape, layout if provenance or picks else None, picks
            )
        parts.append((idx, table, where))
        gathered.update({idx[j]: v for j, v in zip(picks, values, strict=True)})
    return _assemble(leaves, parts, provenance), gathered


def _gathered_group(
    stacked: jax.Array, shape: tuple, layout: Layout, picks: list[int]
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """A group whose every holder has exactly one element: one sum-reduction
    puts every value in its holder's slot (ascending device index), on every
    device; the statistics and indices are then computed locally."""
    k = stacked.shape[0]
    axes = tuple(range(2, 2 + len(shape)))
    onehot = jnp.asarray(layout.onehot)[None]  # (1, S, *shape)
    expand = (k, 1, *shape)
    # where, not a product: NaN or inf times 0 would spread to every slot
    v = jnp.sum(jnp.where(onehot, stacked.reshape(expand), 0), axis=axes)  # 1
    table, where = _summarise(v, jnp.asarray(layout.holders))
    return table, where, [v[j] for j in picks]


def _summarise(v: jax.Array, holders: jax.Array | None) -> tuple[jax.Array, Any]:
    """The ``(4, k)`` statistics of ``k`` gathered rows of values, one value per
    holder (``holders``: their device indices in ascending order, or None for
    no indices), and the ``(3, k)`` device indices."""
    mean = jnp.mean(v, axis=1)
    std = jnp.sqrt(jnp.mean(jnp.square(v - mean[:, None]), axis=1))
    table = jnp.stack([mean, jnp.max(v, axis=1), jnp.min(v, axis=1), std])
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


def _global_group(
    stacked: jax.Array, shape: tuple, layout: Layout | None, picks: list[int]
) -> tuple[jax.Array, Any, list[jax.Array]]:
    """One group of ``k`` stacked leaves: its ``(4, k)`` table, its ``(3, k)``
    device indices (with a layout) and the per-holder values of ``picks``."""
    k = stacked.shape[0]
    axes = tuple(range(1, 1 + len(shape)))
    hi, lo, isnan = _clean(stacked)
    maxed = [hi, lo]
    if layout is not None:
        rank = jnp.asarray(layout.rank, stacked.dtype)
        maxed.append(jnp.where(isnan > 0, -rank, -jnp.inf))
    ext = jnp.max(jnp.concatenate(maxed), axis=axes)  # all-reduce 1
    c = _shift(ext[:k], -ext[k : 2 * k])
    d = stacked - c.reshape((k,) + (1,) * len(shape))
    summed = [d, jnp.square(d), isnan]
    if layout is not None:
        slots = len(layout.holders)
        onehot = jnp.asarray(layout.onehot, stacked.dtype)[None]
        expand = (k,) + (1,) * len(shape)
        at_max = stacked == ext[:k].reshape(expand)
        at_min = stacked == -ext[k : 2 * k].reshape(expand)
        for mask in (at_max, at_min):
            summed.append(
                (mask.astype(stacked.dtype)[:, None] * onehot).reshape(
                    (k * slots, *shape)
                )
            )
        if picks:
            chosen = stacked[np.asarray(picks)]
            summed.append(  # where, not a product: NaN * 0 would spread
                jnp.where(onehot > 0, chosen[:, None], 0).reshape(
                    (len(picks) * slots, *shape)
                )
            )
    sums = jnp.sum(jnp.concatenate(summed), axis=axes)  # all-reduce 2
    table = _finish(c, ext[: 2 * k], sums[: 3 * k], math.prod(shape))
    if layout is None:
        return table, None, []
    counts = sums[3 * k :].reshape(-1, slots)
    where = _where(
        ext[2 * k :], counts[:k], counts[k : 2 * k], jnp.asarray(layout.holders)
    )
    if not picks:
        return table, where, []
    per_slot = np.maximum(layout.onehot.reshape(slots, -1).sum(axis=1), 1)
    values = counts[2 * k :] / jnp.asarray(per_slot, stacked.dtype)
    return table, where, [values[j] for j in range(len(picks))]


def distributed_stats_collective(
    metrics: Any, axis_name: AxisName, provenance: bool = False, *, mesh: Any = None
) -> Stats:
    """Mean, max, min and std of every metric across ``axis_name`` (in shard_map).

    Each leaf is this shard's value (a per-shard loss is a scalar); statistics are
    taken over all elements of all shards. The whole pytree costs one ``pmax`` and
    one ``psum``, whatever the number of leaves (one pair per accumulation dtype, so
    two pairs only when float64 and float32 leaves mix); when every leaf is a
    scalar, one ``psum`` gathers them all and every shard summarises them. Within
    a shard the spread is computed around the shard's own mean, so only the spread
    between shards goes through the shifted sum.

    Args:
        metrics: a pytree of this shard's values.
        axis_name: the mesh axis (or tuple of axes) to reduce over.
        provenance: also ``name/argmax``, ``name/argmin`` and ``name/nan_device``,
            as for :func:`distributed_stats`, in the same two collectives. Every
            mesh axis must be manual in the shard_map; the mesh's devices come
            from ``jax.set_mesh`` or ``mesh`` (the mesh given to shard_map).
        mesh: the shard_map's mesh, for ``provenance`` outside ``jax.set_mesh``:
            the same devices in the same order (inside shard_map the devices
            cannot be checked against it; under ``jax.set_mesh`` a ``mesh``
            listing other devices is a ValueError).

    Returns:
        A :class:`Stats` mapping of ``name/mean``, ``name/max``, ``name/min`` and
        ``name/std`` (and the provenance entries), the same on every device of
        the axis.

    Example:
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
    size = bound_axis_size(axis_name, caller)
    axis_name = check_axis_name(axis_name)
    leaves, _ = flatten_metrics(metrics)
    _check_nonempty(leaves)
    place = None
    if provenance:
        axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        place = _shard_place(shard_tables(axes, mesh, caller))
    # Leaves of one shape are stacked and reduced locally as one array; the local
    # partials of every shape are then joined per accumulation dtype, so each dtype
    # costs one pmax and one psum.
    by_dtype: dict[Any, dict[tuple, list[int]]] = {}
    for i, leaf in enumerate(leaves):
        acc = acc_dtype(leaf.value.dtype)
        by_dtype.setdefault(acc, {}).setdefault(leaf.value.shape, []).append(i)
    parts = []
    for acc, shapes in by_dtype.items():
        idx = [i for group in shapes.values() for i in group]
        if set(shapes) == {()}:  # one value per shard: gathered in one psum
            x = jnp.stack([leaves[i].value.astype(acc) for i in idx])
            if place is None:
                slot, slots, holders = lax.axis_index(axis_name), size, None
            else:
                slot, slots, holders = place[0], place[1].shape[0], place[2]
            mine = jnp.arange(slots) == slot
            v = lax.psum(jnp.where(mine[None], x[:, None], 0), axis_name)  # 1
            parts.append((idx, *_summarise(v, holders)))
            continue
        stacks = []
        for shape, group in shapes.items():
            x = jnp.stack([leaves[i].value.astype(acc) for i in group])
            stacks.append((x, tuple(range(1, 1 + len(shape))), _clean(x)))
        hi = [jnp.max(clean[0], axis=axes) for _, axes, clean in stacks]
        lo = [jnp.max(clean[1], axis=axes) for _, axes, clean in stacks]
        maxed = hi + lo
        if place is not None:
            rank = place[0].astype(acc)
            maxed += [
                jnp.where(jnp.any(isnan > 0, axis=axes), -rank, -jnp.inf)
                for _, axes, (_, _, isnan) in stacks
            ]
        ext = lax.pmax(jnp.concatenate(maxed), axis_name)  # collective 1
        k = len(idx)
        c = _shift(ext[:k], -ext[k : 2 * k])
        s1, spread, nans, counts, at = [], [], [], [], [[], []]
        offset = 0
        for x, axes, (_, _, isnan) in stacks:
            sl = slice(offset, offset + x.shape[0])
            cg = c[sl].reshape((-1,) + (1,) * len(axes))
            n = math.prod(x.shape[1:])
            # Shift first, then centre on the shard's mean of the shifted values:
            # the rounding of a mean of unshifted values would be multiplied by
            # n * |mean - c| in the between-shard term.
            d = x - cg
            local_mean = jnp.mean(d, axis=axes, keepdims=True)
            m2 = jnp.sum(jnp.square(d - local_mean), axis=axes)
            s1.append(jnp.sum(d, axis=axes))
            spread.append(m2 + n * jnp.square(local_mean).reshape(-1))
            nans.append(jnp.sum(isnan, axis=axes))
            counts += [n * size] * x.shape[0]
            if place is not None:
                expand = (-1,) + (1,) * len(axes)
                for j, ex in enumerate((ext[:k][sl], -ext[k : 2 * k][sl])):
                    held = jnp.any(x == ex.reshape(expand), axis=axes).astype(acc)
                    at[j].append(held[:, None] * place[1].astype(acc))
            offset += x.shape[0]
        summed = s1 + spread + nans
        if place is not None:
            summed += [jnp.concatenate(a).reshape(-1) for a in at]
        sums = lax.psum(jnp.concatenate(summed), axis_name)  # 2
        table = _finish(c, ext[: 2 * k], sums[: 3 * k], jnp.asarray(counts, acc))
        where = None
        if place is not None:
            held = sums[3 * k :].reshape(2, k, -1)
            where = _where(ext[2 * k :], held[0], held[1], place[2])
        parts.append((idx, table, where))
    return _assemble(leaves, parts, place is not None)


def _shard_place(tables) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This shard's rank among its group's devices, its one-hot over the group,
    and the group's device indices (ascending), from the mesh axis indices."""
    position, group, stride, gstride = 0, 0, 1, 1
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


def shard_count(x: jax.Array) -> int | None:
    """How many devices ``x``'s first axis is split over (the product of the
    mesh axes its sharding names for that axis), or None when that is unknown
    (no named sharding, or a first axis that is not sharded)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(x, jax.core.Tracer) and isinstance(
        getattr(x, "sharding", None), jax.sharding.NamedSharding
    ):
        sharding = x.sharding  # concrete: the real sharding, Auto axes included
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

    Example:
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
    return fns[reduce](grouped, axis=tuple(range(1, grouped.ndim)))
