"""Reduction operations shared by the SPMD and the collective reducer families.

Each operation reduces one numeric leaf over all of its elements. The SPMD family
applies it to the global array and lets XLA insert the collectives; the collective
family applies it to the local shard and then combines shards with ``lax`` collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxhistory._tree import Leaf, acc_dtype, check_depth

OPS = ("mean", "sum", "max", "min", "std")

ReduceOp = str | Callable[..., Any]
ReduceSpec = None | ReduceOp | Mapping[str, ReduceOp]


def check_op(op: Any, where: str) -> ReduceOp:
    """Returns ``op`` if it is a known op name or a callable; raises otherwise."""
    if callable(op):
        return op
    if isinstance(op, str) and op in OPS:
        return op
    raise ValueError(
        f"unknown reduction {op!r} for {where}; expected one of "
        f"{', '.join(repr(o) for o in OPS)} or a callable"
    )


def resolve_ops(leaves: list[Leaf], reduce_fn: ReduceSpec) -> list[ReduceOp]:
    """Picks the reduction of every leaf from ``reduce_fn``.

    ``reduce_fn`` is ``None`` (every leaf "mean"), one op for every leaf, or a mapping
    from a leaf name or a ``/``-joined prefix of names (``"train"`` covers
    ``"train/loss"``) to an op. The longest matching name wins; unmatched leaves use
    "mean". A mapping key that names no leaf raises ValueError.
    """
    if reduce_fn is None:
        return ["mean"] * len(leaves)
    if not isinstance(reduce_fn, Mapping):
        op = check_op(reduce_fn, "every metric")
        return [op] * len(leaves)
    spec = {}
    for key, op in reduce_fn.items():
        if not isinstance(key, str):
            raise ValueError(f"reduce_fn keys must be metric names, got {key!r}")
        spec[key] = check_op(op, f"metric {key!r}")
    used: set[str] = set()
    ops: list[ReduceOp] = []
    for leaf in leaves:
        parts = leaf.name.split("/")
        op = "mean"
        for end in range(len(parts), 0, -1):
            prefix = "/".join(parts[:end])
            if prefix in spec:
                op = spec[prefix]
                used.add(prefix)
                break
        ops.append(op)
    unknown = [key for key in spec if key not in used]
    if unknown:
        names = ", ".join(repr(leaf.name) for leaf in leaves) or "none"
        raise ValueError(
            f"reduce_fn names metrics that are not in the metrics: "
            f"{', '.join(repr(k) for k in unknown)} (metrics: {names})"
        )
    return ops


def per_leaf(value: Any, leaves: list[Leaf], treedef: Any, what: str) -> list[Any]:
    """Spreads ``weights=``/``mask=`` over the leaves.

    ``value`` is ``None``, one array-like used for every leaf, or a pytree with the same
    structure as the metrics.
    """
    if value is None:
        return [None] * len(leaves)
    check_depth(value, what)
    structure = jax.tree_util.tree_structure(value)
    if structure == treedef:
        return jax.tree_util.tree_leaves(value)
    if jax.tree_util.treedef_is_leaf(structure):
        return [value] * len(leaves)
    raise ValueError(
        f"{what} must be one array used for every metric or a pytree with the same "
        f"structure as the metrics; got structure {structure} for metrics {treedef}"
    )


def weights_for(leaf: Leaf, weights: Any, mask: Any) -> jax.Array | None:
    """Returns the per-element weights of ``leaf`` (``weights * mask``, broadcast)."""
    if weights is None and mask is None:
        return None
    x = leaf.value
    w = jnp.ones((), acc_dtype(x.dtype))
    try:
        if weights is not None:
            w = jnp.broadcast_to(jnp.asarray(weights, acc_dtype(x.dtype)), x.shape)
            w = _sharded_like(w, x)
        if mask is not None:
            m = jnp.broadcast_to(jnp.asarray(mask).astype(bool), x.shape)
            w = jnp.where(_sharded_like(m, x), w, 0)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"weights/mask for metric {leaf.name or '<root>'!r} do not broadcast "
            "to its shape "
            f"{x.shape}: {err}"
        ) from None
    return jnp.broadcast_to(w, x.shape)


def _spec_of(a: Any) -> tuple | None:
    sharding = getattr(jax.typeof(a), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return None if spec is None else tuple(spec) + (None,) * (a.ndim - len(spec))


def _sharded_like(a: jax.Array, x: jax.Array) -> jax.Array:
    """``a`` (broadcast to ``x``'s shape) resharded like ``x`` where both are
    sharded over Explicit mesh axes in different ways: their product would be
    refused as a sharding clash. Left as it is otherwise (no data moves)."""
    a_spec, x_spec = _spec_of(a), _spec_of(x)
    if a_spec is None or x_spec is None or a_spec == x_spec:
        return a
    if all(e is None for e in a_spec) or all(e is None for e in x_spec):
        return a
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    explicit = jax.sharding.AxisType.Explicit
    if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return a
    return jax.sharding.reshard(a, jax.typeof(x).sharding)


def require_elements(leaf: Leaf, op: str) -> None:
    if leaf.value.size == 0:
        raise ValueError(
            f"metric {leaf.name or '<root>'!r} is empty; its {op} is undefined"
        )


def local_mean_parts(leaf: Leaf, w: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Returns (weighted sum, total weight) of ``leaf`` in its accumulation dtype.

    Masked-out elements (weight 0) are excluded with ``where``, so a NaN that is
    masked out does not reach the result.
    """
    acc = acc_dtype(leaf.value.dtype)
    x = leaf.value.astype(acc)
    if w is None:
        return jnp.sum(x), jnp.asarray(x.size, acc)
    return jnp.sum(jnp.where(w != 0, x * w, 0)), jnp.sum(w)


def local_sum(leaf: Leaf) -> jax.Array:
    """Sums ``leaf``: floats in their accumulation dtype, integers as integers."""
    x = leaf.value
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.sum(x, dtype=acc_dtype(x.dtype))
    return jnp.sum(x)


def _extreme_input(leaf: Leaf, op: str) -> tuple[jax.Array, jax.Array | None]:
    """Returns (values with NaN replaced by the op's identity, NaN flags or None).

    Cross-device max/min all-reduces do not propagate NaN (the CPU and GPU runtimes
    compare with an ordinary ``<``), so NaN is carried as a separate flag that is
    reduced with the same op and put back at the end.
    """
    require_elements(leaf, op)
    x = leaf.value
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x, None
    x = x.astype(acc_dtype(x.dtype))
    isnan = jnp.isnan(x)
    fill = -jnp.inf if op == "max" else jnp.inf
    flag = isnan.astype(x.dtype)
    return jnp.where(isnan, fill, x), flag if op == "max" else -flag


def _with_nan(value: jax.Array, flag: jax.Array) -> jax.Array:
    return jnp.where(flag != 0, jnp.nan, value)


def global_extreme(leaf: Leaf, op: str) -> jax.Array:
    """Max or min of ``leaf`` over all elements (SPMD), NaN propagating.

    The values and their NaN flags are stacked and reduced together, so a sharded
    leaf costs one all-reduce.
    """
    red = jnp.max if op == "max" else jnp.min
    clean, flag = _extreme_input(leaf, op)
    if flag is None:
        return red(clean)
    both = red(jnp.stack([clean, flag]), axis=tuple(range(1, clean.ndim + 1)))
    return _with_nan(both[0], both[1])


def local_extreme_parts(leaf: Leaf, op: str) -> list[jax.Array]:
    """Local [extreme] or [extreme, NaN flag] of a shard, for a fused pmax/pmin."""
    red = jnp.max if op == "max" else jnp.min
    clean, flag = _extreme_input(leaf, op)
    return [red(clean)] if flag is None else [red(clean), red(flag)]


def finish_extreme(parts: list[jax.Array]) -> jax.Array:
    """Combines the reduced output of :func:`local_extreme_parts`."""
    return parts[0] if len(parts) == 1 else _with_nan(parts[0], parts[1])


def check_scalar(name: str, result: Any) -> jax.Array:
    """Ensures a callable reduction returned one value, not an unreduced array."""
    try:
        result = jnp.asarray(result)
    except (TypeError, ValueError):
        raise TypeError(
            f"the reduction of metric {name!r} returned a {type(result).__name__}; "
            "a reduction must return a scalar"
        ) from None
    if result.ndim != 0:
        raise ValueError(
            f"the reduction of metric {name!r} returned shape {result.shape}; "
            "a reduction must return a scalar"
        )
    return result
