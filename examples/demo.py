"""Data-parallel Flax NNX training with cross-device loss statistics from jaxhistory.

This example trains a small MLP on synthetic regression data, data parallel over 8
simulated CPU devices (no GPU needed), and shows how to report how the loss is spread
across devices without leaving the jitted train step:

* the batch is sharded over the mesh axis ``"data"``; the model parameters and the
  optimizer state are replicated on every device;
* inside the ``@nnx.jit`` train step, :func:`jaxhistory.per_shard` turns the
  per-example loss (shape ``(batch,)``, sharded like the batch) into one mean loss per
  shard (shape ``(8,)``) without moving data between devices, and
  :func:`jaxhistory.distributed_stats` computes that loss's mean, max, min and
  standard deviation across the shards on device, in one all-reduce (one value
  per device; larger arrays take two);
* :func:`jaxhistory.watch` gives the gradients' and the parameter updates' norm,
  rms, largest value, zero fraction and NaN/inf count per layer and over the
  whole model, in the same step (the gradients are replicated: no collective);
* two sentinels watch the run: a NaN or infinite loss statistic or gradient
  (:class:`jaxhistory.sentinels.NonFinite`) and a loss spike
  (:class:`jaxhistory.sentinels.Spike`) each warn, naming the step;
* the host fetches the statistics only for logged steps, in one ``jax.device_get``;
* every ``--eval-every`` steps, a held-out set of 1,000 examples is evaluated in
  padded batches with a :class:`jaxhistory.metrics.Collection` (the loss's mean and
  standard deviation, and the example count): each device keeps its own partial
  sums, the padding is masked out, and ``compute`` gathers them in 2 all-reduces;
* every step is recorded in a :class:`jaxhistory.History` without waiting for the
  device, and ``history.finalize`` writes the run's outputs at the end: the dataset
  (``dataset.nc``), the JSONL log, matplotlib and terminal plots and ``report.md``.

The "mean" column is the loss the gradient is taken of; "min", "max" and "std" show
how much the devices' shards of the batch disagree.

Run it with ``make demo`` or ``python examples/demo.py --steps 200 --log-every 10
--outdir outputs/demo``.
"""

from __future__ import annotations

import argparse
import os
import time

# The demo, not the library, picks the device count: 8 simulated CPU devices. This
# must happen before JAX is imported (setdefault keeps a count set by the caller).
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory
from jaxhistory import trace
from jaxhistory.sentinels import NonFinite, Spike

IN_FEATURES = 16
HIDDEN = 64
NUM_EXAMPLES = 8192
NUM_EVAL = 1000  # not a multiple of the batch: the last eval batch is padded

# Eval metrics: per-device partial state, merged over batches, gathered at the end.
EvalMetrics = jaxhistory.metrics.Collection.create(
    loss=jaxhistory.metrics.Average.from_output("loss"),
    loss_std=jaxhistory.metrics.Std.from_output("loss"),
    examples=jaxhistory.metrics.Count.from_output("loss"),
)

# Simulated CPU devices run their collectives on a small pool of host threads; when
# more than about 16 jitted steps containing cross-device collectives are queued
# without the host waiting on any of them, the devices can deadlock waiting for each
# other. Waiting on a result at least this often keeps the queue short.
MAX_STEPS_IN_FLIGHT = 8


