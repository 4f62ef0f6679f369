"""watch: statistics of every leaf of a pytree (gradients, parameters, optimizer
updates, sown activations) inside a jitted step, in at most two all-reduces.

Each leaf (or group of leaves, or layer of a stacked leaf) is a *column*. On
each device, the values it holds of a column go into two small tables: one of
maxima (``max |x|``, ``max x``, ``-min x``) and one of sums (``x^2``, zeros,
non-finite values, and, for mean and std, ``x - c`` and ``(x - c)^2`` with ``c``
the column's midrange from the maxima). The max table of every column goes
through one ``pmax`` and the sum table through one ``psum``, whatever the
number of leaves. A leaf held whole by several devices (replicated over a mesh
axis) counts once: only the copy at index 0 of each such axis adds to the
tables. Under ``jit`` the leaves are global arrays and the tables are made in a
``shard_map`` over their mesh, from each leaf's sharding; where every leaf is
replicated, nothing is all-reduced, or, for a large tree, each leaf is read on
one device and the tables are summed in one ``psum`` (:func:`_spread`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhistory._collective import (
    AxisName,
    bound_axis_size,
    check_axis_name,
    varying_axes,
)
from jaxhistory._names import WATCH_STATS, check_depth, path_name
from jaxhistory._stats import Stats, shift_scale
from jaxhistory._tree import acc_dtype, flatten_metrics

__all__ = ["DEFAULT_WATCH", "WATCH_STATS", "watch", "watch_collective"]

DEFAULT_WATCH = ("norm", "rms", "max_abs", "zero_frac", "nonfinite")
_SHIFTED = frozenset({"mean", "std"})  # the statistics that need the shifted sums


class _Part(NamedTuple):
    """How one leaf adds to the tables: its first column, how many columns it
    fills (its layers when split, else 1), and the mesh axes it is sharded
    over (of its leading axis apart, when split)."""

    column: int
    layers: int | None  # None: the whole leaf is one column
    lead_axes: tuple[str, ...]  # mesh axes its leading (layer) axis is split over
    axes: frozenset  # every mesh axis its values vary over


def _check_stats(stats: Any) -> tuple[str, ...]:
    if isinstance(stats, str):
        stats = (stats,)
    try:
        stats = tuple(stats)
    except TypeError:
        raise TypeError(
            f"watch: stats must be a sequence of names from {WATCH_STATS}, got "
            f"{stats!r:.60}"
        ) from None
    unknown = [s for s in stats if s not in WATCH_STATS]
    if unknown or not stats:
        raise ValueError(
            f"watch: unknown statistic(s) {unknown!r}; choose from {WATCH_STATS}"
            if unknown
            else f"watch: stats is empty; choose from {WATCH_STATS}"
        )
    return tuple(dict.fromkeys(stats))


def _patterns(value: Any, what: str) -> tuple[str, ...]:
    if value is None or value is False:
        return ()
    if value is True:
        return ("**",)
    if isinstance(value, str):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        items = (value,)  # refused below, naming it
    if not all(isinstance(p, str) and p for p in items):
        raise TypeError(f"watch: {what} must be glob patterns (str), got {value!r:.80}")
    return items


def _match(pattern: str, path: str) -> str | None:
    """The part of ``path`` that ``pattern`` matches, segment by segment from
    the start (the path may go on); ``**`` matches the whole path."""
    if pattern == "**":
        return path
    want, have = pattern.split("/"), path.split("/")
    if len(have) < len(want):
        return None
    if all(fnmatch.fnmatchcase(h, w) for h, w in zip(have, want, strict=False)):
        return "/".join(have[: len(want)])
    return None


def _leaves(tree: Any) -> list[tuple[str, jax.Array]]:
    """``[(path, value)]``: names joined with ``/``, an nnx Variable's
    ``.value`` left out of its name; values checked and made arrays."""
    check_depth(tree)
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    if not pairs:
        raise ValueError("watch: the tree has no leaves (nothing to watch)")
    out, seen = [], set()
    for path, value in pairs:
        last = path[-1] if path else None
        if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "value":
            path = path[:-1]  # a Variable's value: named as the Variable
        name = path_name(path)
        if value is None:
            raise TypeError(f"watch: leaf {name or '<root>'!r} is None, not an array")
        if name in seen:
            raise ValueError(f"watch: two leaves are named {name!r}")
        if not name and len(pairs) > 1:  # its entries would be the total's
            raise ValueError(
                "watch: a leaf has an empty name (a dict key ''); name it, or "
                "watch it alone"
            )
        seen.add(name)
        leaf = flatten_metrics({"": value} if not name else {name: value})[0][0]
        out.append((name, leaf.value))
    return out


def _spec_axes(spec: Any, ndim: int) -> list[tuple[str, ...]]:
    """The mesh axes each dimension is sharded over."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out: list[tuple[str, ...]] = []
    for e in entries[:ndim]:
        if e is None:
            out.append(())
        elif isinstance(e, tuple):
            out.append(tuple(e))
        else:
            out.append((e,))
    return out


