"""FanOut (jaxhistory._fan_out): what is recorded for a step shares that step's line
in the log; a step's line waits for more of that step, but not for ever."""

import jaxhistory as jh
from jaxhistory import export

# ----- steps: what was timed for a step is recorded at that step --------------------


def _log_lines(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_step_timed_after_its_update_shares_its_line(tmp_path):
    """Finding: in the demo's loop (update, then a timed wait-and-log, then an
    evaluation at the same step) the timing of step 10 landed at step 11, and
    step 200 had two lines in the JSONL."""
    log = tmp_path / "run.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    for step in range(1, 21):
        h.update({"step": step, "loss": 1.0 / step}, summarize=False)
        if step % 10 == 0:
            with jh.StopWatch("wait and log", history=h, step=step):
                pass
            h.update({"eval": {"loss": 0.5}}, step=step, summarize=False)
    h.close()
    lines = _log_lines(log)
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, 21))  # one line per step
    ten = lines[9]["metrics"]
    assert set(ten) == {"loss", "timing/wait_and_log", "eval/loss"}
    assert h.state.steps("timing/wait_and_log").tolist() == [10, 20]
    assert jh.HistoryState.from_jsonl(log).steps("eval/loss").tolist() == [10, 20]


def test_a_steps_line_waits_for_more_of_that_step_but_not_for_ever(tmp_path):
    from jaxhistory._fan_out import FanOut

    log = tmp_path / "s.jsonl"
    stream = export.JsonlStream(log)
    stream.add(1, {"a": 1.0})
    stream.writer.write_queued(final=False)  # the thread's write: step 1 may get more
    assert log.read_text() == ""
    stream.add(1, {"b": 2.0})
    stream.add(2, {"a": 3.0})
    stream.writer.write_queued(final=False)  # step 2 came: step 1 is over
    assert [(r["step"], r["metrics"]) for r in _log_lines(log)] == [
        (1, {"a": 1.0, "b": 2.0})
    ]
    stream.flush()  # flush writes the held line too
    assert [r["step"] for r in _log_lines(log)] == [1, 2]
    stream.add(2, {"late": 4.0})  # after its line was written: a line of its own
    stream.add(3, {"a": 5.0}, timestamp=0.0)  # an old record is never held
    stream.writer.write_queued(final=False)
    stream.add(4, {"a": 6.0}, timestamp=4e9)  # nor one with a time in the future
    stream.writer.write_queued(final=False)
    assert [r["step"] for r in _log_lines(log)] == [1, 2, 2, 3, 4]
    stream.close()
    back = jh.HistoryState.from_jsonl(log)
    assert back.steps("late").tolist() == [2] and back.values("a").tolist() == [
        1.0,
        3.0,
        5.0,
        6.0,
    ]
    assert FanOut.HOLD <= 1.0  # a SIGKILL loses at most about a second


def test_the_latest_steps_line_reaches_the_log_within_the_hold(tmp_path):
    import time

    log = tmp_path / "run.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    h.update({"loss": 1.0}, step=0, summarize=False)
    deadline = time.monotonic() + 20
    while not log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["step"] for r in _log_lines(log)] == [0]  # without a flush
    h.close()


def test_records_of_one_step_merge_only_where_they_follow_each_other():
    from jaxhistory._fan_out import merged as _merged
    from jaxhistory._record import Batch

    def batch(steps, aggregated=None):
        out = Batch(
            steps,
            [float(i) for i in range(len(steps))],
            [{f"m{i}": i} for i in range(len(steps))],
            aggregated,
        )
        out.finite, out.run_id = True, "r"
        return out

    held = batch([3], [{"a/mean": 1.0}])
    new = batch([3, 3, 4, None, None, 3])
    out = _merged(held, new)
    assert out.steps == [3, 4, None, None, 3]  # a later record of 3: its own line
    assert out.metrics[0] == {"m0": 0, "m1": 1}  # held, then the batch's two
    assert out.aggregated[0] == {"a/mean": 1.0} and out.aggregated[1] == {}
    assert out.stamps[0] == 0.0 and out.run_id == "r" and out.finite
    plain = batch([1, 2, 3])
    assert _merged(None, plain) is plain  # nothing to merge: the same batch
    joined = _merged(batch([0]), plain)
    assert joined.steps == [0, 1, 2, 3] and joined.aggregated is None
    assert _merged(None, None) is None and _merged(held, None) is held
