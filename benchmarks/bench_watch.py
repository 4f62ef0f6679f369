"""Benchmark: ``jaxhistory.watch`` in a train step of ~1,000 leaves; quantiles.

A model of ``L`` dense layers (a ``(64, 64)`` kernel and a ``(64,)`` bias each:
``2 L`` parameter leaves, 1,000 at the default ``L = 500``) trained with SGD on 8
simulated CPU devices, the batch sharded over the devices. Two placements of the
parameters: replicated (data parallel: the gradients come out replicated) and
FSDP-like (each kernel's first axis sharded over the devices: so are its
gradients). The variants of the step, side by side in one run:

* ``bare``: returns the loss;
* ``watch``: also returns ``jh.watch(grads)`` (norm, rms, max_abs, zero_frac,
  nonfinite of every leaf and over all of them), one ``Stats`` array;
* ``watch_everywhere`` (replicated placement only): ``jh.watch(grads,
  spread=False)``, every device reading every leaf with no collective, where
  ``watch`` spreads the replicated tree (each leaf read on one device, one
  all-reduce);
* ``by_hand``: also returns ``optax.global_norm`` of each leaf (a dict of 1,000
  scalars), read on the host with ``jax.device_get`` per leaf, as a user would
  write it without jaxhistory.

Each step's output is recorded right after the step is launched, and every
variant waits for its output once per repeat of 8 steps (History records
without waiting; the per-leaf reads of ``by_hand`` wait for their step).
For each: the collectives in the compiled step (from its HLO), the median step
time over repeats (each repeat runs the variants in a rotated order) and the
paired ratio to ``bare`` (per repeat, bare's time over the variant's, then the
median), and the host time to record the step's output in a ``History``
(``watch``: one packed row; ``by_hand``: 1,000 host reads and a dict).

Then the quantiles of ``distributed_stats(..., quantiles=...)`` for arrays of
more than one value per device (read from a histogram whose counts ride in the
sum all-reduce): the rank error (how far the returned value's rank is from the
quantile asked for) over 140 random arrays of 10^4 to 10^6 elements (normal,
lognormal, uniform, exponential, Student-t with 2 degrees of freedom, ReLU-like
and magnitudes spanning 1e-10..1e10, in turn), sharded over the 8 devices, per
dtype (float32, bfloat16), for the 1st, 10th, 50th, 90th and 99th percentiles.

Run: ``make bench`` or
``python benchmarks/bench_watch.py [--out PATH] [--layers L] [--repeats R]``;
``--quick`` is a smoke run with 20 layers, 3 repeats and 3 arrays of 10,000
values.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_info, report

WIDTH = 64
BATCH = 256
STEPS_PER_REPEAT = 8
LOOP_TARGET = 0.97  # bare step time / watch step time, paired


def make_params(layers: int, mesh, fsdp: bool) -> dict:
    rng = np.random.default_rng(0)
    kernel_spec = P("data") if fsdp else P()
    params = {}
    for i in range(layers):
        w = rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)
        params[f"layer{i:04d}"] = {
            "kernel": jax.device_put(jnp.float32(w), NamedSharding(mesh, kernel_spec)),
            "bias": jax.device_put(jnp.zeros(WIDTH), NamedSharding(mesh, P())),
        }
    return params


def loss_fn(params, x):
    for name in sorted(params):
        p = params[name]
        x = jnp.tanh(x @ p["kernel"] + p["bias"])
    return jnp.mean(jnp.square(x))


def make_step(variant: str):
    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        new = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        out = {"loss": loss}
        if variant == "watch":
            out["grads"] = jh.watch(grads)
        elif variant == "watch_everywhere":  # every device reads every leaf
            out["grads"] = jh.watch(grads, spread=False)
        elif variant == "by_hand":
            out["grads"] = {
                jax.tree_util.keystr(path): optax.global_norm(g)
                for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
            }
        return new, out

    return jax.jit(step, donate_argnums=0)


def record(history: jh.History, out: dict, variant: str, step: int) -> None:
    if variant == "by_hand":
        host = {k: float(jax.device_get(v)) for k, v in out["grads"].items()}
        history.update({"loss": out["loss"], "grads": host}, step=step, summarize=False)
    else:
        history.update(out, step=step, summarize=False)


def bench(layers: int, repeats: int, fsdp: bool) -> str:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.device_put(
        jnp.ones((BATCH, WIDTH), jnp.float32), NamedSharding(mesh, P("data"))
    )
    variants = ["bare", "watch", "by_hand"]
    if not fsdp:  # a replicated tree is spread; side by side, without
        variants.insert(2, "watch_everywhere")
    steps = {v: make_step(v) for v in variants}
    params = {v: make_params(layers, mesh, fsdp) for v in variants}
    collectives = {}
    for v in variants:
        counts = jh.collective_counts(steps[v], params[v], x)
        collectives[v] = sum(counts.values())
    leaves = len(jax.tree.leaves(params["bare"]))
    histories = {v: jh.History(distributed_history=False) for v in variants}
    times = {v: [] for v in variants}
    host = {v: [] for v in variants}
    for v in variants:  # compile and warm up
        params[v], out = steps[v](params[v], x)
        jax.block_until_ready(out)
    counter = 0
    for r in range(repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            start = time.perf_counter()
            spent = 0.0
            for _ in range(STEPS_PER_REPEAT):
                params[v], out = steps[v](params[v], x)
                t0 = time.perf_counter()
                if v != "bare":  # every step, as a loop that logs every step
                    record(histories[v], out, v, counter)
                spent += time.perf_counter() - t0
                counter += 1
            # Waited for once a repeat (every variant alike): History needs no
            # wait to record, the per-leaf device_get of by_hand waits anyway.
            jax.block_until_ready(out)
            times[v].append((time.perf_counter() - start) / STEPS_PER_REPEAT)
            host[v].append(spent / STEPS_PER_REPEAT)
    for h in histories.values():
        h.close()
    recorded = histories["watch"].state
    if f"grads/layer{layers - 1:04d}/kernel/norm" not in recorded:
        raise AssertionError("watch's entries were not recorded")
    placement = "FSDP (kernels sharded over the devices)" if fsdp else "replicated"
    rows = [
        f"### {layers} layers, {leaves} parameter leaves, parameters {placement}",
        "",
        "| variant | collectives in the step | ms/step (median) | paired ratio to "
        "bare (median) | host ms/step recording | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    bare = times["bare"]
    for v in variants:
        ratio = statistics.median(b / t for b, t in zip(bare, times[v], strict=True))
        target = ""
        if v.startswith("watch"):
            extra = collectives[v] - collectives["bare"]
            met = "met" if ratio >= LOOP_TARGET else "**missed**"
            target = f"≥ {LOOP_TARGET} paired: {met}; {extra} extra collective(s)"
        rows.append(
            f"| {v} | {collectives[v]} | {statistics.median(times[v]) * 1e3:.2f} | "
            f"{ratio:.3f} | {statistics.median(host[v]) * 1e3:.3f} | {target} |"
        )
    return "\n".join(rows) + "\n"


QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
DISTRIBUTIONS = (
    "normal",
    "lognormal",
    "uniform",
    "exponential",
    "student_t",
    "relu",
    "decades",
)


def random_values(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    """``n`` values of one of :data:`DISTRIBUTIONS`: NumPy's generators, and
    Student-t with 2 degrees of freedom (huge values both ways), ReLU-like
    values (half exact zeros, the rest lognormal with sigma 3, spanning
    decades), and magnitudes from 1e-10 to 1e10 of both signs."""
    if kind == "student_t":
        return rng.standard_t(2, size=n)
    if kind == "relu":
        return np.maximum(rng.normal(size=n), 0) * rng.lognormal(0, 3, size=n)
    if kind == "decades":
        return 10.0 ** rng.uniform(-10, 10, size=n) * rng.choice([-1, 1], size=n)
    return getattr(rng, kind)(size=n)


def rank_error(ordered: np.ndarray, value: float, q: float) -> float:
    """How far the rank of ``value`` among ``ordered`` is from ``q`` (0 where
    ``value`` sits at rank ``q``, ties included)."""
    lo = np.searchsorted(ordered, value, side="left") / len(ordered)
    hi = np.searchsorted(ordered, value, side="right") / len(ordered)
    return 0.0 if lo <= q <= hi else min(abs(lo - q), abs(hi - q))


def bench_quantiles(arrays: int, sizes: tuple[int, ...] = ()) -> str:
    """Rank errors over ``arrays`` random arrays per dtype, of sizes
    log-uniform in 10^4..10^6, or taken in turn from ``sizes`` (fewer shapes
    to compile: an accelerator's compiles take seconds each)."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rng = np.random.default_rng(0)
    fn = jax.jit(lambda m: jh.distributed_stats(m, quantiles=QUANTILES))
    drawn = (
        f"sizes {', '.join(f'{n:,}' for n in sizes)} in turn"
        if len(sizes) > 1
        else f"{sizes[0]:,} values each"
        if sizes
        else "sizes log-uniform in 10^4..10^6 (rounded to a multiple of 8)"
    )
    rows = [
        "## Quantiles across devices, from histograms\n",
        f"{arrays} random arrays per dtype, {drawn}, "
        f"sharded over {jax.device_count()} device(s); the rank error of "
        "each quantile against the exact one of the same (rounded) values.\n",
        "| dtype | quantile | median rank error | max rank error | target |",
        "|---|---:|---:|---:|---|",
    ]
    for dtype in (jnp.float32, jnp.bfloat16):
        errors: dict[float, list[float]] = {q: [] for q in QUANTILES}
        collectives = set()
        for i in range(arrays):
            n = int(10 ** rng.uniform(4, 6)) // 8 * 8
            if sizes:
                n = sizes[i % len(sizes)]
            kind = DISTRIBUTIONS[i % len(DISTRIBUTIONS)]
            values = random_values(rng, kind, n)
            x = jax.device_put(
                jnp.asarray(values, dtype), NamedSharding(mesh, P("data"))
            )
            out = fn({"x": x})
            ordered = np.sort(np.asarray(x.astype(jnp.float32), np.float64))
            for q in QUANTILES:
                got = float(out[f"x/p{100 * q:g}"])
                errors[q].append(rank_error(ordered, got, q))
            if i < 2:
                collectives.add(sum(jh.collective_counts(fn, {"x": x}).values()))
        for q in QUANTILES:
            worst = max(errors[q])
            rows.append(
                f"| {jnp.dtype(dtype).name} | {q:g} | "
                f"{statistics.median(errors[q]):.2e} | {worst:.2e} | "
                f"≤ 1e-2: {'met' if worst <= 0.01 else '**missed**'} |"
            )
        rows.append("")
        rows.append(
            f"{jnp.dtype(dtype).name}: all-reduces per call {sorted(collectives)} "
            "(target ≤ 2)\n"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--layers", type=int, default=0, help="dense layers")
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    if jax.device_count() != 8:
        sys.exit(
            f"error: this benchmark needs 8 devices, JAX sees {jax.device_count()}"
        )
    layers = args.layers or (20 if args.quick else 500)
    repeats = args.repeats or (3 if args.quick else 15)
    sections = ["## watch(grads) in a train step\n"]
    for fsdp in (False, True):
        sections.append(bench(layers, repeats, fsdp))
    # quick: one size, so one program per dtype (each new size compiles one)
    sections.append(
        bench_quantiles(3, (10_000,)) if args.quick else bench_quantiles(140)
    )
    report(machine_info(), args.quick, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