class _Plan(NamedTuple):
    names: tuple[str, ...]  # column names, the global one last
    parts: list[_Part]
    counts: np.ndarray  # values per column (global), the global column last
    dtype: Any


class _Where(NamedTuple):
    """Where a leaf's values are: the mesh axes its leading axis is split
    over, every mesh axis its values differ over, and how many blocks like
    this one make the whole leaf (1 for a global array)."""

    lead: tuple[str, ...]
    axes: frozenset
    copies: int


def _plan(
    leaves: list[tuple[str, jax.Array]],
    wheres: list[_Where],
    prefix: str,
    split: tuple[str, ...],
    groups: tuple[str, ...],
) -> _Plan:
    columns: dict[str, int] = {}
    layers_of: dict[str, int | None] = {}
    counts: list[int] = []
    parts: list[_Part] = []
    used = dict.fromkeys(groups, False)
    matched = dict.fromkeys(groups, False)  # by a leaf, taken or not
    splits = dict.fromkeys(split, False)
    for (name, value), where in zip(leaves, wheres, strict=True):
        base, taken = name, False
        for pattern in groups:
            found = _match(pattern, name)
            if found is not None:
                matched[pattern] = True
                if not taken:  # a leaf takes the first pattern that matches
                    base, used[pattern], taken = found, True, True
        layers = None
        hits = [p for p in split if _match(p, name) is not None]
        splits.update(dict.fromkeys(hits, True))
        if value.ndim >= 1 and hits:
            layers = value.shape[0]
        if base in layers_of and layers_of[base] != layers:
            raise ValueError(
                f"watch: leaf {name!r} joins {base!r}, whose other leaves have "
                f"{layers_of[base]} layers where it has {layers} (split_layers "
                "needs one number of layers per group)"
            )
        if base not in columns:
            layers_of[base] = layers
            columns[base] = len(counts)
            counts += [0] * (1 if layers is None else layers)
        start = columns[base]
        per = math.prod(value.shape[1:]) if layers is not None else value.size
        for i in range(1 if layers is None else layers):
            counts[start + i] += per * where.copies
        lead = where.lead if layers is not None else ()
        parts.append(_Part(start, layers, lead, where.axes))
    shown = ", ".join(repr(n) for n, _ in leaves[:3])
    for what, flags in (("group", matched), ("split_layers", splits)):
        missed = [p for p, hit in flags.items() if not hit]
        if missed:
            raise ValueError(
                f"watch: {what} pattern(s) {missed!r} match no leaf (leaves are "
                f"named like {shown})"
            )
    shadowed = [p for p, hit in used.items() if not hit]
    if shadowed:
        raise ValueError(
            f"watch: group pattern(s) {shadowed!r} match only leaves an earlier "
            "pattern took (a leaf takes the first pattern that matches it)"
        )
    names = []
    for base in columns:
        layers = layers_of[base]
        full = "/".join(p for p in (prefix, base) if p)
        if layers is None:
            names.append(full)
        else:
            names += [f"{full}/{i}" if full else str(i) for i in range(layers)]
    if len(set(names)) < len(names):  # a layer named like a leaf or a group
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"watch: two entries are named {twice[0]!r} (a layer of a split "
            "leaf and a leaf or group of that name); rename one"
        )
    names.append(prefix)  # the global column: every leaf together
    dtype = jnp.result_type(*[acc_dtype(v.dtype) for _, v in leaves])
    counts.append(sum(counts))
    return _Plan(tuple(names), parts, np.asarray(counts, np.float64), dtype)


def _mask(axes: Sequence[str], held: frozenset, dtype) -> Any:
    """1 on the devices whose copy of a leaf counts (index 0 of every axis it
    is replicated over), else 0; 1 outside any mesh."""
    mask = None
    for axis in axes:
        if axis not in held:
            one = (lax.axis_index(axis) == 0).astype(dtype)
            mask = one if mask is None else mask * one
    return mask


def _lead_offset(lead: tuple[str, ...], local: int) -> Any:
    """Where this device's layers start among all layers."""
    index: int | jax.Array = 0
    for axis in lead:
        index = index * lax.axis_size(axis) + lax.axis_index(axis)
    return index * local


