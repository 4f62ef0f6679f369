"""Benchmark: distributed History in a real multi-process training loop.

2 and 4 processes x 2 simulated CPU devices, started with
:func:`jaxhistory.launch_local` (JAX's multi-controller runtime on 127.0.0.1). Each
process trains the same data-parallel MLP (64-256-256-1, plain JAX, SGD, global
batch 1024 sharded over every device of every process). Two variants, interleaved
in every repeat:

* ``baseline``: the train step (with its metrics), nothing recorded;
* ``history``: the same step returning ``{"dist": distributed_stats({"loss":
  per_shard(per_example)}), "grad_norm": ..., "param_norm": ...}`` (statistics
  from the step and replicated scalars) recorded with
  ``History(distributed_history=True).update(metrics, summarize=False)`` every
  step (no host scalars: those are reduced across processes at every update by
  design, a cost of its own).

and a second pair, where History does the reduction:

* ``bare step``: a step returning the per-shard loss array and the norms,
  nothing recorded;
* ``history + host``: that step's outputs and a host scalar (the learning rate,
  a Python float per process) recorded with the same call: History reduces the
  per-shard loss and the host scalar across all devices and processes (with
  device provenance and the straggler fields) in one jitted call per update;
* ``history + host, log_every=16``: the same with ``History(log_every=16)``:
  what needs reducing waits in a batch, reduced every 16 steps on the host
  through the distributed runtime's key-value store (no device program), and
  recorded at each update's own step.

Every variant waits on its latest step output every 8 steps (simulated CPU devices
deadlock when too many collective steps are queued). The figure is the paired
ratio per repeat (the baseline's time over the variant's in the same repeat) and
the host time spent in ``update`` per step ("host wait per update").

Run: ``make bench`` or ``python benchmarks/bench_multihost.py [--out PATH]``;
``--quick`` is a smoke run (2 processes, few steps).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TIMES = "\N{MULTIPLICATION SIGN}"
LOOP_TARGET = 0.97
IN_FEATURES, HIDDEN, BATCH = 64, 256, 1024
MAX_STEPS_IN_FLIGHT = 8
TITLE = "## Distributed History in a multi-process train loop"
LOG_EVERY = 16
BATCHED = f"history + host, log_every={LOG_EVERY}"
HEADER = (
    "| processes x devices | variant | ms/step (median repeat) | paired ratio, median "
    "(IQR) | host µs/update in `update` | target |"
)


def _loop(steps: int, warmup: int, repeats: int) -> dict:
    """Runs in every process (via launch_local): both variants, interleaved."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    rows, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    shapes = [(IN_FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 1)]
    params = [
        jax.device_put((rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32), repl)
        for s in shapes
    ]
    x_np = rng.normal(size=(BATCH, IN_FEATURES)).astype(np.float32)
    y_np = np.tanh(x_np.sum(axis=1, keepdims=True) / 8).astype(np.float32)
    x = jax.make_array_from_callback(x_np.shape, rows, lambda i: x_np[i])
    y = jax.make_array_from_callback(y_np.shape, rows, lambda i: y_np[i])

    def forward(ps, x):
        h = jnp.tanh(x @ ps[0])
        h = jnp.tanh(h @ ps[1])
        return h @ ps[2]

    def loss_fn(ps, x, y):
        per_example = jnp.mean((forward(ps, x) - y) ** 2, axis=-1)
        return per_example.mean(), per_example

    def make_step(in_step_stats: bool):
        @jax.jit
        def step(ps, x, y):
            (_, per), g = jax.value_and_grad(loss_fn, has_aux=True)(ps, x, y)
            new = [p - 0.01 * d for p, d in zip(ps, g, strict=True)]
            loss = jh.per_shard(per)
            metrics = {
                "dist": jh.distributed_stats({"loss": loss}) if in_step_stats else loss,
                "grad_norm": jnp.sqrt(sum(jnp.sum(d * d) for d in g)),
                "param_norm": jnp.sqrt(sum(jnp.sum(p * p) for p in new)),
            }
            return new, metrics

        return step

    steps_of = {True: make_step(True), False: make_step(False)}
    # variant -> (in-step statistics, History or None, host scalars)
    variants = {
        "baseline": (True, None, {}),
        "history": (True, jh.History(distributed_history=True), {}),
        "bare step": (False, None, {}),
        "history + host": (False, jh.History(distributed_history=True), {"lr": 0.01}),
        BATCHED: (
            False,
            jh.History(distributed_history=True, log_every=LOG_EVERY),
            {"lr": 0.01},
        ),
    }
    counter = dict.fromkeys(variants, 0)  # each variant's own steps
    in_update = dict.fromkeys(variants, 0.0)

    def run(variant: str, k: int, timed: bool) -> float:
        nonlocal params
        in_step, history, host = variants[variant]
        step = steps_of[in_step]
        start = time.perf_counter()
        for i in range(k):
            params, metrics = step(params, x, y)
            if history is not None:
                t0 = time.perf_counter()
                history.update(
                    {**metrics, **host}, step=counter[variant], summarize=False
                )
                if timed:
                    in_update[variant] += time.perf_counter() - t0
                counter[variant] += 1
            if i % MAX_STEPS_IN_FLIGHT == MAX_STEPS_IN_FLIGHT - 1:
                params[0].block_until_ready()
        params[0].block_until_ready()
        return time.perf_counter() - start

    for variant in variants:
        run(variant, warmup, False)
    times = {v: [] for v in variants}
    names = list(variants)
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for variant in order:
            times[variant].append(run(variant, steps, True) / steps)
    recorded = {}
    for variant, (_, history, _) in variants.items():
        if history is not None:
            history.close()
            recorded[variant] = history.state.count("grad_norm")
    keys = sorted(variants["history + host"][1].state.keys)
    batched = variants[BATCHED][1].state
    if batched.count("lr/mean") != warmup + steps * repeats:
        raise AssertionError(f"{BATCHED} recorded {batched.count('lr/mean')} lr/mean")
    return {
        "times": times,
        "in_update": {v: t / (steps * repeats) for v, t in in_update.items()},
        "recorded": recorded,
        "expected": warmup + steps * repeats,
        "keys": keys,
    }


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return q[0], statistics.median(xs), q[-1]


