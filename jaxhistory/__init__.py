"""jaxhistory: cross-device metrics for JAX and Flax training runs.

Reducers compute statistics across devices inside jitted train steps:

* SPMD (inside ``jax.jit`` / ``nnx.jit`` on global arrays): :func:`reduce_mean`,
  :func:`reduce_sum`, :func:`reduce_max`, :func:`reduce_min`, :func:`reduce_std`,
  :func:`reduce_custom`, :func:`distributed_stats`, :func:`per_shard`, and
  :func:`watch` (norm, rms, max_abs, zero fraction, NaN/inf count of every leaf
  of a pytree: per-layer gradients, parameters, updates) and :func:`histogram`
  (counts over fixed bins, across devices).
* Collective (inside ``jax.shard_map``, ``axis_name`` required): the
  :mod:`jaxhistory.collective` namespace (``jh.collective.reduce_mean``, ...,
  ``jh.collective.distributed_stats``, ``jh.collective.all_gather``); on the
  host, :func:`collect_from_devices`.

Accumulators that merge across batches and devices (``Average``, ``Accuracy``,
``Std``, ``Collection``, ...): :mod:`jaxhistory.metrics`.

Recording: :class:`HistoryState`, :class:`History`, :class:`MetricBuffer`; checks
that act before a crash in :mod:`jaxhistory.sentinels` (``NonFinite``, ``Spike``);
outputs in :mod:`jaxhistory.export`. End-of-stage reports: :func:`log_metrics`,
:func:`metrics_format`, :func:`save_metrics`, :func:`save_state`,
:class:`MemoryTracker`, :func:`device_memory`, :func:`compiled_memory`.
Publishing and timing: :mod:`jaxhistory.publish` (``put_metric``, ``@prof``),
:class:`StopWatch`, :mod:`jaxhistory.trace` (Chrome traces), and
:mod:`jaxhistory.sinks` (console, JSONL, TensorBoard, W&B).

``import jaxhistory`` imports jax, numpy and orjson only.
"""

from jaxhistory import (
    _moved,
    _version,
    collective,
    export,
    metrics,
    publish,
    sentinels,
    sinks,
    trace,
)
from jaxhistory._buffer import MetricBuffer
from jaxhistory._collective import all_gather, collect_from_devices
from jaxhistory._distributed import distributed_default
from jaxhistory._history import History
from jaxhistory._history_state import HistoryState, warmup_count
from jaxhistory._hlo import collective_bytes, collective_counts, step_flops
from jaxhistory._memory import (
    MemorySample,
    MemoryTracker,
    compiled_memory,
    device_memory,
    live_array_bytes,
)
from jaxhistory._quantiles import histogram
from jaxhistory._reduce import (
    reduce_custom,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_std,
    reduce_sum,
)
from jaxhistory._results import log_metrics, metrics_format, save_metrics, save_state
from jaxhistory._stats import (
    PROVENANCE,
    STATS,
    Stats,
    distributed_stats,
    per_shard,
)
from jaxhistory._timing import StopWatch
from jaxhistory._watch import DEFAULT_WATCH, WATCH_STATS, watch
from jaxhistory.launch import LaunchError, launch_local

__version__ = _version.__version__

__all__ = [
    "DEFAULT_WATCH",
    "PROVENANCE",
    "STATS",
    "WATCH_STATS",
    "History",
    "HistoryState",
    "LaunchError",
    "MemorySample",
    "MemoryTracker",
    "MetricBuffer",
    "Stats",
    "StopWatch",
    "__version__",
    "all_gather",
    "collect_from_devices",
    "collective",
    "collective_bytes",
    "collective_counts",
    "compiled_memory",
    "device_memory",
    "distributed_default",
    "distributed_stats",
    "export",
    "histogram",
    "launch_local",
    "live_array_bytes",
    "log_metrics",
    "metrics",
    "metrics_format",
    "per_shard",
    "publish",
    "reduce_custom",
    "reduce_max",
    "reduce_mean",
    "reduce_min",
    "reduce_std",
    "reduce_sum",
    "save_metrics",
    "save_state",
    "sentinels",
    "sinks",
    "step_flops",
    "trace",
    "warmup_count",
    "watch",
]

# The shard_map forms moved into jaxhistory.collective; the old top-level
# names keep working for one release.
_MOVED = {
    f"{name}_collective": ("jaxhistory.collective", name)
    for name in collective.__all__
    if name not in ("all_gather", "watch", "histogram")  # (never had the suffix)
}


def __getattr__(name: str):
    return _moved.moved("jaxhistory", name, _MOVED)
