"""log_metrics, metrics_format, save_metrics, save_state."""

import json
import logging
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh


# ----- metrics_format --------------------------------------------------------------
def test_format_rules():
    out = jh.metrics_format(
        {
            "train_mem_cpu_alloc_delta": 5 * 2**20 + 2**19,
            "eval_mem_device_peaked_delta": -(2**21),
            "train_runtime": 3725.456,
            "long_runtime": 100_000.0,
            "neg_runtime": -1.5,
            "loss": 0.123456789,
            "steps": 10,
            "flag": True,
        }
    )
    assert out == {
        "train_mem_cpu_alloc_delta": "5.5MiB",
        "eval_mem_device_peaked_delta": "-2.0MiB",
        "train_runtime": "1:02:05.46",
        "long_runtime": "27:46:40.00",  # hours are not wrapped at a day
        "neg_runtime": "-0:00:01.50",
        "loss": 0.1235,
        "steps": 10,
        "flag": True,
    }


def test_format_rounds_centiseconds_without_showing_100():
    assert jh.metrics_format({"x_runtime": 59.999})["x_runtime"] == "0:01:00.00"


def test_format_keeps_small_floats_from_reading_as_zero():
    """Rounded to 4 decimals, a learning rate of 1e-5 read ``learning_rate =
    0.0`` (and -1e-5 ``-0.0``): a float that rounding would make 0 keeps 4
    significant digits instead."""
    out = jh.metrics_format(
        {"learning_rate": 1e-5, "grad": -2.345678e-7, "tiny": 5e-300, "zero": 0.0}
    )
    assert out == {
        "learning_rate": 1e-05,
        "grad": -2.346e-07,
        "tiny": 5e-300,
        "zero": 0.0,
    }
    assert "learning_rate = 1e-05" in jh.log_metrics("train", {"learning_rate": 1e-5})


def test_format_handles_empty_nan_none_and_non_numeric_values():
    assert jh.metrics_format({}) == {}
    out = jh.metrics_format(
        {
            "a_mem_x": None,
            "b_runtime": math.nan,
            "c": math.inf,
            "d": "Not available",
            "e_mem_cpu": "Not available",
            "f": [1, 2],
        }
    )
    assert out == {
        "a_mem_x": "n/a",
        "b_runtime": "nan",
        "c": "inf",
        "d": "Not available",
        "e_mem_cpu": "Not available",
        "f": [1, 2],
    }


def test_format_takes_numpy_and_jax_scalars_and_leaves_the_input_alone():
    metrics = {
        "loss": jnp.float32(0.25),
        "n": np.int64(7),
        "b": jnp.bfloat16(1.5),
        "m_mem_x": np.float64(2**20),
    }
    before = dict(metrics)
    assert jh.metrics_format(metrics) == {
        "loss": 0.25,
        "n": 7,
        "b": 1.5,
        "m_mem_x": "1.0MiB",
    }
    assert metrics == before
    # a small negative delta read "-0.0MiB"
    small = {"m_mem_a": -5, "m_mem_b": -0.04 * 2**20, "m_mem_c": -0.06 * 2**20}
    assert jh.metrics_format(small) == {
        "m_mem_a": "0.0MiB",
        "m_mem_b": "0.0MiB",
        "m_mem_c": "-0.1MiB",
    }
    with pytest.raises(TypeError, match="mapping"):
        jh.metrics_format([("a", 1)])


# ----- log_metrics -------------------------------------------------------------------
def test_log_metrics_prints_an_aligned_sorted_table_and_logs_it(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="jaxhistory"):
        text = jh.log_metrics(
            "train", {"train_runtime": 61.5, "loss": 0.25, "epoch": 3}
        )
    assert capsys.readouterr().out == text + "\n"
    assert text.splitlines() == [
        "***** train metrics *****",
        "  epoch         =          3",
        "  loss          =       0.25",
        "  train_runtime = 0:01:01.50",
    ]
    assert text in caplog.text


