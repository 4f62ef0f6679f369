"""Benchmark: what recording metrics with jaxhistory costs on the host and in a loop.

Five measurements, each taken side by side in one run:

1. **Host recording speed.** 10 Python-float metrics per step, a new dict each
   step, recorded five ways: a plain dict of lists (the Python floor),
   ``state = state.update(m)`` on :class:`jaxhistory.HistoryState`,
   ``History(distributed_history=False).update(m, summarize=False)`` without a
   log, the same with the JSONL log streamed (``report_dir``), and the default
   call ``update(m)`` (summary line and log). Median µs/step over repeats at two
   run lengths, 10x apart, to show the scaling; ratios to the floor.
2. **Memory.** A :class:`~jaxhistory.HistoryState` of 1,000,000 steps x 16
   float64 metrics: ``nbytes()`` per stored value, and the memory Python's
   ``tracemalloc`` sees the history take while it is built.
3. **Train loop.** A Flax NNX MLP trained data parallel on 8 simulated CPU
   devices (``nnx.jit`` under ``jax.set_mesh``), the step returning 10
   replicated scalar metrics; steps/s without recording, with
   :class:`jaxhistory.History`, with History plus a per-shard loss it reduces
   across devices, and with ``float()`` of every metric every step.
4. **Threads.** 4 threads calling ``update`` on one History (each its own 10
   metrics, JSONL log streamed) against one thread making the same updates:
   updates/s, and whether every value and log line was kept.
5. **Log lag after SIGKILL.** A child process records 16 floats per update into a
   History with a JSONL log and is killed with SIGKILL: how many steps, and how
   many seconds of training, the log lost.

Run: ``make bench`` or
``python benchmarks/bench_history.py [--out PATH] [--repeats R]``; ``--quick`` is a
fast smoke run with smaller sizes.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import functools
import gc
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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
from jaxhistory import (
    _codec,
    _compiled,
    _history_state,
    _recorder,
    _row,
    _summary,
    _table,
)
from jaxhistory.sentinels import NonFinite, Spike

TIMES = "\N{MULTIPLICATION SIGN}"
HOST_METRICS = 10
MEMORY_METRICS = 16
# Host recording targets, as ratios to the dict-of-lists floor
STATE_TARGET = 3.0  # HistoryState.update
HISTORY_LOG_TARGET = 3.0  # History.update(m, summarize=False), JSONL log streamed
HISTORY_DEFAULT_TARGET = 4.0  # History.update(m): summary line and JSONL log
SCALING_TARGET = 11.0  # 10x the steps should take at most this many times longer
MEMORY_TARGET = 10.0  # bytes per stored float64
LOOP_TARGET = 0.97  # steps/s of `history` relative to `baseline`
THREADS = 4
KILL_METRICS = 16
KILL_TARGET_S = 1.0  # seconds of training the JSONL log may lose to a SIGKILL
KILL_HARD_TIMEOUT_S = 120.0  # the child's start-up limit, and its own life limit
ROOT = Path(__file__).resolve().parents[1]
# Simulated CPU devices run collectives on a small pool of host threads; more than
# about 16 queued steps with collectives can deadlock them. Every train-loop variant
# waits on its latest step at least this often.
MAX_STEPS_IN_FLIGHT = 8

HOST_TITLE = "## 1. Host recording speed"
MEMORY_TITLE = "## 2. Memory"
LOOP_TITLE = "## 3. Train loop on 8 simulated CPU devices"
THREADS_TITLE = "## 4. Threads"
KILL_TITLE = "## 5. Log lag after SIGKILL"
HOST_HEADER = (
    "| recorder | µs/step, {small} steps | µs/step, {large} steps "
    "| ratio to floor, {small} | ratio to floor, {large} "
    "| time {large} / time {small} | target |"
)
THREADS_HEADER = (
    "| run | threads | updates per thread | µs/update | updates/s "
    "| values kept / expected | log lines / expected | verdict |"
)
KILL_HEADER = (
    "| run | steps trained | child steps/s | last step in the log "
    "| complete lines parsed | steps lost | s of training lost | target |"
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


def make_host_metrics(steps: int) -> list[tuple[float, ...]]:
    """The 10 Python-float values of every step, made before any timing. Each
    recorder's loop builds the step's dict from them (``dict(zip(KEYS, row))``),
    as a training loop builds ``{"loss": loss, ...}`` every step."""
    return [tuple(float(i) + j / 16 for j in range(HOST_METRICS)) for i in range(steps)]


def record_dict_only(ms: list[tuple]) -> float:
    start = time.perf_counter()
    for row in ms:
        m = dict(zip(KEYS, row, strict=True))
    elapsed = time.perf_counter() - start
    if len(m) != HOST_METRICS:
        raise AssertionError("the dict lost values")
    return elapsed


def log_lines(report_dir: Path) -> int:
    """Complete lines in the JSONL log(s) History wrote under ``report_dir``."""
    lines = 0
    for path in report_dir.glob("*.jsonl"):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
    return lines


def record_dict_of_lists(ms: list[dict]) -> float:
    lists: dict[str, list] = {}
    start = time.perf_counter()
    for row in ms:
        m = dict(zip(KEYS, row, strict=True))
        for k, v in m.items():
            column = lists.get(k)
            if column is None:
                column = lists[k] = []
            column.append(v)
    elapsed = time.perf_counter() - start
    if len(lists["m0"]) != len(ms):
        raise AssertionError(f"dict of lists kept {len(lists['m0'])} of {len(ms)}")
    return elapsed


def record_state(ms: list[dict], with_step: bool = False) -> float:
    state = jaxhistory.HistoryState()
    start = time.perf_counter()
    if with_step:  # the form ezpz users write: {"step": s, **metrics}
        for s, row in enumerate(ms):
            state = state.update({"step": s, **dict(zip(KEYS, row, strict=True))})
    else:
        for row in ms:
            state = state.update(dict(zip(KEYS, row, strict=True)))
    elapsed = time.perf_counter() - start
    if state.count("m0") != len(ms):
        raise AssertionError(f"HistoryState kept {state.count('m0')} of {len(ms)}")
    return elapsed


@contextlib.contextmanager
def host_path(python: bool):
    """With ``python``: the host path's compiled helpers (``_speedups.c``)
    turned off for the block, as ``JAXHISTORY_PURE_PYTHON=1`` turns them off
    for a process (what a machine without a C compiler at install time runs)."""
    modules = (_codec, _history_state, _recorder, _row, _summary, _table)
    saved = [m.speedups for m in modules]
    try:
        for m in modules:
            m.speedups = None if python else _compiled.speedups
        yield
    finally:
        for m, value in zip(modules, saved, strict=True):
            m.speedups = value


def record_history(
    ms: list[dict],
    log: bool,
    default_call: bool,
    with_step: bool = False,
    sentinels: bool = False,
    python: bool = False,
) -> float:
    """Times the loop of ``History.update`` calls and the ``flush()`` after it
    (not the construction, not ``close()``); the background writer's thread
    runs, and competes for the GIL, during the loop. Then checks the history and
    the log hold every step. ``python``: without the compiled helpers."""
    with host_path(python), tempfile.TemporaryDirectory(prefix="bench_history_") as tmp:
        report_dir = Path(tmp) if log else None
        watchers = (
            [NonFinite(), Spike(KEYS[0], action=lambda e: None)] if sentinels else ()
        )
        history = jaxhistory.History(
            distributed_history=False, report_dir=report_dir, sentinels=watchers
        )
        line = ""
        # The loop, then flush(): what the background thread has not written
        # yet is written then, so the log's whole cost is timed.
        if default_call and with_step:  # {"step": s, **metrics}, as ezpz users do
            start = time.perf_counter()
            for s, row in enumerate(ms):
                line = history.update({"step": s, **dict(zip(KEYS, row, strict=True))})
            history.flush()
            elapsed = time.perf_counter() - start
        elif default_call:
            start = time.perf_counter()
            for row in ms:
                line = history.update(dict(zip(KEYS, row, strict=True)))
            history.flush()
            elapsed = time.perf_counter() - start
        else:
            start = time.perf_counter()
            for row in ms:
                history.update(dict(zip(KEYS, row, strict=True)), summarize=False)
            history.flush()
            elapsed = time.perf_counter() - start
        history.close()
        kept = {k: history.state.count(k) for k in KEYS}
        if any(n != len(ms) for n in kept.values()):
            raise AssertionError(f"History kept {kept} of {len(ms)} steps each")
        if default_call and not line.startswith(f"step={len(ms) - 1} m0="):
            raise AssertionError(f"unexpected summary line {line!r}")
        if report_dir is not None and (lines := log_lines(report_dir)) != len(ms):
            raise AssertionError(f"the JSONL log has {lines} of {len(ms)} lines")
        del history
    return elapsed


# name -> (label, recorder, target ratio to the floor or None)
RECORDERS: dict[str, tuple[str, Callable[[list[dict]], float], float | None]] = {
    "dict_of_lists": (
        "dict of lists `d[k].append(v)` (floor)",
        record_dict_of_lists,
        None,
    ),
    "dict_only": (
        "the step's dict alone, nothing recorded",
        record_dict_only,
        None,
    ),
    "state": (
        "`state = state.update(m)` (HistoryState)",
        record_state,
        STATE_TARGET,
    ),
    "state_step": (
        '`state = state.update({"step": s, **m})` (HistoryState, step entry)',
        functools.partial(record_state, with_step=True),
        STATE_TARGET,
    ),
    "history_nolog": (
        "`History(distributed_history=False).update(m, summarize=False)`, no log",
        functools.partial(record_history, log=False, default_call=False),
        None,
    ),
    "history_log": (
        "`History(distributed_history=False, report_dir=tmp)"
        ".update(m, summarize=False)`, JSONL log streamed",
        functools.partial(record_history, log=True, default_call=False),
        HISTORY_LOG_TARGET,
    ),
    "history_log_sentinels": (
        "the same with two sentinels, `NonFinite()` on every metric and `Spike(m0)`",
        functools.partial(record_history, log=True, default_call=False, sentinels=True),
        None,
    ),
    "history_default": (
        "`History(distributed_history=False, report_dir=tmp).update(m)`: summary "
        "line returned, JSONL log streamed (the default call)",
        functools.partial(record_history, log=True, default_call=True),
        HISTORY_DEFAULT_TARGET,
    ),
    "history_log_python": (
        "the streamed log without a summary, as Python alone (no compiled "
        "helpers: `JAXHISTORY_PURE_PYTHON=1`, or no C compiler at install)",
        functools.partial(record_history, log=True, default_call=False, python=True),
        None,
    ),
    "history_default_python": (
        "the default call, as Python alone (no compiled helpers)",
        functools.partial(record_history, log=True, default_call=True, python=True),
        None,
    ),
    "history_default_step": (
        '`History(distributed_history=False, report_dir=tmp).update({"step": s, '
        "**m})`: the default call with the step in the dict",
        functools.partial(record_history, log=True, default_call=True, with_step=True),
        HISTORY_DEFAULT_TARGET,
    ),
}


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
                for name, (_, fn, _) in RECORDERS.items():
                    times.setdefault((name, n), []).append(fn(data) / n)
            print(f"host recording: repeat {r + 1}/{repeats} done", flush=True)
    finally:
        del ms, sizes
        gc.unfreeze()
        gc.collect()
    us = {key: statistics.median(ts) * 1e6 for key, ts in times.items()}
    a, b = fmt_steps(small), fmt_steps(large)
    rows = [HOST_HEADER.format(small=a, large=b), "|---|---:|---:|---:|---:|---:|---|"]
    for name, (label, _, limit) in RECORDERS.items():
        t_small, t_large = us[name, small], us[name, large]
        r_small = t_small / us["dict_of_lists", small]
        r_large = t_large / us["dict_of_lists", large]
        # Per repeat, the two lengths run back to back: the ratio of their times
        # in the same repeat, then the median over repeats (robust to drift).
        scaling = statistics.median(
            tl * large / (ts * small)
            for ts, tl in zip(times[name, small], times[name, large], strict=True)
        )
        if name == "dict_of_lists":
            target = "the floor"
        elif name == "dict_only":
            target = "none (part of every row)"
        elif limit is None:
            target = "none (information)"
        else:
            worst = max(r_small, r_large)
            target = (
                f"≤ {limit:g}{TIMES} floor: {verdict(worst <= limit)}; "
                f"time ratio ≈ 10{TIMES} (≤ {SCALING_TARGET:g}): "
                f"{verdict(scaling <= SCALING_TARGET)}"
            )
        rows.append(
            f"| {label} | {t_small:.2f} | {t_large:.2f} "
            f"| {r_small:.1f}{TIMES} | {r_large:.1f}{TIMES} "
            f"| {scaling:.1f}{TIMES} | {target} |"
        )
    settings = (
        f"{HOST_METRICS} Python-float metrics per step. Every loop, the floor's "
        "too, builds the step's dict from that step's values "
        "(`dict(zip(KEYS, row, strict=True))`, as a training loop builds "
        '`{"loss": loss, ...}`) and records it; the row "the step\'s dict alone" '
        "is that building by itself, to subtract where wanted. The values come "
        f"from a pool of {fmt_steps(small)} rows made before timing (the "
        f"{fmt_steps(large)}-step run cycles through the pool); median of "
        f"{repeats} repeats, recorders interleaved; the pool is exempt from "
        "garbage collection (gc.freeze). Timed: the loop of update calls, then "
        "`flush()` where a log is streamed (it writes what the background thread "
        "has not written yet, so the log's whole cost counts); each History is "
        "built before and closed after, outside the timed region. While the loop "
        "runs, History's background writer thread formats and writes the log (at "
        "least five times a second, and whenever 2,048 updates are queued), "
        "competing for the GIL, which is counted. After every "
        "History repeat the script checks that `h.state` and the JSONL log hold "
        "every step (and stops if not). The target is checked on the worse of "
        "the two ratios to the floor. The time-ratio column is the median over "
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
    "history_per_device": "as `history`, plus a per-shard loss (one value per "
    "device) that History reduces to mean/max/min/std in one fused jitted call",
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
        f"sharded over {jax.device_count()} device(s) (`nnx.jit` under "
        f"`jax.set_mesh`). {warmup} "
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
    title = LOOP_TITLE
    if jax.default_backend() != "cpu" or jax.device_count() != 8:
        title = f"## Train loop on {jax.device_count()} {jax.devices()[0].device_kind}"
    return "\n".join([title, "", settings, "", *rows])


# ----- 4. threads --------------------------------------------------------------------
def thread_metrics(thread: int, pool: int) -> list[dict[str, float]]:
    """``pool`` dicts of 10 Python floats named ``t{thread}/m{j}``."""
    names = [f"t{thread}/m{j}" for j in range(HOST_METRICS)]
    return [{k: float(i) for k in names} for i in range(pool)]


def _update_all(history, ms: list[dict], barrier, errors: list) -> None:
    try:
        barrier.wait()
        for m in ms:
            history.update(m, summarize=False)
    except BaseException as err:  # reported in the table, not lost with the thread
        errors.append(err)


# how the updates of section 4 are made -> the row's label
THREAD_MODES = {
    "threads": f"{THREADS} threads, one History",
    "blocks": "1 thread, the same updates, one metric set after another",
    "alternating": "1 thread, the same updates, metric sets alternating",
}


def run_threads(per_thread: list[list[dict]], mode: str) -> dict:
    """One History with a JSONL log fed every dict of ``per_thread``: by one thread
    per list (``threads``), or by this thread alone, list after list (``blocks``)
    or the lists interleaved update by update (``alternating``). Times the
    updates only; then closes the History and counts what it kept."""
    n = len(per_thread[0])
    errors: list[BaseException] = []
    stuck = False
    with tempfile.TemporaryDirectory(prefix="bench_history_threads_") as tmp:
        history = jaxhistory.History(distributed_history=False, report_dir=tmp)
        if mode == "threads":
            barrier = threading.Barrier(len(per_thread) + 1, timeout=60)
            workers = [
                threading.Thread(
                    target=_update_all,
                    args=(history, ms, barrier, errors),
                    name=f"bench-updates-{i}",
                    daemon=True,
                )
                for i, ms in enumerate(per_thread)
            ]
            for worker in workers:
                worker.start()
            barrier.wait()
            start = time.perf_counter()
            for worker in workers:
                worker.join(timeout=KILL_HARD_TIMEOUT_S)
            elapsed = time.perf_counter() - start
            stuck = any(worker.is_alive() for worker in workers)
        else:
            if mode == "blocks":
                ms = [m for ms_i in per_thread for m in ms_i]
            else:
                ms = [m for ms_i in zip(*per_thread, strict=True) for m in ms_i]
            start = time.perf_counter()
            for m in ms:
                history.update(m, summarize=False)
            elapsed = time.perf_counter() - start
        kept = lines = 0
        if not stuck:  # a thread still inside update: leave the History alone
            try:
                history.close()
                state = history.state
                for ms in per_thread:
                    kept += sum(state.count(k) for k in ms[0] if k in state)
                lines = log_lines(Path(tmp))
            except Exception as err:
                errors.append(err)
        del history
    updates = n * len(per_thread)
    return {
        "seconds": elapsed,
        "kept": kept,
        "lines": lines,
        "expected_values": updates * HOST_METRICS,
        "expected_lines": updates,
        "errors": errors,
        "stuck": stuck,
    }


def bench_threads(updates: int, repeats: int) -> str:
    pool = min(updates, 1000)
    per_thread = [thread_metrics(t, pool) * (updates // pool) for t in range(THREADS)]
    if any(len(ms) != updates for ms in per_thread):
        raise ValueError(f"{updates} updates is not a multiple of {pool}")
    gc.collect()
    gc.freeze()
    runs: dict[str, list[dict]] = {mode: [] for mode in THREAD_MODES}
    try:
        warmup = [ms[: min(updates, 200)] for ms in per_thread]
        for mode in THREAD_MODES:  # untimed: the first run of each was slower
            run_threads(warmup, mode)
        for r in range(repeats):
            for mode, results in runs.items():  # interleaved
                results.append(run_threads(per_thread, mode))
            print(f"threads: repeat {r + 1}/{repeats} done", flush=True)
    finally:
        del per_thread
        gc.unfreeze()
        gc.collect()
    total = updates * THREADS
    rows = [THREADS_HEADER, "|---|---:|---:|---:|---:|---:|---:|---|"]
    for mode, results in runs.items():
        seconds = statistics.median(res["seconds"] for res in results)
        worst = min(results, key=lambda res: (res["kept"], res["lines"]))
        problems = []
        for res in results:
            if res["stuck"]:
                problems.append("a thread was still updating after the time limit")
            problems += [repr(err) for err in res["errors"]]
            if res["kept"] != res["expected_values"]:
                problems.append(f"{res['expected_values'] - res['kept']:,} values lost")
            if res["lines"] != res["expected_lines"]:
                problems.append(f"{res['expected_lines'] - res['lines']:,} lines lost")
        if problems:
            shown = "; ".join(dict.fromkeys(problems))  # unique, in order
            shown = shown if len(shown) <= 200 else shown[:197] + "..."
            check = f"**FAIL**: {shown.replace('|', '/')}"
        else:
            check = "all kept"
        threads, each = (THREADS, updates) if mode == "threads" else (1, total)
        rows.append(
            f"| {THREAD_MODES[mode]} | {threads} | {each:,} "
            f"| {seconds / total * 1e6:.2f} "
            f"| {total / seconds:,.0f} "
            f"| {worst['kept']:,} / {worst['expected_values']:,} "
            f"| {worst['lines']:,} / {worst['expected_lines']:,} | {check} |"
        )
    settings = (
        f"One `History(distributed_history=False, report_dir=tmp)` (JSONL log "
        f"streamed) fed by {THREADS} threads at once, each calling "
        f"`update(m, summarize=False)` {updates:,} times with its own "
        f"{HOST_METRICS} Python-float metrics (`t0/m0` ... `t3/m9`, dicts from a "
        f"pool of {pool:,} per thread, exempt from GC); and the same "
        f"{total:,} updates made by one thread, either one metric set's "
        f"{updates:,} updates after another (threads holding the GIL for "
        "5 ms at a time come close to this) or the sets alternating on every "
        "update (the worst case for a history that switches key sets). Timed "
        "from the moment the threads are released together (a barrier) until "
        "all have returned; closing the History is not timed; one short untimed "
        "run of each kind first. "
        f"Median of {repeats} repeat(s), the three runs interleaved. Afterwards the "
        "script counts the values in `h.state` (expected: every update's 10 "
        "values) and the lines of the JSONL log (expected: one per update); the "
        "kept counts shown are the worst repeat's. Verdict: all kept, or FAIL "
        "with what was lost or raised. Python threads share the GIL, so the "
        "threaded rate is not expected to beat the single thread: this checks "
        "that concurrent updates lose nothing, and what they cost."
    )
    return "\n".join([THREADS_TITLE, "", settings, "", *rows])


# ----- 5. log lag after SIGKILL ------------------------------------------------------
# The child: records 16 Python floats per update into a History with a JSONL log
# as fast as it can, and every 1,000 steps replaces a small progress file with
# "steps seconds-since-start". It stops by itself after its hard limit.
KILL_CHILD = """
import os, sys, time
import jaxhistory

