"""distributed_stats (SPMD and collective), per_shard and collective counting."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory._hlo import count_in_hlo


def per_device(mesh, values):
    return jax.device_put(
        np.asarray(values, np.float32), NamedSharding(mesh, P("data"))
    )


def stats_collective(mesh):
    return jax.shard_map(
        lambda m: jh.collective.distributed_stats(
            jax.tree.map(lambda v: v[0], m), "data"
        ),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=True,
    )


@pytest.mark.parametrize("k", [1, 10, 100])
@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_k_metrics_compile_to_at_most_two_collectives(k, family, mesh):
    rng = np.random.default_rng(k)
    metrics = {f"m{i}": per_device(mesh, rng.normal(size=8)) for i in range(k)}
    fn = jh.distributed_stats if family == "spmd" else stats_collective(mesh)
    counts = jh.collective_counts(fn, metrics)
    assert sum(counts.values()) <= 2, counts
    out = jax.jit(fn)(metrics)
    assert len(out) == 4 * k
    x = np.asarray(metrics["m0"], np.float64)
    np.testing.assert_allclose(out["m0/std"], np.std(x), rtol=1e-5)


def test_naive_per_metric_stats_cost_many_more_collectives(mesh):
    # The reference point the fused form is measured against.
    metrics = {f"m{i}": per_device(mesh, np.arange(8.0) + i) for i in range(10)}

    def naive(m):
        out = {}
        for k, v in m.items():
            mu = jnp.mean(v)
            out[k] = (mu, jnp.max(v), jnp.min(v), jnp.sqrt(jnp.mean((v - mu) ** 2)))
        return out

    assert sum(jh.collective_counts(naive, metrics).values()) > 2


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_std_is_stable_for_values_far_from_zero(family, mesh):
    x = per_device(mesh, [1e4 - 1, 1e4 + 1] * 4)
    fn = jh.distributed_stats if family == "spmd" else stats_collective(mesh)
    out = jax.jit(fn)({"loss": x})
    np.testing.assert_allclose(out["loss/std"], 1.0, atol=1e-3)
    assert float(out["loss/mean"]) == 1e4


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_std_is_accurate_for_skewed_values(family, mesh):
    # One outlier: the shift (midrange) sits far from the mean.
    x = np.array([1e3 + 0.5 * i for i in range(7)] + [5e3], np.float32)
    fn = jh.distributed_stats if family == "spmd" else stats_collective(mesh)
    out = jax.jit(fn)({"x": per_device(mesh, x)})
    np.testing.assert_allclose(out["x/std"], np.std(x.astype(np.float64)), rtol=1e-5)
    np.testing.assert_allclose(out["x/mean"], np.mean(x.astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_nan_makes_every_statistic_nan_and_other_metrics_survive(family, mesh):
    fn = jh.distributed_stats if family == "spmd" else stats_collective(mesh)
    bad = per_device(mesh, [1, 2, np.nan, 4, 5, 6, 7, 8])
    out = jax.jit(fn)({"bad": bad, "good": per_device(mesh, np.arange(8.0))})
    for stat in jh.STATS:
        assert np.isnan(out[f"bad/{stat}"]), stat
    assert float(out["good/max"]) == 7.0


def test_infinities_behave_like_numpy(mesh):
    out = jax.jit(jh.distributed_stats)(
        {"x": per_device(mesh, [1, 2, np.inf, 4, 5, 6, 7, 8])}
    )
    assert float(out["x/max"]) == np.inf
    assert float(out["x/mean"]) == np.inf
    assert float(out["x/min"]) == 1.0
    assert np.isnan(out["x/std"])


@pytest.mark.parametrize(
    "values",
    [
        np.full(8, 3e38),  # one per device, near float32's largest
        np.array([3e38, -3e38] * 4),
        np.array([1e20, -1e20] * 32),  # squares past float32's largest
        np.repeat([3e38] * 7 + [-3e38], 8),  # sums past it
        np.array([1e-30, 3e-30] * 16),  # squares below float32's smallest
    ],
    ids=["equal", "alternating", "1e20", "sums", "tiny"],
)
@pytest.mark.parametrize("family", ["spmd", "collective", "watch"])
def test_values_near_the_float32_limits_give_numpys_statistics(values, family, mesh):
    x = per_device(mesh, values)
    if family == "spmd":
        out = jax.jit(jh.distributed_stats)({"x": x})
        mean, std = float(out["x/mean"]), float(out["x/std"])
    elif family == "watch":
        out = jax.jit(lambda t: jh.watch(t, stats=("mean", "std")))({"x": x})
        mean, std = float(out["x/mean"]), float(out["x/std"])
    else:
        fn = jax.shard_map(
            lambda v: jh.collective.distributed_stats({"x": v}, "data").table[:, 0],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
        mean, std = (float(v) for v in np.asarray(jax.jit(fn)(x))[[0, 3]])
    want = np.asarray(values, np.float32).astype(np.float64)
    scale = np.abs(want).max()
    assert mean == pytest.approx(want.mean(), rel=1e-6, abs=1e-6 * scale)
    assert std == pytest.approx(want.std(), rel=1e-6, abs=1e-6 * scale)


def test_bf16_values_give_float32_statistics(mesh):
    x = jax.device_put(
        jnp.arange(8, dtype=jnp.bfloat16) + 100, NamedSharding(mesh, P("data"))
    )
    out = jax.jit(jh.distributed_stats)({"x": x})
    assert all(v.dtype == jnp.float32 for v in out.values())
    np.testing.assert_allclose(out["x/std"], np.std(np.arange(8.0)), rtol=1e-6)


def test_names_are_slash_joined_paths():
    out = jh.distributed_stats({"train": {"loss": jnp.ones(2)}, "acc": [jnp.ones(2)]})
    assert set(out) == {
        f"{name}/{s}" for name in ("train/loss", "acc/0") for s in jh.STATS
    }


def test_a_bare_array_gives_bare_statistic_names():
    assert set(jh.distributed_stats(jnp.ones(3))) == set(jh.STATS)


def test_scalar_leaf_has_zero_spread():
    out = jh.distributed_stats({"lr": 0.5})
    assert float(out["lr/mean"]) == 0.5 and float(out["lr/std"]) == 0.0


def test_mixed_shapes_are_each_correct(mesh):
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=8), rng.normal(size=(16, 2))
    out = jax.jit(jh.distributed_stats)(
        {
            "a": per_device(mesh, a),
            "b": jax.device_put(b.astype(np.float32), NamedSharding(mesh, P("data"))),
            "c": jnp.int32(4),
        }
    )
    for name, x in (("a", a), ("b", b)):
        np.testing.assert_allclose(out[f"{name}/mean"], x.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[f"{name}/std"], x.std(), rtol=1e-5)
        np.testing.assert_allclose(out[f"{name}/min"], x.min(), rtol=1e-6)
    assert float(out["c/max"]) == 4.0


def test_statistic_names_never_collide():
    out = jh.distributed_stats({"loss": jnp.ones(2), "loss/mean": jnp.zeros(2)})
    assert float(out["loss/mean"]) == 1.0
    assert float(out["loss/mean/mean"]) == 0.0
    with pytest.raises(ValueError, match="both named 'a/b'"):
        jh.distributed_stats({"a/b": 1.0, "a": {"b": 2.0}})


def test_empty_leaf_is_rejected():
    with pytest.raises(ValueError, match="'w' is empty"):
        jh.distributed_stats({"w": jnp.zeros(0)})


def test_non_numeric_leaf_is_rejected():
    with pytest.raises(TypeError, match="'run'"):
        jh.distributed_stats({"run": "name"})


def test_collective_std_is_accurate_with_many_values_per_shard(mesh):
    # 8192 values per shard around 1e3 with a spread of 1e-3 and one outlier: the
    # between-shard term must not amplify the rounding of each shard's mean.
    rng = np.random.default_rng(0)
    x = (1e3 + 1e-3 * rng.standard_normal(65536)).astype(np.float32)
    x[0] = 1001
    body = jax.shard_map(
        lambda v: jh.collective.distributed_stats({"x": v}, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    out = jax.jit(body)(jax.device_put(x, NamedSharding(mesh, P("data"))))
    want = np.std(x.astype(np.float64))
    np.testing.assert_allclose(out["x/std"], want, rtol=1e-3)


class TestStatsOf:
    def test_many_scalars_become_one_array_under_their_names(self):
        step = jax.jit(
            lambda x: jh.Stats.of({"loss": x, "n": 3, "acc": {"top1": x / 2}})
        )
        out = step(jnp.float32(0.5))
        assert len(jax.tree.leaves(out)) == 1  # one buffer to fetch
        assert dict(jax.device_get(out)) == {"acc/top1": 0.25, "loss": 0.5, "n": 3.0}
        assert out.table.dtype == jnp.float32  # the int joins the float32 values

    def test_history_records_them_as_metrics(self):
        packed = jh.Stats.of({"loss": jnp.float32(0.5), "acc": jnp.float32(0.25)})
        h = jh.History(distributed_history=False)
        line = h.update({"train": packed, "lr": 0.1})
        assert line == "step=0 train/acc=0.250000 train/loss=0.500000 lr=0.100000"
        h.update(packed)
        assert set(h.state.keys) == {"lr", "train/acc", "train/loss", "acc", "loss"}
        assert h.state.values("train/loss").tolist() == [0.5]
        assert h.state.steps("acc").tolist() == [1]

    def test_history_records_a_stats_passed_alone_as_one_packed_row(self):
        """History.update(stats) takes the packed path, as HistoryState.update
        does: no value is sliced out of the table on the device."""
        step = jax.jit(lambda x: jh.Stats.of({"a": x, "b": x * 2}))
        h = jh.History(distributed_history=False)
        h.update(step(jnp.float32(1.0)), summarize=False)  # first: checked
        with mock.patch.object(
            jh.Stats, "__getitem__", side_effect=AssertionError("sliced")
        ):
            for _ in range(3):
                h.update(step(jnp.float32(1.0)), summarize=False)
        assert h.state.values("b").tolist() == [2.0] * 4

    def test_bad_input_is_named(self):
        with pytest.raises(ValueError, match="at least one metric"):
            jh.Stats.of({})
        with pytest.raises(ValueError, match="'x' has shape \\(2,\\)"):
            jh.Stats.of({"x": jnp.ones(2)})
        with pytest.raises(ValueError, match="dict of named scalars"):
            jh.Stats.of(1.0)
        with pytest.raises(TypeError, match="'x' is a str"):
            jh.Stats.of({"x": "a"})
        with pytest.raises(TypeError, match="'x' is None"):
            jh.Stats.of({"x": None})


class TestPerShard:
    def test_reads_the_shard_count_from_an_explicit_sharding(self, mesh):
        x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            out = jax.jit(jh.per_shard)(x)
        np.testing.assert_allclose(out, np.arange(64.0).reshape(8, 8).mean(axis=1))
        assert out.sharding.spec == P("data")

    def test_moves_no_data_between_devices(self, mesh):
        x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            assert jh.collective_counts(jh.per_shard, x) == {}

    def test_concrete_array_outside_jit(self, mesh):
        x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
        np.testing.assert_allclose(
            jh.per_shard(x, reduce="sum"), np.arange(16.0).reshape(8, 2).sum(1)
        )

    def test_concrete_array_on_an_auto_mesh(self):
        auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.device_put(jnp.arange(16.0), NamedSharding(auto, P("data")))
        np.testing.assert_allclose(
            jh.per_shard(x), np.arange(16.0).reshape(8, 2).mean(1)
        )

    def test_num_shards_may_be_any_integer_but_not_a_bool(self):
        out = jh.per_shard(jnp.arange(4.0), num_shards=np.int64(2))
        np.testing.assert_allclose(out, [0.5, 2.5])
        with pytest.raises(ValueError, match="positive int"):
            jh.per_shard(jnp.arange(4.0), num_shards=True)

    def test_feature_axes_are_reduced_too(self, mesh):
        x = jax.device_put(
            jnp.arange(48.0).reshape(16, 3), NamedSharding(mesh, P("data", None))
        )
        out = jh.per_shard(x, reduce="max")
        np.testing.assert_allclose(out, np.arange(48.0).reshape(8, 6).max(1))

    def test_auto_mesh_inside_jit_needs_num_shards(self):
        auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.device_put(jnp.arange(32.0), NamedSharding(auto, P("data")))
        with pytest.raises(ValueError, match="pass num_shards"):
            jax.jit(jh.per_shard)(x)
        out = jax.jit(lambda v: jh.per_shard(v, num_shards=8))(x)
        np.testing.assert_allclose(out, np.arange(32.0).reshape(8, 4).mean(1))

    @pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
    def test_keeps_the_batch_axis_on_a_mesh_of_one_device(self, axis_type):
        kind = getattr(jax.sharding.AxisType, axis_type)
        one = jax.make_mesh((1,), ("data",), (kind,), devices=jax.devices()[:1])
        x = jax.device_put(
            jnp.arange(12.0).reshape(6, 2), NamedSharding(one, P("data", None))
        )
        eager = jh.per_shard(x, reduce="max")
        np.testing.assert_allclose(eager, [11.0])
        assert eager.sharding.spec == P("data")  # per device, as on 8 devices
        with jax.set_mesh(one):
            jitted = jax.jit(lambda v: jh.per_shard(v, num_shards=1))(x)
        np.testing.assert_allclose(jitted, [5.5])
        # Under jit an Auto mesh's axes are not in the types: the result has
        # none (a documented limit); Explicit axes keep it.
        assert jitted.sharding.spec == (P("data") if axis_type == "Explicit" else P())
        # Not sharded over a mesh axis: nothing to keep.
        plain = jh.per_shard(jnp.arange(4.0), num_shards=1)
        assert not isinstance(plain.sharding, NamedSharding) or all(
            a is None for a in plain.sharding.spec
        )

    def test_feeds_distributed_stats(self, mesh):
        x = jax.device_put(jnp.arange(32.0), NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            out = jax.jit(lambda v: jh.distributed_stats({"loss": jh.per_shard(v)}))(x)
        means = np.arange(32.0).reshape(8, 4).mean(1)
        np.testing.assert_allclose(out["loss/std"], means.std(), rtol=1e-6)

    def test_bad_input(self, mesh):
        x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
        with pytest.raises(ValueError, match="sharded 8 ways"):
            jh.per_shard(x, num_shards=4)
        with pytest.raises(ValueError, match="does not split into 3"):
            jh.per_shard(jnp.arange(10.0), num_shards=3)
        with pytest.raises(ValueError, match="unknown reduce 'median'"):
            jh.per_shard(x, reduce="median")
        with pytest.raises(ValueError, match="scalar"):
            jh.per_shard(jnp.float32(1.0), num_shards=1)
        with pytest.raises(ValueError, match="positive int"):
            jh.per_shard(jnp.arange(4.0), num_shards=0)
        with pytest.raises(TypeError, match="not a pytree"):
            jh.per_shard({"a": jnp.arange(4.0)}, num_shards=2)
        with pytest.raises(ValueError, match="pass num_shards"):
            jh.per_shard(np.arange(4.0))


def test_collective_counts_reads_tuple_and_async_collectives():
    text = "\n".join(
        [
            "  %all-reduce.40 = (f32[], f32[]) all-reduce(%a, %b), channel_id=1",
            "  %ag = f32[8] all-gather-start(%x), dimensions={0}",
            "  %agd = f32[8] all-gather-done(%ag)",
            "  %cp = f32[8] collective-permute(%x), source_target_pairs={{0,1}}",
            "  %add = f32[] add(%all-reduce.40, %c)",
        ]
    )
    assert count_in_hlo(text) == {
        "all-reduce": 1,
        "all-gather": 1,
        "collective-permute": 1,
    }


def test_collective_counts_of_a_plain_function_is_empty():
    assert jh.collective_counts(lambda x: x + 1, jnp.ones(3)) == {}


class TestStatsMapping:
    def test_reads_like_a_flat_dict_in_metric_order(self, mesh):
        out = jax.jit(jh.distributed_stats)(
            {"b": per_device(mesh, np.arange(8.0)), "a": jnp.float32(2.0)}
        )
        assert isinstance(out, jh.Stats)
        # dict keys flatten sorted, so "a" comes first; stats in STATS order
        assert list(out) == [f"{n}/{s}" for n in ("a", "b") for s in jh.STATS]
        assert out.names == ("a", "b")
        assert float(out["b/max"]) == 7.0 and "a/std" in out
        assert dict(out).keys() == set(out)
        with pytest.raises(KeyError):
            out["c/mean"]

    def test_is_one_leaf_and_one_transfer(self, mesh):
        metrics = {f"m{i}": per_device(mesh, np.arange(8.0) + i) for i in range(10)}
        out = jax.jit(jh.distributed_stats)(metrics)
        assert len(jax.tree.leaves(out)) == 1
        assert out.table.shape == (4, 10)
        host = jax.device_get(out)
        assert isinstance(host.table, np.ndarray)
        assert host["m9/min"] == 9.0
        assert "'m0/mean': 3.5" in repr(host)

    def test_columns_follow_the_leaves_across_shape_groups(self, mesh):
        metrics = {
            "a": per_device(mesh, np.arange(8.0)),
            "b": jnp.float32(5.0),
            "c": per_device(mesh, np.arange(8.0) * 2),
        }
        out = jax.jit(jh.distributed_stats)(metrics)
        assert out.names == ("a", "b", "c")
        np.testing.assert_allclose(out.table[1], [7.0, 5.0, 14.0])

    def test_traced_inside_jit(self):
        out = jax.jit(lambda m: jh.distributed_stats(m)["x/mean"] * 2)(
            {"x": jnp.ones(4)}
        )
        assert float(out) == 2.0

    def test_empty(self):
        out = jh.distributed_stats({})
        assert len(out) == 0 and out.table.shape == (4, 0)


def test_collective_mixed_shapes_keep_their_columns(mesh):
    x = np.arange(16.0, dtype=np.float32) ** 1.5
    body = jax.shard_map(
        lambda v: jh.collective.distributed_stats(
            {"a": v[0], "b": v, "c": 2 * v[1], "t": jnp.int32(3)}, "data"
        ),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    out = jax.jit(body)(jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert out.names == ("a", "b", "c", "t")
    pairs = x.reshape(8, 2).astype(np.float64)
    for name, ref in (("a", pairs[:, 0]), ("b", pairs), ("c", 2 * pairs[:, 1])):
        for stat in jh.STATS:
            want = getattr(np, stat)(ref)
            np.testing.assert_allclose(out[f"{name}/{stat}"], want, rtol=1e-5)
    assert float(out["t/std"]) == 0.0 and float(out["t/mean"]) == 3.0


def test_a_tree_deeper_than_the_limit_is_refused(mesh):
    tree = per_device(mesh, np.arange(8.0))
    for _ in range(2000):
        tree = {"a": tree}
    for provenance in (False, True):
        with pytest.raises(ValueError, match=r"more than 100 levels deep"):
            jh.distributed_stats(tree, provenance=provenance)
    assert float(jnp.ones(2).sum()) == 2.0  # JAX still works


# ----- quantiles across devices ------------------------------------------------------

QS = (0.1, 0.5, 0.9, 0.99)


def rank_error(values: np.ndarray, got: float, q: float) -> float:
    ordered = np.sort(values.astype(np.float64).ravel())
    lo = np.searchsorted(ordered, got, side="left") / len(ordered)
    hi = np.searchsorted(ordered, got, side="right") / len(ordered)
    return 0.0 if lo <= q <= hi else min(abs(lo - q), abs(hi - q))


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_quantiles_of_one_value_per_device_are_exact_at_no_extra_collective(
    family, mesh
):
    values = np.random.default_rng(1).normal(size=8).astype(np.float32)
    metrics = {"loss": per_device(mesh, values)}
    if family == "spmd":
        fn = functools.partial(jh.distributed_stats, quantiles=QS)
        plain = jh.distributed_stats
    else:
        fn = jax.shard_map(
            lambda m: jh.collective.distributed_stats(
                jax.tree.map(lambda v: v[0], m), "data", quantiles=QS
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
        plain = stats_collective(mesh)
    out = jax.jit(fn)(metrics)
    want = np.quantile(values.astype(np.float64), QS)  # NumPy's linear rule
    for q, w in zip(QS, want, strict=True):
        assert float(out[f"loss/p{100 * q:g}"]) == pytest.approx(w, rel=1e-6)
    assert out.rows == (*jh.STATS, "p10", "p50", "p90", "p99")
    assert jh.collective_counts(fn, metrics) == jh.collective_counts(plain, metrics)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "dist",
    [
        "normal",
        "lognormal",
        "uniform",
        "exponential",
        "heavy",
        "offset",
        "relu",
        "decades",
        "tiny",
    ],
)
def test_quantiles_of_large_arrays_are_within_a_percent_of_rank(dist, dtype, mesh2d):
    rng = np.random.default_rng(7)
    if dist == "heavy":  # Student-t, 2 degrees of freedom: huge values both ways
        values = rng.standard_t(2, size=(4, 20_000)).astype(np.float32)
    elif dist == "offset":  # a narrow spread far from zero
        values = (1000 + rng.normal(size=(4, 20_000))).astype(np.float32)
    elif dist == "relu":  # half exact zeros, the rest spanning decades
        values = np.maximum(rng.normal(size=(4, 20_000)), 0) * rng.lognormal(
            0, 3, size=(4, 20_000)
        )
        values = values.astype(np.float32)
    elif dist == "decades":  # both signs, magnitudes from 1e-10 to 1e10
        mag = 10.0 ** rng.uniform(-10, 10, size=(4, 20_000))
        values = (mag * rng.choice([-1, 1], size=mag.shape)).astype(np.float32)
    elif dist == "tiny":  # a normal spread and one value near float32's smallest
        values = rng.normal(size=(4, 20_000)).astype(np.float32)
        values[0, 0] = 2e-38
    else:
        values = getattr(rng, dist)(size=(4, 20_000)).astype(np.float32)
    x = jax.device_put(
        jnp.asarray(values, dtype), NamedSharding(mesh2d, P(None, "data"))
    )
    fn = functools.partial(jh.distributed_stats, quantiles=QS)
    out = jax.jit(fn)({"a": x})
    exact = np.asarray(x.astype(jnp.float32))
    for q in QS:
        assert rank_error(exact, float(out[f"a/p{100 * q:g}"]), q) <= 0.01
    counts = jh.collective_counts(fn, {"a": x})
    assert sum(counts.values()) <= 2, counts  # replicated over "model": counted once
    assert float(out["a/mean"]) == pytest.approx(exact.mean(), rel=1e-3, abs=1e-3)


def test_quantiles_in_shard_map_with_check_vma(mesh):
    values = np.random.default_rng(3).lognormal(size=(8, 5000)).astype(np.float32)
    fn = jax.jit(
        jax.shard_map(
            lambda v: jh.collective.distributed_stats(
                {"a": v[0]}, "data", quantiles=QS
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
            check_vma=True,
        )
    )
    x = jax.device_put(values, NamedSharding(mesh, P("data")))
    out = fn(x)
    for q in QS:
        assert rank_error(values, float(out[f"a/p{100 * q:g}"]), q) <= 0.01
    assert sum(jh.collective_counts(fn, x).values()) <= 2


def test_quantiles_of_replicated_arrays_take_no_collective():
    values = np.linspace(-3, 5, 10_001, dtype=np.float32)
    fn = functools.partial(jh.distributed_stats, quantiles=(0.25, 0.5))
    out = jax.jit(fn)({"w": jnp.asarray(values)})
    assert float(out["w/p50"]) == pytest.approx(1.0, abs=8 / 2048)
    assert float(out["w/p25"]) == pytest.approx(-1.0, abs=8 / 2048)
    assert jh.collective_counts(fn, {"w": jnp.asarray(values)}) == {}


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_infinities_leave_the_quantiles_of_the_finite_values(family, mesh):
    values = np.random.default_rng(4).normal(size=(8, 100)).astype(np.float32)
    values[0, 3], values[5, 7], values[6, 1] = np.inf, -np.inf, np.inf
    qs = (0.001, 0.1, 0.5, 0.9, 0.999)
    x = jax.device_put(values, NamedSharding(mesh, P("data")))
    if family == "spmd":
        out = jax.jit(lambda v: jh.distributed_stats({"a": v}, quantiles=qs))(x)
        got = [float(out[f"a/p{100 * q:g}"]) for q in qs]
    else:
        fn = jax.shard_map(
            lambda v: jh.collective.distributed_stats(
                {"a": v}, "data", quantiles=qs
            ).table[4:, 0],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
        got = list(np.asarray(jax.jit(fn)(x)))
    # ranks among the infinities give them (between an infinity and a finite
    # value: the infinity, as jnp.quantile gives)
    assert got[0] == -np.inf and got[-1] == np.inf
    for q, g in zip(qs[1:-1], got[1:-1], strict=True):
        assert np.isfinite(g) and rank_error(values, g, q) <= 0.01, (q, g)


def test_quantiles_of_integer_leaves_are_not_truncated(mesh):
    labels = np.repeat(np.arange(2, dtype=np.int32), 400)  # half 0, half 1
    ramp = np.arange(800, dtype=np.int32) - 400
    qs = (0.25, 0.5, 0.9)
    x = {
        "labels": jax.device_put(labels, NamedSharding(mesh, P("data"))),
        "ramp": jax.device_put(ramp, NamedSharding(mesh, P("data"))),
    }
    out = jax.jit(lambda m: jh.distributed_stats(m, quantiles=qs))(x)
    assert float(out["labels/p25"]) == 0.0 and float(out["labels/p90"]) > 0.99
    assert float(out["labels/p50"]) == pytest.approx(0.5, abs=1e-2)
    for q in qs:  # NumPy: 199.75 - 400, ...; a truncation is off by up to 1
        want = np.quantile(ramp.astype(np.float64), q)
        assert float(out[f"ramp/p{100 * q:g}"]) == pytest.approx(want, abs=0.5)
        assert float(out[f"ramp/p{100 * q:g}"]) != int(want)


def test_a_leaf_of_infinities_and_an_empty_leaf_get_quantiles_too(mesh):
    ones = np.ones((8, 4), np.float32)
    x = {
        "inf": jax.device_put(ones * np.inf, NamedSharding(mesh, P("data"))),
        "zeros": jax.device_put(ones * 0, NamedSharding(mesh, P("data"))),
    }
    out = jax.jit(lambda m: jh.distributed_stats(m, quantiles=(0.5,)))(x)
    assert float(out["inf/p50"]) == np.inf and float(out["zeros/p50"]) == 0.0


def test_a_quantile_between_minus_and_plus_infinity_is_nan_as_in_jnp(mesh):
    """Half -inf, half +inf: a quantile that interpolates between the two is
    undefined (NaN in jnp.quantile and np.quantile, and in the exact form for
    one value per device); the histogram form gave -inf."""
    values = np.full((8, 100), np.inf, np.float32)
    values[:4] = -np.inf
    qs = (0.25, 0.5, 0.75)
    for x in (
        jax.device_put(values, NamedSharding(mesh, P("data"))),
        jax.device_put(values[:, 0], NamedSharding(mesh, P("data"))),  # exact
    ):
        out = jax.jit(lambda m: jh.distributed_stats(m, quantiles=qs))({"a": x})
        flat = jnp.asarray(np.asarray(x).ravel())
        want = np.asarray(jnp.quantile(flat, jnp.asarray(qs)))
        assert np.isnan(want[1]) and want[0] == -np.inf and want[2] == np.inf
        got = [float(out[f"a/p{100 * q:g}"]) for q in qs]
        np.testing.assert_array_equal(got, want)


def test_a_nan_makes_the_quantiles_nan(mesh):
    values = np.arange(8 * 100, dtype=np.float32)
    values[17] = np.nan
    x = jax.device_put(values, NamedSharding(mesh, P("data")))
    out = jax.jit(lambda m: jh.distributed_stats(m, quantiles=(0.5,)))({"a": x})
    assert np.isnan(float(out["a/p50"])) and np.isnan(float(out["a/mean"]))


@pytest.mark.parametrize(
    ("quantiles", "error", "match"),
    [
        ((0.0,), ValueError, "strictly between 0 and 1"),
        ((1.0,), ValueError, "strictly between 0 and 1"),
        ((1.5,), ValueError, "1.5"),
        ((float("nan"),), ValueError, "nan"),
        ((True,), ValueError, "True"),
        (("0.5",), ValueError, "'0.5'"),
        ((0.5, 0.5), ValueError, "repeat"),
        (None, TypeError, "quantiles"),
    ],
)
def test_bad_quantiles_are_refused_naming_them(quantiles, error, match):
    with pytest.raises(error, match=match):
        jh.distributed_stats({"a": jnp.ones(4)}, quantiles=quantiles)


def test_quantiles_of_large_arrays_with_provenance_are_refused(mesh):
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    fn = functools.partial(
        jh.distributed_stats, provenance=True, quantiles=(0.5,), mesh=mesh
    )
    with pytest.raises(ValueError, match="provenance"):
        jax.jit(fn)({"a": x})
    # one value per device: exact, with provenance
    out = jax.jit(fn)({"a": per_device(mesh, np.arange(8.0))})
    assert float(out["a/p50"]) == 3.5 and int(out["a/argmax"]) == 7


def test_history_records_quantiles_and_plots_them_as_bands(tmp_path, mesh):
    from jaxhistory.export._units import plot_units

    h = jh.History(distributed_history=False)
    fn = jax.jit(lambda m: jh.distributed_stats(m, quantiles=(0.1, 0.5, 0.9)))
    for s in range(5):
        x = per_device(mesh, np.arange(8.0) + s)
        line = h.update({"loss": fn({"l": x})}, step=s)
    assert line == "step=4 loss/l=7.500000(±2.291288)"
    assert h.state.values("loss/l/p50").tolist() == [3.5, 4.5, 5.5, 6.5, 7.5]
    (unit,) = plot_units(h.state)
    assert unit.title == "loss/l" and unit.stats["p90"] == "loss/l/p90"
    h.finalize(tmp_path)
    assert sorted(p.name for p in (tmp_path / "plots" / "mplot").glob("*.png")) == [
        "loss_l.png"
    ]


@pytest.mark.parametrize(
    "quantiles",
    [
        np.float32(0.5),
        np.array([0.5, 0.9], np.float32),
        jnp.array([0.5, 0.9]),
        [np.float32(0.5), np.int64(0) + 0.9],
    ],
)
def test_quantiles_given_as_numpy_or_jax_numbers_are_taken(quantiles):
    """A float32 quantile was refused as 'not a number strictly between 0
    and 1' (only Python floats were numbers)."""
    out = jh.distributed_stats({"a": jnp.arange(11.0)}, quantiles=quantiles)
    assert float(out["a/p50"]) == pytest.approx(5.0, abs=0.01)