def test_log_metrics_shows_control_characters_in_names_as_escapes(capsys):
    tracker = jh.MemoryTracker()
    with tracker.stage("ev\x1b[2Jal\n"):  # a stage name with a terminal escape
        pass
    text = jh.log_metrics("tr\rain", tracker.metrics())
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "***** tr\\x0dain metrics *****" and len(lines) == 7
    assert lines[1].startswith("  before_init_mem_cpu ")
    assert lines[3].startswith("  ev\\x1b[2Jal\\x0a_mem_cpu_alloc_delta ")
    assert len({line.index("=") for line in lines[1:]}) == 1  # still aligned
    assert capsys.readouterr().out == text + "\n"


def test_log_metrics_of_nothing_prints_the_header(capsys):
    assert jh.log_metrics("eval", {}) == "***** eval metrics *****"
    assert capsys.readouterr().out == "***** eval metrics *****\n"


def test_log_metrics_prints_only_on_process_zero(capsys):
    with mock.patch.object(jax, "process_index", return_value=1):
        assert jh.log_metrics("train", {"loss": 1.0}) == ""
    assert capsys.readouterr().out == ""
    with pytest.raises(TypeError, match="split"):
        jh.log_metrics(None, {})


# ----- save_metrics --------------------------------------------------------------
def test_save_metrics_writes_split_and_merges_all_results(tmp_path):
    jh.save_metrics(
        "train", {"train_loss": np.float32(0.5), "n": jnp.int32(3)}, tmp_path
    )
    paths = jh.save_metrics(
        "eval", {"eval_loss": math.nan, "eval_acc": 0.75, "n": 4}, tmp_path
    )
    assert [p.name for p in paths] == ["eval_results.json", "all_results.json"]
    strict = json.loads(
        (tmp_path / "eval_results.json").read_text(),
        parse_constant=lambda t: pytest.fail(f"non-strict token {t}"),
    )
    assert strict == {"eval_acc": 0.75, "eval_loss": None, "n": 4}
    everything = json.loads((tmp_path / "all_results.json").read_text())
    assert everything == {
        "eval_acc": 0.75,
        "eval_loss": None,
        "n": 4,
        "train_loss": 0.5,
    }
    assert list(everything) == sorted(everything)  # keys sorted
    assert not list(tmp_path.glob(".*tmp"))  # no temporary files left


def test_save_metrics_without_combined_leaves_all_results_alone(tmp_path):
    jh.save_metrics("test", {"a": [1.0, math.inf]}, tmp_path, combined=False)
    assert json.loads((tmp_path / "test_results.json").read_text()) == {
        "a": [1.0, None]
    }
    assert not (tmp_path / "all_results.json").exists()


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", ""])
def test_a_corrupt_all_results_is_an_error_and_stays_untouched(tmp_path, content):
    path = tmp_path / "all_results.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="all_results.json"):
        jh.save_metrics("eval", {"eval_loss": 1.0}, tmp_path)
    assert path.read_text() == content
    assert not (tmp_path / "eval_results.json").exists()  # nothing half-done


@pytest.mark.parametrize("split", ["", "../x", "a/b", ".."])
def test_save_metrics_refuses_split_names_that_are_not_file_names(tmp_path, split):
    with pytest.raises(ValueError, match="split"):
        jh.save_metrics(split, {"a": 1.0}, tmp_path)


def test_save_metrics_names_a_value_json_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match="'model'"):
        jh.save_metrics("train", {"loss": 1.0, "model": object()}, tmp_path)
    assert not list(tmp_path.iterdir())


def test_save_metrics_writes_only_on_process_zero(tmp_path):
    with mock.patch.object(jax, "process_index", return_value=1):
        assert jh.save_metrics("train", {"a": 1.0}, tmp_path) == []
    assert not list(tmp_path.iterdir())


