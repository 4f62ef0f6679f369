"""distributed_stats on both sides of GATHER_DEVICES, and collective_bytes.

Up to ``jaxhistory._stats.GATHER_DEVICES`` holder devices, one value per device
is gathered whole and provenance counts per holder; above it every all-reduce
carries O(K) values. The threshold is moved here (it is read while a call is
traced, so every jitted function below is a fresh closure) so that the
brute-force references run on both sides of it on 8 devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import _stats
from jaxhistory._hlo import bytes_in_hlo, shape_bytes
from jaxhistory._provenance import concrete_layout
from jaxhistory._tree import Leaf

# GATHER_DEVICES for each side: 8 devices are gathered at 8, not at 1
SIDES = {"gather": 8, "O(K)": 1}


@pytest.fixture(params=list(SIDES))
def side(request, monkeypatch):
    """Runs a test on each side of the threshold; yields the side's name."""
    monkeypatch.setattr(_stats, "GATHER_DEVICES", SIDES[request.param])
    return request.param


def put(mesh, values, spec=P("data"), dtype=np.float32):
    return jax.device_put(
        jnp.asarray(np.asarray(values), dtype), NamedSharding(mesh, spec)
    )


def spmd(mesh):
    def fn(metrics):
        return jh.distributed_stats(metrics, provenance=True, mesh=mesh)

    return fn


def collective(mesh, axes="data", spec=P("data"), per_shard=lambda v: v[0], **kw):
    return jax.shard_map(
        lambda m: jh.collective.distributed_stats(
            jax.tree.map(per_shard, m), axes, provenance=True, mesh=mesh, **kw
        ),
        mesh=mesh,
        in_specs=spec,
        out_specs=P(),
        check_vma=True,
    )


def device_of(mesh, spec=P("data"), shape=(8,)):
    """Global device index holding each element (the lowest of its holders)."""
    index = {d.id: i for i, d in enumerate(jax.devices())}
    owner = np.full(shape, 10**6)
    for d, sl in NamedSharding(mesh, spec).devices_indices_map(shape).items():
        owner[sl] = np.minimum(owner[sl], index[d.id])
    return owner


def reference(values, owner):
    """mean, max, min, std (float64 NumPy) and argmax, argmin, nan_device by
    brute force: the lowest device on ties, a NaN's device for all three."""
    v = np.asarray(values, np.float64).reshape(-1)
    o = owner.reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        stats = (v.mean(), v.max(), v.min(), v.std())
    nan = np.isnan(v)
    if nan.any():
        first = int(o[nan].min())
        return stats, (first, first, first)
    return stats, (int(o[v == v.max()].min()), int(o[v == v.min()].min()), -1)


def check(out, name, values, owner):
    stats, where = reference(values, owner)
    got = tuple(float(out[f"{name}/{s}"]) for s in jh.STATS)
    np.testing.assert_allclose(got, stats, rtol=1e-5, atol=1e-6, err_msg=name)
    assert tuple(int(out[f"{name}/{s}"]) for s in jh.PROVENANCE) == where, name


def all_reduces(fn, *args):
    counts = jh.collective_counts(fn, *args)
    assert set(counts) <= {"all-reduce"}, counts
    return counts.get("all-reduce", 0)


