"""HistoryState: value semantics, steps, dtypes, bad input, device values, export;
integers never rounded, many key sets recorded without scanning the tables."""

import math
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory import _history_state, _table
from jaxhistory._history_state import Appender
from jaxhistory._row import Row, RowKind, parse_row

VALUES = RowKind.VALUES


def test_empty_state():
    s = jh.HistoryState()
    assert s.keys == () and len(s) == 0 and s.next_step == 0
    assert s.all_steps().size == 0
    assert s.summary() == {}


def test_update_returns_a_new_state_and_never_changes_the_old_one():
    s0 = jh.HistoryState()
    s1 = s0.update({"loss": 1.0})
    s2 = s1.update({"loss": 2.0})
    assert s0.keys == ()
    assert s1.values("loss").tolist() == [1.0]
    assert s2.values("loss").tolist() == [1.0, 2.0]


def test_updating_an_old_state_gives_an_independent_branch():
    base = jh.HistoryState()
    for i in range(300):  # past the staging size, so arrays are shared too
        base = base.update({"loss": float(i)})
    a = base.update({"loss": -1.0})
    b = base.update({"loss": -2.0}).update({"loss": -3.0})
    a2 = a.update({"loss": -4.0})
    assert base.count("loss") == 300
    assert a.values("loss")[-1] == -1.0 and a.count("loss") == 301
    assert b.values("loss")[-2:].tolist() == [-2.0, -3.0]
    assert a2.values("loss")[-2:].tolist() == [-1.0, -4.0]
    assert base.values("loss")[-1] == 299.0


def test_step_comes_from_argument_metrics_or_counter():
    s = jh.HistoryState().update({"loss": 1.0})  # step 0
    s = s.update({"loss": 2.0, "step": 10})  # from the metrics, not stored
    s = s.update({"loss": 3.0, "iter": 12})
    s = s.update({"loss": 4.0}, step=20)
    s = s.update({"loss": 5.0})  # next_step
    assert s.steps("loss").tolist() == [0, 10, 12, 20, 21]
    assert "step" not in s and "iter" not in s
    assert s.next_step == 22


def test_metrics_at_different_cadences_keep_their_true_steps():
    s = jh.HistoryState()
    for step in range(1, 301):
        s = s.update({"train": {"loss": 1.0 / step}}, step=step)
        if step % 100 == 0:
            s = s.update({"eval": {"loss": 2.0 / step}}, step=step)
    assert s.steps("eval/loss").tolist() == [100, 200, 300]
    assert s.count("train/loss") == 300
    assert s.select("eval").keys == ("eval/loss",)
    assert s.select("train/").keys == ("train/loss",)


def test_same_metrics_in_different_groupings_merge_in_step_order():
    s = jh.HistoryState().update({"a": 1.0, "b": 1.0}, step=0)
    s = s.update({"a": 2.0}, step=1)
    s = s.update({"a": 3.0, "b": 3.0}, step=2)
    assert s.steps("a").tolist() == [0, 1, 2]
    assert s.values("a").tolist() == [1.0, 2.0, 3.0]
    assert s.steps("b").tolist() == [0, 2]
    assert s.keys == ("a", "b")


def test_dtypes_are_kept():
    big = 2**53 + 1
    s = jh.HistoryState().update(
        {
            "tokens": big,
            "loss": 0.5,
            "f32": np.float32(1.5),
            "half": jnp.asarray(0.5, jnp.bfloat16),
            "ok": True,
            "vec": np.arange(3, dtype=np.int32),
        }
    )
    assert s.dtype("tokens") == np.int64 and int(s.values("tokens")[0]) == big
    assert s.dtype("loss") == np.float64
    assert s.dtype("f32") == np.float32
    assert s.dtype("half") == np.float32 and s.values("half")[0] == 0.5
    assert s.dtype("ok") == np.bool_
    assert s.shape("vec") == (3,) and s.dtype("vec") == np.int32


def test_integer_metric_widens_to_float_when_a_float_arrives():
    s = jh.HistoryState().update({"epoch": 1}).update({"epoch": 1.5})
    assert s.dtype("epoch") == np.float64
    assert s.values("epoch").tolist() == [1.0, 1.5]


def test_nan_and_inf_are_stored_and_counted():
    s = jh.HistoryState()
    for v in (1.0, np.nan, np.inf, 3.0):
        s = s.update({"loss": v})
    np.testing.assert_array_equal(s.values("loss"), [1.0, np.nan, np.inf, 3.0])
    summary = s.summary()["loss"]
    assert summary["nonfinite"] == 2 and summary["count"] == 4
    assert summary["mean"] == 2.0 and summary["last"] == 3.0


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"loss": 1.0, "name": "run-1"}, TypeError, "'name' is str"),
        ({"loss": 1.0, "obj": object()}, TypeError, "'obj'"),
        ({"loss": 1.0, "none": None}, TypeError, "'none'"),
        ({"loss": 1.0, "vec": np.zeros(4)}, ValueError, "'vec' changed shape"),
        ({"loss": 1.0}, ValueError, "'loss' was already recorded at step 3"),
    ],
    ids=["string", "object", "none", "shape", "same-step"],
)
def test_bad_input_names_the_key_and_loses_nothing(bad, error, match):
    s = jh.HistoryState()
    for step in range(4):
        s = s.update({"loss": float(step), "vec": np.zeros(3)}, step=step)
    with pytest.raises(error, match=match):
        s.update(bad, step=3 if "same-step" in match or "recorded" in match else 4)
    assert s.values("loss").tolist() == [0.0, 1.0, 2.0, 3.0]
    s2 = s.update({"loss": 4.0, "vec": np.ones(3)})
    assert s2.count("loss") == 5 and s.count("loss") == 4


def test_an_earlier_step_is_refused():
    s = jh.HistoryState().update({"loss": 1.0}, step=10)
    with pytest.raises(ValueError, match="merge"):
        s.update({"loss": 0.0}, step=5)


def test_a_tracer_points_to_the_metric_buffer():
    s = jh.HistoryState()

    @jax.jit
    def step(x):
        s.update({"loss": x})
        return x

    with pytest.raises(TypeError, match="'loss' is a JAX tracer.*MetricBuffer"):
        step(1.0)
    assert s.keys == ()


def test_step_must_be_a_whole_number():
    with pytest.raises(ValueError, match="whole number"):
        jh.HistoryState().update({"loss": 1.0, "step": 1.5})


def test_values_are_read_only():
    s = jh.HistoryState().update({"loss": 1.0})
    with pytest.raises(ValueError, match="read-only"):
        s.values("loss")[0] = 2.0
    with pytest.raises(ValueError, match="read-only"):
        s.steps("loss")[0] = 2


def test_unknown_metric_is_named():
    with pytest.raises(KeyError, match="'lss'.*loss"):
        jh.HistoryState().update({"loss": 1.0}).values("lss")


def test_device_values_do_not_block_and_reading_starts_no_new_copies():
    f = jax.jit(lambda x: {"loss": x * 2, "acc": x / 2})
    outs = [f(jnp.float32(i)) for i in range(5)]
    s = jh.HistoryState()
    with (
        mock.patch.object(jax, "device_get", wraps=jax.device_get) as get,
        mock.patch.object(
            jax, "block_until_ready", wraps=jax.block_until_ready
        ) as block,
    ):
        for out in outs:
            s = s.update(out)
        assert get.call_count == 0 and block.call_count == 0
    array_type = type(outs[0]["loss"])  # the concrete jax.Array class
    with mock.patch.object(
        array_type, "copy_to_host_async", autospec=True, side_effect=AssertionError
    ) as copy:
        # Reading needs no new copies: they were all started by update().
        assert s.values("loss").tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert s.values("acc").tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
        assert copy.call_count == 0


def test_too_many_unresolved_device_updates_are_waited_for():
    f = jax.jit(lambda x: x + 1)
    s = jh.HistoryState()
    with mock.patch.object(
        jax, "block_until_ready", wraps=jax.block_until_ready
    ) as block:
        for i in range(_history_state.MAX_INFLIGHT):
            s = s.update({"x": f(jnp.float32(i))})
        assert block.call_count == 0
        s = s.update({"x": f(jnp.float32(99))})
        assert block.call_count == 1
    assert s.values("x")[-1] == 100.0


