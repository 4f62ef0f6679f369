"""Benchmark: what recording metrics with jaxhistory costs on the host and in a loop.

Three measurements, each taken side by side in one run:

1. **Host recording speed.** 10 Python-float metrics per step, a new dict each
   step, recorded four ways: a plain dict of lists (the Python floor),
   ``state = state.update(m)`` on :class:`jaxhistory.HistoryState`,
   ``History(distributed_history=False).update(m, summarize=False)``, and the
   same with ``summarize=True`` (which also builds the summary line). Median
   µs/step over repeats at two run lengths, 10x apart, to show the scaling.
2. **Memory.** A :class:`~jaxhistory.HistoryState` of 1,000,000 steps x 16
   float64 metrics: ``nbytes()`` per stored value, and the memory Python's
   ``tracemalloc`` sees the history take while it is built.
3. **Train loop.** A Flax NNX MLP trained data parallel on 8 simulated CPU
   devices (``nnx.jit`` under ``jax.set_mesh``), the step returning 10
   replicated scalar metrics; steps/s without recording, with
   :class:`jaxhistory.History`, with History plus a per-shard loss it reduces
   across devices, and with ``float()`` of every metric every step.

Run: ``make bench`` or
``python benchmarks/bench_history.py [--out PATH] [--repeats R]``; ``--quick`` is a
fast smoke run with smaller sizes.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory

if jax.device_count() != 8:
    sys.exit(
        f"error: this benchmark needs 8 devices, JAX sees {jax.device_count()}; "
        "set JAX_NUM_CPU_DEVICES=8 before JAX starts"
    )

TIMES = "\N{MULTIPLICATION SIGN}"
HOST_METRICS = 10
MEMORY_METRICS = 16
HOST_TARGET_US = 5.0  # µs/step for HistoryState.update and History.update
SCALING_TARGET = 11.0  # 10x the steps should take at most this many times longer
MEMORY_TARGET = 10.0  # bytes per stored float64
LOOP_TARGET = 0.97  # steps/s of `history` relative to `baseline`
# Simulated CPU devices run collectives on a small pool of host threads; more than
# about 16 queued steps with collectives can deadlock them. Every train-loop variant
# waits on its latest step at least this often.
MAX_STEPS_IN_FLIGHT = 8

HOST_TITLE = "## 1. Host recording speed"
MEMORY_TITLE = "## 2. Memory"
LOOP_TITLE = "## 3. Train loop on 8 simulated CPU devices"
HOST_HEADER = (
    "| recorder | µs/step, {small} steps | µs/step, {large} steps "
    "| ratio to floor, {small} | ratio to floor, {large} "
    "| time {large} / time {small} | target |"
)
MEMORY_HEADER = "| measurement | steps | metrics | MiB | bytes per float64 | target |"
LOOP_HEADER = (
    "| variant | recording per step | steps/s | ms/step | ms/step range "
    "| µs/step in recording call | ratio vs baseline | paired ratio, median "
    "(IQR) | target |"
)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile of ``xs``."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def machine_info() -> str:
    return (
        f"jax {jax.__version__}, flax {flax.__version__}, "
        f"python {platform.python_version()}, {jax.device_count()} devices, "
        f"platform {jax.default_backend()}, os.cpu_count()={os.cpu_count()}"
    )


def fmt_steps(n: int) -> str:
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


# ----- 1. host recording speed -------------------------------------------------------
KEYS = tuple(f"m{j}" for j in range(HOST_METRICS))


def make_host_metrics(steps: int) -> list[dict[str, float]]:
    """A new dict of 10 Python floats for every step, built before any timing."""
    return [{k: float(i) for k in KEYS} for i in range(steps)]


def record_dict_of_lists(ms: list[dict]) -> int:
    lists: dict[str, list] = {}
    for m in ms:
        for k, v in m.items():
            column = lists.get(k)
            if column is None:
                column = lists[k] = []
            column.append(v)
    return len(lists["m0"])


def record_state(ms: list[dict]) -> int:
    state = jaxhistory.HistoryState()
    for m in ms:
        state = state.update(m)
    return state.count("m0")


def record_history(ms: list[dict]) -> int:
    history = jaxhistory.History(distributed_history=False)
    for m in ms:
        history.update(m, summarize=False)
    return history.state.count("m0")


def record_history_summary(ms: list[dict]) -> int:
    history = jaxhistory.History(distributed_history=False)
    line = ""
    for m in ms:
        line = history.update(m, summarize=True)
    if not line.startswith(f"step={len(ms) - 1} m0="):
        raise AssertionError(f"unexpected summary line {line!r}")
    return history.state.count("m0")


RECORDERS: dict[str, tuple[str, Callable[[list[dict]], int]]] = {
    "dict_of_lists": ("dict of lists `d[k].append(v)` (floor)", record_dict_of_lists),
    "state": ("`state = state.update(m)` (HistoryState)", record_state),
    "history": ("`History.update(m, summarize=False)`", record_history),
    "history_summary": (
        "`History.update(m, summarize=True)`",
        record_history_summary,
    ),
}


def time_recorder(fn: Callable[[list[dict]], int], ms: list[dict]) -> float:
    start = time.perf_counter()
    count = fn(ms)
    elapsed = time.perf_counter() - start
    if count != len(ms):
        raise AssertionError(f"{fn.__name__} recorded {count} of {len(ms)} steps")
    return elapsed / len(ms)


def bench_host(small: int, large: int, repeats: int) -> str:
    # One pool of `small` dicts feeds both sizes: the large run cycles through it,
    # so both runs read the same inputs from the same memory and the scaling column
    # measures the recorder alone (200k distinct prebuilt dicts fall out of cache
    # and made even the floor take ~12.7x for 10x the steps). Freezing them keeps
    # the garbage collector from rescanning them during the timed loops, which
    # would charge the recorders that allocate (all but the floor) for the
    # benchmark's own data.
    ms = make_host_metrics(small)
    gc.collect()
    gc.freeze()
    sizes = {small: ms, large: ms * (large // small)}
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(repeats):  # recorders and sizes interleaved in each repeat
            for n, data in sizes.items():
                for name, (_, fn) in RECORDERS.items():
                    times.setdefault((name, n), []).append(time_recorder(fn, data))
            print(f"host recording: repeat {r + 1}/{repeats} done", flush=True)
    finally:
        del ms, sizes
        gc.unfreeze()
        gc.collect()
    us = {key: statistics.median(ts) * 1e6 for key, ts in times.items()}
    a, b = fmt_steps(small), fmt_steps(large)
    rows = [HOST_HEADER.format(small=a, large=b), "|---|---:|---:|---:|---:|---:|---|"]
    for name, (label, _) in RECORDERS.items():
        t_small, t_large = us[name, small], us[name, large]
        # Per repeat, the two lengths run back to back: the ratio of their times
        # in the same repeat, then the median over repeats (robust to drift).
        scaling = statistics.median(
            tl * large / (ts * small)
            for ts, tl in zip(times[name, small], times[name, large], strict=True)
        )
        if name == "dict_of_lists":
            target = "the floor"
        elif name in ("state", "history"):
            worst = max(t_small, t_large)
            target = (
                f"≤ {HOST_TARGET_US:g} µs/step: {verdict(worst <= HOST_TARGET_US)}; "
                f"time ratio ≈ 10{TIMES} (≤ {SCALING_TARGET:g}): "
                f"{verdict(scaling <= SCALING_TARGET)}"
            )
        else:
            target = "none (builds a string)"
        rows.append(
            f"| {label} | {t_small:.2f} | {t_large:.2f} "
            f"| {t_small / us['dict_of_lists', small]:.1f}{TIMES} "
            f"| {t_large / us['dict_of_lists', large]:.1f}{TIMES} "
            f"| {scaling:.1f}{TIMES} | {target} |"
        )
    settings = (
        f"{HOST_METRICS} Python-float metrics per step, a dict per step from a "
        f"pool of {fmt_steps(small)} dicts built before timing (the "
        f"{fmt_steps(large)}-step run cycles through the pool); median of "
        f"{repeats} repeats, recorders interleaved; the dicts are exempt from "
        "garbage collection (gc.freeze). The time-ratio column is the median over "
        "repeats of (time for the long run / time for the short run), both taken "
        "back to back in the same repeat."
    )
    return "\n".join([HOST_TITLE, "", settings, "", *rows])


# ----- 2. memory ---------------------------------------------------------------------
MEMORY_KEYS = tuple(f"metric_{j:02d}" for j in range(MEMORY_METRICS))


def build_state(steps: int) -> jaxhistory.HistoryState:
    state = jaxhistory.HistoryState()
    for i in range(steps):
        x = float(i)
        state = state.update({k: x for k in MEMORY_KEYS})
    return state


def bench_memory(steps: int, traced_steps: int) -> str:
    values = MEMORY_METRICS
    gc.collect()
    start = time.perf_counter()
    state = build_state(steps)
    build_s = time.perf_counter() - start
    last = state.values(MEMORY_KEYS[-1])
    if len(last) != steps or last[-1] != steps - 1:
        raise AssertionError("the memory history lost records")
    nbytes = state.nbytes()
    del state, last
    gc.collect()
    print(f"memory: built {steps} steps in {build_s:.1f} s", flush=True)

    # tracemalloc slows every allocation, so it gets a run of its own (smaller in
    # a full run); it sees NumPy's buffers as well as Python objects.
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    start = time.perf_counter()
    state = build_state(traced_steps)
    traced_s = time.perf_counter() - start
    state.values(MEMORY_KEYS[0])  # staged rows moved into the arrays
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del state
    gc.collect()
    print(f"memory: traced {traced_steps} steps in {traced_s:.1f} s", flush=True)

    mib = 2.0**20
    n_values, n_traced = steps * values, traced_steps * values
    per_value = nbytes / n_values
    rows = [
        MEMORY_HEADER,
        "|---|---:|---:|---:|---:|---|",
        f"| `HistoryState.nbytes()` | {steps:,} | {values} | {nbytes / mib:.1f} "
        f"| {per_value:.2f} | ≤ {MEMORY_TARGET:g}: "
        f"{verdict(per_value <= MEMORY_TARGET)} |",
        f"| tracemalloc, current after building | {traced_steps:,} | {values} "
        f"| {(current - base) / mib:.1f} | {(current - base) / n_traced:.2f} | |",
        f"| tracemalloc, peak while building | {traced_steps:,} | {values} "
        f"| {(peak - base) / mib:.1f} | {(peak - base) / n_traced:.2f} | |",
    ]
    settings = (
        f"`state = state.update(m)` with {values} float64 metrics per step. "
        f"Building {steps:,} steps took {build_s:.1f} s "
        f"({build_s / steps * 1e6:.1f} µs/step). tracemalloc slows every "
        f"allocation, so its rows come from a separate, smaller run of "
        f"{traced_steps:,} steps ({traced_s:.1f} s under tracing), measured from "
        "an empty state to after every value is in the NumPy arrays; its bytes per "
        "value depend on where that length falls in the arrays' growth schedule "
        "(doubling up to 65,536 rows, then +1/8 at a time). The peak includes the "
        "moment an array is copied into a larger one."
    )
    return "\n".join([MEMORY_TITLE, "", settings, "", *rows])


# ----- 3. train loop -----------------------------------------------------------------
IN_FEATURES = 64
HIDDEN = 256
BATCH = 1024
NUM_BATCHES = 8


class MLP(nnx.Module):
    def __init__(self, in_features: int, hidden: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(in_features, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.linear1(x))
        x = nnx.relu(self.linear2(x))
        return self.out(x)


def step_metrics(model, grads, pred, y, per_example) -> dict[str, jax.Array]:
    """10 replicated scalars, the kind of thing a train step reports."""
    loss = jnp.mean(per_example)
    err = pred - y
    y_var = jnp.var(y)
    grad_leaves = jax.tree.leaves(grads)
    return {
        "loss": loss,
        "grad_norm": optax.global_norm(grads),
        "param_norm": optax.global_norm(nnx.state(model, nnx.Param)),
        "grad_max_abs": jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in grad_leaves])),
        "pred_mean": jnp.mean(pred),
        "pred_std": jnp.std(pred),
        "mae": jnp.mean(jnp.abs(err)),
        "max_abs_err": jnp.max(jnp.abs(err)),
        "target_var": y_var,
        "explained_var": 1.0 - loss / y_var,
    }


def make_train_step(with_shards: bool):
    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            pred = model(x)
            per_example = jnp.mean(jnp.square(pred - y), axis=-1)  # (batch,)
            return jnp.mean(per_example), (pred, per_example)

        grads, (pred, per_example) = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        metrics = step_metrics(model, grads, pred, y, per_example)
        if with_shards:
            # (8,) sharded over "data": one mean loss per device.
            metrics["loss_per_shard"] = jaxhistory.per_shard(per_example)
        return metrics

    return train_step


def make_batches(mesh: jax.sharding.Mesh, seed: int = 0) -> list[tuple]:
    """NUM_BATCHES batches, already sharded over "data", cycled by every variant."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(IN_FEATURES, 1)).astype(np.float32) / np.sqrt(IN_FEATURES)
    sharding = NamedSharding(mesh, P("data", None))
    batches = []
    for _ in range(NUM_BATCHES):
        x = rng.normal(size=(BATCH, IN_FEATURES)).astype(np.float32)
        y = (np.sin(2.0 * x @ w) + 0.05 * rng.normal(size=(BATCH, 1))).astype(
            np.float32
        )
        batches.append(jax.device_put((x, y), sharding))
    return batches


