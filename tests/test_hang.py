"""The hang watch: which processes a report names, and when."""

import json
import logging
import time

import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory._hang import HangWatch, check_hang_timeout, stop_all

pytestmark = pytest.mark.filterwarnings("ignore:processes may hang")


class Store:
    """The key-value store's calls the watch makes, in memory."""

    def __init__(self):
        self.data = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.data[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


def entry(process, step, seq, span=None, done=False):
    key = f"jaxhistory/hang/k/{process}"
    return key, json.dumps([step, seq, f"host{process}", span, done])


@pytest.fixture
def watch():
    w = HangWatch(10.0, Store(), "k", me=0, count=3)
    w._stop.set()  # checked by hand here: the thread stays out of it
    yield w
    w.stop()


def test_a_process_behind_the_others_is_named_after_the_timeout(watch):
    posts = [entry(0, 5, 1), entry(1, 4, 1, span="data"), entry(2, 5, 1)]
    assert watch.check(posts, 0.0) == ([], 5)
    assert watch.check(posts, 9.9)[0] == []
    stalled, front = watch.check(posts, 10.0)
    assert front == 5 and [s.process for s in stalled] == [1]
    (s,) = stalled
    assert (s.host, s.step, s.span, s.responding) == ("host1", 4, "data", False)
    assert "process 1 ('host1') at step 4 in 'data'" in s.text()


def test_a_report_is_made_once_and_again_after_the_run_moves(watch):
    posts = [entry(0, 5, 1), entry(1, 4, 1), entry(2, 5, 1)]
    watch.check(posts, 0.0)
    assert len(watch.check(posts, 10.0)[0]) == 1
    assert watch.check(posts, 20.0)[0] == []  # the same episode
    moved = [entry(0, 6, 2), entry(1, 6, 2), entry(2, 6, 2)]
    assert watch.check(moved, 21.0)[0] == []
    later = [entry(0, 7, 3), entry(1, 6, 3), entry(2, 7, 3)]
    watch.check(later, 22.0)
    assert [s.process for s in watch.check(later, 32.0)[0]] == [1]


def test_a_process_that_keeps_posting_is_responding(watch):
    watch.check([entry(0, 5, 1), entry(1, 4, 1), entry(2, 5, 1)], 0.0)
    stalled, _ = watch.check([entry(0, 5, 2), entry(1, 4, 9), entry(2, 5, 2)], 10.0)
    assert stalled[0].responding and "not responding" not in stalled[0].text()


def test_when_nobody_moves_the_one_whose_posts_stopped_is_named(watch):
    watch.check([entry(0, 5, 1), entry(1, 5, 1), entry(2, 5, 1)], 0.0)
    stalled, front = watch.check([entry(0, 5, 8), entry(1, 5, 1), entry(2, 5, 8)], 12.0)
    assert front == 5 and [s.process for s in stalled] == [1]


def test_a_long_pause_of_everyone_is_not_a_hang(watch):
    """Everyone at one step and posting (a checkpoint, an evaluation)."""
    watch.check([entry(p, 5, 1) for p in range(3)], 0.0)
    assert watch.check([entry(p, 5, 2) for p in range(3)], 100.0)[0] == []


def test_a_process_that_never_posted_is_named(watch):
    watch.check([entry(0, 3, 1), entry(2, 3, 1)], 0.0)
    stalled, _ = watch.check([entry(0, 3, 2), entry(2, 3, 2)], 10.0)
    assert [(s.process, s.step, s.host) for s in stalled] == [(1, -1, "?")]
    assert "no step yet" in stalled[0].text()


def test_a_process_that_closed_level_with_the_others_is_never_named(watch):
    """Done at the step the others wait at: it is not the one they wait for."""
    watch.check([entry(0, 9, 1), entry(1, 9, 1, done=True), entry(2, 9, 1)], 0.0)
    posts = [entry(0, 9, 2), entry(1, 9, 1, done=True), entry(2, 9, 2)]
    assert watch.check(posts, 100.0)[0] == []


def test_a_process_that_closed_while_the_others_move_is_not_named(watch):
    watch.check([entry(0, 5, 1), entry(1, 4, 1, done=True), entry(2, 5, 1)], 0.0)
    for t in range(1, 30):  # the others go on, a step every second
        posts = [entry(0, 5 + t, t), entry(1, 4, 1, done=True), entry(2, 5 + t, t)]
        assert watch.check(posts, float(t))[0] == []


def test_a_process_that_closed_behind_the_others_is_named_once_they_wait(watch):
    """Process 1 closed at step 4 while the others went on to step 5, where
    they wait for it (in a collective it will never join)."""
    watch.check([entry(0, 4, 1), entry(1, 4, 1), entry(2, 4, 1)], 0.0)
    posts = [entry(0, 5, 2), entry(1, 4, 2, done=True), entry(2, 5, 2)]
    assert watch.check(posts, 1.0)[0] == []
    assert watch.check(posts, 10.9)[0] == []
    stalled, front = watch.check(posts, 11.0)
    assert front == 5 and [s.process for s in stalled] == [1]
    (s,) = stalled
    assert s.closed and s.step == 4
    assert s.text() == "process 1 ('host1') closed at step 4"
    assert watch.check(posts, 20.0)[0] == []  # the same episode


def test_a_process_that_closed_before_any_step_is_named_so(watch):
    watch.check([entry(0, 0, 1), entry(1, -1, 1, done=True), entry(2, 0, 1)], 0.0)
    posts = [entry(0, 0, 2), entry(1, -1, 1, done=True), entry(2, 0, 2)]
    (s,), _ = watch.check(posts, 10.0)
    assert s.text() == "process 1 ('host1') closed before any step"


def test_the_only_process_left_names_the_one_that_closed(caplog):
    """Process 0 made one update more than process 1, which closed: process
    0 alone is live, waiting; its report names process 1 and its step."""
    w = HangWatch(10.0, Store(), "k", me=0, count=2)
    w._stop.set()
    try:
        w.check([entry(0, 41, 1), entry(1, 41, 1)], 0.0)
        posts = [entry(0, 42, 2), entry(1, 41, 2, done=True)]
        assert w.check(posts, 1.0)[0] == []
        stalled, front = w.check(posts, 11.0)
        assert front == 42 and [s.text() for s in stalled] == [
            "process 1 ('host1') closed at step 41"
        ]
        with (
            caplog.at_level(logging.WARNING, logger="jaxhistory"),
            pytest.warns(RuntimeWarning, match="closed at step 41"),
        ):
            w._tell(stalled, front)
        assert "process 1 ('host1') closed at step 41; the others are at " in (
            caplog.text
        )
    finally:
        w.stop()


def test_this_process_does_not_name_itself_as_behind(watch):
    watch.check([entry(0, 4, 1), entry(1, 5, 1), entry(2, 5, 1)], 0.0)
    posts = [entry(0, 4, 2), entry(1, 5, 2), entry(2, 5, 2)]
    assert watch.check(posts, 10.0)[0] == []


def test_entries_that_are_not_the_watchs_are_skipped(watch):
    posts = [
        ("jaxhistory/hang/k/x", "[1, 1, 'h', null, false]"),
        ("jaxhistory/hang/k/1", "not json"),
        ("jaxhistory/hang/k/2", json.dumps([1, 2])),
        entry(0, 5, 1),
    ]
    watch.check(posts, 0.0)
    stalled, _ = watch.check(posts, 10.0)
    assert sorted(s.process for s in stalled) == [1, 2]  # never posted, as read


def test_the_thread_posts_and_reports(caplog):
    store = Store()
    store.data.update(dict([entry(1, 0, 1)]))
    got = []
    with caplog.at_level(logging.WARNING, logger="jaxhistory"):
        w = HangWatch(0.5, store, "k", me=0, count=2, report=lambda s, f: got.append(f))
        w.beat(3)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.warns(RuntimeWarning):  # one more report, after the run moves
            store.data.update(dict([entry(1, 3, 2)]))
            w.beat(4)
            while len(got) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        w.stop()
    assert got[:2] == [3, 4], got
    assert "process 1 ('host1') at step 0" in caplog.text
    assert json.loads(store.data["jaxhistory/hang/k/0"])[0] == 4
    assert json.loads(store.data["jaxhistory/hang/k/0"])[4] is True  # done


def test_a_report_that_raises_is_logged_and_the_watch_goes_on(caplog):
    store = Store()

    def report(stalled, front):
        raise OSError("disk full")

    with caplog.at_level(logging.WARNING, logger="jaxhistory"):
        w = HangWatch(0.2, store, "k", me=0, count=2, report=report)
        w.beat(1)
        deadline = time.monotonic() + 10
        while "disk full" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        w.stop()
    assert "could not write the hang report" in caplog.text


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("300", TypeError),
        (True, TypeError),
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
    ],
)
def test_bad_hang_timeouts_are_refused(value, error):
    with pytest.raises(error, match="hang_timeout"):
        check_hang_timeout(value)