report_dir, progress, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
keys = [f"metric_{j:02d}" for j in range(int(sys.argv[4]))]
pool = [{k: i + j / 16 for j, k in enumerate(keys)} for i in range(1000)]
history = jaxhistory.History(distributed_history=False, report_dir=report_dir)
partial = progress + ".tmp"
steps = 0
start = time.perf_counter()
while True:
    for m in pool:
        history.update(m, summarize=False)
    steps += len(pool)
    elapsed = time.perf_counter() - start
    with open(partial, "w") as f:
        f.write(f"{steps} {elapsed!r}")
    os.replace(partial, progress)
    if elapsed > limit:
        sys.exit("the parent never killed this process")
"""


def parse_log(path: Path | None) -> tuple[int, int, int]:
    """Reads a JSONL log line by line: (last step, complete lines parsed, lines
    that do not parse or break the step sequence). A cut-off last line (no
    newline: the write stopped there) is skipped."""
    try:
        from orjson import loads
    except ImportError:  # pragma: no cover - orjson comes with jaxhistory
        from json import loads
    last, parsed, bad = -1, 0, 0
    if path is None:
        return last, parsed, bad
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # cut off by the kill
            try:
                step = loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            if step != last + 1:
                bad += 1
            last = step
            parsed += 1
    return last, parsed, bad


def kill_run(seconds: float) -> dict:
    """Starts the child, lets it train ``seconds`` after its first progress report,
    kills it with SIGKILL and compares its progress with its JSONL log."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    with tempfile.TemporaryDirectory(prefix="bench_history_kill_") as tmp:
        report_dir, progress = Path(tmp) / "report", Path(tmp) / "progress.txt"
        stderr_path = Path(tmp) / "stderr.txt"
        limit = seconds + KILL_HARD_TIMEOUT_S
        with open(stderr_path, "wb") as stderr:
            args = [report_dir, progress, limit, KILL_METRICS]
            proc = subprocess.Popen(
                [sys.executable, "-c", KILL_CHILD, *map(str, args)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
            try:
                deadline = time.monotonic() + KILL_HARD_TIMEOUT_S
                while not progress.exists() and proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the SIGKILL child did not start within "
                            f"{KILL_HARD_TIMEOUT_S:g} s"
                        )
                    time.sleep(0.01)
                kill_at = time.monotonic() + seconds
                while proc.poll() is None and time.monotonic() < kill_at:
                    time.sleep(0.02)
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(
                f"the SIGKILL child exited with {proc.returncode} before it was "
                f"killed:\n{stderr_path.read_text(errors='replace')[-2000:]}"
            )
        steps_text, elapsed_text = progress.read_text().split()
        steps, elapsed = int(steps_text), float(elapsed_text)
        logs = sorted(report_dir.glob("*.jsonl"))
        last, parsed, bad = parse_log(logs[0] if logs else None)
    rate = steps / elapsed
    lost = max(0, steps - (last + 1))
    return {
        "steps": steps,
        "rate": rate,
        "last": last,
        "parsed": parsed,
        "bad": bad,
        "logs": len(logs),
        "lost": lost,
        "lost_s": lost / rate,
    }


def bench_kill(seconds: float, runs: int) -> str:
    results = []
    for r in range(runs):
        results.append(kill_run(seconds))
        print(f"SIGKILL: run {r + 1}/{runs} done", flush=True)
    rows = [KILL_HEADER, "|---|---:|---:|---:|---:|---:|---:|---|"]
    for i, res in enumerate(results):
        note = ""
        if res["bad"] or res["logs"] != 1:
            note = (
                f"; **FAIL**: {res['bad']} bad or out-of-order lines, "
                f"{res['logs']} log files"
            )
        rows.append(
            f"| {i + 1} | {res['steps']:,} | {res['rate']:,.0f} | {res['last']:,} "
            f"| {res['parsed']:,} | {res['lost']:,} | {res['lost_s']:.2f} "
            f"| ≤ {KILL_TARGET_S:g} s: {verdict(res['lost_s'] <= KILL_TARGET_S)}"
            f"{note} |"
        )
    median_s = statistics.median(res["lost_s"] for res in results)
    median_steps = statistics.median(res["lost"] for res in results)
    rows.append(
        f"| median | {statistics.median(res['steps'] for res in results):,.0f} "
        f"| {statistics.median(res['rate'] for res in results):,.0f} | | "
        f"| {median_steps:,.0f} | {median_s:.2f} "
        f"| ≤ {KILL_TARGET_S:g} s: {verdict(median_s <= KILL_TARGET_S)} |"
    )
    slack = 1000 / statistics.median(res["rate"] for res in results)
    settings = (
        f"A child process (`JAX_PLATFORMS=cpu`) records {KILL_METRICS} Python "
        "floats per update, as fast as it can, into "
        "`History(distributed_history=False, report_dir=tmp)` with "
        "`update(m, summarize=False)`, and every 1,000 steps replaces a small "
        "progress file (steps done, seconds since its loop started) with "
        f"`os.replace`. {seconds:g} s after its first progress report the parent "
        "kills it with SIGKILL, then reads the JSONL log line by line (a cut-off "
        "last line is skipped; every complete line must parse and the steps must "
        "run 0, 1, 2, ... or the row says FAIL). Steps trained: the last "
        "progress report (the child may have run up to 999 steps more, "
        f"≈ {slack * 1e3:.0f} ms here, so the loss shown is a lower bound by at "
        "most that much); steps lost: steps trained minus the steps in the log; "
        "seconds lost: steps lost / the child's steps per second (from its last "
        f"progress report). {runs} run(s); the target is checked on each run and "
        f"on the median. The child stops by itself after {KILL_HARD_TIMEOUT_S:g} "
        "s more, and the parent gives it as long to start."
    )
    return "\n".join([KILL_TITLE, "", settings, "", *rows])


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
    if jax.device_count() != 8:
        sys.exit(
            f"error: this benchmark needs 8 devices, JAX sees {jax.device_count()}; "
            "set JAX_NUM_CPU_DEVICES=8 before JAX starts"
        )
    if args.quick:
        host, memory, traced, loop = (1_000, 10_000), 50_000, 20_000, (8, 8)
        host_repeats, loop_repeats = args.repeats or 2, args.repeats or 3
        thread_updates, thread_repeats = 2_000, args.repeats or 1
        kill_seconds, kill_runs = 2.0, 1
    else:
        host, memory, traced, loop = (20_000, 200_000), 1_000_000, 200_000, (48, 16)
        host_repeats, loop_repeats = args.repeats or 5, args.repeats or 48
        thread_updates, thread_repeats = 20_000, args.repeats or 3
        kill_seconds, kill_runs = 10.0, 3

    info = machine_info()
    print(info, flush=True)
    start = time.perf_counter()
    sections = [
        bench_host(*host, host_repeats),
        bench_memory(memory, traced),
        bench_loop(*loop, loop_repeats),
        bench_threads(thread_updates, thread_repeats),
        bench_kill(kill_seconds, kill_runs),
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
