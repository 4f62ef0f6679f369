"""Device scalars sent to the host in stacked transfers (jaxhistory._host_copies).

On CPU devices History starts no copies (their buffers are host memory), so
these tests make History treat the CPU devices as an accelerator's, the path
every GPU and TPU run takes.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import _appending, _host_copies
from jaxhistory._host_copies import HostCopies, host_copies, to_host


@pytest.fixture
def as_accelerator(monkeypatch):
    """History starts copies to the host as it does on an accelerator."""
    monkeypatch.setattr(_appending, "needs_host_copy", lambda arrays: True)
    host_copies.send()  # nothing left over from another test


def _mesh():
    return jax.make_mesh((jax.device_count(),), ("data",))


@jax.jit
def _step(x, i):
    total = jnp.sum(x)
    metrics = {f"m{k}": total * (k + 1) + i for k in range(8)}
    metrics["count"] = jnp.int32(3) * i.astype(jnp.int32)
    metrics["half"] = (total / 7 + i).astype(jnp.bfloat16)
    return metrics


def _log_lines(tmp_path):
    (path,) = tmp_path.rglob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_values_are_exact_in_the_state_the_log_and_the_summary(
    as_accelerator, tmp_path
):
    x = jax.device_put(
        jnp.arange(64, dtype=jnp.float32), NamedSharding(_mesh(), P("data"))
    )
    steps = 150
    outs = [_step(x, jnp.float32(i)) for i in range(8)]
    jax.block_until_ready(outs)
    programs = host_copies.programs
    history = jh.History(distributed_history=False, report_dir=tmp_path)
    lines = {}
    for i in range(steps):
        m = _step(x, jnp.float32(i))
        line = history.update(m, summarize=i % 40 == 0)
        if line:
            lines[i] = line
        if i % 8 == 7:
            jax.block_until_ready(m)
    history.flush()
    state = history.state
    total = np.float32(np.arange(64, dtype=np.float32).sum())
    for k in range(8):
        want = total * np.float32(k + 1) + np.arange(steps, dtype=np.float32)
        np.testing.assert_array_equal(state.values(f"m{k}"), want)
    np.testing.assert_array_equal(state.values("count"), np.arange(steps) * 3)
    half = (total / np.float32(7) + np.arange(steps, dtype=np.float32)).astype(
        jnp.bfloat16
    )
    np.testing.assert_array_equal(state.values("half"), half.astype(np.float64))
    # the summary line of step 40 and the log line of step 77
    assert f"m1={float(total * 2 + 40):.6f}" in lines[40], lines
    assert "count=120" in lines[40], lines
    record = _log_lines(tmp_path)[77]
    assert record["step"] == 77
    assert record["metrics"]["m7"] == float(total * 8 + 77)
    assert record["metrics"]["count"] == 231
    # 1,500 scalars of three dtypes: a stacked program per 64 of one dtype
    # (1,200 float32, 150 int32, 150 bfloat16: 22 of them), and one per dtype
    # where a read could not wait (the summary lines, the log's writer);
    # fewer programs than updates, never one per value
    launched = host_copies.programs - programs
    assert 22 <= launched < steps, launched
    history.close()
    del history, state, m, outs
    gc.collect()
    assert host_copies.waiting() == 0
    assert host_copies.remembered() == 0  # forgotten with the arrays


def test_scalars_go_in_one_program_per_device_from_one_copy_each(as_accelerator):
    devices = jax.devices()
    a = jax.device_put(jnp.float32(1.5), devices[0])
    b = jax.device_put(jnp.float32(2.5), devices[1])
    c = jax.device_put(jnp.float32(4.0), NamedSharding(_mesh(), P()))
    copies = HostCopies()
    copies.stage([a, b, c])
    assert copies.waiting() == 3
    copies.send()
    # a replicated scalar goes through its copy on this process's first device
    assert copies.programs == 2
    stacked = {id(sent) for sent, _, _ in copies._sent.values()}
    assert len(stacked) == 2
    for value, want in ((a, 1.5), (b, 2.5), (c, 4.0)):
        host = copies.read(value)
        assert host.shape == () and host.dtype == np.float32 and host == want


def test_arrays_that_are_not_scalars_start_their_own_copy(as_accelerator):
    copies = HostCopies()
    vector = jnp.arange(3.0)
    per_device = jax.device_put(jnp.arange(8.0), NamedSharding(_mesh(), P("data")))
    strings = np.asarray(1.0)  # not a JAX array
    copies.stage([vector, per_device, strings])
    assert copies.waiting() == 0 and copies.read(vector) is None
    np.testing.assert_array_equal(to_host(vector), [0.0, 1.0, 2.0])
    assert to_host(2.5) == 2.5 and to_host(strings) == 1.0


def test_scalars_of_one_kind_go_in_programs_of_send_at(as_accelerator):
    copies = HostCopies()
    values = [jnp.float32(i) + 0.5 for i in range(300)]
    copies.stage(values)
    assert copies.programs == 4 and copies.waiting() == 44  # 4 x 64 sent
    copies.send()
    assert copies.programs == 5  # the 44 left (padded to 64)
    copies.SEND_AT = 1000  # (read at each send)
    more = [jnp.float32(i) for i in range(150)]
    copies.stage(more)
    assert copies.waiting() == 150
    copies.send()
    assert copies.programs == 6 and float(copies.read(more[-1])) == 149.0
    assert [float(copies.read(v)) for v in values] == [i + 0.5 for i in range(300)]


def test_a_value_read_while_it_waits_is_sent_with_the_others(as_accelerator):
    copies = HostCopies()
    values = [jnp.int32(i) * 2 for i in range(5)]
    copies.stage(values)
    assert copies.read(values[3]) == 6  # sends all five in one program
    assert copies.programs == 1 and copies.waiting() == 0
    assert [int(copies.read(v)) for v in values] == [0, 2, 4, 6, 8]
    assert copies.read(jnp.int32(6)) is None  # never staged


def test_a_value_deleted_before_it_is_sent_is_lost_alone(as_accelerator):
    history = jh.History(distributed_history=False)
    kept, gone = jnp.float32(1.25) + 0, jnp.float32(7.0) + 0
    history.update({"kept": kept, "gone": gone}, step=0, summarize=False)
    assert host_copies.waiting() >= 2
    gone.delete()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history.flush()
        kept_values = history.state.values("kept").tolist()
        gone_values = history.state.values("gone")
    assert kept_values == [1.25]
    assert np.isnan(gone_values[0])
    assert any("could not be read" in str(w.message) for w in caught), caught
    history.close()


def test_a_value_deleted_after_it_was_sent_is_still_recorded(as_accelerator):
    history = jh.History(distributed_history=False)
    value = jnp.float32(3.5) + 0
    history.update({"v": value, "w": value * 2}, step=0, summarize=False)
    host_copies.send()
    value.delete()
    history.flush()
    assert history.state.values("v").tolist() == [3.5]
    assert history.state.values("w").tolist() == [7.0]
    history.close()


def test_where_the_stacking_fails_each_copy_starts_alone(as_accelerator, monkeypatch):
    def refuse(*values):
        raise RuntimeError("no")

    monkeypatch.setattr(_host_copies, "_stack", refuse)
    copies = HostCopies()
    values = [jnp.float32(i) + 1 for i in range(4)]
    copies.stage(values)
    copies.send()
    assert copies.programs == 0 and copies.waiting() == 0
    assert copies.read(values[0]) is None
    assert [float(to_host(v)) for v in values] == [1.0, 2.0, 3.0, 4.0]


def test_histories_on_several_threads_record_exact_values(as_accelerator):
    def run(offset: int, out: dict):
        history = jh.History(distributed_history=False)
        for i in range(120):
            value = jnp.float32(offset + i)
            history.update({"a": value, "b": value * 2}, step=i, summarize=False)
        history.flush()
        out[offset] = (history.state.values("a"), history.state.values("b"))
        history.close()

    results: dict = {}
    threads = [threading.Thread(target=run, args=(1000 * k, results)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1000, 2000, 3000]
    for offset, (a, b) in results.items():
        np.testing.assert_array_equal(a, offset + np.arange(120.0))
        np.testing.assert_array_equal(b, 2 * (offset + np.arange(120.0)))


def test_sentinels_read_sent_values(as_accelerator):
    from jaxhistory.sentinels import NonFinite

    history = jh.History(
        distributed_history=False, sentinels=[NonFinite(action="warn")]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            loss = jnp.float32(jnp.nan if i == 11 else i)
            history.update({"loss": loss, "lr": jnp.float32(0.1)}, step=i)
        history.flush()
    fired = [w for w in caught if "loss" in str(w.message) and "11" in str(w.message)]
    assert fired, [str(w.message) for w in caught]
    history.close()


@pytest.mark.slow
def test_replicated_scalars_of_several_processes_go_through_local_copies():
    """Global replicated scalars (on every process's devices) are stacked from
    each process's own copy: no program spans the processes, and every
    process records the exact values."""
    steps = 40
    results = jh.launch_local(
        "mp_workers:stacked_copies_run", 2, 2, args=(steps,), timeout=240
    )
    for r in results:
        assert r["fully_addressable"] is False  # the values span the processes
        assert 6 <= r["programs"] < steps, r["programs"]
        total = np.float32(r["total"])
        for j in range(10):
            want = total * np.float32(j + 1) + np.arange(steps, dtype=np.float32)
            np.testing.assert_array_equal(r["records"][f"m{j}"], want)
        assert r["lines"][1].startswith("step=10 ")
        assert f"m1={float(total * 2 + 10):.6f}" in r["lines"][1], r["lines"]


def test_the_variable_turns_stacked_transfers_off(monkeypatch, as_accelerator):
    monkeypatch.setenv(HostCopies.OFF, "1")
    copies = HostCopies()
    values = [jnp.float32(i) for i in range(70)]
    copies.stage(values)
    assert copies.waiting() == 0 and copies.programs == 0
    assert copies.read(values[0]) is None
    assert float(to_host(values[69])) == 69.0


def test_a_bad_value_of_the_variable_warns_naming_it(monkeypatch):
    monkeypatch.setenv(HostCopies.OFF, "maybe")
    with pytest.warns(RuntimeWarning, match="JAXHISTORY_NO_STACKED_COPIES='maybe'"):
        copies = HostCopies()
    assert copies.enabled


def test_a_state_and_the_finalized_dataset_hold_the_sent_values(
    as_accelerator, tmp_path
):
    """HistoryState used on its own, and History.finalize, read the scalars
    from their stacked transfers."""
    state = jh.HistoryState()
    for i in range(100):
        state = state.update({"a": jnp.float32(i) * 0.5, "n": jnp.int32(i)}, step=i)
    assert host_copies.waiting() > 0  # fewer than 64 of each kind: still waiting
    np.testing.assert_array_equal(state.values("a"), np.arange(100) * 0.5)
    np.testing.assert_array_equal(state.values("n"), np.arange(100))
    assert host_copies.waiting() == 0

    history = jh.History(distributed_history=False)
    for i in range(30):
        history.update({"loss": jnp.float32(i) + 0.25}, step=i, summarize=False)
    ds = history.finalize(tmp_path, plot=False)
    np.testing.assert_array_equal(ds["loss"].values, np.arange(30) + 0.25)


def test_a_history_freed_by_the_garbage_collector_mid_stage_does_not_hang(tmp_path):
    """A History dropped without close() is freed by the garbage collector,
    whose finalizer closes its log; when that happens while this thread
    stages values (holding the lock), every reader goes alone, nothing
    waits for the lock, and nothing hangs."""
    script = tmp_path / "gc_mid_stage.py"
    script.write_text(
        textwrap.dedent(
            """
            import faulthandler, gc, sys, tempfile
            import jax.numpy as jnp
            import jaxhistory as jh
            from jaxhistory import _appending, _host_copies
            _appending.needs_host_copy = lambda arrays: True
            faulthandler.dump_traceback_later(40, exit=True)
            old = jh.History(distributed_history=False, report_dir=tempfile.mkdtemp())
            for i in range(3):
                old.update({"loss": jnp.float32(i) + 0}, step=i, summarize=False)
            del old  # in a reference cycle: freed by the next collection
            local = _host_copies._local
            def collect_then_local(value):  # a collection at an allocation here
                gc.collect()
                return local(value)
            _host_copies._local = collect_then_local
            gc.disable()
            new = jh.History(distributed_history=False)
            new.update({"x": jnp.float32(1) + 0}, step=0, summarize=False)
            print("recorded", new.state.values("x").tolist())
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "recorded [1.0]" in proc.stdout, proc.stdout


def test_a_scalar_of_partial_sums_is_never_read_from_one_device(as_accelerator):
    """A scalar held as different partial sums on its devices is not stacked
    from one device's copy: it is read as a whole (here: NaN and a warning,
    as JAX cannot read it), never recorded as one device's part."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
        total = jax.jit(
            lambda x: jnp.einsum("i->", x, out_sharding=P(unreduced={"d"}))
        )(x)
    copies = HostCopies()
    copies.stage([total])
    assert copies.waiting() == 0  # its own copy started, not stacked
    history = jh.History(distributed_history=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history.update({"total": total}, step=0, summarize=False)
        recorded = history.state.values("total")
    assert recorded.tolist() != [0.0] and np.isnan(recorded[0]), recorded
    assert any("could not be read" in str(w.message) for w in caught), caught
    history.close()


def test_scalars_are_stacked_under_a_users_mesh(as_accelerator):
    """Under jax.set_mesh (Explicit axes), jit refuses single-device inputs:
    the stacking program runs under a mesh of its own device."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    copies = HostCopies()
    with jax.set_mesh(mesh):
        values = [jax.jit(lambda x, k=k: jnp.sum(x) * k)(x) for k in range(5)]
        copies.stage(values)
        copies.send()
    assert copies.programs == 1
    assert [float(copies.read(v)) for v in values] == [0.0, 28.0, 56.0, 84.0, 112.0]


def test_a_value_that_fails_does_not_spoil_the_others_in_its_stack(as_accelerator):
    """A value whose computation fails on the device goes in one stack with
    other histories' values: each of them is then read alone, exactly."""

    def boom(x):
        raise ValueError("boom")

    @jax.jit
    def slow(x):  # so that the failure comes after the launch returns
        return jax.lax.fori_loop(0, 40, lambda i, a: jnp.tanh(a @ a), x).sum()

    @jax.jit
    def bad(s):
        return jax.pure_callback(boom, jax.ShapeDtypeStruct((), jnp.float32), s)

    big = jnp.ones((1024, 1024), jnp.float32) * 1e-3
    slow(big).block_until_ready()
    good = jh.History(distributed_history=False)
    for i in range(3):
        good.update({"loss": jnp.float32(i) + 0.5}, step=i, summarize=False)
    host_copies.stage([bad(slow(big))])  # fails later, on the device
    line = good.update({"loss": jnp.float32(3) + 0.5}, step=3)
    assert line == "step=3 loss=3.500000"
    assert good.state.values("loss").tolist() == [0.5, 1.5, 2.5, 3.5]
    good.close()
    # JAX keeps the failed callback's error for its exit handlers, which
    # print it (a "ValueError: boom" traceback after the suite's result):
    # it is taken here, where it is expected.
    with pytest.raises(Exception, match="boom"):
        jax.effects_barrier()
    from jax._src import dispatch  # (the barrier raised before clearing)

    dispatch.runtime_tokens.clear()
    jax.effects_barrier()


def test_weak_and_strong_scalars_go_in_programs_of_their_own(as_accelerator):
    """A weak-typed scalar (a schedule computed from Python numbers) and a
    strong one would compile a stacking program per mix: they go apart."""
    copies = HostCopies()
    strong = [jnp.float32(i) + 0 for i in range(40)]
    weak = [jnp.asarray(0.5) * i for i in range(40)]
    assert weak[0].weak_type and not strong[0].weak_type
    before = _host_copies._stack._cache_size()
    rng = np.random.default_rng(0)
    for order in range(6):  # staged in different mixes each time
        mixed = list(zip(strong, weak, strict=True))
        rng.shuffle(mixed)
        copies.stage([v for pair in mixed for v in pair][: 10 + 10 * order])
        copies.send()
    assert _host_copies._stack._cache_size() - before <= 2 * len(_host_copies._BUCKETS)
    assert float(copies.read(weak[7])) == 3.5 and float(copies.read(strong[7])) == 7.0


def test_close_sends_what_still_waits(as_accelerator):
    history = jh.History(distributed_history=False)
    history.update({"a": jnp.float32(2.0) + 0}, step=0, summarize=False)
    assert host_copies.waiting() >= 1
    history.close()
    assert host_copies.waiting() == 0


def test_sentinels_survive_a_deleted_value():
    """A recorded device value deleted (donated) before the sentinels read it
    is reported, not read: asking whether it is ready would crash."""
    from jaxhistory.sentinels import NonFinite

    history = jh.History(
        distributed_history=False, sentinels=[NonFinite("loss", action="warn")]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            loss = jnp.float32(jnp.nan if i == 5 else i) + 0
            buf = jnp.arange(4.0) + i
            history.update({"loss": loss, "buf": buf}, step=i, summarize=False)
            buf.delete()
        history.flush()
    messages = [str(w.message) for w in caught]
    assert any("step 5: 'loss' is NaN" in m for m in messages), messages
    history.close()
