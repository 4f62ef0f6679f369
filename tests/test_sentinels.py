"""jaxhistory.sentinels: NonFinite and Spike act before the crash, name the
metric, the step and the device, and never lose a line of the log."""

import json
import logging
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory.sentinels import Event, NonFinite, SentinelError, Spike


def caught_messages(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_a_nan_host_value_warns_at_its_update_and_is_counted(tmp_path, caplog):
    h = jh.History(
        distributed_history=False, report_dir=tmp_path, sentinels=[NonFinite()]
    )
    h.update({"loss": 1.0, "lr": 0.1}, step=1)
    with caplog.at_level(logging.WARNING, logger="jaxhistory"):
        messages = caught_messages(lambda: h.update({"loss": math.nan}, step=2))
    assert messages == ["step 2: 'loss' is NaN"]
    assert "step 2: 'loss' is NaN" in caplog.text
    assert h.state.values("sentinel/nonfinite").tolist() == [1.0]
    assert h.state.steps("sentinel/nonfinite").tolist() == [2]
    h.close()
    lines = [json.loads(x) for x in h.log_path.read_text().splitlines()]
    assert lines[-1]["step"] == 2
    assert lines[-1]["metrics"] == {"loss": "NaN", "sentinel/nonfinite": 1.0}


def test_nonfinite_watches_only_its_patterns():
    h = jh.History(
        distributed_history=False, sentinels=[NonFinite(["train/*", "loss"])]
    )
    messages = caught_messages(
        lambda: h.update({"eval/acc": math.inf, "train": {"loss": -math.inf}}, step=0)
    )
    assert messages == ["step 0: 'train/loss' is -inf"]


def test_a_nan_on_one_device_is_named_with_its_device_and_process(mesh):
    values = np.arange(8, dtype=np.float32)
    values[3] = np.nan
    loss = jax.device_put(values, NamedSharding(mesh, P("data")))
    h = jh.History(distributed_history=True, sentinels=[NonFinite("loss/mean")])
    messages = caught_messages(lambda: (h.update({"loss": loss}, step=5), h.flush()))
    sentinel = [m for m in messages if m.startswith("step 5: 'loss/mean'")]
    assert sentinel == ["step 5: 'loss/mean' is NaN on device 3 (process 0)"]
    assert h.state.values("sentinel/nonfinite").tolist() == [1.0]


def test_device_values_are_checked_within_the_in_flight_window():
    seen = []
    h = jh.History(
        distributed_history=False, sentinels=[NonFinite("x", action=seen.append)]
    )
    h.update({"x": jnp.array([1.0, jnp.inf])}, step=0)
    for s in range(1, 12):  # no flush: later updates find it on the host
        h.update({"x": jnp.array([1.0, 2.0])}, step=s)
    assert [e.step for e in seen] == [0]
    assert seen[0].value == math.inf


def smooth_noisy(n, seed):
    rng = np.random.default_rng(seed)
    trend = 2.0 * np.exp(-np.arange(n) / 3000) + 0.5
    return trend + 0.02 * rng.normal(size=n)


def test_no_false_alarm_on_ten_thousand_smooth_noisy_steps():
    events = []
    spikes = [Spike("a", action=events.append), Spike("b", action=events.append)]
    h = jh.History(distributed_history=False, sentinels=spikes)
    a, b = smooth_noisy(10_000, 0), smooth_noisy(10_000, 1) * 1e-6
    for s in range(10_000):
        h.update({"a": float(a[s]), "b": float(b[s])}, step=s, summarize=False)
    assert events == []
    assert "sentinel/spike" not in h.state


def test_one_spike_does_not_hide_the_next():
    events = []
    h = jh.History(
        distributed_history=False, sentinels=[Spike("loss", action=events.append)]
    )
    loss = smooth_noisy(600, 2)
    loss[300], loss[301], loss[450] = 9.0, 7.0, -3.0
    for s, v in enumerate(loss):
        h.update({"loss": float(v)}, step=s, summarize=False)
    assert [e.step for e in events] == [300, 301, 450]
    assert all(isinstance(e, Event) and e.kind == "spike" for e in events)
    assert "robust deviations from the median" in events[0].detail
    assert h.state.values("sentinel/spike").tolist() == [1.0, 2.0, 3.0]


def test_a_raise_comes_after_the_steps_line_is_in_the_log(tmp_path):
    h = jh.History(
        distributed_history=False,
        report_dir=tmp_path,
        sentinels=[Spike("loss", window=20, action="raise")],
    )
    for s in range(30):
        h.update({"loss": 1.0 + 0.01 * (s % 3)}, step=s)
    with pytest.raises(SentinelError, match="step 30: 'loss' spiked") as info:
        h.update({"loss": 50.0, "lr": 0.1}, step=30)
    assert info.value.event.step == 30 and info.value.event.value == 50.0
    lines = [json.loads(x) for x in h.log_path.read_text().splitlines()]
    assert lines[-1]["step"] == 30  # on disk already
    assert lines[-1]["metrics"]["loss"] == 50.0
    assert h.state.values("loss")[-1] == 50.0  # and recorded
    h.update({"loss": 1.0}, step=31)  # recording goes on after the error
    assert h.state.last_step("loss") == 31
    h.close()  # (its log file is not left for the garbage collector)


def test_a_callable_action_that_raises_is_reported_and_recording_goes_on():
    def broken(event):
        raise KeyError("oops")

    h = jh.History(distributed_history=False, sentinels=[NonFinite(action=broken)])
    messages = caught_messages(lambda: h.update({"loss": math.nan}, step=1))
    assert len(messages) == 1 and "KeyError('oops')" in messages[0]
    assert "recording goes on" in messages[0]
    h.update({"loss": 1.0}, step=2)
    assert h.state.steps("loss").tolist() == [1, 2]


def test_a_sentinel_naming_a_metric_never_recorded_warns_at_finalize(tmp_path):
    h = jh.History(distributed_history=False, sentinels=[Spike("val_loss")])
    h.update({"loss": 1.0}, step=0)
    messages = caught_messages(lambda: h.finalize(tmp_path, plot=False))
    assert any(
        "Spike('val_loss'" in m and "matched no recorded metric" in m for m in messages
    )


def test_the_report_lists_the_events(tmp_path):
    h = jh.History(distributed_history=False, sentinels=[NonFinite()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.update({"loss": 1.0}, step=0)
        h.update({"loss": math.inf}, step=1)
        h.finalize(tmp_path, plot=False)
    report = (tmp_path / "report.md").read_text()
    assert "## Sentinels" in report and "1 event(s): 1 nonfinite." in report
    assert "| 1 | loss | nonfinite | is inf |" in report


def test_spike_needs_enough_values_and_ignores_nonfinite_and_arrays():
    spike = Spike("x", window=10, min_steps=5)
    assert [spike.see("x", s, 1.0) for s in range(4)] == [None] * 4
    assert spike.see("x", 4, 100.0) is None  # 4 values seen: not yet
    assert spike.see("x", 5, math.nan) is None
    assert spike.see("x", 6, np.ones(3)) is None
    assert spike.see("x", 7, 1e6) is not None  # constant window: any change


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: NonFinite(action="explode"), ValueError, "action"),
        (lambda: NonFinite(metrics=[1]), TypeError, "glob"),
        (lambda: NonFinite(metrics=[]), TypeError, "glob"),
        (lambda: Spike(3), TypeError, "metric"),
        (lambda: Spike("x", window=2), ValueError, "window"),
        (lambda: Spike("x", threshold=0), ValueError, "threshold"),
        (lambda: Spike("x", threshold=math.nan), ValueError, "threshold"),
        (lambda: Spike("x", window=10, min_steps=11), ValueError, "min_steps"),
        (lambda: jh.History(sentinels=["loss"]), TypeError, "NonFinite or Spike"),
        (lambda: NonFinite(metrics=5), TypeError, "glob"),
        (lambda: Spike("x", threshold=True), ValueError, "threshold"),
        (lambda: jh.History(sentinels=Spike("x")), TypeError, r"\[Spike"),
        (lambda: Spike("x", window=True), ValueError, "window"),
    ],
)
def test_bad_sentinels_are_refused_naming_what_was_wrong(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_the_plot_of_a_metric_marks_where_its_sentinel_fired(tmp_path):
    from jaxhistory.export import _mpl

    h = jh.History(distributed_history=False)
    for s in range(50):
        h.update({"loss": 1.0 + (5.0 if s == 30 else 0.01 * (s % 3))}, step=s)
    pending = _mpl.start_png(h.state, tmp_path, marks={"loss": [30, 3]})
    (kind, (_data, unit, steps), path) = pending.jobs[0]
    assert kind == "unit" and unit.title == "loss" and steps == [3, 30]
    assert pending.wait() == [path] and path.stat().st_size > 5_000
    events = []
    h2 = jh.History(
        distributed_history=False, sentinels=[Spike("loss", action=events.append)]
    )
    for s in range(50):
        h2.update({"loss": 1.0 + (5.0 if s == 30 else 0.01 * (s % 3))}, step=s)
    assert [e.step for e in events] == [30]


def test_a_sentinel_kind_must_say_what_it_sees():
    from jaxhistory.sentinels import Sentinel

    class Nothing(Sentinel):
        kind = "nothing"

    with pytest.raises(TypeError, match="abstract"):
        Nothing()


def test_sentinels_under_several_threads_see_each_threads_values_once():
    import threading

    events = []
    h = jh.History(
        distributed_history=False,
        sentinels=[
            NonFinite(action=events.append),
            Spike("*/loss", window=50, action=events.append),
        ],
    )

    def run(i):
        rng = np.random.default_rng(i)
        for s in range(1500):
            v = 1.0 + 0.01 * rng.normal()
            if i == 2 and s == 1000:
                v = math.nan
            if i == 3 and s == 1200:
                v = 9.0
            h.update({f"t{i}/loss": v}, step=s, summarize=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = sorted((e.kind, e.metric, e.step) for e in events)
    assert found == [("nonfinite", "t2/loss", 1000), ("spike", "t3/loss", 1200)]
    assert h.state.values("sentinel/nonfinite").tolist() == [1.0]
    assert h.state.values("sentinel/spike").tolist() == [1.0]
    for i in range(4):
        assert h.state.count(f"t{i}/loss") == 1500


def test_a_window_mostly_at_one_value_is_not_read_as_constant():
    """With half the window or more at one value, the median absolute
    deviation is 0, and every other value was a spike: 1, 2, 1, 2, ... fired
    at each 2 while the window held more 1s, and 1, 1, 1.5, ... fired at
    each 1.5. The mean absolute deviation stands in then
    (Iglewicz and Hoaglin's modified z-score); a constant window still fires
    at its first change."""
    for series in ([1.0, 2.0] * 30, [1.0, 1.0, 1.5] * 20):
        spike = Spike("x", window=20)
        fired = [s for s, v in enumerate(series) if spike.see("x", s, v)]
        assert fired == [], (series[:14], fired)
        assert spike.see("x", len(series), 50.0) is not None  # a real spike
    steady = Spike("x", window=20)
    assert all(steady.see("x", s, 3.0) is None for s in range(20))
    assert steady.see("x", 20, 3.001) is not None


def test_numpy_numbers_configure_a_spike():
    spike = Spike(
        "x", window=np.int64(20), threshold=np.float32(4), min_steps=np.int32(5)
    )
    assert (spike.window, spike.threshold, spike.min_steps) == (20, 4.0, 5)


def test_a_constant_float32_metric_moving_by_its_rounding_is_no_spike():
    """A constant window fired at any change, 1e-12 of the value or more: a
    float32 metric off by one rounding step (1.2e-7 of it: a learning rate
    recomputed on the device) was a spike. Changes within float32 rounding
    (8 steps) are not; a larger change still fires at once."""
    lr = np.float32(1e-3)
    for nudge in (1, -1, 8):
        spike = Spike("lr", window=20)
        assert all(spike.see("lr", s, float(lr)) is None for s in range(20))
        moved = lr + nudge * np.spacing(lr)
        assert spike.see("lr", 20, float(moved)) is None, nudge
    spike = Spike("lr", window=20)
    assert all(spike.see("lr", s, float(lr)) is None for s in range(20))
    assert spike.see("lr", 20, float(lr) * (1 + 1e-5)) is not None
    zero = Spike("count", window=20)
    assert all(zero.see("count", s, 0.0) is None for s in range(20))
    assert zero.see("count", 20, 1e-9) is not None  # from 0: any change


def test_finalize_writes_its_outputs_where_warnings_are_errors(tmp_path, caplog):
    """Under -W error (pytest's filterwarnings = error), a "warn" sentinel's
    warning at finalize, or one for a sentinel that matched nothing, was
    raised out of finalize, and no dataset or report was written. The
    warnings go to the jaxhistory logger there, and the outputs come."""
    h = jh.History(
        distributed_history=False, sentinels=[NonFinite("x"), Spike("never")]
    )
    h.update({"x": jnp.array(jnp.nan)}, step=0)  # a device value: seen later
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "jaxhistory"):
        warnings.simplefilter("error", RuntimeWarning)
        h.finalize(tmp_path, plot=False)
    assert (tmp_path / "dataset.nc").is_file() and (tmp_path / "report.md").is_file()
    assert "matched no recorded metric" in caplog.text
    assert "'x'" in caplog.text and "NaN" in caplog.text
    assert h.state.values("sentinel/nonfinite").tolist() == [1.0]


def test_a_callable_action_runs_once_the_steps_line_is_in_the_log(tmp_path):
    """A callable that never returns, or ends the process, must cost the log
    no line: the step that fired it is on disk when it is called."""
    on_disk = []

    def look(event):
        steps = [json.loads(x)["step"] for x in h.log_path.read_text().splitlines()]
        on_disk.append(event.step in steps)

    h = jh.History(
        distributed_history=False,
        report_dir=tmp_path,
        sentinels=[NonFinite(["loss", "x"], action=look)],
    )
    h.update({"loss": 1.0}, step=0)
    h.update({"loss": math.nan, "lr": 0.1}, step=1)
    h.update({"x": jnp.array(jnp.inf)}, step=2)  # a device value: checked at flush
    h.flush()
    assert on_disk == [True, True]
    h.close()


def test_finalize_waits_a_bounded_time_for_a_hung_or_exiting_callable(
    tmp_path, monkeypatch, caplog
):
    """At finalize (sentinels run on device values still in flight) a callable
    action that hangs, or raises SystemExit, gets a warning naming the
    sentinel; finalize goes on and writes its outputs. A hung action is not
    called again for the next event."""
    import threading

    from jaxhistory import sentinels as sentinels_module

    monkeypatch.setattr(sentinels_module, "ACTION_TIMEOUT", 0.5)
    release = threading.Event()
    called = []

    def hang(event):
        called.append(event.metric)
        release.wait(60)

    def leave(event):
        raise SystemExit(3)

    hung, leaving = NonFinite("x*", action=hang), NonFinite("y", action=leave)
    h = jh.History(distributed_history=False, sentinels=[hung, leaving])
    nan = jnp.array(jnp.nan)
    h.update({"x": nan, "x2": nan, "y": jnp.array(jnp.inf)}, step=0)
    outcome = []

    def run():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                h.finalize(tmp_path, plot=False)
            outcome.append([str(w.message) for w in caught])
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)  # (only so that a hang fails the test instead of blocking it)
    release.set()
    assert not thread.is_alive(), "finalize waited for the hung action"
    (messages,) = outcome
    assert isinstance(messages, list), messages
    assert any(repr(hung) in m and "did not return within 0.5 s" in m for m in messages)
    assert any(repr(leaving) in m and "SystemExit(3)" in m for m in messages)
    assert (tmp_path / "dataset.nc").is_file() and (tmp_path / "report.md").is_file()
    assert h.state.values("sentinel/nonfinite").tolist() == [3.0]
    assert called == ["x"]  # not called again while its first call hangs


