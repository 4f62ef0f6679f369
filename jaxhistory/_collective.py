"""Collective reducers: run inside ``jax.shard_map`` with a named mesh axis.

Inside ``shard_map`` every leaf is the *local* value of one shard. Each reducer first
reduces the leaf over its local elements, then combines the shards with ``lax``
collectives over ``axis_name``. The per-leaf partial results are stacked so that a
whole metrics pytree costs one collective per kind of reduction, not one per leaf.
Results are the same on every device of the axis (``out_specs=P()`` is valid with
``check_vma=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhistory import _ops
from jaxhistory._names import named_leaves
from jaxhistory._tree import Leaf, acc_dtype, check_depth, flatten_metrics

__all__ = [
    "all_gather",
    "collect_from_devices",
    "fused_by_dtype",
    "pmax",
    "pmin",
    "psum",
    "reduce_custom_collective",
    "reduce_max_collective",
    "reduce_mean_collective",
    "reduce_min_collective",
    "reduce_std_collective",
    "reduce_sum_collective",
    "sharded_axes",
    "varying_axes",
    "varying_over_all",
]

AxisName = Hashable | tuple[Hashable, ...]


def check_axis_name(axis_name: Any) -> AxisName:
    """Validates ``axis_name``: a mesh axis name or a tuple of them."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    if axis_name is None or axis_name == ():
        raise ValueError(
            "axis_name is required: the shard_map mesh axis (or tuple of axes) to "
            "reduce over"
        )
    if isinstance(axis_name, tuple):
        if not all(isinstance(a, str) for a in axis_name):
            raise ValueError(f"axis_name {axis_name!r} must hold axis names (str)")
    elif not isinstance(axis_name, str):
        raise ValueError(
            f"axis_name must be a str or a tuple of str, got {axis_name!r}"
        )
    return axis_name


def bound_axis_size(axis_name: Any, caller: str) -> int:
    """Checks ``axis_name`` and that it is bound here; returns the axis size."""
    axis_name = check_axis_name(axis_name)
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis_name {axis_name!r} is not a bound mesh axis: call {caller} inside "
            f"jax.shard_map over a mesh with that axis ({err})"
        ) from None


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which ``x`` differs from device to device
    (its type says so under ``check_vma=True``; empty otherwise)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: the manual-axes type of a value
    varying: Any = getattr(mat, "varying", None) or getattr(aval, "vma", ())
    return frozenset(varying)


