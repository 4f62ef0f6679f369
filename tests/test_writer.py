"""Writer: one background thread writing queued items to any target."""

import gc
import queue
import threading
import time
import weakref
from unittest import mock

import pytest

from jaxhistory import _writer


class Target:
    def __init__(self):
        self.calls: list[tuple[list, bool]] = []
        self.lock = threading.Lock()

    def write(self, items, final):
        with self.lock:
            self.calls.append((list(items), final))

    def items(self):
        with self.lock:
            return [x for items, _ in self.calls for x in items]


def test_items_reach_the_target_in_order_and_flush_is_final():
    target = Target()
    writer = _writer.Writer(target, name="test-writer")
    for k in range(100):
        writer.add(k)
    writer.flush()
    assert target.items() == list(range(100)) and target.calls[-1][1] is True
    writer.close()
    writer.close()  # idempotent
    assert writer.closed and target.calls[-1][1] is True
    with pytest.raises(ValueError, match="closed"):
        writer.add(1)


def test_the_thread_writes_on_its_own_without_being_final():
    target = Target()
    writer = _writer.Writer(target)
    writer.add("a")
    deadline = time.monotonic() + 5
    while not target.items() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert target.items() == ["a"]
    assert any(final is False for items, final in target.calls if items)
    writer.close()


def test_close_on_the_writers_own_thread_mid_write_writes_the_rest():
    """A History freed by the garbage collector on the writer's own thread
    closes its writer from inside a write (a finalizer): that must not wait
    for the write it interrupts, and what is queued still reaches the target."""
    target = Target()
    writer = _writer.Writer(target)
    closed_inside = threading.Event()
    original = target.write

    def write(items, final):
        if items and not closed_inside.is_set():
            writer.add("queued meanwhile")
            writer.close()  # what the finalizer does, on this thread
            closed_inside.set()
        original(items, final)

    target.write = write
    writer.add("first")
    writer._wake_thread()
    assert closed_inside.wait(5)
    writer._thread.join(5)
    assert not writer._thread.is_alive()  # not stuck on its own drain lock
    assert target.items() == ["first", "queued meanwhile"]
    assert target.calls[-1][1] is True


def test_a_failing_target_warns_once_and_the_thread_lives_on(monkeypatch):
    monkeypatch.setattr(_writer.Writer, "INTERVAL", 0.01)
    seen = []

    class Flaky:
        def write(self, items, final):
            seen.extend(items)
            if items and items[0] == "bad":
                raise OSError("disk full")

    writer = _writer.Writer(Flaky(), what="the test log")
    with pytest.warns(RuntimeWarning, match="writing the test log failed"):
        writer.add("bad")
        deadline = time.monotonic() + 5
        while "bad" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    writer.add("good")
    writer.flush()
    assert seen[-1] == "good"
    writer.close()


def test_a_hung_target_costs_items_not_the_training_thread(monkeypatch):
    monkeypatch.setattr(_writer.Writer, "WAKE_AT", 4)
    monkeypatch.setattr(_writer.Writer, "MAX_PENDING", 8)
    monkeypatch.setattr(_writer.Writer, "MAX_WAIT", 0.2)
    release = threading.Event()

    class Hung:
        def write(self, items, final):
            release.wait(10)

    writer = _writer.Writer(Hung(), what="the hung log", kept=" (kept elsewhere)")
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"the hung log fell 0 s behind.*kept"):
        for k in range(40):
            writer.add(k)
    assert time.monotonic() - start < 8
    assert writer.dropped > 0 and writer.pending() <= 8
    release.set()
    writer.close()


def _stuck_writer(monkeypatch):
    """A writer (MAX_WAIT 0.3 s) whose thread is stuck inside a write of "a"
    (a stuck file system) until the event returned is set."""
    monkeypatch.setattr(_writer.Writer, "MAX_WAIT", 0.3)
    release = threading.Event()
    entered = threading.Event()

    class Hung:
        def write(self, items, final):
            if items:
                entered.set()
                release.wait(30)

    writer = _writer.Writer(Hung(), what="the hung log")
    writer.add("a")
    writer._wake_thread()
    assert entered.wait(5)  # the thread is stuck inside a write
    return writer, release