def test_hang_timeout_off_and_on():
    assert check_hang_timeout(None) is None and check_hang_timeout(0) is None
    assert check_hang_timeout(False) is None and check_hang_timeout(2) == 2.0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_the_others_name_a_process_that_sleeps_or_is_stopped(how):
    """Three processes; process 1 sleeps (or is SIGSTOPped) at step 3, the
    others wait for it in their next update. Both others name it, with its
    host, step and open span, within hang_timeout + 5 s."""
    # Stopped, it is "not responding" once its posts are 2 periods + 0.5 s old
    # (1.3 s at hang_timeout=2, 2.1 s at 4): it stops 1.5 periods into the
    # others' wait, so 4 s leaves 0.7 s to spare on a loaded machine.
    timeout = 2.0 if how == "sleep" else 4.0
    results = jh.launch_local(
        "mp_workers:hang_run", 3, 1, args=(how, timeout), timeout=120
    )
    for process in (0, 2):
        r = results[process]
        assert r["reports"], results
        text = r["reports"][0]
        assert "process 1 (" in text and "at step 2 in 'load batch'" in text, text
        assert "others are at step 3" in text, text
        assert timeout <= r["latency"] <= timeout + 5, r
        if how == "stop":
            assert "not responding" in text, text
        assert r["logged"] == [1, 2]  # process 1 at step 2, in the log
    assert results[1]["reports"] == []  # nobody waited long for the others


