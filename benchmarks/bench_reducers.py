"""Benchmark: mean, max, min and std of K metrics across 8 devices, six ways.

Compares, for K = 1, 10 and 100 metrics (one float32 value per device each):

* ``fused``: :func:`jaxhistory.distributed_stats` inside ``jax.jit`` (SPMD);
* ``fused_collective``: :func:`jaxhistory.collective.distributed_stats` inside
  ``jax.shard_map``;
* ``fused_dict``: ``fused`` returning a dict of 4*K scalars rather than one
  (4, K) table, to show what the output format costs;
* ``naive``: ``jnp.mean``/``jnp.max``/``jnp.min`` and a two-pass std, written one
  metric at a time, returning a dict of 4*K scalars;
* ``naive_stacked``: the same reductions returned as one (4, K) array, which
  separates the cost of the collectives from the cost of 4*K outputs;
* ``all_gather``: one ``shard_map`` per metric that all-gathers the metric and
  computes the four statistics locally.

For each it reports the collectives XLA compiled in (``jaxhistory.collective_counts``)
and the median wall time per call. Every call waits for its result
(``jax.block_until_ready``), so at most one step is in flight at a time.

Run: ``make bench`` or
``python benchmarks/bench_reducers.py [--out PATH] [--repeats R] [--calls N]``;
``--quick`` is a fast smoke run.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory

if jax.device_count() != 8:
    sys.exit(
        f"error: this benchmark needs 8 devices, JAX sees {jax.device_count()}; "
        "set JAX_NUM_CPU_DEVICES=8 before JAX starts"
    )

NUM_DEVICES = 8
KS = (1, 10, 100)
TIMES = "\N{MULTIPLICATION SIGN}"
HEADER = (
    "| K | implementation | collectives | compile s | median µs/call | ratio vs fused |"
)


def make_metrics(mesh: jax.sharding.Mesh, k: int, seed: int = 0) -> dict:
    """K metrics, each of shape (8,) sharded one value per device.

    Values are 1e4 plus noise of std 0.5 to 2, so that float32 sums of squares
    would lose the spread (1e4**2 needs all of float32's precision).
    """
    rng = np.random.default_rng(seed + k)
    sharding = NamedSharding(mesh, P("data"))
    out = {}
    for i in range(k):
        scale = rng.uniform(0.5, 2.0)
        host = (1e4 + scale * rng.standard_normal(NUM_DEVICES)).astype(np.float32)
        out[f"m{i}"] = jax.device_put(host, sharding)
    return out


def fused(metrics: dict) -> dict:
    return jaxhistory.distributed_stats(metrics)


def fused_dict(metrics: dict) -> dict:
    """``fused`` returned as a plain dict of 4*K scalars instead of one table."""
    return dict(jaxhistory.distributed_stats(metrics))


def naive(metrics: dict) -> dict:
    """What a user writes by hand: four reductions per metric, one metric at a time."""
    out = {}
    for name, v in metrics.items():
        mean = jnp.mean(v)
        out[f"{name}/mean"] = mean
        out[f"{name}/max"] = jnp.max(v)
        out[f"{name}/min"] = jnp.min(v)
        out[f"{name}/std"] = jnp.sqrt(jnp.mean((v - mean) ** 2))
    return out


def naive_stacked(metrics: dict) -> jaxhistory.Stats:
    """The same per-metric reductions, returned as one (4, K) array.

    Separates the two costs of ``naive``: its collectives (13 at K=10) and its
    4*K separate output buffers. This variant keeps the collectives but has one
    output, like ``fused``.
    """
    columns = []
    for v in metrics.values():
        mean = jnp.mean(v)
        std = jnp.sqrt(jnp.mean((v - mean) ** 2))
        columns.append(jnp.stack([mean, jnp.max(v), jnp.min(v), std]))
    return jaxhistory.Stats(tuple(metrics), jnp.stack(columns, axis=1))


def make_all_gather(mesh: jax.sharding.Mesh) -> Callable[[dict], dict]:
    """One shard_map per metric: all-gather it, then compute the stats locally.

    With ``check_vma=True`` the result of ``lax.all_gather`` still counts as varying
    over "data" (JAX does not know every device holds the same vector), so the stats
    cannot be returned with ``out_specs=P()``. Each device instead returns its own
    copy as a ``(1,)`` block with ``out_specs=P("data")``: every statistic comes back
    as an ``(8,)`` array, one identical copy per device, and no extra collective is
    added to make it replicated (check_vma keeps its default, True). ``to_host``
    checks that the copies agree; the statistic reported is copy 0, read on the
    host outside the timed loop.
    """

    def stats_of_one(v_local: jax.Array) -> dict:
        v = lax.all_gather(v_local, "data", tiled=True)  # shape (8,) on every device
        mean = jnp.mean(v)
        std = jnp.sqrt(jnp.mean((v - mean) ** 2))
        return {
            "mean": mean[None],
            "max": jnp.max(v)[None],
            "min": jnp.min(v)[None],
            "std": std[None],
        }

    per_metric = jax.shard_map(
        stats_of_one, mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )

    def all_gather(metrics: dict) -> dict:
        out = {}
        for name, v in metrics.items():
            for stat, value in per_metric(v).items():
                out[f"{name}/{stat}"] = value
        return out

    return all_gather


def make_fused_collective(mesh: jax.sharding.Mesh) -> Callable[[dict], dict]:
    return jax.shard_map(
        lambda m: jaxhistory.collective.distributed_stats(
            jax.tree.map(lambda v: v[0], m), "data"
        ),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=True,
    )


def to_host(stats: dict) -> dict[str, np.ndarray]:
    """Stats as NumPy scalars; per-device copies (all_gather) must all agree."""
    out = {}
    for key, value in stats.items():
        arr = np.asarray(value)
        if arr.ndim:
            if not np.all(arr == arr[0]):
                raise AssertionError(f"per-device copies of {key} differ: {arr}")
            arr = arr[0]
        out[key] = arr
    return out


def reference(metrics: dict) -> dict[str, float]:
    """float64 NumPy statistics of every metric."""
    out = {}
    for name, v in metrics.items():
        x = np.asarray(v, dtype=np.float64)
        out.update(
            {
                f"{name}/mean": x.mean(),
                f"{name}/max": x.max(),
                f"{name}/min": x.min(),
                f"{name}/std": x.std(),
            }
        )
    return out


def check_agree(results: dict[str, dict], metrics: dict) -> None:
    """Fails loudly unless every implementation matches float64 NumPy (rtol 1e-4)."""
    ref = reference(metrics)
    for impl, stats in results.items():
        if set(stats) != set(ref):
            raise AssertionError(f"{impl} returned keys {sorted(stats)[:8]}...")
        for key, want in ref.items():
            got = stats[key]
            if not np.allclose(got, want, rtol=1e-4, atol=1e-6):
                raise AssertionError(
                    f"{impl} disagrees on {key}: got {float(got)!r}, "
                    f"float64 reference {want!r}"
                )


def time_calls(fn: Callable, metrics: dict, calls: int) -> float:
    """Mean seconds per call over ``calls`` calls, waiting for each one."""
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(metrics))
    return (time.perf_counter() - start) / calls


def machine_info() -> str:
    return (
        f"jax {jax.__version__}, {jax.device_count()} devices, "
        f"platform {jax.default_backend()}, os.cpu_count()={os.cpu_count()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats")
    parser.add_argument("--calls", type=int, default=20, help="calls per repeat")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2 repeats of 3 calls"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.calls = 2, 3
    if args.repeats < 1 or args.calls < 1:
        parser.error("--repeats and --calls must be at least 1")

    info = machine_info()
    print(info, flush=True)

    mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
    impls = {
        "fused": jax.jit(fused),
        "fused_collective": jax.jit(make_fused_collective(mesh)),
        "fused_dict": jax.jit(fused_dict),
        "naive": jax.jit(naive),
        "naive_stacked": jax.jit(naive_stacked),
        "all_gather": jax.jit(make_all_gather(mesh)),
    }

    rows = []
    for k in KS:
        metrics = make_metrics(mesh, k)
        counts = {}
        results = {}
        compile_s = {}
        for name, fn in impls.items():
            start = time.perf_counter()
            fn.lower(metrics).compile()
            compile_s[name] = time.perf_counter() - start
            counts[name] = sum(jaxhistory.collective_counts(fn, metrics).values())
            results[name] = to_host(jax.block_until_ready(fn(metrics)))  # warm-up
        check_agree(results, metrics)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(args.repeats):  # implementations interleaved in each repeat
            for name, fn in impls.items():
                times[name].append(time_calls(fn, metrics, args.calls))
        medians = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
        for name in impls:
            ratio = medians[name] / medians["fused"]
            rows.append(
                f"| {k} | {name} | {counts[name]} | {compile_s[name]:.2f} "
                f"| {medians[name]:.0f} "
                f"| {ratio:.2f}{TIMES} |"
            )
        print(f"K={k}: done", flush=True)

    table = "\n".join([HEADER, "|---:|---|---:|---:|---:|---:|", *rows])
    settings = (
        f"{args.repeats} repeats of {args.calls} calls; median over repeats "
        "of the mean time per call"
    )
    text = f"{info}\n{settings}\n\n{table}\n"
    print()
    print(text, end="", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
