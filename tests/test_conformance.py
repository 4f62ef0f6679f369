"""One suite for both reducer families, against a float64 NumPy reference.

Every case runs the SPMD reducers under ``jax.jit`` on a sharded global array and the
collective reducers under ``jax.shard_map`` (``check_vma=True``) on the same data,
on a real 8-device mesh (and a 4x2 mesh), and compares both with NumPy in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh

RNG = np.random.default_rng(0)


def _with_nan():
    x = RNG.normal(size=(16,)).astype(np.float32)
    x[5] = np.nan
    return x


CASES = {
    "per_device": RNG.normal(size=(8,)).astype(np.float32),
    "batch": (RNG.normal(size=(32,)) * 3 + 1).astype(np.float32),
    "matrix": RNG.normal(size=(16, 3)).astype(np.float32),
    "offset": np.array([1e4 - 1, 1e4 + 1] * 4, np.float32),
    "bf16": RNG.normal(size=(16,)).astype(jnp.bfloat16),
    "fp16": RNG.normal(size=(16,)).astype(np.float16),
    "int": RNG.integers(-50, 50, size=(24,)).astype(np.int32),
    "nan": _with_nan(),
}
OPS = ("mean", "sum", "max", "min", "std")
REFERENCE = {
    "mean": np.mean,
    "sum": np.sum,
    "max": np.max,
    "min": np.min,
    "std": np.std,
}


def _reference(op, x):
    return REFERENCE[op](np.asarray(x, np.float64))


def _spec(x, axes):
    return P(axes, *([None] * (np.ndim(x) - 1)))


def _spmd(fn, mesh, axes, x):
    xs = jax.device_put(x, NamedSharding(mesh, _spec(x, axes)))
    return jax.jit(fn)({"group": {"x": xs}})


def _collective(fn, mesh, axes, x):
    xs = jax.device_put(x, NamedSharding(mesh, _spec(x, axes)))
    body = jax.shard_map(
        lambda m: fn(m, axes),
        mesh=mesh,
        in_specs=P(axes),
        out_specs=P(),
        check_vma=True,
    )
    return jax.jit(body)({"group": {"x": xs}})


def _check(got, want, x):
    got = np.asarray(got, np.float64)
    if np.isnan(want):
        assert np.isnan(got)
        return
    assert np.isfinite(got)
    rtol = 1e-5 if np.asarray(x).dtype != np.int32 else 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("family", ["spmd", "collective"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("op", OPS)
def test_reducer_matches_float64_reference(family, case, op, mesh):
    x = CASES[case]
    if family == "spmd":
        out = _spmd(getattr(jh, f"reduce_{op}"), mesh, "data", x)
    else:
        out = _collective(getattr(jh.collective, f"reduce_{op}"), mesh, "data", x)
    got = out["group"]["x"]
    assert got.shape == ()
    _check(got, _reference(op, x), x)


@pytest.mark.parametrize("family", ["spmd", "collective"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_distributed_stats_matches_float64_reference(family, case, mesh):
    x = CASES[case]
    if family == "spmd":
        out = _spmd(jh.distributed_stats, mesh, "data", x)
    else:
        out = _collective(jh.collective.distributed_stats, mesh, "data", x)
    assert sorted(out) == sorted(f"group/x/{s}" for s in jh.STATS)
    for stat in jh.STATS:
        got = out[f"group/x/{stat}"]
        assert got.dtype == (np.float32 if x.dtype != np.float64 else np.float64)
        _check(got, _reference(stat, x), x)


@pytest.mark.parametrize("family", ["spmd", "collective"])
@pytest.mark.parametrize("op", (*OPS, "stats"))
def test_two_axis_mesh_reduces_over_every_device(family, op, mesh2d):
    x = RNG.normal(size=(8, 6)).astype(np.float32) * 5 + 2
    axes = ("data", "model")
    xs = jax.device_put(x, NamedSharding(mesh2d, P("data", "model")))
    if family == "spmd":
        fn = jh.distributed_stats if op == "stats" else getattr(jh, f"reduce_{op}")
        out = jax.jit(fn)({"x": xs})
    else:
        name = "distributed_stats" if op == "stats" else f"reduce_{op}"
        fn = getattr(jh.collective, name)
        body = jax.shard_map(
            lambda m: fn(m, axes),
            mesh=mesh2d,
            in_specs=P("data", "model"),
            out_specs=P(),
            check_vma=True,
        )
        out = jax.jit(body)({"x": xs})
    if op == "stats":
        for stat in jh.STATS:
            _check(out[f"x/{stat}"], _reference(stat, x), x)
    else:
        _check(out["x"], _reference(op, x), x)


@pytest.mark.parametrize("op", (*OPS, "stats"))
def test_spmd_reducers_work_on_an_auto_axis_mesh(op):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = CASES["batch"]
    fn = jh.distributed_stats if op == "stats" else getattr(jh, f"reduce_{op}")
    out = _spmd(fn, mesh, "data", x)
    if op == "stats":
        for stat in jh.STATS:
            _check(out[f"group/x/{stat}"], _reference(stat, x), x)
    else:
        _check(out["group"]["x"], _reference(op, x), x)
