"""Sinks: one conformance suite over every sink, History fan-out, TensorBoard, W&B."""

import io
import json
import math
import os
import re
import struct
import threading
import time
import warnings
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory._files import NotAFile
from jaxhistory.sinks import (
    ConsoleSink,
    JsonlSink,
    NullSink,
    Record,
    TensorBoardSink,
    WandbSink,
)
from jaxhistory.sinks import _base as sinks_base

RECORDS = [
    Record(step=0, timestamp=100.0, metrics={"loss": 1.0, "tokens": 2**53 + 1}),
    Record(
        step=1,
        timestamp=101.0,
        metrics={"loss": math.nan, "w": np.array([1.0, 2.0, math.inf])},
        aggregated={"g/mean": 0.5, "g/max": 1.0, "g/min": 0.0, "g/std": 0.25},
    ),
    Record(step=2, timestamp=102.0, metrics={}),  # empty
    Record(step=None, timestamp=103.0, metrics={"lat.ms": 1.5}, group="agent"),
    Record(step=3, timestamp=104.0, metrics={"b": np.float32(0.5), "flag": True}),
]


# ----- reading back what each sink wrote ----------------------------------------------
def _read_jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _read_tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    return scalars, acc.Tags()["histograms"]


def _wandb_records(data: bytes):
    """The protobuf records of an offline run file (a LevelDB-style log)."""
    from wandb.proto import wandb_internal_pb2 as pb

    block, pos, chunks = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 or len(chunk) < length:
            break
        chunks += chunk
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _wandb_history(run_dir):
    """History rows of an offline run, once wandb's service has written the run's
    exit record (it finishes the file after wandb.finish() returns)."""
    path = next(Path(run_dir).glob("run-*.wandb"))
    deadline = time.monotonic() + 30
    while True:
        records = list(_wandb_records(path.read_bytes()))
        kinds = {r.WhichOneof("record_type") for r in records}
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


@pytest.fixture
def wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    import wandb

    run = wandb.init(project="jaxhistory-tests", dir=str(tmp_path))
    yield run
    if wandb.run is not None:
        wandb.finish()


# ----- conformance: every sink on the same records ----------------------------------
SINKS = ["null", "console", "jsonl", "tensorboard", "wandb", "trace"]


def _make(kind, tmp_path, request):
    if kind == "null":
        return NullSink()
    if kind == "console":
        return ConsoleSink(stream=io.StringIO())
    if kind == "jsonl":
        return JsonlSink(tmp_path / "sink.jsonl")
    if kind == "tensorboard":
        return TensorBoardSink(tmp_path / "tb")
    if kind == "trace":
        from jaxhistory.trace import JSONTraceHandler

        handler = JSONTraceHandler(
            folder=str(tmp_path / "tr"), merged_trace_filename=None
        )
        handler.start()
        return handler
    request.getfixturevalue("wandb_run")
    return WandbSink()


