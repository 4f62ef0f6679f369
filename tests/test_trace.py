"""Chrome traces and StopWatch."""

import contextlib
import gzip
import json
import logging
import os
import random
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
from test_export import _cli as run_cli  # the command in a fresh process

import jaxhistory as jh
from jaxhistory import trace

REQUIRED = {
    "X": {"name", "ph", "ts", "dur", "pid", "tid"},
    "C": {"name", "ph", "ts", "pid", "args"},
    "i": {"name", "ph", "ts", "pid", "tid", "s"},
    "M": {"name", "ph", "pid", "args"},
}


def check_valid(events):
    """Every event has its required fields, times are numbers, X events nest."""
    for e in events:
        assert REQUIRED[e["ph"]] <= set(e), e
        if "ts" in e:
            assert isinstance(e["ts"], int | float) and np.isfinite(e["ts"])
    spans = {}
    for e in events:
        if e["ph"] == "X":
            spans.setdefault((e["pid"], e["tid"]), []).append(
                (e["ts"], e["ts"] + e["dur"])
            )
    for intervals in spans.values():
        stack = []
        for start, end in sorted(intervals, key=lambda se: (se[0], -se[1])):
            while stack and stack[-1] <= start + 1e-3:
                stack.pop()
            if stack:
                assert end <= stack[-1] + 1e-3, "X events overlap without nesting"
            stack.append(end)
    json.dumps(events, allow_nan=False)  # strict JSON: loads in Perfetto


def record_some(handler, history=None):
    with jh.StopWatch("outer"):
        with jh.StopWatch("inner"):
            time.sleep(0.001)
        with jh.StopWatch("inner 2"):
            pass
    worker = threading.Thread(target=lambda: jh.StopWatch("on a thread")(lambda: 1)())
    worker.start()
    worker.join()
    handler.instant("checkpoint", {"path": "/x", "loss": float("nan")})
    handler.counter("queue", {"depth": 3, "bad": float("inf")})
    if history is not None:
        for i in range(3):
            history.update(
                {"loss": 1.0 / (i + 1), "nan": float("nan")}, summarize=False
            )
        history.flush()


# ----- the handler ------------------------------------------------------------------
def test_a_trace_has_every_event_kind_valid_and_nested(tmp_path):
    h = jh.History(distributed_history=False)
    with trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t:
        record_some(t, h)
    events = trace.load_trace(t.paths[0])
    check_valid(events)
    assert t.paths[0].name == "ep0-ba0-rank0.json"
    kinds = {(e["ph"], e["name"]) for e in events}
    assert {
        ("X", "outer"),
        ("X", "inner"),
        ("X", "on a thread"),
        ("i", "checkpoint"),
    } <= kinds
    assert {("M", "process_name"), ("M", "thread_name"), ("M", "clock_sync")} <= kinds
    loss = [e for e in events if e["ph"] == "C" and e["name"] == "loss"]
    assert [e["args"]["loss"] for e in loss] == [1.0, 0.5, 1.0 / 3]
    assert not [e for e in events if e["ph"] == "C" and e["name"] == "nan"]
    queue = next(e for e in events if e["name"] == "queue")
    assert queue["args"] == {"depth": 3.0}  # the infinite series is left out
    ckpt = next(e for e in events if e["name"] == "checkpoint")
    assert ckpt["args"] == {"path": "/x", "loss": "NaN"}
    threads = {e["tid"] for e in events if e["ph"] == "X"}
    assert len(threads) == 2 and all(e["pid"] == 0 for e in events)


def test_traces_are_only_written_while_a_handler_is_active(tmp_path):
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    with jh.StopWatch("before"):
        pass
    t.start()
    with jh.StopWatch("during"):
        pass
    t.close()
    with jh.StopWatch("after"):
        pass
    names = {e["name"] for e in trace.load_trace(t.paths[0]) if e["ph"] == "X"}
    assert names == {"during"}


def test_format_variables_and_unknown_ones(tmp_path):
    t = trace.JSONTraceHandler(
        folder=str(tmp_path / "{run_name}" / "w{world_size}"),
        filename="s{step}-e{epoch}-b{batch}-r{rank}-l{local_rank}-n{node_rank}.json",
        run_name="demo",
        merged_trace_filename="node{node_rank}.json",
    )
    with t:
        t.rotate(step=5, epoch=1)
        t.instant("in the second file")
    assert [p.name for p in t.paths] == [
        "s0-e0-b0-r0-l0-n0.json",
        "s5-e1-b0-r0-l0-n0.json",
    ]
    assert t.paths[0].parent == tmp_path / "demo" / "w1"
    assert t.merged_path.name == "node0.json"
    with pytest.raises(ValueError, match=r"unknown variable \{epochs\}"):
        trace.JSONTraceHandler(filename="ep{epochs}.json")
    with pytest.raises(ValueError, match=r"unknown variable \{step\}"):
        trace.JSONTraceHandler(folder="{step}")
    with pytest.raises(ValueError, match="num_traces_to_keep"):
        trace.JSONTraceHandler(num_traces_to_keep=-2)


def test_overwrite_false_refuses_a_non_empty_folder_but_ignores_hidden_files(tmp_path):
    (tmp_path / ".cache").write_text("x")
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    with t:
        pass  # only a hidden file there: fine
    with pytest.raises(FileExistsError, match="not empty"):
        trace.JSONTraceHandler(folder=str(tmp_path)).start()
    with trace.JSONTraceHandler(folder=str(tmp_path), overwrite=True) as again:
        pass
    assert again.paths[0].is_file()
    assert trace._trace_state.active() is None


def test_rotation_keeps_the_newest_files_of_this_process_only(tmp_path):
    other = tmp_path / "ep0-ba0-rank1.json"  # another process's file
    t = trace.JSONTraceHandler(
        folder=str(tmp_path),
        num_traces_to_keep=2,
        overwrite=True,
        merged_trace_filename=None,
    )
    with t:
        other.write_text("[]")  # written after the start barrier, as it would be
        for batch in range(1, 5):
            with jh.StopWatch(f"b{batch}"):
                pass
            t.rotate(batch=batch)
        t.instant("in the last file")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ep0-ba0-rank1.json", "ep0-ba3-rank0.json", "ep0-ba4-rank0.json"]
    assert [p.name for p in t.paths] == ["ep0-ba3-rank0.json", "ep0-ba4-rank0.json"]
    with pytest.raises(RuntimeError, match="not started"):
        t.rotate(batch=9)


