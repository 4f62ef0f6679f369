"""Straggler scores from per-process arrival lags."""

import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory._stragglers import StragglerScores, check_window, straggler_table


def feed(scores, lags_per_update, start=0, interval=0.1):
    for i, lags in enumerate(lags_per_update):
        scores.add(start + i, (start + i) * interval, np.asarray(lags), (0, 1, 2))


def test_a_window_is_scored_a_window_later_at_its_last_step():
    s = StragglerScores(4)
    feed(s, [[0.0, 0.0, 0.02]] * 7)
    assert not s.due() and s.take() == []
    feed(s, [[0.0, 0.0, 0.02]], start=7)
    with pytest.warns(RuntimeWarning, match="process 2 is consistently slower"):
        ((step, values),) = s.take()
    assert step == 3 and values["straggler/slowest"] == 2
    np.testing.assert_allclose(values["straggler/median_lag"], [0, 0, 0.02])
    assert values["straggler/score"] == pytest.approx(0.2)
    assert values["straggler/flagged"] == 1


def test_a_flag_is_raised_once_until_the_process_catches_up():
    s = StragglerScores(2)
    slow, fine = [[0.0, 0.0, 0.02]] * 2, [[0.0, 0.0, 0.0]] * 2
    feed(s, slow + slow + fine + slow + [[0, 0, 0]] * 2)
    with pytest.warns(RuntimeWarning) as caught:
        rows = s.take(wait_all=True)
    assert len(caught) == 2 and [r[1]["straggler/flagged"] for r in rows] == [
        1,
        1,
        1,
        2,
        2,
    ]


def test_noise_below_the_limits_is_not_flagged(recwarn):
    s = StragglerScores(10)
    rng = np.random.default_rng(0)
    feed(s, rng.normal(0, 0.001, size=(20, 3)))
    s.take(wait_all=True)
    assert not [w for w in recwarn if "consistently" in str(w.message)]


def test_a_partial_window_waits_and_a_change_of_processes_is_scored_on_the_last():
    s = StragglerScores(3)
    feed(s, [[0.0, 0.0, 0.0]] * 2)
    assert s.take(wait_all=True) == []  # two of three: not a window
    s.add(2, 0.2, np.zeros(2), (0, 1))
    ((_, values),) = s.take(wait_all=True)
    assert values["straggler/median_lag"].shape == (2,)


@pytest.mark.parametrize("bad", [1, 0, 2.5, True, "10", None])
def test_bad_windows_are_refused(bad):
    with pytest.raises(ValueError, match="straggler_window"):
        check_window(bad)
    with pytest.raises(ValueError, match="straggler_window"):
        jh.History(distributed_history=False, straggler_window=bad)


def test_the_table_needs_per_process_arrays():
    state = jh.HistoryState()
    assert straggler_table(state) == []
    state = state.update({"straggler/median_lag": 0.5})  # not one per process
    assert straggler_table(state) == []
    s = jh.HistoryState()
    for k in range(3):
        s = s.update(
            {
                "straggler/median_lag": np.array([0.0, 0.004, 0.001 * k]),
                "straggler/p90_lag": np.array([0.0, 0.006, 0.002]),
            },
            step=k,
        )
    lines = straggler_table(s, top=2)
    assert lines[-2:] == [
        "| 1 | 4.00 | 6.00 | 3 of 3 |",
        "| 2 | 1.00 | 2.00 | 0 of 3 |",
    ]


def test_a_window_given_as_a_numpy_integer_is_taken():
    """np.int64(50) from an array or a config is an int of updates."""
    assert check_window(np.int64(50)) == 50 and type(check_window(np.int64(50))) is int
    with pytest.raises(ValueError, match="straggler_window"):
        check_window(np.int64(1))
    with pytest.raises(ValueError, match="straggler_window"):
        check_window(np.bool_(True))