def test_finalize_waits_for_callable_actions_a_bounded_time_in_all(
    tmp_path, monkeypatch
):
    """ACTION_TIMEOUT bounded each call, so finalize waited that long for each
    hung sentinel, and for a slow action as long as its events took (1,000
    events of a 1 s action: 1,000 s). It is now finalize's time for all the
    calls: each sentinel's actions run on a thread of their own, side by side
    (a hung one holds back no other), and once the time is spent the events
    not reached are not acted on, with a warning naming each sentinel and how
    many of its events were left."""
    import threading

    from jaxhistory import sentinels as sentinels_module

    monkeypatch.setattr(sentinels_module, "ACTION_TIMEOUT", 0.5)
    release = threading.Event()
    called = []

    def hang(event):
        called.append(("hang", event.metric))
        release.wait(60)

    def slow(event):
        called.append(("slow", event.metric))
        time.sleep(0.2)

    first, second = NonFinite("a", action=hang), NonFinite("b", action=hang)
    slowly = NonFinite("c*", action=slow)
    h = jh.History(distributed_history=False, sentinels=[first, second, slowly])
    nan = jnp.array(jnp.nan)
    h.update({"a": nan, "b": nan, **{f"c{i}": nan for i in range(10)}}, step=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h.finalize(tmp_path, plot=False)
    finally:
        release.set()
    messages = [str(w.message) for w in caught]
    slow_calls = sum(1 for who, _ in called if who == "slow")  # (the running one too)
    assert ("hang", "a") in called and ("hang", "b") in called, called
    assert 1 <= slow_calls <= 4, called  # 0.2 s each, in 0.5 s
    for hung in (first, second):
        assert any(repr(hung) in m and "did not return" in m for m in messages)
    (left,) = [m for m in messages if "not acted on" in m]
    n = int(left.split(" event")[0])
    assert repr(slowly) in left and n == 10 - slow_calls, (left, called)
    assert (tmp_path / "dataset.nc").is_file()
    assert h.state.values("sentinel/nonfinite").tolist() == [12.0]