# ----- save_state ----------------------------------------------------------------
def test_save_state_writes_the_whole_history_sorted(tmp_path):
    h = jh.History(distributed_history=False)
    h.update({"loss": 0.5, "tokens": 2**53 + 1, "w": np.array([1.0, np.nan])})
    h.update({"eval/acc": jnp.float32(0.25)}, step=10)
    path = jh.save_state(h, tmp_path)
    doc = json.loads(path.read_text())
    assert list(doc) == ["attrs", "metrics", "next_step"]
    assert doc["next_step"] == 11
    assert list(doc["metrics"]) == sorted(doc["metrics"])
    assert doc["metrics"]["tokens"] == {
        "dtype": "int64",
        "shape": [],
        "steps": [0],
        "values": [2**53 + 1],  # exact
    }
    assert doc["metrics"]["w"]["values"] == [[1.0, None]]
    assert doc["metrics"]["eval/acc"]["steps"] == [10]
    assert doc["metrics"]["eval/acc"]["dtype"] == "float32"


def test_save_state_of_an_empty_history_and_bad_input(tmp_path):
    doc = json.loads(jh.save_state(jh.HistoryState(), tmp_path).read_text())
    assert doc == {"attrs": {}, "metrics": {}, "next_step": 0}
    with pytest.raises(TypeError, match="History or HistoryState"):
        jh.save_state({"loss": [1.0]}, tmp_path)


def test_an_all_results_file_with_bare_nan_is_read_and_rewritten_strict(tmp_path):
    (tmp_path / "all_results.json").write_text('{"old": NaN, "kept": 1}')
    jh.save_metrics("eval", {"eval_loss": 0.5}, tmp_path)
    assert json.loads((tmp_path / "all_results.json").read_text()) == {
        "eval_loss": 0.5,
        "kept": 1,
        "old": None,
    }


def test_the_split_all_is_reserved(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        jh.save_metrics("all", {"a": 1.0}, tmp_path, combined=False)


# ----- files: links at the outputs and beside them ---------------------------------
def test_results_are_never_written_through_a_link(tmp_path):
    """A link at eval_results.json or all_results.json is refused before either
    file is written; links planted at .{name}.{pid}.tmp get nothing."""
    import os

    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("eval_results.json", "all_results.json", "history_state.json"):
        (out / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    paths = jh.save_metrics("eval", {"eval_loss": 0.25}, out)
    state_path = jh.save_state(jh.HistoryState().update({"loss": 0.5}), out)
    assert victim.read_text() == "keep"
    for path in [*paths, state_path]:
        assert path.is_file() and not path.is_symlink()
    assert json.loads(paths[0].read_text()) == {"eval_loss": 0.25}
    for name in ("all_results.json", "eval_results.json", "history_state.json"):
        other = tmp_path / name
        other.mkdir()
        (other / name).symlink_to(victim)
        with pytest.raises(OSError, match=f"{other / name}: it is a symbolic link"):
            if name == "history_state.json":
                jh.save_state(jh.HistoryState().update({"loss": 0.5}), other)
            else:
                jh.save_metrics("eval", {"eval_loss": 0.5}, other)
        assert victim.read_text() == "keep"
        assert [p.name for p in other.iterdir()] == [name]  # nothing written


def test_total_flos_is_shown_in_gigaflop_units():
    out = jh.metrics_format({"total_flos": 3.5e12, "train_flos": 2**31, "x": 2**31})
    assert out == {"total_flos": "3259GF", "train_flos": "2GF", "x": 2**31}


def test_float32_results_are_saved_as_the_number_shown(tmp_path):
    """A float32 0.2113 is written 0.2113, not 0.21130000054836273."""
    metrics = {
        "loss": np.float32(0.2113),
        "acc": jnp.float32(0.8),
        "half": np.float16(0.3),
        "curve": np.array([[0.1, 0.7]], np.float32),
        "bad": np.float32("nan"),
        "exact": 0.21130000054836273,
    }
    jh.save_metrics("eval", metrics, tmp_path)
    saved = json.loads((tmp_path / "eval_results.json").read_text())
    assert saved == {
        "loss": 0.2113,
        "acc": 0.8,
        "half": 0.3,
        "curve": [[0.1, 0.7]],
        "bad": None,
        "exact": 0.21130000054836273,
    }
    assert np.float32(saved["loss"]) == np.float32(0.2113)