def test_a_folder_swapped_for_a_link_mid_run_is_never_written_or_deleted_through(
    tmp_path,
):
    """Finding: the trace folder moved away and a link to another folder put
    in its place: rotating deleted that folder's ep0-ba0-rank0.json (a file
    the handler never made) and wrote its next file and the merged trace
    there."""
    real, victim = tmp_path / "traces", tmp_path / "victim"
    victim.mkdir()
    (victim / "ep0-ba0-rank0.json").write_text("mine")
    t = trace.JSONTraceHandler(folder=str(real), num_traces_to_keep=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with t:
            with jh.StopWatch("a"):
                pass
            real.rename(tmp_path / "moved")
            real.symlink_to(victim)
            t.rotate(batch=1)
            t.rotate(batch=2)
    assert sorted(p.name for p in victim.iterdir()) == ["ep0-ba0-rank0.json"]
    assert (victim / "ep0-ba0-rank0.json").read_text() == "mine"
    texts = [str(w.message) for w in caught]
    assert any("symbolic link put in place of the folder" in x for x in texts), texts
    # the handler's own first file, moved with its folder, is intact
    assert (tmp_path / "moved" / "ep0-ba0-rank0.json").is_file()


def test_a_trace_cut_at_any_byte_still_loads(tmp_path):
    with trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t:
        record_some(t, jh.History(distributed_history=False))
    data = t.paths[0].read_bytes()
    full = trace.load_trace(t.paths[0])
    rng = random.Random(0)
    cut_file = tmp_path / "cut.json"
    for cut in [1, 2, len(data) - 1, len(data) - 3, *rng.sample(range(len(data)), 40)]:
        cut_file.write_bytes(data[:cut])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            events = trace.load_trace(cut_file)
        assert events == full[: len(events)]  # a prefix of the events, never garbage
        check_valid(events)
        # an event cut in half is said, with what was kept (one event a line)
        said = [str(w.message) for w in caught]
        tail = data[:cut].rsplit(b"\n", 1)[-1].strip()
        if tail.startswith(b"{") and not tail.rstrip(b",").endswith(b"}"):
            assert said, cut
        for text in said:
            assert "cut off or damaged" in text
            assert f"the {len(events)} complete event(s) before it are kept" in text


def test_load_trace_forms(tmp_path):
    events = [{"name": "a", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 0, "tid": 1}]
    (tmp_path / "obj.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "comma.json").write_text("[" + json.dumps(events[0]) + ",\n")
    (tmp_path / "gz.json.gz").write_bytes(gzip.compress(json.dumps(events).encode()))
    for name in ("obj.json", "comma.json", "gz.json.gz"):
        assert trace.load_trace(tmp_path / name) == events
    (tmp_path / "bad.json").write_text("not a trace")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        trace.load_trace(tmp_path / "bad.json")


def test_a_process_killed_mid_run_leaves_a_loadable_file(tmp_path):
    code = f"""
import os, time, jaxhistory as jh
from jaxhistory import trace
t = trace.JSONTraceHandler(folder={str(tmp_path)!r}, merged_trace_filename=None)
t.start()
for i in range(50):
    with jh.StopWatch(f"span {{i}}"):
        pass
time.sleep(1.2)  # past the flush interval
t.instant("last")
os.kill(os.getpid(), 9)
"""
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, check=False)
    assert proc.returncode == -9
    events = trace.load_trace(tmp_path / "ep0-ba0-rank0.json")
    assert len([e for e in events if e["ph"] == "X"]) == 50
    check_valid(events)


# ----- merging -----------------------------------------------------------------------
def _fake_process(tmp_path, pid, sync_ts, sync_id, wall=1000.0):
    events = [
        {
            "name": "clock_sync",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {
                "sync_ts": sync_ts,
                "sync_wall": wall,
                "sync_id": sync_id,
                "process_index": pid,
            },
        },
        {
            "name": "process_name",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"name": f"p{pid}"},
        },
        {
            "name": "work",
            "ph": "X",
            "ts": sync_ts + 100.0,
            "dur": 10.0,
            "pid": pid,
            "tid": 1,
        },
    ]
    path = tmp_path / f"p{pid}-{sync_id}.json"
    path.write_text(json.dumps(events))
    return path


def test_merge_aligns_processes_at_their_sync_and_keeps_one_pid_each(tmp_path):
    a = _fake_process(tmp_path, 0, sync_ts=5_000.0, sync_id=7)
    b = _fake_process(tmp_path, 1, sync_ts=9_000_000.0, sync_id=7)  # another clock
    out = trace.merge_traces([a, b], tmp_path / "merged.json")
    events = trace.load_trace(out)
    work = {e["pid"]: e["ts"] for e in events if e["name"] == "work"}
    assert work == {0: 100.0, 1: 100.0}  # both 100 µs after the shared barrier
    # Re-merging the merged file with itself changes nothing but duplicates nothing.
    again = trace.load_trace(trace.merge_traces([out], tmp_path / "again.json"))
    assert sorted((e["pid"], e["ts"]) for e in again if e["name"] == "work") == [
        (0, 100.0),
        (1, 100.0),
    ]
    # A second run whose process 0 has the same pid gets a pid of its own, placed
    # by wall clock (2 s later).
    c = _fake_process(tmp_path, 0, sync_ts=1.0, sync_id=8, wall=1002.0)
    merged = trace.load_trace(trace.merge_traces([out, c], tmp_path / "three.json"))
    work = sorted((e["pid"], e["ts"]) for e in merged if e["name"] == "work")
    assert work == [(0, 100.0), (1, 100.0), (2, 2_000_100.0)]
    with pytest.raises(ValueError, match="at least one"):
        trace.merge_traces([], tmp_path / "none.json")


def test_merge_traces_command(tmp_path):
    a = _fake_process(tmp_path, 0, 0.0, 1)
    b = _fake_process(tmp_path, 1, 0.0, 1)
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "jaxhistory", "merge-traces", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    ok = run(a, b, "-o", tmp_path / "m.json.gz")
    assert ok.returncode == 0, ok.stderr
    assert {e["pid"] for e in trace.load_trace(tmp_path / "m.json.gz")} == {0, 1}
    missing = run(tmp_path / "nope.json", "-o", tmp_path / "x.json")
    assert missing.returncode == 2 and "no trace file" in missing.stderr


@pytest.mark.slow
def test_two_processes_trace_sync_and_merge_with_distinct_pids(tmp_path):
    results = jh.launch_local(
        "mp_workers:trace_run", 2, 1, args=(str(tmp_path),), timeout=240
    )
    assert [r["vars"] for r in results] == [
        {"rank": 0, "local_rank": 0, "world_size": 2},
        {"rank": 1, "local_rank": 1, "world_size": 2},
    ]
    merged = results[0]["merged"]
    assert merged is not None and results[1]["merged"] is None  # local rank 0 only
    events = trace.load_trace(merged)
    check_valid(events)
    assert {e["pid"] for e in events} == {0, 1}
    for pid in (0, 1):
        spans = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        assert [e["name"] for e in spans] == ["step 0", "step 1", "step 2"]
        counters = [e for e in events if e["pid"] == pid and e["ph"] == "C"]
        assert [e["args"]["loss"] for e in counters] == [1.0, 0.5, 1.0 / 3]
    syncs = [e for e in events if e["name"] == "clock_sync"]
    assert len(syncs) == 2 and len({e["args"]["sync_id"] for e in syncs}) == 1
    # Both processes started together at the barrier: their first spans start
    # within a fraction of a second of each other on the merged clock.
    first = [
        min(e["ts"] for e in events if e["pid"] == p and e["ph"] == "X") for p in (0, 1)
    ]
    assert abs(first[0] - first[1]) < 500_000


# ----- StopWatch ---------------------------------------------------------------------
def test_stopwatch_logs_its_message_with_control_characters_escaped(caplog):
    # "m\x1b[31mx\ny" was logged raw: a colour escape and a second line
    with (
        caplog.at_level(logging.INFO, logger="jaxhistory"),
        jh.StopWatch("m\x1b[31mx\ny"),
    ):
        pass
    (message,) = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert message.startswith("m\\x1b[31mx\\x0ay took ")
    assert "\x1b" not in message and "\n" not in message


def test_stopwatch_logs_records_and_annotates(caplog):
    h = jh.History(distributed_history=False)
    with (
        caplog.at_level(logging.INFO, logger="jaxhistory"),
        mock.patch.object(
            jax.profiler, "TraceAnnotation", wraps=jax.profiler.TraceAnnotation
        ) as ann,
        jh.StopWatch("forward pass", history=h) as sw,
    ):
        time.sleep(0.002)
    assert ann.call_args.args == ("forward pass",)
    assert sw.seconds >= 0.002
    assert f"forward pass took {sw.seconds:.3f} seconds" in caplog.text
    # Attached to the next update's step: training still starts at step 0.
    h.update({"loss": 1.0})
    assert h.state.steps("timing/forward_pass").tolist() == [0]
    assert h.state.steps("loss").tolist() == [0]
    with jh.StopWatch("forward pass", history=h):
        pass
    h.update({"loss": 0.5})
    assert h.state.steps("timing/forward_pass").tolist() == [0, 1]
    assert h.state.next_step == 2  # the step counter follows the updates only
    with jh.StopWatch("x", wbtag="timing/fwd", history=h, step=20):
        pass
    h.flush()  # values with a step of their own: at the next update or flush
    assert h.state.steps("timing/fwd").tolist() == [20]
    assert h.state.next_step == 21


def test_a_decorator_and_a_block_record_the_same_name():
    h = jh.History(distributed_history=False)
    watch = jh.StopWatch("m", wbtag="timing/timing/x", history=h)
    with watch:
        pass
    h.update({"loss": 1.0})
    watch(lambda: None)()
    h.update({"loss": 0.5})
    assert h.state.steps("timing/timing/x").tolist() == [0, 1]


def test_timings_between_two_updates_keep_the_later_value_and_no_step_is_skipped():
    h = jh.History(distributed_history=False)

    @jh.StopWatch("load", history=h)
    def load(seconds):
        time.sleep(seconds)

    h.update({"loss": 1.0})
    load(0.001)
    load(0.02)
    h.update({"loss": 0.5})
    assert h.state.steps("loss").tolist() == [0, 1]
    assert h.state.steps("timing/load").tolist() == [1]
    assert h.state.values("timing/load")[0] >= 0.02
    load(0.001)  # nothing follows: recorded at finalize/close, at next_step
    h.close()
    assert h.state.steps("timing/load").tolist() == [1, 2]


def test_one_stopwatch_nested_in_itself_and_on_threads():
    watch = jh.StopWatch("reused")
    with watch:
        time.sleep(0.03)
        with watch:
            time.sleep(0.01)
        inner = watch.seconds
    assert 0.01 <= inner < 0.03 and watch.seconds >= 0.04
    results = []

    def work():
        with watch:
            time.sleep(0.02)
        results.append(watch.seconds)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and min(results) >= 0.02
    with pytest.raises(RuntimeError, match="not running"):
        watch.wait(1)


def test_stopwatch_waits_for_device_work():
    x = jnp.ones((128, 128))
    with mock.patch.object(jax, "block_until_ready", wraps=jax.block_until_ready) as b:
        with jh.StopWatch("given", block=x):
            pass
        with jh.StopWatch("inside") as sw:
            out = sw.wait(x @ x)
        assert b.call_count == 2
        assert b.call_args.args[0] == [out]

        @jh.StopWatch("decorated", block=True)
        def step(a):
            return a * 2

        result = step(x)
        assert b.call_count == 3 and b.call_args.args[0] == [result]
        assert step.last > 0


def test_stopwatch_decorator_times_every_call_into_a_history():
    h = jh.History(distributed_history=False)

    @jh.StopWatch("load", history=h)
    def load(i):
        return i

    for i in range(3):
        assert load(i) == i
        h.update({"loss": float(i)})  # each timing lands at the next update's step
    assert h.state.steps("timing/load").tolist() == [0, 1, 2]


def test_a_decorated_async_function_is_timed_over_its_await():
    """@StopWatch on an async def timed only the call that made the coroutine
    (microseconds) and recorded that. Now the await is timed, each call on
    its own even where tasks overlap on one thread (the stop watch's span
    stack is per thread, which interleaved tasks would mix up)."""
    import asyncio

    h = jh.History(distributed_history=False)
    sw = jh.StopWatch("fetch", history=h)
    gates = {}

    @sw
    async def fetch(name):
        await gates[name].wait()
        return name

    async def main():
        gates.update(a=asyncio.Event(), b=asyncio.Event())
        first = asyncio.create_task(fetch("a"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(fetch("b"))  # starts 50 ms after "a"
        await asyncio.sleep(0.05)
        gates["a"].set()  # "a" ends ~100 ms after it started
        assert await first == "a"
        first_took = fetch.last
        await asyncio.sleep(0.2)
        gates["b"].set()  # "b" ends ~250 ms after it started
        assert await second == "b"
        return first_took, fetch.last

    a, b = asyncio.run(main())
    assert a >= 0.09 and b >= 0.24, (a, b)  # each from its own start
    h.update({"loss": 0.0})
    assert sorted(h.state.values("timing/fetch").tolist()) == [b]  # the later


def test_a_generator_function_is_refused_by_the_decorator():
    """Its call only makes the generator: timing it timed nothing."""

    def gen():
        yield 1

    async def agen():
        yield 1

    for fn in (gen, agen):
        with pytest.raises(TypeError, match="generator"):
            jh.StopWatch("g")(fn)


def _on_a_thread(fn, name="closer"):
    """Runs ``fn`` on a new thread; returns what it raised and the exceptions
    Python reported as ignored meanwhile (a generator's close run by the GC)."""
    raised, ignored = [], []

    def run():
        try:
            fn()
        except BaseException as err:  # reported to the test
            raised.append(err)

    with mock.patch.object(sys, "unraisablehook", ignored.append):
        worker = threading.Thread(target=run, name=name)
        worker.start()
        worker.join()
    return raised, [u.exc_value for u in ignored]


def _spans_by_thread(path):
    """``{thread name: [(span name, ts, dur, args), ...]}`` of a trace file."""
    events = json.loads(path.read_text())
    check_valid(events)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    out = {}
    for e in events:
        if e["ph"] == "X":
            span = (e["name"], e["ts"], e["dur"], e.get("args"))
            out.setdefault(names[e["tid"]], []).append(span)
    return out


def _suspended_in(watch, how):
    """A span of ``watch`` entered on this thread and left suspended, and the
    function that ends it from wherever it is called: a generator closed, a
    generator resumed to its end, a generator closed, a generator dropped (the
    GC closes it), a coroutine resumed, an ExitStack closed."""
    if how == "exit stack":
        stack = contextlib.ExitStack()
        stack.enter_context(watch)
        return stack.close
    if how == "coroutine":

        async def fetch(gate):
            with watch:
                await gate

        class Gate:
            def __await__(self):
                yield

        coro = fetch(Gate())
        coro.send(None)

        def resume():
            with pytest.raises(StopIteration):
                coro.send(None)

        return resume

    def batches():
        with watch:
            yield 1
            yield 2

    kept = [batches()]
    next(kept[0])
    if how == "generator resumed":

        def resume():
            with pytest.raises(StopIteration):
                next(kept[0])
                next(kept[0])

        return resume
    if how == "generator closed":
        return lambda: kept[0].close()
    return kept.clear  # the last reference: the GC closes it on that thread


@pytest.mark.parametrize(
    "how",
    [
        "generator resumed",
        "generator closed",
        "generator dropped",
        "coroutine",
        "exit stack",
    ],
)
def test_a_span_ended_on_another_thread_is_recorded_once_on_its_own(tmp_path, how):
    """A ``with StopWatch`` left suspended on one thread (a data-loader
    generator made on the main thread, closed, resumed or collected on a
    worker; an ExitStack closed there) was ended by popping the *exiting*
    thread's span stack: IndexError (``Exception ignored in generator`` when
    the GC ran it). The span is now ended where it was opened: once, with its
    own duration, on the opening thread's track, recorded in the History (a
    generator closed ends it with GeneratorExit: traced as an error, not
    recorded, as on its own thread)."""
    h = jh.History(distributed_history=False)
    watch = jh.StopWatch("load", history=h)
    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        end = _suspended_in(watch, how)
        time.sleep(0.03)
        raised, ignored = _on_a_thread(end)
        assert trace._trace_state.open_spans() == []
        assert trace._trace_state.innermost_span(threading.get_ident()) is None
    assert raised == [] and ignored == []
    spans = _spans_by_thread(t.paths[0])
    assert list(spans) == ["MainThread"]
    [(name, _, dur, args)] = spans["MainThread"]
    assert name == "load" and dur >= 30_000 and watch.seconds >= 0.03
    h.update({"loss": 1.0})
    if how in ("generator closed", "generator dropped"):
        assert args == {"error": "GeneratorExit"} and watch.data == {}
        assert "timing/load" not in h.state
    else:
        assert args is None and watch.data["timing/load/count"] == 1
        assert h.state.values("timing/load").tolist() == [watch.seconds]


@pytest.mark.parametrize("shared", [False, True], ids=["own watch", "same watch"])
def test_a_span_ended_inside_another_threads_span_leaves_that_span_open(
    tmp_path, shared
):
    """The thread that ends another thread's span (closes its generator) may
    be inside a span of its own, of another StopWatch or of the same one: that
    span was popped in the other's place (it ended at the wrong time, in the
    trace and the History, and the hang watch named the wrong innermost span)
    or IndexError was raised. Each span now ends as and where it began."""
    load = jh.StopWatch("load")
    work = load if shared else jh.StopWatch("work")
    seen = {}
    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        close = _suspended_in(load, "generator closed")
        time.sleep(0.02)

        def worker():
            with work:
                time.sleep(0.02)
                close()
                seen["load"] = load.seconds
                seen["innermost"] = trace._trace_state.innermost_span(
                    threading.get_ident()
                )
                time.sleep(0.03)
            seen["work"] = work.seconds

        raised, ignored = _on_a_thread(worker, name="worker")
        assert trace._trace_state.open_spans() == []
    assert raised == [] and ignored == []
    assert seen["innermost"] == work.msg
    assert seen["load"] >= 0.04 and seen["work"] >= 0.05
    spans = _spans_by_thread(t.paths[0])
    [(name, main_ts, main_dur, _)] = spans["MainThread"]
    [(work_name, work_ts, work_dur, _)] = spans["worker"]
    assert name == "load" and work_name == work.msg
    assert main_dur >= 40_000 and work_dur >= 50_000
    # the generator's span ended inside the worker's, which went on after it
    assert work_ts < main_ts + main_dur < work_ts + work_dur - 20_000


@pytest.mark.parametrize("shared", [False, True], ids=["two watches", "one watch"])
def test_spans_exited_out_of_order_on_one_thread_end_as_they_began(tmp_path, shared):
    """Two generators suspended in spans on one thread, the one started first
    closed first (an inner exit after its outer one): with one StopWatch
    instance in both, the first close ended the second span (the top of the
    stack) and the second close the first one, each with the other's start."""
    first = jh.StopWatch("batch")
    second = first if shared else jh.StopWatch("batch")
    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        close_first = _suspended_in(first, "generator closed")
        time.sleep(0.03)
        close_second = _suspended_in(second, "generator closed")
        time.sleep(0.03)
        close_first()
        took_first = first.seconds
        time.sleep(0.03)
        close_second()
        took_second = second.seconds
        assert trace._trace_state.open_spans() == []
    assert took_first >= 0.06 and took_second >= 0.06
    events = [e for e in trace.load_trace(t.paths[0]) if e["ph"] == "X"]
    early, late = sorted(events, key=lambda e: e["ts"])
    assert early["ts"] + early["dur"] < late["ts"] + late["dur"]  # ended first
    assert early["dur"] >= 60_000 and late["dur"] >= 60_000


def test_a_span_of_a_thread_that_ended_can_be_ended_later_elsewhere(tmp_path):
    """A worker that made a generator, entered its span and ended, handing
    the generator on: closed on the main thread while the trace is open, the
    span is written once on the worker's track, ending at the close; one
    still open when the trace closes is written there (``open_at_close``),
    and closing it afterwards raises nothing and writes it to no later trace."""
    watch = jh.StopWatch("read")
    handed = []

    def work():
        for _ in range(2):
            handed.append(_suspended_in(watch, "generator closed"))

    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        worker = threading.Thread(target=work, name="reader")
        worker.start()
        worker.join()
        time.sleep(0.02)
        handed[1]()  # the later one closed on the main thread: they nest
        assert watch.seconds >= 0.02
        assert len(trace._trace_state.open_spans()) == 1
    with trace.JSONTraceHandler(folder=tmp_path / "next") as later:
        raised, ignored = _on_a_thread(handed[0])
        later.instant("later")
    assert raised == [] and ignored == []
    assert trace._trace_state.open_spans() == []
    spans = _spans_by_thread(t.paths[0])
    assert list(spans) == ["reader"]
    at_close, closed = sorted(spans["reader"], key=lambda s: "error" in s[3])
    assert closed[3] == {"error": "GeneratorExit"} and closed[2] >= 20_000
    assert at_close[3] == {"open_at_close": True}
    names = [e["name"] for e in trace.load_trace(later.paths[0]) if e["ph"] != "M"]
    assert names == ["later"]


def test_a_block_that_raises_is_traced_but_not_recorded(tmp_path):
    h = jh.History(distributed_history=False)
    with (
        trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t,
        pytest.raises(KeyError),
        jh.StopWatch("fails", history=h),
    ):
        raise KeyError("x")
    assert "timing/fails" not in h.state
    span = next(e for e in trace.load_trace(t.paths[0]) if e["ph"] == "X")
    assert span["args"]["error"] == "KeyError"


def test_stopwatch_bad_arguments():
    with pytest.raises(ValueError, match="msg"):
        jh.StopWatch("")
    with pytest.raises(ValueError, match="wbtag"):
        jh.StopWatch("a", wbtag="  ")
    with pytest.raises(
        ValueError, match="wbtag"
    ):  # recorded 'timing/', keys 'timing//dt'
        jh.StopWatch("a", wbtag="timing/")
    with pytest.raises(TypeError, match="History"):
        jh.StopWatch("a", history=[])
    with pytest.raises(TypeError, match="decorates a function"):
        jh.StopWatch("a")(3)
    for step in ("seven", 1.5, True, 2**63, [1]):  # at once, not after the work
        with pytest.raises(ValueError, match="step must be a whole number"):
            jh.StopWatch("a", step=step)
    assert jh.StopWatch("a", step=np.int64(3)).step == 3


# ----- regressions -------------------------------------------------------------------
def test_closing_the_handler_writes_the_counters_history_still_queued(tmp_path):
    h = jh.History(distributed_history=False)
    with trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t:
        for i in range(10):
            h.update({"loss": float(i)}, summarize=False)
    counters = [e for e in trace.load_trace(t.paths[0]) if e["ph"] == "C"]
    assert [e["args"]["loss"] for e in counters] == [float(i) for i in range(10)]


def test_rotate_to_an_existing_name_keeps_the_handler_working(tmp_path):
    t = trace.JSONTraceHandler(folder=str(tmp_path))
    t.start()
    with pytest.raises(FileExistsError, match="new epoch, batch or step"):
        t.rotate()  # the same epoch/batch/step: the same file name
    assert t.active and trace._trace_state.active() is t
    with jh.StopWatch("still traced"):
        pass
    t.close()
    assert t.merged_path is not None
    names = {e["name"] for e in trace.load_trace(t.merged_path)}
    assert "still traced" in names


def test_keeping_no_traces_is_refused_naming_the_argument(tmp_path):
    """num_traces_to_keep=0 would leave no trace and say nothing: refused."""
    with pytest.raises(ValueError, match=r"num_traces_to_keep .*>= 1.* got 0"):
        trace.JSONTraceHandler(folder=str(tmp_path), num_traces_to_keep=0)
    assert not list(tmp_path.iterdir())
    with trace.JSONTraceHandler(folder=str(tmp_path), num_traces_to_keep=1) as t:
        t.instant("a")
        t.rotate(batch=1)
        t.instant("b")
    assert [p.name for p in t.paths] == ["ep0-ba1-rank0.json"]
    names = {e["name"] for e in trace.load_trace(t.merged_path)}
    assert "b" in names and "a" not in names


def test_a_finished_span_is_on_disk_within_a_second(tmp_path):
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    t.start()
    with jh.StopWatch("before a hang"):
        pass
    time.sleep(1.2)  # nothing else happens: the flusher writes it
    names = {e["name"] for e in trace.load_trace(t.paths[0])}
    t.close()
    assert "before a hang" in names


def test_merging_traces_of_other_tools_keeps_their_processes_apart(tmp_path):
    for host in ("a", "b"):
        (tmp_path / f"{host}.json").write_text(
            json.dumps(
                [
                    {
                        "name": "process_name",
                        "ph": "M",
                        "pid": 1,
                        "args": {"name": host},
                    },
                    {
                        "name": "work",
                        "ph": "X",
                        "ts": 10.0,
                        "dur": 1.0,
                        "pid": 1,
                        "tid": 1,
                    },
                    {"name": "flow", "ph": "s", "pid": 1, "tid": 1, "id": 3},
                ]
            )
        )
    out = trace.merge_traces(
        [tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "m.json"
    )
    events = trace.load_trace(out)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "a", 2: "b"}
    assert [e["ts"] for e in events if e["name"] == "work"] == [10.0, 10.0]
    assert len([e for e in events if e["name"] == "flow"]) == 2  # no ts: kept


def test_a_gzip_trace_cut_off_loads_its_complete_events(tmp_path):
    events = [
        {"name": f"e{i}", "ph": "X", "ts": float(i), "dur": 1.0, "pid": 0, "tid": 1}
        for i in range(2000)
    ]
    data = gzip.compress(("[\n" + ",\n".join(map(json.dumps, events))).encode())
    path = tmp_path / "t.json.gz"
    for cut in (5, 12, 20, len(data) // 10, len(data) // 2, len(data) - 8):
        path.write_bytes(data[:cut])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = trace.load_trace(path)
        assert got == events[: len(got)]
        # what was lost is said, naming what was kept
        for w in caught:
            assert f"the {len(got)} complete event(s) before it are kept" in str(
                w.message
            )
        if 0 < len(got) < len(events):  # cut inside the events
            assert caught, cut
    path.write_bytes(data[: len(data) // 2])
    with pytest.warns(RuntimeWarning, match="cut off or damaged"):
        assert len(trace.load_trace(path)) > 100


@pytest.mark.slow
def test_a_timing_on_one_process_of_a_distributed_history_does_not_hang():
    results = jh.launch_local("mp_workers:timing_on_one_process", 2, 1, timeout=120)
    stats = {f"lr/{s}": [0] for s in (*jh.STATS, *jh.PROVENANCE)}
    stats.update({"straggler/process": [0], "straggler/lag": [0]})
    assert results[0] == {**stats, "timing/checkpoint": [0]}
    assert results[1] == stats


def test_events_from_other_threads_during_a_rotate_are_all_written(tmp_path):
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    t.start()
    stop = threading.Event()
    sent = []

    def spam():
        i = 0
        while not stop.is_set():
            t.instant(f"e{i}")
            sent.append(i)
            i += 1

    worker = threading.Thread(target=spam)
    worker.start()
    for batch in range(1, 30):
        t.rotate(batch=batch)
    stop.set()
    worker.join()
    t.close()
    written = [
        e["name"] for p in t.paths for e in trace.load_trace(p) if e["ph"] == "i"
    ]
    assert len(written) == len(sent)


def test_events_before_a_rotate_are_in_the_file_it_finishes(tmp_path):
    with trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t:
        for batch in range(1, 4):
            t.instant(f"before {batch}")
            t.rotate(batch=batch)
        t.instant("last")
    names = [
        [e["name"] for e in trace.load_trace(p) if e["ph"] == "i"] for p in t.paths
    ]
    assert names == [["before 1"], ["before 2"], ["before 3"], ["last"]]


def test_the_handler_writes_on_one_writer_thread_and_names_its_threads(tmp_path):
    before = {th.ident for th in threading.enumerate()}
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    t.start()
    started = [th for th in threading.enumerate() if th.ident not in before]
    assert [th.name for th in started] == ["jaxhistory-trace"]
    worker = threading.Thread(target=lambda: t.instant("on a thread"), name="w")
    worker.start()
    worker.join()
    t.rotate(batch=1)
    t.instant("main")
    t.close()
    assert not any(th.is_alive() for th in started)
    for path in t.paths:  # every file names every thread seen so far
        events = trace.load_trace(path)
        named = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert named >= {"w"}
        check_valid(events)


def _linked_first_file(tmp_path, name):
    """A folder ``name`` whose first trace file is a link to ``victim.txt``
    ("keep"); returns both."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    folder = tmp_path / name
    folder.mkdir()
    (folder / "ep0-ba0-rank0.json").symlink_to(victim)
    return folder, victim


def test_a_trace_file_that_is_a_link_is_never_written_through(tmp_path):
    from jaxhistory._files import NotAFile

    folder, victim = _linked_first_file(tmp_path, "traces")
    t = trace.JSONTraceHandler(
        folder=str(folder), merged_trace_filename=None, overwrite=True
    )
    with pytest.raises(NotAFile, match="ep0-ba0-rank0.json: it is a symbolic link"):
        t.start()
    assert not t.active and trace._trace_state.active() is None
    t.start(batch=1)
    (folder / "ep0-ba2-rank0.json").symlink_to(victim)
    with pytest.raises(NotAFile, match="symbolic link"):
        t.rotate(batch=2)
    assert t.active  # the open file is kept
    t.close()
    assert victim.read_text() == "keep"
    assert [p.name for p in t.paths] == ["ep0-ba1-rank0.json"]


def test_a_damaged_trace_warns_naming_the_line_and_keeps_the_events_before(
    tmp_path,
):
    events = [
        {"name": n, "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 0, "tid": 1} for n in "ab"
    ]
    lines = "[\n" + ",\n".join(json.dumps(e) for e in events)
    (tmp_path / "clean.json").write_text(lines + ",\n")  # a killed run: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trace.load_trace(tmp_path / "clean.json") == events
    (tmp_path / "half.json").write_text(lines + ',\n{"name": "c", "ph')
    with pytest.warns(RuntimeWarning, match=r"half.json: .* at line 4 .* 2 complete"):
        assert trace.load_trace(tmp_path / "half.json") == events
    (tmp_path / "bad.json").write_text(lines.replace('"b"', "b", 1))
    with pytest.warns(RuntimeWarning, match="line 3"):
        assert trace.load_trace(tmp_path / "bad.json") == events[:1]


# ----- bad trace files, and where files may be written ------------------------------
def test_a_trace_whose_events_are_not_a_list_is_a_value_error_naming_the_file(
    tmp_path,
):
    path = tmp_path / "dict.json"
    path.write_text(json.dumps({"traceEvents": {"name": "a", "ph": "X"}}))
    with pytest.raises(ValueError, match=r"dict\.json.*traceEvents is a dict"):
        trace.load_trace(path)
    (tmp_path / "num.json").write_text("42")
    with pytest.raises(ValueError, match=r"num\.json is not a Chrome trace"):
        trace.load_trace(tmp_path / "num.json")
    # Finding: any JSON object (a package.json) merged as a trace of no events
    (tmp_path / "pkg.json").write_text('{"foo": [1, 2, 3]}')
    with pytest.raises(
        ValueError, match=r"pkg\.json is not a Chrome trace.*traceEvents"
    ):
        trace.load_trace(tmp_path / "pkg.json")
    with pytest.raises(ValueError, match=r"pkg\.json"):
        trace.merge_traces([tmp_path / "pkg.json"], tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()
    (tmp_path / "none.json").write_text('{"traceEvents": []}')  # a trace, no events
    assert trace.load_trace(tmp_path / "none.json") == []


def test_gzip_garbage_is_a_value_error_and_the_command_says_so_in_one_line(tmp_path):
    garbage = tmp_path / "junk.json.gz"
    garbage.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"junk\.json\.gz .*gzip data is damaged"):
        trace.load_trace(garbage)
    with pytest.raises(ValueError, match=r"junk\.json\.gz"):
        trace.merge_traces([garbage], tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()
    out = str(tmp_path / "m.json")
    done = subprocess.run(
        [sys.executable, "-m", "jaxhistory", "merge-traces", str(garbage), "-o", out],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "junk.json.gz" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize(
    ("args", "what"),
    [
        ([1, 2], "args"),
        ("sync", "args"),
        ({"sync_ts": "soon", "sync_wall": 1.0, "sync_id": 1}, "sync_ts"),
        ({"sync_ts": 1.0, "sync_wall": [1], "sync_id": 1}, "sync_wall"),
        ({"sync_ts": 1.0, "sync_wall": 1.0, "sync_id": [1]}, "sync_id"),
    ],
)
def test_a_malformed_clock_sync_is_a_value_error_naming_the_argument_and_file(
    tmp_path, args, what
):
    path = tmp_path / "odd.json"
    path.write_text(
        json.dumps([{"name": "clock_sync", "ph": "M", "pid": 0, "args": args}])
    )
    with pytest.raises(ValueError, match=rf"odd\.json: the clock_sync .* {what}"):
        trace.merge_traces([path], tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_merging_in_the_wrong_argument_order_leaves_the_input_trace_intact(tmp_path):
    """merge_traces(merged, rank_file), output first as in other tools: the
    process's own trace is refused as the output and left byte for byte."""
    with trace.JSONTraceHandler(folder=str(tmp_path), run_name="one") as t:
        t.instant("batch 0")
        t.rotate(batch=3)
        t.instant("batch 3")
    rank_file = tmp_path / "ep0-ba3-rank0.json"
    merged = tmp_path / "merged_trace.json"
    before = rank_file.read_bytes()
    with pytest.raises(ValueError, match=r"ep0-ba3-rank0\.json .*inputs first"):
        trace.merge_traces(str(merged), str(rank_file))
    assert rank_file.read_bytes() == before
    # A process's trace that is also an input is refused as the output too.
    with pytest.raises(ValueError, match=r"ep0-ba3-rank0\.json is also one of"):
        trace.merge_traces([rank_file], rank_file)
    assert rank_file.read_bytes() == before
    # The earlier merge among the inputs (traces/*.json picking it up) is merged
    # again into itself, every event once.
    events = trace.load_trace(merged)
    assert trace.merge_traces([rank_file, merged], merged) == merged
    assert sorted(map(json.dumps, trace.load_trace(merged))) == sorted(
        map(json.dumps, events)
    )
    # Re-merging the same run into its merged file is fine.
    assert trace.merge_traces([rank_file], tmp_path / "again.json").is_file()
    assert trace.merge_traces([merged], tmp_path / "again.json").is_file()


def test_a_merge_onto_another_runs_merged_trace_is_refused(tmp_path):
    a = _fake_process(tmp_path, 0, 0.0, sync_id=1)
    b = _fake_process(tmp_path, 0, 0.0, sync_id=2)
    out = trace.merge_traces([a], tmp_path / "m.json")
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"m\.json holds the trace of another run"):
        trace.merge_traces([b], out)
    assert out.read_bytes() == before
    (tmp_path / "notes.txt").write_text("my notes")
    with pytest.raises(ValueError, match=r"notes\.txt exists and is not a trace"):
        trace.merge_traces([a], tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "my notes"


def test_a_merge_never_writes_onto_a_device_node_fifo_or_link(tmp_path):
    import os
    import stat

    a = _fake_process(tmp_path, 0, 0.0, sync_id=1)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"fifo\.json exists and is not a plain"):
        trace.merge_traces([a], fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target = tmp_path / "target.json"
    target.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(ValueError, match=r"link\.json exists and is a link"):
        trace.merge_traces([a], link)
    assert link.is_symlink() and target.read_text() == "keep"
    done = subprocess.run(
        [sys.executable, "-m", "jaxhistory", "merge-traces", str(a), "-o", str(fifo)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "fifo.json" in done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_linked_folder_inside_the_trace_folder_is_never_written_or_cleared(
    tmp_path,
):
    from jaxhistory._files import NotAFile

    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("ep0.json", "ep7.json"):
        (victim / name).write_text("precious")
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "sub").symlink_to(victim)  # planted inside the trace folder
    h = trace.JSONTraceHandler(
        folder=str(folder),
        filename="sub/ep{epoch}.json",
        merged_trace_filename=None,
        overwrite=True,
        run_name="r",
    )
    with pytest.raises(NotAFile, match="sub: it is a symbolic link"):
        h.start(epoch=1)
    assert sorted(p.name for p in victim.iterdir()) == ["ep0.json", "ep7.json"]
    assert (victim / "ep0.json").read_text() == "precious"
    assert (folder / "sub").is_symlink()


def test_a_pipe_named_like_a_trace_is_never_read_and_never_blocks(tmp_path):
    import os

    a = _fake_process(tmp_path, 0, 0.0, sync_id=1)
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # reading it would wait for a writer that never comes
    with pytest.raises(ValueError, match=r"pipe\.json is a named pipe"):
        trace.merge_traces([a, fifo], tmp_path / "out.json")
    with pytest.raises(ValueError, match=r"pipe\.json is a named pipe"):
        trace.load_trace(fifo)
    folder = tmp_path / "traces"
    h = trace.JSONTraceHandler(folder=str(folder), run_name="r")
    h.start()
    h.instant("x")
    os.mkfifo(folder / "zz_other.json")  # appears in the folder during the run
    h.close()  # merges the folder's traces, leaving the pipe out
    names = {e.get("name") for e in trace.load_trace(h.merged_path)}
    assert "x" in names


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"filename": "../../{rank}.json"}, "filename"),
        ({"filename": "/tmp/{rank}.json"}, "filename"),
        ({"filename": "sub/../../x{rank}.json"}, "filename"),
        ({"merged_trace_filename": "../merged.json"}, "merged_trace_filename"),
    ],
)
def test_a_file_name_that_leaves_the_trace_folder_is_refused(tmp_path, kwargs, what):
    folder = tmp_path / "a" / "b"
    with pytest.raises(ValueError, match=rf"{what} .* leaves the trace folder"):
        trace.JSONTraceHandler(folder=str(folder), **kwargs)
    assert not list(tmp_path.iterdir())


def test_the_folder_and_file_names_may_be_paths(tmp_path):
    """folder= (and filename=, merged_trace_filename=) take any os.PathLike,
    as every other path argument does: a pathlib.Path was a ValueError ('must
    be a non-empty str'). A Path is a template like a str, and is checked as
    one: no file name leaves the folder, no link is written through."""
    import pathlib

    from jaxhistory._files import NotAFile

    t = trace.JSONTraceHandler(
        folder=tmp_path / "{run_name}" / "traces",
        filename=pathlib.PurePosixPath("ep{epoch}-r{rank}.json"),
        merged_trace_filename=pathlib.Path("merged.json"),
        run_name="demo",
    )
    assert t.folder_template == str(tmp_path / "{run_name}" / "traces")
    with t:
        t.instant("in the file")
    folder = tmp_path / "demo" / "traces"
    assert t.folder == folder and t.paths == [folder / "ep0-r0.json"]
    names = {e["name"] for e in trace.load_trace(t.paths[0]) if e["ph"] == "i"}
    assert names == {"in the file"}
    assert t.merged_path == folder / "merged.json"
    assert "in the file" in {e["name"] for e in trace.load_trace(t.merged_path)}
    with pytest.raises(ValueError, match="filename .* leaves the trace folder"):
        trace.JSONTraceHandler(folder=tmp_path, filename=pathlib.Path("/x{rank}"))
    with pytest.raises(ValueError, match=r"unknown variable \{step\}"):
        trace.JSONTraceHandler(folder=tmp_path / "{step}")
    with pytest.raises(ValueError, match="folder must be a non-empty str or a path"):
        trace.JSONTraceHandler(folder=b"traces")
    linked, victim = _linked_first_file(tmp_path, "linked")
    t = trace.JSONTraceHandler(
        folder=linked, merged_trace_filename=None, overwrite=True
    )
    with pytest.raises(NotAFile, match="symbolic link"):
        t.start()
    assert victim.read_text() == "keep" and not t.active


def test_overwrite_clears_an_earlier_runs_files_so_none_is_merged(tmp_path):
    with trace.JSONTraceHandler(folder=str(tmp_path), run_name="old") as t:
        for batch in range(1, 4):
            t.instant(f"old {batch}")
            t.rotate(batch=batch)
        t.instant("old last")
    (tmp_path / "ep0-ba0-rank3.json").write_text("[]")  # a rank the new run lacks
    (tmp_path / "notes.txt").write_text("mine")
    with trace.JSONTraceHandler(
        folder=str(tmp_path), run_name="new", overwrite=True
    ) as t:
        t.instant("new")
    events = trace.load_trace(t.merged_path)
    assert {e["name"] for e in events if e["ph"] == "i"} == {"new"}
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {f"new: process 0 ({__import__('socket').gethostname()})"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ep0-ba0-rank0.json",
        "merged_trace.json",
        "notes.txt",
    ]


def test_rotating_after_the_last_epoch_leaves_no_metadata_only_file(tmp_path):
    """The documented pattern rotates after each epoch: the file the last rotate
    opens gets no event and is not left behind."""
    with trace.JSONTraceHandler(folder=str(tmp_path), run_name="demo") as t:
        for epoch in range(3):
            with jh.StopWatch(f"epoch {epoch}"):
                pass
            t.rotate(epoch=epoch + 1)
    assert [p.name for p in t.paths] == [f"ep{e}-ba0-rank0.json" for e in range(3)]
    assert not (tmp_path / "ep3-ba0-rank0.json").exists()
    for path in t.paths:
        assert [e["ph"] for e in trace.load_trace(path)].count("X") == 1
    spans = [e["name"] for e in trace.load_trace(t.merged_path) if e["ph"] == "X"]
    assert sorted(spans) == ["epoch 0", "epoch 1", "epoch 2"]


# ----- a failing write --------------------------------------------------------------


def test_a_failing_trace_write_never_raises_even_with_warnings_as_errors(tmp_path):
    tracer = jh.trace.JSONTraceHandler(folder=str(tmp_path), run_name="t")
    tracer.start()

    class Broken:
        closed = False

        def write(self, data=None):
            raise OSError(28, "No space left on device")

        flush = close = write

    tracer._out.file = Broken()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jh.StopWatch("span"):
            pass
        tracer.close()
    assert tracer.lost >= 1 and tracer.error is not None
    # closed for good: no longer the active handler, though its file failed
    assert not tracer.active and jh.trace._trace_state.active() is None


# ----- merging runs and folders -----------------------------------------------------


def traced_run(folder, run_name, spans=3):
    from jaxhistory import trace

    t = trace.JSONTraceHandler(
        folder=str(folder), run_name=run_name, merged_trace_filename="merged_trace.json"
    )
    with t:
        for _ in range(spans):
            with jh.StopWatch("step"):
                pass
    return t


def test_merging_a_folder_twice_or_with_its_merge_keeps_each_span_once(tmp_path):
    from jaxhistory import trace

    t = traced_run(tmp_path, "runA")
    merged = tmp_path / "merged_trace.json"
    assert merged.is_file()
    files = sorted(str(p) for p in tmp_path.glob("*.json"))  # the merge included
    out = run_cli("merge-traces", *files, *files, "-o", tmp_path / "again.json")
    assert out.returncode == 0, out.stderr
    spans = [e for e in trace.load_trace(tmp_path / "again.json") if e["ph"] == "X"]
    assert len(spans) == 3 == len({(e["ts"], e["dur"]) for e in spans})
    # One path works too (a str is one file, not a list of characters).
    one = trace.merge_traces(str(t.paths[0]), tmp_path / "one.json")
    assert len([e for e in trace.load_trace(one) if e["ph"] == "X"]) == 3


def test_merged_runs_are_labelled_by_run_name_and_spans_group_by_name(tmp_path):
    from jaxhistory import trace

    a = traced_run(tmp_path / "a", "baseline")
    b = traced_run(tmp_path / "b", "bigger-lr")
    out = trace.merge_traces([*a.paths, *b.paths], tmp_path / "both.json")
    events = trace.load_trace(out)
    labels = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert [label.split(":")[0] for label in labels] == ["baseline", "bigger-lr"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and all("args" not in e for e in spans)  # nothing varies
    t = trace.JSONTraceHandler(folder=str(tmp_path / "c"), run_name="c")
    with t, pytest.raises(ZeroDivisionError), jh.StopWatch("fails"):
        1 / 0  # noqa: B018
    failed = [e for e in trace.load_trace(t.paths[0]) if e["ph"] == "X"]
    assert failed[0]["args"] == {"error": "ZeroDivisionError"}


def test_history_counters_before_a_rotate_are_in_the_file_it_finishes(tmp_path):
    """rotate, like close, first writes the counters History has queued."""
    with trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t:
        h = jh.History(distributed_history=False)
        for epoch in range(1, 4):
            for i in range(5):
                h.update(
                    {"step": epoch * 10 + i, "loss": float(epoch)}, summarize=False
                )
            t.rotate(epoch=epoch)
        h.close()
    per_file = [
        sorted({e["args"]["loss"] for e in trace.load_trace(p) if e["ph"] == "C"})
        for p in t.paths
    ]
    assert per_file[:3] == [[1.0], [2.0], [3.0]]


def test_merge_traces_in_composer_s_argument_order_names_the_order(tmp_path):
    with trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None) as t:
        t.instant("x")
    made = t.paths[0]
    new = tmp_path / "merged.json"
    with pytest.raises(FileNotFoundError, match="inputs come first.*out_path"):
        trace.merge_traces(new, made)  # Composer's order: output first
    assert not new.exists()
    with pytest.raises(FileNotFoundError, match="nope.json: no such trace file$"):
        trace.merge_traces([tmp_path / "nope.json"], tmp_path / "other.json")
    assert trace.merge_traces([made], new) == new


def test_trace_files_in_subfolders_are_merged(tmp_path):
    """A filename that puts each file in a subfolder (rank{rank}/...) had its
    files left out of the merged trace, which merged only the folder's own
    files; a subfolder that is a link is not read."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "rank0").mkdir(parents=True)
    foreign = '{"traceEvents": [{"name": "foreign", "ph": "i", "ts": 1, "pid": 9}]}'
    (elsewhere / "rank0" / "ep7.json").write_text(foreign)
    folder = tmp_path / "traces"
    t = trace.JSONTraceHandler(
        folder=folder, filename="rank{rank}/ep{epoch}.json", overwrite=True
    )
    with t:
        t.instant("in a subfolder")
    assert t.paths == [folder / "rank0" / "ep0.json"]
    assert t.merged_path == folder / "merged_trace.json"
    assert "in a subfolder" in {e["name"] for e in trace.load_trace(t.merged_path)}
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "rank1").symlink_to(elsewhere / "rank0")
    with trace.JSONTraceHandler(
        folder=linked, filename="rank{rank}/ep{epoch}.json", overwrite=True
    ) as u:
        u.instant("mine")
    merged = {e.get("name") for e in trace.load_trace(u.merged_path)}
    assert "mine" in merged and "foreign" not in merged
    assert (elsewhere / "rank0" / "ep7.json").read_text() == foreign


def test_a_span_that_raised_leaves_the_stopwatch_data_of_the_counted_spans():
    """``data``'s dt was the seconds of a span that raised, while its count and
    total left that span out (dt 0.1 s beside a total of 0.01 s over 1 span)."""
    watch = jh.StopWatch("step")
    with watch:
        time.sleep(0.01)
    counted = watch.data
    with pytest.raises(ValueError), watch:
        time.sleep(0.05)
        raise ValueError
    assert watch.data == counted
    assert counted["timing/step/dt"] == counted["timing/step/total"]


def test_a_thread_started_after_another_ended_gets_its_own_named_track(tmp_path):
    """Threads were told apart by ``threading.get_ident()``, which Python
    hands again to a thread started after another ended: the later thread's
    spans landed on the earlier one's track, under its name."""
    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        for i in range(3):
            worker = threading.Thread(
                target=jh.StopWatch(f"span {i}")(lambda: None), name=f"worker-{i}"
            )
            worker.start()
            worker.join()
        del worker
        t.rotate(epoch=1)  # a finished thread is not named again in later files
        t.instant("next file")
    events = trace.load_trace(t.paths[0])
    check_valid(events)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = {e["name"]: names[e["tid"]] for e in events if e["ph"] == "X"}
    assert spans == {f"span {i}": f"worker-{i}" for i in range(3)}
    later = trace.load_trace(t.paths[1])
    check_valid(later)
    assert [e["args"]["name"] for e in later if e["name"] == "thread_name"] == [
        "MainThread"
    ]


def test_spans_left_open_by_threads_that_ended_are_written_at_close(tmp_path):
    """A worker that ended inside a StopWatch span (entered on an ExitStack
    the worker handed on and nobody closed) had the span left out of the
    trace at close. It is written ending at the close, marked
    ``open_at_close``, on the worker's own named track; a thread started after
    it (which may be handed the same ``threading.get_ident()``) keeps its own
    span and track. Once written, they are not written again by a later
    trace."""
    kept = []

    def work(name):
        with jh.StopWatch(f"{name} setup"):
            pass
        stack = contextlib.ExitStack()
        stack.enter_context(jh.StopWatch(f"{name} batch"))
        kept.append(stack)  # never closed

    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        for name in ("loader", "reader"):
            worker = threading.Thread(target=work, args=(name,), name=name)
            worker.start()
            worker.join()
        del worker
    events = json.loads(t.paths[0].read_text())  # the whole file, strict JSON
    check_valid(events)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert sorted(spans) == [
        "loader batch",
        "loader setup",
        "reader batch",
        "reader setup",
    ]
    for name in ("loader", "reader"):
        setup, batch = spans[f"{name} setup"], spans[f"{name} batch"]
        assert batch["args"] == {"open_at_close": True} and "args" not in setup
        assert batch["tid"] == setup["tid"] and names[batch["tid"]] == name
        assert setup["ts"] + setup["dur"] <= batch["ts"]
    assert spans["loader batch"]["tid"] != spans["reader batch"]["tid"]
    # written once: a later trace does not show them again
    with trace.JSONTraceHandler(folder=tmp_path / "next") as later:
        later.instant("later")
    names = [e["name"] for e in trace.load_trace(later.paths[0]) if e["ph"] != "M"]
    assert names == ["later"]


def test_an_event_orjson_cannot_write_costs_no_other_event(tmp_path):
    """A span named after an undecodable file name (``os.fsdecode`` makes a
    lone surrogate of its bytes) or an argument past 64 bits made orjson raise
    on the writer's thread: every event queued with it was lost, uncounted."""
    odd = "load " + os.fsdecode(b"shard\xff.bin")
    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        with jh.StopWatch("before"):
            pass
        with jh.StopWatch(odd):
            pass
        t.instant("big", {"n": 2**70, odd: odd})
        with jh.StopWatch("after"):
            pass
    events = trace.load_trace(t.paths[0])
    check_valid(events)
    spans = [e for e in events if e["ph"] != "M"]
    shown = "load shard\\udcff.bin"
    assert [e["name"] for e in spans] == ["before", shown, "big", "after"]
    assert spans[2]["args"] == {"n": 2**70, shown: shown}
    assert t.lost == 0


def test_event_arguments_that_are_no_mapping_are_a_type_error_naming_them(tmp_path):
    """``instant("x", 5)`` wrote ``"args": 5`` (the format's args are an
    object) and ``counter("loss", 0.5)`` raised AttributeError on ``.items``."""
    with trace.JSONTraceHandler(folder=tmp_path, merged_trace_filename=None) as t:
        with pytest.raises(TypeError, match=r"args must be a mapping.*got int"):
            t.instant("x", 5)
        with pytest.raises(TypeError, match=r"args must be a mapping.*got str"):
            t.complete("z", 1, 2, args="abc")
        with pytest.raises(TypeError, match=r"thread must be a threading.Thread"):
            t.complete("z", 1, 2, thread="MainThread")
        with pytest.raises(TypeError, match=r"values must be a mapping.*got float"):
            t.counter("loss", 0.5)
        t.instant("fine", {"a": 1})
    events = [e for e in trace.load_trace(t.paths[0]) if e["ph"] != "M"]
    assert [(e["name"], e["args"]) for e in events] == [("fine", {"a": 1})]


def test_spans_open_at_close_are_written_ending_at_the_close(tmp_path):
    """A handler closed while StopWatch spans are open (the close in a
    ``finally`` inside the span, Ctrl-C on its way out, a worker thread still
    in its span) writes each of them, ending at the close and marked
    ``open_at_close``; the file is strict JSON whose spans nest."""
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    t.start()
    started, release = threading.Event(), threading.Event()

    def work():
        with jh.StopWatch("loader"):
            started.set()
            release.wait(30)

    worker = threading.Thread(target=work)
    worker.start()
    assert started.wait(10)
    with pytest.raises(KeyboardInterrupt), jh.StopWatch("train"):
        try:
            with jh.StopWatch("step"):
                time.sleep(0.002)
            raise KeyboardInterrupt
        finally:
            t.close()
    release.set()
    worker.join()
    events = json.loads(t.paths[0].read_text())  # the whole file, strict JSON
    check_valid(events)
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == ["loader", "step", "train"]
    by_name = {e["name"]: e for e in spans}
    train, step, loader = by_name["train"], by_name["step"], by_name["loader"]
    assert train["args"] == {"open_at_close": True}
    assert loader["args"] == {"open_at_close": True}
    assert "args" not in step
    assert train["ts"] <= step["ts"] and step["ts"] + step["dur"] <= (
        train["ts"] + train["dur"]
    )
    assert train["tid"] == step["tid"] != loader["tid"]
    named = [e for e in events if e["name"] == "thread_name"]
    names = {(e["tid"], e["args"]["name"]) for e in named}
    assert (loader["tid"], worker.name) in names


@pytest.mark.parametrize("held", ["handler", "stopwatch", "writer"])
def test_a_span_ended_while_its_thread_holds_a_tracing_lock_does_not_hang(
    tmp_path, held
):
    """The garbage collector may close a generator suspended inside a span at
    any allocation, so also while that thread is inside the trace handler, the
    StopWatch or the trace's writer, holding its lock: ending the span there
    takes the same lock again, which must not wait for itself."""
    sw = jh.StopWatch("gen")

    def gen():
        with sw:
            yield 1
            yield 2

    done = threading.Event()
    t = trace.JSONTraceHandler(folder=str(tmp_path), merged_trace_filename=None)
    t.__enter__()
    lock = {"handler": t._lock, "stopwatch": sw._lock, "writer": t._writer._lock}

    def run():
        g = gen()
        next(g)
        with lock[held]:  # as when the collector closes g right here
            g.close()
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    # (not closed when it hangs: closing would wait on the held lock too)
    assert done.wait(20), f"ending the span waited on the {held}'s own lock"
    worker.join()
    t.close()
    spans = [e for e in trace.load_trace(t.paths[0]) if e.get("name") == "gen"]
    assert len(spans) == 1 and spans[0]["ph"] == "X"
    assert "open_at_close" not in spans[0].get("args", {})


def test_a_handler_never_closed_finishes_its_file_at_exit(tmp_path):
    """A script that starts a trace handler and ends without close(): the
    writer wrote the spans at exit, but the file was left open (a
    ResourceWarning at exit) and without its closing bracket. The handler now
    finishes its file at exit: every span, a complete JSON array."""
    from pathlib import Path

    script = tmp_path / "no_close.py"
    script.write_text(
        "import jaxhistory as jh\n"
        "from jaxhistory import trace\n"
        "import sys\n"
        "t = trace.JSONTraceHandler(folder=sys.argv[1], merged_trace_filename=None)\n"
        "t.start()\n"
        "w = jh.StopWatch('load')\n"
        "for _ in range(3):\n"
        "    with w:\n"
        "        pass\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, "-X", "dev", str(script), str(tmp_path / "traces")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ResourceWarning" not in proc.stderr, proc.stderr[-2000:]
    (path,) = (tmp_path / "traces").glob("*.json")
    events = json.loads(path.read_text())  # the whole array, bracket closed
    assert [e["name"] for e in events if e.get("ph") == "X"] == ["load"] * 3