@pytest.mark.parametrize("kind", SINKS)
def test_every_sink_takes_every_record_and_closes(kind, tmp_path, request):
    sink = _make(kind, tmp_path, request)
    assert isinstance(sink, jh.sinks.Sink) and sinks_base.is_sink(sink)
    for record in RECORDS:
        sink.write(record)
    sink.flush()
    sink.close()
    if kind == "console":
        lines = sink.stream.getvalue().splitlines()
        assert lines[0] == "step=0 loss=1.000000 tokens=9007199254740993"
        assert lines[1].startswith("step=1 loss=nan w=[3 values] g/mean=0.500000")
        assert lines[2] == "step=2" and lines[3] == "[agent] lat.ms=1.500000"
        assert lines[4] == "step=3 b=0.500000 flag=True"
    elif kind == "jsonl":
        rows = _read_jsonl(tmp_path / "sink.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2, None, 3]
        assert rows[0]["metrics"]["tokens"] == 2**53 + 1  # exact
        assert rows[1]["metrics"] == {"loss": "NaN", "w": [1.0, 2.0, "Infinity"]}
        assert rows[1]["aggregated"]["g/std"] == 0.25
        assert rows[3]["group"] == "agent" and "group" not in rows[0]
    elif kind == "tensorboard":
        scalars, histograms = _read_tensorboard(tmp_path / "tb")
        assert scalars["loss"][0] == (0, 1.0) and math.isnan(scalars["loss"][1][1])
        assert scalars["g/mean"] == [(1, 0.5)]
        assert scalars["agent/lat.ms"] == [(0, 1.5)]  # no step: numbered per tag
        assert scalars["b"] == [(3, 0.5)] and scalars["flag"] == [(3, 1.0)]
        assert "w" in histograms
    elif kind == "trace":
        from jaxhistory.trace import load_trace

        events = load_trace(sink.paths[0])
        counters = {}
        for e in events:
            if e["ph"] == "C":
                counters.setdefault(e["name"], []).extend(e["args"].values())
        assert counters["loss"] == [1.0]  # NaN left out of the track
        assert counters["tokens"] == [float(2**53 + 1)]
        assert counters["agent/lat.ms"] == [1.5] and counters["g/std"] == [0.25]
        assert "w" not in counters  # arrays are not counters
    elif kind == "wandb":
        import wandb

        run_dir = Path(wandb.run.dir).parent
        wandb.finish()
        rows = _wandb_history(run_dir)
        by_step = {r.get("_step"): r for r in rows}
        assert by_step[0]["loss"] == 1.0 and by_step[0]["tokens"] == 2**53 + 1
        assert by_step[1]["g/mean"] == 0.5 and by_step[3]["b"] == 0.5
        assert any(r.get("agent/lat.ms") == 1.5 for r in rows)


def test_tensorboard_sinks_in_one_logdir_keep_each_others_events(tmp_path):
    # a resumed run in the same second: its own event file, the first one kept
    for step in (0, 1):
        sink = TensorBoardSink(tmp_path / "tb")
        sink.write(Record(step=step, timestamp=100.0 + step, metrics={"a": step}))
        sink.close()
    assert _read_tensorboard(tmp_path / "tb")[0]["a"] == [(0, 0.0), (1, 1.0)]


def test_tensorboard_histograms_count_values_past_1e20(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    sink = TensorBoardSink(tmp_path / "tb")
    big = np.array([3e38, -3e38], np.float32)  # past the buckets of tensorboardX
    spread = np.array([1e300, -1e25, 0.0, 1.0])
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 0.5, "w": big}))
    sink.write(Record(step=1, timestamp=2.0, metrics={"w": spread}))
    sink.close()
    assert _read_tensorboard(tmp_path / "tb")[0]["loss"] == [(0, 0.5)]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    histograms = [e.histogram_value for e in acc.Histograms("w")]
    assert [(h.num, sum(h.bucket)) for h in histograms] == [(2, 2), (4, 4)]
    assert histograms[0].max == np.float32(3e38) and histograms[1].max == 1e300


def test_a_closed_tensorboard_sink_writes_nothing_more(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(Record(step=0, timestamp=100.0, metrics={"a": 1.0}))
    sink.close()
    threads = threading.active_count()
    with pytest.warns(RuntimeWarning, match=r"after close\(\)"):
        sink.write(Record(step=1, timestamp=101.0, metrics={"a": 2.0}))
    sink.flush()
    sink.close()
    assert threading.active_count() == threads  # no writer started again
    assert _read_tensorboard(tmp_path / "tb")[0]["a"] == [(0, 1.0)]


def test_a_tensorboard_logdir_deleted_mid_run_is_started_again(tmp_path):
    """The logdir removed mid-run (a clean-up): later events went into the
    deleted file and were lost without a word. A new event file is started in
    the logdir, with one warning, as the CSV and JSONL sinks do."""
    import shutil

    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 1.0}))
    sink.flush()
    shutil.rmtree(tmp_path / "tb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.write(Record(step=1, timestamp=2.0, metrics={"loss": 0.5}))
        sink.write(Record(step=2, timestamp=3.0, metrics={"w": np.ones(3)}))
        sink.close()
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "was deleted" in texts[0], texts
    assert str(tmp_path / "tb") in texts[0]
    scalars, histograms = _read_tensorboard(tmp_path / "tb")
    assert scalars == {"loss": [(1, 0.5)]} and histograms == ["w"]


def test_a_tensorboard_event_file_that_could_not_be_started_again_is_retried(
    tmp_path,
):
    """The event file deleted, and the new one could not be made at once (the
    logdir's path taken by a file meanwhile): the sink kept the closed file,
    and every later write failed on it ('I/O operation on closed file') even
    once the logdir could be made again."""
    import shutil

    logdir = tmp_path / "tb"
    sink = TensorBoardSink(logdir)
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 1.0}))
    shutil.rmtree(logdir)
    logdir.write_text("in the way")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sink.write(Record(step=1, timestamp=2.0, metrics={"loss": 0.5}))
        assert sink.lost == 1
        logdir.unlink()
        sink.write(Record(step=2, timestamp=3.0, metrics={"loss": 0.25}))
        sink.close()
    assert sink.lost == 1, repr(sink.error)
    assert _read_tensorboard(logdir)[0] == {"loss": [(2, 0.25)]}


