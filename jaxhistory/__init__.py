"""jaxhistory: cross-device metrics for JAX and Flax training runs.

Reducers compute statistics across devices inside jitted train steps:

* SPMD (inside ``jax.jit`` / ``nnx.jit`` on global arrays): :func:`reduce_mean`,
  :func:`reduce_sum`, :func:`reduce_max`, :func:`reduce_min`, :func:`reduce_std`,
  :func:`reduce_custom`, :func:`distributed_stats`, :func:`per_shard`.
* Collective (inside ``jax.shard_map``, ``axis_name`` required):
  :func:`reduce_mean_collective` and friends, :func:`all_gather`,
  :func:`distributed_stats_collective`; on the host, :func:`collect_from_devices`.

``import jaxhistory`` imports jax and numpy only.
"""

from jaxhistory import export
from jaxhistory._buffer import MetricBuffer
from jaxhistory._collective import (
    all_gather,
    collect_from_devices,
    reduce_custom_collective,
    reduce_max_collective,
    reduce_mean_collective,
    reduce_min_collective,
    reduce_std_collective,
    reduce_sum_collective,
)
from jaxhistory._facade import History, distributed_default
from jaxhistory._history import HistoryState, warmup_count
from jaxhistory._hlo import collective_counts
from jaxhistory._reduce import (
    reduce_custom,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_std,
    reduce_sum,
)
from jaxhistory._stats import (
    STATS,
    Stats,
    distributed_stats,
    distributed_stats_collective,
    per_shard,
)
from jaxhistory.launch import LaunchError, launch_local

__version__ = "0.1.0"

__all__ = [
    "STATS",
    "History",
    "HistoryState",
    "LaunchError",
    "MetricBuffer",
    "Stats",
    "__version__",
    "all_gather",
    "collect_from_devices",
    "collective_counts",
    "distributed_default",
    "distributed_stats",
    "distributed_stats_collective",
    "export",
    "launch_local",
    "per_shard",
    "reduce_custom",
    "reduce_custom_collective",
    "reduce_max",
    "reduce_max_collective",
    "reduce_mean",
    "reduce_mean_collective",
    "reduce_min",
    "reduce_min_collective",
    "reduce_std",
    "reduce_std_collective",
    "reduce_sum",
    "reduce_sum_collective",
    "warmup_count",
]
