"""Collective reducers inside jax.shard_map (check_vma=True), and host collection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh


def run(mesh, fn, *args, in_specs=P("data")):
    body = jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=True
    )
    return jax.jit(body)(*args)


def sharded(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P("data")))


def test_whole_pytree_shares_one_psum(mesh):
    metrics = {f"m{i}": sharded(mesh, jnp.arange(16.0) + i) for i in range(20)}
    fn = jax.shard_map(
        lambda m: jh.collective.reduce_mean(m, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    assert jh.collective_counts(fn, metrics) == {"all-reduce": 1}
    out = jax.jit(fn)(metrics)
    assert float(out["m3"]) == 7.5 + 3


def test_masked_mean_is_exact_when_shards_keep_different_counts(mesh):
    v = np.arange(32.0, dtype=np.float32)
    mask = np.zeros(32, bool)
    mask[:3] = True  # shard 0 keeps 3 values, shard 1 keeps 2, the rest none
    mask[4:6] = True
    out = run(
        mesh,
        lambda v, m: jh.collective.reduce_mean({"v": v}, "data", mask=m),
        sharded(mesh, v),
        sharded(mesh, mask),
        in_specs=(P("data"), P("data")),
    )
    np.testing.assert_allclose(out["v"], v[mask].mean())


def test_weighted_mean_collective(mesh):
    rng = np.random.default_rng(2)
    v, w = rng.normal(size=64).astype(np.float32), rng.random(64).astype(np.float32)
    out = run(
        mesh,
        lambda v, w: jh.collective.reduce_mean({"v": v}, "data", weights=w),
        sharded(mesh, v),
        sharded(mesh, w),
        in_specs=(P("data"), P("data")),
    )
    np.testing.assert_allclose(out["v"], np.sum(v * w) / np.sum(w), rtol=1e-5)


def test_mixed_dtypes_in_one_call(mesh):
    m = {
        "loss": sharded(mesh, jnp.arange(8.0)),
        "tokens": sharded(mesh, jnp.arange(8, dtype=jnp.int32)),
        "half": sharded(mesh, jnp.arange(8.0, dtype=jnp.bfloat16)),
    }
    out = run(mesh, lambda m: jh.collective.reduce_sum(m, "data"), m)
    assert out["tokens"].dtype == jnp.int32 and int(out["tokens"]) == 28
    assert out["half"].dtype == jnp.float32 and float(out["half"]) == 28.0
    out = run(mesh, lambda m: jh.collective.reduce_max(m, "data"), m)
    assert int(out["tokens"]) == 7 and float(out["loss"]) == 7.0


def test_a_value_that_is_the_same_on_every_device_counts_once_per_device(mesh):
    out = run(
        mesh,
        lambda v: jh.collective.reduce_sum({"c": jnp.float32(2.0), "v": v}, "data"),
        sharded(mesh, jnp.ones(8)),
    )
    assert float(out["c"]) == 16.0
    out = run(
        mesh,
        lambda v: jh.collective.reduce_mean({"c": jnp.float32(2.0)}, "data"),
        sharded(mesh, jnp.ones(8)),
    )
    assert float(out["c"]) == 2.0


def test_a_value_sharded_over_one_of_the_reduced_axes(mesh2d):
    # Over ("data", "model"), a block that varies over "model" only (copies
    # along "data") counts once per device, as for a fully replicated value;
    # lax.psum alone refuses its mixed type.
    v = np.arange(8.0, dtype=np.float32)
    x = jax.device_put(v, NamedSharding(mesh2d, P("model")))
    axes, copies = ("data", "model"), mesh2d.shape["data"]

    def body(b):
        stats = jh.collective.distributed_stats({"v": b}, axes)
        return (
            jh.collective.reduce_mean({"v": b}, axes)["v"],
            jh.collective.reduce_sum({"v": b}, axes)["v"],
            jh.collective.reduce_std({"v": b}, axes)["v"],
            stats.table,
            jh.collective.histogram(b, axes, 4, (0.0, 8.0)),
        )

    fn = jax.shard_map(body, mesh=mesh2d, in_specs=P("model"), out_specs=P())
    mean, total, std, table, hist = jax.jit(fn)(x)
    assert float(mean) == 3.5 and float(total) == copies * 28.0
    np.testing.assert_allclose(std, v.std(), rtol=1e-6)
    want = [v.mean(), v.max(), v.min(), v.std()]
    np.testing.assert_allclose(table[:, 0], want, rtol=1e-6)
    np.testing.assert_array_equal(hist, copies * np.histogram(v, 4, (0, 8))[0])


def test_every_collective_form_takes_a_value_varying_over_some_reduced_axes(mesh2d):
    """Finding (JAX 0.12, what pip installs on Python 3.12 and later): a max or
    min over ("data", "model") of a block that varies over "model" only raised
    "jax.lax.pmax can only accept axis_name which corresponds to one of
    varying, ... Got ... input state: {'invarying', 'varying'}"; JAX 0.10
    accepted it. Each form now types the block as varying over every reduced
    axis first (no data moves)."""
    v = np.array([3.0, -1.0, 7.0, 2.0, 0.5, 9.0, -4.0, 1.0], np.float32)
    x = jax.device_put(v, NamedSharding(mesh2d, P("model")))
    axes = ("data", "model")

    def body(b):
        return (
            jh.collective.reduce_max({"v": b}, axes)["v"],
            jh.collective.reduce_min({"v": b}, axes)["v"],
            jh.collective.watch({"v": b}, axes, stats=("norm", "max_abs")),
            jh.collective.reduce_custom({"v": b}, "max", axes)["v"],
            jh.collective.reduce_custom(
                {"v": b}, lambda t, ax: lax.pmax(jnp.max(t), ax), axes
            )["v"],
        )

    fn = jax.shard_map(body, mesh=mesh2d, in_specs=P("model"), out_specs=P())
    big, small, watched, named, custom = jax.jit(fn)(x)
    assert float(big) == float(named) == float(custom) == 9.0 and float(small) == -4.0
    np.testing.assert_allclose(watched["v/norm"], np.linalg.norm(v), rtol=1e-6)
    assert float(watched["v/max_abs"]) == 9.0


def test_std_collective_is_two_pass_stable(mesh):
    x = np.array([1e4 - 1, 1e4 + 1] * 4, np.float32)
    out = run(
        mesh, lambda v: jh.collective.reduce_std({"x": v}, "data"), sharded(mesh, x)
    )
    np.testing.assert_allclose(out["x"], 1.0, atol=1e-3)


def test_custom_collective_with_names_and_a_callable(mesh):
    x = sharded(mesh, jnp.arange(16.0) - 10)

    def absmax(v, axis_name):
        return lax.pmax(jnp.max(jnp.abs(v)), axis_name)

    out = run(
        mesh,
        lambda v: jh.collective.reduce_custom(
            {"train": {"a": v, "b": v}, "c": v},
            {"train": "sum", "train/b": absmax, "c": "min"},
            "data",
        ),
        x,
    )
    assert float(out["train"]["a"]) == float(np.sum(np.arange(16.0) - 10))
    assert float(out["train"]["b"]) == 10.0
    assert float(out["c"]) == -10.0


def test_custom_collective_rejects_a_per_device_result(mesh):
    with pytest.raises(ValueError, match="'x' returned a per-device value"):
        run(
            mesh,
            lambda v: jh.collective.reduce_custom(
                {"x": v}, {"x": lambda v, ax: jnp.max(v)}, "data"
            ),
            sharded(mesh, jnp.arange(8.0)),
        )


def test_custom_collective_checks_names_and_ops(mesh):
    with pytest.raises(ValueError, match="'nope'"):
        run(
            mesh,
            lambda v: jh.collective.reduce_custom({"x": v}, {"nope": "sum"}, "data"),
            sharded(mesh, jnp.arange(8.0)),
        )
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        run(
            mesh,
            lambda v: jh.collective.reduce_custom({"x": v}, {"x": "avg"}, "data"),
            sharded(mesh, jnp.arange(8.0)),
        )


@pytest.mark.parametrize("axis_name", [None, (), 3, ("data", 1)])
def test_axis_name_is_required_and_checked(axis_name):
    with pytest.raises(ValueError, match="axis_name"):
        jh.collective.reduce_mean({"x": 1.0}, axis_name)


@pytest.mark.parametrize(
    "fn",
    [
        jh.collective.reduce_mean,
        jh.collective.reduce_max,
        jh.all_gather,
        jh.collective.distributed_stats,
    ],
)
def test_unbound_axis_name_explains_where_to_call(fn, mesh):
    with pytest.raises(ValueError, match="'model' is not a bound mesh axis"):
        run(mesh, lambda v: fn({"x": v}, "model"), sharded(mesh, jnp.arange(8.0)))
    with pytest.raises(ValueError, match="shard_map"):
        fn({"x": jnp.ones(3)}, "data")


def test_all_gather_stacks_shards_in_order_and_leaves_replicated(mesh):
    x = sharded(mesh, jnp.arange(16.0).reshape(8, 2))
    tokens = sharded(mesh, jnp.arange(8, dtype=jnp.int32) * 10)
    out = run(
        mesh,
        lambda x, t: jh.all_gather({"x": x[0], "t": t[0], "pair": x}, "data"),
        x,
        tokens,
        in_specs=(P("data"), P("data")),
    )
    np.testing.assert_array_equal(out["x"], np.arange(16.0).reshape(8, 2))
    np.testing.assert_array_equal(out["t"], np.arange(8) * 10)
    assert out["t"].dtype == jnp.int32
    assert out["pair"].shape == (8, 1, 2)
    assert out["x"].sharding.is_fully_replicated


def test_all_gather_keeps_nan_in_its_own_slot(mesh):
    x = np.arange(8.0, dtype=np.float32)
    x[3] = np.nan
    out = run(mesh, lambda v: jh.all_gather({"x": v[0]}, "data"), sharded(mesh, x))
    np.testing.assert_array_equal(np.isnan(out["x"]), np.isnan(x))


def test_all_gather_over_two_axes(mesh2d):
    x = jax.device_put(
        jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh2d, P("data", "model"))
    )
    body = jax.shard_map(
        lambda v: jh.all_gather({"x": v[0, 0]}, ("data", "model")),
        mesh=mesh2d,
        in_specs=P("data", "model"),
        out_specs=P(),
    )
    np.testing.assert_array_equal(jax.jit(body)(x)["x"], np.arange(8.0))


def test_collect_from_devices_splits_the_leading_axis(mesh):
    x = sharded(mesh, jnp.arange(8.0))
    gathered = run(mesh, lambda v: jh.all_gather({"loss": v[0]}, "data"), x)
    per_device = jh.collect_from_devices({"loss": gathered["loss"], "raw": x})
    assert len(per_device["loss"]) == 8
    assert [float(v) for v in per_device["loss"]] == list(range(8))
    assert isinstance(per_device["raw"][0], np.floating)


def test_collect_from_devices_keeps_bfloat16():
    out = jh.collect_from_devices({"x": jnp.arange(4, dtype=jnp.bfloat16)})
    assert [float(v) for v in out["x"]] == [0.0, 1.0, 2.0, 3.0]


def test_collect_from_devices_rejects_bad_input():
    with pytest.raises(ValueError, match="'a' is a scalar"):
        jh.collect_from_devices({"a": 1.0})
    with pytest.raises(ValueError, match="disagree"):
        jh.collect_from_devices({"a": np.zeros(8), "b": np.zeros(4)})
    with pytest.raises(TypeError, match="'name'"):
        jh.collect_from_devices({"name": np.array(["a", "b"])})


def test_trees_deeper_than_the_limit_are_refused(mesh):
    """In shard_map and on the host: a ValueError naming the limit."""

    def nested(depth, leaf):
        for _ in range(depth):
            leaf = {"a": leaf}
        return leaf

    x = sharded(mesh, jnp.arange(8.0))
    for reducer in (
        jh.collective.reduce_mean,
        jh.collective.reduce_std,
        lambda t, axis: jh.collective.reduce_custom(t, "max", axis),
        jh.all_gather,
        jh.collective.distributed_stats,
    ):
        with pytest.raises(ValueError, match=r"more than 100 levels deep"):
            run(mesh, lambda v, r=reducer: r(nested(2000, v[0]), "data"), x)
    with pytest.raises(ValueError, match=r"mask nest more than 100 levels"):
        run(
            mesh,
            lambda v: jh.collective.reduce_mean(
                {"x": v[0]}, "data", mask=nested(101, True)
            ),
            x,
        )
    with pytest.raises(ValueError, match=r"metrics nest more than 100 levels"):
        jh.collect_from_devices(nested(2000, np.arange(8.0)))
    out = run(mesh, lambda v: jh.collective.reduce_mean(nested(100, v[0]), "data"), x)
    assert float(jax.tree.leaves(out)[0]) == 3.5
    assert float(jnp.ones(2).sum()) == 2.0  # JAX still works


def test_fused_by_dtype_is_one_collective_per_dtype_and_splits_back():
    from jaxhistory._collective import fused_by_dtype

    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))

    def body(v):
        arrays = [v[0], (v[0] * 2).astype(jnp.int32), v[0] + 1, jnp.full((2, 3), v[0])]
        summed = fused_by_dtype(lambda s: lax.psum(s, "data"), arrays, flatten=True)
        stacked = fused_by_dtype(lambda s: lax.pmax(s, "data"), arrays[:3])
        return summed, stacked

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
    (a, b, c, d), (e, g, h) = f(x)
    assert (float(a), int(b), float(c)) == (28.0, 56, 36.0)
    assert d.shape == (2, 3) and np.all(np.asarray(d) == 28.0)
    assert (float(e), int(g), float(h)) == (7.0, 14, 8.0)
    counts = jh.collective_counts(f, x)
    assert counts.get("all-reduce", 0) == 4  # psum: float + int; pmax: float + int


def test_fused_by_dtype_keeps_leading_axes_and_groups_by_a_given_key():
    from jaxhistory._collective import fused_by_dtype

    arrays = [jnp.float32(1), jnp.float16(2), jnp.arange(3.0, dtype=jnp.float32)]
    calls = []

    def tile(v):
        calls.append(v.dtype)
        return jnp.stack([v, 10 * v])  # a leading axis of 2, as an all-gather's

    a, b, c = fused_by_dtype(tile, arrays, flatten=True, dtype_of=lambda x: jnp.float32)
    assert calls == [jnp.float32]  # float16 joined float32: one call
    assert a.tolist() == [1.0, 10.0] and b.dtype == jnp.float32
    assert c.shape == (2, 3) and c[1].tolist() == [0.0, 10.0, 20.0]
    assert fused_by_dtype(tile, []) == []


# ----- values that cannot be stored -------------------------------------------------


def test_collective_reducers_refuse_a_none_leaf(mesh):
    from jax.sharding import PartitionSpec as P

    f = jax.shard_map(
        lambda v: jh.collective.reduce_mean({"x": v, "n": {"bad": None}}, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    with pytest.raises(TypeError, match="metric 'n/bad' is None"):
        jax.jit(f)(jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("data"))))
