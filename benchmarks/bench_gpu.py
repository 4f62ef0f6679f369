"""Benchmark: the checks that need an accelerator (run it on a GPU or TPU machine).

Six sections, in one process, on the default backend's devices:

1. **Reducers on the device against float64 NumPy**: ``distributed_stats`` of
   float32 and bfloat16 arrays of 10^4 to 10^7 elements (values drawn around 1.0
   with std 3, one array per size) and ``watch`` of a tree of such arrays,
   compared with NumPy's float64 statistics of the same (rounded) values: the
   largest relative error of mean and std, whether max and min are exact, and
   the jitted call's median time.
2. **Quantiles from histograms**: ``bench_watch``'s rank errors over random
   arrays, computed on the device; the cost of ``quantiles=`` at 10^6 to 10^8
   elements; and a leaf with more than 2**24 values in one bin.
3. **Per-layer watch in a train step**: ``bench_watch``'s model (500 dense layers,
   1,000 parameter leaves, replicated), bare step against ``watch(grads)`` and
   the hand-written per-leaf norms, paired ratios; then bare against watch with
   nothing recorded (the watch's device work alone).
4. **The train loop of** ``bench_history``: an NNX MLP trained with ``nnx.jit``,
   recorded four ways; the host time spent in the recording call per step.
5. **Memory**: ``History(memory=...)`` per update (device memory read from
   ``memory_stats()``, not from the live arrays as on CPU), and a
   ``MemoryTracker`` stage around the allocation of a 1 GiB array: its
   ``{stage}_mem_device_alloc_delta`` and ``{stage}_mem_device_peaked_delta``.
6. **Recording device scalars**: the host time of ``History.update`` of 10
   device scalars right after the step's launch, and of its parts (starting
   copies to the host, a jitted stack, reading); loops of steps recorded as
   they are, with no copy started at update, and with the step returning one
   ``Stats.of`` array of the 10.

Run: ``python benchmarks/bench_gpu.py [--out PATH]`` on a machine with an
accelerator (it stops on CPU unless ``--allow-cpu``, which the smoke test uses);
``--quick`` is a smoke run with small sizes; ``--only scalars`` (or any of
``reducers quantiles watch loop memory scalars``) runs only the sections
named.
"""

import os

# The other benchmarks this one imports default to CPU devices: keep JAX's own
# choice (the accelerator) unless the caller names a platform.
os.environ.setdefault("JAX_PLATFORMS", "")

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import _appending
from jaxhistory._host_copies import host_copies

sys.path.insert(0, str(Path(__file__).parent))
import bench_history
import bench_memory
import bench_watch
from _common import machine_info, report

GIB = 2**30
SCALARS = 10


