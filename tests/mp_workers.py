"""Functions run inside processes started by jaxhistory.launch_local (tests only).

Kept free of pytest and of module-level JAX work: each launched process imports this
module after jax.distributed.initialize has run.
"""

import time

import numpy as np


def global_data(seed: int, n_metrics: int, n_values: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"m{i}": (rng.normal(size=n_values) * (i + 1) + 100 * i).astype(np.float32)
        for i in range(n_metrics)
    }


def stats_on_global_mesh(seed: int, n_metrics: int) -> dict:
    """distributed_stats (SPMD and shard_map) over every device of every process."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    data = global_data(seed, n_metrics, n)
    metrics = {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in data.items()
    }
    spmd = jax.jit(jh.distributed_stats)(metrics)
    coll = jax.jit(
        jax.shard_map(
            lambda m: jh.collective.distributed_stats(
                jax.tree.map(lambda v: v[0], m), "data"
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
    )(metrics)
    local = {
        k: [float(x) for x in v.addressable_data(0).reshape(-1)]
        for k, v in metrics.items()
    }
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": n,
        "local_values": local,
        "spmd": {k: float(v.addressable_data(0)) for k, v in spmd.items()},
        "collective": {k: float(v.addressable_data(0)) for k, v in coll.items()},
    }


def fail_on_process_one() -> int:
    import jax

    if jax.process_index() == 1:
        raise RuntimeError("process one gives up")
    return jax.process_index()


def sleep_forever() -> None:
    time.sleep(3600)


def fail_while_the_other_waits_in_a_collective() -> int:
    """Process 1 raises while process 0 blocks in a cross-process collective."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_index() == 1:
        raise RuntimeError("rank one gives up")
    multihost_utils.process_allgather(np.ones(1))
    return 0


