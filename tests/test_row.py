"""parse_row: each update parsed once into a Row."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxhistory._row import Row, RowKind, kind_of, parse_row, step_entry


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