def _timed(fn, *args, calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn`` (each waited for)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def bench_reducers(sizes: tuple[int, ...], calls: int) -> str:
    """Device statistics against NumPy's float64 ones of the same values."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    spread = NamedSharding(mesh, P("data"))
    stats_fn = jax.jit(lambda x: jh.distributed_stats({"x": x}))
    watch_fn = jax.jit(lambda tree: jh.watch(tree, stats=("norm", "max_abs", "rms")))
    rng = np.random.default_rng(0)
    rows = [
        "| dtype | elements | mean rel. error | std rel. error | max, min exact "
        "| `distributed_stats` ms | watch norm rel. error | watch rms rel. error "
        "| `watch` ms |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for dtype in (jnp.float32, jnp.bfloat16):
        for n in sizes:
            n -= n % jax.device_count()
            host = (1.0 + 3.0 * rng.standard_normal(n)).astype(dtype)
            exact = np.asarray(host, np.float64)  # the values the device holds
            x = jax.device_put(host, spread)
            got = jax.device_get(stats_fn(x))
            mean_err = _rel(float(got["x/mean"]), exact.mean())
            std_err = _rel(float(got["x/std"]), exact.std())
            extremes = (
                float(got["x/max"]) == exact.max()
                and float(got["x/min"]) == exact.min()
            )
            # watch: three leaves of different sizes and layouts
            half = jax.device_put(host[: n // 2], NamedSharding(mesh, P()))
            tree = {"all": x, "half": half, "neg": -x}
            w = jax.device_get(watch_fn(tree))
            norm_err = _rel(float(w["all/norm"]), float(np.sqrt(np.sum(exact**2))))
            rms_err = _rel(float(w["neg/rms"]), float(np.sqrt(np.mean(exact**2))))
            if float(w["all/max_abs"]) != np.abs(exact).max():
                raise AssertionError(f"watch max_abs is not exact ({dtype}, {n})")
            rows.append(
                f"| {jnp.dtype(dtype).name} | {n:,} | {mean_err:.1e} | "
                f"{std_err:.1e} | {'yes' if extremes else '**no**'} | "
                f"{_timed(stats_fn, x, calls=calls) * 1e3:.3f} | {norm_err:.1e} | "
                f"{rms_err:.1e} | {_timed(watch_fn, tree, calls=calls) * 1e3:.3f} |"
            )
    return "\n".join(
        [
            "## Reducers on the device against float64 NumPy",
            "",
            f"Values 1 + 3 N(0, 1), spread over the {jax.device_count()} "
            "device(s); NumPy's float64 statistics of the same rounded values "
            f"are the reference. Times: median of {calls} jitted calls, each "
            "waited for. `watch` of three leaves (the array, its first half "
            "replicated, its negation), statistics norm, max_abs and rms.",
            "",
            *rows,
        ]
    )


def bench_quantiles_section(
    arrays: int, sizes: tuple[int, ...], calls: int, rank_sizes: tuple[int, ...]
) -> str:
    """Quantiles from histograms on the device: rank errors over random arrays
    of ``rank_sizes`` in turn (``bench_watch``'s), the cost of asking for
    them, and a bin past 2**24."""
    qs = (0.1, 0.5, 0.9)
    plain = jax.jit(lambda x: jh.distributed_stats({"x": x}))
    with_q = jax.jit(lambda x: jh.distributed_stats({"x": x}, quantiles=qs))
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rng = np.random.default_rng(1)
    rows = [
        "| elements | `distributed_stats` ms | with 3 quantiles, ms | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for n in sizes:
        n -= n % jax.device_count()
        x = jax.device_put(
            rng.standard_normal(n).astype(np.float32), NamedSharding(mesh, P("data"))
        )
        # alternated, so both see the same device state
        a, b = [], []
        for _ in range(3):
            a.append(_timed(plain, x, calls=max(calls // 3, 1)))
            b.append(_timed(with_q, x, calls=max(calls // 3, 1)))
        ms_a, ms_b = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        rows.append(f"| {n:,} | {ms_a:.3f} | {ms_b:.3f} | {ms_b / ms_a:.2f} |")
        del x
    # more than 2**24 values in one bin: counted in int32 on the device
    ones, twos = 2**24 + 3_000_000, 2_000_000
    big = jnp.concatenate([jnp.ones(ones, jnp.float32), jnp.full(twos, 2.0)])
    got = jax.device_get(with_q(big))
    want = np.quantile(np.asarray(big), qs)
    read = [float(got[f"x/p{100 * q:g}"]) for q in qs]
    match = all(abs(g - w) < 1e-3 for g, w in zip(read, want, strict=True))
    return "\n".join(
        [
            bench_watch.bench_quantiles(arrays, rank_sizes),
            f"Cost on the device (float32 values N(0, 1), median of {calls} "
            "jitted calls in three alternating blocks, each call waited for):",
            "",
            *rows,
            "",
            f"{ones:,} ones and {twos:,} twos on one device (a bin past 2**24): "
            f"p10/p50/p90 {[round(g, 4) for g in read]}"
            f", NumPy {want.tolist()}: {'match' if match else '**differ**'}.",
        ]
    )


def bench_watch_device(layers: int, repeats: int) -> str:
    """The watch's cost on the device alone: the bare and the watch step run
    back to back with nothing recorded, waited for once per block of steps."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.device_put(
        jnp.ones((bench_watch.BATCH, bench_watch.WIDTH), jnp.float32),
        NamedSharding(mesh, P("data")),
    )
    variants = ("bare", "watch")
    steps = {v: bench_watch.make_step(v) for v in variants}
    params = {v: bench_watch.make_params(layers, mesh, False) for v in variants}
    for v in variants:
        params[v], out = steps[v](params[v], x)
        jax.block_until_ready(out)
    block = 4 * bench_watch.STEPS_PER_REPEAT
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(repeats):
        for v in variants if r % 2 == 0 else variants[::-1]:
            start = time.perf_counter()
            for _ in range(block):
                params[v], out = steps[v](params[v], x)
            jax.block_until_ready((params[v], out))
            times[v].append((time.perf_counter() - start) / block)
    ratio = statistics.median(
        b / w for b, w in zip(times["bare"], times["watch"], strict=True)
    )
    bare, watch = (statistics.median(times[v]) * 1e3 for v in variants)
    return (
        f"Nothing recorded ({repeats} alternating blocks of {block} steps, "
        f"waited for at each block's end): bare {bare:.2f} ms/step, watch "
        f"{watch:.2f} ms/step, paired ratio {ratio:.3f}; the watch's device "
        f"work is {1e3 * (watch - bare):.0f} µs a step at the medians.\n"
    )


def bench_memory_section(steps: int, repeats: int) -> str:
    """History(memory=...) per update, and a stage around a 1 GiB allocation."""
    tracker = jh.MemoryTracker()
    with tracker.stage("alloc"):
        big = jnp.ones((GIB // 4,), jnp.float32)  # 1 GiB
        big.block_until_ready()
    with tracker.stage("free"):
        del big
    m = tracker.metrics()
    source = jh.device_memory().source
    lines = [
        "## Memory reports on the device",
        "",
        f"Device memory source: `{source}`.",
        "",
        *bench_memory.bench_history(steps, repeats),
        "",
        "| stage | `_mem_device_alloc_delta` MiB | `_mem_device_peaked_delta` MiB |",
        "|---|---:|---:|",
    ]
    for stage, what in (("alloc", "a 1 GiB array made"), ("free", "that array freed")):
        alloc = m[f"{stage}_mem_device_alloc_delta"]
        peak = m[f"{stage}_mem_device_peaked_delta"]
        peak_text = "None" if peak is None else f"{peak / 2**20:,.1f}"
        lines.append(f"| {stage}: {what} | {alloc / 2**20:,.1f} | {peak_text} |")
    return "\n".join(lines)


def _scalar_step(packed: bool = False):
    """A jitted step over a (512, 512) array returning 10 device scalars (one
    ``Stats.of`` of them with ``packed``)."""

    def step(x):
        metrics = {f"m{i}": jnp.sum(x) * (i + 1) for i in range(SCALARS)}
        return x * 0.999 + 0.001, jh.Stats.of(metrics) if packed else metrics

    return jax.jit(step)


def _median_us(step, x, what, calls: int) -> tuple[float, Any]:
    """Median µs of ``what(metrics)`` right after each step is launched
    (waiting for the step every 8 steps, as a training loop must)."""
    times = []
    for i in range(calls):
        x, m = step(x)
        start = time.perf_counter()
        what(m)
        times.append(time.perf_counter() - start)
        if i % 8 == 7:
            x.block_until_ready()
    x.block_until_ready()
    return statistics.median(times) * 1e6, x


@contextlib.contextmanager
def _per_value_copies():
    """History as it was before stacked transfers: each recorded device value
    starts its own copy to the host at update."""

    def stage(arrays):
        for a in arrays:
            a.copy_to_host_async()

    host_copies.stage = stage  # (an attribute of the instance hides the method)
    try:
        yield
    finally:
        del host_copies.stage


def _loop_us(step, x, mode: str, steps: int) -> tuple[float, float, Any]:
    """µs per step of a loop that records every step's scalars (``mode``:
    "bare" records nothing, "stacked" is History as it is, "per value" starts
    each value's copy at update, "no copies" starts no copy to the host at
    update, "packed" is History as it is with a step that returns
    ``Stats.of`` of its scalars), and µs per step to read them all after."""
    started = _appending.needs_host_copy
    if mode == "no copies":
        _appending.needs_host_copy = lambda arrays: False
    per_value = _per_value_copies() if mode == "per value" else contextlib.nullcontext()
    try:
        with per_value:
            history = None if mode == "bare" else jh.History(distributed_history=False)
            start = time.perf_counter()
            for i in range(steps):
                x, m = step(x)
                if history is not None:
                    history.update(m, summarize=False)
                if i % 8 == 7:
                    x.block_until_ready()
            x.block_until_ready()
            looped = time.perf_counter()
            if history is not None:
                if len(history.state.values(f"m{SCALARS - 1}")) != steps:
                    raise AssertionError("History lost steps")
                history.close()
            read = time.perf_counter() - looped if history is not None else 0.0
    finally:
        _appending.needs_host_copy = started
    return (looped - start) / steps * 1e6, read / steps * 1e6, x


def bench_device_scalars(calls: int, steps: int, repeats: int) -> str:
    """The host cost of recording 10 device scalars per step, and of its parts."""
    step = _scalar_step()
    stack = jax.jit(lambda d: jnp.stack(list(d.values())))
    x = jnp.ones((512, 512))
    x, m = step(x)
    jax.block_until_ready(stack(m))
    parts = {
        "`copy_to_host_async()` of each of the 10": lambda m: [
            a.copy_to_host_async() for a in m.values()
        ],
        "a jitted `jnp.stack` of the 10, then one `copy_to_host_async()`": lambda m: (
            stack(m).copy_to_host_async()
        ),
        "`History.update(m, summarize=False)`": None,
        "`History.update(m, summarize=False)`, a copy started per value (the "
        "previous version)": None,
        "`float()` of each of the 10 (waits for the step)": lambda m: [
            float(a) for a in m.values()
        ],
    }
    rows = [
        "| host work right after the step's launch | µs per step (median) |",
        "|---|---:|",
    ]
    for label, what in parts.items():
        history = None
        if what is None:
            history = jh.History(distributed_history=False)
            what = functools.partial(history.update, summarize=False)
        per_value = "per value" in label
        with _per_value_copies() if per_value else contextlib.nullcontext():
            us, x = _median_us(step, x, what, calls)
            if history is not None:
                history.close()
        rows.append(f"| {label} | {us:.1f} |")
    history = jh.History(distributed_history=False)
    packed = _scalar_step(packed=True)
    _median_us(packed, x, functools.partial(history.update, summarize=False), 8)
    us, x = _median_us(
        packed, x, functools.partial(history.update, summarize=False), calls
    )
    if history.state.count("m0") != calls + 8:
        raise AssertionError("Stats.of's values were not recorded")
    history.close()
    rows.append(
        "| `History.update(m, summarize=False)`, the step returning "
        f"`jh.Stats.of` of the 10 (one array) | {us:.1f} |"
    )
    modes = ("bare", "per value", "stacked", "no copies", "packed")
    steps_of = dict.fromkeys(modes, step) | {"packed": packed}
    for mode in modes:  # warm up
        _, _, x = _loop_us(steps_of[mode], x, mode, 40)
    loops = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            looped, read, x = _loop_us(steps_of[mode], x, mode, steps)
            loops[mode].append((looped, read))
    labels = {
        "bare": "nothing recorded",
        "per value": "`History.update`, a copy started per value at update (the "
        "previous version)",
        "stacked": "`History.update` (the scalars sent to the host in stacked "
        "transfers)",
        "no copies": "`History.update` with no copy started at update",
        "packed": "`History.update` of the step returning `jh.Stats.of` of the 10",
    }
    rows += [
        "",
        "| loop of steps, recording every step | µs per step (median) | reading "
        "the values afterwards, µs per step |",
        "|---|---:|---:|",
    ]
    for mode in modes:
        looped = statistics.median(a for a, _ in loops[mode])
        read = statistics.median(b for _, b in loops[mode])
        rows.append(f"| {labels[mode]} | {looped:.1f} | {read:.1f} |")
    return "\n".join(
        [
            "## Recording device scalars",
            "",
            f"A jitted step over a (512, 512) array returning {SCALARS} device "
            f"scalars; medians of {calls} steps (first table) and of {repeats} "
            f"loops of {steps} steps (second table); every loop waits for its "
            "step every 8 steps.",
            "",
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on CPU devices too (smoke test)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("reducers", "quantiles", "watch", "loop", "memory", "scalars"),
        help="run only these sections (default: all, in this order)",
    )
    args = parser.parse_args(argv)
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        sys.exit("error: no accelerator: JAX's default backend is cpu")
    device = jax.devices()[0]
    info = f"{machine_info()}, device {device.device_kind}"
    print(info, flush=True)
    if args.quick:
        sizes, calls, layers, watch_repeats = (10_000, 100_000), 3, 20, 3
        loop, loop_repeats, mem_steps, mem_repeats = (8, 8), 2, 200, 2
        scalar_calls, scalar_steps, scalar_repeats = 40, 40, 2
        q_arrays, q_sizes, rank_sizes = 3, (10_000,), (10_000,)
    else:
        sizes, calls, layers, watch_repeats = (
            (10_000, 1_000_000, 10_000_000),
            20,
            500,
            15,
        )
        loop, loop_repeats, mem_steps, mem_repeats = (48, 16), 24, 2_000, 5
        scalar_calls, scalar_steps, scalar_repeats = 300, 400, 5
        # arrays of three sizes: each size compiles its own program (on an
        # H100, 70 arrays of random sizes per dtype did not finish in 5
        # minutes, nor 14 in 100 s; compiles are the likely cost)
        q_arrays, q_sizes = 70, (1_000_000, 10_000_000, 100_000_000)
        rank_sizes = (10_000, 100_000, 1_000_000)
    start = time.perf_counter()
    runs = {
        "reducers": lambda: bench_reducers(sizes, calls),
        "quantiles": lambda: bench_quantiles_section(
            q_arrays, q_sizes, calls, rank_sizes
        ),
        "watch": lambda: (
            "## Per-layer watch in a train step\n\n"
            + bench_watch.bench(layers, watch_repeats, fsdp=False)
            + "\n"
            + bench_watch_device(layers, watch_repeats)
        ),
        "loop": lambda: bench_history.bench_loop(*loop, loop_repeats),
        "memory": lambda: bench_memory_section(mem_steps, mem_repeats),
        "scalars": lambda: bench_device_scalars(
            scalar_calls, scalar_steps, scalar_repeats
        ),
    }
    sections = []
    for name in args.only or list(runs):
        sections.append(runs[name]())
        print(sections[-1], flush=True)
    print(flush=True)
    total = time.perf_counter() - start
    report(info, args.quick, ["\n\n".join(sections)], args.out, total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