def test_a_tensorboard_logdir_that_is_a_link_is_refused(tmp_path):
    """A logdir given as a symbolic link was written through (the event file
    went where the link points): it is refused, naming it, as the CSV and
    JSONL sinks refuse a link, and nothing is written where it points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tb").symlink_to(elsewhere)
    (tmp_path / "dangling").symlink_to(tmp_path / "absent")
    for logdir in (tmp_path / "tb", tmp_path / "dangling"):
        with pytest.raises(
            NotAFile, match=re.escape(f"{logdir}: it is a symbolic link")
        ):
            TensorBoardSink(logdir)
        assert logdir.is_symlink()  # left as it was
    assert not list(elsewhere.iterdir()) and not (tmp_path / "absent").exists()


def test_a_tensorboard_logdir_made_a_link_mid_run_is_not_written_through(
    tmp_path, monkeypatch
):
    """The logdir removed and a link put in its place mid-run: the new event
    file was not written through it only because of a check before the open
    (a link swapped in after the check went through). The open itself refuses
    the link: the records are counted lost with one warning naming the logdir,
    and once a real logdir is back, the next ones are written there."""
    import shutil

    from jaxhistory.sinks import _tensorboard

    logdir, elsewhere = tmp_path / "tb", tmp_path / "elsewhere"
    elsewhere.mkdir()
    sink = TensorBoardSink(logdir)
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 1.0}))
    shutil.rmtree(logdir)
    logdir.symlink_to(elsewhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.write(Record(step=1, timestamp=2.0, metrics={"loss": 0.5}))
        # as if the link came between the check and the open
        monkeypatch.setattr(_tensorboard, "check_target", lambda *a, **k: None)
        sink.write(Record(step=2, timestamp=3.0, metrics={"loss": 0.25}))
        monkeypatch.undo()
    assert sink.lost == 2 and isinstance(sink.error, NotAFile), repr(sink.error)
    assert not list(elsewhere.iterdir())
    assert logdir.is_symlink()  # left as it was
    texts = [str(w.message) for w in caught]
    assert any(f"{logdir}: it is a symbolic link" in t for t in texts), texts
    logdir.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sink.write(Record(step=3, timestamp=4.0, metrics={"loss": 0.125}))
    sink.close()
    assert sink.lost == 2 and not list(elsewhere.iterdir())
    assert _read_tensorboard(logdir)[0] == {"loss": [(3, 0.125)]}


_FULL_DISK = """
import resource, signal, sys, time, warnings
import jaxhistory as jh
from jaxhistory.sinks import TensorBoardSink

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead: a full disk
sink = TensorBoardSink(sys.argv[1])
history = jh.History(sinks=[sink])
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(3000):
        history.update({"step": step, "loss": float(step)}, summarize=False)
    history.flush()
    resource.setrlimit(resource.RLIMIT_FSIZE, (-1, -1))  # room again
    history.update({"step": 3000, "loss": 0.5}, summarize=False)
    start = time.monotonic()
    history.close()
    took = time.monotonic() - start