def test_a_watch_whose_runtime_is_gone_stops_calling_it():
    calls = []

    class Counting(Store):
        def key_value_set(self, key, value, allow_overwrite=False):
            calls.append(key)
            super().key_value_set(key, value, allow_overwrite)

    alive = [True]
    w = HangWatch(0.5, Counting(), "k", me=0, count=2, alive=lambda: alive[0])
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert calls, "the watch never posted"
    alive[0] = False
    w._thread.join(5)
    assert not w._thread.is_alive()  # ended itself at its next period
    seen = len(calls)
    w.stop()  # nothing posted to a runtime that is gone
    assert len(calls) == seen


def test_alive_that_raises_counts_as_gone():
    def alive():
        raise RuntimeError("runtime torn down")

    w = HangWatch(0.5, Store(), "k", me=0, count=2, alive=alive)
    w._thread.join(5)
    assert not w._thread.is_alive()
    w.stop()


def test_stop_all_stops_every_watch_once_and_posts_done():
    stores = [Store(), Store()]
    watches = [HangWatch(10.0, s, "k", me=0, count=2) for s in stores]
    for w in watches:
        w.beat(7)
    stop_all()
    for w, s in zip(watches, stores, strict=True):
        assert not w._thread.is_alive()
        step, seq, _, _, done = json.loads(s.data["jaxhistory/hang/k/0"])
        assert (step, done) == (7, True)
        w.stop()  # again: nothing more posted
        assert json.loads(s.data["jaxhistory/hang/k/0"])[1] == seq
    stop_all()  # none left: nothing to do


@pytest.mark.slow
@pytest.mark.parametrize("shutdown", [False, True], ids=["exit", "shutdown"])
def test_a_process_leaving_histories_open_exits_cleanly(shutdown):
    """A watch thread still inside the runtime's client when the interpreter
    ends aborts the process ("terminate called after throwing an instance of
    ''"): each launch left 8 watches posting every 0.1 s; before the fix most
    launches lost a process that way."""
    got = jh.launch_local(
        "mp_workers:unclosed_histories", 2, 1, args=(8, shutdown), timeout=120
    )
    assert got == [8, 8]