def distributed_history_run(steps: int) -> dict:
    """History with distributed history over every device of every process."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    history = jh.History(distributed_history=True)
    lines = []
    for step in range(steps):
        data = global_data(step, 1, n)["m0"]
        loss = jax.make_array_from_callback(
            data.shape, sharding, lambda i, data=data: data[i]
        )
        host = float(jax.process_index() + 1) * (step + 1)
        lines.append(history.update({"loss": loss, "host": host, "lr": 0.1}))
    state = history.state
    # What History's one reduction per update compiles to: host, lr and, with
    # several processes, the two arrival scalars, beside the per-device loss.
    from jaxhistory._distributed import _per_process_rows

    (fn,) = history._recorder.job.reducer._fns.values()
    packed = None  # one process: host scalars are recorded as they are
    if jax.process_count() > 1:
        packed = _per_process_rows([(str(i), 0.0) for i in range(4)], mesh)
    return {
        "collectives": jh.collective_counts(fn, {"loss": loss}, packed),
        "lines": lines,
        "records": {k: np.asarray(state.values(k)).tolist() for k in state.keys},
        "steps": {k: np.asarray(state.steps(k)).tolist() for k in state.keys},
    }


def replicated_values_run(steps: int) -> dict:
    """A jitted step on a mesh over every process's devices returns statistics
    from the step, a replicated scalar and a replicated array; History records
    them with host scalars, and counts any all-gather it would make."""
    from unittest import mock

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(x):
        per = x * x
        return {
            "dist": jh.distributed_stats({"loss": jh.per_shard(per)}),
            "grad_norm": jnp.sqrt(jnp.sum(per)),  # replicated over all devices
            "w": jnp.stack([per.min(), per.max()]),  # a replicated array
        }

    history = jh.History(distributed_history=True)
    lines = []
    with mock.patch.object(
        multihost_utils, "process_allgather", wraps=multihost_utils.process_allgather
    ) as gather:
        for k in range(steps):
            data = global_data(k, 1, n)["m0"]
            x = jax.make_array_from_callback(
                data.shape, sharding, lambda i, d=data: d[i]
            )
            out = step(x)
            host = float(jax.process_index() + 1) * (k + 1)
            lines.append(history.update({**out, "host": host}, step=k))
        gathers = gather.call_count
    local = jh.History(distributed_history=False)
    try:  # a per-device array, not reduced: each process holds only its part
        local.update({"x": x})
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    state = history.state
    return {
        "lines": lines,
        "gathers": gathers,
        "refused": refused,
        "records": {k: np.asarray(state.values(k)).tolist() for k in state.keys},
    }


def names_timeout() -> dict:
    """Process 0 records a name set; process 1 never calls update."""
    import time

    import jax

    import jaxhistory as jh
    from jaxhistory import _distributed

    _distributed.NAMES_TIMEOUT_S = 3.0
    history = jh.History(distributed_history=True)
    if jax.process_index() != 0:
        return {"error": None, "seconds": 0.0}
    start = time.monotonic()
    try:
        history.update({"loss": 1.0})
    except TimeoutError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": "no error", "seconds": time.monotonic() - start}


def mismatched_names() -> str:
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True)
    name = "loss" if jax.process_index() == 0 else "lost"
    try:
        history.update({name: 1.0})
    except ValueError as err:
        return str(err)
    return "no error"


def names_differ_beside_a_shared_one() -> str:
    """Both processes record "loss"; process 0 also "acc", process 1 "lost"."""
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True)
    other = "acc" if jax.process_index() == 0 else "lost"
    try:
        history.update({"loss": 1.0, other: 2.0})
    except ValueError as err:
        return str(err)
    return "no error"


def finalize_run(outdir: str, steps: int) -> dict:
    """A distributed History with a shared and a per-process JSONL log, finalized.

    Every process records and finalizes; only process 0 may write the shared files.
    """
    import os

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    shared = jh.History(
        distributed_history=True, jsonl_path=os.path.join(outdir, "shared.jsonl")
    )
    mine = jh.History(
        distributed_history=False,
        jsonl_path=os.path.join(outdir, "rank{process_index}.jsonl"),
    )
    for step in range(steps):
        data = global_data(step, 1, n)["m0"]
        loss = jax.make_array_from_callback(
            data.shape, sharding, lambda i, data=data: data[i]
        )
        shared.update({"loss": loss, "lr": 0.1}, summarize=False)
        mine.update({"rank": float(jax.process_index()), "step": step})
    ds = shared.finalize(os.path.join(outdir, "out"), plot=False)
    mine.close()
    return {
        "process_index": jax.process_index(),
        "variables": sorted(str(v) for v in ds.data_vars),
        "loss_mean": [float(x) for x in ds["loss/mean"].values],
        "process_count_attr": int(ds.attrs["process_count"]),
    }


def trace_run(folder: str) -> dict:
    """Each process traces spans and a History's counters; local rank 0 merges."""
    import time

    import jax

    import jaxhistory as jh
    from jaxhistory import trace

    handler = trace.JSONTraceHandler(folder=folder, run_name="mp")
    handler.start()
    history = jh.History(distributed_history=False)
    for step in range(3):
        with jh.StopWatch(f"step {step}"):
            time.sleep(0.002 * (jax.process_index() + 1))
        history.update({"loss": 1.0 / (step + 1)}, summarize=False)
    history.flush()
    handler.close()
    return {
        "paths": [str(p) for p in handler.paths],
        "merged": None if handler.merged_path is None else str(handler.merged_path),
        "vars": {k: handler._vars[k] for k in ("rank", "local_rank", "world_size")},
    }


def timing_on_one_process() -> dict:
    """Only process 0 times a block into a distributed History: no collective."""
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True)
    if jax.process_index() == 0:
        with jh.StopWatch("checkpoint", history=history):
            pass
    history.update({"lr": 0.1})  # a host scalar: reduced across processes
    state = history.state
    return {k: state.steps(k).tolist() for k in state.keys}