def test_a_quantile_given_as_a_string_is_refused_whole():
    with pytest.raises(TypeError, match="'0.5'"):
        jh.distributed_stats({"a": jnp.ones(4)}, quantiles="0.5")


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_quantiles_of_integer_leaves_with_ties_are_exact(family, mesh):
    """Each end of a quantile is one of the values: an integer for an integer
    leaf. Read from the middle of its bin it was off (labels 0-9: p50 4.9985
    where NumPy gives 5, p99 8.9983 for 9: 7% of rank past every tie)."""
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 10, size=(8, 64)).astype(np.int32)
    wide = rng.integers(-50_000, 50_000, size=(8, 64)).astype(np.int32)
    qs = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
    x = {
        name: jax.device_put(v, NamedSharding(mesh, P("data")))
        for name, v in (("labels", labels), ("wide", wide))
    }
    if family == "spmd":
        out = jax.jit(lambda m: jh.distributed_stats(m, quantiles=qs))(x)
    else:
        out = jax.jit(
            jax.shard_map(
                lambda m: jh.collective.distributed_stats(m, "data", quantiles=qs),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )(x)
    want = np.quantile(labels.astype(np.float64), qs)
    got = [float(out[f"labels/p{100 * q:g}"]) for q in qs]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for q in qs:  # bins wider than 1: within a percent of rank still
        assert rank_error(wide, float(out[f"wide/p{100 * q:g}"]), q) <= 0.01