def test_per_device_array_metric_keeps_its_shape(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    s = jh.HistoryState().update({"loss": x}).update({"loss": x + 1})
    assert s.shape("loss") == (8,)
    np.testing.assert_array_equal(s.values("loss")[1], np.arange(8.0) + 1)


def test_pytree_round_trip_through_leaves():
    s = jh.HistoryState().update({"a": 1.0, "b": np.arange(2.0)})
    s = s.update({"a": 2.0}).with_attrs(run="r1")
    leaves, treedef = jax.tree_util.tree_flatten(s)
    assert all(isinstance(leaf, np.ndarray) for leaf in leaves[:-1])
    assert leaves[-1] == s.next_step == 2  # next_step is data, not structure
    back = jax.tree_util.tree_unflatten(treedef, [np.array(x) for x in leaves])
    assert type(back.next_step) is int
    for name in s.keys:
        np.testing.assert_array_equal(back.steps(name), s.steps(name))
        np.testing.assert_array_equal(back.values(name), s.values(name))
    assert back.next_step == s.next_step and back.attrs == s.attrs
    more = back.update({"a": 3.0})
    assert more.values("a").tolist() == [1.0, 2.0, 3.0]
    shapes = jax.tree.map(np.shape, s)  # placeholders survive tree transformations
    assert jax.tree.leaves(shapes)


def test_extend_records_many_steps_at_once():
    s = jh.HistoryState().update({"loss": 0.0}, step=0)
    s = s.extend(np.arange(1, 5), {"loss": np.arange(1.0, 5.0), "lr": np.ones(4)})
    assert s.steps("loss").tolist() == [0, 1, 2, 3, 4]
    assert s.count("lr") == 4 and s.next_step == 5
    with pytest.raises(ValueError, match="strictly increasing"):
        s.extend([7, 6], {"loss": np.ones(2)})
    with pytest.raises(ValueError, match="'loss' has 2 records for 3 steps"):
        s.extend([7, 8, 9], {"loss": np.ones(2)})
    with pytest.raises(ValueError, match="'loss' was already recorded"):
        s.extend([4, 5], {"loss": np.ones(2)})


def test_merge_combines_a_resumed_run_in_step_order():
    first = jh.HistoryState()
    for step in range(6):
        first = first.update({"loss": float(step)}, step=step)
    resumed = jh.HistoryState()
    for step in range(4, 8):  # restarted from a checkpoint at step 4
        resumed = resumed.update({"loss": 10.0 + step, "lr": 0.1}, step=step)
    merged = first.merge(resumed)
    assert merged.steps("loss").tolist() == list(range(8))
    assert merged.values("loss").tolist() == [0, 1, 2, 3, 14, 15, 16, 17]
    assert merged.steps("lr").tolist() == [4, 5, 6, 7]
    assert merged.next_step == 8
    with pytest.raises(ValueError, match="'loss' has shape"):
        first.merge(jh.HistoryState().update({"loss": np.zeros(2)}))


def test_summary_statistics():
    values = np.array([5.0, 1.0, 2.0, 3.0, 4.0, np.nan])
    s = jh.HistoryState()
    for v in values:
        s = s.update({"x": v})
    got = s.summary()["x"]
    finite = values[np.isfinite(values)]
    assert got["mean"] == finite.mean() and got["std"] == finite.std()
    assert got["median"] == 3.0 and got["min"] == 1.0 and got["max"] == 5.0
    assert got["p10"] == np.percentile(finite, 10)
    assert got["p90"] == np.percentile(finite, 90)
    assert np.isnan(got["last"]) and got["count"] == 6 and got["nonfinite"] == 1
    assert s.summary(warmup=2)["x"]["count"] == 4
    assert s.summary(warmup=0.5)["x"]["count"] == 3


@pytest.mark.parametrize(
    ("warmup", "n", "dropped"),
    [(0, 10, 0), (0.05, 100, 5), (0.999, 10, 9), (1, 10, 1), (3, 10, 3), (50, 10, 10)],
)
def test_warmup_is_a_fraction_below_one_and_a_count_above(warmup, n, dropped):
    assert jh.warmup_count(warmup, n) == dropped


@pytest.mark.parametrize(
    ("warmup", "dropped"),
    [(np.int64(3), 3), (np.float32(0.5), 5), (np.float64(0.25), 2), (np.uint8(12), 10)],
)
def test_warmup_takes_numpy_numbers(warmup, dropped):
    """Finding: summary, to_xarray and finalize refused np.int64(3) and
    np.float32(0.1) as warmup (TypeError), while log_every took NumPy ints."""
    assert jh.warmup_count(warmup, 10) == dropped
    s = jh.HistoryState()
    for step in range(10):
        s = s.update({"x": float(step)})
    assert s.summary(warmup=warmup)["x"]["count"] == 10 - dropped


@pytest.mark.parametrize("bad", [-1, float("nan"), "5", True, np.bool_(True)])
def test_bad_warmup(bad):
    with pytest.raises((ValueError, TypeError), match="warmup"):
        jh.warmup_count(bad, 10)


class TestXarray:
    def make(self):
        s = jh.HistoryState().with_attrs(run="demo")
        for step in range(10):
            m = {"train": {"loss": 1.0 / (step + 1)}, "vec": np.full(2, step)}
            s = s.update(m, step=step)
            if step % 5 == 4:
                s = s.update({"eval/acc": np.nan if step == 4 else 0.5}, step=step)
        return s.update({"tokens": 2**53 + 1}, step=3 * 0 + 10)

    def test_layout(self):
        ds = self.make().to_xarray()
        assert ds["step"].values.tolist() == list(range(11))
        assert {"train/loss", "vec", "eval/acc", "tokens"} <= set(ds.data_vars)
        assert ds["vec"].dims == ("step", "vec_dim_0")
        assert np.isnan(ds["train/loss"].values[10])
        assert ds.attrs["run"] == "demo"
        acc = ds["eval/acc"].values
        assert np.isnan(acc[0]) and np.isnan(acc[4]) and acc[9] == 0.5

    def test_round_trip_is_exact(self):
        s = self.make()
        back = jh.HistoryState.from_xarray(s.to_xarray())
        assert set(back.keys) == set(s.keys)
        for name in s.keys:
            np.testing.assert_array_equal(back.steps(name), s.steps(name))
            np.testing.assert_array_equal(back.values(name), s.values(name))
            assert back.dtype(name) == s.dtype(name)
        assert int(back.values("tokens")[0]) == 2**53 + 1
        assert back.next_step == s.next_step and dict(back.attrs) == {"run": "demo"}

    def test_warmup_drops_leading_steps(self):
        ds = self.make().to_xarray(warmup=0.5)
        assert ds["step"].values.tolist() == [5, 6, 7, 8, 9, 10]
        assert self.make().to_xarray(warmup=3)["step"].values[0] == 3

    def test_from_xarray_needs_a_step_coordinate(self):
        import xarray as xr

        with pytest.raises(ValueError, match="'step'"):
            jh.HistoryState.from_xarray(xr.Dataset({"a": ("x", [1.0])}))


def test_a_scan_loop_buffer_is_appended_with_one_transfer():
    def inner(buf, i):
        loss = 1.0 / (i + 1.0)
        return buf.write(i, {"loss": loss, "grad": {"norm": 2.0 * loss}}), None

    @jax.jit
    def run(buf, start):
        buf, _ = jax.lax.scan(inner, buf.reset(), start + jnp.arange(10))
        return buf

    example = {"loss": jnp.float32(0), "grad": {"norm": jnp.float32(0)}}
    buf = jh.MetricBuffer.create(16, example)
    s = jh.HistoryState().update({"loss": 5.0}, step=-1)
    with mock.patch.object(jax, "device_get", wraps=jax.device_get) as get:
        for chunk in range(3):
            buf = run(buf, chunk * 10)
            s = s.extend_from_buffer(buf)
        assert get.call_count == 3
    assert s.steps("loss").tolist() == list(range(-1, 30))
    np.testing.assert_allclose(s.values("grad/norm"), 2.0 / (np.arange(30) + 1))


def test_stats_from_a_jitted_step_are_recorded_without_waiting(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    step = jax.jit(lambda x: {"dist": jh.distributed_stats({"loss": x}), "lr": 0.1})
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    s = jh.HistoryState()
    with mock.patch.object(jax, "device_get", wraps=jax.device_get) as get:
        for i in range(3):
            s = s.update(step(x + i))
        assert get.call_count == 0
    assert s.values("dist/loss/max").tolist() == [7.0, 8.0, 9.0]
    assert s.steps("dist/loss/std").tolist() == [0, 1, 2]
    assert s.values("lr").tolist() == pytest.approx([0.1] * 3)
    bare = jh.HistoryState().update(jh.distributed_stats({"a": jnp.arange(4.0)}))
    assert set(bare.keys) == {f"a/{stat}" for stat in jh.STATS}


def test_packed_rows_check_their_size():
    with pytest.raises(ValueError, match="needs 2 values"):
        jh.HistoryState().update_packed(("a", "b"), np.zeros(3))
    s = jh.HistoryState().update_packed(("a", "b"), np.array([[1.0], [2.0]]))
    assert s.values("b").tolist() == [2.0]


def test_packed_rows_that_continue_their_table_are_still_checked_where_needed():
    watched = jh.watch({"a": jnp.ones(2), "b": jnp.ones(2)}, stats=("norm",))
    s = jh.HistoryState()
    for step in range(3):
        s = s.update({"loss": 1.0, "g": watched}, step=step)
        s = s.update_packed(("x", "y"), jnp.arange(2.0) + step, step=step)
    assert s.steps("x").tolist() == [0, 1, 2] and s.values("y").tolist() == [1, 2, 3]
    assert s.values("g/a/norm").tolist() == pytest.approx([2**0.5] * 3)
    with pytest.raises(ValueError, match="'x' was already recorded at step 2"):
        s.update_packed(("x", "y"), jnp.zeros(2), step=2)  # not past its table
    # "y" recorded by another table at a later step: the next packed row of
    # ("x", "y") at an earlier step must not pass as a continuation
    later = s.update({"y": 5.0}, step=9)
    with pytest.raises(ValueError, match="'y' was already recorded at step 9"):
        later.update_packed(("x", "y"), jnp.zeros(2), step=4)
    assert later.update_packed(("x", "y"), jnp.zeros(2), step=10).steps(
        "y"
    ).tolist() == [
        0,
        1,
        2,
        9,
        10,
    ]
    with pytest.raises(ValueError, match="unique"):
        s.update_packed(("x", "x"), jnp.zeros(2), step=7)


def test_a_continued_packed_row_checks_its_names_once_per_set_of_tables():
    names = ("x", "y")
    s = jh.HistoryState().update({"loss": 1.0}, step=0)
    for step in range(3):
        s = s.update_packed(names, jnp.arange(2.0) + step, step=step)
    table = s.data.tables[names][0]
    assert table.exclusive is s.data.index()  # checked, kept for this index
    # A new table holding "y" makes a new index: the check runs again.
    later = s.update({"y": 5.0}, step=9)
    assert later.data.index() is not table.exclusive
    with pytest.raises(ValueError, match="'y' was already recorded at step 9"):
        later.update_packed(names, jnp.zeros(2), step=4)
    # The first state is unchanged and still continues its table.
    s = s.update_packed(names, jnp.zeros(2), step=3)
    assert s.steps("x").tolist() == [0, 1, 2, 3]

    s = jh.HistoryState().update({"t": 1})
    with pytest.raises(ValueError, match="'t' is 9223372036854775808, outside int64"):
        s.update({"t": 2**63})
    assert s.values("t").tolist() == [1]
    assert s.update({"t": 2}).values("t").tolist() == [1, 2]


def test_stats_land_at_the_requested_step():
    st = jh.distributed_stats({"x": jnp.arange(8.0)})
    s = jh.HistoryState().update({"b": 1.0}, step=9)
    s2 = s.update({"a": 1.0, "d": st}, step=5)
    assert s2.steps("a").tolist() == s2.steps("d/x/mean").tolist() == [5]
    s3 = jh.HistoryState().update({"z": 1.0}, step=50)
    s3 = s3.update({"step": 7, "lr": 0.1, "d": st})
    assert s3.steps("lr").tolist() == s3.steps("d/x/max").tolist() == [7]


def test_packed_rows_keep_integer_dtypes_and_widen_half_floats():
    s = jh.HistoryState().update_packed(
        ("a", "b"), jnp.array([2**24 + 1, 3], jnp.int32)
    )
    assert s.dtype("a") == np.int32 and int(s.values("a")[0]) == 2**24 + 1
    half = jh.HistoryState().update_packed(("a",), np.array([1.5], np.float16))
    assert half.dtype("a") == np.float32
    with pytest.raises(TypeError, match="'a'"):
        jh.HistoryState().update_packed(("a",), np.array(["x"]))


def test_a_step_entry_is_never_a_metric():
    s = jh.HistoryState().update({"step": 3, "loss": 1.0}, step=3)
    assert s.keys == ("loss",)
    assert "step" in s.to_xarray().coords
    with pytest.raises(ValueError, match="two steps given"):
        s.update({"step": 9, "loss": 0.5}, step=20)
    assert s.count("loss") == 1


# ----- the float fast path: every kind of value that can reach it -----------------
def _floats(n=1):
    s = jh.HistoryState()
    for i in range(n):
        s = s.update({"a": float(i), "b": 1.0})
    return s


def test_fast_path_stores_ints_and_bools_in_a_float_metric_as_float64():
    s = _floats().update({"a": 3, "b": True}).update({"a": 2**70, "b": 0.5})
    assert s.dtype("a") == np.float64 and s.dtype("b") == np.float64
    assert s.values("a").tolist() == [0.0, 3.0, float(2**70)]
    assert s.values("b").tolist() == [1.0, 1.0, 0.5]
    # the slow path (a new key set) agrees: an int into an existing float metric
    s2 = _floats().update({"a": 2**70})
    assert s2.values("a").tolist() == [0.0, float(2**70)]


def test_ints_too_large_for_float64_are_refused_on_both_paths():
    s = _floats(2)
    with pytest.raises(ValueError, match="'a' is an int too large for float64"):
        s.update({"a": 10**400, "b": 1.0})
    with pytest.raises(ValueError, match="'a' is an int too large for float64"):
        s.update({"a": 10**400})
    assert s.values("a").tolist() == [0.0, 1.0]
    assert s.update({"a": 2.0, "b": 1.0}).values("a").tolist() == [0.0, 1.0, 2.0]


def test_fast_path_refuses_strings_none_and_nested_values_like_the_slow_path():
    s = _floats(2)
    with pytest.raises(TypeError, match="'a' is str"):
        s.update({"a": "x", "b": 1.0})
    with pytest.raises(TypeError, match="'b' is NoneType"):
        s.update({"a": 1.0, "b": None})
    nested = s.update({"a": 2.0, "b": {"c": 1.0}})
    assert nested.keys == ("a", "b", "b/c")
    assert s.values("a").tolist() == [0.0, 1.0]


def test_real_numbers_are_stored_as_float64():
    import fractions

    s = jh.HistoryState().update({"a": fractions.Fraction(1, 4)})
    assert s.dtype("a") == np.float64 and s.values("a").tolist() == [0.25]
    s = _floats().update({"a": fractions.Fraction(1, 2), "b": 1.0})
    assert s.values("a").tolist() == [0.0, 0.5]


def test_numpy_and_jax_values_after_floats_keep_their_meaning():
    s = _floats().update({"a": np.float32(1.5), "b": jnp.float32(2.5)})
    s = s.update({"a": np.float64(3.0), "b": jnp.asarray(4.0)})
    assert s.values("a").tolist() == [0.0, 1.5, 3.0]
    assert s.values("b").tolist() == [1.0, 2.5, 4.0]
    with pytest.raises(ValueError, match="changed shape"):
        s.update({"a": np.zeros(3), "b": 1.0})


def test_an_object_that_only_acts_like_a_number_becomes_nan_with_a_warning():
    class AddsLikeAFloat:
        def __radd__(self, other):
            return other + 1.0

    s = _floats().update({"a": AddsLikeAFloat(), "b": 2.0})
    with pytest.warns(RuntimeWarning, match="metric 'a': AddsLikeAFloat value"):
        values = s.values("a")
    assert values[0] == 0.0 and np.isnan(values[1])
    assert s.values("b").tolist() == [1.0, 2.0]
    # on its own (no float metric to join) it is refused outright
    with pytest.raises(TypeError, match="'a' is not numeric"):
        jh.HistoryState().update({"a": AddsLikeAFloat()})


def test_fast_path_with_explicit_steps_and_branches():
    s = _floats(2).update({"a": 5.0, "b": 5.0}, step=10)
    assert s.steps("a").tolist() == [0, 1, 10] and s.next_step == 11
    with pytest.raises(ValueError, match="already recorded at step 10"):
        s.update({"a": 1.0, "b": 1.0}, step=10)
    left = s.update({"a": 6.0, "b": 6.0})
    right = s.update({"a": 7.0, "b": 7.0})
    assert left.values("a").tolist() == [0.0, 1.0, 5.0, 6.0]
    assert right.values("a").tolist() == [0.0, 1.0, 5.0, 7.0]
    assert s.values("a").tolist() == [0.0, 1.0, 5.0]


def test_an_iter_metric_stored_with_an_explicit_step_stays_a_step_entry_later():
    s = jh.HistoryState().update({"iter": 1.0, "x": 2.0}, step=0)
    s = s.update({"iter": 5.0, "x": 3.0})
    assert s.steps("x").tolist() == [0, 5] and s.steps("iter").tolist() == [0]


def test_many_fast_path_rows_cross_the_staging_flush():
    s = jh.HistoryState()
    n = 3 * _table.STAGE + 5
    for i in range(n):
        s = s.update({"a": float(i), "b": i % 2})
    assert s.values("a").tolist() == [float(i) for i in range(n)]
    assert s.values("b").tolist() == [float(i % 2) for i in range(n)]


# ----- review fixes ---------------------------------------------------------------
def test_a_reused_numpy_buffer_is_copied_when_recorded():
    buf = np.zeros(3)
    s = jh.HistoryState()
    for i in range(5):
        buf[:] = i
        s = s.update({"v": buf})
    assert s.values("v").tolist() == [[float(i)] * 3 for i in range(5)]


def test_a_numpy_array_is_copied_once_when_recorded():
    """Finding: recording a NumPy array copied it twice: once when recorded (the
    state's own copy) and once more when the staged rows were stacked on their
    way into the table. The peak extra memory of an update and the read that
    moves the row is now one copy; the record is still the state's own."""
    import tracemalloc

    a = np.arange(1_000_000, dtype=np.float64)
    s = jh.HistoryState().update({"a": a}, step=0)
    s.values("a")  # the table made, with room for the next rows
    tracemalloc.start()
    try:
        s = s.update({"a": a}, step=1)
        a[:] = -1.0  # the caller reuses its buffer before the row is moved
        s.values("a")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * a.nbytes, peak / a.nbytes
    a[:] = -2.0  # and after
    assert (s.values("a") == np.arange(1_000_000)).all()
    # History copies it for its log and keeps that same copy
    h = jh.History(distributed_history=False)
    h.update({"a": a}, step=0, summarize=False)
    h.state.values("a")
    a[:] = 7.0
    tracemalloc.start()
    try:
        h.update({"a": a}, step=1, summarize=False)
        a[:] = -1.0
        h.state.values("a")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * a.nbytes, peak / a.nbytes
    assert (h.state.values("a")[1] == 7.0).all()
    buf = np.zeros(4)
    for i in range(2, 5):
        buf[:] = i
        h.update({"b": buf}, summarize=False)
    buf[:] = -1.0
    assert h.state.values("b").tolist() == [[float(i)] * 4 for i in range(2, 5)]


def test_dtype_of_a_metric_in_several_tables_is_what_values_returns():
    s = jh.HistoryState().update({"a": 1}).update({"a": 1.5, "b": 2.0})
    assert s.values("a").dtype == s.dtype("a") == np.float64
    back = jh.HistoryState.from_xarray(s.to_xarray())
    assert back.values("a").tolist() == [1.0, 1.5]


@pytest.mark.parametrize("step", [2**63, -(2**63) - 1, float("inf"), float("nan")])
def test_steps_outside_int64_are_refused_and_nothing_breaks(step):
    s = jh.HistoryState().update({"a": 1.0})
    with pytest.raises(ValueError, match="step"):
        s.update({"a": 2.0}, step=step)
    with pytest.raises(ValueError, match="step"):
        s.update({"step": step, "a": 2.0})
    assert s.update({"a": 3.0}).values("a").tolist() == [1.0, 3.0]


def test_the_last_int64_step_is_the_last_one():
    s = jh.HistoryState().update({"a": 1.0}, step=2**63 - 1)
    assert s.steps("a").tolist() == [2**63 - 1]
    with pytest.raises(ValueError, match="outside the int64 range"):
        s.update({"a": 2.0})


def test_a_failed_wait_for_device_values_does_not_jam_later_updates():
    inflight = _history_state.InFlight(2)

    class Broken:
        def copy_to_host_async(self):
            pass

    inflight.add([Broken()])
    inflight.add([Broken()])
    broken = mock.patch.object(
        jax, "block_until_ready", side_effect=RuntimeError("deleted")
    )
    with broken, pytest.raises(RuntimeError, match="deleted"):
        inflight.add([Broken()])
    assert len(inflight.updates) <= 2
    inflight.add([jnp.zeros(())])  # works again


# ----- device rows: checked once, then a signature match --------------------------
def _device_rows(n, mesh=None):
    f = jax.jit(lambda x: {"loss": x * 2, "acc": x / 2, "n": (x * 3).astype(jnp.int32)})
    outs = []
    for i in range(n):
        outs.append(f(jnp.float32(i)))
        if i % 8 == 7:
            jax.block_until_ready(outs[-1])
    return outs


def test_device_rows_past_the_staging_flush_keep_every_value_and_dtype():
    outs = _device_rows(_table.STAGE + 40)
    s = jh.HistoryState()
    for out in outs:
        s = s.update(out)
    n = len(outs)
    assert s.values("loss").tolist() == [2.0 * i for i in range(n)]
    assert s.values("n").tolist() == [3 * i for i in range(n)]
    assert s.dtype("loss") == np.float32 and s.dtype("n") == np.int32
    assert s.steps("acc").tolist() == list(range(n))


def test_device_rows_that_change_are_checked_again_and_refused_cleanly():
    outs = _device_rows(3)
    s = jh.HistoryState()
    for out in outs:
        s = s.update(out)
    bad = dict(outs[0], loss=jnp.zeros(3))  # a changed shape after fast-path rows
    with pytest.raises(ValueError, match="'loss' changed shape"):
        s.update(bad)
    traced = []
    with pytest.raises(TypeError, match="'loss' is a JAX tracer"):
        jax.jit(lambda x: traced.append(s.update(dict(outs[0], loss=x))) or x)(1.0)
    wider = dict(outs[0], loss=jnp.float64(1.5) if jax.config.x64_enabled else 1.5)
    s2 = s.update(wider)  # another type: the checked path, recorded
    assert s.values("loss").tolist() == [0.0, 2.0, 4.0]  # unchanged, still usable
    assert s2.values("loss").tolist() == [0.0, 2.0, 4.0, 1.5]
    assert s.update(outs[2]).values("loss").tolist() == [0.0, 2.0, 4.0, 4.0]


def test_device_rows_at_an_old_step_are_refused_and_branches_stay_apart():
    outs = _device_rows(4)
    s = jh.HistoryState()
    for out in outs[:2]:
        s = s.update(out)
    with pytest.raises(ValueError, match="already recorded at step 1"):
        s.update(outs[2], step=1)
    a = s.update(outs[2])
    b = s.update(outs[3])  # an older state again: its own copy of the rows
    a = a.update(outs[3])
    assert a.values("loss").tolist() == [0.0, 2.0, 4.0, 6.0]
    assert b.values("loss").tolist() == [0.0, 2.0, 6.0]
    assert s.values("loss").tolist() == [0.0, 2.0]


def test_host_copies_start_only_for_arrays_off_cpu():
    from jaxhistory._table import InFlight, needs_host_copy

    cpu = jnp.ones(3)
    assert not needs_host_copy([cpu])

    class Device:
        platform = "gpu"

    class Sharding:
        device_set = frozenset({Device()})

    class Fake:
        sharding = Sharding()
        copies = 0

        def copy_to_host_async(self):
            Fake.copies += 1

    assert needs_host_copy([cpu, Fake()])
    queue = InFlight(8)
    queue.add([Fake(), Fake()], copy=True)
    queue.add([Fake()], copy=False)
    assert Fake.copies == 2 and len(queue.updates) == 2


def test_a_recorded_array_deleted_later_loses_only_its_own_values():
    outs = _device_rows(4)
    s = jh.HistoryState()
    for out in outs[:3]:
        s = s.update(out)
    s = s.update({"loss": outs[3]["loss"], "acc": 7.0, "n": outs[3]["n"]}, step=3)
    outs[1]["loss"].delete()  # e.g. donated to a later step
    outs[1]["n"].delete()
    outs[3]["loss"].delete()
    for i in range(_history_state.MAX_INFLIGHT + 2):  # waits skip the deleted arrays
        s = s.update(_device_rows(1)[0], step=10 + i)
    with pytest.warns(RuntimeWarning, match=r"could not be read.*'loss'") as seen:
        loss = s.values("loss")
    text = " ".join(str(w.message) for w in seen)
    assert "step 1" in text and "3" in text and "'n'" in text
    assert np.isnan(loss[1]) and np.isnan(loss[3])
    assert loss[[0, 2]].tolist() == [0.0, 4.0]
    assert s.values("n")[:3].tolist() == [0, 0, 6]  # integers: 0
    assert s.values("acc")[:4].tolist() == [0.0, 0.5, 1.0, 7.0]
    assert len(s.values("loss")) == 4 + _history_state.MAX_INFLIGHT + 2  # still usable


def test_a_deleted_packed_row_becomes_nan():
    table = jnp.arange(4.0)
    s = jh.HistoryState().update_packed(("a", "b", "c", "d"), table)
    s = s.update_packed(("a", "b", "c", "d"), jnp.arange(4.0) + 10)
    table.delete()
    with pytest.warns(RuntimeWarning, match="step 0 could not be read"):
        assert np.isnan(s.values("c")[0]) and s.values("c")[1] == 12.0


def test_a_state_checkpoints_with_orbax_and_keeps_recording(tmp_path):
    import orbax.checkpoint as ocp

    s = jh.HistoryState().update({"loss": 0.5, "acc": 1}).update({"loss": 0.25})
    s = s.update({"w": np.arange(3.0)}, step=5)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", jax.device_get(s))
        ckptr.wait_until_finished()
        back = ckptr.restore(tmp_path / "ckpt", jax.device_get(s))
    assert isinstance(back, jh.HistoryState) and back.next_step == 6
    for name in s.keys:
        np.testing.assert_array_equal(back.steps(name), s.steps(name))
        np.testing.assert_array_equal(back.values(name), s.values(name))
    assert back.update({"loss": 0.125}).values("loss").tolist() == [0.5, 0.25, 0.125]


def test_merge_never_rounds_an_integer_it_cannot_hold():
    ints = jh.HistoryState().update({"x": 2**53 + 1}, step=0)
    floats = jh.HistoryState().update({"x": 1.5}, step=1)
    for a, b in ((ints, floats), (floats, ints)):
        with pytest.raises(ValueError, match=r"'x'.*int64.*float64.*9007199254740993"):
            a.merge(b)
    small = jh.HistoryState().update({"x": 3}, step=0)
    merged = small.merge(floats)  # as update does: an int joins floats exactly
    assert merged.values("x").tolist() == [3.0, 1.5] and merged.dtype("x") == "f8"
    assert ints.values("x").tolist() == [2**53 + 1]  # nothing lost


def test_merge_of_unsigned_and_signed_integers_stays_integer():
    top = jh.HistoryState().update({"x": np.uint64(2**64 - 1)}, step=0)
    minus = jh.HistoryState().update({"x": np.int64(-1)}, step=1)
    with pytest.raises(ValueError, match=r"'x'.*uint64.*int64.*18446744073709551615"):
        top.merge(minus)
    five = jh.HistoryState().update({"x": np.uint64(5)}, step=0)
    merged = five.merge(minus)
    assert merged.values("x").tolist() == [5, -1] and merged.dtype("x") == np.int64
    three = jh.HistoryState().update({"x": np.int64(3)}, step=1)
    merged = top.merge(three)
    assert merged.values("x").tolist() == [2**64 - 1, 3]
    assert merged.dtype("x") == np.uint64


def test_a_log_of_integers_reads_back_exactly_or_is_refused(tmp_path):
    def log(*values):
        path = tmp_path / "x.jsonl"
        path.write_text(
            "".join(
                f'{{"step":{i},"metrics":{{"x":{v}}}}}\n' for i, v in enumerate(values)
            )
        )
        return path

    with pytest.raises(ValueError, match=r"x.jsonl.*'x'.*18446744073709551615.*-1"):
        jh.HistoryState.from_jsonl(log(2**64 - 1, -1))
    s = jh.HistoryState.from_jsonl(log(2**64 - 1, 3))
    assert s.values("x").tolist() == [2**64 - 1, 3] and s.dtype("x") == np.uint64
    with pytest.raises(ValueError, match=r"x.jsonl.*'x'.*9007199254740993"):
        jh.HistoryState.from_jsonl(log(2**53 + 1, 1.5))
    s = jh.HistoryState.from_jsonl(log(3, 1.5))
    assert s.values("x").tolist() == [3.0, 1.5] and s.dtype("x") == np.float64
    s = jh.HistoryState.from_jsonl(log(-(2**63), 2**63 - 1))
    assert s.values("x").tolist() == [-(2**63), 2**63 - 1] and s.dtype("x") == "i8"


@pytest.mark.parametrize("steps", [[5.5, 6.5], [5.0, np.nan], [2**63, 2**63 + 1]])
def test_extend_refuses_steps_that_are_not_int64_whole_numbers(steps):
    s = jh.HistoryState().update({"x": 1.0}, step=0)
    steps = np.array(steps, np.uint64 if steps[0] == 2**63 else np.float64)
    with pytest.raises(ValueError, match=r"steps must be whole numbers.*int64"):
        s.extend(steps, {"x": np.ones(2)})
    assert s.steps("x").tolist() == [0] and s.next_step == 1
    whole = s.extend(np.array([5.0, 6.0]), {"x": np.ones(2)})  # as update takes 5.0
    assert whole.steps("x").tolist() == [0, 5, 6]


def test_negative_steps_survive_the_log(tmp_path):
    s = jh.HistoryState().update({"x": 1.0}, step=-3).update({"x": 2.0}, step=-1)
    s = s.update({"y": 5}, step=-(2**63))
    path = jh.export.to_jsonl(s, tmp_path / "n.jsonl")
    back = jh.HistoryState.from_jsonl(path)
    assert back.steps("x").tolist() == [-3, -1] and back.values("x").tolist() == [1, 2]
    assert back.steps("y").tolist() == [-(2**63)]
    assert back.next_step == s.next_step == 0


def test_negative_steps_streamed_by_history_read_back(tmp_path):
    h = jh.History(jsonl_path=tmp_path / "log.jsonl", report_dir=tmp_path)
    h.update({"loss": 0.5}, step=-1)
    h.update({"loss": 0.25}, step=0)
    h.close()
    back = jh.HistoryState.from_jsonl(tmp_path / "log.jsonl")
    assert back.steps("loss").tolist() == [-1, 0]
    assert back.values("loss").tolist() == [0.5, 0.25]


def test_a_metric_recorded_with_other_metrics_never_reads_back_rounded():
    top = jh.HistoryState().update({"x": np.uint64(2**64 - 1)}, step=0)
    with pytest.raises(ValueError, match=r"'x' is stored as uint64.*int64"):
        top.update({"x": np.int64(-1), "y": 1.0}, step=1)
    assert top.values("x").tolist() == [2**64 - 1] and top.dtype("x") == np.uint64
    big = jh.HistoryState().update({"x": 2**53 + 1}, step=0)
    for value in (1.5, np.float32(1.5), np.array(1.5)):
        with pytest.raises(ValueError, match=r"'x'.*int64.*9007199254740993"):
            big.update({"x": value, "y": 1.0}, step=1)
    assert big.values("x").tolist() == [2**53 + 1]
    small = jh.HistoryState().update({"x": 3}, step=0)
    mixed = small.update({"x": np.float32(1.5), "y": 1.0}, step=1)
    assert mixed.values("x").tolist() == [3.0, 1.5]


# ----- values that cannot be stored, names that collide, prefixes that are no str ---


def test_a_step_entry_must_be_one_number():
    s = jh.HistoryState().update({"a": 1.0})
    for entry in ([1, 2], (3,), {"x": 1}):
        with pytest.raises(ValueError, match="'step' must be a whole number"):
            s.update({"step": entry, "a": 2.0})
    with pytest.raises(ValueError, match="'iter' must be a whole number"):
        s.update({"iter": [4], "b": {"c": 1.0}})
    assert s.keys == ("a",) and s.next_step == 1  # nothing recorded


def test_names_that_would_collide_in_files_are_refused():
    s = jh.HistoryState()
    with pytest.raises(ValueError, match="two metrics are both named '1'"):
        s.update({1: 1.0, "1": 2.0})
    assert s.update({1: 1.0, 2: 3}).keys == ("1", "2")  # int names become str


def test_integers_are_never_rounded_silently():
    big = 2**63 - 1
    s = jh.HistoryState().update({"a": np.int64(big)})
    with pytest.raises(ValueError, match=f"'a' holds the integer {big}"):
        s.update({"a": 0.5})
    assert s.values("a").tolist() == [big] and s.dtype("a") == np.int64
    u = jh.HistoryState().update({"u": np.uint64(2**64 - 1)})
    with pytest.raises(ValueError, match="'u' holds the integer 18446744073709551615"):
        u.update({"u": np.int64(3)})  # uint64 with int64 widens to float64
    assert u.values("u").tolist() == [2**64 - 1]
    f = jh.HistoryState().update({"f": 0.5})
    for value in (2**60 + 1, np.int64(2**60 + 1)):
        with pytest.raises(
            ValueError, match="cannot hold the integer 1152921504606846977"
        ):
            f.update({"f": value})
    # Integers float64 holds exactly still join a float metric.
    assert f.update({"f": 2**70}).update({"f": 3}).values("f").tolist() == [
        0.5,
        float(2**70),
        3.0,
    ]
    h = jh.History(distributed_history=False)
    h.update({"f": 0.5})
    with pytest.raises(ValueError, match="cannot hold the integer"):
        h.update({"f": 2**60 + 1})  # the fast path sends large rows to the checks
    assert h.state.values("f").tolist() == [0.5]


def test_a_python_int_into_a_float32_metric_is_stored_as_float64_never_rounded():
    """A Python int (or bool) recorded into a float32 metric took the metric's
    float32, so 16777217 read back as 16777216 with no error (only float64's
    2**53 was checked). The docs say such a value is stored as float64: the
    metric widens to float64 and keeps the integer exactly, on the first such
    update and on the later ones that reuse its types; a float32 metric in
    another grouping reads back float64 too."""
    s = jh.HistoryState().update({"a": np.float32(0.5)})
    for value in (2**24 + 1, True):
        out = s.update({"a": value}).update({"a": 2**24 + 3})
        assert out.dtype("a") == np.float64 and out.values("a").dtype == np.float64
        assert out.values("a").tolist() == [0.5, float(value), 2**24 + 3]
    both = s.update({"a": 2**24 + 1, "b": 1.0})
    assert both.dtype("a") == np.float64
    assert both.values("a").tolist() == [0.5, 2**24 + 1]
    assert s.dtype("a") == np.float32 and s.values("a").tolist() == [0.5]


def test_integers_just_past_2_to_53_are_refused_on_every_path():
    big = 2**53 + 1
    for value in (np.int64(big), np.int64(-big)):
        s = jh.HistoryState().update({"a": value})
        with pytest.raises(ValueError, match="cannot hold exactly"):
            s.update({"a": 0.5})
    # a float metric that has taken an int before (its rows cache int types)
    s = jh.HistoryState().update({"x": 1.0}).update({"x": 3})
    with pytest.raises(ValueError, match=f"cannot hold the integer {big}"):
        s.update({"x": big})
    assert s.values("x").tolist() == [1.0, 3.0]


def test_select_names_a_prefix_that_is_not_a_string():
    s = jh.HistoryState().update({"a": 1.0})
    with pytest.raises(TypeError, match=r"select.*prefix.*str.*int 5"):
        s.select(5)
    with pytest.raises(TypeError, match="bytes"):
        s.select("a", b"a")
    assert s.select("a").keys == ("a",)


def test_select_keeps_every_record_of_a_metric_recorded_in_several_groupings():
    """A metric recorded alone and beside others: selecting it keeps the
    records of both groupings, in step order (one overwrote the other)."""
    s = jh.HistoryState().update({"a": 1.0}, step=0)
    s = s.update({"a": 2.0, "b": 5.0}, step=1).update({"a": 3.0}, step=2)
    picked = s.select("a")
    assert picked.keys == ("a",)
    assert picked.steps("a").tolist() == [0, 1, 2]
    assert picked.values("a").tolist() == [1.0, 2.0, 3.0]
    s = jh.HistoryState().update({"t/a": 1, "b": 5.0, "c": 1.0}, step=0)
    s = s.update({"t/a": 2, "c": 2.0}, step=3).update({"c": 3.0}, step=4)
    s = s.update({"t/a": 4, "b": 6.0, "c": 4.0}, step=5)
    picked = s.select("t", "c")
    assert picked.keys == ("t/a", "c")
    for name in picked.keys:
        assert picked.steps(name).tolist() == s.steps(name).tolist()
        assert picked.values(name).tolist() == s.values(name).tolist()
        assert picked.dtype(name) == s.dtype(name)
    assert picked.update({"t/a": 7, "c": 7.0}).values("t/a").tolist() == [1, 2, 4, 7]


# ----- many key sets: linear recording; summary of single values --------------------


def key_sets(n):
    s = jh.HistoryState()
    for i in range(n):
        s = s.update({f"sample/{i}": float(i), "loss": 1.0 / (i + 1)}, step=i)
    return s


def test_a_new_key_set_at_a_new_step_never_scans_the_tables(monkeypatch):
    from jaxhistory._table import Table

    s = key_sets(50)
    calls = []
    real = Table.step_at
    monkeypatch.setattr(Table, "step_at", lambda t, n: calls.append(1) or real(t, n))
    for i in range(50, 100):
        s = s.update({f"sample/{i}": 1.0, "loss": 0.5}, step=i)
    assert not calls  # O(keys) per update, not O(tables)
    assert s.count("loss") == 100 and s.dtype("loss") == np.float64
    # The checks still hold across key sets: shape, and steps out of order.
    with pytest.raises(ValueError, match="'loss' changed shape"):
        s.update({"loss": np.ones(2), "new": 1.0}, step=100)
    with pytest.raises(ValueError, match="'loss' was already recorded at step 99"):
        s.update({"loss": 1.0, "new": 1.0}, step=99)
    t = s.update({"sample/3": 1, "n": 1}, step=100)  # an int joins a float metric
    assert t.dtype("sample/3") == np.float64 and t.dtype("n") == np.int64
    assert s.count("loss") == 100  # the refused updates changed nothing


def test_summary_of_single_values_matches_numpy():
    s = jh.HistoryState()
    for i, v in enumerate((2.5, math.nan, math.inf, -3)):
        s = s.update({f"m{i}": v}, step=i)
    got = s.summary()
    assert got["m0"] | {} == {
        "mean": 2.5,
        "std": 0.0,
        "median": 2.5,
        "p10": 2.5,
        "p90": 2.5,
        "min": 2.5,
        "max": 2.5,
        "last": 2.5,
        "count": 1,
        "nonfinite": 0,
    }
    assert got["m3"]["mean"] == -3.0 and got["m3"]["std"] == np.std([-3.0])
    for name in ("m1", "m2"):
        assert math.isnan(got[name]["mean"]) and got[name]["nonfinite"] == 1
    assert math.isnan(got["m1"]["last"]) and got["m2"]["last"] == math.inf


def test_summary_keeps_the_extremes_and_last_value_of_integers_exact(tmp_path):
    """Found by a round trip: every statistic went through float64, so a token
    count of 2**53 + 1 had min, max and last 2**53 (a value never recorded) and
    2**64 - 1 in uint64 had a max of 2**64; the report showed those."""
    s = jh.HistoryState()
    for i, v in enumerate((2**53 + 1, 2**53 + 3, -(2**63), 2**63 - 1, 2**53 + 1)):
        s = s.update({"tokens": v, "u": np.uint64(2**64 - 2 + i % 2)})
    got = s.summary()["tokens"]
    assert (got["min"], got["max"], got["last"]) == (-(2**63), 2**63 - 1, 2**53 + 1)
    assert type(got["last"]) is int
    assert got["mean"] == s.values("tokens").mean()  # as NumPy reckons it
    assert (s.summary()["u"]["min"], s.summary()["u"]["max"]) == (2**64 - 2, 2**64 - 1)
    one = jh.HistoryState().update({"n": 2**53 + 1}).summary()["n"]
    assert one["min"] == one["max"] == one["last"] == 2**53 + 1
    grid = jh.HistoryState().update({"a": np.array([[2**62 + 1, 3]])}).summary()["a"]
    assert grid["max"] == 2**62 + 1 and grid["min"] == 3
    text = jh.export.to_markdown(s, tmp_path / "r.md").read_text()
    assert f"| {2**53 + 1} | 0 | 5 |" in text  # last, nonfinite, count


def test_summary_last_is_the_last_value_recorded(tmp_path):
    """Found by a round trip: the last value of a scalar metric was the mean of
    it, which made a recorded -0.0 into 0.0 (the report: ``x = 0``)."""
    s = jh.HistoryState().update({"x": -0.0}).update({"x": -0.0})
    assert math.copysign(1.0, s.summary()["x"]["last"]) == -1.0
    assert "x = -0" in jh.export.to_markdown(s, tmp_path / "r.md").read_text()


def test_summary_of_values_near_the_largest_float(tmp_path):
    """Found by a round trip: the sums of the mean and std overflowed, so finite
    values had a mean of inf, with NumPy's overflow warning, which where
    warnings are errors ended finalize before report.md was written."""
    big = np.array([1.7e308, 1.7e308, 1.0e308, -1.7e308])
    s = jh.HistoryState()
    for v in big:
        s = s.update({"x": float(v)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = s.summary()["x"]
        jh.export.to_markdown(s, tmp_path / "r.md")
    unit = np.ldexp(big, -1024)  # NumPy's statistics of these, 2**1024 times
    want = [unit.mean(), unit.std(), *np.percentile(unit, [10, 50, 90])]
    got_all = [got[k] for k in ("mean", "std", "p10", "median", "p90")]
    assert got_all == [np.ldexp(v, 1024) for v in want]
    assert math.isclose(got["mean"], 0.675e308, rel_tol=1e-15)
    assert (got["min"], got["max"], got["last"]) == (-1.7e308, 1.7e308, -1.7e308)


def test_summary_last_of_an_array_with_infinities_or_huge_values(tmp_path):
    """Found by a randomized round trip: an array metric's last value (the
    mean of its last record) came with NumPy's "invalid value" warning where
    that record held inf and -inf, and was inf, with an overflow warning, for
    values near the largest float: where warnings are errors, summary(), the
    report and `jaxhistory summary` raised."""
    s = jh.HistoryState().update({"w": np.array([1.0, 2.0])})
    s = s.update({"w": np.array([np.inf, -np.inf])})
    t = jh.HistoryState().update({"w": np.array([1.7e308, 1.7e308, 1.0e308])})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(s.summary()["w"]["last"])
        assert t.summary()["w"]["last"] == pytest.approx(1.4666666666666667e308)
        jh.export.to_markdown(s, tmp_path / "r.md")


def test_the_appender_makes_a_state_only_when_read():
    rec = Appender()
    for s in range(5):
        rec.append(parse_row({"loss": s / 2, "lr": 1e-3}, None, rec.next_step))
    first = rec.state
    assert first is rec.state  # nothing appended since: the same object
    assert first.values("loss").tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    rec.append(parse_row({"loss": 9.0, "lr": 1e-3}, None, rec.next_step))
    assert first.steps("loss").tolist() == [0, 1, 2, 3, 4]  # never sees later rows
    assert rec.state.steps("loss").tolist() == [0, 1, 2, 3, 4, 5]
    assert rec.next_step == rec.state.next_step == 6


def test_the_appender_goes_on_after_a_read_state_is_branched():
    """A state read from the appender and updated elsewhere takes the end of the
    shared table: the appender's next row copies, and both keep their own."""
    rec = Appender()
    for s in range(3):
        rec.append(parse_row({"a": float(s)}, None, rec.next_step))
    branch = rec.state.update({"a": 100.0})
    rec.append(parse_row({"a": 3.0}, None, rec.next_step))
    rec.append(parse_row({"a": 4.0}, None, rec.next_step))
    assert branch.values("a").tolist() == [0.0, 1.0, 2.0, 100.0]
    assert rec.state.values("a").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_the_appender_refuses_what_the_state_refuses_and_keeps_the_rest():
    rec = Appender()
    rec.append(parse_row({"a": 1.0}, 5))
    assert not rec.append_floats(("a",), (2.0,), 5)  # not past the last step
    assert not rec.append_floats(("b",), (2.0,), 6)  # not the last row's names
    with pytest.raises(ValueError, match="already recorded"):
        rec.append(parse_row({"a": 2.0}, 5))
    assert rec.state.values("a").tolist() == [1.0]
    rec.set(jh.HistoryState().update({"b": 1.0}))
    assert not rec.append_floats(("a",), (2.0,), 7)  # forgot the old names
    rec.append(parse_row({"a": 2.0}, 7))
    assert rec.state.keys == ("b", "a") and rec.next_step == 8


def test_the_appender_interleaves_key_sets_and_value_kinds():
    rec = Appender()
    expect = {"a": [], "b": [], "c": []}
    for s in range(300):  # crosses the staging size of a table
        if s % 3:
            rec.append(parse_row({"a": s * 0.5}, s))
            expect["a"].append(s * 0.5)
        elif s % 2:
            rec.append(parse_row({"b": s}, s))  # an int: its own dtype
            expect["b"].append(s)
        else:
            rec.append(parse_row({"c": np.float32(s)}, s))
            expect["c"].append(s)
    state = rec.state
    for name, values in expect.items():
        np.testing.assert_array_equal(state.values(name), values)
    assert state.values("b").dtype == np.int64


def _reduced_rows(steps, rng, names=("loss", "lr"), where=True):
    """Rows as a batch reduced on the host gives them: one Stats and the
    straggler fields, NumPy scalars."""
    rows = []
    for s in steps:
        table = rng.normal(size=(4, len(names))).astype(np.float32)
        found = rng.integers(-1, 4, (3, len(names))).astype(np.int32)
        stats = jh.Stats(names, table, found if where else None)
        values = (stats, np.int32(s % 3), np.float32(s / 100))
        rows.append(Row(s, ("", "straggler/process", "straggler/lag"), values, VALUES))
    return rows


def _same_states(a, b):
    assert a.keys == b.keys and a.next_step == b.next_step
    for k in a.keys:
        assert a.dtype(k) == b.dtype(k), k
        np.testing.assert_array_equal(a.steps(k), b.steps(k), err_msg=k)
        np.testing.assert_array_equal(a.values(k), b.values(k), err_msg=k)


def test_the_appender_takes_a_batch_of_reduced_rows_in_one_call():
    """What a batch reduced on the host gives, appended in one extend per
    table: the state appending the rows one by one makes, plain values
    recorded between batches and read states included."""
    rng = np.random.default_rng(0)
    one, bulk = Appender(), Appender()
    for start in range(0, 96, 16):
        rows = _reduced_rows(range(start, start + 16), rng)
        for r in rows:
            one.append(r)
        bulk.append_rows(rows)
        for rec in (one, bulk):  # the plain values of later updates
            rec.append(parse_row({"x": 1.0}, start + 100))
        if start == 48:
            _same_states(one.state, bulk.state)
    _same_states(one.state, bulk.state)
    assert bulk.state.values("loss/argmax").dtype == np.int32


@pytest.mark.parametrize("case", ["f16", "int64", "recorded"])
def test_a_batch_of_rows_takes_the_checks_of_extend(case):
    """Statistics in float16 (stored as float32) or int64 in a float column
    (widened) take extend's own conversions; steps at or before a record
    raise as extend does, and nothing of the batch is recorded."""
    rng = np.random.default_rng(2)
    rows = _reduced_rows(range(10, 14), rng)
    one, bulk = Appender(), Appender()
    if case == "f16":
        rows = [
            r._replace(
                values=(
                    jh.Stats(
                        r.values[0].names,
                        r.values[0].table.astype(np.float16),
                        r.values[0].where,
                    ),
                    *r.values[1:],
                )
            )
            for r in rows
        ]
    elif case == "int64":
        for rec in (one, bulk):
            rec.append(parse_row({"straggler/lag": 0.5}, 2))
        rows = [r._replace(values=(*r.values[:2], np.int64(r.step))) for r in rows]
    else:
        for rec in (one, bulk):
            rec.append(parse_row({"loss/mean": 0.5}, 12))
        before = bulk.state
        with pytest.raises(ValueError, match="already recorded"):
            bulk.append_rows(rows)
        assert bulk.state is before and bulk.state.count("loss/mean") == 1
        return
    for r in rows:
        one.append(r)
    bulk.append_rows(rows)
    _same_states(one.state, bulk.state)
    if case == "f16":
        assert bulk.state.values("loss/mean").dtype == np.float32
    else:
        assert bulk.state.values("straggler/lag").dtype == np.float64


@pytest.mark.parametrize("case", ["steps", "layouts", "device", "plain", "no-where"])
def test_rows_that_do_not_share_a_layout_are_appended_one_by_one(case):
    rng = np.random.default_rng(1)
    rows = _reduced_rows(range(10, 14), rng, where=case != "no-where")
    if case == "steps":  # not increasing: the per-row checks decide
        rows[2] = rows[2]._replace(step=11)
    elif case == "layouts":  # another metric in one row
        rows[1:2] = _reduced_rows([11], rng, names=("loss", "lr", "acc"))
    elif case == "device":  # a Stats still on the device
        stats = rows[0].values[0]
        device = jh.Stats(stats.names, jnp.asarray(stats.table), stats.where)
        rows[0] = rows[0]._replace(values=(device, *rows[0].values[1:]))
    elif case == "plain":  # a Python value among the plain ones
        rows[3] = rows[3]._replace(values=(*rows[3].values[:2], 0.5))
    one, bulk = Appender(), Appender()
    if case == "steps":
        with pytest.raises(ValueError, match="already recorded"):
            for r in rows:
                one.append(r)
        with pytest.raises(ValueError, match="already recorded"):
            bulk.append_rows(rows)
    else:
        for r in rows:
            one.append(r)
        bulk.append_rows(rows)
    _same_states(one.state, bulk.state)
    if case == "no-where":
        assert "loss/argmax" not in bulk.state and bulk.state.count("loss/mean") == 4


def test_values_replicated_over_devices_are_read_exactly_and_a_deleted_one_is_nan(
    mesh,
):
    """Device values replicated over 8 devices are read from one of them when
    their rows move to NumPy: the same numbers and dtypes as a plain read; a
    deleted one still becomes NaN (0 for integers) with the warning."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    repl = NamedSharding(mesh, P())
    vals = [
        {
            "x": jax.device_put(jnp.float32(i / 3), repl),
            "n": jax.device_put(jnp.int32(i), repl),
            "v": jax.device_put(jnp.arange(3.0) * i, repl),
            "h": float(i),
        }
        for i in range(5)
    ]
    s = jh.HistoryState()
    for i, m in enumerate(vals):
        s = s.update(m, step=i)
    vals[2]["x"].delete()
    vals[2]["n"].delete()
    with pytest.warns(RuntimeWarning, match="step 2 could not be read"):
        x = s.values("x")
    assert x.dtype == np.float32 and np.isnan(x[2])
    np.testing.assert_array_equal(x[[0, 1, 3, 4]], np.float32([0, 1, 3, 4]) / 3)
    np.testing.assert_array_equal(
        x[[0, 1, 3, 4]], [np.asarray(vals[i]["x"]) for i in (0, 1, 3, 4)]
    )
    assert s.values("n").tolist() == [0, 1, 0, 3, 4]
    np.testing.assert_array_equal(s.values("v")[4], [0.0, 4.0, 8.0])
    assert s.values("h").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_state_holding_a_deleted_device_value_flattens_without_crashing():
    """Flattening a state asks whether its staged device values are computed;
    asking a deleted array crashes the process, so a deleted one counts as
    done and is reported (NaN, with the warning) when read. In a child
    process: a crash must fail this test, not the suite."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import warnings, jax, jax.numpy as jnp, jaxhistory as jh\n"
        "a = jnp.float32(1) + 0\n"
        "s = jh.HistoryState().update({'a': a, 'b': a * 2}, step=0)\n"
        "a.delete()\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    leaves = jax.tree.leaves(s)\n"
        "print(len(leaves), s.values('a').tolist(), s.values('b').tolist(),\n"
        "      sum('could not be read' in str(w.message) for w in caught))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    # flattened; 'a' deleted: NaN and one warning; 'b' kept
    leaves, *rest = proc.stdout.split()
    assert int(leaves) >= 3 and rest == ["[nan]", "[2.0]", "1"], proc.stdout


def test_a_metric_named_step_is_refused_by_extend_and_update_packed():
    state = jh.HistoryState().update({"x": 1.0}, step=0)
    with pytest.raises(ValueError, match="may not be named 'step'"):
        state.extend(np.arange(1, 4), {"step": np.arange(3.0), "x": np.ones(3)})
    with pytest.raises(ValueError, match="may not be named 'step'"):
        state.update_packed(("step", "y"), np.ones(2, np.float32), step=5)
    assert state.values("x").tolist() == [1.0]  # nothing lost
    state.to_xarray()


def test_a_uint64_that_would_widen_an_int64_metric_names_both_dtypes():
    """An int64 metric given a uint64 past int64 was refused with "is stored
    as float64", a dtype it never had (the two widen to float64). The message
    names the metric's int64 and the uint64 value; nothing is recorded."""
    s = jh.HistoryState().update({"m": 1})
    with pytest.raises(ValueError) as info:
        s.update({"m": np.uint64(2**64 - 1)})
    message = str(info.value)
    assert "stored as int64" in message and "a uint64 value" in message, message
    assert "float64" in message and str(2**64 - 1) in message
    assert s.values("m").tolist() == [1] and s.values("m").dtype == np.int64


def test_a_state_through_jit_or_device_put_comes_back_a_working_state():
    """Leaves that come back as JAX arrays (a jitted function's output,
    ``jax.device_put``) rebuild a state that reads and records, as NumPy
    leaves do."""
    s = jh.HistoryState().update({"a": 1.0, "i": 3, "w": np.arange(2.0)}, step=0)
    s = s.update({"a": 2.0, "i": 4, "w": np.arange(2.0) + 1}, step=5)
    doubled = jax.jit(lambda st: jax.tree.map(lambda x: x * 2, st))(s)
    same = jax.jit(lambda st: st)(s)
    for out, scale in ((same, 1), (doubled, 2), (jax.device_put(s), 1)):
        assert type(out) is jh.HistoryState and out.keys == s.keys
        assert out.steps("a").dtype == np.int64
        assert out.steps("i").tolist() == [0, 5 * scale]
        assert out.values("i").tolist() == [3 * scale, 4 * scale]
        assert out.values("w").tolist() == [[0.0, scale], [scale, 2.0 * scale]]
        assert out.next_step == 6 * scale
        more = out.update({"a": 9.0, "i": 9, "w": np.zeros(2)})
        assert more.values("a")[-1] == 9.0 and more.count("i") == 3
        assert more.steps("a")[-1] == 6 * scale


def test_a_state_pickles_and_deep_copies_with_every_record_and_dtype(tmp_path):
    """pickle (a launched function's return value, a checkpoint) and
    copy.deepcopy keep every record, dtype, step, attribute and the table
    layout, device values not read yet included; the copy records on its
    own and the original is unchanged."""
    import copy
    import pickle

    s = jh.HistoryState().update({"a": 1.0, "i": 2**53 + 1, "b": True}, step=0)
    s = s.update({"w": np.arange(3, dtype=np.float32), "u": np.uint64(2**63)}, step=4)
    s = s.update({"d": jnp.float32(1.5) + 0, "n": jnp.int32(7) + 0}, step=7)
    s = s.with_attrs(run="r1", tags=["x"])
    log = tmp_path / "run.jsonl"
    jh.export.to_jsonl(jh.HistoryState().update({"loss": 0.5}, step=3), log)
    resumed = jh.HistoryState.from_jsonl(log).update({"loss": 0.25})
    for state in (s, resumed, jh.HistoryState()):
        for back in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
            assert type(back) is jh.HistoryState
            assert back.keys == state.keys and back.next_step == state.next_step
            assert back.attrs == state.attrs
            assert [k for k, _, _ in back.blocks()] == [k for k, _, _ in state.blocks()]
            for name in state.keys:
                assert back.dtype(name) == state.dtype(name)
                np.testing.assert_array_equal(back.steps(name), state.steps(name))
                np.testing.assert_array_equal(back.values(name), state.values(name))
                assert back.values(name).dtype == state.values(name).dtype
    back = copy.deepcopy(s)
    assert back.values("i")[0] == 2**53 + 1 and back.values("u")[0] == 2**63
    back.attrs[1][1].append("y")  # its attrs are its own
    assert dict(s.attrs)["tags"] == ["x"]
    more = back.update({"d": jnp.float32(2.5) + 0, "n": jnp.int32(8) + 0})
    assert more.values("d").tolist() == [1.5, 2.5] and s.values("d").tolist() == [1.5]
    assert copy.copy(s).values("n").tolist() == [7]


def test_a_state_unflattened_from_arrays_keeps_them_from_later_changes():
    """The caller's arrays handed to ``jax.tree.unflatten`` (an orbax
    restore, a ``jax.tree.map``) may be changed afterwards: the state is
    immutable and keeps what it was given."""
    s = jh.HistoryState().update({"a": 1.0}, step=0).update({"a": 2.0}, step=1)
    leaves, treedef = jax.tree.flatten(s)
    mine = [np.array(x) for x in leaves]
    back = jax.tree.unflatten(treedef, mine)
    mine[0][0], mine[1][0] = 50, 99.0
    assert back.steps("a").tolist() == [0, 1]
    assert back.values("a").tolist() == [1.0, 2.0]
    assert back.update({"a": 3.0}).values("a").tolist() == [1.0, 2.0, 3.0]


def test_states_with_equal_content_are_equal():
    """Finding: ``==`` compared the storage by identity, so two states recording
    the same values separately (or a state and its dataset read back) were
    unequal. Equal metrics (steps, values with NaN equal to NaN, dtypes),
    next_step and attrs now make equal states, however the records were split
    into tables; equal states hash alike."""

    def run(loss):
        s = jh.HistoryState().update({"loss": loss, "n": 3}, step=0)
        s = s.update({"w": np.arange(3.0), "loss": math.nan, "n": 4})
        return s.update({"eval/acc": 0.5}, step=5).with_attrs(run="r")

    a, b = run(1.0), run(1.0)
    assert a == b and hash(a) == hash(b)
    assert (a != b) is False
    assert a == jh.HistoryState.from_xarray(a.to_xarray())  # one table per metric
    assert jh.HistoryState() == jh.HistoryState()
    assert a != run(2.0)  # a value
    assert a != a.with_attrs(run="other")  # the attrs
    assert a != jh.HistoryState(data=a.data, next_step=a.next_step + 1, attrs=a.attrs)
    assert a != a.select("loss", "n", "w")  # a metric fewer
    assert a == a.update({"eval/acc": 0.5}, step=6).before(6)  # taken off again
    # a metric with no record before the step is gone, not kept with 0 records
    # (it showed as a row of '-' and count 0 in a resumed run's report)
    assert a.before(5).keys == ("loss", "n", "w") and len(a.before(0)) == 0
    assert a.before(0).keys == () and a.before(0).next_step == 0
    assert a != a.update({"eval/acc": 0.5}, step=6)
    ints = jh.HistoryState().update({"x": 1}, step=0)
    floats = jh.HistoryState().update({"x": 1.0}, step=0)
    assert ints != floats  # int64 against float64
    later = jh.HistoryState().update({"x": 1}, step=0).update({"x": 1}, step=2)
    assert later != jh.HistoryState().update({"x": 1}, step=0).update({"x": 1}, step=1)
    assert a.__eq__("a") is NotImplemented and a != "a"


def test_states_with_array_attrs_compare_without_raising():
    """Finding: ``==`` compared the attrs as tuples, so a NumPy array among them
    (a config's shape, a dataset's attribute) raised 'The truth value of an
    array ... is ambiguous' instead of answering; states used as dict keys
    (equal hashes) raised too."""
    s = jh.HistoryState().update({"x": 1.0}, step=0)
    a = s.with_attrs(shape=np.arange(3), cfg={"w": np.ones(2)})
    b = s.with_attrs(shape=np.arange(3), cfg={"w": np.ones(2)})
    assert a == b and hash(a) == hash(b)
    assert a != s.with_attrs(shape=np.arange(4), cfg={"w": np.ones(2)})
    assert a != s.with_attrs(shape=np.arange(3), cfg={"w": np.zeros(2)})
    assert a != s.with_attrs(shape=[0, 1, 2], cfg={"w": np.ones(2)})
    assert {a: 1}[b] == 1


def test_states_with_nan_attrs_equal_their_copies():
    """Finding: a NaN among the attrs (a learning rate not set, a NumPy
    scalar, a NaN in a list or a set) made a state unequal to its pickled or
    deep copy and to the same state built again, though NaN in metric values
    and in array attrs already compared equal. NaN at the same places now
    counts as equal; NaN against a number, a type or a shape apart still
    differ, and equal states hash alike."""
    import copy
    import pickle

    nan = float("nan")
    s = jh.HistoryState().update({"x": 1.0}, step=0)

    def attrs():
        return {
            "lr": float("nan"),
            "beta": np.float32("nan"),
            "mix": complex(1.0, float("nan")),
            "born": np.datetime64("NaT", "s"),
            "cfg": {"decay": [1.0, (np.float64("nan"), -0.0)]},
            "tags": {float("nan"), "a"},
            "w": np.array([1.0, np.nan]),
            "rows": np.array([(1, np.nan)], dtype=[("n", "i8"), ("v", "f8")]),
            "objs": np.array([np.nan, "a"], dtype=object),
        }

    a = s.with_attrs(**attrs())
    for other in (
        pickle.loads(pickle.dumps(a)),
        copy.deepcopy(a),
        s.with_attrs(**attrs()),
        jh.HistoryState.from_xarray(s.with_attrs(lr=nan).to_xarray()).with_attrs(
            **{k: v for k, v in attrs().items() if k != "lr"}
        ),
    ):
        assert other == a and a == other and hash(other) == hash(a)
    assert s.with_attrs(lr=0.0) == s.with_attrs(lr=-0.0)  # as == has them
    assert s.with_attrs(w=np.array([0.0])) == s.with_attrs(w=np.array([-0.0]))
    assert s.with_attrs(lr=np.float64(nan)) == s.with_attrs(lr=nan)
    unequal = {
        "lr": 0.1,  # NaN against a number
        "beta": None,
        "mix": complex(1.0, 0.0),
        "born": np.timedelta64("NaT", "s"),  # NaT of another kind
        "cfg": {"decay": [1.0, (0.0, -0.0)]},
        "tags": {float("nan"), "b"},
        "w": np.array([1.0, np.nan], np.float32),  # another dtype
        "rows": np.array([(1, 0.0)], dtype=[("n", "i8"), ("v", "f8")]),
        "objs": np.array([np.nan, "b"], dtype=object),
    }
    for name, value in unequal.items():
        assert a != a.with_attrs(**{name: value}), name
    assert a != a.with_attrs(w=np.array([[1.0, np.nan]]))  # another shape
    assert a != a.with_attrs(w=np.array([np.nan, 1.0]))  # NaN elsewhere
    assert a != a.with_attrs(tags={float("nan"), float("nan"), "a"})
    assert a != a.with_attrs(cfg={"decay": [1.0, [np.float64("nan"), -0.0]]})


def test_with_attrs_keeps_copies_of_the_callers_containers():
    """Finding: with_attrs kept the caller's dict and list, so changing them
    later changed the state's attrs (and every state sharing them)."""
    config = {"lr": 1e-3, "layers": [64, 64], "opt": {"betas": (0.9, [0.99])}}
    tags = ["a"]
    s = jh.HistoryState().with_attrs(config=config, tags=tags)
    config["lr"] = 1.0
    config["layers"].append(128)
    config["opt"]["betas"][1].append(0.5)
    tags.append("b")
    attrs = dict(s.attrs)
    assert attrs["config"] == {
        "lr": 1e-3,
        "layers": [64, 64],
        "opt": {"betas": (0.9, [0.99])},
    }
    assert attrs["tags"] == ["a"]


def test_a_large_array_metric_reserves_room_in_bytes_not_in_rows():
    """Finding: the first record of an array metric set aside room for 64 rows,
    so a 400 MB array asked for 25 GiB and failed with MemoryError (a 40 MB one
    reserved 2.5 GB). Room for large rows is now bounded in bytes, and grows
    from there; every record is kept."""
    import tracemalloc

    a = np.ones(10_000_000, np.float32)  # 40 MB
    tracemalloc.start()
    try:
        s = jh.HistoryState().update({"a": a}, step=0)
        s.values("a")
        _, first = tracemalloc.get_traced_memory()
        for step in range(1, 5):
            s = s.update({"a": a * step}, step=step)
        got = s.values("a")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first < 3 * a.nbytes, first / a.nbytes
    assert peak < 16 * a.nbytes, peak / a.nbytes
    assert got.shape == (5, 10_000_000)
    assert [float(row[0]) for row in got] == [1.0, 1.0, 2.0, 3.0, 4.0]
    # small rows keep their 64 rows of room (no regrowth on short runs)
    t = jh.HistoryState()
    for step in range(64):
        t = t.update({"x": 1.0}, step=step)
    assert t.count("x") == 64


def test_an_attr_that_holds_itself_is_a_clear_error():
    """Finding: with_attrs copies plain containers all the way down; a list
    holding itself ended in a bare RecursionError."""
    s = jh.HistoryState().update({"x": 1.0}, step=0).with_attrs(lr=0.1)
    loop = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match="'cfg' holds itself"):
        s.with_attrs(cfg={"a": loop})
    shared = [1, 2]  # the same object twice is no loop
    t = s.with_attrs(pair=[shared, shared])
    assert dict(t.attrs)["pair"] == [[1, 2], [1, 2]] and dict(s.attrs) == {"lr": 0.1}
