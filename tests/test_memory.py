"""MemoryTracker, device_memory, compiled_memory, History memory metrics."""

import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory import _memory


class FakeDevice:
    """A device whose memory_stats() returns what the test sets."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return None if self.stats is None else dict(self.stats)


class FakeRss:
    def __init__(self, value):
        self.value = value
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.value


# ----- device_memory ---------------------------------------------------------------
def test_devices_that_are_no_devices_are_a_clear_error():
    """``devices=["cpu"]`` (a name, not a device) measured 0 bytes without a
    word, one device not in a list raised "'Device' object is not iterable",
    and ``devices=[]`` measured nothing. Each is now an error naming it."""
    device = jax.devices()[0]
    for call in (jh.device_memory, lambda d: jh.MemoryTracker(devices=d)):
        with pytest.raises(TypeError, match=r"devices\[1\] is str 'cpu', not a"):
            call([device, "cpu"])
        with pytest.raises(TypeError, match=r"a sequence of devices .*, got Device"):
            call(device)
        with pytest.raises(ValueError, match="devices is empty"):
            call([])
    assert jh.device_memory((device,)).in_use >= 0  # a tuple is a sequence


def test_device_memory_sums_reported_stats():
    a = FakeDevice({"bytes_in_use": 100, "peak_bytes_in_use": 300})
    b = FakeDevice({"bytes_in_use": 50, "peak_bytes_in_use": 80, "extra": 1})
    sample = jh.device_memory([a, b])
    assert (sample.in_use, sample.peak, sample.source) == (150, 380, "memory_stats")


@pytest.mark.parametrize(
    "stats",
    [None, {}, {"bytes_in_use": -1, "peak_bytes_in_use": -1}, RuntimeError("no")],
)
def test_device_memory_without_usable_stats_falls_back_and_has_no_peak(stats):
    sample = jh.device_memory([FakeDevice(stats)])
    assert sample.in_use == 0  # no live JAX arrays on a fake device
    assert sample.peak is None and sample.source == "live_arrays"


def test_a_partial_stats_dict_keeps_the_usage_but_not_the_peak():
    sample = jh.device_memory(
        [FakeDevice({"bytes_in_use": 10}), FakeDevice({"bytes_in_use": 5})]
    )
    assert (sample.in_use, sample.peak) == (15, None)
    mixed = jh.device_memory([FakeDevice({"bytes_in_use": 10}), FakeDevice(None)])
    assert (mixed.in_use, mixed.peak, mixed.source) == (10, None, "mixed")


def test_cpu_devices_count_the_bytes_of_live_arrays():
    devices = jax.local_devices()
    gc.collect()
    before = jh.device_memory(devices)
    assert before.source == "live_arrays" and before.peak is None
    x = jnp.ones((1024, 256), jnp.float32)  # 1 MiB on device 0
    replicated = jax.device_put(
        np.ones(1024, np.float32),
        jax.sharding.NamedSharding(jax.make_mesh((8,), ("d",)), jax.P()),
    )  # 4 KiB on each of 8 devices
    after = jh.device_memory(devices)
    assert after.in_use - before.in_use == 2**20 + 8 * 4096
    assert (
        jh.device_memory(devices[1:2]).in_use - jh.live_array_bytes(devices[1:2]) == 0
    )
    del x, replicated


# ----- MemoryTracker -------------------------------------------------------------
def test_stages_report_host_and_device_deltas():
    rss = FakeRss(1000)
    dev = FakeDevice({"bytes_in_use": 100, "peak_bytes_in_use": 100})
    tracker = jh.MemoryTracker(devices=[dev], rss=rss)
    with tracker.stage("init"):
        rss.value = 1500
        dev.stats = {"bytes_in_use": 400, "peak_bytes_in_use": 900}
    m = tracker.metrics()
    assert m == {
        "before_init_mem_cpu": 1000,
        "before_init_mem_device": 100,
        "init_mem_cpu_alloc_delta": 500,
        "init_mem_cpu_peaked_delta": 0,
        "init_mem_device_alloc_delta": 300,
        "init_mem_device_peaked_delta": 500,  # raised the mark: 900 - 400
    }


def test_device_peak_not_raised_by_a_stage_is_a_lower_bound():
    dev = FakeDevice({"bytes_in_use": 500, "peak_bytes_in_use": 2000})
    tracker = jh.MemoryTracker(devices=[dev], rss=FakeRss(0))
    tracker.start("eval")
    dev.stats = {"bytes_in_use": 200, "peak_bytes_in_use": 2000}  # freed 300
    out = tracker.stop("eval")
    assert out["eval_mem_device_alloc_delta"] == -300
    assert out["eval_mem_device_peaked_delta"] == 300  # max(start, end) - end


def test_host_peak_is_sampled_by_a_thread_that_is_joined_at_stop():
    rss = FakeRss(1000)
    tracker = jh.MemoryTracker(devices=[FakeDevice(None)], rss=rss, interval=0.001)
    tracker.start("train")
    sampler = next(t for t in threading.enumerate() if t.name == "jaxhistory-memory")
    rss.value = 5000  # a spike ...
    deadline = time.monotonic() + 5
    while rss.calls < 5 and time.monotonic() < deadline:
        time.sleep(0.002)
    rss.value = 1200  # ... gone before stop
    out = tracker.stop("train")
    assert not sampler.is_alive()
    assert out["train_mem_cpu_alloc_delta"] == 200
    assert out["train_mem_cpu_peaked_delta"] == 3800
    assert out["train_mem_device_peaked_delta"] is None  # never a made-up 0
    calls = rss.calls
    time.sleep(0.02)
    assert rss.calls == calls  # nothing samples between stages


def test_overlapping_stages_and_a_rerun_stage():
    rss = FakeRss(0)
    tracker = jh.MemoryTracker(devices=[FakeDevice(None)], rss=rss)
    tracker.start("train")
    with tracker.stage("eval"):
        rss.value = 10
        assert tracker.running == ("train", "eval")
    rss.value = 30
    tracker.stop("train")
    with tracker.stage("eval"):  # run again: replaces the earlier figures
        rss.value = 35
    m = tracker.metrics()
    assert m["train_mem_cpu_alloc_delta"] == 30
    assert m["eval_mem_cpu_alloc_delta"] == 5
    assert tracker.running == ()


def test_stage_errors_are_clear_and_lose_nothing():
    tracker = jh.MemoryTracker(devices=[FakeDevice(None)], rss=FakeRss(0))
    with pytest.raises(RuntimeError, match="'train' is not running.*never started"):
        tracker.stop("train")
    with (
        tracker.stage("train"),
        pytest.raises(RuntimeError, match="already running"),
    ):
        tracker.start("train")
    with pytest.raises(RuntimeError, match="already stopped"):
        tracker.stop("train")
    for bad in ("", "  ", None, 3):
        with pytest.raises(ValueError, match="stage name"):
            tracker.start(bad)
    with pytest.raises(ValueError, match="interval"):
        jh.MemoryTracker(interval=0)
    assert "train_mem_cpu_alloc_delta" in tracker.metrics()


def test_a_stage_that_raises_is_still_measured():
    tracker = jh.MemoryTracker(devices=[FakeDevice(None)], rss=FakeRss(0))
    with pytest.raises(KeyError), tracker.stage("test"):
        raise KeyError("boom")
    assert "test_mem_cpu_alloc_delta" in tracker.metrics()
    assert tracker.running == ()


def test_real_tracker_on_cpu_sees_host_and_array_memory():
    tracker = jh.MemoryTracker()
    with tracker.stage("train"):
        host = np.ones(64 * 2**20 // 8)  # 64 MiB of host memory, touched
        dev = jnp.ones((2**20,), jnp.float32)  # 4 MiB of arrays
        dev.block_until_ready()
    m = tracker.metrics()
    assert m["before_init_mem_cpu"] > 0
    assert m["train_mem_cpu_alloc_delta"] + m["train_mem_cpu_peaked_delta"] > 32 * 2**20
    assert m["train_mem_device_alloc_delta"] >= 4 * 2**20
    assert m["train_mem_device_peaked_delta"] is None
    formatted = jh.metrics_format(m)
    assert formatted["train_mem_device_peaked_delta"] == "n/a"
    del host, dev


# ----- compiled_memory -------------------------------------------------------------
def test_compiled_memory_of_a_function_and_of_a_jitted_one():
    x = jnp.ones((256, 256), jnp.float32)
    m = jh.compiled_memory(lambda a: (a @ a).sum(), x)
    assert m["argument"] == 256 * 256 * 4 and m["output"] == 4
    assert m["peak"] >= m["argument"]
    assert set(m) == {"argument", "output", "alias", "temp", "generated_code", "peak"}
    donated = jax.jit(lambda a: a * 2, donate_argnums=0)
    spec = jax.ShapeDtypeStruct((1024,), jnp.float32)
    d = jh.compiled_memory(donated, spec)  # abstract input: compiled, not run
    assert d["argument"] == d["output"] == 4096
    with pytest.raises(TypeError, match="function"):
        jh.compiled_memory(3, x)


# ----- History integration ---------------------------------------------------------
def test_history_records_memory_metrics_and_a_summary_token(monkeypatch):
    monkeypatch.setattr(_memory, "host_rss", lambda: 3 * 2**30)
    h = jh.History(distributed_history=False, memory=True)
    line = h.update({"loss": 0.5})
    assert line.startswith("step=0 loss=0.500000 memory=")
    assert line.endswith("GiB")
    s = h.state
    assert s.values("mem/host_rss").tolist() == [3 * 2**30]
    assert s.values("mem/device_in_use")[0] >= 0
    assert "mem/device_peak" not in s  # CPU: no peak to record
    h.update({"loss": 0.25}, summarize=False)
    assert s.count("loss") == 1 and h.state.count("mem/host_rss") == 2


def test_history_memory_every_n_updates_and_bad_settings():
    h = jh.History(distributed_history=False, memory=3)
    for i in range(7):
        h.update({"loss": float(i)}, summarize=False)
    assert h.state.steps("mem/host_rss").tolist() == [0, 3, 6]
    for bad in (-1, 0.5, "yes"):
        with pytest.raises(ValueError, match="memory"):
            jh.History(memory=bad)


def test_memory_token_uses_device_stats_when_there_are_some():
    from jaxhistory._history import memory_token

    assert memory_token(_memory.MemorySample(2**30, 3 * 2**30, "memory_stats"), 0) == (
        "memory=1.00/3.00GiB"
    )
    # No device peak (CPU): host RSS now and its peak so far.
    assert memory_token(_memory.MemorySample(0, None, "live_arrays"), 2**30, 2**31) == (
        "memory=1.00/2.00GiB"
    )


# ----- regressions ----------------------------------------------------------------
def test_stop_on_one_thread_and_start_on_another_never_hang():
    def rss():
        if threading.current_thread().name == "jaxhistory-memory":
            time.sleep(0.05)  # a slow sample: the old sampler is mid-read
        return 0

    tracker = jh.MemoryTracker(devices=[FakeDevice(None)], rss=rss, interval=0.001)
    tracker.start("a")
    time.sleep(0.01)
    stopper = threading.Thread(target=tracker.stop, args=("a",))
    stopper.start()
    tracker.start("b")
    stopper.join(timeout=5)
    assert not stopper.is_alive()
    tracker.stop("b")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        t.name == "jaxhistory-memory" for t in threading.enumerate()
    ):
        time.sleep(0.01)
    assert not any(t.name == "jaxhistory-memory" for t in threading.enumerate())


def test_device_peaked_delta_is_per_device_then_summed():
    gib = 2**30
    d0 = FakeDevice({"bytes_in_use": 1 * gib, "peak_bytes_in_use": 10 * gib})
    d1 = FakeDevice({"bytes_in_use": 5 * gib, "peak_bytes_in_use": 5 * gib})
    tracker = jh.MemoryTracker(devices=[d0, d1], rss=FakeRss(0))
    tracker.start("train")
    d1.stats = {"bytes_in_use": 5 * gib, "peak_bytes_in_use": 6 * gib}
    out = tracker.stop("train")
    # Device 1 rose to 6 GiB and ends at 5; device 0's old 10 GiB mark is not
    # this stage's.
    assert out["train_mem_device_peaked_delta"] == 1 * gib
    assert out["train_mem_device_alloc_delta"] == 0


def test_a_peak_without_bytes_in_use_is_not_used():
    sample = jh.device_memory([FakeDevice({"peak_bytes_in_use": 3 * 2**30})])
    assert sample.peak is None and sample.source == "live_arrays"


def test_a_failing_measurement_at_stop_keeps_the_stage_running():
    rss = FakeRss(0)
    tracker = jh.MemoryTracker(devices=[FakeDevice(None)], rss=rss)
    tracker.start("eval")

    def broken():
        raise OSError("no /proc")

    tracker._rss = broken
    with pytest.raises(OSError):
        tracker.stop("eval")
    assert tracker.running == ("eval",)
    tracker._rss = rss
    assert "eval_mem_cpu_alloc_delta" in tracker.stop("eval")


def test_history_memory_goes_into_the_same_jsonl_line(tmp_path):
    import json

    path = tmp_path / "log.jsonl"
    h = jh.History(distributed_history=False, memory=True, jsonl_path=path)
    h.update({"loss": 0.5}, summarize=False)
    h.update({"loss": 0.25}, summarize=False)
    h.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    assert set(lines[0]["metrics"]) == {"loss", "mem/host_rss", "mem/device_in_use"}
