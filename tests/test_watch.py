"""watch: per-leaf statistics of a pytree inside jit and shard_map, against
float64 NumPy on 8 devices, in at most two all-reduces."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh

SPECS = [P("data"), P(None, "model"), P("data", "model"), P(), P("model")]


def expected(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    finite = x[~np.isnan(x)]
    return {
        "norm": float(np.sqrt(np.sum(x * x))),
        "rms": float(np.sqrt(np.mean(x * x))),
        "max_abs": float(np.abs(finite).max()) if finite.size else 0.0,
        "zero_frac": float(np.mean(x == 0)),
        "nonfinite": float(np.sum(~np.isfinite(x))),
        "mean": float(np.mean(x)),
        "std": float(np.std(x)),
    }


def assert_close(got, want, scale=1.0, rtol=2e-6):
    if math.isnan(want):
        assert math.isnan(got)
    elif math.isinf(want):
        assert got == want
    else:
        assert abs(got - want) <= rtol * max(abs(want), scale), (got, want)


def sharded_tree(mesh2d, n=40, seed=0):
    rng = np.random.default_rng(seed)
    tree = {}
    for i in range(n):
        shape = (8 * (i % 3 + 1), 4 * (i % 4 + 1))
        x = rng.normal(size=shape) * (i + 1) + (3.0 if i % 7 == 0 else 0.0)
        x[rng.random(shape) < 0.1] = 0.0
        sharding = NamedSharding(mesh2d, SPECS[i % len(SPECS)])
        tree[f"block{i}"] = {"kernel": jax.device_put(jnp.float32(x), sharding)}
    return tree


def test_every_statistic_of_every_leaf_matches_float64_numpy(mesh2d):
    tree = sharded_tree(mesh2d)
    out = jax.jit(lambda t: jh.watch(t, stats=jh.WATCH_STATS))(tree)
    everything = []
    for name, leaf in tree.items():
        x = np.asarray(leaf["kernel"], np.float64)
        everything.append(x.ravel())
        for stat, want in expected(x).items():
            scale = x.std() if stat == "mean" else 1e-6
            assert_close(float(out[f"{name}/kernel/{stat}"]), want, scale)
    total = expected(np.concatenate(everything))
    for stat, want in total.items():
        assert_close(float(out[stat]), want, total["std"] if stat == "mean" else 1e-6)
    assert out.rows == jh.WATCH_STATS and out.table.shape == (7, 41)


@pytest.mark.parametrize("k", [1, 10, 120])
def test_any_number_of_sharded_leaves_takes_at_most_two_all_reduces(mesh2d, k):
    tree = sharded_tree(mesh2d, n=k, seed=k)
    counts = jh.collective_counts(jh.watch, tree)
    assert counts.get("all-reduce", 0) <= 2 and sum(counts.values()) <= 2, counts
    shifted = jh.collective_counts(lambda t: jh.watch(t, stats=("mean", "std")), tree)
    assert sum(shifted.values()) <= 2, shifted


def test_replicated_leaves_take_no_collective(mesh):
    tree = {
        f"p{i}": jax.device_put(jnp.ones((4, 3)) * i, NamedSharding(mesh, P()))
        for i in range(20)
    }
    assert jh.collective_counts(jh.watch, tree) == {}
    out = jax.jit(jh.watch)(tree)
    assert float(out["p3/norm"]) == pytest.approx(3 * math.sqrt(12))


@pytest.mark.parametrize("stats", [jh.DEFAULT_WATCH, ("mean", "std")])
@pytest.mark.parametrize("placed", ["replicated", "sharded", "spread"])
def test_the_compiled_watch_does_not_grow_an_operation_per_leaf(mesh2d, placed, stats):
    """The leaves are stacked, reduced and put into columns by a fixed number of
    operations (a slice and a concatenation per leaf made two small kernels
    per leaf: 2,030 for 1,000 leaves; mean and std took each column's centre
    and scale by two slices per leaf, and compiled 1,000 spread leaves in 38 s
    against 7 s now)."""

    def fusions(n: int) -> int:
        tree = {f"p{i}": jnp.ones((16, 8)) * i for i in range(n)}
        if placed == "sharded":  # the specs in turn: 5 shapes of local blocks
            tree = {
                k: jax.device_put(v, NamedSharding(mesh2d, SPECS[i % len(SPECS)]))
                for i, (k, v) in enumerate(tree.items())
            }
        elif placed == "spread":
            tree = jax.device_put(tree, NamedSharding(mesh2d, P()))
        fn = jax.jit(lambda t: jh.watch(t, stats=stats, spread=placed == "spread"))
        text = fn.lower(tree).compile().as_text()
        return text.count(" fusion(") + text.count(" dynamic-slice(")

    small, large = fusions(10), fusions(80)
    assert large - small <= 10, (small, large)


def test_split_layers_gives_one_entry_per_layer_also_when_the_layers_are_sharded(
    mesh2d,
):
    rng = np.random.default_rng(1)
    stack = rng.normal(size=(8, 6, 4)) * np.arange(1, 9)[:, None, None]
    tree = {
        "layers": {
            "kernel": jax.device_put(
                jnp.float32(stack), NamedSharding(mesh2d, P("data"))
            ),
            "bias": jnp.float32(stack[:, 0]),
        },
        "embed": jnp.float32(rng.normal(size=(5, 4))),
    }
    out = jax.jit(lambda t: jh.watch(t, stats=jh.WATCH_STATS, split_layers="layers"))(
        tree
    )
    for i in range(8):
        for stat, want in expected(stack[i]).items():
            scale = stack[i].std() if stat == "mean" else 1e-6
            assert_close(float(out[f"layers/kernel/{i}/{stat}"]), want, scale)
        assert_close(float(out[f"layers/bias/{i}/norm"]), np.linalg.norm(stack[i, 0]))
    assert "embed/norm" in out and "embed/0/norm" not in out  # not split
    assert (
        jh.collective_counts(lambda t: jh.watch(t, split_layers="layers"), tree).get(
            "all-reduce", 0
        )
        <= 2
    )


def test_groups_report_per_block_with_the_layer_index_kept():
    rng = np.random.default_rng(2)
    tree = {
        "layers": {
            str(i): {"attn": {"q": rng.normal(size=(4, 4)), "k": rng.normal(size=4)}}
            for i in range(3)
        },
        "head": rng.normal(size=(4, 2)),
    }
    tree = jax.tree.map(jnp.float32, tree)
    out = jax.jit(lambda t: jh.watch(t, groups="layers/*", prefix="grads"))(tree)
    for i in range(3):
        block = tree["layers"][str(i)]["attn"]
        both = np.concatenate([np.ravel(block["q"]), np.ravel(block["k"])])
        assert_close(float(out[f"grads/layers/{i}/norm"]), np.linalg.norm(both))
    assert "grads/head/norm" in out  # matched by no pattern: an entry of its own
    assert not any(k.startswith("grads/layers/0/attn") for k in out)
    everything = np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    assert_close(float(out["grads/norm"]), np.linalg.norm(everything))


def test_split_groups_need_one_number_of_layers():
    tree = {"a": {"x": jnp.ones((3, 2)), "y": jnp.ones((4, 2))}}
    with pytest.raises(ValueError, match="layers"):
        jh.watch(tree, groups="a", split_layers=True)


def test_nonfinite_values_are_counted_and_left_out_of_max_abs():
    x = jnp.array([1.0, -7.0, jnp.nan, jnp.inf, 0.0])
    out = jax.jit(lambda t: jh.watch(t, stats=jh.WATCH_STATS))({"g": x})
    assert float(out["g/nonfinite"]) == 2 and float(out["nonfinite"]) == 2
    assert float(out["g/max_abs"]) == math.inf  # inf is a value; NaN is not
    assert math.isnan(float(out["g/norm"])) and math.isnan(float(out["g/std"]))
    assert float(out["g/zero_frac"]) == pytest.approx(0.2)
    only_nan = jax.jit(jh.watch)({"g": jnp.full(3, jnp.nan)})
    assert float(only_nan["g/max_abs"]) == 0.0 and float(only_nan["g/nonfinite"]) == 3


@pytest.mark.parametrize("sharded", [True, False])
def test_a_leaf_with_no_values_is_watched_and_adds_nothing_to_the_total(sharded, mesh):
    w = np.arange(64, dtype=np.float32)
    empty = np.zeros((8, 0), np.float32)
    if sharded:
        tree = {
            "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
            "e": jax.device_put(empty, NamedSharding(mesh, P("data"))),
        }
    else:
        tree = {"w": jnp.asarray(w), "e": jnp.asarray(empty)}
    out = jax.jit(lambda t: jh.watch(t, stats=jh.WATCH_STATS))(tree)
    want = expected(w)
    for stat in ("norm", "mean", "std", "max_abs"):
        assert_close(float(out[stat]), want[stat], scale=abs(want[stat]) + 1)
    assert float(out["e/norm"]) == 0.0 and float(out["e/nonfinite"]) == 0.0


def test_the_total_mean_and_std_keep_their_digits_far_from_zero(mesh):
    rng = np.random.default_rng(3)
    a = (1e8 + rng.normal(size=64) * 10).astype(np.float32)
    b = (1e8 + 50 + rng.normal(size=64) * 10).astype(np.float32)
    tree = {
        "a": jax.device_put(a, NamedSharding(mesh, P("data"))),
        "b": jax.device_put(b, NamedSharding(mesh, P("data"))),
    }
    out = jax.jit(lambda t: jh.watch(t, stats=("mean", "std")))(tree)
    both = np.concatenate([a, b]).astype(np.float64)
    assert float(out["std"]) == pytest.approx(both.std(), rel=1e-4)  # was 3% off
    assert float(out["mean"]) == pytest.approx(both.mean(), rel=1e-7)


@pytest.mark.parametrize(
    "values",
    [
        [2e19, 0.0],  # the spread between the leaves squared: past float32
        [3e38, 1.0],  # their shift from the midrange of everything, too
        [3e38, -3e38],
        [2e19, -2e19, 1.0, 3.0],
        [1e30, 1e30],
    ],
    ids=["2e19,0", "3e38,1", "3e38,-3e38", "2e19,-2e19,1,3", "1e30,1e30"],
)
def test_the_total_mean_and_std_of_constant_leaves_far_apart(mesh, values):
    """Finding: the total mean and std were inf for leaves of one value each
    (each leaf's own range 0) lying 1.8e19 or more apart in float32, where
    NumPy's (float64) are finite; the leaves' differences are now taken in
    units of the range of every value."""
    leaves = {
        f"l{i}": jax.device_put(
            jnp.full((8 * (i + 1),), v, jnp.float32), NamedSharding(mesh, P("data"))
        )
        for i, v in enumerate(values)
    }
    both = np.concatenate([np.asarray(x, np.float64) for x in leaves.values()])
    stats = ("mean", "std")
    for out in (
        jax.jit(lambda t: jh.watch(t, stats=stats))(leaves),
        jh.watch(leaves, stats=stats),
    ):
        for stat, want in (("mean", both.mean()), ("std", both.std())):
            got = float(out[stat])
            assert math.isfinite(got), (stat, got)
            # float32 rounding of values of the size of the largest
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6 * np.abs(both).max())
    counts = jh.collective_counts(lambda t: jh.watch(t, stats=stats), leaves)
    assert sum(counts.values()) <= 2, counts


def test_integer_and_bool_leaves_are_watched_as_float32():
    out = jh.watch({"steps": jnp.arange(5), "mask": jnp.array([True, False])})
    assert out.table.dtype == jnp.float32
    assert float(out["steps/norm"]) == pytest.approx(math.sqrt(30))
    assert float(out["mask/zero_frac"]) == 0.5


def test_outside_jit_it_runs_jitted_and_gives_the_same(mesh2d):
    tree = sharded_tree(mesh2d, n=5)
    eager = jh.watch(tree)
    jitted = jax.jit(jh.watch)(tree)
    np.testing.assert_allclose(np.asarray(eager.table), np.asarray(jitted.table))


def test_an_nnx_models_gradients_are_named_by_path_in_nnx_jit(mesh):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return self.head(x)

    model = Model(nnx.Rngs(0))
    x = jnp.ones((8, 4))

    @nnx.jit
    def step(model, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return grads, jh.watch(grads, prefix="grads")

    grads, out = step(model, x)
    assert "grads/layers/0/kernel/norm" in out and "grads/head/bias/norm" in out
    flat = jax.tree.leaves(grads)
    total = math.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in flat))
    assert float(out["grads/norm"]) == pytest.approx(total, rel=1e-6)


def collective_watch(mesh, check_vma, **kw):
    def body(per_device, shared):
        return jh.collective.watch(
            {"per_device": per_device, "shared": shared}, "data", **kw
        )

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("data"), P()),
            out_specs=P(),
            check_vma=check_vma,
        )
    )


def test_the_shard_map_form_counts_a_replicated_leaf_once(mesh):
    rng = np.random.default_rng(3)
    per_device = rng.normal(size=(8, 5)).astype(np.float32)
    shared = rng.normal(size=(3,)).astype(np.float32)
    args = (
        jax.device_put(per_device, NamedSharding(mesh, P("data"))),
        jax.device_put(shared, NamedSharding(mesh, P())),
    )
    fn = collective_watch(mesh, True, stats=jh.WATCH_STATS)
    out = fn(*args)
    for name, x in (("per_device", per_device), ("shared", shared)):
        for stat, want in expected(x).items():
            scale = np.std(x) if stat == "mean" else 1e-6
            assert_close(float(out[f"{name}/{stat}"]), want, scale)
    both = np.concatenate([per_device.ravel(), shared])
    assert_close(float(out["norm"]), np.linalg.norm(both))
    counts = jh.collective_counts(fn, *args)
    assert counts.get("all-reduce", 0) <= 2 and sum(counts.values()) <= 2, counts


def test_the_shard_map_form_without_check_vma_takes_every_block_as_distinct(mesh):
    per_device = np.arange(40, dtype=np.float32).reshape(8, 5)
    shared = np.ones(3, np.float32)
    out = collective_watch(mesh, False)(
        jax.device_put(per_device, NamedSharding(mesh, P("data"))),
        jax.device_put(shared, NamedSharding(mesh, P())),
    )
    assert_close(float(out["per_device/norm"]), np.linalg.norm(per_device))
    assert_close(float(out["shared/norm"]), math.sqrt(3 * 8))  # 8 copies counted


def test_history_records_watch_as_one_packed_row_and_summarizes_the_total():
    h = jh.History(distributed_history=False)
    grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}
    line = h.update({"loss": 0.5, "grads": jh.watch(grads)}, step=1)
    assert "grads/norm=5.000000" in line and "grads/w/norm" not in line
    assert "grads/nonfinite=0 " in line + " "
    assert h.state.values("grads/w/norm").tolist() == [5.0]
    assert h.state.values("grads/b/zero_frac").tolist() == [1.0]
    assert h.state.values("grads/nonfinite").tolist() == [0.0]


def test_a_watch_result_is_a_pytree_that_keeps_its_rows():
    out = jh.watch({"x": jnp.ones(3)}, stats=("norm", "max_abs"))
    leaves, treedef = jax.tree.flatten(out)
    back = jax.tree.unflatten(treedef, leaves)
    assert back.rows == ("norm", "max_abs") and dict(back) == dict(out)
    assert set(out) == {"x/norm", "x/max_abs", "norm", "max_abs"}


@pytest.mark.parametrize(
    ("tree", "kw", "error", "match"),
    [
        ({}, {}, ValueError, "no leaves"),
        ({"a": None}, {}, TypeError, "'a' is None"),
        ({"a": "text"}, {}, TypeError, "'a'"),
        ({"a": object()}, {}, TypeError, "'a'"),
        ({"a": jnp.ones(2)}, {"stats": ("norm", "median")}, ValueError, "median"),
        ({"a": jnp.ones(2)}, {"stats": ()}, ValueError, "empty"),
        ({"a": jnp.ones(2)}, {"stats": 3}, TypeError, "stats"),
        ({"a": jnp.ones(2)}, {"groups": "layers/*"}, ValueError, "match no leaf"),
        ({"a": jnp.ones(2)}, {"groups": [1]}, TypeError, "glob"),
        ({"a": jnp.ones(2)}, {"prefix": 3}, TypeError, "prefix"),
        ({"a": jnp.ones(2)}, {"split_layers": 3}, TypeError, "split_layers"),
        ({"a": jnp.ones(2)}, {"groups": 3}, TypeError, "groups"),
        ({"a": jnp.ones(2)}, {"split_layers": "b"}, ValueError, "split_layers"),
        (
            {"a": {"b": jnp.ones(2)}},
            {"groups": ["a", "a/b"]},
            ValueError,
            r"'a/b'\] match only leaves an earlier pattern took",
        ),
    ],
)
def test_bad_input_is_refused_naming_it(tree, kw, error, match):
    with pytest.raises(error, match=match):
        jh.watch(tree, **kw)


def test_the_shard_map_form_needs_a_bound_axis():
    with pytest.raises(ValueError, match="axis_name"):
        jh.collective.watch({"a": jnp.ones(2)}, None)
    with pytest.raises(ValueError, match="not a bound mesh axis"):
        jh.collective.watch({"a": jnp.ones(2)}, "data")


@pytest.mark.parametrize("stat", jh.WATCH_STATS)
def test_each_statistic_alone_matches_numpy_in_its_collectives(mesh2d, stat):
    """Only what a statistic needs is computed: one all-reduce for a sum or a
    max alone, two for mean and std (the midrange first)."""
    tree = sharded_tree(mesh2d, n=10, seed=5)
    fn = jax.jit(lambda t: jh.watch(t, stats=(stat,)))
    out = fn(tree)
    assert set(out) == {f"{n}/kernel/{stat}" for n in tree} | {stat}
    for name, leaf in tree.items():
        x = np.asarray(leaf["kernel"], np.float64)
        scale = x.std() if stat == "mean" else 1e-6
        assert_close(float(out[f"{name}/kernel/{stat}"]), expected(x)[stat], scale)
    counts = jh.collective_counts(lambda t: jh.watch(t, stats=(stat,)), tree)
    assert sum(counts.values()) == (2 if stat in ("mean", "std") else 1), counts


def test_a_watch_of_leaves_without_values_alone_is_constant(mesh):
    """Only empty leaves, sharded: nothing to reduce (a shard_map without
    inputs had no devices to run on)."""
    e = jax.device_put(np.zeros((8, 0), np.float32), NamedSharding(mesh, P("data")))
    out = jax.jit(lambda t: jh.watch(t, stats=jh.WATCH_STATS))({"e": e, "f": e})
    assert float(out["norm"]) == 0.0 and float(out["e/max_abs"]) == 0.0
    assert float(out["nonfinite"]) == 0.0 and math.isnan(float(out["f/mean"]))
    layered = jax.jit(lambda t: jh.watch(t, split_layers=True))({"e": e})
    assert [k for k in layered if k.endswith("/norm")] == [
        f"e/{i}/norm" for i in range(8)
    ]


@pytest.mark.parametrize("sharded", [True, False])
def test_no_operation_reads_a_leaf_without_values(sharded, mesh):
    """An XLA compiler (JAX 0.11.2's, on CPU) crashed on the reductions of an
    empty leaf; none is emitted: the empty leaf is only a parameter."""
    w, empty = np.arange(64, dtype=np.float32), np.zeros((8, 0), np.float32)
    if sharded:
        spread = NamedSharding(mesh, P("data"))
        tree = {"w": jax.device_put(w, spread), "e": jax.device_put(empty, spread)}
    else:
        tree = {"w": jnp.asarray(w), "e": jnp.asarray(empty)}
    text = jax.jit(lambda t: jh.watch(t, stats=jh.WATCH_STATS)).lower(tree).as_text()
    body = [line for line in text.splitlines() if "func.func" not in line]
    assert not [line for line in body if re.search(r"tensor<(\d+x)*0x", line)]


def test_a_bare_array_is_its_own_total_and_history_records_it():
    """A tree that is one array has one entry, the total: its leaf's name is
    empty, and a column of it beside the total gave two entries of one name
    (History refused the packed row)."""
    x = jnp.arange(4.0)
    out = jh.watch(x, stats=("norm",))
    assert out.names == ("",) and float(out["norm"]) == pytest.approx(math.sqrt(14))
    h = jh.History(distributed_history=False)
    h.update({"g": out}, step=0)
    assert h.state.values("g/norm").tolist() == pytest.approx([math.sqrt(14)])
    layers = jh.watch(jnp.ones((3, 2)), stats=("norm",), split_layers=True)
    assert set(layers) == {"0/norm", "1/norm", "2/norm", "norm"}
    with pytest.raises(ValueError, match="empty name"):
        jh.watch({"": x, "b": x})


def test_a_stack_of_no_layers_has_no_entries():
    """split_layers on a leaf whose leading axis is 0 long gave it one column
    in the counts and none in the names: a broadcasting TypeError."""
    tree = {"a": jnp.zeros((0, 3)), "b": jnp.arange(3.0)}
    out = jh.watch(tree, stats=("norm", "mean"), split_layers=True)
    assert set(out) == {f"b/{i}/{s}" for i in range(3) for s in ("norm", "mean")} | {
        "norm",
        "mean",
    }
    assert float(out["norm"]) == pytest.approx(math.sqrt(5))
    assert float(out["mean"]) == pytest.approx(1.0)


def test_a_layer_named_like_another_leaf_is_refused_naming_it():
    """A split leaf's layer 1 and a leaf named 'w/1' were two entries of one
    name: History refused the packed row ('packed metric names must be
    unique'), naming neither."""
    tree = {"w": jnp.ones((2, 3)), "w/1": jnp.float32(5.0)}
    with pytest.raises(ValueError, match="'w/1'"):
        jh.watch(tree, split_layers=True)


def test_an_infinity_in_a_replicated_leaf_is_inf_not_nan(mesh):
    """A leaf replicated over a mesh axis, beside a sharded one, had its sums
    multiplied by 0 on the devices whose copy does not count: there an
    infinite value's square (or shifted value) times 0 was NaN, and the psum
    made its norm, rms and mean NaN, the total's too, where NumPy gives inf.
    The same for a sum of squares that overflows in float32 (documented as
    inf). Both forms: jit on global arrays and shard_map."""
    sharded = jax.device_put(
        np.arange(8, dtype=np.float32), NamedSharding(mesh, P("data"))
    )
    stats = ("norm", "rms", "mean")
    jitted = jax.jit(lambda t: jh.watch(t, stats=stats))
    in_shard_map = jax.jit(
        jax.shard_map(
            lambda t: jh.collective.watch(t, "data", stats=stats),
            mesh=mesh,
            in_specs=({"shared": P(), "sharded": P("data")},),
            out_specs=P(),
        )
    )
    for value in (np.inf, -np.inf, 3e38):
        shared = jax.device_put(
            np.array([value, 1.0], np.float32), NamedSharding(mesh, P())
        )
        tree = {"shared": shared, "sharded": sharded}
        for out in (jitted(tree), in_shard_map(tree)):
            for key in ("shared/norm", "shared/rms", "norm", "rms"):
                assert float(out[key]) == math.inf, (value, key, float(out[key]))
            if math.isinf(value):
                assert float(out["shared/mean"]) == value, (value, out["shared/mean"])
                assert float(out["mean"]) == value, (value, out["mean"])


def replicated_with_copies_that_differ(mesh, tree):
    """Each leaf 'replicated' over the mesh, its copy on device d holding
    (d + 1) times the values: a watch's result tells which copy it read."""
    devices = list(mesh.devices.flat)
    sharding = NamedSharding(mesh, P())
    out = {}
    for name, x in tree.items():
        copies = [
            jax.device_put(jnp.asarray(x) * (d + 1), device)
            for d, device in enumerate(devices)
        ]
        out[name] = jax.make_array_from_single_device_arrays(x.shape, sharding, copies)
    return out


def test_a_large_replicated_tree_is_spread_over_the_devices_in_one_all_reduce(mesh):
    """Each device computed every replicated leaf's statistics (8 times the
    work on 8 simulated devices, 0.87 of the bare step in bench_watch); each
    leaf is now read on one device and the tables are summed in one
    all-reduce."""
    ones = {f"p{i:02d}": np.ones((16, 4), np.float32) for i in range(40)}
    tree = replicated_with_copies_that_differ(mesh, ones)
    out = jax.jit(lambda t: jh.watch(t, spread=True))(tree)
    read = [round(float(out[f"{name}/max_abs"])) for name in ones]  # copy d + 1
    assert sorted(set(read)) == list(range(1, 9)), read  # every device works
    assert max(read.count(d) for d in set(read)) <= 5  # evenly: 40 leaves on 8
    for name, d in zip(ones, read, strict=True):  # each leaf from one copy
        assert float(out[f"{name}/norm"]) == pytest.approx(d * 8.0)
    counts = jh.collective_counts(lambda t: jh.watch(t, spread=True), tree)
    assert counts == {"all-reduce": 1}, counts
    # by default only where the replicated leaves hold 2**20 values or more
    assert jh.collective_counts(jh.watch, tree) == {}
    large = {"a": jax.device_put(jnp.ones((1024, 1024)), NamedSharding(mesh, P()))}
    assert jh.collective_counts(jh.watch, large) == {"all-reduce": 1}
    assert jh.collective_counts(lambda t: jh.watch(t, spread=False), large) == {}


def replicated_tree(mesh, seed=3):
    """Leaves of every kind the plan handles, replicated over ``mesh``: a
    group, stacked layers, NaN and infinities, an empty leaf, ints, bools,
    bfloat16, values far from zero."""
    rng = np.random.default_rng(seed)
    stack = rng.normal(size=(6, 5, 4)) * np.arange(1, 7)[:, None, None]
    bad = rng.normal(size=(7, 3))
    bad[0, 0], bad[2, 1], bad[4, 2] = np.nan, np.inf, -np.inf
    tree = {
        "layers": {"kernel": stack, "bias": stack[:, 0]},
        "blocks": {
            f"b{i}": {"w": rng.normal(size=(4, i + 1)) * 10**i} for i in range(5)
        },
        "bad": bad,
        "far": 1e4 + rng.normal(size=(9,)),
        "empty": np.zeros((3, 0)),
        "ints": np.arange(-6, 6).reshape(3, 4),
        "flags": rng.random(10) < 0.5,
        "half": rng.normal(size=(8, 2)),
    }
    dtypes = {"ints": jnp.int32, "flags": jnp.bool_, "half": jnp.bfloat16}
    sharding = NamedSharding(mesh, P())
    return {
        k: jax.device_put(
            jax.tree.map(lambda v, k=k: jnp.asarray(v, dtypes.get(k, jnp.float32)), v),
            sharding,
        )
        for k, v in tree.items()
    }


@pytest.mark.parametrize("mesh_of", ["mesh", "mesh2d"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"split_layers": "layers", "groups": "blocks/*", "prefix": "g"},
        {"groups": ["blocks", "layers"]},
        {"split_layers": True},
    ],
)
def test_a_spread_watch_gives_what_every_device_reading_every_leaf_gives(
    request, mesh_of, kw
):
    tree = replicated_tree(request.getfixturevalue(mesh_of))
    stats = jh.WATCH_STATS
    spread = jax.jit(lambda t: jh.watch(t, stats=stats, spread=True, **kw))(tree)
    plain = jax.jit(lambda t: jh.watch(t, stats=stats, spread=False, **kw))(tree)
    assert spread.names == plain.names and spread.rows == plain.rows
    # (the same sums, stacked in another order: equal to float32 rounding)
    np.testing.assert_allclose(
        np.asarray(spread.table), np.asarray(plain.table), rtol=3e-7, atol=0
    )
    if not kw:  # and each leaf against NumPy
        x = np.asarray(tree["bad"], np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf in NumPy's std
            want_of = expected(x)
        for stat, want in want_of.items():
            assert_close(float(spread[f"bad/{stat}"]), want)
        far = np.asarray(tree["far"], np.float64)
        assert_close(float(spread["far/std"]), far.std(), rtol=1e-4)


def test_a_spread_watch_of_one_leaf_or_only_empty_leaves(mesh):
    one = {"w": jax.device_put(jnp.arange(12.0), NamedSharding(mesh, P()))}
    out = jax.jit(lambda t: jh.watch(t, spread=True))(one)
    assert float(out["norm"]) == pytest.approx(np.linalg.norm(np.arange(12.0)))
    assert jh.collective_counts(lambda t: jh.watch(t, spread=True), one) == {
        "all-reduce": 1
    }
    e = jax.device_put(np.zeros((8, 0), np.float32), NamedSharding(mesh, P()))
    out = jax.jit(lambda t: jh.watch(t, spread=True, stats=jh.WATCH_STATS))(
        {"e": e, "f": e}
    )
    assert float(out["norm"]) == 0.0 and math.isnan(float(out["e/mean"]))
    # nothing to read: nothing spread, no collective
    assert jh.collective_counts(lambda t: jh.watch(t, spread=True), {"e": e}) == {}


def test_spread_is_a_no_op_without_a_mesh_and_outside_jit(mesh):
    tree = {"a": jnp.arange(6.0), "b": jnp.ones((2, 2))}  # one device
    out = jax.jit(lambda t: jh.watch(t, spread=True))(tree)
    assert float(out["a/norm"]) == pytest.approx(np.linalg.norm(np.arange(6.0)))
    assert jh.collective_counts(lambda t: jh.watch(t, spread=True), tree) == {}
    placed = jax.device_put(tree, NamedSharding(mesh, P()))
    eager = jh.watch(placed, spread=True)  # jitted inside: spread there
    assert float(eager["b/norm"]) == 2.0 and float(eager["a/max_abs"]) == 5.0


def test_spread_and_sharded_leaves_keep_their_all_reduces(mesh2d):
    """A tree with a sharded leaf takes the sharded form whatever ``spread``
    says: its two all-reduces already combine the devices."""
    tree = sharded_tree(mesh2d, n=10, seed=2)
    for spread in (True, False, None):
        counts = jh.collective_counts(lambda t, s=spread: jh.watch(t, spread=s), tree)
        assert sum(counts.values()) <= 2, counts


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_spread_must_be_a_bool_or_none(bad):
    with pytest.raises(TypeError, match="spread"):
        jh.watch({"a": jnp.ones(2)}, spread=bad)
