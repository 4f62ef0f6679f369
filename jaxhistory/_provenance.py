"""Which device holds each value: the layouts behind ``provenance=True``.

A device is named by its global index in ``jax.devices()`` order (the same on
every process). A :class:`Layout` maps every element of a global array to the
lowest index among the devices that hold it (its *holder*), through a rank into
the sorted list of holders, so a reduction can count, per holder, how many of its
elements equal the maximum: the lowest holder with a count wins, which is the
lowest device index on ties.

Everything here runs on the host, at trace time; the results are NumPy constants.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxhistory._dtypes import as_flag

__all__ = [
    "Layout",
    "ShardTables",
    "check_provenance",
    "concrete_layout",
    "device_label",
    "global_index",
    "layout_of",
    "positional_layout",
    "shard_tables",
]


@dataclass(frozen=True, eq=False)
class Layout:
    """Where the elements of one array live.

    Attributes:
        rank: int32, the array's shape: each element's holder, as a position in
            ``holders``.
        holders: int32, sorted: the global device indices that hold elements.
    """

    rank: np.ndarray
    holders: np.ndarray

    @functools.cached_property
    def key(self) -> tuple:
        return (self.rank.shape, self.rank.tobytes(), self.holders.tobytes())

    @functools.cached_property
    def onehot(self) -> np.ndarray:
        """``(len(holders), *shape)``: 1 where an element belongs to a holder."""
        slots = np.arange(len(self.holders)).reshape((-1,) + (1,) * self.rank.ndim)
        return self.rank[None] == slots


def global_index() -> dict[int, int]:
    """Device id -> position in ``jax.devices()``."""
    return {d.id: i for i, d in enumerate(jax.devices())}


def device_label(index: int) -> str:
    """``"device 3 (process 1)"`` for a global device index."""
    devices = jax.devices()
    if 0 <= index < len(devices):
        return f"device {index} (process {devices[index].process_index})"
    return f"device {index}"


def _from_owner(owner: np.ndarray) -> Layout:
    holders = np.unique(owner).astype(np.int32)
    rank = np.searchsorted(holders, owner).astype(np.int32)
    return Layout(rank, holders)


@functools.lru_cache(maxsize=256)
def _cached_layout(sharding: Any, shape: tuple[int, ...]) -> Layout:
    index = global_index()
    owner = np.full(shape, np.iinfo(np.int32).max, np.int64)
    for device, slices in sharding.devices_indices_map(shape).items():
        where = owner[slices]
        owner[slices] = np.minimum(where, index[device.id])
    return _from_owner(owner)


def concrete_layout(sharding: Any, shape: tuple[int, ...]) -> Layout:
    """The layout of an array of ``shape`` placed by ``sharding`` (any kind)."""
    return _cached_layout(sharding, tuple(shape))


def _matches(concrete: Any, abstract: Any) -> bool:
    return (
        isinstance(concrete, jax.sharding.Mesh)
        and tuple(concrete.axis_names) == tuple(abstract.axis_names)
        and tuple(concrete.devices.shape) == tuple(abstract.axis_sizes)
    )


def _context_mesh() -> Any:
    """The concrete mesh set by ``jax.set_mesh`` (which jit keeps while
    tracing), or None. Read through JAX's internals: there is no public call
    inside jit; if they move, ``mesh=`` still works."""
    try:
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.get_concrete_mesh()
    except Exception:
        return None
    if (
        not isinstance(mesh, jax.sharding.Mesh)
        or getattr(mesh, "empty", False)
        or getattr(mesh, "devices", None) is None
    ):
        return None
    return mesh


def _ids(mesh: jax.sharding.Mesh) -> list[int]:
    return [d.id for d in mesh.devices.flat]


def _mesh_for(abstract: Any, mesh: Any, caller: str) -> jax.sharding.Mesh:
    context = _context_mesh()
    if context is not None and not _matches(context, abstract):
        context = None
    if mesh is not None and _matches(mesh, abstract):
        if context is not None and _ids(context) != _ids(mesh):
            raise ValueError(
                f"{caller}: mesh= lists devices {_ids(mesh)} but the mesh of "
                f"jax.set_mesh, which the values are on, lists {_ids(context)}: "
                "devices are named from the mesh's order, so pass the mesh the "
                "values are on (or leave mesh= out)"
            )
        return mesh
    if context is not None:
        return context
    if mesh is not None:
        axes = dict(zip(abstract.axis_names, abstract.axis_sizes, strict=True))
        raise ValueError(
            f"{caller}: mesh= has axes {dict(mesh.shape)} but the values are on a "
            f"mesh with axes {axes}"
        )
    raise ValueError(
        f"{caller} with provenance=True names devices, so it needs the mesh's "
        "devices, which jit does not know: call it under `with jax.set_mesh(mesh)` "
        "or pass mesh="
    )


def check_provenance(value: Any, caller: str) -> bool:
    """``value`` as a bool; TypeError unless it is one (``"yes"``, 1, None)."""
    return as_flag(f"{caller}: provenance", value)


def layout_of(value: Any, mesh: Any, caller: str) -> tuple[Layout, Any]:
    """The layout of a (possibly traced) global array, and the value to reduce.

    Concrete arrays carry their sharding. Under jit the sharding is read from
    the value's type, which is exact on Explicit mesh axes (``jax.make_mesh``'s
    default); the devices come from ``mesh`` or ``jax.set_mesh``. A traced
    sharded value comes back placed on that mesh (no data moves when it is the
    values' own), so jit refuses to compile when the values are on other devices
    or on the same ones in another order, instead of naming the wrong device.
    """
    shape = tuple(value.shape)
    if not isinstance(value, jax.core.Tracer) and isinstance(value, jax.Array):
        return concrete_layout(value.sharding, shape), value
    # the aval's sharding, when it has one (then so has its mesh)
    sharding: Any = getattr(jax.typeof(value), "sharding", None)
    abstract = getattr(sharding, "mesh", None)
    if abstract is None or not getattr(abstract, "axis_names", ()):
        # No mesh: one device runs it, the default one (or the mesh's first).
        # Replicated, its holder is the lowest device: the mesh's order is moot.
        context = mesh if mesh is not None else _context_mesh()
        if context is not None:
            replicated = jax.sharding.NamedSharding(
                context, jax.sharding.PartitionSpec()
            )
            return concrete_layout(replicated, shape), value
        first = global_index()[jax.devices()[0].id]
        return Layout(np.zeros(shape, np.int32), np.array([first], np.int32)), value
    auto = jax.sharding.AxisType.Auto
    types = dict(zip(abstract.axis_names, abstract.axis_types, strict=True))
    if any(t == auto for t in types.values()):
        raise ValueError(
            f"{caller} with provenance=True cannot tell how a value of shape "
            f"{shape} is sharded under jit on a mesh with Auto axes (the compiler "
            "may shard it over them whatever its spec says): use Explicit "
            "axes (jax.make_mesh's default), or call it outside jit on concrete "
            "arrays, or use jaxhistory.collective.distributed_stats in shard_map"
        )
    concrete = _mesh_for(abstract, mesh, caller)
    named = jax.sharding.NamedSharding(concrete, sharding.spec)
    return concrete_layout(named, shape), _values_must_be_on_this_mesh(value, named)


def _values_must_be_on_this_mesh(value: Any, named: Any) -> Any:
    # Named so that jit's error on a mismatch points here.
    return jax.device_put(value, named)


def positional_layout(value: Any) -> Layout | None:
    """Which elements of a global array share a device, for statistics only:
    the holders are mesh positions, not device indices, so no devices are
    needed. None when unknown (a traced value on a mesh with Auto axes) or
    when there is no mesh."""
    shape = tuple(value.shape)
    if not isinstance(value, jax.core.Tracer) and isinstance(value, jax.Array):
        return concrete_layout(value.sharding, shape)
    # the aval's sharding and its mesh, when it has them (``names`` when so)
    sharding: Any = getattr(jax.typeof(value), "sharding", None)
    abstract: Any = getattr(sharding, "mesh", None)
    names = tuple(getattr(abstract, "axis_names", ()))
    if not names or any(t == jax.sharding.AxisType.Auto for t in abstract.axis_types):
        return None
    return _positional(shape, tuple(sharding.spec), names, tuple(abstract.axis_sizes))


@functools.lru_cache(maxsize=256)
def _positional(
    shape: tuple[int, ...], spec: tuple, names: tuple, sizes: tuple
) -> Layout | None:
    strides = {}
    stride = 1
    for name, size in zip(reversed(names), reversed(sizes), strict=True):
        strides[name] = stride
        stride *= size
    size_of = dict(zip(names, sizes, strict=True))
    owner = np.zeros(shape, np.int64)
    for dim, entry in enumerate(spec[: len(shape)]):
        if entry is None:
            continue
        axes = _axes(entry)
        blocks = math.prod(size_of[a] for a in axes)
        if shape[dim] % blocks:
            return None
        block = np.arange(shape[dim]) // (shape[dim] // blocks)
        position = np.zeros(shape[dim], np.int64)
        for a in reversed(axes):  # the first axis is the major one
            position += (block % size_of[a]) * strides[a]
            block = block // size_of[a]
        view = [1] * len(shape)
        view[dim] = shape[dim]
        owner = owner + position.reshape(view)
    return _from_owner(owner)


def _axes(dim: Any) -> tuple:
    return tuple(dim) if isinstance(dim, tuple) else (dim,)


@dataclass(frozen=True, eq=False)
class ShardTables:
    """For a shard_map over ``axes`` of a mesh: each shard's rank among the
    devices of its group (the devices that differ only along ``axes``), and
    each group's devices in ascending global index."""

    names: tuple[str, ...]  # every mesh axis, in mesh order
    sizes: tuple[int, ...]
    reduced: tuple[bool, ...]  # whether each axis is one of ``axes``
    rank: np.ndarray  # (mesh.size,) by linear mesh position
    holders: np.ndarray  # (groups, group size)


@functools.lru_cache(maxsize=64)
def _tables(mesh: jax.sharding.Mesh, axes: tuple[Hashable, ...]) -> ShardTables:
    index = global_index()
    names = tuple(mesh.axis_names)
    sizes = tuple(mesh.devices.shape)
    reduced = tuple(n in axes for n in names)
    ids = np.vectorize(lambda d: index[d.id])(mesh.devices).astype(np.int64)
    # Reduced axes last: each row of `grouped` is one group.
    order = [i for i, r in enumerate(reduced) if not r] + [
        i for i, r in enumerate(reduced) if r
    ]
    size = math.prod(s for s, r in zip(sizes, reduced, strict=True) if r)
    grouped = np.transpose(ids, order).reshape(-1, size)
    holders = np.sort(grouped, axis=1).astype(np.int32)
    rank_of = {
        int(g): int(np.searchsorted(holders[row], g))
        for row in range(grouped.shape[0])
        for g in grouped[row]
    }
    rank = np.array([rank_of[int(g)] for g in ids.reshape(-1)], np.int32)
    return ShardTables(names, sizes, reduced, rank, holders)


def shard_tables(axes: tuple[Hashable, ...], mesh: Any, caller: str) -> ShardTables:
    """The tables for a shard_map reduction over ``axes`` (at trace time)."""
    abstract = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    concrete = _mesh_for(abstract, mesh, caller)
    missing = [
        n
        for n, t in zip(abstract.axis_names, abstract.axis_types, strict=True)
        if t != manual
    ]
    if missing:
        raise ValueError(
            f"{caller} with provenance=True needs every mesh axis manual in the "
            f"shard_map (axes {missing} are not)"
        )
    return _tables(concrete, tuple(axes))