def provenance_run(steps: int) -> dict:
    """Provenance over every device of 2 processes x 2 devices: the public
    reducers (SPMD and shard_map) and History, with a NaN on device 3."""
    import warnings

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))

    def global_array(values):
        values = np.asarray(values, np.float32)
        return jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])

    def read(stats):
        return {k: float(v.addressable_data(0)) for k, v in stats.items()}

    values = [1.0, 9.0, 9.0, -4.0]  # max on devices 1 and 2 (a tie), min on 3
    x = {"x": global_array(values)}
    with jax.set_mesh(mesh):
        spmd = jax.jit(lambda m: jh.distributed_stats(m, provenance=True))(x)
    coll = jax.jit(
        jax.shard_map(
            lambda m: jh.collective.distributed_stats(
                {"x": m["x"][0]}, "data", provenance=True, mesh=mesh
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
    )(x)
    history = jh.History(distributed_history=True)
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            loss = np.arange(4.0) + step
            if step >= 2:
                loss[3] = np.nan
            host = 10.0 * (jax.process_index() + 1)
            lines.append(
                history.update({"loss": global_array(loss), "host": host}, step=step)
            )
    state = history.state
    return {
        "spmd": read(spmd),
        "collective": read(coll),
        "lines": lines,
        "warnings": [str(w.message) for w in caught if "NaN" in str(w.message)],
        "records": {k: np.asarray(state.values(k)).tolist() for k in state.keys},
    }


def straggler_run(steps: int, slow: int, sleep: float) -> dict:
    """Process ``slow`` sleeps before each update; the others do not."""
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True)
    for step in range(steps):
        if jax.process_index() == slow:
            time.sleep(sleep)
        history.update({"loss": float(step)}, step=step)
    state = history.state
    return {
        "process": np.asarray(state.values("straggler/process")).tolist(),
        "lag": np.asarray(state.values("straggler/lag")).tolist(),
        "keys": sorted(state.keys),
    }


def say(word: str = "hi") -> int:
    """Prints two lines (stdout and stderr); returns the process index."""
    import sys

    import jax

    print(f"{word} from {jax.process_index()}", flush=True)
    print(f"{word} on stderr", file=sys.stderr, flush=True)
    return jax.process_index()


def metrics_across_processes() -> dict:
    """A Collection over a mesh of every device of every process: per-process
    batch parts, one global batch, exact against NumPy on the whole batch."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxhistory import metrics as M

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    Metrics = M.Collection.create(
        loss=M.Average.from_output("loss"),
        loss_std=M.Std.from_output("loss"),
        acc=M.Accuracy,
        last=M.Last.from_output("loss"),
    )
    rng = np.random.default_rng(0)
    batches = []
    for b in range(3):
        size = 4 * n
        mask = rng.random(size) > 0.3
        if b == 2:
            mask[size // 3 :] = False  # padding on the later processes only
        batches.append(
            {
                "loss": (1e3 + rng.normal(size=size)).astype(np.float32),
                "logits": rng.normal(size=(size, 5)).astype(np.float32),
                "labels": rng.integers(0, 5, size=size).astype(np.int32),
                "mask": mask,
            }
        )
    per = 4 * n // jax.process_count()
    me = jax.process_index()
    step = jax.jit(lambda m, b: m.update(**b))
    m = Metrics.empty(num_shards=n)
    for batch in batches:
        local = {k: v[me * per : (me + 1) * per] for k, v in batch.items()}
        glob = {
            k: jax.make_array_from_process_local_data(sharding, v)
            for k, v in local.items()
        }
        m = step(m, glob)
    out = jax.jit(lambda m: m.compute())(m)
    got = {k: float(np.asarray(v)) for k, v in out.items()}
    cat = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    x = cat["loss"].astype(np.float64)[cat["mask"]]
    hit = (cat["logits"].argmax(1) == cat["labels"])[cat["mask"]]
    want = {"loss": x.mean(), "loss_std": x.std(), "acc": hit.mean(), "last": x[-1]}
    return {"got": got, "want": want}


def run_ids(sleep_on: int, seconds: float) -> dict:
    """Each process makes two Histories (one named, one not); ``sleep_on``
    starts ``seconds`` late, so its clock reads a later second. Process 2 (when
    there is one) makes no History at all."""
    import jax

    import jaxhistory as jh

    if jax.process_index() == 2:
        return {"ids": []}
    if jax.process_index() == sleep_on:
        time.sleep(seconds)
    first = jh.History(distributed_history=False, run_name="mp")
    second = jh.History(distributed_history=False)
    return {"ids": [first.run_id, second.run_id]}


def hang_reports(client, me: int) -> list:
    """The hang reports this process's watch makes, as (time, text), filled in
    as they come; the first also posts ``test/reported/{me}``."""
    import logging

    reports = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "may hang" in record.getMessage():
                if not reports:
                    client.key_value_set(f"test/reported/{me}", "1")
                reports.append((time.time(), record.getMessage()))

    logging.getLogger("jaxhistory").addHandler(Catch())
    return reports


def hang_run(how: str, timeout: float) -> dict:
    """Process 1 stops at step 3 inside a StopWatch span ("sleep": for
    ``timeout`` + 4 s; "stop": SIGSTOP until process 0, once it has reported,
    sends SIGCONT). Returns each process's reports, how long after the stop
    the first came, and what its log says."""
    import json
    import os
    import signal
    import tempfile
    import threading

    import jax

    import jaxhistory as jh
    from jaxhistory._distributed import distributed_client

    client = distributed_client()
    me = jax.process_index()
    reports = hang_reports(client, me)
    log = os.path.join(tempfile.mkdtemp(), "run{process_index}.jsonl")
    history = jh.History(distributed_history=True, hang_timeout=timeout, jsonl_path=log)
    if me == 0 and how == "stop":

        def wake():  # once both others have reported
            for other in (0, 2):
                client.blocking_key_value_get(f"test/reported/{other}", 60_000)
            pid = int(client.blocking_key_value_get("test/pid", 60_000))
            os.kill(pid, signal.SIGCONT)

        threading.Thread(target=wake, daemon=True).start()
    for step in range(6):
        if me == 1 and step == 3:
            with jh.StopWatch("load batch"):  # no more steps from here
                client.key_value_set("test/stopped", repr(time.time()))
                if how == "sleep":
                    time.sleep(timeout + 4)
                else:  # after a post of the watch (every timeout / 5 s)
                    time.sleep(1.5 * timeout / 5)
                    client.key_value_set("test/pid", str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
        history.update({"loss": float(step)})
    history.close()
    stopped = float(client.blocking_key_value_get("test/stopped", 60_000))
    logged = []
    with open(log.replace("{process_index}", str(me))) as f:
        for line in f:
            m = json.loads(line).get("metrics", {})
            if "hang/process" in m:
                logged.append([m["hang/process"], m["hang/last_step"]])
    return {
        "reports": [text for _, text in reports],
        "latency": reports[0][0] - stopped if reports else None,
        "logged": logged[0] if logged else None,
    }


def metric_added_on_one_process(hang_timeout: float) -> None:
    """Both record "loss" for 3 steps; at step 3 process 1 adds "extra" (and
    raises), while process 0 waits in its step-3 reduction."""
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True, hang_timeout=hang_timeout)
    for step in range(3):
        history.update({"loss": float(step)})
    extra = {"extra": 1.0} if jax.process_index() == 1 else {}
    history.update({"loss": 3.0, **extra})


def differing_plain_values(name: str, log_every: int = 1) -> dict:
    """Records, for 16 steps, "loss" (a host scalar, reduced), "lr" (0.003 on
    every process) and ``name``: a NumPy array ("np"), a single-device JAX
    array ("jax") or a NumPy array the same everywhere ("same"), which on
    process 1 differs from step 5 on (except "same")."""
    import jax
    import jax.numpy as jnp

    import jaxhistory as jh

    history = jh.History(distributed_history=True, log_every=log_every)
    me = jax.process_index()
    raised = None
    for step in range(16):
        bump = 1.0 if (me == 1 and step >= 5 and name != "same") else 0.0
        value = np.array([float(step), bump])
        if name == "jax":
            value = jnp.asarray(value)
        try:
            history.update(
                {"loss": float(me), "lr": 0.003, "w": value},
                step=step,
                summarize=me == 0,  # the batches' reads differ: the raise must not
            )
        except ValueError as err:
            raised = (step, str(err))
            break
    state = history.state
    return {
        "raised": raised,
        "lr": {k: state.values(k).tolist() for k in state.keys if k.startswith("lr")},
    }


def straggler_scores_run(slow: int, outdir: str) -> dict:
    """Three processes step every 100 ms; process ``slow`` (-1: none) takes
    10% longer before each update. Windows of 10 updates, 40 updates."""
    import warnings

    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True, straggler_window=10)
    flagged = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(40):
            time.sleep(0.1)
            if jax.process_index() == slow:
                time.sleep(0.01)
            history.update({"loss": float(step)}, step=step)
        history.flush()
        flagged = [str(w.message) for w in caught if "consistently" in str(w.message)]
    state = history.state
    history.finalize(outdir, plot=jax.process_index() == 0)
    return {
        "flagged": flagged,
        "median": np.asarray(state.values("straggler/median_lag")).tolist(),
        "steps": np.asarray(state.steps("straggler/median_lag")).tolist(),
        "slowest": np.asarray(state.values("straggler/slowest")).tolist(),
    }


def batched_run(
    log_every: int, steps: int, summarize: str = "all", batch_values: int = 0
) -> dict:
    """A per-shard loss and a host scalar recorded with ``log_every``: the
    device programs run, the batches reduced on the host, the summary lines
    and the records."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh
    from jaxhistory import _distributed

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    history = jh.History(distributed_history=True, log_every=log_every)
    programs, batches = [], []  # device programs; batches reduced on the host
    run = _distributed.Reducer._program

    def counted(self, items):
        programs.append(1)
        return run(self, items)

    class Counted(_distributed.HostBatch):
        def __init__(self, updates, *args):
            batches.append(len(updates))
            super().__init__(updates, *args)

    _distributed.Reducer._program = counted
    _distributed.HostBatch = Counted
    if batch_values:
        _distributed.BATCH_VALUES = batch_values
    lines = []
    for step in range(steps):
        data = global_data(step, 1, n)["m0"]
        loss = jax.make_array_from_callback(
            data.shape, sharding, lambda i, data=data: data[i]
        )
        host = float(jax.process_index() + 1) * (step + 1)
        wanted = summarize == "all" or (
            summarize == "first" and jax.process_index() == 0
        )
        lines.append(
            history.update({"loss": loss, "host": host}, step=step, summarize=wanted)
        )
    history.close()
    state = history.state
    # what the batches left in the store: the last group's keys only
    client = _distributed.distributed_client()
    left = [
        k for k, _ in client.key_value_dir_get_bytes("jaxhistory/") if "/batch" in k
    ]
    return {
        "programs": programs,
        "batches": batches,
        "store": sorted(k.split("/", 2)[2] for k in left),
        "lines": lines,
        "records": {k: np.asarray(state.values(k)).tolist() for k in state.keys},
        "steps": {k: np.asarray(state.steps(k)).tolist() for k in state.keys},
    }


def host_scalars_in_float64() -> dict:
    """With jax_enable_x64: a host scalar's statistics across processes."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jaxhistory as jh

    history = jh.History(distributed_history=True)
    value = 1234567.891 + jax.process_index() * 1e-6
    history.update({"x": value, "lr": 0.003}, step=0)
    state = history.state
    return {
        k: float(state.values(k)[0])
        for k in ("x/mean", "x/max", "x/min", "lr/mean", "lr/std")
    }


def unclosed_histories(count: int, shutdown: bool) -> int:
    """Makes ``count`` Histories watching for hangs every 0.1 s, records 3
    steps in each and leaves them open; with ``shutdown`` ends the runtime
    itself, as many scripts do. The process must then exit cleanly."""
    import jax

    import jaxhistory as jh

    histories = []
    for k in range(count):
        history = jh.History(
            distributed_history=True, hang_timeout=0.1, run_name=f"open{k}"
        )
        for step in range(3):
            history.update({"loss": float(step)}, step=step)
        histories.append(history)
    if shutdown:
        jax.distributed.shutdown()
    return len(histories)


def exit_while_a_batch_waits() -> str:
    """Leaves a batch waiting in the distributed runtime's client (native
    code) for a result that never comes, and returns: the process must exit
    cleanly, not abort when the interpreter ends its threads."""
    import time

    import jax

    from jaxhistory import _distributed, _host_batches
    from jaxhistory._distributed import distributed_client

    _host_batches.LEADER = 99  # every process waits for a leader that never posts
    batch = _host_batches.HostBatch(
        [(0, 0.0, [("x", 1.0)])],
        "jaxhistory-test/waits",
        None,
        distributed_client() or _distributed._client(),
        lambda: True,
        _distributed._combine_batch,
        _distributed._split_batch,
        jax.sharding.Mesh(jax.devices(), ("d",)),
    )
    time.sleep(0.5)  # the thread is inside the blocking read now
    return "waiting" if not batch._done.is_set() else "done"


def bad_host_value_in_a_batch() -> dict:
    """log_every=4, 8 updates; at step 5 the host scalar is a string on every
    process: that update raises at once, and every other update is recorded."""
    import jaxhistory as jh

    history = jh.History(distributed_history=True, log_every=4)
    raised = []
    for step in range(8):
        host = "x" if step == 5 else float(step)
        try:
            history.update({"host": host}, step=step, summarize=False)
        except TypeError as err:
            raised.append((step, str(err)))
    history.close()
    return {"raised": raised, "steps": history.state.steps("host/mean").tolist()}


def stacked_copies_run(steps: int) -> dict:
    """A step on a mesh over every process's devices returns 10 replicated
    scalars (global arrays, not fully addressable); History sends them to the
    host in stacked transfers, as it does on an accelerator: each process
    through its own copies, on its own schedule."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh
    from jaxhistory import _appending
    from jaxhistory._host_copies import host_copies

    _appending.needs_host_copy = lambda arrays: True  # as on an accelerator
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sharding = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(x, k):
        total = jnp.sum(x)
        return {f"m{j}": total * (j + 1) + k for j in range(10)}

    history = jh.History(distributed_history=True)
    data = np.arange(4 * n, dtype=np.float32)
    x = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
    lines = []
    for k in range(steps):
        out = step(x, jnp.float32(k))
        line = history.update(out, step=k, summarize=k % 10 == 0)
        if line:
            lines.append(line)
        if k % 8 == 7:
            jax.block_until_ready(out)
    history.flush()
    state = history.state
    records = {key: np.asarray(state.values(key)).tolist() for key in state.keys}
    addressable = out["m0"].is_fully_addressable
    history.close()
    return {
        "records": records,
        "lines": lines,
        "programs": host_copies.programs,
        "fully_addressable": addressable,
        "total": float(data.sum()),
    }