print("close took", round(took, 1), "s; lost", sink.lost, "; error", repr(sink.error))
print(*{str(w.message) for w in caught}, sep="\\n")
"""


def test_a_tensorboard_sink_on_a_full_disk_warns_and_the_process_exits(tmp_path):
    """A write that failed (a full disk) ended tensorboardX's writer thread
    with a traceback on stderr; its queue then filled, the sink's write hung,
    close gave up on it after 5 s, and the process never exited (an exit
    handler waited on that queue). The sink now writes its events itself: a
    failed write warns once, counts what it lost, is cut off the file, and
    nothing hangs."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr
    out = done.stdout
    assert "close took 0." in out, out
    assert "File too large" in out and "writing failed" in out, out
    assert "did not finish" not in out, out
    assert int(out.split("lost ")[1].split()[0]) > 0, out
    # what failed was cut off: the file reads, with the step written since
    assert _read_tensorboard(tmp_path / "tb")[0]["loss"][-1] == (3000, 0.5)


# ----- History fan-out ------------------------------------------------------------
class Collect:
    all_processes = False

    def __init__(self):
        self.records, self.flushes, self.closed = [], 0, False

    def write(self, record):
        self.records.append(record)

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_history_hands_each_update_to_its_sinks_with_host_values():
    sink = Collect()
    h = jh.History(distributed_history=False, sinks=[sink])
    f = jax.jit(lambda x: {"loss": x * 2, "acc": x / 4})
    for i in range(3):
        h.update({**f(jnp.float32(i)), "lr": 0.1}, summarize=False)
    h.update({"eval/acc": 0.9}, step=10)
    h.flush()
    steps = [r.step for r in sink.records]
    assert steps == [0, 1, 2, 10] and sink.flushes >= 1
    assert sink.records[2].metrics == {"loss": 4.0, "acc": 0.5, "lr": 0.1}
    assert type(sink.records[2].metrics["loss"]) is float  # on the host
    h.close()
    assert sink.closed
    h.update({"loss": 1.0, "acc": 0.0, "lr": 0.1})  # recording goes on ...
    h.flush()
    assert len(sink.records) == 4  # ... but a closed sink gets nothing more
    h.close()


def test_history_gives_sinks_the_stats_from_the_step(mesh):
    sink = Collect()
    h = jh.History(sinks=[sink])
    sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    loss = jax.device_put(np.arange(8.0, dtype=np.float32), sharding)
    h.update({"loss": loss, "lr": 0.1}, summarize=False)
    h.flush()
    record = sink.records[0]
    assert record.metrics == {"lr": 0.1}
    assert record.aggregated["loss/mean"] == pytest.approx(3.5)
    assert record.aggregated["loss/max"] == 7.0


def test_a_failing_sink_warns_once_and_the_others_go_on(tmp_path):
    class Failing(Collect):
        def write(self, record):
            raise OSError("disk gone")

    good = Collect()
    h = jh.History(
        distributed_history=False,
        sinks=[Failing(), good],
        jsonl_path=tmp_path / "log.jsonl",
    )
    with pytest.warns(
        RuntimeWarning,
        match=r"sink Failing \(sinks\[0\]\): write failed: OSError..disk gone",
    ):
        h.update({"loss": 1.0})
        h.flush()
    h.update({"loss": 0.5})
    h.flush()
    assert [r.step for r in good.records] == [0, 1]
    assert len(_read_jsonl(tmp_path / "log.jsonl")) == 2  # the log is unaffected
    h.close()


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
def test_a_sink_raising_system_exit_keeps_its_thread_and_flush_never_waits(error):
    class Exiting(Collect):
        def write(self, record):
            raise error("bye")

    before = set(threading.enumerate())  # (other tests' abandoned sinks)
    h = jh.History(distributed_history=False, sinks=[Exiting()])
    with pytest.warns(RuntimeWarning, match="write failed"):
        h.update({"loss": 1.0})
        h.flush()
    alive = [
        t
        for t in set(threading.enumerate()) - before
        if t.name.startswith("jaxhistory-sink")
    ]
    assert alive and all(t.is_alive() for t in alive)  # (else each flush waits 5 s)
    for _ in range(3):
        h.update({"loss": 0.5})
        h.flush()
    h.close()
    for t in alive:  # closed, not abandoned: each thread ends
        t.join(5)
    assert not any(t.is_alive() for t in alive)


def test_sinks_are_checked_and_written_by_process_zero_only():
    with pytest.raises(TypeError, match="not a sink"):
        jh.History(sinks=[object()])
    with pytest.raises(TypeError, match="sequence of sinks"):
        jh.History(sinks=Collect())
    everywhere = Collect()
    everywhere.all_processes = True
    with mock.patch.object(jax, "process_index", return_value=1):
        h = jh.History(distributed_history=False, sinks=[Collect(), everywhere])
    assert h.sinks == (everywhere,)


