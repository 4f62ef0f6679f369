"""Seeded randomized check of the reducers against float64 NumPy.

Random meshes of the 8 devices (8, 2x4, 4x2, 2x2x2, some with their devices in
another order than ``jax.devices()``), partition specs (one axis, two, a tuple
of axes on the leading dimension, replicated), dtypes (float32, bfloat16,
float16, int32, bool), value distributions (normal, huge, tiny, constant,
NaN/inf sprinkled, all NaN, one NaN on a chosen device) and masks/weights (all
zero, one nonzero, random). Every case runs the jit (SPMD) reducers and the
``jh.collective`` reducers in ``shard_map`` on the same data; both must agree
with NumPy within float32 rounding, as docs/reducers.md promises, including the
documented float32 range limits (no rescaling in the reducers, NumPy's figures
from ``distributed_stats``) and provenance's lowest-device tie rule.

The data has one shape, (8, 8), so the number of compiled programs stays small;
values change from case to case, meshes, specs and dtypes are drawn.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh

SHAPE = (8, 8)
DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "int32": jnp.int32,
    "bool": jnp.bool_,
}
F32_MAX = float(np.finfo(np.float32).max)


def make_mesh(rng, shape):
    names = ("a", "b", "c")[: len(shape)]
    devices = np.array(jax.devices())
    if rng.random() < 0.5:
        devices = devices[rng.permutation(8)]
    return Mesh(
        devices.reshape(shape), names, axis_types=(AxisType.Explicit,) * len(shape)
    )


def specs_for(names):
    if len(names) == 1:
        (a,) = names
        return [P(a), P(None, a), P()]
    if len(names) == 2:
        a, b = names
        return [P(a), P(b), P(a, b), P(None, b), P((a, b)), P()]
    a, b, c = names
    return [P(a), P((a, b), c), P(c, (a, b)), P((a, b, c)), P(None, b), P()]


def owners(mesh, spec):
    """Lowest global device index (``jax.devices()`` order) holding each element."""
    index = {d.id: i for i, d in enumerate(jax.devices())}
    owner = np.full(SHAPE, 10**6)
    for d, sl in NamedSharding(mesh, spec).devices_indices_map(SHAPE).items():
        owner[sl] = np.minimum(owner[sl], index[d.id])
    return owner


def replication(mesh, spec):
    """How many devices hold each block."""
    held = {
        a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))
    }
    return math.prod(n for a, n in mesh.shape.items() if a not in held)


def draw_values(rng, dtype, kind, owner):
    if dtype == "bool":
        return rng.random(SHAPE) < rng.random()
    if dtype == "int32":
        hi = int(rng.choice([3, 1000, 2**20]))
        return rng.integers(-hi, hi, size=SHAPE).astype(np.int32)
    x = rng.normal(size=SHAPE)
    if kind == "huge":
        x = x * 1e30 if dtype != "float16" else x * 1e4
    elif kind == "tiny":
        x = x * (1e-30 if dtype != "float16" else 1e-3)
    elif kind == "constant":
        x = np.full(SHAPE, rng.normal())
    elif kind == "offset":
        x = 1e4 + x
    elif kind == "ties":
        x = rng.integers(0, 3, size=SHAPE).astype(np.float64)
    elif kind == "overflow":  # one sign: a float32 sum past 3.4e38 in any order
        x = rng.uniform(1.0, 2.0, size=SHAPE) * (1e37 if dtype != "float16" else 3e4)
    elif kind == "sprinkled":
        flat = x.reshape(-1)
        picks = rng.choice(flat.size, size=3, replace=False)
        flat[picks] = rng.choice([np.nan, np.inf, -np.inf], size=3)
    elif kind == "infinities":
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, size=2, replace=False)] = [np.inf, -np.inf]
    elif kind == "all_nan":
        x = np.full(SHAPE, np.nan)
    elif kind == "one_nan":
        device = rng.integers(8)
        rows, cols = np.nonzero(owner == device)
        if rows.size == 0:  # this device holds only replicas: another one
            rows, cols = np.nonzero(owner == owner.min())
        i = rng.integers(rows.size)
        x[rows[i], cols[i]] = np.nan
    return np.asarray(jnp.asarray(x, DTYPES[dtype]))


def draw_weights(rng, kind):
    if kind == "none":
        return None
    if kind == "zero":
        return np.zeros(SHAPE, np.float32)
    if kind == "one":
        w = np.zeros(SHAPE, np.float32)
        w[tuple(rng.integers(0, 8, size=2))] = rng.uniform(0.5, 2.0)
        return w
    return rng.uniform(0.0, 2.0, size=SHAPE).astype(np.float32)


def draw_mask(rng, kind):
    if kind == "none":
        return None
    if kind == "zero":
        return np.zeros(SHAPE, bool)
    if kind == "one":
        m = np.zeros(SHAPE, bool)
        m[tuple(rng.integers(0, 8, size=2))] = True
        return m
    return rng.random(SHAPE) < 0.5


def f32(v):
    """A float64 result rounded to float32, as the reducers give it."""
    with np.errstate(over="ignore"):
        return np.float64(np.float32(v))


def close(got, want, scale, what, rtol=1e-5):
    got, want = float(got), float(want)
    if math.isnan(want) or math.isinf(want):
        assert got == want or (math.isnan(got) and math.isnan(want)), (
            what,
            got,
            want,
        )
        return
    assert abs(got - want) <= rtol * abs(want) + 1e-6 * scale, (what, got, want)


def summed(total):
    """A float64 sum as the reducers' float32 accumulation gives it: not
    rescaled, so past float32's largest value it is infinite (the values of a
    case that overflows all have one sign, so every order of summation
    overflows). None near the edge, where rounding decides."""
    if abs(abs(total) - F32_MAX) < 1e-4 * F32_MAX:
        return None
    return math.copysign(math.inf, total) if abs(total) > F32_MAX else total


def expected(x64, w, m, r):
    """NumPy (float64) reference of every reducer of one family, with the
    float32 range limits docs/reducers.md documents for reducers that do not
    rescale. ``r`` is how many devices hold each block (1 for the jit form):
    the collective sums count every copy, as ``lax.psum`` does."""
    out = {}
    with np.errstate(all="ignore"):
        weighted = w is not None or m is not None
        weight = np.ones(SHAPE) if w is None else w.astype(np.float64)
        if m is not None:
            weight = np.where(m, weight, 0.0)
        keep = weight != 0
        total = summed(r * np.sum(np.where(keep, x64 * weight, 0.0)))
        count = r * weight.sum()
        out["mean_w"] = (
            None if not weighted or total is None else np.float64(total) / count
        )
        out["sum"] = summed(r * x64.sum())
        mean_sum = summed(r * x64.sum())
        out["mean"] = (
            None if mean_sum is None else np.float64(mean_sum) / (r * x64.size)
        )
        out["max"], out["min"] = x64.max(), x64.min()
        std = x64.std()
        if np.isfinite(x64).all():
            dev = np.abs(x64 - x64.mean())
            if (
                out["mean"] is not None and np.isinf(out["mean"])
            ) or dev.max() > 1.8e19:
                std = np.inf  # a deviation's square overflows
            elif 0 < dev.max() < 1e-25:
                std = 0.0  # every square is below float32's normal range
            elif dev.max() < 1e-18:
                std = None
        out["std"] = std
    return out


def spmd_reduce(x, w, m):
    return {
        "mean": jh.reduce_mean({"x": x})["x"],
        "mean_w": jh.reduce_mean({"x": x}, weights=w, mask=m)["x"],
        "sum": jh.reduce_sum(x),
        "max": jh.reduce_max(x),
        "min": jh.reduce_min(x),
        "std": jh.reduce_std(x),
        "custom": jh.reduce_custom({"s": x, "t": {"u": x}}, {"s": "sum", "t": "max"}),
    }


def collective_reduce(axes):
    def body(x, w, m):
        c = jh.collective
        return {
            "mean": c.reduce_mean({"x": x}, axes)["x"],
            "mean_w": c.reduce_mean({"x": x}, axes, weights=w, mask=m)["x"],
            "sum": c.reduce_sum(x, axes),
            "max": c.reduce_max(x, axes),
            "min": c.reduce_min(x, axes),
            "std": c.reduce_std(x, axes),
            "custom": c.reduce_custom(
                {"s": x, "t": {"u": x}}, {"s": "sum", "t": "max"}, axes
            ),
        }

    return body


def check_reducers(name, got, want, x64, weighted):
    finite = x64[np.isfinite(x64)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    n = x64.size
    integer = np.issubdtype(np.asarray(got["sum"]).dtype, np.integer)
    if integer:
        assert int(got["sum"]) == int(want["sum"]), (name, got["sum"], want["sum"])
        assert int(got["custom"]["s"]) == int(want["sum"]), name
    else:
        if want["sum"] is not None:
            close(got["sum"], f32(want["sum"]), scale * n, (name, "sum"))
        close(got["custom"]["s"], got["sum"], 0.0, (name, "custom sum"), rtol=0.0)
    if want["mean"] is not None:
        close(got["mean"], f32(want["mean"]), scale, (name, "mean"))
    if not weighted:
        close(got["mean_w"], got["mean"], 0.0, (name, "mean_w"), rtol=0.0)
    elif want["mean_w"] is not None:
        close(got["mean_w"], f32(want["mean_w"]), scale * 2, (name, "mean_w"))
    for op in ("max", "min"):
        close(got[op], want[op], 0.0, (name, op), rtol=0.0)
    close(got["custom"]["t"]["u"], got["max"], 0.0, (name, "custom max"), rtol=0.0)
    if want["std"] is not None:
        close(got["std"], f32(want["std"]), scale, (name, "std"), rtol=2e-5)


def check_stats(name, stats, x64, owner):
    nan = np.isnan(x64)
    finite = x64[np.isfinite(x64)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    with np.errstate(all="ignore"):
        mean, std = x64.mean(), x64.std()
    close(stats["x/mean"], f32(mean), scale, (name, "stats mean"))
    close(stats["x/max"], x64.max(), 0.0, (name, "stats max"), rtol=0.0)
    close(stats["x/min"], x64.min(), 0.0, (name, "stats min"), rtol=0.0)
    if not (scale < 1e-37 and scale > 0):  # below float32's normal range: flushed
        close(stats["x/std"], f32(std), scale, (name, "stats std"), rtol=2e-5)
    if nan.any():
        first = int(owner[nan].min())
        want = (first, first, first)
    else:
        want = (
            int(owner[x64 == x64.max()].min()),
            int(owner[x64 == x64.min()].min()),
            -1,
        )
    got = tuple(int(stats[f"x/{s}"]) for s in jh.PROVENANCE)
    assert got == want, (name, "provenance", got, want)


KINDS = [
    "normal",
    "ties",
    "overflow",
    "huge",
    "tiny",
    "constant",
    "offset",
    "sprinkled",
    "infinities",
    "all_nan",
    "one_nan",
]
MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2)]


CASES = [*KINDS, "int32", "bool"]


def run_case(seed):
    rng = np.random.default_rng(seed)
    mesh = make_mesh(rng, MESHES[seed % len(MESHES)])
    specs = specs_for(mesh.axis_names)
    spec = specs[rng.integers(len(specs))]
    kind = CASES[seed % len(CASES)]
    dtype = (
        kind if kind in DTYPES else str(rng.choice(["float32", "bfloat16", "float16"]))
    )
    owner = owners(mesh, spec)
    values = draw_values(rng, dtype, kind, owner)
    w = draw_weights(rng, str(rng.choice(["none", "zero", "one", "random"])))
    m = draw_mask(rng, str(rng.choice(["none", "zero", "one", "random"])))
    name = f"seed={seed} mesh={dict(mesh.shape)} spec={spec} {dtype} {kind}"
    name += f" w={'-' if w is None else int((w != 0).sum())}"
    name += f" m={'-' if m is None else int(m.sum())}"

    sharding = NamedSharding(mesh, spec)
    x = jax.device_put(jnp.asarray(values, DTYPES[dtype]), sharding)
    wd = None if w is None else jax.device_put(w, sharding)
    md = None if m is None else jax.device_put(m, sharding)
    x64 = np.asarray(values).astype(np.float64)
    weighted = w is not None or m is not None

    spmd = jax.jit(spmd_reduce)(x, wd, md)
    want_spmd = expected(x64, w, m, 1)
    check_reducers(name + " spmd", spmd, want_spmd, x64, weighted)

    axes = tuple(mesh.axis_names)
    coll = jax.jit(
        jax.shard_map(
            collective_reduce(axes),
            mesh=mesh,
            in_specs=(spec, None if w is None else spec, None if m is None else spec),
            out_specs=P(),
        )
    )(x, wd, md)
    want_coll = expected(x64, w, m, replication(mesh, spec))
    check_reducers(name + " collective", coll, want_coll, x64, weighted)
    # The two forms agree with each other wherever the same result is due
    # (a replicated block's copies can take the collective sum past float32).
    finite = x64[np.isfinite(x64)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    for op in ("mean", "mean_w", "max", "min", "std"):
        if want_spmd[op] is None or not np.array_equal(
            want_spmd[op], want_coll[op], equal_nan=True
        ):
            continue
        a, b = float(spmd[op]), float(coll[op])
        assert np.array_equal(a, b, equal_nan=True) or (
            abs(a - b) <= 2e-5 * abs(a) + 1e-6 * scale
        ), (name, op, a, b)

    stats = jax.jit(
        lambda v: jh.distributed_stats({"x": v}, provenance=True, mesh=mesh)
    )(x)
    check_stats(name + " stats", stats, x64, owner)
    stats_c = jax.jit(
        jax.shard_map(
            lambda v: jh.collective.distributed_stats(
                {"x": v}, axes, provenance=True, mesh=mesh
            ),
            mesh=mesh,
            in_specs=spec,
            out_specs=P(),
        )
    )(x)
    check_stats(name + " collective stats", stats_c, x64, owner)

    # One value per shard: per_shard's means, and their exact quantiles
    # (NumPy's linear rule) from distributed_stats.
    if spec and spec[0] is not None:
        qs = (0.1, 0.5, 0.9)
        shards, qstats = jax.jit(
            lambda v: (
                jh.per_shard(v),
                jh.distributed_stats({"p": jh.per_shard(v)}, quantiles=qs),
            )
        )(x)
        ns = shards.shape[0]
        with np.errstate(all="ignore"):
            per = x64.reshape(ns, -1).mean(axis=1)
        for a, b in zip(np.asarray(shards, np.float64), per, strict=True):
            if math.isfinite(b):
                close(a, f32(b), scale, (name, "per_shard"))
            else:
                assert np.array_equal(a, b, equal_nan=True), (name, "per_shard", a, b)
        got = np.asarray(shards, np.float64)
        with np.errstate(all="ignore"):
            want_q = np.quantile(got, qs)
        for q, wq in zip(("p10", "p50", "p90"), want_q, strict=True):
            close(qstats[f"p/{q}"], f32(wq), scale, (name, q))


@pytest.mark.parametrize("seed", range(2 * len(CASES)))
def test_reducers_agree_with_numpy(seed):
    run_case(seed)


def test_bad_inputs_are_refused_as_documented():
    """Mismatched weights, empty leaves and non-numeric leaves, in both forms."""
    rng = np.random.default_rng(7)
    mesh = make_mesh(rng, (2, 4))
    x = jax.device_put(
        jnp.asarray(rng.normal(size=SHAPE), jnp.float32), NamedSharding(mesh, P("a"))
    )
    c = jh.collective

    def in_shard_map(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("a"), out_specs=P()))

    for weights in (np.ones((3,)), np.ones((8, 3)), np.ones((2, 8, 8))):
        with pytest.raises(ValueError, match="weights/mask for metric 'x' do not"):
            jax.jit(lambda v, w=weights: jh.reduce_mean({"x": v}, weights=w))(x)
        with pytest.raises(ValueError, match="weights/mask for metric 'x' do not"):
            jh.reduce_mean({"x": x}, mask=weights.astype(bool))
        with pytest.raises(ValueError, match="weights/mask for metric 'x' do not"):
            in_shard_map(lambda v, w=weights: c.reduce_mean({"x": v}, "a", weights=w))(
                x
            )
    with pytest.raises(ValueError, match="weights must be one array"):
        jh.reduce_mean({"x": x, "y": x}, weights={"x": np.ones(SHAPE)})

    empty = jnp.zeros((0, 8), jnp.float32)
    for reduce in (jh.reduce_max, jh.reduce_min):
        with pytest.raises(ValueError, match="metric 'e' is empty"):
            reduce({"e": empty})
    assert math.isnan(float(jh.reduce_mean({"e": empty})["e"]))
    with pytest.raises(ValueError, match="empty"):
        jh.distributed_stats({"e": empty})

    for bad, match in (
        ("text", "metric 'bad' is a str"),
        (np.array(["a", "b"]), "metric 'bad'"),
        (jnp.ones(3, jnp.complex64), "metric 'bad' is complex"),
        (object(), "metric 'bad' is not numeric"),
    ):
        for reduce in (jh.reduce_mean, jh.reduce_sum, jh.reduce_std, jh.reduce_max):
            with pytest.raises(TypeError, match=match):
                reduce({"bad": bad, "ok": x})
        with pytest.raises(TypeError, match=match):
            jh.distributed_stats({"bad": bad, "ok": x})
        with pytest.raises(TypeError, match=match):
            in_shard_map(lambda v, b=bad: c.reduce_sum({"bad": b, "ok": v}, "a"))(x)
