"""The host recording core under threads, branches, pytree transformations and
SIGKILL: nothing recorded is lost, duplicated or seen where it does not belong."""

import contextlib
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import _writer
from jaxhistory._fan_out import FanOut
from jaxhistory._row import Row, RowKind


def _log_path(h: jh.History):
    return h.report_dir / f"{h.run_id}.jsonl"


@pytest.fixture
def switch_often():
    """Threads switch every microsecond: races show up at once instead of rarely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


# ----- History from several threads --------------------------------------------------
@pytest.mark.parametrize("log", [False, True])
def test_updates_from_four_threads_are_all_recorded_in_order(
    tmp_path, log, switch_often
):
    h = jh.History(distributed_history=False, report_dir=tmp_path if log else None)
    n = 1500
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        for k in range(n):
            h.update({f"t{i}": float(k)}, summarize=False)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h.close()
    for i in range(4):
        assert h.state.values(f"t{i}").tolist() == [float(k) for k in range(n)]
    steps = np.concatenate([h.state.steps(f"t{i}") for i in range(4)])
    assert len(np.unique(steps)) == 4 * n  # every update got a step of its own
    if log:
        back = jh.HistoryState.from_jsonl(_log_path(h))
        for i in range(4):
            assert back.values(f"t{i}").tolist() == [float(k) for k in range(n)]
            assert back.steps(f"t{i}").tolist() == h.state.steps(f"t{i}").tolist()


def test_flush_from_a_monitor_thread_loses_no_attached_value(tmp_path, switch_often):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    done = threading.Event()
    n = 1500

    def monitor():
        while not done.is_set():
            h.flush()

    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        for k in range(n):
            h.attach({"att": float(k)})
            h.update({"loss": float(k)}, summarize=False)
    finally:
        done.set()
        thread.join()
    h.close()
    assert h.state.values("att").tolist() == [float(k) for k in range(n)]
    assert h.state.steps("att").tolist() == h.state.steps("loss").tolist()
    back = jh.HistoryState.from_jsonl(_log_path(h))
    assert back.values("att").tolist() == [float(k) for k in range(n)]


@pytest.mark.parametrize("round_", range(5))
def test_close_racing_updates_keeps_every_update_that_returned(
    tmp_path, switch_often, round_
):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    returned = []
    errors = []

    def work():
        try:
            for k in range(3000):
                h.update({"x": float(k)}, summarize=False)
                returned.append(k)
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(0.002 * (round_ + 1))
    before_close = len(returned)
    h.close()  # updates go on: a later one reopens the log in append mode
    logged = jh.HistoryState.from_jsonl(_log_path(h)).count("x")
    thread.join()
    h.close()
    assert errors == []
    assert logged >= before_close  # what returned before close() was written
    values = h.state.values("x").tolist()
    assert values == [float(k) for k in range(3000)]
    back = jh.HistoryState.from_jsonl(_log_path(h))
    assert back.values("x").tolist() == values


@pytest.mark.usefixtures("host_path")
@pytest.mark.parametrize("form", ["repeated dict", "device value"])
def test_updates_after_a_close_cut_short_by_ctrl_c_are_recorded_and_logged(
    tmp_path, monkeypatch, form
):
    """Ctrl-C landing in close() while it waits for the log (a slow disk), the
    loop going on: updates neither raise (before: ValueError 'the writer is
    closed', the row recorded all the same) nor miss the log; the next close
    completes the one cut short."""
    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="r")
    for s in range(10):
        h.update({"x": float(s)}, summarize=False)
    writer = h._recorder.out.writer
    monkeypatch.setattr(
        writer._thread, "join", mock.Mock(side_effect=KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        h.close()
    monkeypatch.undo()
    for s in range(10, 20):
        x = float(s) if form == "repeated dict" else jnp.float32(s)
        h.update({"x": x}, summarize=False)
    h.close()
    assert h.state.values("x").tolist() == [float(s) for s in range(20)]
    back = jh.HistoryState.from_jsonl(_log_path(h))
    assert back.values("x").tolist() == [float(s) for s in range(20)]


def test_updates_from_threads_with_device_values(tmp_path, switch_often):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    f = jax.jit(lambda x: x * 2.0)

    def work(i):
        for k in range(200):
            h.update({f"d{i}": f(jnp.float32(k))}, summarize=False)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h.close()
    back = jh.HistoryState.from_jsonl(_log_path(h))
    for i in range(3):
        expected = [2.0 * k for k in range(200)]
        assert h.state.values(f"d{i}").tolist() == expected
        assert back.values(f"d{i}").tolist() == expected


# ----- HistoryState branches ---------------------------------------------------------
@pytest.mark.parametrize("interval", [None, 1e-6])
def test_branches_on_four_threads_never_see_each_other(interval):
    old = sys.getswitchinterval()
    if interval is not None:
        sys.setswitchinterval(interval)
    try:
        for _ in range(10):  # a race shows up in some rounds, not in all
            _branches_round()
    finally:
        sys.setswitchinterval(old)


def _branches_round():
    base = jh.HistoryState()
    for k in range(10):
        base = base.update({"x": float(-k)})
    before = base.values("x").tolist()
    results = {}
    barrier = threading.Barrier(4)

    def work(i):
        s = base
        barrier.wait()
        for k in range(500):
            s = s.update({"x": float(i * 1000 + k)})
        results[i] = s

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]  # no thread died
    for i, s in results.items():
        mine = [float(i * 1000 + k) for k in range(500)]
        assert s.values("x").tolist() == before + mine
        assert s.steps("x").tolist() == list(range(510))
    assert base.values("x").tolist() == before and base.next_step == 10


def test_a_state_never_sees_rows_recorded_after_it():
    s1 = jh.HistoryState().update({"a": 1.0}).update({"a": 2.0})
    values, steps = s1.values("a"), s1.steps("a")
    s2 = s1.update({"a": 3.0})
    b1 = s1.update({"a": -3.0})  # a branch from s1
    s3 = s2.update({"a": 4.0})
    assert s1.values("a").tolist() == [1.0, 2.0] and len(s1.steps("a")) == 2
    assert values.tolist() == [1.0, 2.0] and steps.tolist() == [0, 1]
    assert b1.values("a").tolist() == [1.0, 2.0, -3.0]
    assert s3.values("a").tolist() == [1.0, 2.0, 3.0, 4.0]
    for k in range(600):  # past the staging flush and a table growth
        s3 = s3.update({"a": float(k)})
        b1 = b1.update({"a": float(-k)})
    assert s2.values("a").tolist() == [1.0, 2.0, 3.0]
    assert b1.values("a")[:3].tolist() == [1.0, 2.0, -3.0]
    assert s3.count("a") == b1.count("a") + 1


# ----- pytree ------------------------------------------------------------------------
def test_the_pytree_structure_is_stable_while_the_metrics_are():
    s1 = jh.HistoryState().update({"a": 1.0, "b": 2.0})
    s2 = s1.update({"a": 3.0, "b": 4.0})
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    firsts = jax.tree.map(
        lambda x, y: np.asarray(y)[: np.size(x)] if np.ndim(y) else x, s1, s2
    )
    assert firsts.values("a").tolist() == [1.0]
    assert firsts.values("b").tolist() == [2.0]
    host = jax.device_get(s2)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host)[:-1])
    back = jax.tree.unflatten(jax.tree.structure(s2), jax.tree.leaves(s2))
    assert back.values("a").tolist() == [1.0, 3.0] and back.next_step == 2


def test_jit_traces_once_for_states_of_the_same_shapes():
    traces = []

    @jax.jit
    def total(state):
        traces.append(1)
        return sum(jnp.sum(x) for x in jax.tree.leaves(state))

    a = jh.HistoryState().update({"a": 1.0}, step=3)
    b = jh.HistoryState().update({"a": 2.0}, step=7)
    assert float(total(a)) == 3 + 1.0 + 4  # steps, values, next_step
    assert float(total(b)) == 7 + 2.0 + 8
    assert len(traces) == 1


def test_flattening_does_not_wait_for_the_device():
    @jax.jit
    def slow(x):
        return jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y), x).sum()

    x = jnp.eye(256) * 0.5
    slow(x).block_until_ready()  # compiled
    start = time.perf_counter()
    slow(x).block_until_ready()
    took = time.perf_counter() - start
    value = slow(x)  # dispatched, not computed yet
    s = jh.HistoryState().update({"slow": value, "host": 1.0})
    assert not value.is_ready(), f"the computation ({took:.2f} s) is too short"
    start = time.perf_counter()
    leaves, treedef = jax.tree.flatten(s)
    flat_took = time.perf_counter() - start
    assert flat_took < took / 4, (flat_took, took)
    back = jax.tree.unflatten(treedef, leaves)
    assert np.asarray(jax.device_get(leaves)[1]).tolist() == [float(value)]
    assert back.values("slow").tolist() == [float(value)]


# ----- the writer: bounded and never stuck --------------------------------------------
class _SlowSink:
    all_processes = True

    def __init__(self, delay: float):
        self.delay, self.count, self.most = delay, 0, 0

    def write(self, record):
        time.sleep(self.delay)
        self.count += 1

    def flush(self):
        pass

    def close(self):
        pass


def test_a_slow_writer_holds_the_training_thread_back_instead_of_queueing(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(_writer.Writer, "WAKE_AT", 8)
    monkeypatch.setattr(_writer.Writer, "MAX_PENDING", 32)
    log = jh.sinks.JsonlSink(tmp_path / "log.jsonl")
    slow = _SlowSink(0.0005)
    # sinks the writer thread writes itself
    writer = _writer.Writer(FanOut([slow, log]))
    most = 0
    for k in range(600):
        writer.add(Row(k, ("x",), (float(k),), RowKind.FLOATS, time.time()))
        most = max(most, writer.pending())
    assert most <= 32
    writer.close()
    assert slow.count == 600
    log.close()
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 600


def test_a_slow_sink_neither_holds_training_back_nor_costs_the_log_a_line(tmp_path):
    """A sink taking 2 ms a record: the log has all 12,000 lines once close
    returns, and close returns in bounded time, naming the sink it left."""
    sink = _SlowSink(0.002)
    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=path, sinks=[sink])
    start = time.monotonic()
    for k in range(12000):
        h.update({"x": float(k)}, summarize=False)
    assert time.monotonic() - start < 20  # (12000 x 2 ms would be 24 s)
    with pytest.warns(RuntimeWarning, match=r"sink _SlowSink did not finish"):
        h.close()
    assert time.monotonic() - start < 40
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(12000))
    assert 0 < sink.count < 12000
    assert h.state.count("x") == 12000


def test_a_hung_sink_cannot_stop_training_close_or_finalize(tmp_path, monkeypatch):
    monkeypatch.setattr(jh.sinks._feed.SinkFeed, "TIMEOUT", 0.5)
    release = threading.Event()

    class Hung(_SlowSink):
        def write(self, record):
            release.wait(60)

    other = _SlowSink(0)
    h = jh.History(
        distributed_history=False, report_dir=tmp_path, sinks=[Hung(0), other]
    )
    for k in range(100):
        h.update({"x": float(k)}, summarize=False)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"sink Hung \(sinks\[0\]\) did not"):
        h.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.finalize(tmp_path / "out", plot=False)
    with pytest.warns(RuntimeWarning, match=r"sink Hung \(sinks\[0\]\) did not"):
        h.close()
    assert time.monotonic() - start < 10
    assert other.count == 100  # the other sink got everything
    # the streamed log is complete: nothing had to be written again
    log = _log_path(h)
    assert jh.HistoryState.from_jsonl(log).values("x").tolist() == [
        float(k) for k in range(100)
    ]
    assert not (tmp_path / "out" / log.name).exists()
    release.set()


def test_a_sink_that_closes_the_history_from_write_does_not_deadlock(tmp_path):
    holder = {}

    class Closing(_SlowSink):
        def write(self, record):
            super().write(record)
            if record.step == 5:
                holder["h"].close()

    sink = Closing(0)
    path = tmp_path / "log.jsonl"
    h = holder["h"] = jh.History(
        distributed_history=False, jsonl_path=path, sinks=[sink]
    )
    for k in range(10):
        h.update({"x": float(k)}, summarize=False)
    h.flush()
    done = threading.Event()

    def close():
        h.close()
        done.set()

    threading.Thread(target=close, daemon=True).start()
    assert done.wait(20), "close deadlocked against a sink that closes"
    assert len(path.read_text().splitlines()) == 10
    assert sink.count >= 6


def test_a_sink_whose_flush_or_close_raises_does_not_stop_the_others(tmp_path):
    class Raising(_SlowSink):
        def flush(self):
            raise OSError("flush broke")

        def close(self):
            raise OSError("close broke")

    class Closed(_SlowSink):
        closed = False

        def close(self):
            self.closed = True

    bad, good = Raising(0), Closed(0)
    h = jh.History(distributed_history=False, sinks=[bad, good])
    h.update({"x": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.flush()
        h.close()
    texts = [str(w.message) for w in caught]
    assert any("Raising (sinks[0]): flush failed" in t and "flush broke" in t
               for t in texts)  # fmt: skip
    assert any("Raising (sinks[0]): close failed" in t and "close broke" in t
               for t in texts)  # fmt: skip
    assert good.closed and good.count == 1 and bad.count == 1


def test_a_sink_that_changes_its_record_changes_nothing_another_sink_sees(tmp_path):
    seen = []

    class Mutating(_SlowSink):
        def write(self, record):
            record.metrics["x"] = -1.0
            record.metrics["added"] = 1.0
            with contextlib.suppress(ValueError):
                record.metrics["arr"][0] = -1.0

    class Keeping(_SlowSink):
        def write(self, record):
            seen.append((dict(record.metrics), record.metrics["arr"].tolist()))

    path = tmp_path / "log.jsonl"
    h = jh.History(
        distributed_history=False, jsonl_path=path, sinks=[Mutating(0), Keeping(0)]
    )
    arr = np.array([1.0, 2.0])
    for k in range(3):
        h.update({"x": float(k), "arr": arr}, summarize=False)
    h.close()
    assert [(m["x"], "added" in m, a) for m, a in seen] == [
        (float(k), False, [1.0, 2.0]) for k in range(3)
    ]
    assert arr.tolist() == [1.0, 2.0]
    lines = [json.loads(line)["metrics"] for line in path.read_text().splitlines()]
    assert [m["x"] for m in lines] == [0.0, 1.0, 2.0]
    assert all("added" not in m for m in lines)


# ----- SIGKILL ------------------------------------------------------------------------
_LOOP = """
import os, sys, time
import jaxhistory as jh
out = sys.argv[1]
h = jh.History(distributed_history=False, report_dir=out, run_name="kill")
keys = [f"m{j}" for j in range(16)]
step = 0
while True:
    h.update({k: step + j / 16 for j, k in enumerate(keys)}, summarize=False)
    step += 1
    if step % 1000 == 0:
        tmp = os.path.join(out, "progress.tmp")
        with open(tmp, "w") as f:
            f.write(f"{step} {time.time()}")
        os.replace(tmp, os.path.join(out, "progress"))
"""


@pytest.mark.slow
def test_a_sigkill_loses_at_most_about_a_second_of_a_fast_loop(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _LOOP, str(tmp_path)], env=env)
    progress = tmp_path / "progress"
    try:
        deadline = time.monotonic() + 120
        while not progress.exists():
            assert time.monotonic() < deadline, "the loop never started"
            assert proc.poll() is None, "the loop died"
            time.sleep(0.1)
        first_step, first_time = map(float, progress.read_text().split())
        time.sleep(4)
        last_step, last_time = map(float, progress.read_text().split())
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    rate = (last_step - first_step) / (last_time - first_time)
    (log,) = tmp_path.glob("kill-*.jsonl")
    steps = []
    for line in log.read_bytes().splitlines():
        with contextlib.suppress(ValueError):  # the line the kill cut
            steps.append(json.loads(line)["step"])
    assert steps == list(range(len(steps)))  # nothing lost before the end
    lag = (last_step - steps[-1]) / rate
    assert lag <= 1.5, f"the log was {lag:.2f} s of training behind"


@pytest.mark.usefixtures("host_path")
def test_a_sink_that_attaches_cannot_deadlock_an_update_under_back_pressure(
    monkeypatch,
):
    monkeypatch.setattr(_writer.Writer, "WAKE_AT", 4)
    monkeypatch.setattr(_writer.Writer, "MAX_PENDING", 8)
    holder = {}

    class Attaching(_SlowSink):
        def write(self, record):
            time.sleep(0.0002)
            holder["h"].attach({"seen": float(record.step)})

    h = holder["h"] = jh.History(distributed_history=False, sinks=[Attaching(0)])
    done = threading.Event()

    def loop():
        for k in range(300):
            h.update({"x": float(k)}, summarize=False)
        done.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(60)
    assert done.is_set(), "update deadlocked against a sink that attaches"
    # the sink's feed may still be behind on a loaded machine: flush waits for
    # it, and close records what it attached (what a sink attaches while close
    # drains it comes after the last record)
    h.flush()
    h.close()
    assert h.state.count("x") == 300 and h.state.count("seen") > 0


def test_attach_from_another_thread_loses_nothing(tmp_path, switch_often):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    done = threading.Event()

    def attacher():
        for k in range(1000):
            h.attach({"b": float(k)}, step=10_000 + k)
        done.set()

    thread = threading.Thread(target=attacher)
    thread.start()
    k = 0
    while not done.is_set() or k < 100:
        h.update({"a": float(k)}, step=k, summarize=False)
        k += 1
    thread.join()
    h.close()
    assert h.state.values("b").tolist() == [float(k) for k in range(1000)]
    assert h.state.steps("b").tolist() == [10_000 + k for k in range(1000)]
    assert jh.HistoryState.from_jsonl(_log_path(h)).count("b") == 1000


@pytest.mark.usefixtures("host_path")
def test_non_finite_floats_on_the_fast_path_are_written_as_strings(tmp_path):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    rows = [(0.5, 1.0), (float("nan"), 2.0), (float("inf"), -float("inf")), (1.5, 3)]
    for a, b in rows:  # same names, floats: the state's fast path after the first
        h.update({"a": a, "b": b}, summarize=False)
    h.close()
    lines = _log_path(h).read_text().splitlines()
    metrics = [json.loads(line)["metrics"] for line in lines]  # strict JSON
    assert metrics == [
        {"a": 0.5, "b": 1.0},
        {"a": "NaN", "b": 2.0},
        {"a": "Infinity", "b": "-Infinity"},
        {"a": 1.5, "b": 3},
    ]
    back = jh.HistoryState.from_jsonl(_log_path(h))
    assert np.isnan(back.values("a")[1]) and back.values("b")[2] == -np.inf


def test_a_log_written_again_keeps_the_streamed_timestamps(tmp_path):
    h = jh.History(distributed_history=False, report_dir=tmp_path)
    for k in range(50):
        h.update({"x": float(k)}, summarize=False)
    h.flush()
    streamed = [json.loads(x)["timestamp"] for x in _log_path(h).read_text().split()]
    # as after a failed write: finalize writes the log again
    h._recorder.out.failed = True
    h.finalize(tmp_path / "out", plot=False)
    log = tmp_path / "out" / f"{h.run_id}.jsonl"
    again = [json.loads(x)["timestamp"] for x in log.read_text().split()]
    assert again == streamed and all(isinstance(t, float) for t in again)
    h.close()


def test_finalize_on_another_thread_while_updates_run_writes_a_snapshot(tmp_path):
    """finalize beside a running loop (from before its first update on): each
    dataset holds the steps recorded when it began, complete and in order."""
    h = jh.History(distributed_history=False, report_dir=tmp_path, keys=["loss"])
    started, stop = threading.Event(), threading.Event()
    errors = []

    def loop():
        started.set()
        k = 0
        while not stop.is_set() and k < 400_000:
            metrics = {"loss": 1.0 / (k + 1), "acc": 0.5}
            if k % 97 == 0:
                metrics["lr"] = jnp.float32(0.1)  # a device value: the slow path
            try:
                h.update(metrics, step=k, summarize=k % 50 == 0)
            except Exception as err:  # pragma: no cover - reported below
                errors.append(err)
                return
            k += 1

    thread = threading.Thread(target=loop, daemon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        thread.start()
        started.wait(10)
        sizes = []
        for i in range(3):
            ds = h.finalize(tmp_path / f"out{i}", plot=False)
            steps = ds["step"].values.tolist()
            assert steps == list(range(len(steps)))
            if steps:
                loss = ds["loss"].values
                assert np.allclose(loss, 1.0 / (np.arange(len(steps)) + 1))
            sizes.append(len(steps))
            time.sleep(0.05)
        stop.set()
        thread.join(60)
        h.close()
    assert not errors
    assert sizes == sorted(sizes), sizes


def test_finalize_loop_beside_distributed_device_updates_writes_snapshots(
    tmp_path, mesh
):
    """finalize called again and again on another thread, from before the first
    update on, while the loop records jitted per-device values (reduced across
    the 8 devices), a device scalar and a host float with log_every: every
    dataset holds a complete prefix of the steps with the values computed."""
    sharding = NamedSharding(mesh, P("data"))

    @functools.partial(jax.jit, out_shardings=(sharding, None))
    def step_fn(k):
        return jnp.arange(8.0) + k, k * 0.5  # one value per device, a scalar

    h = jh.History(
        distributed_history=True, report_dir=tmp_path, keys=["loss"], log_every=5
    )
    go, stop = threading.Event(), threading.Event()
    errors, sizes = [], []

    def finalize_loop():
        go.set()
        i = 0
        while not stop.is_set() or i < 2:
            try:
                ds = h.finalize(tmp_path / f"out{i % 2}", plot=False)
            except Exception as err:  # reported below
                errors.append(err)
                return
            steps = ds["step"].values.tolist()
            assert steps == list(range(len(steps)))
            if steps:
                mean = np.asarray(ds["loss/mean"].values, np.float64)
                np.testing.assert_allclose(mean, np.arange(len(steps)) + 3.5)
                np.testing.assert_allclose(ds["half"].values, np.arange(len(steps)) / 2)
            sizes.append(len(steps))
            i += 1

    thread = threading.Thread(target=finalize_loop, daemon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        thread.start()
        go.wait(10)
        for k in range(60):
            loss, half = step_fn(jnp.float32(k))
            h.update({"loss": loss, "half": half, "lr": 0.1})
            if k % 8 == 0:  # a bounded queue of collective steps
                jax.block_until_ready(loss)
        stop.set()
        thread.join(120)
        ds = h.finalize(tmp_path / "last", plot=False)
        h.close()
    assert not errors, errors
    assert sizes == sorted(sizes) and len(sizes) >= 2
    assert ds["step"].values.tolist() == list(range(60))


SCRIPT_WITHOUT_CLOSE = """
import sys, time
import jaxhistory as jh

class FileSink:
    def __init__(self, path):
        self.f = open(path, "w")
    def write(self, record):
        time.sleep(0.001)
        self.f.write(f"{record.step}\\n")
    def flush(self):
        self.f.flush()
    def close(self):
        self.f.write("closed\\n")
        self.f.close()

h = jh.History(distributed_history=False, sinks=[FileSink(sys.argv[1])])
for i in range(1000):
    h.update({"x": float(i)}, step=i, summarize=False)
"""


def test_a_script_that_ends_without_close_still_feeds_and_closes_its_sinks(tmp_path):
    """The sinks' threads are daemons: at exit the History's finalizer hands
    them what is queued and closes them, as History.close() would."""
    out = tmp_path / "sink.txt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(
        [sys.executable, "-c", SCRIPT_WITHOUT_CLOSE, str(out)],
        check=True,
        timeout=120,
        env=env,
    )
    lines = out.read_text().split()
    assert lines[:-1] == [str(i) for i in range(1000)]
    assert lines[-1] == "closed"


def test_sinks_are_fed_at_exit_where_no_thread_can_start_then(tmp_path):
    """Finding (Python 3.12.0 and 3.12.1, which refuse to start a thread once
    the interpreter is shutting down, atexit callbacks included): a script
    that ended without close() handed its sinks nothing, and warned "writing
    the JSONL log failed: RuntimeError("can't create new thread at
    interpreter shutdown")": the sinks' threads were started at their first
    record, which came at exit. Each sink's thread now starts with the
    History. Here an exit callback that runs before the History's refuses
    new threads the way those Pythons do."""
    out = tmp_path / "sink.txt"
    refuse = """
import atexit, threading
def _refuse(self, *a, **k):
    raise RuntimeError("can't create new thread at interpreter shutdown")
atexit.register(lambda: setattr(threading.Thread, "start", _refuse))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT_WITHOUT_CLOSE + refuse, str(out)],
        timeout=120,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed" not in done.stderr, done.stderr[-3000:]
    lines = out.read_text().split()
    assert lines[:-1] == [str(i) for i in range(1000)]
    assert lines[-1] == "closed"


def test_a_dropped_history_ends_its_sinks_threads():
    class Sink:
        closed = False

        def write(self, record):
            pass

        def flush(self):
            pass

        def close(self):
            self.closed = True

    sinks = [Sink() for _ in range(3)]
    for sink in sinks:
        h = jh.History(distributed_history=False, sinks=[sink])
        h.update({"x": 1.0}, summarize=False)
        del h
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [t for t in threading.enumerate() if t.name == "jaxhistory-sink-Sink"]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive
    assert all(sink.closed for sink in sinks)


_CTRL_C_ANYWHERE = """
import signal, sys, time
import jaxhistory as jh

h = jh.History(distributed_history=False, jsonl_path=sys.argv[1])
deadline = time.monotonic() + 1.5
inside = [False]  # interrupts only around the update (the loop's own code
# outside the try would let them escape)


def interrupt(signum, frame):
    # one interrupt per update at most: a second one landing in the except
    # clause below would escape the loop (the script's fault, not History's)
    if inside[0]:
        inside[0] = False
        raise KeyboardInterrupt


signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0003)
hits = n = 0
while time.monotonic() < deadline:
    try:
        inside[0] = True
        n += 1
        h.update({"a": float(n), "b": 0.5}, summarize=n % 3 == 0)
        inside[0] = False
    except (KeyboardInterrupt, RuntimeError) as err:
        # (RuntimeError: one landing inside threading's own Condition.wait
        # as the log's thread starts, where CPython then releases an unlocked
        # lock; the update is interrupted all the same)
        inside[0] = False
        if type(err) is RuntimeError and "unlocked lock" not in str(err):
            raise
        hits += 1
signal.setitimer(signal.ITIMER_REAL, 0, 0)
h.close()
print(hits, h.state.count("a"), int(h._recorder.out.failed))
"""


@pytest.mark.parametrize("pure", ["0", "1"])
def test_a_ctrl_c_anywhere_in_update_never_leaves_a_short_log_unmarked(tmp_path, pure):
    """Ctrl-C may land at any point of an update, also just after its row went
    into the history and before its line was queued. Wherever the log then
    lacks a recorded row, it is marked failed (finalize writes it again from
    the history): random interrupts in a process of its own, thousands of
    updates, compiled and as Python alone."""
    log = tmp_path / "m.jsonl"
    finished, unfinished = 0, []
    for _ in range(3):
        # (timeout: a Ctrl-C that left a lock held hung the close at the end)
        out = subprocess.run(
            [sys.executable, "-c", _CTRL_C_ANYWHERE, str(log)],
            env=dict(os.environ, JAXHISTORY_PURE_PYTHON=pure),
            capture_output=True,
            text=True,
            timeout=60,
        )
        counts = out.stdout.split()
        if len(counts) != 3:  # an interrupt the script itself did not catch
            unfinished.append(out.stderr[-600:])
            continue
        finished += 1
        hits, recorded, failed = map(int, counts)
        lines = len(log.read_bytes().splitlines())
        assert hits > 10 and recorded > 100
        assert lines <= recorded
        assert failed or lines == recorded, (lines, recorded)
        log.unlink()
    assert finished >= 2, unfinished