# ----- W&B ------------------------------------------------------------------------
def test_history_uses_an_active_wandb_run_and_logs_outputs_at_finalize(
    wandb_run, tmp_path
):
    import wandb

    h = jh.History(distributed_history=False)  # use_wandb=None: the run is active
    assert any(isinstance(s, WandbSink) for s in h.sinks)
    for i in range(4):
        h.update({"loss": 1.0 / (i + 1), "lr": 0.1}, summarize=False)
    h.finalize(tmp_path / "out", plot=True)
    run_dir = Path(wandb.run.dir).parent
    files = Path(wandb.run.dir)
    wandb.finish()
    rows = _wandb_history(run_dir)
    losses = {r["_step"]: r["loss"] for r in rows if "loss" in r}
    assert losses == {0: 1.0, 1: 0.5, 2: 1.0 / 3, 3: 0.25}
    tables = list(files.glob("media/table/history_*.table.json"))
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "loss", "lr"]
    assert [row[0] for row in table["data"]] == [0, 1, 2, 3]
    assert list(files.glob("media/images/plots/loss_*.png"))


def test_close_before_finalize_still_logs_the_wandb_outputs(wandb_run, tmp_path):
    import wandb

    h = jh.History(distributed_history=False)
    for i in range(3):
        h.update({"loss": 1.0 / (i + 1)}, summarize=False)
    h.close()
    h.finalize(tmp_path / "out", plot=False)
    files = Path(wandb.run.dir)
    wandb.finish()
    assert list(files.glob("media/table/history_*.table.json"))


def test_finalize_logs_only_the_pngs_it_wrote(wandb_run, tmp_path):
    import wandb

    out = tmp_path / "out"
    stale = out / "plots" / "mplot" / "old_metric.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"not from this run")
    os.utime(stale, (1_000_000_000, 1_000_000_000))
    h = jh.History(distributed_history=False)
    h.update({"loss": 1.0})
    h.update({"loss": 0.5})
    logged = []
    sink = next(s for s in h.sinks if isinstance(s, WandbSink))
    original = sink.log_outputs
    sink.log_outputs = lambda state, images: (
        logged.extend(images),
        original(state, images),
    )
    h.finalize(out)
    wandb.finish()
    assert [p.name for p in logged] == ["loss.png"]


def test_wandb_sink_skips_steps_that_go_back(wandb_run):
    import wandb

    sink = WandbSink()
    sink.write(Record(step=5, timestamp=0.0, metrics={"loss": 1.0}))
    with pytest.warns(RuntimeWarning, match="cannot log step 3 after step 5"):
        sink.write(Record(step=3, timestamp=0.0, metrics={"loss": 9.0}))
    sink.write(Record(step=6, timestamp=0.0, metrics={"loss": 0.5}))
    run_dir = Path(wandb.run.dir).parent
    wandb.finish()
    losses = {r["_step"]: r["loss"] for r in _wandb_history(run_dir) if "loss" in r}
    assert losses == {5: 1.0, 6: 0.5}