def uneven_batches(updates: int, extra_on: int) -> dict:
    """log_every=4: every process records ``updates`` steps of a host scalar,
    process ``extra_on`` one more; then each closes. What close raised, and
    how long it took."""
    import time

    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True, log_every=4, hang_timeout=2.0)
    count = updates + (jax.process_index() == extra_on)
    for step in range(count):
        history.update({"lr": 0.1 * step}, step=step, summarize=False)
    start = time.monotonic()
    try:
        history.close()
        raised = None
    except ValueError as err:
        raised = str(err)
    return {
        "raised": raised,
        "seconds": time.monotonic() - start,
        "steps": history.state.steps("lr/mean").tolist(),
    }


def metric_added_in_batches() -> dict:
    """log_every=4, 8 steps: at step 4 (where a batch closes) process 1 adds
    "extra"; each process stops at its first error and closes. What update
    and close raised, and how long it all took."""
    import time

    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True, log_every=4, hang_timeout=2.0)
    start, raised = time.monotonic(), {}
    try:
        for step in range(8):
            extra = {"extra": 1.0} if jax.process_index() == 1 and step >= 4 else {}
            history.update({"lr": 0.1 * step, **extra}, step=step, summarize=False)
    except (ValueError, TimeoutError) as err:
        raised["update"] = f"{type(err).__name__}: {err}"
    try:
        history.close()
    except ValueError as err:
        raised["close"] = str(err)
    return {"raised": raised, "seconds": time.monotonic() - start}


