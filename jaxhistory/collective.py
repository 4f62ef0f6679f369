"""Reducers for inside ``jax.shard_map``: each takes the mesh ``axis_name`` (a
name or a tuple of names) the values are spread over and runs ``lax`` collectives
(``psum``, ``pmax``, ``pmin``) over it, fused by dtype where several leaves go
together.

* :func:`reduce_mean`, :func:`reduce_sum`, :func:`reduce_max`,
  :func:`reduce_min`, :func:`reduce_std`: one statistic of a pytree across the
  axis (and within each shard).
* :func:`reduce_custom`: several statistics of a pytree in one fused set of
  collectives.
* :func:`distributed_stats`: mean, max, min and std of every metric (and, with
  provenance, which device holds the max, min and first NaN) as one
  :class:`~jaxhistory.Stats`, in at most two all-reduces.
* :func:`all_gather`: every leaf from every shard, one collective per dtype.
* :func:`histogram`: counts of the values over fixed bins, in one ``psum``.
* :func:`watch`: norm, rms, max_abs, zero fraction and non-finite count of
  every leaf of a pytree (gradients, parameters), in one ``pmax`` and one
  ``psum``.

The SPMD forms (inside ``jax.jit`` on global arrays) are the top-level names
``jaxhistory.reduce_mean``, ..., ``jaxhistory.distributed_stats`` and
``jaxhistory.watch``.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jaxhistory as jh
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))
    >>> f = jax.shard_map(
    ...     lambda v: jh.collective.reduce_mean(v, "data"),
    ...     mesh=mesh, in_specs=P("data"), out_specs=P(),
    ... )
    >>> float(f(x))
    3.5
"""

from jaxhistory._collective import all_gather
from jaxhistory._collective import reduce_custom_collective as reduce_custom
from jaxhistory._collective import reduce_max_collective as reduce_max
from jaxhistory._collective import reduce_mean_collective as reduce_mean
from jaxhistory._collective import reduce_min_collective as reduce_min
from jaxhistory._collective import reduce_std_collective as reduce_std
from jaxhistory._collective import reduce_sum_collective as reduce_sum
from jaxhistory._quantiles import histogram_collective as histogram
from jaxhistory._stats import distributed_stats_collective as distributed_stats
from jaxhistory._watch import watch_collective as watch

__all__ = [
    "all_gather",
    "distributed_stats",
    "histogram",
    "reduce_custom",
    "reduce_max",
    "reduce_mean",
    "reduce_min",
    "reduce_std",
    "reduce_sum",
    "watch",
]