def test_hang_timeouts_from_numpy_are_seconds_too():
    """A timeout read from a NumPy array or a config (np.float32, np.int64)
    is a number of seconds, not a TypeError saying it is not a number."""
    assert check_hang_timeout(np.float32(2.5)) == 2.5
    assert check_hang_timeout(np.int64(300)) == 300.0
    assert type(check_hang_timeout(np.int64(300))) is float
    with pytest.raises(ValueError, match="hang_timeout"):
        check_hang_timeout(np.float32("nan"))
    with pytest.raises(TypeError, match="hang_timeout"):
        check_hang_timeout(np.bool_(True))


def assert_named_closed(results: list, closed_at: int, front: int) -> None:
    """Process 1 alone reported, within hang_timeout (2 s) + 5 s, that process 0
    closed at ``closed_at`` while it is at ``front``; both recorded every step."""
    first, second = results
    assert first["reports"] == [], results
    text = second["reports"][0]
    assert "process 0 (" in text and f") closed at step {closed_at};" in text, text
    assert f"the others are at step {front}" in text, text
    assert second["latency"] <= 2.0 + 5, second
    assert [r["steps"] for r in results] == [list(range(6))] * 2


@pytest.mark.slow
def test_the_others_name_a_process_that_closed_early():
    """Process 0 closes at step 2 while process 1 goes on: process 1 waits in
    step 3's reduction, and its report names process 0 and the step it closed
    at, within hang_timeout + 5 s of the close."""
    results = jh.launch_local(
        "mp_workers:closed_behind", 2, 1, args=(2, 5, 2.0), timeout=60
    )
    assert_named_closed(results, closed_at=2, front=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "summarize", "log", "end"),
    [
        (1, True, False, "close"),
        (2, False, True, "close"),
        (2, False, False, "finalize"),
    ],
    ids=["in-update", "in-close", "in-finalize"],
)
def test_one_update_more_on_one_process_is_named(devices, summarize, log, end):
    """log_every=1: process 1 records step 5, process 0 closes after step 4.
    Process 1 waits in step 5's reduction, a device collective nothing can
    cancel: in update (one device per process: its launch waits; or for the
    summary line), or, with two, where close waits for the log's values or
    finalize for the recorded ones. Its report names process 0 and the step
    it closed at within hang_timeout + 5 s: the watch runs until the values
    it waits for are in."""
    results = jh.launch_local(
        "mp_workers:closed_behind",
        2,
        devices,
        args=(4, 5, 2.0, summarize, log, end),
        timeout=60,
    )
    assert_named_closed(results, closed_at=4, front=5)


def test_close_stops_the_watch_also_where_closing_the_log_raises(monkeypatch):
    """close stops the hang watch once the log is closed; where closing it
    raised (a device value that failed to arrive, Ctrl-C), the watch was never
    stopped: its thread went on posting this process as live at its last step
    after close, for the others to report as behind."""
    h = jh.History(distributed_history=False)
    h.update({"x": 1.0}, step=0)
    recorder = h._recorder
    stopped = []
    monkeypatch.setattr(recorder.job, "stop_watch", lambda **kw: stopped.append(1))

    def fail():
        raise KeyboardInterrupt

    monkeypatch.setattr(recorder.out, "close", fail)
    with pytest.raises(KeyboardInterrupt):
        h.close()
    assert stopped == [1]


def test_a_settling_stop_stops_the_watch_also_where_the_reduction_failed():
    """stop_watch(settle=True) (finalize) waits for this process's last
    reduction first; where that wait raised (a device computation that
    failed), the watch was left running after finalize raised."""

    class Watch:
        stopped = False

        def stop(self):
            Watch.stopped = True

    class Failed:
        def block_until_ready(self):
            raise RuntimeError("the reduction failed")

    job = jh.History(distributed_history=False)._recorder.job
    job._hang, job.reducer.last_reduced = Watch(), Failed()
    with pytest.raises(RuntimeError, match="the reduction failed"):
        job.stop_watch(settle=True)
    assert Watch.stopped and job._hang is None