def _needs(stats: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The columns of the max table and of the sum table that ``stats`` read."""
    wanted = set(stats)
    shifted = bool(_SHIFTED & wanted)
    maxes = ("abs",) * ("max_abs" in wanted) + ("max", "negmin") * shifted
    sums = (
        ("sq",) * bool({"norm", "rms"} & wanted)
        + ("zeros",) * ("zero_frac" in wanted)
        + ("nonfinite",) * ("nonfinite" in wanted)
        + ("d1", "d2") * shifted
    )
    return maxes, sums


def _tables(
    blocks: list[jax.Array],
    plan: _Plan,
    axes: Sequence[str],
    stats: tuple[str, ...],
    pmax: Any,
    psum: Any,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The all-reduced columns of the max table and of the sum table that
    ``stats`` need (see :func:`_needs`), each one value per plan column (the
    global column left out).

    Every part is one row per layer (or one row); parts whose rows are equally
    long are stacked and reduced together (one reduction per statistic and
    row length, not per leaf), then the rows are gathered into the columns in
    one operation per table."""
    dtype = plan.dtype
    max_cols, sum_cols = _needs(stats)
    by_length: dict[int, list[int]] = {}
    rows_of: list[jax.Array | np.ndarray] = []
    keeps: list[jax.Array | None] = []
    empty: list[int] = []
    for i, (x, part) in enumerate(zip(blocks, plan.parts, strict=True)):
        if math.prod(x.shape) == 0:
            # no values: constant rows, and no operation on an empty array
            # (some XLA versions crash compiling reductions over one)
            rows_of.append(np.empty((1 if part.layers is None else x.shape[0], 0)))
            keeps.append(None)
            empty.append(i)
            continue
        x2 = x.astype(dtype).reshape(1 if part.layers is None else x.shape[0], -1)
        rows_of.append(x2)
        keep = _mask(axes, part.axes, dtype)
        ones = jnp.ones((x2.shape[0], 1), dtype)
        keeps.append(ones if keep is None else ones * keep)
        by_length.setdefault(x2.shape[1], []).append(i)
    stacks = []  # (indices, stacked rows, their keep flags)
    for idx in by_length.values():
        x2 = jnp.concatenate([rows_of[i] for i in idx])
        # by_length holds only parts with values, whose keep flags are set
        keep = jnp.concatenate([cast(jax.Array, keeps[i]) for i in idx])
        stacks.append((idx, x2, keep))
    n_empty = sum(rows_of[i].shape[0] for i in empty)
    ext = {}
    if max_cols:
        maxed = []
        low = -jnp.inf
        for idx, x2, keep in stacks:
            rows = _maxima(x2, max_cols)
            maxed.append((idx, jnp.where(keep > 0, rows, low)))
        if empty:  # what _maxima gives for no values: abs 0, the others -inf
            none = [0.0 if c == "abs" else -np.inf for c in max_cols]
            maxed.append((empty, jnp.tile(jnp.asarray(none, dtype), (n_empty, 1))))
        table = pmax(_table_of(maxed, plan, "max", rows_of))  # all-reduce 1
        ext = {name: table[:, j] for j, name in enumerate(max_cols)}
    centre = scale = None
    if "max" in ext:
        mid = ext["max"] / 2 - ext["negmin"] / 2
        centre = jnp.where(jnp.isfinite(mid), mid, 0)
        scale = shift_scale(ext["max"], -ext["negmin"])
    if not sum_cols:
        return ext, {}
    summed = []
    for idx, x2, keep in stacks:
        cols = {}
        if "sq" in sum_cols:
            cols["sq"] = jnp.sum(jnp.square(x2), axis=1)
        if "zeros" in sum_cols:
            cols["zeros"] = jnp.sum((x2 == 0).astype(dtype), axis=1)
        if "nonfinite" in sum_cols:
            cols["nonfinite"] = _nonfinite(x2, cols.get("sq"))
        # each row shifted by its column's midrange (centre and scale set together)
        if centre is not None and scale is not None:
            # (and scaled: no overflow near the largest)
            if any(plan.parts[i].lead_axes for i in idx):  # a device's layers
                starts, scales = [], []
                for i in idx:
                    part, k = plan.parts[i], rows_of[i].shape[0]
                    start = part.column + _lead_offset(part.lead_axes, k)
                    starts.append(lax.dynamic_slice(centre, (start,), (k,)))
                    scales.append(lax.dynamic_slice(scale, (start,), (k,)))
                at, by = jnp.concatenate(starts), jnp.concatenate(scales)
            else:  # every row's column is known: one gather, not two per leaf
                of_row = np.concatenate(
                    [plan.parts[i].column + np.arange(rows_of[i].shape[0]) for i in idx]
                )
                at, by = centre[of_row], scale[of_row]
            d = (x2 - at.reshape(-1, 1)) / by.reshape(-1, 1)
            cols["d1"], cols["d2"] = jnp.sum(d, axis=1), jnp.sum(jnp.square(d), axis=1)
        # where, not a product: an inf (a sum of squares past float32 too)
        # times 0 is NaN, which the psum would spread from an uncounted copy
        rows = jnp.stack([cols[c] for c in sum_cols], axis=1)
        summed.append((idx, jnp.where(keep > 0, rows, 0)))
    if empty:
        summed.append((empty, jnp.zeros((n_empty, len(sum_cols)), dtype)))
    table = psum(_table_of(summed, plan, "add", rows_of))  # all-reduce 2
    return ext, {name: table[:, j] for j, name in enumerate(sum_cols)}


def _maxima(x2: jax.Array, max_cols: tuple[str, ...]) -> jax.Array:
    """The max-table columns of each row, NaN left out (``abs``: the largest
    magnitude, 0 for none; ``max``, ``negmin``: -inf for none).

    A max propagates NaN, so the plain maxima show whether a row holds one:
    only then are they taken again with the NaNs masked, which costs a pass
    over the values per column and is skipped otherwise."""

    def maxima(nan_out: bool) -> jax.Array:
        low = -jnp.inf
        nan = jnp.isnan(x2) if nan_out else None

        def top(v, fill):
            if nan is not None:
                v = jnp.where(nan, fill, v)
            return jnp.max(v, axis=1, initial=fill)

        cols = []
        if "abs" in max_cols:
            cols.append(top(jnp.abs(x2), 0))
        if "max" in max_cols:  # the midrange, for the shifted sums
            cols += [top(x2, low), top(-x2, low)]
        return jnp.stack(cols, axis=1)

    plain = maxima(False)
    return lax.cond(jnp.any(jnp.isnan(plain)), lambda: maxima(True), lambda: plain)


def _nonfinite(x2: jax.Array, sq: jax.Array | None) -> jax.Array:
    """The count of NaN and infinite values of each row; counted only where
    the sums of squares say there may be some (one pass saved otherwise)."""

    def count():
        return jnp.sum((~jnp.isfinite(x2)).astype(x2.dtype), axis=1)

    if sq is None:
        return count()
    return lax.cond(jnp.all(jnp.isfinite(sq)), lambda: jnp.zeros_like(sq), count)


def _table_of(
    stacked: list[tuple[list[int], jax.Array]], plan: _Plan, how: str, rows_of: list
) -> jax.Array:
    """The reduced rows of every stack (the parts ``idx``, in order) as one
    table of the plan's columns, combined by max or by add.

    One concatenation and at most one reordering or segment reduction,
    whatever the number of parts: splitting the stacks back into one slice
    per part would be a small operation per leaf. Parts whose layers are
    split over devices are placed at their offset part by part."""
    if any(plan.parts[i].lead_axes for idx, _ in stacked for i in idx):
        pieces: list[Any] = [None] * len(plan.parts)
        for idx, rows in stacked:
            _scatter(pieces, idx, rows, rows_of)
        return _columns(pieces, plan, how)
    c = len(plan.names) - 1
    ids = np.concatenate(
        [
            plan.parts[i].column + np.arange(rows_of[i].shape[0])
            for idx, _ in stacked
            for i in idx
        ]
    )
    rows = (
        jnp.concatenate([r for _, r in stacked]) if len(stacked) > 1 else stacked[0][1]
    )
    if np.array_equal(ids, np.arange(c)):  # a column per row, in order
        return rows
    if np.array_equal(np.sort(ids), np.arange(c)):  # a column per row
        return rows[np.argsort(ids)]
    segment = jax.ops.segment_max if how == "max" else jax.ops.segment_sum
    return segment(rows, jnp.asarray(ids), num_segments=c)


def _scatter(out: list, idx: list[int], rows: jax.Array, rows_of: list) -> None:
    """Splits a stack's reduced ``rows`` back into its parts' rows."""
    at = 0
    for i in idx:
        k = rows_of[i].shape[0]
        out[i] = rows[at : at + k]
        at += k


def _columns(rows: list[jax.Array], plan: _Plan, how: str) -> jax.Array:
    """Each part's rows (one per local layer, or one) gathered into a table of
    the plan's columns, by max or by add."""
    c = len(plan.names) - 1
    ids, placed = [], []
    for block, part in zip(rows, plan.parts, strict=True):
        if part.lead_axes:  # the layers are split over devices: this one's go
            fill = -jnp.inf if how == "max" else 0  # at their offset
            full = jnp.full((part.layers, block.shape[1]), fill, block.dtype)
            start = (_lead_offset(part.lead_axes, block.shape[0]), 0)
            block = lax.dynamic_update_slice(full, block, start)
        placed.append(block)
        count = 1 if part.layers is None else part.layers
        ids.append(np.arange(part.column, part.column + count))
    table = jnp.concatenate(placed)
    column_ids = np.concatenate(ids)
    if np.array_equal(column_ids, np.arange(c)):  # a column per part, in order
        return table
    segment = jax.ops.segment_max if how == "max" else jax.ops.segment_sum
    return segment(table, jnp.asarray(column_ids), num_segments=c)


def _finish(ext: dict, sums: dict, plan: _Plan, stats: tuple[str, ...]) -> jax.Array:
    """The ``(len(stats), C + 1)`` table: each column's statistics, then the
    global column's (every leaf together)."""
    dtype = plan.dtype
    counts = jnp.asarray(plan.counts[:-1], dtype)
    total = jnp.asarray(plan.counts[-1], dtype)
    out = {}
    if "sq" in sums:
        sq, g_sq = sums["sq"], jnp.sum(sums["sq"])
        out["norm"] = (jnp.sqrt(sq), jnp.sqrt(g_sq))
        out["rms"] = (jnp.sqrt(sq / counts), jnp.sqrt(g_sq / total))
    if "abs" in ext:
        out["max_abs"] = (ext["abs"], jnp.max(ext["abs"]))
    if "zeros" in sums:
        out["zero_frac"] = (sums["zeros"] / counts, jnp.sum(sums["zeros"]) / total)
    if "nonfinite" in sums:
        out["nonfinite"] = (sums["nonfinite"], jnp.sum(sums["nonfinite"]))
    if "d1" in sums:
        mid = ext["max"] / 2 - ext["negmin"] / 2
        centre = jnp.where(jnp.isfinite(mid), mid, 0)
        scale = shift_scale(ext["max"], -ext["negmin"])
        d1 = sums["d1"] / counts  # (in units of scale)
        mean = centre + d1 * scale  # inf and NaN go through as in NumPy
        var = jnp.maximum(sums["d2"] / counts - jnp.square(d1), 0)
        var = jnp.where(jnp.isfinite(d1), var, jnp.nan)
        std = jnp.sqrt(var) * scale
        # every leaf together: the columns' means and spreads combined (Chan),
        # each mean taken from one reference (the midrange of every value), so
        # that means far from zero do not lose their differences to rounding;
        # a leaf without values (mean NaN) adds nothing
        top = jnp.max(jnp.where(counts > 0, ext["max"], -jnp.inf))
        bottom = -jnp.max(jnp.where(counts > 0, ext["negmin"], -jnp.inf))
        ref = top / 2 + bottom / 2
        ref = jnp.where(jnp.isfinite(ref), ref, 0)
        has = counts > 0
        # in units of the largest column scale or of the range of every value,
        # whichever is larger (a power of two): no overflow, even where the
        # columns lie far apart and each spans nothing (a constant leaf)
        unit = jnp.maximum(jnp.max(jnp.where(has, scale, 1)), shift_scale(top, bottom))
        delta = jnp.where(has, (centre - ref) / unit + d1 * (scale / unit), 0)
        g_delta = jnp.sum(counts * delta) / total
        spread = jnp.square(std / unit) + jnp.square(delta - g_delta)
        g_var = jnp.sum(jnp.where(has, counts * spread, 0)) / total
        g_mean = ref + g_delta * unit
        out["mean"] = (mean, g_mean)
        out["std"] = (std, jnp.sqrt(g_var) * unit)
    rows = [jnp.concatenate([out[s][0], out[s][1][None]]) for s in stats]
    return jnp.stack(rows)


def _stats_of(leaves, wheres, blocks_fn, prefix, stats, split, groups) -> Stats:
    plan = _plan(leaves, wheres, prefix, split, groups)
    ext, sums = blocks_fn(plan, stats)
    names, table = plan.names, _finish(ext, sums, plan, stats)
    if len(names) == 2 and names[0] == names[1]:  # one array: its entry is the total
        names, table = names[1:], table[:, 1:]
    return Stats(names, table, rows=stats)


def _check_prefix(prefix: Any) -> str:
    if prefix is None:
        return ""
    if not isinstance(prefix, str):
        raise TypeError(f"watch: prefix must be a str, got {prefix!r:.60}")
    return prefix.strip("/")


def watch(
    tree: Any,
    *,
    stats: Sequence[str] = DEFAULT_WATCH,
    split_layers: bool | str | Sequence[str] = False,
    groups: str | Sequence[str] | None = None,
    prefix: str | None = None,
    spread: bool | None = None,
) -> Stats:
    """Per-leaf statistics of a pytree, inside ``jit`` / ``nnx.jit``, in at most
    two all-reduces whatever the number of leaves.

    Args:
        tree: gradients, parameters, optimizer updates, sown activations: any
            pytree of arrays (an ``nnx.State`` too; a Variable is named by its
            path, without ``/value``). Integer and bool leaves are watched as
            float32 values.
        stats: which statistics, from :data:`WATCH_STATS`: ``norm`` (L2),
            ``rms``, ``max_abs``, ``zero_frac`` (the fraction of exact zeros),
            ``nonfinite`` (the count of NaN and infinite values), ``mean`` and
            ``std`` (population). Default :data:`DEFAULT_WATCH`, the first five.
        split_layers: a leading axis of stacked layers (``nnx.scan`` /
            ``nnx.vmap`` stacks) becomes one entry per layer,
            ``{path}/{i}/{stat}``. True: every leaf with an axis; glob
            patterns: the leaves whose path they match (``"layers"``: every
            leaf under ``layers``); a pattern that matches no leaf is a
            ValueError.
        groups: glob patterns matched against the start of each leaf's path,
            segment by segment (``"layers/*"`` groups ``layers/3/attn/kernel``
            into ``layers/3``): each group is one entry, all its leaves'
            values together. A leaf takes the first pattern that matches;
            leaves that none matches keep entries of their own. A pattern that
            matches nothing, or only leaves an earlier pattern took, is a
            ValueError.
        prefix: put before every name (``"grads"`` gives ``grads/norm`` and
            ``grads/layers/0/kernel/norm``).
        spread: where every leaf is replicated over a mesh of several devices
            (data parallel gradients), each device holds the whole tree.
            True: each leaf is read on one of (at most 8) devices, balanced
            by size, and the tables are summed in one all-reduce. False:
            every device reads every leaf and no collective is issued. None
            (the default): spread where the leaves hold at least 2**20
            values in all, below which reading them costs less than an
            all-reduce's latency on an accelerator. No effect on sharded
            leaves, outside a mesh, or in :func:`watch_collective`.

    Returns:
        A :class:`Stats` mapping, read like a flat dict: ``{path}/{stat}`` for
        every leaf (or group, or layer), and ``{stat}`` (``{prefix}/{stat}``)
        over every leaf together: ``norm`` is the global L2 norm. One
        ``(len(stats), K + 1)`` array: one transfer to the host, and
        :class:`~jaxhistory.History` records it as one packed row.

    Raises:
        ValueError: an empty tree, an unknown statistic, a group or
            split_layers pattern that matches no leaf, leaves of one group
            split into different numbers of layers.
        TypeError: a leaf that is not numeric (a string, None, an object);
            ``split_layers`` or ``groups`` not glob patterns; ``spread`` not
            a bool or None.

    Values accumulate in float32 (float64 for float64 leaves): ``norm`` and
    ``rms`` overflow to inf above about 1.8e19 in float32. NaN and infinite
    values are counted by ``nonfinite``, make ``norm``, ``rms``, ``mean`` and
    ``std`` NaN or inf; NaN is left out of ``max_abs`` (an inf is its
    ``max_abs``).

    Under ``jit`` with sharded leaves, the statistics are computed from each
    device's shard in a ``shard_map`` over the leaves' mesh (read from their
    types: exact on Explicit mesh axes, ``jax.make_mesh``'s default) and
    combined in one ``pmax`` and one ``psum``; a leaf replicated over an axis
    counts once. Where every leaf is replicated, no collective is issued, or
    one ``psum`` where the tree is spread (see ``spread``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}
        >>> out = jax.jit(jh.watch)(grads)
        >>> float(out["norm"]), float(out["w/norm"]), float(out["b/zero_frac"])
        (5.0, 5.0, 1.0)
    """
    stats = _check_stats(stats)
    prefix = _check_prefix(prefix)
    split = _patterns(split_layers, "split_layers")
    groups = _patterns(groups, "groups")
    if spread is not None and not isinstance(spread, bool):
        raise TypeError(
            f"watch: spread must be True, False or None, got {spread!r:.60}"
        )
    leaves = _leaves(tree)
    arrays = [v for _, v in leaves]
    if not any(isinstance(v, jax.core.Tracer) for v in arrays):
        # outside jit: the same computation, jitted (one compile per structure,
        # cached: a function made per call would compile at every call)
        return _watch_jitted(
            dict(leaves),
            stats=stats,
            split_layers=split,
            groups=groups,
            prefix=prefix,
            spread=spread,
        )
    mesh, specs = _mesh_and_specs(arrays)
    if mesh is None:  # every leaf replicated
        wheres = [_Where((), frozenset(), 1)] * len(arrays)
        over = _spread_mesh(arrays, spread)
        if over is not None:  # each leaf read on one device, one all-reduce

            def spread_over(plan, wanted):
                return _spread(arrays, plan, wanted, over)

            return _stats_of(leaves, wheres, spread_over, prefix, stats, split, groups)

        def local(plan, wanted):  # every device reads every leaf: no collective
            return _tables(arrays, plan, (), wanted, _same, _same)

        return _stats_of(leaves, wheres, local, prefix, stats, split, groups)
    wheres = []
    for spec, v in zip(specs, arrays, strict=True):
        dims = _spec_axes(spec, v.ndim)
        lead = dims[0] if dims else ()
        wheres.append(_Where(lead, frozenset(a for d in dims for a in d), 1))
    axes = tuple(mesh.axis_names)
    # a leaf without values does not enter the shard_map: its block's shape
    # is all _tables reads of it
    live = [i for i, v in enumerate(arrays) if math.prod(v.shape) > 0]
    shapes = [
        NamedSharding(mesh, spec).shard_shape(v.shape)
        for spec, v in zip(specs, arrays, strict=True)
    ]

    def sharded(plan, wanted):
        def body(*blocks):
            local: list[Any] = [np.empty(shape) for shape in shapes]
            for i, block in zip(live, blocks, strict=True):
                local[i] = block
            return _tables(
                local,
                plan,
                axes,
                wanted,
                lambda t: lax.pmax(t, axes),
                lambda t: lax.psum(t, axes),
            )

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(specs[i] for i in live),
            out_specs=(P(), P()),
        )(*(arrays[i] for i in live))

    return _stats_of(leaves, wheres, sharded, prefix, stats, split, groups)