def steps_that_differ(log_every: int) -> dict:
    """Each process records 12 updates of a host scalar, process 1 one step
    ahead of process 0 (steps 1-12 against 0-11); each stops at its first
    ValueError and closes."""
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True, log_every=log_every)
    me, raised = jax.process_index(), None
    try:
        for k in range(12):
            history.update({"lr": 0.1}, step=k + me, summarize=False)
        history.flush()
    except ValueError as err:
        raised = str(err)
    try:
        history.close()
    except ValueError as err:
        raised = raised or str(err)
    return {"raised": raised, "keys": list(history.state.keys)}


def close_after_finalize_on_one_process(outdir: str) -> list:
    """log_every=4, 6 updates, finalize on every process, then close (twice)
    on process 0 alone: nothing was recorded since, so nothing waits."""
    import jax

    import jaxhistory as jh

    history = jh.History(distributed_history=True, log_every=4, hang_timeout=2.0)
    for step in range(6):
        history.update({"lr": 0.1 * step}, step=step, summarize=False)
    history.finalize(outdir, plot=False)
    if jax.process_index() == 0:
        history.close()
        history.close()
    return history.state.steps("lr/mean").tolist()


def closed_behind(
    close_at: int,
    last: int,
    timeout: float,
    summarize: bool = True,
    log: bool = False,
    end: str = "close",
) -> dict:
    """Process 0 records steps 0 to ``close_at`` of a host scalar (one
    collective each) and closes, while process 1 goes on to ``last`` and ends
    with ``end`` ("close" or "finalize"); once process 1 has reported the
    hang, process 0 records the steps it left out (joining the collective
    process 1 waits in) and ends the same way. ``log``: each process streams
    a JSONL log (closing it waits for the values). Returns what each
    reported, and how long after process 0 closed."""
    import os
    import tempfile

    import jax

    import jaxhistory as jh
    from jaxhistory._distributed import distributed_client

    client = distributed_client()
    me = jax.process_index()
    reports = hang_reports(client, me)
    folder = tempfile.mkdtemp()
    history = jh.History(
        distributed_history=True,
        hang_timeout=timeout,
        jsonl_path=os.path.join(folder, "run{process_index}.jsonl") if log else None,
    )
    first = close_at + 1 if me == 0 else last + 1
    for step in range(first):
        history.update({"lr": 0.1 * step}, step=step, summarize=summarize)
    if me == 0:
        history.close()
        client.key_value_set("test/closed", repr(time.time()))
        client.blocking_key_value_get("test/reported/1", 60_000)
        for step in range(first, last + 1):
            history.update({"lr": 0.1 * step}, step=step, summarize=summarize)
    if end == "finalize":
        history.finalize(folder, plot=False)
    else:
        history.close()
    closed = float(client.blocking_key_value_get("test/closed", 60_000))
    return {
        "reports": [text for _, text in reports],
        "latency": reports[0][0] - closed if reports else None,
        "steps": history.state.steps("lr/mean").tolist(),
    }


def spread_watch_across_processes() -> dict:
    """watch of a tree replicated over every device of every process, spread
    and read everywhere."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rng = np.random.default_rng(11)
    host = {f"w{i:02d}": rng.normal(size=(8, i + 1)) * (i + 1) for i in range(12)}
    host["w03"][1, 2] = np.nan
    sharding = NamedSharding(mesh, P())
    tree = {
        k: jax.make_array_from_callback(
            v.shape, sharding, lambda idx, v=v: np.float32(v[idx])
        )
        for k, v in host.items()
    }
    out = {}
    for spread in (True, False):
        fn = jax.jit(lambda t, s=spread: jh.watch(t, stats=jh.WATCH_STATS, spread=s))
        stats = fn(tree)
        out[str(spread)] = {k: float(v.addressable_data(0)) for k, v in stats.items()}
        out[f"counts {spread}"] = jh.collective_counts(fn, tree)
    out["process_index"] = jax.process_index()
    out["host"] = {k: v.tolist() for k, v in host.items()}
    return out