class MLP(nnx.Module):
    """A two-hidden-layer perceptron with ReLU activations and one output."""

    def __init__(self, in_features: int, hidden: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(in_features, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.linear1(x))
        x = nnx.relu(self.linear2(x))
        return self.out(x)


def make_dataset(seed: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Synthetic regression data, a smooth nonlinear target plus a little noise:
    the training set and a held-out set of ``NUM_EVAL`` examples."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(NUM_EXAMPLES, IN_FEATURES)).astype(np.float32)
    w = rng.normal(size=(IN_FEATURES, 1)).astype(np.float32) / np.sqrt(IN_FEATURES)
    v = rng.normal(size=(IN_FEATURES, 1)).astype(np.float32) / np.sqrt(IN_FEATURES)
    sets = []
    for inputs in (x, rng.normal(size=(NUM_EVAL, IN_FEATURES)).astype(np.float32)):
        y = np.sin(2.0 * inputs @ w) + 0.5 * (inputs @ v) ** 2
        y += 0.05 * rng.normal(size=y.shape).astype(np.float32)
        sets.append((inputs, y.astype(np.float32)))
    return tuple(sets)


@nnx.jit
def train_step(
    model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array
) -> tuple[jaxhistory.Stats, jaxhistory.Stats, jaxhistory.Stats]:
    """One optimizer step; returns the loss's cross-device statistics and the
    per-layer statistics of the gradients and of the parameter updates."""

    def loss_fn(model: MLP) -> tuple[jax.Array, jax.Array]:
        per_example = jnp.mean(jnp.square(model(x) - y), axis=-1)  # (batch,)
        return jnp.mean(per_example), per_example

    grads, per_example = nnx.grad(loss_fn, has_aux=True)(model)
    # (a copy: the optimizer updates the model's variables in place)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    updates = jax.tree.map(jnp.subtract, nnx.state(model, nnx.Param), before)
    # per_shard: (batch,) sharded over "data" -> (8,), one mean loss per device.
    stats = jaxhistory.distributed_stats({"loss": jaxhistory.per_shard(per_example)})
    # One entry per layer (groups="*": linear1, linear2, out) and one over the
    # whole model: grads/norm is the global gradient norm.
    grad_stats = jaxhistory.watch(grads, groups="*")
    update_stats = jaxhistory.watch(updates, groups="*", stats=("norm", "max_abs"))
    return stats, grad_stats, update_stats


@nnx.jit
def eval_step(model: MLP, metrics, x: jax.Array, y: jax.Array, mask: jax.Array):
    """Adds one (padded) batch to the eval metrics: no data moves between devices."""
    per_example = jnp.mean(jnp.square(model(x) - y), axis=-1)
    return metrics.update(loss=per_example, mask=mask)


def evaluate(model: MLP, data, batch_size: int, sharding) -> dict[str, jax.Array]:
    """The eval metrics over ``data`` in padded batches (JAX arrays, not waited for)."""
    xs, ys = data
    metrics = EvalMetrics.empty(num_shards=jax.device_count())
    for start in range(0, len(xs), batch_size):
        n = min(batch_size, len(xs) - start)
        x = np.zeros((batch_size, xs.shape[1]), np.float32)
        y = np.zeros((batch_size, ys.shape[1]), np.float32)
        x[:n], y[:n] = xs[start : start + n], ys[start : start + n]
        mask = np.arange(batch_size) < n  # False on the padding
        batch = jax.device_put((x, y), sharding)
        mask = jax.device_put(mask, NamedSharding(sharding.mesh, P("data")))
        metrics = eval_step(model, metrics, *batch, mask)
    return metrics.compute()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--log-every", type=int, default=10, help="steps per log line")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--seed", type=int, default=0, help="data and init seed")
    parser.add_argument(
        "--outdir", default="outputs/demo", help="where finalize writes the outputs"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    parser.add_argument(
        "--eval-every", type=int, default=50, help="steps between evaluations"
    )
    parser.add_argument(
        "--no-plots",
        dest="plots",
        action="store_false",
        help="skip the PNG and terminal plots (dataset, log and report only)",
    )
    args = parser.parse_args(argv)

    n = jax.device_count()
    if args.batch_size % n:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of {n}")
    if args.steps < 1 or args.log_every < 1 or args.eval_every < 1:
        parser.error("--steps, --log-every and --eval-every must be positive")

    mesh = jax.make_mesh((n,), ("data",))
    batch_sharding = NamedSharding(mesh, P("data", None))
    (xs, ys), held_out = make_dataset(args.seed)  # held_out: never trained on
    batch_rng = np.random.default_rng(args.seed + 1)

    # Host RSS and device memory of each stage (on CPU devices: live array bytes).
    tracker = jaxhistory.MemoryTracker()
    with jax.set_mesh(mesh):
        # Data parallel: arrays created under the mesh without a sharding of their
        # own are replicated, so every device holds a full copy of the parameters and
        # of the optimizer state; only the batch is split.
        tracker.start("init")
        model = MLP(IN_FEATURES, HIDDEN, rngs=nnx.Rngs(args.seed))
        optimizer = nnx.Optimizer(
            model, optax.adamw(args.lr, weight_decay=1e-4), wrt=nnx.Param
        )
        # Compile the evaluation up front (its first call compiles, a second or
        # so here): the evaluation at step 50 then takes milliseconds, and shares
        # the step's line in the JSONL log.
        jax.block_until_ready(
            evaluate(model, held_out, args.batch_size, batch_sharding)
        )
        tracker.stop("init")
        tracker.start("train")
        # Records every step; a JSONL log streams to the output folder meanwhile.
        history = jaxhistory.History(
            keys=["train/loss"],
            log_every=args.log_every,  # perf/steps_per_sec and perf/eta_sec there
            total_steps=args.steps,
            report_dir=args.outdir,
            run_name=f"demo-seed{args.seed}",
            # Warn at a NaN/inf loss statistic or gradient, and at a loss spike.
            sentinels=[
                NonFinite(["train/*", "grads/*"]),
                Spike("train/loss/mean", window=50),
            ],
        )

        # A Chrome trace of the run (open traces/merged_trace.json in Perfetto):
        # StopWatch spans, and the recorded metrics as counter tracks.
        tracing = trace.JSONTraceHandler(
            folder=os.path.join(args.outdir, "traces"),
            overwrite=True,  # a rerun of the demo replaces its traces
            run_name=f"demo-seed{args.seed}",
        )
        tracing.start()
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            idx = batch_rng.integers(0, NUM_EXAMPLES, size=args.batch_size)
            with jaxhistory.StopWatch("dispatch step"):  # host time: jit is async
                x, y = jax.device_put((xs[idx], ys[idx]), batch_sharding)
                out = train_step(model, optimizer, x, y)
            stats, grads, updates = out
            # Stats are recorded as train/loss/mean|max|min|std, grads/linear1/norm,
            # ...; nothing waits here.
            history.update(
                {
                    "step": step,
                    "train": stats,
                    "grads": grads,
                    "updates": updates,
                    "lr": args.lr,
                },
                summarize=False,
            )
            if step % args.log_every == 0 or step == args.steps:
                # Timed after this step's update: step= records it at this step.
                with jaxhistory.StopWatch("wait and log", history=history, step=step):
                    s, g, _ = jax.device_get(out)  # one transfer for all
                    grad_norm = g["norm"]
                    print(
                        f"step={step:4d}  loss mean={s['loss/mean']:.6f} "
                        f"min={s['loss/min']:.6f} max={s['loss/max']:.6f} "
                        f"std={s['loss/std']:.6f}  grad_norm={grad_norm:.4f}",
                        flush=True,
                    )
            if step % args.eval_every == 0 or step == args.steps:
                # eval/loss, eval/loss_std, eval/examples, recorded without waiting
                results = evaluate(model, held_out, args.batch_size, batch_sharding)
                history.update({"eval": results}, step=step, summarize=False)
                jax.block_until_ready(results)  # its all-reduces: keep the queue short
            elif step % MAX_STEPS_IN_FLIGHT == 0:
                # See MAX_STEPS_IN_FLIGHT: never let too many steps queue up.
                jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        history.flush()  # the last metrics into the trace as well
        tracing.close()
        tracker.stop("train")

    print(
        f"done: {n} devices, {args.steps} steps, batch {args.batch_size}, "
        f"{elapsed:.2f} s wall time"
    )
    # Dataset, JSONL log, plots and report; prints the terminal summary plot.
    history.finalize(args.outdir, warmup=0.05, plot=args.plots)
    # End-of-training table and train_results.json / all_results.json.
    results = {
        "train_runtime": elapsed,
        "train_steps_per_second": args.steps / elapsed,
        "train_loss": history.state.last("train/loss/mean"),
        **tracker.metrics(),
    }
    jaxhistory.log_metrics("train", results)
    jaxhistory.save_metrics("train", results, args.outdir)
    print(f"outputs: {os.path.abspath(args.outdir)} (open report.md)")


if __name__ == "__main__":
    main()