def test_flush_and_close_never_wait_longer_than_max_wait_on_a_hung_target(
    monkeypatch,
):
    writer, release = _stuck_writer(monkeypatch)
    writer.add("b")
    done = threading.Event()

    def flush_and_close():
        with pytest.warns(RuntimeWarning, match="has not returned for 0 s"):
            writer.flush()
        writer.close()
        done.set()

    worker = threading.Thread(target=flush_and_close, daemon=True)
    worker.start()
    assert done.wait(10)  # bounded (before: forever)
    assert writer.pending() == 1  # "b" still queued, not lost silently
    release.set()


def test_a_close_interrupted_by_ctrl_c_is_completed_by_the_next_close():
    """Ctrl-C while close waits for the thread: the items still queued, and the
    target's final write, come with the next close (a ``finally:``, atexit)."""
    target = Target()
    writer = _writer.Writer(target)
    for k in range(10):
        writer.add(k)
    with (
        mock.patch.object(writer._thread, "join", side_effect=KeyboardInterrupt),
        pytest.raises(KeyboardInterrupt),
    ):
        writer.close()
    writer.close()
    assert target.items() == list(range(10))
    assert target.calls[-1][1] is True
    writer.close()  # idempotent once done
    assert target.items() == list(range(10))


def test_ctrl_c_inside_add_leaves_the_writer_usable():
    """Ctrl-C (a signal handler's exception) landing inside add, while it holds
    the writer's lock: later adds, the thread and close go on, and nothing hangs."""

    class Interrupted(list):
        def append(self, item):
            raise KeyboardInterrupt

    target = Target()
    writer = _writer.Writer(target)
    writer.add(0)
    with writer._drain_lock:  # (the thread takes nothing meanwhile)
        writer._queue = Interrupted(writer._queue)
        with pytest.raises(KeyboardInterrupt):
            writer.add(1)
        writer._queue = list(writer._queue)

    def go_on():
        writer.add(2)
        writer.close()

    thread = threading.Thread(target=go_on, daemon=True)
    thread.start()
    thread.join(60)  # (only so that a hang fails the test instead of blocking it)
    assert not thread.is_alive(), "the writer's lock was left held"
    assert target.items() == [0, 2]


def test_ctrl_c_as_the_drain_lock_is_taken_leaves_it_free():
    """Ctrl-C (a signal handler's exception) raised just as the drain lock's
    acquire returns, before the write's ``try:``: the lock must not stay
    held, or every later write waits and the log stops."""

    class Interrupted:
        def __init__(self, lock):
            self.lock, self.armed = lock, True

        def acquire(self, *args, **kwargs):
            got = self.lock.acquire(*args, **kwargs)
            if got and self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return got

        def release(self):
            self.lock.release()

    target = Target()
    writer = _writer.Writer(target)
    writer.add(0)
    writer._drain_lock = Interrupted(writer._drain_lock)
    with pytest.raises(KeyboardInterrupt):
        writer.flush()
    writer._drain_lock = writer._drain_lock.lock
    writer.add(1)
    done = threading.Event()

    def go_on():
        writer.flush()
        writer.close()
        done.set()

    threading.Thread(target=go_on, daemon=True).start()
    # (a held lock: the flush gives up after MAX_WAIT with a warning)
    assert done.wait(writer.MAX_WAIT / 2), "the drain lock was left held"
    assert target.items() == [0, 1]
    assert not writer._warned


def test_ctrl_c_in_a_write_leaves_the_drain_lock_free():
    target = Target()
    writer = _writer.Writer(target)
    writer.add(0)
    with (
        mock.patch.object(writer, "_take", side_effect=KeyboardInterrupt),
        pytest.raises(KeyboardInterrupt),
    ):
        writer.flush()
    writer.flush()
    writer.close()
    assert target.items() == [0] and not writer._warned


def test_a_closed_writer_leaves_nothing_registered_at_exit():
    # A process that makes and closes many Histories (one Writer each) must not
    # keep each one's exit callback (and what it holds) until it ends.
    hooks = []
    for _ in range(20):
        w = _writer.Writer(Target())
        w.add(1)
        w.close()
        hooks.append(weakref.ref(w._at_exit.hook))
        del w
    gc.collect()
    assert [h for h in hooks if h() is not None] == []


