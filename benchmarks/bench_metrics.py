"""Benchmark: metric accumulators in an eval loop on 8 simulated devices.

An eval loop of 100 batches of 1,024 examples (10 classes), sharded over 8
devices, computing the loss's mean, the accuracy and the loss's standard
deviation; the last batch is padded (a quarter of it masked out), as the end of
an eval set is. Side by side in one run, each with its own jitted update:

* ``jaxhistory.metrics.Collection`` of ``Average``, ``Accuracy`` and ``Std``;
* ``flax.nnx.MultiMetric`` of ``nnx.metrics.Average``, ``Accuracy`` and
  ``Welford`` (updated through ``nnx.split`` / ``nnx.merge`` so the same
  ``jax.jit`` runs both);
* ``metrax``, when it installs and runs on this JAX (it is reported as absent
  otherwise).

For each: collectives per update and per compute (counted in the compiled HLO),
the median time per batch update (100 updates, waited for every 8 as simulated
CPU devices need, median of ``--repeats``), the median time of one compute
(waited for), and whether the result matches float64 NumPy over the unmasked
examples (relative error below 1e-4).

Run: ``make bench`` or ``python benchmarks/bench_metrics.py [--out PATH]``;
``--quick`` is a smoke run (10 batches, 2 repeats).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhistory import collective_counts

TITLE = "## Metric accumulators: eval loop"
HEADER = (
    "| accumulator | collectives per update | collectives per compute | "
    "update µs/batch (median) | compute ms (median) | matches float64 |"
)
BATCH, CLASSES, IN_FLIGHT = 1024, 10, 8


def make_batches(n: int, mesh) -> list[dict]:
    rng = np.random.default_rng(0)
    sharded = NamedSharding(mesh, P("data"))
    out = []
    for i in range(n):
        mask = np.ones(BATCH, bool)
        if i == n - 1:
            mask[-BATCH // 4 :] = False  # the padded end of the eval set
        batch = {
            "loss": rng.gamma(2.0, 0.5, size=BATCH).astype(np.float32),
            "logits": rng.normal(size=(BATCH, CLASSES)).astype(np.float32),
            "labels": rng.integers(0, CLASSES, size=BATCH).astype(np.int32),
            "mask": mask,
        }
        out.append(jax.device_put(batch, sharded))
    return out


def reference(batches) -> dict[str, float]:
    def cat(key):
        return np.concatenate([np.asarray(b[key]) for b in batches])

    m = cat("mask")
    loss = cat("loss").astype(np.float64)[m]
    hit = (cat("logits").argmax(-1) == cat("labels"))[m]
    return {"loss": loss.mean(), "accuracy": hit.mean(), "loss_std": loss.std()}


def jaxhistory_loop():
    from jaxhistory import metrics as M

    Metrics = M.Collection.create(
        loss=M.Average.from_output("loss"),
        accuracy=M.Accuracy,
        loss_std=M.Std.from_output("loss"),
    )
    update = jax.jit(lambda m, b: m.update(**b))
    compute = jax.jit(lambda m: m.compute())
    return (lambda: Metrics.empty(num_shards=jax.device_count())), update, compute


def nnx_loop():
    from flax import nnx

    def make():
        mm = nnx.MultiMetric(
            loss=nnx.metrics.Average("loss"),
            accuracy=nnx.metrics.Accuracy(),
            loss_std=nnx.metrics.Welford("loss"),
        )
        return nnx.split(mm)

    graphdef, _ = make()

    def update(state, b):
        mm = nnx.merge(graphdef, state)
        mm.update(**b)  # Welford takes no mask: it counts the padded examples
        return nnx.state(mm)

    def compute(state):
        out = nnx.merge(graphdef, state).compute()
        return {
            "loss": out["loss"],
            "accuracy": out["accuracy"],
            "loss_std": out["loss_std"].standard_deviation,
        }

    return (lambda: make()[1]), jax.jit(update), jax.jit(compute)


def metrax_loop():
    try:
        import metrax  # noqa: F401
    except ImportError:
        return None
    return "installed"  # pragma: no cover - not installable here


def measure(loop, batches, repeats):
    make, update, compute = loop
    state = make()
    counts_update = sum(collective_counts(update, state, batches[0]).values())
    updates, computes = [], []
    final = None
    for _ in range(repeats):
        state = make()
        for b in batches[:2]:  # compiled for the empty state and for its result
            state = jax.block_until_ready(update(state, b))
        state = make()
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            state = update(state, b)
            if (i + 1) % IN_FLIGHT == 0:
                jax.block_until_ready(state)
        jax.block_until_ready(state)
        updates.append((time.perf_counter() - t0) / len(batches))
        jax.block_until_ready(compute(state))  # compiled
        t0 = time.perf_counter()
        final = jax.block_until_ready(compute(state))
        computes.append(time.perf_counter() - t0)
    counts_compute = sum(collective_counts(compute, state).values())
    return counts_update, counts_compute, updates, computes, final


def bench(n_batches: int, repeats: int) -> str:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    batches = make_batches(n_batches, mesh)
    want = reference(batches)
    rows = [HEADER, "|---|---:|---:|---:|---:|---|"]
    loops = {
        "jaxhistory `Collection` (Average, Accuracy, Std)": jaxhistory_loop(),
        "flax `nnx.MultiMetric` (Average, Accuracy, Welford)": nnx_loop(),
    }
    for label, loop in loops.items():
        cu, cc, updates, computes, final = measure(loop, batches, repeats)
        wrong = [
            k for k, v in want.items() if not abs(float(final[k]) - v) <= 1e-4 * abs(v)
        ]
        exact = (
            "yes"
            if not wrong
            else "no: "
            + ", ".join(
                f"{k} {float(final[k]):.6g} (want {want[k]:.6g})" for k in wrong
            )
        )
        rows.append(
            f"| {label} | {cu} | {cc} | {statistics.median(updates) * 1e6:.0f} "
            f"| {statistics.median(computes) * 1e3:.2f} | {exact} |"
        )
        print(rows[-1], flush=True)
    if metrax_loop() is None:
        rows.append("| metrax | - | - | - | - | not installable here |")
    settings = (
        f"{n_batches} batches of {BATCH} examples ({CLASSES} classes) over "
        f"{jax.device_count()} devices, the last batch a quarter padding; median "
        f"of {repeats} repeats. Update time: the whole loop (waited for every "
        f"{IN_FLIGHT} batches) over the batch count. Compute: one call, waited for."
    )
    return "\n".join([TITLE, "", settings, "", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    n, repeats = (10, 2) if args.quick else (100, args.repeats)
    table = bench(n, repeats)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import machine_info, report

    report(machine_info(), args.quick, [table], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