class Recorder:
    """What one train-loop variant does with each step's metrics."""

    def __init__(self, variant: str):
        self.variant = variant
        self.history = None
        self.lists: dict[str, list[float]] = {}
        self.steps = 0
        self.seconds = 0.0  # spent in record(), summed over every step
        if variant in ("history", "history_per_device"):
            self.history = jaxhistory.History(distributed_history=True)

    def record(self, metrics: dict) -> None:
        start = time.perf_counter()
        if self.history is not None:
            self.history.update(metrics, summarize=False)
        elif self.variant == "float_per_metric":
            for k, v in metrics.items():
                self.lists.setdefault(k, []).append(float(v))
        self.seconds += time.perf_counter() - start
        self.steps += 1

    def check(self) -> None:
        """Fails unless every step was recorded (this also fetches every value)."""
        if self.history is not None:
            state = self.history.state
            names = ["loss", "grad_norm", "explained_var"]
            if self.variant == "history_per_device":
                names += [f"loss_per_shard/{s}" for s in jaxhistory.STATS]
            for name in names:
                count = state.count(name)
                if count != self.steps:
                    raise AssertionError(
                        f"{self.variant}: {name} has {count} of {self.steps} steps"
                    )
            if not np.all(np.isfinite(state.values("loss"))):
                raise AssertionError(f"{self.variant}: non-finite loss recorded")
            if self.variant == "history_per_device":
                mean = state.values("loss_per_shard/mean")
                if not np.allclose(mean, state.values("loss"), rtol=1e-4):
                    raise AssertionError("per-shard mean loss differs from the loss")
        elif self.variant == "float_per_metric" and (
            len(self.lists["loss"]) != self.steps
        ):
            raise AssertionError(
                f"{self.variant}: {len(self.lists['loss'])} of {self.steps} steps"
            )


