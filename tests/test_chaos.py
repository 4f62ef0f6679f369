"""Seeded chaos: a History whose sinks and sentinel actions raise, sleep or
hang at random, fed by several threads at once (updates, attaches, flushes,
closes) while its log is deleted or its folder made unwritable. The log keeps
every step's line once and in order, close and finalize return within their
bounds, every misbehaving sink is named in a warning, the training threads
never see a sink's error, and the sinks' queues stay bounded."""

import math
import os
import random
import shutil
import threading
import time
import warnings

import numpy as np
import orjson
import pytest

import jaxhistory as jh
from jaxhistory import sentinels as sentinels_module
from jaxhistory._writer import Writer
from jaxhistory.sentinels import NonFinite, Spike
from jaxhistory.sinks import _feed

SEEDS = range(6)
TIMEOUT = 0.5  # SinkFeed.TIMEOUT here (5 s in a run): bounds below scale with it
EXTRAS = 0.5  # EXTRAS_TIMEOUT and ACTION_TIMEOUT here (60 s in a run)
QUEUED = 128  # SinkFeed.MAX_QUEUED here (16,384 in a run), so hung sinks drop
ERRORS = (RuntimeError, OSError, ValueError, KeyboardInterrupt, SystemExit)
WAIT = 60.0  # no wait here is longer: a failure never hangs the suite


class Chaos:
    """A sink whose calls, by its own seeded plan, return, raise, sleep or
    hang until ``release`` is set. It remembers what it did."""

    def __init__(self, seed: int, release: threading.Event, hang: float):
        self.rng = random.Random(seed)  # only its own thread draws
        self.release, self.hang = release, hang
        self.raised: set[str] = set()
        self.hanging = 0  # calls hung now
        self.steps: list = []  # the steps of the records it was given
        self.lock = threading.Lock()

    def _act(self, what: str) -> None:
        with self.lock:
            r = self.rng.random()
            error = self.rng.choice(ERRORS)
            pause = self.rng.uniform(0, 0.004)
        if r < 0.06:
            self.raised.add(what)
            raise error(f"chaos in {what}")
        if r < 0.06 + self.hang:
            self.hanging += 1
            try:
                self.release.wait(WAIT)
            finally:
                self.hanging -= 1
        elif r < 0.3:
            time.sleep(pause)

    def write(self, record):
        self.steps.append(record.step)
        self._act("write")

    def flush(self):
        self._act("flush")

    def close(self):
        self._act("close")

    def log_table(self, key, columns, rows):
        self._act("log_table")


class ChaosBatch(Chaos):
    def write_batch(self, batch):
        self.steps.extend(batch.steps)
        self._act("write")


class Action:
    """A sentinel's action: returns, raises, sleeps or (once) hangs until
    ``release`` is set."""

    def __init__(self, seed: int, release: threading.Event, name: str):
        self.rng = random.Random(seed)
        self.release, self.name = release, name
        self.raised = False
        self.hung = threading.Event()
        self.thread = None  # the thread its hung call holds
        self.lock = threading.Lock()

    def __repr__(self):
        return f"Action({self.name})"

    def __call__(self, event):
        with self.lock:
            r = self.rng.random()
            hang = r > 0.9 and not self.hung.is_set()
            if hang:
                self.hung.set()
                self.thread = threading.current_thread()
        if r < 0.3:
            self.raised = True
            raise self.rng.choice((RuntimeError, ValueError, ZeroDivisionError))(
                f"chaos in {self.name}"
            )
        if hang:
            self.release.wait(WAIT)
        elif r < 0.6:
            time.sleep(0.002)


def _vandal(rng: random.Random, folder, h, stop: threading.Event) -> str:
    """At a random point, deletes the log, removes its folder, or puts a
    plain file where the folder was for a while (nothing can be written
    there), then puts a folder back. Returns what it did."""
    stop.wait(rng.uniform(0.05, 0.6))
    what = rng.choice(["unlink", "rmtree", "unwritable", "nothing"])
    path = h.log_path
    if what == "unlink":
        try:
            os.unlink(path)
        except FileNotFoundError:
            what = "nothing (no log yet)"
    elif what == "rmtree":
        shutil.rmtree(folder, ignore_errors=True)
    elif what == "unwritable":
        shutil.rmtree(folder, ignore_errors=True)
        try:
            folder.write_bytes(b"")
        except OSError:  # (the writer made the folder again meanwhile)
            what = "nothing (raced)"
        else:
            stop.wait(rng.uniform(0.05, 0.3))
            folder.unlink()
            folder.mkdir(exist_ok=True)
    return what