PAIRS = (
    ("baseline", "history"),
    ("bare step", "history + host"),
    ("bare step", BATCHED),
)


def bench(procs: list[int], steps: int, warmup: int, repeats: int) -> str:
    import jaxhistory as jh

    rows = [HEADER, "|---|---|---:|---:|---:|---|"]
    for p in procs:
        results = jh.launch_local(
            "bench_multihost:_loop",
            num_processes=p,
            devices_per_process=2,
            args=(steps, warmup, repeats),
            timeout=1800,
        )
        for r in results:
            for variant, count in r["recorded"].items():
                if count != r["expected"]:
                    raise AssertionError(f"{variant} recorded {count} of {r}")
            for key in ("straggler/process", "dist/argmax", "lr/mean"):
                if key not in r["keys"]:
                    raise AssertionError(f"history + host did not record {key}")
        main = results[0]  # every process takes part in every step: the same pace
        label = f"{p} {TIMES} 2"
        for base_name, name in PAIRS:
            base = main["times"][base_name]
            hist = main["times"][name]
            paired = [b / h for b, h in zip(base, hist, strict=True)]
            lo, med, hi = quartiles(paired)
            worst = min(
                statistics.median(
                    [
                        b / h
                        for b, h in zip(
                            r["times"][base_name], r["times"][name], strict=True
                        )
                    ]
                )
                for r in results
            )
            if f"`{base_name}`" not in rows[-1] and f"`{base_name}`" not in rows[-2]:
                rows.append(
                    f"| {label} | `{base_name}` | {statistics.median(base) * 1e3:.2f} "
                    "| 1.000 | | |"
                )
            verdict = "met" if med >= LOOP_TARGET else "**missed**"
            host_us = statistics.median(r["in_update"][name] for r in results) * 1e6
            rows.append(
                f"| {label} | `{name}` | {statistics.median(hist) * 1e3:.2f} | "
                f"{med:.3f} ({lo:.3f}-{hi:.3f}) | {host_us:.0f} | "
                f"≥ {LOOP_TARGET:g} (paired, process 0): {verdict}; slowest "
                f"process {worst:.3f} |"
            )
        print(f"{p} processes done", flush=True)
    settings = (
        f"{steps} timed steps per variant per repeat, {repeats} repeats, variants "
        f"interleaved (order reversed every other repeat), {warmup} warm-up steps "
        "each. The paired ratio is the unrecorded variant's time over the recorded "
        "one's in the same repeat (`baseline` vs `history`, `bare step` vs "
        "`history + host` and its batched form), on process 0 (the processes "
        "step together); 'slowest "
        "process' is the lowest median paired ratio of any process. Host "
        "µs/update is the median over the processes of the time spent inside "
        "`History.update` per step."
    )
    return "\n".join([TITLE, "", settings, "", *rows])


