"""SPMD reducers: semantics and edge cases."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh

REDUCERS = [jh.reduce_mean, jh.reduce_sum, jh.reduce_max, jh.reduce_min, jh.reduce_std]


def test_every_leaf_of_a_nested_pytree_is_reduced():
    metrics = {
        "train": {"loss": jnp.arange(4.0), "acc": [jnp.ones(3), jnp.zeros((2, 2))]},
        "lr": 1e-3,
    }
    out = jax.jit(jh.reduce_mean)(metrics)
    assert jax.tree.structure(out) == jax.tree.structure(metrics)
    assert all(leaf.shape == () for leaf in jax.tree.leaves(out))
    assert float(out["train"]["loss"]) == 1.5
    assert float(out["train"]["acc"][0]) == 1.0
    np.testing.assert_allclose(out["lr"], 1e-3, rtol=1e-6)


@pytest.mark.parametrize("reducer", REDUCERS)
@pytest.mark.parametrize(
    "value", [3.5, 7, np.float32(2.0), np.array(4.0), jnp.array(5.0)], ids=repr
)
def test_scalars_of_every_kind_follow_one_rule(reducer, value):
    # A Python number, NumPy scalar or 0-d array is a one-element array.
    out = reducer({"x": value})["x"]
    assert out.shape == ()
    expected = 0.0 if reducer is jh.reduce_std else float(np.asarray(value))
    assert float(out) == expected


@pytest.mark.parametrize("reducer", REDUCERS)
def test_numpy_arrays_are_reduced_not_passed_through(reducer):
    x = np.arange(12.0).reshape(3, 4)
    out = reducer({"x": x})["x"]
    assert out.shape == ()
    expected = {
        jh.reduce_mean: 5.5,
        jh.reduce_sum: 66.0,
        jh.reduce_max: 11.0,
        jh.reduce_min: 0.0,
        jh.reduce_std: np.std(x),
    }[reducer]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_a_bare_array_is_a_pytree_too():
    assert float(jh.reduce_sum(jnp.arange(5))) == 10


def test_empty_metrics_give_empty_results():
    assert jh.reduce_mean({}) == {}
    assert jh.reduce_custom({}, None) == {}
    assert jh.distributed_stats({}) == {}


def test_caller_metrics_are_not_mutated():
    metrics = {"a": {"b": np.arange(3.0)}, "c": [1, 2]}
    before = copy.deepcopy(metrics)
    jh.reduce_custom(metrics, {"a": "sum"})
    jh.distributed_stats(metrics)
    np.testing.assert_array_equal(metrics["a"]["b"], before["a"]["b"])
    assert metrics["c"] == before["c"]


def test_weighted_mean_is_sum_vw_over_sum_w():
    v = jnp.array([1.0, 2.0, 3.0, 4.0])
    w = jnp.array([4.0, 3.0, 2.0, 1.0])
    out = jh.reduce_mean({"v": v}, weights=w)["v"]
    np.testing.assert_allclose(out, (4 + 6 + 6 + 4) / 10, rtol=1e-6)


def test_weights_can_be_a_pytree_like_the_metrics():
    metrics = {"a": jnp.array([1.0, 3.0]), "b": jnp.array([10.0, 20.0])}
    weights = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([1.0, 3.0])}
    out = jh.reduce_mean(metrics, weights=weights)
    assert float(out["a"]) == 1.0
    assert float(out["b"]) == 17.5


def test_broadcast_mask_counts_every_covered_element():
    # (B, 1) mask against (B, C) values: each kept row counts C elements.
    v = jnp.arange(12.0).reshape(4, 3)
    mask = jnp.array([[1], [0], [1], [0]])
    out = jh.reduce_mean({"v": v}, mask=mask)["v"]
    np.testing.assert_allclose(out, np.mean(np.arange(12.0).reshape(4, 3)[[0, 2]]))


def test_mask_and_weights_combine():
    v = jnp.array([1.0, 2.0, 100.0])
    out = jh.reduce_mean(
        {"v": v}, weights=jnp.array([1.0, 3.0, 5.0]), mask=jnp.array([1, 1, 0])
    )
    np.testing.assert_allclose(out["v"], (1 + 6) / 4)


def test_masked_out_nan_does_not_poison_the_mean():
    v = jnp.array([1.0, jnp.nan, 3.0])
    out = jh.reduce_mean({"v": v}, mask=jnp.array([True, False, True]))
    assert float(out["v"]) == 2.0


def test_fully_masked_leaf_is_nan():
    out = jh.reduce_mean({"v": jnp.ones(3)}, mask=jnp.zeros(3, bool))
    assert np.isnan(out["v"])


def test_mask_that_does_not_broadcast_names_the_metric():
    with pytest.raises(ValueError, match="'train/loss'.*broadcast"):
        jh.reduce_mean({"train": {"loss": jnp.ones((4, 3))}}, mask=jnp.ones(5))


def test_weights_with_another_structure_are_rejected():
    with pytest.raises(ValueError, match="same structure"):
        jh.reduce_mean({"a": jnp.ones(2), "b": jnp.ones(2)}, weights={"a": jnp.ones(2)})


def test_weighted_mean_on_a_sharded_batch(mesh):
    rng = np.random.default_rng(1)
    v, w = rng.normal(size=64).astype(np.float32), rng.random(64).astype(np.float32)
    sh = NamedSharding(mesh, P("data"))
    out = jax.jit(lambda v, w: jh.reduce_mean({"v": v}, weights=w))(
        jax.device_put(v, sh), jax.device_put(w, sh)
    )
    np.testing.assert_allclose(out["v"], np.sum(v * w) / np.sum(w), rtol=1e-5)


def test_weights_and_mask_sharded_unlike_the_values(mesh2d):
    # Explicit axes: values on ("data", "model"), weights the other way round,
    # a mask over "model" columns only; the specs clash when multiplied.
    rng = np.random.default_rng(2)
    v, w = rng.normal(size=(8, 4)).astype(np.float32), rng.random((8, 4))
    mask = rng.random((8, 4)) > 0.3
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh2d, P(*spec)))
    args = (put(v, "data", "model"), put(w.astype(np.float32), "model", "data"))
    args += (put(mask, None, "model"),)
    fn = lambda v, w, m: jh.reduce_mean({"v": v}, weights=w, mask=m)["v"]
    want = np.sum(v * w * mask) / np.sum(w * mask)
    np.testing.assert_allclose(jax.jit(fn)(*args), want, rtol=1e-5)
    np.testing.assert_allclose(fn(*args), want, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("reducer", [jh.reduce_sum, jh.reduce_mean, jh.reduce_std])
def test_low_precision_accumulates_in_float32(dtype, reducer):
    # 4096 ones: a bf16 accumulator stops at 256, an fp16 one at 2048.
    x = jnp.ones(4096, dtype).at[0].set(2)
    out = reducer({"x": x})["x"]
    assert out.dtype == jnp.float32
    xs = np.ones(4096)
    xs[0] = 2
    expected = {jh.reduce_sum: 4097.0, jh.reduce_mean: 4097 / 4096}.get(
        reducer, np.std(xs)
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_max_min_are_float32(dtype):
    x = jnp.array([1.0, -2.0, 3.0], dtype)
    assert jh.reduce_max({"x": x})["x"].dtype == jnp.float32
    assert float(jh.reduce_min({"x": x})["x"]) == -2.0


def test_integers_and_booleans():
    assert jh.reduce_sum({"t": jnp.array([1, 2, 3])})["t"].dtype == jnp.int32
    assert int(jh.reduce_sum({"ok": np.array([True, False, True])})["ok"]) == 2
    np.testing.assert_allclose(
        jh.reduce_mean({"ok": np.array([True, False, True, True])})["ok"], 0.75
    )
    assert int(jh.reduce_max({"t": jnp.array([-5, 9, 2])})["t"]) == 9


@pytest.mark.parametrize("reducer", REDUCERS)
def test_nan_propagates(reducer, mesh):
    x = np.arange(16.0, dtype=np.float32)
    x[11] = np.nan
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert np.isnan(jax.jit(reducer)({"x": xs})["x"])


def test_infinities_reduce_like_numpy():
    x = jnp.array([1.0, jnp.inf, 3.0])
    assert float(jh.reduce_max({"x": x})["x"]) == np.inf
    assert float(jh.reduce_min({"x": -x})["x"]) == -np.inf
    assert float(jh.reduce_mean({"x": x})["x"]) == np.inf


def test_float32_std_is_stable_for_large_offsets(mesh):
    x = np.array([1e4 - 1, 1e4 + 1] * 4, np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    textbook = jax.jit(lambda v: jnp.sqrt(jnp.mean(v * v) - jnp.mean(v) ** 2))(xs)
    assert abs(float(textbook) - 1.0) > 0.5  # the cancellation two passes avoid
    out = jax.jit(jh.reduce_std)({"x": xs})["x"]
    np.testing.assert_allclose(out, 1.0, atol=1e-3)


@pytest.mark.parametrize("reducer", [jh.reduce_max, jh.reduce_min])
def test_max_min_of_an_empty_leaf_is_an_error(reducer):
    with pytest.raises(ValueError, match="'grads/w' is empty"):
        reducer({"grads": {"w": jnp.zeros((0, 3))}})


def test_mean_of_an_empty_leaf_is_nan():
    assert np.isnan(jh.reduce_mean({"x": jnp.zeros(0)})["x"])


@pytest.mark.parametrize("reducer", REDUCERS)
@pytest.mark.parametrize(
    ("leaf", "match"),
    [
        ("fast", "'a/b/1' is a str"),
        (object(), "'a/b/1' is not numeric"),
        (np.array(["x", "y"]), "'a/b/1'"),
        (jnp.array([1 + 2j]), "'a/b/1' is complex"),
    ],
    ids=["str", "object", "str-array", "complex"],
)
def test_non_numeric_leaves_raise_type_error_naming_the_path(reducer, leaf, match):
    with pytest.raises(TypeError, match=match):
        reducer({"a": {"b": [1.0, leaf]}})


def test_colliding_names_are_rejected():
    with pytest.raises(ValueError, match="both named 'a/b'"):
        jh.reduce_mean({"a/b": 1.0, "a": {"b": 2.0}})


class TestReduceCustom:
    metrics = {
        "train": {"loss": jnp.array([1.0, 3.0]), "tokens": jnp.array([5, 7])},
        "eval": {"loss": jnp.array([2.0, 6.0])},
        "grad_norm": jnp.array([0.5, 4.0]),
    }

    def test_default_is_mean_for_every_leaf(self):
        out = jh.reduce_custom(self.metrics)
        assert float(out["train"]["loss"]) == 2.0
        assert float(out["grad_norm"]) == 2.25

    def test_names_paths_and_prefixes(self):
        out = jh.reduce_custom(
            self.metrics,
            {"train": "max", "train/tokens": "sum", "grad_norm": "min"},
        )
        assert float(out["train"]["loss"]) == 3.0  # prefix "train"
        assert int(out["train"]["tokens"]) == 12  # longer match wins
        assert float(out["eval"]["loss"]) == 4.0  # unmatched: mean
        assert float(out["grad_norm"]) == 0.5

    def test_one_op_for_every_leaf(self):
        out = jh.reduce_custom(self.metrics, "std")
        assert float(out["eval"]["loss"]) == 2.0

    def test_callable_reduction(self):
        out = jax.jit(
            lambda m: jh.reduce_custom(m, {"grad_norm": lambda x: jnp.linalg.norm(x)})
        )(self.metrics)
        np.testing.assert_allclose(out["grad_norm"], np.hypot(0.5, 4.0), rtol=1e-6)

    def test_unknown_op_is_named(self):
        with pytest.raises(ValueError, match="unknown reduction 'median'.*'eval'"):
            jh.reduce_custom(self.metrics, {"eval": "median"})

    def test_unknown_metric_name_is_named(self):
        with pytest.raises(ValueError, match="'train/los'"):
            jh.reduce_custom(self.metrics, {"train/los": "sum"})

    def test_non_string_key_is_rejected(self):
        with pytest.raises(ValueError, match="metric names"):
            jh.reduce_custom(self.metrics, {0: "sum"})

    def test_callable_that_does_not_reduce_is_an_error(self):
        with pytest.raises(ValueError, match="'grad_norm' returned shape \\(2,\\)"):
            jh.reduce_custom(self.metrics, {"grad_norm": lambda x: x * 2})

    def test_inside_jit_on_a_mesh(self, mesh):
        sh = NamedSharding(mesh, P("data"))
        m = {"a": jax.device_put(jnp.arange(8.0), sh), "b": jnp.arange(3)}
        out = jax.jit(lambda m: jh.reduce_custom(m, {"a": "std", "b": "sum"}))(m)
        np.testing.assert_allclose(out["a"], np.std(np.arange(8.0)), rtol=1e-6)
        assert int(out["b"]) == 3


@pytest.mark.parametrize(
    "value",
    [np.array([2**40, 1]), np.int64(2**35), 2**40, 2**70, np.array([2**63], np.uint64)],
    ids=["int64-array", "int64-scalar", "python-int", "huge-int", "uint64"],
)
def test_host_integers_that_would_wrap_are_refused(value):
    with pytest.raises(ValueError, match="'tok'.*(wrap|too large)"):
        jh.reduce_sum({"tok": value})


def test_host_int64_within_int32_range_is_fine():
    assert (
        int(jh.reduce_sum({"tok": np.array([2**30, 5], np.int64)})["tok"]) == 2**30 + 5
    )


def test_callable_returning_a_non_array_names_the_metric():
    with pytest.raises(TypeError, match="'x' returned a dict"):
        jh.reduce_custom({"x": jnp.ones(2)}, {"x": lambda v: {"a": v}})


def nested(depth, leaf=1.0):
    tree = leaf
    for _ in range(depth):
        tree = {"a": tree}
    return tree


def test_a_tree_deeper_than_the_limit_is_refused_before_any_recursion():
    """A 2000-deep dict raises ValueError naming the limit, not RecursionError,
    and JAX works normally afterwards; 100 levels are still reduced."""
    assert float(jax.tree.leaves(jh.reduce_mean(nested(100)))[0]) == 1.0
    deep = nested(2000)
    for call in (
        *(lambda t, r=r: r(t) for r in REDUCERS),
        lambda t: jh.reduce_custom(t, "max"),
        lambda t: jh.reduce_mean({"x": 1.0}, weights=t),
    ):
        with pytest.raises(ValueError, match=r"more than 100 levels deep"):
            call(deep)
    with pytest.raises(ValueError, match=r"weights nest more than 100 levels"):
        jh.reduce_mean(nested(100), weights=nested(101))
    with pytest.raises(ValueError, match=r"mask nest more than 100 levels"):
        jh.reduce_mean(nested(100), mask=nested(101, True))
    # the next JAX calls work
    assert float(jnp.ones(3).sum()) == 3.0
    assert float(jax.jit(lambda x: x * 2)(2.0)) == 4.0
    looped = []
    looped.append(looped)  # a list that holds itself never ends
    with pytest.raises(ValueError, match=r"more than 100 levels deep"):
        jh.reduce_mean({"x": looped})


# ----- values that cannot be stored -------------------------------------------------


@pytest.mark.parametrize(
    "reduce",
    [jh.reduce_mean, jh.reduce_sum, jh.reduce_max, jh.distributed_stats],
)
def test_reducers_refuse_a_none_leaf(reduce):
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        reduce({"bad": None, "ok": jnp.ones(3)})


def test_the_float32_range_of_the_reducers_is_as_documented():
    """The reducers do not rescale (docs/reducers.md): the mean of values
    whose sum passes float32's largest is inf, as is the std of deviations
    past 1.8e19; distributed_stats scales and returns NumPy's figures."""
    big = jnp.full((1000,), 1e36, jnp.float32)
    wide = jnp.array([1e20, -1e20], jnp.float32)
    assert jnp.isinf(jh.reduce_mean(big)) and jnp.isinf(jh.reduce_std(wide))
    assert float(jh.distributed_stats(big)["mean"]) == pytest.approx(1e36, rel=1e-6)
    assert float(jh.distributed_stats(wide)["std"]) == pytest.approx(1e20, rel=1e-6)
    # just inside the range: finite and right
    assert float(jh.reduce_mean(big / 1e4)) == pytest.approx(1e32, rel=1e-6)
    assert float(jh.reduce_std(wide / 1e2)) == pytest.approx(1e18, rel=1e-6)


def test_errors_about_a_bare_array_name_it_as_the_root():
    """Finding: a bare array's errors read "metric ''", where the rest of the
    library says '<root>'."""
    with pytest.raises(ValueError, match="metric '<root>' is empty"):
        jh.reduce_max(jnp.zeros((0,)))
    with pytest.raises(ValueError, match="weights/mask for metric '<root>'"):
        jh.reduce_mean(jnp.ones(16), weights=jnp.ones(3))
