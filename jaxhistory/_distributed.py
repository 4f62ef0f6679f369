"""History's distributed reduction: per-device values (and, with several
processes, per-process host scalars) become ``name/{mean,max,min,std}`` across
all devices or processes, in one fused jitted call per update."""

from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np

from jaxhistory._env import env_flag
from jaxhistory._names import COUNTER_KEYS
from jaxhistory._stats import Stats, distributed_stats

__all__ = ["DISTRIBUTED_LIMIT", "Reducer", "distributed_default", "is_per_device"]

DISTRIBUTED_LIMIT = 384  # devices; above this the per-update all-reduce is off
_OFF_VARS = ("JAXHISTORY_NO_DISTRIBUTED_HISTORY", "JAXHISTORY_LOCAL_HISTORY")


def distributed_default() -> bool:
    """Whether distributed history is on when not set explicitly.

    Off when ``JAXHISTORY_NO_DISTRIBUTED_HISTORY`` or ``JAXHISTORY_LOCAL_HISTORY``
    is 1/true/yes, or when there are more than 384 devices (the all-reduce per
    update costs too much there); on otherwise.

    Example:
        >>> import jaxhistory as jh
        >>> jh.distributed_default()  # 8 devices here, no variable set
        True
    """
    if any(env_flag(v) for v in _OFF_VARS):
        return False
    return jax.device_count() <= DISTRIBUTED_LIMIT


def is_per_device(value: Any) -> bool:
    """A JAX array that holds different values on different devices."""
    return (
        isinstance(value, jax.Array)
        and value.ndim >= 1
        and not value.sharding.is_fully_replicated
    )


class Reducer:
    """Splits an update's values into those recorded as they are and those
    reduced across devices (and processes), and reduces the latter."""

    def __init__(self):
        self.multi_process = jax.process_count() > 1
        self._stats_fn = jax.jit(distributed_stats)

    def split(self, items: list[tuple[str, Any]]) -> tuple[list, list]:
        """(recorded as they are, reduced across devices/processes)."""
        plain, reduce = [], []
        for name, value in items:
            if name in COUNTER_KEYS:
                plain.append((name, value))
            elif is_per_device(value) or (
                self.multi_process
                and not isinstance(value, jax.Array | Stats)
                and np.ndim(value) == 0
            ):
                reduce.append((name, value))
            else:
                plain.append((name, value))
        return plain, reduce

    def reduce(self, items: list[tuple[str, Any]]) -> tuple[Stats, Any]:
        """The statistics of ``items`` (one fused call) and the mesh they used."""
        names = [n for n, _ in items]
        if self.multi_process:
            _check_same_names(names)
        meshes = [v.sharding.mesh for _, v in items if isinstance(v, jax.Array)]
        mesh = meshes[0] if meshes else jax.sharding.Mesh(jax.devices(), ("devices",))
        metrics = {}
        for name, value in items:
            if isinstance(value, jax.Array):
                metrics[name] = value
            else:
                metrics[name] = _per_process_array(name, value, mesh)
        return self._stats_fn(metrics), (mesh if meshes else None)


def _check_same_names(names: list[str]) -> None:
    from jax.experimental import multihost_utils

    digest = zlib.crc32("\0".join(sorted(names)).encode())
    everyone = np.asarray(
        multihost_utils.process_allgather(np.array([digest, len(names)], np.int64))
    ).reshape(-1, 2)
    if len(set(map(tuple, everyone.tolist()))) > 1:
        raise ValueError(
            f"processes passed different metrics to History.update (process "
            f"{jax.process_index()} has {sorted(names)}); every process must "
            "record the same names for distributed history"
        )


def _per_process_array(name: str, value: Any, mesh: jax.sharding.Mesh) -> jax.Array:
    """A global array over ``mesh`` holding this process's scalar on its devices.

    Each process fills the entries of its own devices with its value, so with the
    same number of devices per process, statistics over the array are statistics
    over processes. Sharing the per-device metrics' mesh keeps one fused call.
    """
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r} is not numeric ({type(value).__name__})")
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    )
    local = np.float32(arr)
    return jax.make_array_from_callback(
        (mesh.size,), sharding, lambda index: np.full(mesh.size, local)[index]
    )