def run_steps(step_fn, model, optimizer, batches, recorder: Recorder, steps: int):
    """Runs ``steps`` train steps, recording each.

    Returns (seconds for the steps, seconds of them spent in ``recorder.record``).
    """
    in_record = recorder.seconds
    start = time.perf_counter()
    out = None
    for i in range(steps):
        x, y = batches[i % len(batches)]
        out = step_fn(model, optimizer, x, y)
        recorder.record(out)
        if (i + 1) % MAX_STEPS_IN_FLIGHT == 0:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return time.perf_counter() - start, recorder.seconds - in_record


LOOP_VARIANTS = {
    "baseline": "none (waits on the step output every 8 steps, as all variants do)",
    "history": "`history.update(metrics, summarize=False)`, 10 replicated scalars",
    "history_per_device": "as `history`, plus a per-shard loss `(8,)` that "
    "History reduces to mean/max/min/std in one fused jitted call",
    "float_per_metric": "`float(v)` of each of the 10 metrics, appended to lists",
}


def bench_loop(steps: int, warmup: int, repeats: int) -> str:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    batches = make_batches(mesh)
    variants = list(LOOP_VARIANTS)
    with jax.set_mesh(mesh):
        # Parameters and optimizer state are replicated; only the batch is split.
        model = MLP(IN_FEATURES, HIDDEN, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        plain_step = make_train_step(with_shards=False)
        fns = dict.fromkeys(variants, plain_step)
        fns["history_per_device"] = make_train_step(with_shards=True)
        # One recorder per variant for the whole run, as in a real training run.
        recorders = {v: Recorder(v) for v in variants}
        start = time.perf_counter()
        for v in variants:  # compiles everything, History's reduction included
            run_steps(fns[v], model, optimizer, batches, recorders[v], warmup)
        print(
            f"train loop: warm-up done in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        times: dict[str, list[float]] = {v: [] for v in variants}
        in_record: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(repeats):
            # Variants interleaved, the order rotated each repeat.
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                elapsed, recording = run_steps(
                    fns[v], model, optimizer, batches, recorders[v], steps
                )
                times[v].append(elapsed)
                in_record[v].append(recording)
            print(f"train loop: repeat {r + 1}/{repeats} done", flush=True)
        for recorder in recorders.values():
            recorder.check()  # every step of every variant really recorded
    total_steps = warmup + repeats * steps
    rate = {v: steps / statistics.median(ts) for v, ts in times.items()}
    rows = [LOOP_HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for variant, what in LOOP_VARIANTS.items():
        ratio = rate[variant] / rate["baseline"]
        # Within one repeat the variants run back to back, so the machine's slow
        # drifts hit both sides of these ratios alike.
        paired = [b / t for b, t in zip(times["baseline"], times[variant], strict=True)]
        q1, med, q3 = quartiles(paired)
        ms = [t / steps * 1e3 for t in times[variant]]
        rec_us = statistics.median(in_record[variant]) / steps * 1e6
        target = ""
        if variant == "history":
            target = f"≥ {LOOP_TARGET:g} (paired): {verdict(med >= LOOP_TARGET)}"
        rows.append(
            f"| `{variant}` | {what} | {rate[variant]:.1f} "
            f"| {1e3 / rate[variant]:.2f} | {min(ms):.1f}-{max(ms):.1f} "
            f"| {rec_us:.0f} | {ratio:.3f} | {med:.3f} ({q1:.3f}-{q3:.3f}) "
            f"| {target} |"
        )
    settings = (
        f"MLP {IN_FEATURES}-{HIDDEN}-{HIDDEN}-1, adamw, global batch {BATCH} "
        f"sharded over 8 devices (`nnx.jit` under `jax.set_mesh`). {warmup} "
        f"warm-up steps per variant, then {repeats} repeats of {steps} timed "
        "steps per variant, variants interleaved (order rotated each repeat); "
        "steps/s from the median repeat, with the range of ms/step over repeats. "
        "The paired ratio is, for each repeat, the baseline's time over the "
        "variant's time in that same repeat (run minutes apart at most); the "
        "table gives the median and interquartile range over repeats, and the "
        "target is checked on that median. "
        "The recording-call column is the wall time spent in the per-step "
        "recording code: host work plus any waiting for the device (`float()` "
        "waits for each step; History waits for the oldest of its in-flight "
        "values when more than 8 updates are pending, which the baseline "
        "instead waits for at its every-8-steps block). One recorder per variant "
        f"for the whole run; at the end each holds all {total_steps} steps "
        "(checked)."
    )
    return "\n".join([LOOP_TITLE, "", settings, "", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run with smaller sizes"
    )
    args = parser.parse_args(argv)
    if args.repeats < 0:
        parser.error("--repeats must be at least 1")
    if args.quick:
        host, memory, traced, loop = (2_000, 20_000), 100_000, 50_000, (24, 16)
        host_repeats, loop_repeats = args.repeats or 2, args.repeats or 3
    else:
        host, memory, traced, loop = (20_000, 200_000), 1_000_000, 200_000, (48, 16)
        host_repeats, loop_repeats = args.repeats or 5, args.repeats or 48

    info = machine_info()
    print(info, flush=True)
    start = time.perf_counter()
    sections = [
        bench_host(*host, host_repeats),
        bench_memory(memory, traced),
        bench_loop(*loop, loop_repeats),
    ]
    total = time.perf_counter() - start
    mode = "--quick" if args.quick else "full run"
    text = f"{info}\n{mode}, {total:.0f} s in all\n\n" + "\n\n".join(sections) + "\n"
    print()
    print(text, end="", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