LAUNCH_TITLE = "## How long launching a program takes right after a step"


def _launch_wait(repeats: int) -> dict:
    """Runs in every process (via launch_local), plain JAX, no jaxhistory in
    the timed code: a data-parallel step (about a hundred ms here) is
    launched, and right after it a tiny program whose inputs were computed
    long before; the time its launch call takes, per kind of program. Then
    the same call with the devices idle."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    rows, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.normal(size=(512, 512)).astype(np.float32) / 23, repl)
    x_np = rng.normal(size=(2048, 512)).astype(np.float32)
    x = jax.make_array_from_callback(x_np.shape, rows, lambda i: x_np[i])

    @jax.jit
    def step(w, x):
        def loss(w):
            h = x
            for _ in range(4):
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        return w - 1e-3 * jax.grad(loss)(w)

    v_np = np.arange(n, dtype=np.float32)
    v = jax.make_array_from_callback((n,), rows, lambda i: v_np[i])
    w0 = jax.device_put(np.ones((8, 8), np.float32), repl)
    z = jax.device_put(np.ones(4, np.float32), jax.local_devices()[0])
    programs = {
        "every device, a cross-process all-reduce": (
            jax.jit(jnp.sum, out_shardings=repl),
            v,
        ),
        "every device, no collective": (jax.jit(lambda a: a * 2.0), w0),
        "one device": (jax.jit(lambda a: a * 2.0), z),
    }
    for fn, arg in programs.values():
        jax.block_until_ready(fn(arg))
    w = step(w, x)
    w.block_until_ready()
    out: dict[str, tuple[float, float]] = {}
    steps = []
    for label, (fn, arg) in programs.items():
        busy, idle = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            w = step(w, x)
            t1 = time.perf_counter()
            r = fn(arg)  # the devices still run the step
            busy.append(time.perf_counter() - t1)
            w.block_until_ready()
            steps.append(time.perf_counter() - t0)
            jax.block_until_ready(r)
            t3 = time.perf_counter()
            r = fn(arg)  # the devices idle
            idle.append(time.perf_counter() - t3)
            jax.block_until_ready(r)
        out[label] = (statistics.median(busy), statistics.median(idle))
    return {"programs": out, "step": statistics.median(steps)}


def bench_launch(procs: int, repeats: int) -> str:
    import jaxhistory as jh

    results = jh.launch_local(
        "bench_multihost:_launch_wait",
        num_processes=procs,
        devices_per_process=2,
        args=(repeats,),
        timeout=600,
    )
    rows = [
        "| program launched | launch call, devices busy with the step (ms) "
        "| launch call, devices idle (ms) |",
        "|---|---:|---:|",
    ]
    for label in results[0]["programs"]:
        busy = [r["programs"][label][0] * 1e3 for r in results]
        idle = [r["programs"][label][1] * 1e3 for r in results]
        rows.append(
            f"| {label} | {min(busy):.2f}-{max(busy):.2f} "
            f"| {min(idle):.2f}-{max(idle):.2f} |"
        )
    step_ms = [r["step"] * 1e3 for r in results]
    settings = (
        f"{procs} processes x 2 CPU devices, plain JAX (no jaxhistory in the "
        "timed code). A data-parallel step (4 tanh layers of 512, batch 2,048 "
        f"sharded over the devices; {min(step_ms):.0f}-{max(step_ms):.0f} ms "
        "from launch to done) is launched, then at once a tiny program whose "
        "inputs were computed long before: the time its launch call takes; "
        f"then the same call with the devices idle. Median of {repeats} per "
        "process; the range over the processes."
    )
    return "\n".join([LAUNCH_TITLE, "", settings, "", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the workers
    if args.quick:
        table = bench([2], steps=16, warmup=8, repeats=3)
        launch = bench_launch(2, repeats=3)
    else:
        table = bench([2, 4], steps=48, warmup=16, repeats=32)
        launch = bench_launch(2, repeats=15)
    import jax
    from _common import report

    info = f"jax {jax.__version__}, launch_local processes x 2 CPU devices"
    report(info, args.quick, [table, "", launch], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