_watch_jitted = jax.jit(
    watch, static_argnames=("stats", "split_layers", "groups", "prefix", "spread")
)

_SPREAD_AT = 2**20  # replicated values from which spread=None spreads them
_SPREAD_WAYS = 8  # the most devices a replicated tree is spread over


def _spread_mesh(arrays: list[jax.Array], spread: bool | None) -> Any:
    """The mesh to spread replicated leaves over, or None: where ``spread``
    is False, where no leaf's type names a mesh of more than one device, or
    (``spread=None``) where the leaves hold fewer than 2**20 values."""
    values = sum(math.prod(v.shape) for v in arrays)
    if spread is False or not values or (spread is None and values < _SPREAD_AT):
        return None  # (no values: nothing to read, and no input to place it)
    meshes = set()
    for v in arrays:
        m = getattr(getattr(jax.typeof(v), "sharding", None), "mesh", None)
        if m is not None and getattr(m, "size", 1) > 1:
            meshes.add(m)
    return meshes.pop() if len(meshes) == 1 else None


def _owners(plan: _Plan, arrays: list[jax.Array], ways: int) -> list[int]:
    """Which of ``ways`` devices reads each leaf: the leaves of one column (a
    group) go together, the largest first to the device with the fewest
    values so far."""
    size: dict[int, int] = {}
    for part, v in zip(plan.parts, arrays, strict=True):
        size[part.column] = size.get(part.column, 0) + math.prod(v.shape)
    load, owner_of = [0] * ways, {}
    for column in sorted(size, key=lambda c: (-size[c], c)):
        device = load.index(min(load))
        owner_of[column], load[device] = device, load[device] + size[column]
    return [owner_of[part.column] for part in plan.parts]