def sharded_axes(x: Any) -> tuple[Any, tuple[str, ...]]:
    """The sharding a traced ``x``'s type carries (None where it carries
    none) and the mesh axes its dimensions are split over, in order (empty:
    replicated, or not known)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None) or ()
    axes = tuple(
        a
        for entry in spec
        if entry is not None
        for a in (entry if isinstance(entry, tuple) else (entry,))
    )
    return sharding, axes


def varying_over_all(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """``x`` typed as varying over every axis of ``axis_name``, where it
    varies over some of them and not others (a block sharded over "model"
    only, reduced over ("data", "model")). This moves no data. JAX refuses a
    collective over such a mix (0.12 and later); a value typed as varying
    over nothing (``check_vma=False``, or the same on every device) is
    returned as it is."""
    held = varying_axes(x)
    if held:
        axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        missing = tuple(a for a in axes if a not in held)
        if missing:
            x = lax.pcast(x, missing, to="varying")
    return x


def psum(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """``lax.psum`` of ``x`` over ``axis_name``, where ``x`` may vary over some
    of the axes and not others: each device's copy is counted (see
    :func:`varying_over_all`), as ``lax.psum`` counts a value that varies over
    none."""
    return lax.psum(varying_over_all(x, axis_name), axis_name)


def pmax(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """``lax.pmax`` of ``x`` over ``axis_name``, where ``x`` may vary over some
    of the axes and not others (see :func:`varying_over_all`)."""
    return lax.pmax(varying_over_all(x, axis_name), axis_name)


def pmin(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """``lax.pmin`` of ``x`` over ``axis_name``, where ``x`` may vary over some
    of the axes and not others (see :func:`varying_over_all`)."""
    return lax.pmin(varying_over_all(x, axis_name), axis_name)


def fused_by_dtype(
    reduce: Callable[[jax.Array], jax.Array],
    arrays: Sequence[jax.Array],
    *,
    axis: int = 0,
    flatten: bool = False,
    dtype_of: Callable[[Any], Any] | None = None,
) -> list[jax.Array]:
    """One ``reduce`` call (one collective) per dtype for many arrays.

    The arrays are grouped by dtype (``dtype_of(array)``, default its own),
    each group is packed into one array, ``reduce`` is called on it once, and
    the result is split back into one array per input, in the inputs' order.

    Args:
        reduce: the collective on a packed group (``lax.psum(x, "data")``, ...).
            It may add leading axes (an all-gather's slots): they are kept.
        arrays: the arrays, of any mix of dtypes.
        axis: with ``flatten`` False, the arrays (all of one shape within a
            group) are stacked along ``axis`` and the result is split along it.
        flatten: each array is flattened and the group concatenated along the
            last axis (any shapes); the result is split along its last axis and
            each part reshaped to its leading axes plus the input's shape.
        dtype_of: the grouping key (e.g. an accumulation dtype the inputs are
            cast to).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxhistory._collective import fused_by_dtype
        >>> calls = []
        >>> out = fused_by_dtype(
        ...     lambda x: calls.append(x.shape) or x * 2,
        ...     [jnp.float32(1), jnp.int32(2), jnp.float32(3)],
        ... )
        >>> [int(v) for v in out], calls
        ([2, 4, 6], [(2,), (1,)])
    """
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        key = jnp.dtype(x.dtype) if dtype_of is None else dtype_of(x)
        groups.setdefault(key, []).append(i)
    out: list[Any] = [None] * len(arrays)
    for key, indices in groups.items():
        members = [
            arrays[i] if dtype_of is None else arrays[i].astype(key) for i in indices
        ]
        if flatten:
            flat = [x.reshape(-1) for x in members]
            reduced = reduce(jnp.concatenate(flat))
            lead, offset = reduced.shape[:-1], 0
            for i, x in zip(indices, members, strict=True):
                part = reduced[..., offset : offset + x.size]
                out[i] = part.reshape((*lead, *x.shape))
                offset += x.size
        else:
            reduced = reduce(jnp.stack(members, axis=axis))
            for j, i in enumerate(indices):
                out[i] = lax.index_in_dim(reduced, j, axis, keepdims=False)
    return out


def fused(
    collective: Callable[[jax.Array, AxisName], jax.Array],
    values: Sequence[jax.Array],
    axis_name: AxisName,
) -> list[jax.Array]:
    """Applies ``collective`` to many scalars with one call per dtype.

    The scalars are stacked by dtype, reduced over ``axis_name`` together and split
    again, in their original order.
    """
    return fused_by_dtype(lambda x: collective(x, axis_name), values)


def collective_reduce(
    leaves: list[Leaf],
    ops: list[_ops.ReduceOp],
    axis_name: AxisName,
    weights: list[Any] | None = None,
    masks: list[Any] | None = None,
) -> list[jax.Array]:
    """Reduces each leaf with its op across ``axis_name`` with fused collectives.

    Every "sum"-like partial (means, sums, the first pass of std) goes into one
    ``psum``, maxima into one ``pmax``, minima into one ``pmin``, and the second pass
    of std into one more ``psum``.
    """
    n = len(leaves)
    weights = weights or [None] * n
    masks = masks or [None] * n
    sums: list[jax.Array] = []
    maxs: list[jax.Array] = []
    mins: list[jax.Array] = []
    plan: list[tuple] = []
    for leaf, op, w, m in zip(leaves, ops, weights, masks, strict=True):
        if callable(op):
            plan.append(("call", op))
        elif op in ("mean", "std"):
            total, count = _ops.local_mean_parts(leaf, _ops.weights_for(leaf, w, m))
            plan.append((op, len(sums)))
            sums += [total, count]
        elif op == "sum":
            plan.append(("sum", len(sums)))
            sums.append(_ops.local_sum(leaf))
        elif op == "max":
            parts = _ops.local_extreme_parts(leaf, "max")
            plan.append(("max", len(maxs), len(parts)))
            maxs += parts
        else:
            parts = _ops.local_extreme_parts(leaf, "min")
            plan.append(("min", len(mins), len(parts)))
            mins += parts
    sums = fused(psum, sums, axis_name)
    maxs = fused(pmax, maxs, axis_name)
    mins = fused(pmin, mins, axis_name)

    # Second pass of std: squared deviations from the global mean.
    squares: list[jax.Array] = []
    square_of: dict[int, int] = {}
    for i, (leaf, (kind, *rest)) in enumerate(zip(leaves, plan, strict=True)):
        if kind == "std":
            j = rest[0]
            mean = sums[j] / sums[j + 1]
            x = leaf.value.astype(acc_dtype(leaf.value.dtype))
            square_of[i] = len(squares)
            squares.append(jnp.sum(jnp.square(x - mean)))
    squares = fused(psum, squares, axis_name)

    results = []
    for i, (leaf, (kind, *rest)) in enumerate(zip(leaves, plan, strict=True)):
        if kind == "call":
            results.append(_call(rest[0], leaf, axis_name))
        elif kind == "mean":
            results.append(sums[rest[0]] / sums[rest[0] + 1])
        elif kind == "std":
            results.append(jnp.sqrt(squares[square_of[i]] / sums[rest[0] + 1]))
        elif kind == "sum":
            results.append(sums[rest[0]])
        else:
            found = maxs if kind == "max" else mins
            j, k = rest
            results.append(_ops.finish_extreme(found[j : j + k]))
    return results


def _call(fn: Callable, leaf: Leaf, axis_name: AxisName) -> jax.Array:
    # (typed as varying over every axis reduced: the user's own lax collective
    # over them then takes a block that varies over only some, as ours do)
    value = varying_over_all(leaf.value, axis_name)
    result = _ops.check_scalar(leaf.name, fn(value, axis_name))
    axes = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}
    if axes & varying_axes(result):
        raise ValueError(
            f"the reduction of metric {leaf.name!r} returned a per-device value; a "
            "callable passed to jaxhistory.collective.reduce_custom must reduce "
            f"across {axis_name!r} itself (for example with lax.psum)"
        )
    return result


def _reduce_all(
    metrics: Any, op: str, axis_name: Any, weights: Any = None, mask: Any = None
) -> Any:
    bound_axis_size(axis_name, f"jaxhistory.collective.reduce_{op}")
    axis_name = check_axis_name(axis_name)
    leaves, treedef = flatten_metrics(metrics)
    ws = _ops.per_leaf(weights, leaves, treedef, "weights")
    ms = _ops.per_leaf(mask, leaves, treedef, "mask")
    results = collective_reduce(leaves, [op] * len(leaves), axis_name, ws, ms)
    return jax.tree_util.tree_unflatten(treedef, results)


def reduce_mean_collective(
    metrics: Any, axis_name: AxisName, *, weights: Any = None, mask: Any = None
) -> Any:
    """Mean of every leaf over all shards along ``axis_name`` (inside shard_map).

    The global mean is ``psum(local sum) / psum(local count)``, so it is exact even
    when masks leave different shards with different counts. ``weights`` and
    ``mask`` work as in :func:`jaxhistory.reduce_mean`. All leaves share one ``psum``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxhistory as jh
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> data = NamedSharding(mesh, P("data"))
        >>> x = jax.device_put(jnp.arange(8.0 * jax.device_count()), data)
        >>> f = jax.shard_map(lambda v: jh.collective.reduce_mean({"x": v}, "data"),
        ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
        >>> float(jax.jit(f)(x)["x"]) == float(x.mean())
        True
    """
    return _reduce_all(metrics, "mean", axis_name, weights, mask)


def reduce_sum_collective(metrics: Any, axis_name: AxisName) -> Any:
    """Sum of every leaf over all shards along ``axis_name`` (inside shard_map).

    A value that is the same on every device (not varying over ``axis_name``) is
    counted once per device, as ``lax.psum`` does.
    """
    return _reduce_all(metrics, "sum", axis_name)


def reduce_max_collective(metrics: Any, axis_name: AxisName) -> Any:
    """Maximum of every leaf over all shards along ``axis_name``; NaN propagates."""
    return _reduce_all(metrics, "max", axis_name)


def reduce_min_collective(metrics: Any, axis_name: AxisName) -> Any:
    """Minimum of every leaf over all shards along ``axis_name``; NaN propagates."""
    return _reduce_all(metrics, "min", axis_name)


def reduce_std_collective(metrics: Any, axis_name: AxisName) -> Any:
    """Population std of every leaf over all shards along ``axis_name``.

    Two fused ``psum`` passes (global mean, then squared deviations from it) keep it
    accurate in float32.
    """
    return _reduce_all(metrics, "std", axis_name)


def reduce_custom_collective(
    metrics: Any, reduce_fn: _ops.ReduceSpec, axis_name: AxisName
) -> Any:
    """Reduces each leaf with its own operation across ``axis_name``.

    ``reduce_fn`` follows :func:`jaxhistory.reduce_custom`; a callable here is called
    as ``fn(local_value, axis_name)`` and must return a scalar that is the same on
    every device (reduce across the axis with ``lax.psum``/``pmax``/... yourself);
    a per-device result raises ValueError. ``local_value`` is typed as varying
    over every axis of ``axis_name`` (under ``check_vma=True``), so a ``lax``
    collective over them takes a block that is the same along some: each
    device's copy counts, as in the other reducers.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax import lax
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxhistory as jh
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> data = NamedSharding(mesh, P("data"))
        >>> x = jax.device_put(-jnp.arange(1.0 * jax.device_count()), data)
        >>> absmax = lambda v, ax: lax.pmax(jnp.max(jnp.abs(v)), ax)
        >>> f = jax.shard_map(
        ...     lambda v: jh.collective.reduce_custom(
        ...         {"x": v, "absmax": v}, {"x": "sum", "absmax": absmax}, "data"),
        ...     mesh=mesh, in_specs=P("data"), out_specs=P())
        >>> out = jax.jit(f)(x)
        >>> float(out["absmax"]) == jax.device_count() - 1
        True
    """
    bound_axis_size(axis_name, "jaxhistory.collective.reduce_custom")
    axis_name = check_axis_name(axis_name)
    leaves, treedef = flatten_metrics(metrics)
    ops = _ops.resolve_ops(leaves, reduce_fn)
    results = collective_reduce(leaves, ops, axis_name)
    return jax.tree_util.tree_unflatten(treedef, results)


def all_gather(metrics: Any, axis_name: AxisName) -> Any:
    """Gathers every leaf from all shards along ``axis_name`` (inside shard_map).

    Each leaf gains a leading axis of the axis size, ordered by shard index. Unlike a
    bare ``lax.all_gather``, the result is typed as the same on every device, so it can
    leave ``shard_map`` through ``out_specs=P()`` with ``check_vma=True``: each shard
    writes its value into its own slot of a zero array and one ``psum`` per dtype
    fills in the rest. Split the result per device on the host with
    :func:`collect_from_devices`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxhistory as jh
        >>> n = jax.device_count()
        >>> mesh = jax.make_mesh((n,), ("data",))
        >>> x = jax.device_put(jnp.arange(1.0 * n), NamedSharding(mesh, P("data")))
        >>> f = jax.shard_map(lambda v: jh.all_gather({"x": v[0]}, "data"),
        ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
        >>> jax.jit(f)(x)["x"].shape == (n,)
        True
    """
    size = bound_axis_size(axis_name, "all_gather")
    axis_name = check_axis_name(axis_name)
    index = lax.axis_index(axis_name)
    leaves, treedef = flatten_metrics(metrics)

    def gather(local: jax.Array) -> jax.Array:
        slots = jnp.zeros((size, local.size), local.dtype).at[index].set(local)
        return lax.psum(slots, axis_name)  # every shard's row, on every device

    out = fused_by_dtype(gather, [leaf.value for leaf in leaves], flatten=True)
    return jax.tree_util.tree_unflatten(treedef, out)


def collect_from_devices(metrics: Any) -> Any:
    """Splits per-device values along the leading axis, on the host.

    Args:
        metrics: a pytree whose leaves have one entry per device along axis 0, such as
            the output of :func:`all_gather` or a per-shard array from
            :func:`jaxhistory.per_shard`. The whole tree crosses to the host in one
            transfer. Arrays spread over several processes are gathered with
            ``multihost_utils.process_allgather``, which is collective: every process
            must call this function then.

    Returns:
        The same structure with each leaf replaced by a list of NumPy values, one per
        device.

    Raises:
        TypeError: a leaf is not numeric.
        ValueError: a leaf is a scalar or the leaves disagree on the device count.

    Examples:
        >>> import numpy as np
        >>> import jaxhistory as jh
        >>> jh.collect_from_devices({"loss": np.array([0.5, 0.25])})
        {'loss': [np.float64(0.5), np.float64(0.25)]}
    """
    check_depth(metrics)
    pairs, treedef = named_leaves(metrics)
    names = [name or "<root>" for name, _ in pairs]
    values = [v for _, v in pairs]
    if any(isinstance(v, jax.Array) and not v.is_fully_addressable for v in values):
        from jax.experimental import multihost_utils

        values = multihost_utils.process_allgather(values, tiled=True)
    host = [np.asarray(v) for v in jax.device_get(values)]
    counts = set()
    for name, value in zip(names, host, strict=True):
        if value.dtype.kind not in "biuf" and not jnp.issubdtype(
            value.dtype, jnp.floating
        ):
            raise TypeError(f"metric {name!r} is not numeric (dtype {value.dtype})")
        if value.ndim == 0:
            raise ValueError(
                f"metric {name!r} is a scalar; collect_from_devices needs a leading "
                "device axis"
            )
        counts.add(value.shape[0])
    if len(counts) > 1:
        raise ValueError(
            f"metrics disagree on the number of devices along axis 0: {sorted(counts)}"
        )
    return jax.tree_util.tree_unflatten(treedef, [list(v) for v in host])
