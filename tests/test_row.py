"""parse_row: each update parsed once into a Row."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxhistory import _row as row_module
from jaxhistory._row import (
    Repeat,
    Row,
    RowKind,
    kind_of,
    parse_row,
    repeat_of,
    repeated,
    step_entry,
)


def test_a_flat_dict_of_floats():
    row = parse_row({"loss": 0.5, "lr": 1e-3}, None, 4, 12.5)
    assert row == Row(4, ("loss", "lr"), (0.5, 1e-3), RowKind.FINITE_FLOATS, 12.5)
    assert row.label == "step" and row.as_dict() == {"loss": 0.5, "lr": 1e-3}


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        ((1.0, math.nan), RowKind.FLOATS),
        ((1.0, math.inf), RowKind.FLOATS),
        ((1.0, 2), RowKind.NUMBERS),
        ((1, True), RowKind.VALUES),  # a bool is not a number to sum
        ((np.float32(1.0),), RowKind.VALUES),
        ((jnp.ones(()),), RowKind.VALUES),
        ((), RowKind.FINITE_FLOATS),
    ],
)
def test_the_kind_says_what_the_values_are(values, kind):
    if values == ():
        assert kind_of(values) is RowKind.NUMBERS  # (no values: nothing to skip)
        return
    names = tuple(f"m{i}" for i in range(len(values)))
    assert parse_row(dict(zip(names, values, strict=True))).kind is kind
    assert kind_of(values) is kind


def test_a_step_entry_is_the_step_and_leaves_the_dict_unchanged():
    metrics = {"step": 3, "loss": 1.0}
    row = parse_row(metrics, None, 99)
    assert (row.step, row.names, row.label) == (3, ("loss",), "step")
    assert metrics == {"step": 3, "loss": 1.0}
    row = parse_row({"iter": 5.0, "loss": 1.0})
    assert (row.step, row.names, row.label) == (5, ("loss",), "iter")
    row = parse_row({"step": 2, "iter": 7, "loss": 1.0})  # step wins; iter stays
    assert (row.step, row.names) == (2, ("iter", "loss"))


def test_an_explicit_step_and_a_step_entry_must_agree():
    assert parse_row({"step": 3, "x": 1.0}, 3).names == ("x",)
    with pytest.raises(ValueError, match="two steps given: step=4"):
        parse_row({"step": 3, "x": 1.0}, 4)
    row = parse_row({"iter": 3, "x": 1.0}, 10)  # iter is a metric then
    assert (row.step, row.names) == (10, ("iter", "x"))


@pytest.mark.parametrize(
    ("metrics", "step", "match"),
    [
        ({"step": 1.5, "x": 1.0}, None, "'step' must be a whole number"),
        ({"step": [1, 2], "x": 1.0}, None, "'step' must be a whole number"),
        ({"iter": {"a": 1}, "x": 1.0}, None, "'iter' must be a whole number"),
        ({"step": 2**63, "x": 1.0}, None, "outside the int64 range"),
        ({"x": 1.0}, 2**63, "outside the int64 range"),
        ({"x": 1.0}, "7", "must be a whole number"),
    ],
)
def test_bad_steps_are_refused_naming_them(metrics, step, match):
    with pytest.raises(ValueError, match=match):
        parse_row(metrics, step)


def test_nested_dicts_and_names_that_are_not_str_are_flattened():
    row = parse_row({"train": {"loss": 1.0}, "lr": 2.0}, None, 0)
    assert row.names == ("train/loss", "lr") and row.kind is RowKind.FINITE_FLOATS
    assert parse_row({1: 0.5}).names == ("1",)
    with pytest.raises(ValueError, match="'1'"):
        parse_row({1: 0.5, "1": 0.25})
    row = parse_row({"a": {"step": 3}, "step": 4})  # a nested step is a metric
    assert (row.step, row.names) == (4, ("a/step",))
    with pytest.raises(TypeError, match="named values"):
        parse_row(jnp.ones(3))


def test_a_row_is_immutable_and_extends_into_a_new_row():
    row = parse_row({"loss": 1.0})
    with pytest.raises(AttributeError):
        row.step = 3
    more = row.extended(("perf/steps_per_sec",), (2.0,))
    assert more.names == ("loss", "perf/steps_per_sec") and row.names == ("loss",)
    assert more.kind is RowKind.FINITE_FLOATS
    assert row.extended(("n",), (3,)).kind is RowKind.NUMBERS
    assert row.extended((), ()) is row


def test_step_entry_alone():
    assert step_entry({"x": 1}, None) == ({"x": 1}, None, "step")
    assert step_entry({"iter": 2, "x": 1}, None) == ({"x": 1}, 2, "iter")


@pytest.mark.parametrize(
    "make",
    [
        lambda s, m: m,  # no step entry: the next step
        lambda s, m: {"step": s, **m},  # the form ezpz users write
        lambda s, m: {**m, "step": s},
    ],
    ids=["no-step", "step-first", "step-last"],
)
def test_a_repeated_dict_parses_as_the_first_did(make):
    """The second and later dicts with the same keys take the cheap way, which
    must give the row the full parse gives, and refuse what it refuses."""
    base = {"loss": 0.5, "lr": 1e-3}
    first = parse_row(make(10, base), None, 0, 1.0)
    assert repeat_of(make(10, base), first) is not None
    for step in (11, 12, 1000):
        metrics = make(step, {"loss": step / 3, "lr": 2e-3})
        row = parse_row(metrics, None, step if "step" not in metrics else 0, 2.0)
        fresh = _parsed_without_cache(metrics, row)
        assert row == fresh and row.names is first.names  # shared names tuple
        assert type(row) is Row and row.kind is RowKind.FINITE_FLOATS
    # what the cheap way does not take goes the full way, with its answer
    assert parse_row(make(13, {"loss": math.nan, "lr": 1.0}), None, 13).kind is (
        RowKind.FLOATS
    )
    assert parse_row(make(14, {"loss": 1, "lr": 1.0}), None, 14).kind is (
        RowKind.NUMBERS
    )
    assert parse_row(make(15, {"loss": np.float32(1), "lr": 1.0}), None, 15).kind is (
        RowKind.VALUES
    )
    nested = parse_row(make(16, {"loss": {"a": 1.0}, "lr": 1.0}), None, 16)
    assert nested.names == ("loss/a", "lr")


def _parsed_without_cache(metrics, row):
    saved = row_module.LAST_REPEAT[0]
    row_module.LAST_REPEAT[0] = None
    try:
        return parse_row(metrics, None, row.step, row.timestamp)
    finally:
        row_module.LAST_REPEAT[0] = saved


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (True, "step"),
        (2.5, "whole number"),
        ("3", "step"),
        (2**63, "int64"),
    ],
)
def test_a_repeated_dict_with_a_bad_step_is_refused_as_the_first(step, match):
    parse_row({"step": 1, "loss": 0.5})
    with pytest.raises((TypeError, ValueError), match=match):
        parse_row({"step": step, "loss": 0.5})


def test_a_repeated_dict_keeps_its_own_step_below_the_next():
    """A step entry below ``next_step`` is the full parse's to judge (the state
    then refuses a step already recorded)."""
    parse_row({"step": 5, "loss": 0.5}, None, 0)
    row = parse_row({"step": 3, "loss": 0.5}, None, 6)
    assert row.step == 3


def test_a_repeated_dict_past_the_last_int64_step_is_the_full_parses_to_refuse():
    first = parse_row({"loss": 0.5}, None, 0)
    repeat = repeat_of({"loss": 0.5}, first)
    assert repeated(repeat, {"loss": 0.25}, 2**63 - 1, 0.0).step == 2**63 - 1
    assert repeated(repeat, {"loss": 0.25}, 2**63, 0.0) is None


def test_the_same_keys_in_another_order_are_another_row():
    parse_row({"a": 1.0, "b": 2.0})
    row = parse_row({"b": 2.0, "a": 1.0})
    assert row.names == ("b", "a") and row.values == (2.0, 1.0)


def test_repeat_of_takes_only_dicts_of_finite_floats_with_a_plain_step():
    row = parse_row({"iter": 3, "loss": 0.5})
    assert row.label == "iter" and repeat_of({"iter": 3, "loss": 0.5}, row) is None
    mid = {"loss": 0.5, "step": 2, "lr": 1.0}
    assert repeat_of(mid, parse_row(mid)) is None  # step neither first nor last
    assert repeat_of([("loss", 0.5)], parse_row({"loss": 0.5})) is None
    nan = {"loss": math.nan}
    assert repeat_of(nan, parse_row(nan)) is None
    assert repeated(Repeat(("a",), ("a",), None), [("a", 1.0)], 0, 0.0) is None


@pytest.mark.parametrize(
    "at", [None, 0, -1], ids=["no-step", "step-first", "step-last"]
)
def test_a_repeated_row_is_queued_as_a_dict_the_garbage_collector_does_not_track(at):
    """``queued``: the log's item for a repeated row, a new dict of exactly its
    names and values in order (no step entry), then its step under 0 and time
    under 1; later changes to the caller's dict do not reach it, and it is not
    tracked by the garbage collector (a Row is, for as long as it lives)."""
    import gc

    from jaxhistory._row import queued

    def make(step, m):
        if at is None:
            return dict(m)
        return {"step": step, **m} if at == 0 else {**m, "step": step}

    first = make(0, {"loss": 0.5, "lr": 1e-3})
    repeat = repeat_of(first, parse_row(first, None, 0))
    metrics = make(1, {"loss": 0.25, "lr": 2e-3})
    row = repeated(repeat, metrics, 1, 3.0)
    item = queued(row, metrics)
    assert list(item.items()) == [("loss", 0.25), ("lr", 2e-3), (0, 1), (1, 3.0)]
    assert item is not metrics
    metrics["loss"] = 9.0
    assert item["loss"] == 0.25
    assert not gc.is_tracked(item) and gc.is_tracked(row)


def test_a_float32_beside_a_float_past_its_range_records_without_a_warning():
    """A NumPy float32 and a Python float too large for float32 in one row of
    a float table: recorded exactly, with no overflow warning from the check
    of how the row adds up."""
    import warnings

    import jaxhistory as jh

    s = jh.HistoryState().update({"a": 0.5, "b": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = s.update({"a": np.float32(2.5), "b": 1e308})
    assert [str(w.message) for w in caught] == []
    assert s.values("a").tolist() == [0.5, 2.5]
    assert s.values("b").tolist() == [1.0, 1e308]