def _spread(
    arrays: list[jax.Array], plan: _Plan, stats: tuple[str, ...], mesh: Any
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """:func:`_tables` of replicated leaves, each leaf read on one device.

    Every device holds every leaf; reading each on every device is the work
    of the whole tree times the devices (on an accelerator in parallel, on a
    CPU's simulated devices on shared cores). Here device ``d`` reduces only
    the leaves :func:`_owners` gives it (a ``lax.switch`` on its index), its
    other columns are 0 in both tables, and one ``psum`` adds them: each
    column has one term, so the sum is that device's value exactly (a max
    too, and a column's shifted sums need only its own maxima, which its
    device has)."""
    max_cols, sum_cols = _needs(stats)
    columns = len(plan.names) - 1
    units = len({part.column for part in plan.parts})
    ways = min(mesh.size, _SPREAD_WAYS, units)
    owner = _owners(plan, arrays, ways)
    axes = tuple(mesh.axis_names)
    live = [i for i, v in enumerate(arrays) if math.prod(v.shape) > 0]

    def blank(i: int) -> np.ndarray:  # what _tables takes for a leaf with no values
        layers = plan.parts[i].layers
        return np.empty((0,) if layers is None else (layers, 0), np.float32)

    def reader(device: int):
        owned = np.zeros(columns, bool)
        for part, o in zip(plan.parts, owner, strict=True):
            if o == device:
                owned[part.column : part.column + (part.layers or 1)] = True

        def read(blocks: list[Any]) -> jax.Array:
            mine: list[Any] = [
                x if o == device else blank(i)
                for i, (x, o) in enumerate(zip(blocks, owner, strict=True))
            ]
            ext, sums = _tables(mine, plan, (), stats, _same, _same)
            rows = [jnp.where(owned, ext[c], 0) for c in max_cols]
            return jnp.stack(rows + [sums[c] for c in sum_cols])

        return read

    readers = [reader(d) for d in range(ways)]
    shape = (len(max_cols) + len(sum_cols), columns)

    def body(*held):
        blocks: list[Any] = [blank(i) for i in range(len(arrays))]
        for i, block in zip(live, held, strict=True):
            blocks[i] = block
        branches = [lambda r=r: r(blocks) for r in readers]
        branches.append(lambda: jnp.zeros(shape, plan.dtype))  # the devices past ways
        index = jnp.minimum(lax.axis_index(axes), ways)
        table = lax.psum(lax.switch(index, branches), axes)  # the one all-reduce
        ext = {c: table[j] for j, c in enumerate(max_cols)}
        sums = {c: table[len(max_cols) + j] for j, c in enumerate(sum_cols)}
        return ext, sums

    return jax.shard_map(
        body, mesh=mesh, in_specs=tuple(P() for _ in live), out_specs=(P(), P())
    )(*(arrays[i] for i in live))


def _same(table: jax.Array) -> jax.Array:
    return table


def _mesh_and_specs(arrays: list[jax.Array]) -> tuple[Any, list[Any]]:
    """The mesh the traced leaves that hold values are sharded over and each
    leaf's spec; (None, []) where every such leaf is replicated (or no mesh is
    known)."""
    mesh, specs = None, []
    for v in arrays:
        sharding = getattr(jax.typeof(v), "sharding", None)
        spec = getattr(sharding, "spec", None)
        m = getattr(sharding, "mesh", None)
        specs.append(P() if spec is None else spec)
        # (a leaf without values is left out of the shard_map: its mesh is
        # not needed)
        if spec is not None and any(e is not None for e in spec) and v.size:
            if mesh is not None and m != mesh:
                raise ValueError(
                    "watch: the leaves are sharded over different meshes; watch "
                    "them in separate calls"
                )
            mesh = m
    if mesh is None or getattr(mesh, "size", 1) <= 1:
        return None, []
    return mesh, specs


def watch_collective(
    tree: Any,
    axis_name: AxisName,
    *,
    stats: Sequence[str] = DEFAULT_WATCH,
    split_layers: bool | str | Sequence[str] = False,
    groups: str | Sequence[str] | None = None,
    prefix: str | None = None,
) -> Stats:
    """:func:`watch` inside ``jax.shard_map``: each leaf is this device's block;
    the statistics are over every device's blocks along ``axis_name`` (a mesh
    axis or a tuple of them), in one ``lax.pmax`` and one ``lax.psum``.

    A leaf that does not vary over an axis (its type says so under
    ``check_vma=True``) counts once; with ``check_vma=False`` every leaf is
    taken to differ on every device. With ``split_layers``, each block's
    leading axis holds all the layers (the layer axis is not sharded).
    Arguments, result and errors as for :func:`watch`.
    """
    axis_name = check_axis_name(axis_name)
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    stats = _check_stats(stats)
    prefix = _check_prefix(prefix)
    split = _patterns(split_layers, "split_layers")
    groups = _patterns(groups, "groups")
    sizes = {a: bound_axis_size(a, "watch_collective") for a in axes}
    leaves = _leaves(tree)
    arrays = [v for _, v in leaves]
    # Under check_vma=True a value's type says which axes it differs over (the
    # axis index always does); without, every leaf is taken to differ on every
    # device.
    typed = bool(varying_axes(lax.axis_index(axes[0])))
    wheres = []
    for v in arrays:
        held = varying_axes(v) & frozenset(axes) if typed else frozenset(axes)
        wheres.append(_Where((), held, math.prod(sizes[a] for a in held)))

    def local(plan, wanted):
        return _tables(
            arrays,
            plan,
            axes,
            wanted,
            lambda t: lax.pmax(t, axis_name),
            lambda t: lax.psum(t, axis_name),
        )

    return _stats_of(leaves, wheres, local, prefix, stats, split, groups)
