"""SPMD reducers: run inside ``jax.jit`` / ``nnx.jit`` on global arrays.

The inputs are global (possibly sharded) arrays; each leaf is reduced over all of its
elements and XLA inserts whatever collectives the sharding needs. The result has the
structure of the input with a scalar in place of every leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxhistory import _ops
from jaxhistory._tree import Leaf, acc_dtype, flatten_metrics, map_leaves

__all__ = [
    "reduce_custom",
    "reduce_max",
    "reduce_mean",
    "reduce_min",
    "reduce_std",
    "reduce_sum",
]


def _std(leaf: Leaf) -> jax.Array:
    # Two passes over the data: the mean first, then the mean squared deviation.
    # The one-pass E[x^2] - E[x]^2 loses every digit for values like 1e4 +- 1.
    x = leaf.value.astype(acc_dtype(leaf.value.dtype))
    mean = jnp.mean(x)
    return jnp.sqrt(jnp.mean(jnp.square(x - mean)))


def _apply(op: _ops.ReduceOp, leaf: Leaf, weights: Any = None, mask: Any = None):
    if callable(op):
        return _ops.check_scalar(leaf.name, op(leaf.value))
    if op == "mean":
        total, count = _ops.local_mean_parts(
            leaf, _ops.weights_for(leaf, weights, mask)
        )
        return total / count
    if op == "sum":
        return _ops.local_sum(leaf)
    if op in ("max", "min"):
        return _ops.global_extreme(leaf, op)
    return _std(leaf)


def reduce_mean(metrics: Any, *, weights: Any = None, mask: Any = None) -> Any:
    """Mean of every leaf over all its elements (and so over all devices).

    Args:
        metrics: a pytree of numbers or arrays (Python numbers, NumPy or JAX arrays).
            Each leaf is reduced over all its elements; a scalar is its own mean.
        weights: optional weights, one array used for every leaf or a pytree shaped
            like ``metrics``; broadcast against each leaf. The result is
            ``sum(v * w) / sum(w)``.
        mask: optional boolean mask, broadcast like ``weights``. Masked-out elements
            are excluded from both the sum and the count (a masked-out NaN does not
            poison the mean). A leaf whose elements are all masked out gives NaN.

    Returns:
        A pytree shaped like ``metrics`` with a scalar per leaf, float32 for
        bfloat16/float16/float32/integer inputs (float64 stays float64). The
        sum is not rescaled: past float32's largest value (3.4e38) the mean
        is ``inf``; :func:`~jaxhistory.distributed_stats` stays finite there.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jax.jit(jh.reduce_mean)({"loss": jnp.array([1.0, 2.0, 3.0, 6.0])})
        {'loss': Array(3., dtype=float32)}
        >>> jh.reduce_mean(jnp.array([1.0, 2.0, 9.0]), mask=jnp.array([1, 1, 0]))
        Array(1.5, dtype=float32)
    """
    leaves, treedef = flatten_metrics(metrics)
    ws = _ops.per_leaf(weights, leaves, treedef, "weights")
    ms = _ops.per_leaf(mask, leaves, treedef, "mask")
    results = [
        _apply("mean", lf, w, m) for lf, w, m in zip(leaves, ws, ms, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, results)


def reduce_sum(metrics: Any) -> Any:
    """Sum of every leaf over all its elements.

    Floats accumulate in float32 at least; integers (and booleans, as 0/1) keep an
    integer dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.reduce_sum({"tokens": jnp.array([3, 4, 5])})
        {'tokens': Array(12, dtype=int32)}
    """
    leaves, treedef = flatten_metrics(metrics)
    return map_leaves(lambda lf: _apply("sum", lf), leaves, treedef)


def reduce_max(metrics: Any) -> Any:
    """Maximum of every leaf over all its elements; NaN propagates.

    Raises:
        ValueError: a leaf has no elements.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.reduce_max({"grad_norm": jnp.array([0.5, 2.0, 1.0])})
        {'grad_norm': Array(2., dtype=float32)}
    """
    leaves, treedef = flatten_metrics(metrics)
    return map_leaves(lambda lf: _apply("max", lf), leaves, treedef)


def reduce_min(metrics: Any) -> Any:
    """Minimum of every leaf over all its elements; NaN propagates.

    Raises:
        ValueError: a leaf has no elements.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.reduce_min({"grad_norm": jnp.array([0.5, 2.0, 1.0])})
        {'grad_norm': Array(0.5, dtype=float32)}
    """
    leaves, treedef = flatten_metrics(metrics)
    return map_leaves(lambda lf: _apply("min", lf), leaves, treedef)


def reduce_std(metrics: Any) -> Any:
    """Population standard deviation (ddof=0) of every leaf over all its elements.

    Computed in two passes (mean, then mean squared deviation), so it stays accurate
    in float32 when the mean is large next to the spread. A scalar's std is 0.
    Not rescaled: where a deviation passes 1.8e19 in float32 (its square
    overflows), or the mean's sum passes 3.4e38, the std is ``inf``; where
    every deviation is below about 1e-19 (its square is flushed to zero) it
    is 0. :func:`~jaxhistory.distributed_stats` scales and gives NumPy's std
    in both cases.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.reduce_std({"loss": jnp.array([1e4 - 1, 1e4 + 1])})
        {'loss': Array(1., dtype=float32)}
    """
    leaves, treedef = flatten_metrics(metrics)
    return map_leaves(lambda lf: _apply("std", lf), leaves, treedef)


def reduce_custom(metrics: Any, reduce_fn: _ops.ReduceSpec = None) -> Any:
    """Reduces each leaf with its own operation.

    Args:
        metrics: a pytree of numbers or arrays.
        reduce_fn: ``None`` ("mean" for every leaf), one operation for every leaf, or
            a mapping from a metric name to an operation. Names are leaf paths joined
            with ``/`` (``"train/loss"``) or a prefix of them (``"train"`` covers every
            leaf under ``train``); the longest match wins and unmatched leaves use
            "mean". An operation is "mean", "sum", "max", "min", "std" or a callable
            that takes the leaf array and returns a scalar.

    Raises:
        ValueError: an unknown operation, a name that is not in ``metrics``, or a
            callable that returned more than one value.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> m = {"loss": jnp.array([1.0, 3.0]), "tokens": jnp.array([10, 20])}
        >>> jh.reduce_custom(m, {"tokens": "sum"})
        {'loss': Array(2., dtype=float32), 'tokens': Array(30, dtype=int32)}
    """
    leaves, treedef = flatten_metrics(metrics)
    ops = _ops.resolve_ops(leaves, reduce_fn)
    results = [_apply(op, lf) for op, lf in zip(ops, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, results)