def _scenario(seed: int, folder, release, out: dict) -> None:
    rng = random.Random(seed)
    sinks = [
        rng.choice((Chaos, ChaosBatch))(rng.randrange(2**32), release, hang)
        for hang in (0.0, rng.choice((0.0, 0.002, 0.01)), rng.choice((0.002, 0.02)))
    ]
    actions = [Action(rng.randrange(2**32), release, n) for n in ("nan", "spike")]
    watch = [
        NonFinite(["loss", "x"], action=actions[0]),
        Spike("x", window=20, threshold=4.0, action=actions[1]),
    ]
    h = jh.History(
        distributed_history=False,
        report_dir=folder,
        run_name=f"chaos{seed}",
        sinks=sinks,
        sentinels=watch,
    )
    out.update(h=h, sinks=sinks, actions=actions, sentinels=watch)
    errors: list = []
    lock = threading.Lock()
    stop = threading.Event()
    feeds = h._recorder.out.feed._feeds
    peaks = {"queued": 0, "pending": 0}
    closes = [0]
    updates = [0]

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as err:  # the training thread saw it
                errors.append(err)

        return run

    def train(k: int):
        r = random.Random(rng.randrange(2**32) + k)
        for _ in range(r.randrange(60, 160)):
            x = r.gauss(0, 1) if r.random() > 0.03 else r.choice((40.0, math.inf))
            loss = math.nan if r.random() < 0.03 else r.random()
            metrics = {"loss": loss, "x": x}
            if r.random() < 0.2:
                metrics["acc"] = {"top1": r.random()}  # another key set
            with lock:
                updates[0] += 1
            h.update(metrics, summarize=r.random() < 0.5)
            if r.random() < 0.1:
                time.sleep(r.uniform(0, 0.005))
            if threading.current_thread() in {a.thread for a in actions}:
                return  # (released at the end: it records no more)

    def attach(k: int):
        r = random.Random(rng.randrange(2**32) + k)
        for i in range(r.randrange(20, 60)):
            h.attach({"side": {f"t{k}": r.random(), "n": i}})
            time.sleep(r.uniform(0, 0.004))

    def flush():
        r = random.Random(rng.randrange(2**32))
        for _ in range(r.randrange(2, 6)):
            time.sleep(r.uniform(0, 0.15))
            if r.random() < 0.25:
                h.close()  # mid-run: the next update opens the log again
                closes[0] += 1
            else:
                h.flush()

    def monitor():
        while not stop.wait(0.005):
            peaks["queued"] = max(peaks["queued"], *(f.queued for f in feeds))
            writer = h._recorder.out.writer
            if writer is not None:
                peaks["pending"] = max(peaks["pending"], writer.pending())

    vandalism = []
    trainers = [
        threading.Thread(target=guarded(lambda k=k: train(k))) for k in (0, 1, 2)
    ]
    others = [
        threading.Thread(target=guarded(lambda: attach(0))),
        threading.Thread(target=guarded(lambda: attach(1))),
        threading.Thread(target=guarded(flush)),
        threading.Thread(
            target=lambda: vandalism.append(_vandal(rng, folder, h, stop))
        ),
    ]
    watcher = threading.Thread(target=monitor, daemon=True)
    out["threads"] = [*trainers, *others, watcher]
    watcher.start()
    for t in others + trainers:
        t.daemon = True
        t.start()
    deadline = time.monotonic() + WAIT
    for t in others:
        t.join(max(deadline - time.monotonic(), 0))
    # (a trainer whose update holds a hung sentinel action is left to it: the
    # action holds the thread that found the event, as documented)
    while time.monotonic() < deadline:
        held = {a.thread for a in actions}
        if not any(t.is_alive() and t not in held for t in trainers):
            break
        time.sleep(0.01)
    held = {a.thread for a in actions}
    out["threads_done"] = not any(
        t.is_alive() for t in others + [t for t in trainers if t not in held]
    )
    # nothing is left attached for close to record at an earlier step's line
    guarded(lambda: h.update({"loss": 0.5, "x": 0.0}))()
    folder.mkdir(exist_ok=True)
    t0 = time.monotonic()
    guarded(h.close)()
    out["close_s"] = time.monotonic() - t0
    out["hung_at_close"] = [s.hanging > 0 for s in sinks]
    t0 = time.monotonic()
    try:
        h.finalize(plot=False)
    except BaseException as err:
        errors.append(err)
    out["finalize_s"] = time.monotonic() - t0
    stop.set()
    watcher.join(WAIT)
    out.update(errors=errors, peaks=peaks, vandalism=vandalism, closes=closes[0])
    out["updates"] = updates[0] + 1
    out["dropped"] = [f.dropped for f in feeds]
    out["names"] = [f.name for f in feeds]


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("seed", SEEDS)
def test_chaos(seed, tmp_path, monkeypatch):
    monkeypatch.setattr(_feed.SinkFeed, "TIMEOUT", TIMEOUT)
    monkeypatch.setattr(_feed.SinkFeed, "MAX_QUEUED", QUEUED)
    monkeypatch.setattr(_feed, "EXTRAS_TIMEOUT", EXTRAS)
    monkeypatch.setattr(sentinels_module, "ACTION_TIMEOUT", EXTRAS)
    folder = tmp_path / "run"
    release = threading.Event()
    before = set(threading.enumerate())
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = threading.Thread(
            target=_scenario, args=(seed, folder, release, out), daemon=True
        )
        worker.start()
        worker.join(WAIT)
        hung = worker.is_alive()
        release.set()  # every hung sink and action goes on, and ends
        ours = ("jaxhistory-sink", "jaxhistory-sentinel")
        threads = {worker, *out.get("threads", ())}
        for t in [*threads, *threading.enumerate()]:
            if t not in before and (t in threads or t.name.startswith(ours)):
                t.join(WAIT)
    assert not hung, f"seed {seed}: the History work did not finish in {WAIT} s"
    assert out["threads_done"], "an attach or flush thread did not finish"
    assert out["errors"] == [], out["errors"]  # no sink's error reached a caller

    # bounds: close waits TIMEOUT for the sinks (the log's writer is not hung);
    # finalize also the extras of each sink (EXTRAS each) and the actions
    sinks, h = out["sinks"], out["h"]
    assert out["close_s"] < 10 * TIMEOUT + 5, out["close_s"]
    assert out["finalize_s"] < 10 * (TIMEOUT + EXTRAS * (len(sinks) + 2)) + 20
    assert out["peaks"]["queued"] <= QUEUED
    assert out["peaks"]["pending"] <= Writer.MAX_PENDING + 8

    # the log: every step once, in order, as the history has it
    state = h.state
    # (where the log could not be opened again, finalize wrote it here)
    log = folder / f"{h.run_id}.jsonl"
    lines = [orjson.loads(x) for x in log.read_bytes().splitlines()]
    steps = [x["step"] for x in lines]
    assert steps == sorted(steps)
    assert sorted(set(steps)) == state.all_steps().tolist()
    # a close may end a step's line before an update of that step: one more
    assert len(steps) - len(set(steps)) <= out["closes"], out["vandalism"]
    logged = jh.HistoryState.from_jsonl(log)
    assert sorted(logged.keys) == sorted(state.keys)
    for name in state.keys:
        assert logged.steps(name).tolist() == state.steps(name).tolist(), name
        assert _same(logged.values(name), state.values(name)), name
    assert state.steps("loss").size == out["updates"]  # every update recorded

    # each sink: what it got is in order, and all of it in the history
    recorded = set(state.all_steps().tolist())
    for sink in sinks:
        assert sink.steps == sorted(sink.steps)
        assert set(sink.steps) <= recorded

    # warnings name each sink that misbehaved, and each action that raised
    texts = [str(w.message) for w in caught]

    def said(text):
        return any(text in t for t in texts)

    for name, sink, dropped, stuck in zip(
        out["names"], sinks, out["dropped"], out["hung_at_close"], strict=True
    ):
        assert name.endswith(f"(sinks[{sinks.index(sink)}])")
        for what in sink.raised - {"log_table"}:
            assert said(f"sink {name}: {what} failed"), (what, texts)
        if "log_table" in sink.raised:
            assert said(f"sink {name}: log_table('training_history') failed")
        if dropped:
            assert said(f"sink {name} fell {QUEUED} records behind"), texts
        if stuck:
            assert said(f"sink {name} did not finish within"), texts
    for s, action in zip(out["sentinels"], out["actions"], strict=True):
        if action.raised:
            assert said(f"the action of {s!r} raised"), texts