def test_exit_callbacks_of_objects_freed_unclosed_are_forgotten():
    class Thing:
        def close(self):
            pass

    thing = Thing()
    hook = weakref.ref(_writer.AtExit(thing, "close").hook)
    assert hook() is not None  # registered: atexit holds it
    del thing
    gc.collect()
    assert hook() is None


def test_a_writer_still_open_at_exit_is_closed_by_its_exit_callback():
    t = Target()
    w = _writer.Writer(t)
    hook = w._at_exit.hook  # what atexit calls
    w.add(7)
    hook()
    assert w.closed and t.items() == [7]
    hook()  # a second call (close at exit after an explicit one) is harmless


def test_a_hung_target_is_waited_for_once_not_at_every_fill(monkeypatch):
    """A file system that hangs for the rest of the run: the training thread
    waits MAX_WAIT once; later fills drop the oldest items at once (before: a
    wait of MAX_WAIT every MAX_PENDING / 2 updates, for as long as it hung).
    Once the thread writes again, the back-pressure waits again."""
    monkeypatch.setattr(_writer.Writer, "WAKE_AT", 4)
    monkeypatch.setattr(_writer.Writer, "MAX_PENDING", 8)
    monkeypatch.setattr(_writer.Writer, "MAX_WAIT", 0.2)
    release = threading.Event()
    entered = threading.Event()

    class Hung:
        def write(self, items, final):
            if items and not release.is_set():
                entered.set()
                release.wait(30)

    waits = []

    class Counting:  # the room tokens, counting the waits for them
        def __init__(self):
            self.tokens = queue.SimpleQueue()

        def get(self, timeout=None):
            waits.append(timeout)
            return self.tokens.get(timeout=timeout)

        def get_nowait(self):
            return self.tokens.get_nowait()

        def put(self, token):
            self.tokens.put(token)

    writer = _writer.Writer(Hung(), what="the hung log")
    writer._space = Counting()
    writer.add(-1)
    writer._wake_thread()
    assert entered.wait(5)  # the thread is stuck inside a write
    with pytest.warns(RuntimeWarning, match="fell 0 s behind"):
        for k in range(8):
            writer.add(k)
    assert writer.dropped > 0 and waits  # the first fill waited
    first = len(waits)
    for k in range(8, 200):
        writer.add(k)
    assert len(waits) == first  # no wait at any later fill
    assert writer.pending() <= 8 and writer.dropped >= 180
    release.set()
    writer.flush()  # the thread (or this flush) takes items again
    assert not writer._stalled
    writer.close()


def test_close_waits_at_most_max_wait_in_all_on_a_hung_target(monkeypatch):
    """close() on a thread stuck in a write: the join and the final write's
    wait share one MAX_WAIT (before: MAX_WAIT each, twice the documented
    bound)."""
    writer, release = _stuck_writer(monkeypatch)
    writer.add("b")
    waited = []
    lock, join = writer._drain_lock, writer._thread.join

    class Timed:
        def acquire(self, blocking=True, timeout=-1):
            waited.append(timeout)
            return lock.acquire(blocking, timeout)

        def release(self):
            lock.release()

    def timed_join(timeout=None):
        waited.append(timeout)
        join(timeout)

    writer._drain_lock = Timed()
    with (
        mock.patch.object(writer._thread, "join", timed_join),
        pytest.warns(RuntimeWarning, match="has not returned"),
    ):
        writer.close()
    assert len(waited) == 2 and sum(waited) <= 0.3 + 1e-6, waited
    assert writer.pending() == 1  # "b" still queued, not lost silently
    release.set()


def test_ctrl_c_while_the_thread_starts_leaves_no_thread_behind(monkeypatch):
    """Ctrl-C landing in Writer() after its thread started (start() waits for
    it): nobody holds the writer to close it, so its thread must end (before:
    one thread more for the life of the process at every such Ctrl-C)."""
    started = []
    start = threading.Thread.start

    def interrupted(self):
        start(self)
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _writer.Writer(Target(), name="test-interrupted-writer")
    monkeypatch.undo()
    (thread,) = started
    thread.join(10)  # (only so that a leak fails the test instead of blocking it)
    assert not thread.is_alive()