def test_a_second_wandb_sink_warns_of_steps_the_run_has_passed(wandb_run):
    """A second W&B sink on the run (a second History, an evaluation loop) or
    one attached after the run logged later steps: W&B dropped its records at
    earlier steps, and the sink, comparing only with its own steps, said
    nothing. The run's own step counts too: one RuntimeWarning, and a record
    at the run's current step still joins it."""
    import wandb

    train, evaluation = WandbSink(), WandbSink()
    for step in range(5):
        train.write(Record(step=step, timestamp=0.0, metrics={"loss": float(step)}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (0, 2):
            evaluation.write(Record(step=step, timestamp=0.0, metrics={"acc": 0.5}))
        evaluation.write(Record(step=4, timestamp=0.0, metrics={"acc": 0.75}))
        evaluation.write(Record(step=6, timestamp=0.0, metrics={"acc": 0.875}))
    texts = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(texts) == 1 and "cannot log step 0 after step 4" in texts[0], texts
    run_dir = Path(wandb.run.dir).parent
    wandb.finish()
    acc = {r["_step"]: r["acc"] for r in _wandb_history(run_dir) if "acc" in r}
    assert acc == {4: 0.75, 6: 0.875}


def test_wandb_histograms_of_float32_arrays_spanning_its_range(wandb_run):
    import wandb

    sink = WandbSink()
    wide = np.array([3e38, -3e38, 0.0, np.nan], np.float32)
    sink.write(Record(step=0, timestamp=0.0, metrics={"loss": 1.0, "w": wide}))
    run_dir = Path(wandb.run.dir).parent
    wandb.finish()
    (row,) = [r for r in _wandb_history(run_dir) if "loss" in r]
    assert row["loss"] == 1.0 and row["w/_type"] == "histogram"
    assert sum(row["w/values"]) == 3 and row["w/bins"][-1] == pytest.approx(3e38)


def test_wandb_switches(wandb_run, monkeypatch):
    assert not any(isinstance(s, WandbSink) for s in jh.History(use_wandb=False).sinks)
    monkeypatch.setenv("WANDB_DISABLED", "true")
    assert jh.History().sinks == ()
    monkeypatch.setenv("WANDB_DISABLED", "maybe")
    with pytest.raises(ValueError, match="WANDB_DISABLED='maybe'"):
        jh.History()
    monkeypatch.setenv("WANDB_DISABLED", "0")
    assert len(jh.History().sinks) == 1
    with pytest.raises(ValueError, match="use_wandb"):
        jh.History(use_wandb="yes")


def test_wandb_sink_without_a_run_is_a_clear_error(monkeypatch):
    import wandb

    monkeypatch.setattr(wandb, "run", None)
    with pytest.raises(ValueError, match="no active W&B run"):
        WandbSink()
    assert jh.History(use_wandb=None).sinks == ()  # nothing active: no sink


def test_missing_extras_name_the_pip_install(monkeypatch, tmp_path):
    monkeypatch.setitem(os.sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxhistory\[tensorboard\]'"):
        TensorBoardSink(tmp_path)


def test_a_record_the_jsonl_sink_cannot_encode_costs_only_itself(tmp_path):
    import warnings

    from jaxhistory._record import Batch

    path = tmp_path / "log.jsonl"
    sink = JsonlSink(path)
    batch = Batch(
        [1, 2, 3], [0.5, 0.6, 0.7], [{"loss": 0.25}, {7: 0.5}, {"loss": 0.125}]
    )
    batch.run_id = "run-1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.write_batch(batch)
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["step"], line["metrics"]) for line in lines] == [
        (1, {"loss": 0.25}),
        (3, {"loss": 0.125}),
    ]
    assert {line["run_id"] for line in lines} == {"run-1"}
    assert sink.lost == 1
    assert any("step 2" in str(w.message) for w in caught)


def test_the_console_sink_escapes_control_characters_in_names():
    sink = ConsoleSink(stream=io.StringIO())
    sink.write(Record(step=3, timestamp=0.0, metrics={"a\x1b[2J": 0.25}, group="g\r"))
    assert sink.stream.getvalue() == "[g\\x0d] step=3 a\\x1b[2J=0.250000\n"


def test_finalize_bounds_and_guards_each_sinks_extras(tmp_path, monkeypatch):
    from jaxhistory.sinks import _feed

    monkeypatch.setattr(_feed, "EXTRAS_TIMEOUT", 0.5)
    release = threading.Event()
    tables = []

    class Finished(Collect):  # as W&B's sink after wandb.finish()
        def log_outputs(self, state, images):
            raise RuntimeError("run is finished")

    class Hanging(Collect):
        def log_table(self, key, columns, rows):
            release.wait()

    class Taker(Collect):
        def log_table(self, key, columns, rows):
            tables.append((key, columns, rows))

    h = jh.History(distributed_history=False, sinks=[Finished(), Hanging(), Taker()])
    for s in range(3):
        h.update({"loss": float(s)})
    with pytest.warns(RuntimeWarning) as caught:
        ds = h.finalize(tmp_path, plot=False)
    release.set()
    texts = [str(w.message) for w in caught]
    assert any(
        "log_outputs failed: RuntimeError('run is finished')" in t for t in texts
    )
    assert any("log_table did not return within 0.5 s" in t for t in texts)
    assert ds["loss"].values.tolist() == [0.0, 1.0, 2.0]
    assert [t[0] for t in tables] == ["training_history"]  # the others went on


@pytest.mark.parametrize("kind", ["jsonl", "csv", "tensorboard"])
def test_a_sink_written_after_close_warns_once_and_keeps_its_file(tmp_path, kind):
    """A file sink written after close() (two Histories sharing it, the first
    closed it) dropped the records without a word. It still drops them, and
    warns once, naming the sink and that it was closed; the file keeps what
    was written before."""
    make = {
        "jsonl": lambda: JsonlSink(tmp_path / "m.jsonl"),
        "csv": lambda: jh.sinks.CsvSink(tmp_path / "m.csv"),
        "tensorboard": lambda: TensorBoardSink(tmp_path / "tb"),
    }[kind]
    sink = make()
    sink.write(RECORDS[0])
    sink.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    before = [p.read_bytes() for p in files]
    with pytest.warns(RuntimeWarning, match=r"after close\(\)") as caught:
        sink.write(RECORDS[1])
        sink.write(RECORDS[1])
    assert len([w for w in caught if "after close" in str(w.message)]) == 1
    assert type(sink).__name__ in str(caught[0].message)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files
    assert [p.read_bytes() for p in files] == before


@pytest.mark.parametrize("flag", ["false", "no", "0", 0.0, None, [False]])
def test_a_flag_that_is_not_a_bool_is_refused_before_any_file_is_touched(
    flag, tmp_path
):
    """Finding: ``overwrite="false"`` went through bool() and erased the log,
    the CSV file and a trace folder; ``distributed_history="false"`` and
    ``report_enabled="no"`` were true as well. A flag is True or False (a
    NumPy bool too); anything else is a TypeError naming the option."""
    from jaxhistory import trace
    from jaxhistory.sinks import CsvSink, JsonlSink

    for name in ("keep.jsonl", "keep.csv"):
        (tmp_path / name).write_text("theirs\n")
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "ep0.json").write_text("theirs\n")
    makers = {
        "jsonl_overwrite": lambda: jh.History(
            distributed_history=False,
            jsonl_path=tmp_path / "keep.jsonl",
            jsonl_overwrite=flag,
        ),
        "report_enabled": lambda: jh.History(
            distributed_history=False, report_enabled=flag
        ),
        "distributed_history": lambda: jh.History(distributed_history=flag or "no"),
        "overwrite": lambda: JsonlSink(tmp_path / "keep.jsonl", overwrite=flag),
        "overwrite ": lambda: CsvSink(tmp_path / "keep.csv", overwrite=flag),
        "overwrite  ": lambda: trace.JSONTraceHandler(
            folder=tmp_path / "traces", overwrite=flag
        ),
    }
    for option, make in makers.items():
        with pytest.raises(TypeError, match=f"{option.strip()} must be True or False"):
            make()
    for name in ("keep.jsonl", "keep.csv", "traces/ep0.json"):
        assert (tmp_path / name).read_text() == "theirs\n", name
    for ok in (True, False, np.bool_(True)):
        sink = JsonlSink(tmp_path / "ok.jsonl", overwrite=ok)
        sink.close()


def test_sink_names_in_a_list_say_to_give_them_as_one_string(tmp_path):
    """Finding: sinks=["csv"] said "str is not a sink: it needs write, flush
    and close", where the docstring speaks of sinks or their names."""
    with pytest.raises(TypeError, match=r"one string, sinks='csv,console'"):
        jh.History(
            distributed_history=False, report_dir=tmp_path, sinks=["csv", "console"]
        )
    assert list(tmp_path.iterdir()) == []


def test_a_jsonl_sink_with_real_folder_refuses_a_folder_that_is_a_link(tmp_path):
    from jaxhistory._files import NotAFile
    from jaxhistory.sinks import JsonlSink

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(NotAFile, match="symbolic link"):
        JsonlSink(tmp_path / "link" / "log.jsonl", real_folder=True)
    JsonlSink(tmp_path / "link" / "log.jsonl").close()  # the user's link: followed
    with pytest.raises(TypeError, match="real_folder"):
        JsonlSink(real / "x.jsonl", real_folder="yes")
    assert sorted(p.name for p in real.iterdir()) == ["log.jsonl"]
