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
from jaxhistory._names import STATS
from jaxhistory._tree import Leaf, acc_dtype, flatten_metrics

__all__ = [
    "STATS",
    "Stats",
    "distributed_stats",
    "distributed_stats_collective",
    "per_shard",
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

    Attributes:
        names: the metric names, one per column.
        table: the ``(4, K)`` array.
    """

    __slots__ = ("_index", "names", "table")

    def __init__(self, names: tuple[str, ...], table: Any):
        self.names = tuple(names)
        self.table = table
        self._index: dict[str, tuple[int, int]] | None = None

    def _keys(self) -> dict[str, tuple[int, int]]:
        if self._index is None:
            self._index = {
                (f"{name}/{stat}" if name else stat): (row, col)
                for col, name in enumerate(self.names)
                for row, stat in enumerate(STATS)
            }
        return self._index

    def __getitem__(self, key: str) -> Any:
        row, col = self._keys()[key]
        return self.table[row, col]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(STATS) * len(self.names)

    def __repr__(self) -> str:
        if isinstance(self.table, np.ndarray | jax.Array) and not isinstance(
            self.table, jax.core.Tracer
        ):
            body = ", ".join(f"{k!r}: {float(v):.6g}" for k, v in self.items())
            return f"Stats({{{body}}})"
        return f"Stats(names={self.names!r}, table={self.table!r})"

    def tree_flatten(self):
        return (self.table,), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, children[0])


def _assemble(leaves: list[Leaf], parts: list[tuple[list[int], jax.Array]]) -> Stats:
    """Joins each group's table into one, with columns in the order of ``leaves``."""
    names = tuple(leaf.name for leaf in leaves)
    if not parts:
        return Stats(names, jnp.zeros((len(STATS), 0), jnp.float32))
    order = [i for idx, _ in parts for i in idx]
    table = jnp.concatenate([t for _, t in parts], axis=1)
    if order != sorted(order):
        table = table[:, np.argsort(order)]
    return Stats(names, table)


def _group_key(leaf: Leaf) -> tuple:
    sharding = getattr(jax.typeof(leaf.value), "sharding", None)
    spec = str(getattr(sharding, "spec", None))
    return (leaf.value.shape, acc_dtype(leaf.value.dtype), spec)


def distributed_stats(metrics: Any) -> Stats:
    """Cross-device mean, max, min and std of every metric (SPMD, inside jit).

    Args:
        metrics: a pytree whose leaves hold the values to summarise, typically one
            value per device or shard (a per-shard loss of shape ``(num_shards,)``
            sharded over the mesh, made with :func:`per_shard`). Statistics are taken
            over all elements of each leaf; a scalar has std 0. bf16/fp16 values
            accumulate in float32.

    Returns:
        A :class:`Stats` mapping, read like a flat dict: ``name/mean``,
        ``name/max``, ``name/min`` and ``name/std`` for every leaf ``name`` (its
        ``/``-joined path). NaN in a leaf makes all four statistics NaN. The values
        are float32 (float64 if a leaf is float64), in one ``(4, K)`` array.

    Leaves of the same shape, dtype and sharding are stacked, so ``K`` of them
    compile to two all-reduces in total (one max, one sum), whatever ``K``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> stats = jax.jit(jh.distributed_stats)({"loss": jnp.array([1.0, 3.0])})
        >>> {k: float(v) for k, v in stats.items()}
        {'loss/mean': 2.0, 'loss/max': 3.0, 'loss/min': 1.0, 'loss/std': 1.0}
        >>> stats.table.shape
        (4, 1)
    """
    leaves, _ = flatten_metrics(metrics)
    _check_nonempty(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(_group_key(leaf), []).append(i)
    parts = []
    for (shape, acc, _), idx in groups.items():
        k = len(idx)
        stacked = jnp.stack([leaves[i].value.astype(acc) for i in idx])
        axes = tuple(range(1, 1 + len(shape)))
        hi, lo, isnan = _clean(stacked)
        ext = jnp.max(jnp.concatenate([hi, lo]), axis=axes)  # all-reduce 1
        c = _shift(ext[:k], -ext[k:])
        d = stacked - c.reshape((k,) + (1,) * len(shape))
        sums = jnp.sum(jnp.concatenate([d, jnp.square(d), isnan]), axis=axes)  # 2
        parts.append((idx, _finish(c, ext, sums, math.prod(shape))))
    return _assemble(leaves, parts)


def distributed_stats_collective(metrics: Any, axis_name: AxisName) -> Stats:
    """Mean, max, min and std of every metric across ``axis_name`` (in shard_map).

    Each leaf is this shard's value (a per-shard loss is a scalar); statistics are
    taken over all elements of all shards. The whole pytree costs one ``pmax`` and
    one ``psum``, whatever the number of leaves (one pair per accumulation dtype, so
    two pairs only when float64 and float32 leaves mix). Within a shard the spread is
    computed around the shard's own mean, so only the spread between shards goes
    through the shifted sum.

    Returns:
        A :class:`Stats` mapping of ``name/mean``, ``name/max``, ``name/min`` and
        ``name/std``, the same on every device of the axis.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxhistory as jh
        >>> n = jax.device_count()
        >>> mesh = jax.make_mesh((n,), ("data",))
        >>> x = jax.device_put(jnp.arange(1.0 * n), NamedSharding(mesh, P("data")))
        >>> f = jax.shard_map(
        ...     lambda v: jh.distributed_stats_collective({"loss": v[0]}, "data"),
        ...     mesh=mesh, in_specs=P("data"), out_specs=P())
        >>> float(jax.jit(f)(x)["loss/max"]) == n - 1
        True
    """
    size = bound_axis_size(axis_name, "distributed_stats_collective")
    axis_name = check_axis_name(axis_name)
    leaves, _ = flatten_metrics(metrics)
    _check_nonempty(leaves)
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
        stacks = []
        for shape, group in shapes.items():
            x = jnp.stack([leaves[i].value.astype(acc) for i in group])
            stacks.append((x, tuple(range(1, 1 + len(shape))), _clean(x)))
        hi = [jnp.max(clean[0], axis=axes) for _, axes, clean in stacks]
        lo = [jnp.max(clean[1], axis=axes) for _, axes, clean in stacks]
        ext = lax.pmax(jnp.concatenate(hi + lo), axis_name)  # collective 1
        k = len(idx)
        c = _shift(ext[:k], -ext[k:])
        s1, spread, nans, counts = [], [], [], []
        offset = 0
        for x, axes, (_, _, isnan) in stacks:
            cg = c[offset : offset + x.shape[0]].reshape((-1,) + (1,) * len(axes))
            offset += x.shape[0]
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
        sums = lax.psum(jnp.concatenate(s1 + spread + nans), axis_name)  # 2
        table = _finish(c, ext, sums, jnp.asarray(counts, acc))
        parts.append((idx, table))
    return _assemble(leaves, parts)


def _num_shards(x: jax.Array) -> int | None:
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
    known = _num_shards(x)
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