def hard_values(per_device: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Metrics with ties across devices, NaN, inf and -inf, on 8 devices."""
    rng = np.random.default_rng(seed)
    n = 8 * per_device
    data = {f"tie{i}": rng.integers(0, 3, size=n).astype(np.float32) for i in range(6)}
    data["tie0"][[n // 8, 5 * n // 8]] = 9.0  # a max on devices 1 and 5: 1 wins
    data["normal"] = rng.normal(1e3, 1.0, size=n).astype(np.float32)
    data["nan"] = np.arange(float(n), dtype=np.float32)
    data["nan"][[n - 1, 3 * per_device]] = np.nan  # devices 7 and 3: 3 is named
    data["inf"] = np.arange(float(n), dtype=np.float32)
    data["inf"][[2 * per_device, 6 * per_device]] = np.inf
    data["inf"][4 * per_device] = -np.inf
    data["all_nan"] = np.full(n, np.nan, np.float32)
    data["same"] = np.full(n, 2.5, np.float32)  # every device ties: device 0
    return data


@pytest.mark.parametrize("per_device", [1, 4])
def test_spmd_matches_brute_force_on_both_sides(per_device, side, mesh):
    data = hard_values(per_device)
    metrics = {k: put(mesh, v) for k, v in data.items()}
    fn = spmd(mesh)
    want = (1 if per_device == 1 else 2) if side == "gather" else 3
    assert all_reduces(fn, metrics) == want
    out = jax.jit(fn)(metrics)
    owner = device_of(mesh, shape=(8 * per_device,))
    for name, values in data.items():
        check(out, name, values, owner)
    assert int(out["tie0/argmax"]) == 1 and int(out["nan/nan_device"]) == 3
    assert (int(out["inf/argmax"]), int(out["inf/argmin"])) == (2, 4)


@pytest.mark.parametrize("per_device", [1, 4])
def test_shard_map_matches_brute_force_on_both_sides(per_device, side, mesh):
    data = hard_values(per_device, seed=1)
    metrics = {k: put(mesh, v) for k, v in data.items()}
    shard = (lambda v: v[0]) if per_device == 1 else (lambda v: v)
    fn = collective(mesh, per_shard=shard)
    want = (1 if per_device == 1 else 2) if side == "gather" else 3
    assert all_reduces(fn, metrics) == want
    out = jax.jit(fn)(metrics)
    owner = device_of(mesh, shape=(8 * per_device,))
    for name, values in data.items():
        check(out, name, values, owner)


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_both_sides_give_the_same_results(family, mesh, monkeypatch):
    rng = np.random.default_rng(2)
    data = {f"m{i}": rng.integers(-2, 3, size=8) * 1.5 + 1e4 for i in range(20)}
    data["m3"][6] = np.nan
    metrics = {k: put(mesh, v) for k, v in data.items()}
    outs = []
    for threshold in SIDES.values():
        monkeypatch.setattr(_stats, "GATHER_DEVICES", threshold)
        fn = spmd(mesh) if family == "spmd" else collective(mesh)
        outs.append(jax.device_get(jax.jit(fn)(metrics)))
    gathered, ranked = outs
    np.testing.assert_array_equal(gathered.where, ranked.where)
    np.testing.assert_allclose(gathered.table, ranked.table, rtol=1e-6)


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_mixed_dtypes_on_both_sides(family, side, mesh):
    rng = np.random.default_rng(3)
    data = {
        "f32": (rng.integers(0, 4, size=8) + 0.25).astype(np.float32),
        "bf16": rng.integers(-3, 3, size=8).astype(np.float32),  # exact in bf16
        "i32": rng.integers(-50, 50, size=8).astype(np.int32),
    }
    data["bf16"][[2, 6]] = 7.0  # tie for the max: device 2
    data["i32"][[1, 4]] = -99  # tie for the min: device 1
    dtypes = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32}
    metrics = {k: put(mesh, v, dtype=dtypes[k]) for k, v in data.items()}
    fn = spmd(mesh) if family == "spmd" else collective(mesh)
    assert all_reduces(fn, metrics) <= (1 if side == "gather" else 3)
    out = jax.jit(fn)(metrics)
    assert out.table.dtype == jnp.float32 and out.where.dtype == jnp.int32
    for name, values in data.items():
        check(out, name, values, device_of(mesh))
    assert int(out["bf16/argmax"]) == 2 and int(out["i32/argmin"]) == 1


def test_two_dimensional_meshes_on_both_sides(side, mesh2d):
    values = np.array([3.0, 1, 7, 7, 0, 0, 2, 5], np.float32)
    # Sharded over "data" only: each block is held by two devices (4 holders).
    metrics = {"x": put(mesh2d, values[:4]), "y": put(mesh2d, values)}
    out = jax.jit(spmd(mesh2d))(metrics)
    check(out, "x", values[:4], device_of(mesh2d, shape=(4,)))
    check(out, "y", values, device_of(mesh2d, shape=(8,)))
    # In shard_map over both axes: one value per device.
    both = ("data", "model")
    fn = collective(mesh2d, both, P(both))
    out = jax.jit(fn)({"x": put(mesh2d, values, P(both))})
    check(out, "x", values, device_of(mesh2d, P(both)))
    # Over "data" only: each model column gets its own answer.
    per_column = jax.jit(
        jax.shard_map(
            lambda m: (
                jh.collective.distributed_stats(
                    {"x": m[0, 0]}, "data", provenance=True, mesh=mesh2d
                ).where
            ),
            mesh=mesh2d,
            in_specs=P("data", "model"),
            out_specs=P(None, "model"),
            check_vma=True,
        )
    )(put(mesh2d, values.reshape(4, 2), P("data", "model")))
    # Column 0 holds 3, 7, 0, 2 on devices 0, 2, 4, 6; column 1: 1, 7, 0, 5.
    assert np.asarray(per_column)[:2].tolist() == [[2, 3], [4, 5]]


def test_the_threshold_is_inclusive(mesh, monkeypatch):
    metrics = {f"m{i}": put(mesh, np.arange(8.0) + i) for i in range(3)}
    monkeypatch.setattr(_stats, "GATHER_DEVICES", 8)
    assert all_reduces(spmd(mesh), metrics) == 1
    assert all_reduces(collective(mesh), metrics) == 1
    monkeypatch.setattr(_stats, "GATHER_DEVICES", 7)
    assert all_reduces(spmd(mesh), metrics) == 3
    assert all_reduces(collective(mesh), metrics) == 3
    without = jax.shard_map(
        lambda m: jh.collective.distributed_stats(
            jax.tree.map(lambda v: v[0], m), "data"
        ),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=True,
    )
    assert all_reduces(without, metrics) == 2  # no provenance: two passes
    assert all_reduces(lambda m: jh.distributed_stats(m), metrics) == 2


def sub_mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@pytest.mark.parametrize("per_device", [1, 4])
@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_bytes_above_the_threshold_do_not_grow_with_the_devices(
    family, per_device, monkeypatch
):
    monkeypatch.setattr(_stats, "GATHER_DEVICES", 1)
    found = {}
    for n in (4, 8):
        mesh = sub_mesh(n)
        rng = np.random.default_rng(n)
        metrics = {
            f"m{i}": put(mesh, rng.normal(size=n * per_device)) for i in range(10)
        }
        shard = (lambda v: v[0]) if per_device == 1 else (lambda v: v)
        fn = spmd(mesh) if family == "spmd" else collective(mesh, per_shard=shard)
        found[n] = jh.collective_bytes(fn, metrics)
    assert found[4] == found[8], found
    # [x, -x, NaN rank], then the lowest ranks and [x - c, (x - c)^2, NaN]
    assert sorted(found[8]["all-reduce"]) == sorted([4 * 30, 4 * 20, 4 * 30])


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_bytes_of_the_gather_grow_with_the_devices(family, monkeypatch):
    monkeypatch.setattr(_stats, "GATHER_DEVICES", 8)
    for n in (4, 8):
        mesh = sub_mesh(n)
        metrics = {f"m{i}": put(mesh, np.arange(float(n))) for i in range(10)}
        fn = spmd(mesh) if family == "spmd" else collective(mesh)
        assert jh.collective_bytes(fn, metrics) == {"all-reduce": [4 * 10 * n]}


def test_per_holder_values_come_back_on_both_sides(side, mesh):
    """What the History's per-update reducer asks of global_stats: statistics
    with provenance, and the per-device values of some leaves."""
    rng = np.random.default_rng(4)
    values = {n: rng.integers(0, 5, size=8).astype(np.float32) for n in "abc"}
    arrays = {n: put(mesh, v) for n, v in values.items()}
    layouts = [concrete_layout(a.sharding, a.shape) for a in arrays.values()]

    def reduce(arrays):
        leaves = [Leaf(n, v) for n, v in arrays.items()]
        stats, picked = _stats.global_stats(leaves, layouts, frozenset({0, 2}))
        return stats, picked

    stats, picked = jax.jit(reduce)(arrays)
    assert all_reduces(reduce, arrays) <= (1 if side == "gather" else 3)
    assert sorted(picked) == [0, 2]
    np.testing.assert_array_equal(picked[0], values["a"])
    np.testing.assert_array_equal(picked[2], values["c"])
    for name, v in values.items():
        check(stats, name, v, device_of(mesh))


def test_exact_quantiles_keep_the_gather_above_the_threshold(mesh, monkeypatch):
    monkeypatch.setattr(_stats, "GATHER_DEVICES", 1)
    values = np.array([5.0, 1, 4, 2, 8, 3, 7, 6], np.float32)
    metrics = {"x": put(mesh, values)}

    def fn(m):
        return jh.distributed_stats(m, quantiles=(0.5, 0.9))

    assert jh.collective_bytes(fn, metrics) == {"all-reduce": [4 * 8]}
    out = jax.jit(fn)(metrics)
    np.testing.assert_allclose(float(out["x/p50"]), np.quantile(values, 0.5))
    np.testing.assert_allclose(float(out["x/p90"]), np.quantile(values, 0.9))
    shard = collective(mesh, quantiles=(0.5,))
    assert all_reduces(shard, metrics) == 1
    np.testing.assert_allclose(
        float(jax.jit(shard)(metrics)["x/p50"]), np.quantile(values, 0.5)
    )


def test_ranks_are_exact_past_what_bfloat16_holds():
    """Ranks ride in the accumulation dtype: 1,000 holders (bfloat16 is exact
    to 256 only) still name the lowest one holding the max and the min."""
    holders = 1000
    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, size=(3, holders)).astype(np.float32)
    x[1, [257, 259, 999]] = 9.0  # the max on ranks 257, 259, 999: 257 wins
    x[2, [513, 515]] = -1.0
    x = jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)
    issue = _stats._reducing_issue(
        lambda t: t, lambda t: t
    )  # one device: no collective
    rank = jnp.arange(holders, dtype=jnp.float32)
    device = jnp.arange(holders, dtype=jnp.int32) * 3  # each holder's device index
    _, where, _ = _stats._two_pass([x], issue, holders, (rank, None, device))
    xs = np.asarray(x)
    want_max = [3 * int(np.argmax(row == row.max())) for row in xs]
    want_min = [3 * int(np.argmax(row == row.min())) for row in xs]
    assert np.asarray(where[0]).tolist() == want_max
    assert np.asarray(where[1]).tolist() == want_min
    assert int(where[0, 1]) == 3 * 257 and int(where[1, 2]) == 3 * 513


# ----- collective_bytes ---------------------------------------------------------


def test_collective_bytes_of_no_collective_is_empty(mesh):
    assert jh.collective_bytes(lambda x: x + 1, jnp.ones(3)) == {}
    replicated = jnp.ones(8)
    assert jh.collective_bytes(jax.jit(lambda x: x * 2), replicated) == {}


def test_collective_bytes_of_plain_and_jitted_functions(mesh):
    x = put(mesh, np.ones((8, 3)), P("data"))

    def summed(x):
        return x.sum(axis=0)

    assert jh.collective_bytes(summed, x) == {"all-reduce": [12]}
    assert jh.collective_bytes(jax.jit(summed), x) == {"all-reduce": [12]}
    gathered = jax.shard_map(
        lambda v: jax.lax.all_gather(v, "data", tiled=True),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=False,
    )
    assert jh.collective_bytes(gathered, x) == {"all-gather": [8 * 3 * 4]}
    assert jh.collective_counts(gathered, x) == {"all-gather": 1}


def test_collective_bytes_sums_a_combined_tuple(mesh):
    """Two psums XLA combines into one tuple all-reduce: one entry, both parts."""
    x = put(mesh, np.ones(32), P("data"))
    fn = jax.shard_map(
        lambda v: (jax.lax.psum(v, "data"), jax.lax.psum(v[0], "data")),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    counts = jh.collective_counts(fn, x)
    found = jh.collective_bytes(fn, x)
    assert len(found["all-reduce"]) == counts["all-reduce"]
    assert sum(found["all-reduce"]) == 4 * 4 + 4


def test_collective_bytes_refuses_what_is_not_a_function():
    with pytest.raises(TypeError, match="collective_bytes takes the function"):
        jh.collective_bytes({"loss": jnp.ones(3)})
    with pytest.raises(TypeError, match="collective_counts takes the function"):
        jh.collective_counts(3.0, jnp.ones(3))


def test_bytes_in_hlo_reads_tuples_async_pairs_and_dtypes():
    text = "\n".join(
        [
            "  %all-reduce.40 = (f32[], bf16[8]{0}) all-reduce(%a, %b), channel_id=1",
            "  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(%x), dimensions={0}",
            "  %ars = s8[100]{0} all-reduce-start(%y), to_apply=%add",
            "  %agd = f32[16]{0} all-gather-done(%ags)",
            "  ROOT %ard = s8[100]{0} all-reduce-done(%ars)",
            "  %cp = pred[<=8]{0} collective-permute(%p), source_target_pairs={{0,1}}",
            "  %fused = f32[3]{0} fusion(%all-reduce.40), kind=kLoop",
            "  %rs = c64[2,3]{1,0} reduce-scatter(%z), dimensions={0}",
        ]
    )
    assert bytes_in_hlo(text) == {
        "all-reduce": [4 + 16, 100],
        "all-gather": [64],
        "collective-permute": [8],
        "reduce-scatter": [48],
    }
    assert shape_bytes("(f32[4,2]{1,0}, (s32[], u4[3]))") == 32 + 4 + 2
    assert shape_bytes("token[]") == 0
    with pytest.raises(ValueError, match="unknown HLO element type 'opaque'"):
        shape_bytes("opaque[2]")
    assert shape_bytes("f64[]") == 8
