"""Seeded randomized check of watch, histogram and distributed_stats' quantiles
against float64 NumPy.

watch: a tree of five leaves of fixed shapes (a 0-d scalar, an (8, 16)
matrix, two leaves with a leading axis of 4 stacked layers, an (8, 0) leaf
without values), each of a drawn dtype (float32, bfloat16, float16, int32)
and sharding (replicated, on axis 0, on axis 1, on both, on a tuple of axes,
the layer axis too) over a 2x4 or 4x2 mesh, and of drawn values (normal,
huge near float32's largest, subnormal, all zero, constant, offset far from
zero, ties, NaN/inf sprinkled, all NaN). Every statistic of every entry (each
layer with ``split_layers``; the layer leaves as one group with ``groups``
and ``prefix``; the total) is compared with NumPy on the same dtype-rounded
values within float32 rounding, as docs/watch.md promises, with the float32
limits the docs give: a sum of squares past float32's largest value is inf,
squares below its normal range read as zero, and on CPU a subnormal value may
read as zero (docs/reducers.md). ``jh.collective.watch`` in ``jax.shard_map``
(the layer axis unsplit, as it requires) runs on the same leaves in half the
layouts and must agree as well.

Quantiles and histogram: one leaf of 1,024 to 65,536 values (normal,
lognormal, Cauchy, 30% ties at one value among values up to 1e6, ReLU-like,
integer labels, wide integers, huge, tiny, infinities, one NaN) in float32,
bfloat16 or int32, and one value per device. A quantile of the large leaf
must lie between NumPy's order statistics at ranks within 1% of the asked
rank, or within the share of values in the bin holding it where that is more
(ties; docs/reducers.md); of integer labels, NumPy's exactly; of one value
per device, the linear rule within float32 rounding (between a finite value
and an infinity, the infinity, where ``np.quantile`` gives NaN). The
histogram is NumPy's, up to values within float32 rounding of a bin edge.

Programs are few: four watch layouts and three quantile layouts (mesh,
shapes, shardings, dtypes), each compiled once per function, with several
value draws through each (about 11 s here).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh

F32 = np.finfo(np.float32)
F32_MAX = float(F32.max)
F32_TINY = float(F32.tiny)  # smallest normal float32
EPS = float(F32.eps)
DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "int32": jnp.int32,
}

SHAPES = {"s": (), "w": (8, 16), "k": (4, 8, 4), "b": (4, 8), "e": (8, 0)}


def leaf_specs(name):
    """The partition specs a leaf of this shape may take on a mesh of axes
    ("a", "b") of sizes 2 and 4 in either order."""
    return {
        "s": [P()],
        "w": [P(), P("a"), P(None, "b"), P("a", "b"), P(("a", "b"))],
        "k": [P(), P("a"), P("b"), P(None, ("a", "b")), P(None, "a", "b")],
        "b": [P(), P("b"), P(None, "a"), P("a", "b")],
        "e": [P(), P("a"), P(("a", "b"))],
    }[name]


KINDS = [
    "normal",
    "huge",
    "tiny",
    "zeros",
    "constant",
    "offset",
    "ties",
    "sprinkled",
    "all_nan",
]


def draw_values(rng, shape, dtype, kind):
    """Values of ``kind``, rounded to ``dtype`` (returned as that dtype)."""
    if dtype == "int32":
        hi = int(rng.choice([3, 1000, 2**31 - 1]))
        x = rng.integers(-hi, hi, size=shape, endpoint=True)
        if kind == "zeros":
            x = np.zeros(shape, np.int64)
        return x.astype(np.int32)
    big = 6e4 if dtype == "float16" else 3e38
    small = 1e-6 if dtype == "float16" else 1e-40  # subnormal in the dtype
    x = rng.normal(size=shape)
    if kind == "huge":
        x = np.clip(x, -1, 1) * big
    elif kind == "tiny":
        x = x * small
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "constant":
        x = np.full(shape, rng.normal() * 10.0 ** rng.integers(-3, 4))
    elif kind == "offset":
        x = 1e4 + x
    elif kind == "ties":
        x = rng.integers(-1, 2, size=shape).astype(np.float64)
    elif kind == "sprinkled" and x.size:
        flat = x.reshape(-1)
        n = int(rng.integers(1, min(3, flat.size) + 1))
        picks = rng.choice(flat.size, size=n, replace=False)
        flat[picks] = rng.choice([np.nan, np.inf, -np.inf], size=n)
    elif kind == "all_nan":
        x = np.full(shape, np.nan)
    with np.errstate(over="ignore"):
        return np.asarray(jnp.asarray(np.asarray(x, np.float32), DTYPES[dtype]))


def as_computed(x):
    """``x`` as watch computes with it, float32 (integers too), then float64
    for the reference."""
    return np.ravel(np.asarray(x).astype(np.float32).astype(np.float64))


def squares(v):
    """The float64 sum of squares of ``v``, and that of only the squares in
    float32's normal range: a smaller square reads as zero in float32 (below
    it, or flushed on CPU, docs/reducers.md), so the sum may be either."""
    with np.errstate(all="ignore"):
        sq = v * v
        return float(np.sum(sq)), float(np.sum(np.where(sq < F32_TINY, 0.0, sq)))


def reference(v):
    """Every watch statistic of float64 values ``v`` (NumPy); norm and rms as
    ``(low, high)`` bounds, the float32 limits the docs give: squares below
    its normal range read as zero, a sum of squares past its largest value is
    inf (None where rounding decides: a sum at float32's largest value)."""
    out = {}
    with np.errstate(all="ignore"):
        n = v.size
        for stat in ("norm", "rms"):
            bounds = []
            for sq in squares(v):
                if math.isfinite(sq) and abs(sq - F32_MAX) < 1e-4 * F32_MAX:
                    bounds = None
                    break
                if math.isfinite(sq) and sq > F32_MAX:  # documented: inf
                    sq = math.inf
                if stat == "rms":
                    sq = sq / n if n else math.nan
                bounds.append(math.sqrt(sq))
            out[stat] = None if bounds is None else (min(bounds), max(bounds))
        kept = v[~np.isnan(v)]
        out["max_abs"] = float(np.max(np.abs(kept))) if kept.size else 0.0
        out["nonfinite"] = float(np.sum(~np.isfinite(v)))
        out["mean"] = float(np.mean(v)) if n else math.nan
        out["std"] = float(np.std(v)) if n else math.nan
    return out


def close(got, want, tol, what):
    got = float(got)
    if want is None:
        return
    if math.isnan(want) or math.isinf(want):
        assert got == want or (math.isnan(got) and math.isnan(want)), (what, got, want)
        return
    assert abs(got - want) <= tol, (what, got, want, tol)


def between(got, bounds, rtol, what):
    got = float(got)
    if bounds is None:
        return
    low, high = bounds
    if not (math.isfinite(low) and math.isfinite(high)):
        close(got, high if math.isinf(high) or math.isnan(high) else low, 0.0, what)
        return
    assert low * (1 - rtol) <= got <= high * (1 + rtol), (what, got, low, high)


def check_entry(out, key, v, what):
    """Every statistic of the entry ``key`` against the values ``v``."""
    want = reference(v)
    finite = v[np.isfinite(v)]
    top = float(np.max(np.abs(finite))) if finite.size else 0.0
    n = max(v.size, 1)
    # float32 rounding: of each value (and its square) and of sums of n of them
    sum_rtol = 4 * EPS * max(math.log2(n), 1) + 2 * EPS
    name = f"{key}/" if key else ""
    close(out[name + "nonfinite"], want["nonfinite"], 0.0, (what, key, "nonfinite"))
    # exact; a subnormal largest magnitude may read as zero on CPU
    flushed = want["max_abs"] if want["max_abs"] < F32_TINY else 0.0
    close(out[name + "max_abs"], want["max_abs"], flushed, (what, key, "max_abs"))
    # exact zeros; subnormal values may count as zeros on CPU
    if v.size:
        zeros = (float(np.mean(v == 0)), float(np.mean(np.abs(v) < F32_TINY)))
        between(out[name + "zero_frac"], zeros, 2 * EPS, (what, key, "zero_frac"))
    else:
        close(out[name + "zero_frac"], math.nan, 0.0, (what, key, "zero_frac"))
    for stat in ("norm", "rms"):
        between(out[name + stat], want[stat], sum_rtol, (what, key, stat))
    # mean and std: each value shifted by the midrange and scaled, the sums
    # in float32: off by a rounding of the largest value's size per value
    # summed; and results below float32's normal range may read as zero
    tol = sum_rtol * top + F32_TINY
    close(out[name + "mean"], want["mean"], tol, (what, key, "mean"))
    std = want["std"]
    if math.isfinite(std):
        # var = E[d^2] - E[d]^2 in float32: its error is a rounding of the
        # largest squared deviation; the std's is that over 2 std
        spread = float(np.max(np.abs(finite - np.mean(finite)))) if finite.size else 0
        var_err = sum_rtol * spread**2
        tol = sum_rtol * std + min(math.sqrt(var_err), var_err / (2 * std + 1e-300))
        tol += F32_TINY
    else:
        tol = 0.0
    close(out[name + "std"], std, tol, (what, key, "std"))


def make_mesh(shape):
    return jax.make_mesh(shape, ("a", "b"))


def draw_layout(rng, collective):
    """A mesh, a spec and a dtype per leaf. For the shard_map form the layer
    axis of the stacked leaves is not split (watch_collective's rule)."""
    mesh = make_mesh(((2, 4), (4, 2))[int(rng.integers(2))])
    specs, dtypes = {}, {}
    for name in SHAPES:
        choices = leaf_specs(name)
        if collective and name in ("k", "b"):
            choices = [s for s in choices if not s or s[0] is None]
        specs[name] = choices[int(rng.integers(len(choices)))]
        if name == "e":
            dtypes[name] = "float32"
        else:
            dtypes[name] = str(rng.choice(list(DTYPES)))
    return mesh, specs, dtypes


def tree_of(values):
    return {
        "s": values["s"],
        "w": values["w"],
        "layers": {"k": values["k"], "b": values["b"]},
        "e": values["e"],
    }


def expected_entries(values, split):
    """``{entry name: float64 values}``, the total as ''."""
    v = {name: as_computed(values[name]) for name in SHAPES}
    out = {"s": v["s"], "w": v["w"], "e": v["e"]}
    if split:
        for name in ("k", "b"):
            layers = as_computed(values[name]).reshape(4, -1)
            for i in range(4):
                out[f"layers/{name}/{i}"] = layers[i]
    else:
        out["layers"] = np.concatenate([v["k"], v["b"]])
    out[""] = np.concatenate([v[name] for name in SHAPES])
    return out


def watch_options(split):
    if split:
        return {"stats": jh.WATCH_STATS, "split_layers": "layers"}
    return {"stats": jh.WATCH_STATS, "groups": "layers", "prefix": "g"}


def check_watch(out, values, split, what):
    prefix = "" if split else "g"
    entries = expected_entries(values, split)
    keys = {
        "/".join(p for p in (prefix, name) if p) + "/" + stat
        if name or prefix
        else stat
        for name in entries
        for stat in jh.WATCH_STATS
    }
    assert set(out) == keys, (what, sorted(set(out) ^ keys))
    for name, v in entries.items():
        key = "/".join(p for p in (prefix, name) if p)
        check_entry(out, key, v, what)


_JIT = {True: None, False: None}


def jitted_watch(split):
    if _JIT[split] is None:
        _JIT[split] = jax.jit(lambda t: jh.watch(t, **watch_options(split)))
    return _JIT[split]


def collective_watch(mesh, specs, split):
    in_specs = tree_of(specs)

    def body(tree):
        return jh.collective.watch(tree, ("a", "b"), **watch_options(split))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=P()))


def run_watch_layout(layout_seed, draws):
    rng = np.random.default_rng(layout_seed)
    split, collective = layout_seed % 2 == 0, layout_seed % 4 in (1, 2)
    mesh, specs, dtypes = draw_layout(rng, collective)
    shard_fn = collective_watch(mesh, specs, split) if collective else None
    for draw in range(draws):
        values = {
            name: draw_values(rng, SHAPES[name], dtypes[name], str(rng.choice(KINDS)))
            for name in SHAPES
        }
        what = f"layout={layout_seed} draw={draw} {dict(mesh.shape)} " + " ".join(
            f"{n}:{dtypes[n]}:{specs[n]}" for n in SHAPES
        )
        arrays = {
            name: jax.device_put(
                jnp.asarray(values[name], DTYPES[dtypes[name]]),
                NamedSharding(mesh, specs[name]),
            )
            for name in SHAPES
        }
        tree = tree_of(arrays)
        check_watch(jitted_watch(split)(tree), values, split, what + " jit")
        if collective:
            check_watch(shard_fn(tree), values, split, what + " shard_map")


@pytest.mark.parametrize("layout", range(4))
def test_watch_agrees_with_numpy(layout):
    run_watch_layout(layout, draws=6)


# Quantiles and histograms: a large leaf and one value per device.

QS = (0.001, 0.1, 0.5, 0.9, 0.999)
Q_NAMES = ("p0.1", "p10", "p50", "p90", "p99.9")
# (mesh shape, large leaf's shape and spec, one-per-device spec, dtype)
Q_LAYOUTS = [
    ((2, 4), (8, 8192), P("a", "b"), P(("a", "b")), "float32"),
    ((8,), (8, 128), P(None, "a"), P("a"), "bfloat16"),
    ((4, 2), (8, 1024), P("a"), P(("a", "b")), "int32"),
]
Q_KINDS = {
    "float": [
        "normal",
        "lognormal",
        "cauchy",
        "ties",
        "relu",
        "labels",
        "huge",
        "tiny",
        "infinities",
        "one_nan",
        "constant",
    ],
    "int32": ["labels", "labels", "wide", "ties", "constant"],
}
# (bins, range, log) of the histograms, by the layout's dtype
HISTOGRAMS = {
    "float32": [(64, (-4.0, 4.0), False), (20, (1e-2, 1e2), True)],
    "bfloat16": [(64, (-4.0, 4.0), False)],
    "int32": [(16, (0.0, 16.0), False)],
}


def draw_large(rng, shape, dtype, kind):
    n = math.prod(shape)
    if kind == "normal":
        x = rng.normal(size=n) * 10.0 ** rng.integers(-3, 4)
    elif kind == "lognormal":
        x = rng.lognormal(0, 3, size=n)
    elif kind == "cauchy":
        x = rng.standard_cauchy(size=n)
    elif kind == "ties":  # 30% at one value among values up to 1e6
        x = rng.uniform(0, 1e6, size=n)
        x[rng.random(n) < 0.3] = 1.0
    elif kind == "relu":
        x = np.maximum(rng.normal(size=n), 0)
    elif kind == "labels":
        x = rng.integers(0, 10, size=n).astype(np.float64)
    elif kind == "wide":
        x = rng.integers(-(2**30), 2**30, size=n).astype(np.float64)
    elif kind == "huge":
        x = rng.uniform(-1, 1, size=n) * 3e38
    elif kind == "tiny":
        x = rng.normal(size=n) * 1e-30
    elif kind == "infinities":
        x = rng.normal(size=n)
        picks = rng.choice(
            n, size=int(rng.integers(1, max(2, n // 100))), replace=False
        )
        x[picks] = rng.choice([np.inf, -np.inf], size=picks.size)
    elif kind == "one_nan":
        x = rng.normal(size=n)
        x[rng.integers(n)] = np.nan
    else:  # constant
        x = np.full(n, rng.normal() * 100)
    x = x.reshape(shape)
    if dtype == "int32":
        return x.astype(np.int32)
    return np.asarray(jnp.asarray(np.asarray(x, np.float32), DTYPES[dtype]))


def bin_share(v, x):
    """How many of the values ``v`` share with ``x`` the emptier of the two
    histogram bins holding it, as docs/reducers.md
    describes them: 1,024 equal bins between the smallest and largest finite
    value, and 1,024 equal in ``sign(x) log(1 + |x| / s)``, ``s`` the smallest
    nonzero magnitude; zeros and infinities are counted apart (share 0)."""
    finite = v[np.isfinite(v)]
    binned = finite[finite != 0]
    if not math.isfinite(x) or x == 0 or binned.size == 0:
        return 0
    s = float(np.min(np.abs(binned)))

    def forward(y):
        return np.sign(y) * np.log1p(np.abs(y) / s)

    counts = []
    for f in (lambda y: y, forward):
        lo, hi = f(finite.min()), f(finite.max())
        width = (hi - lo) / 1024 if hi > lo else 1.0
        index = np.clip(np.floor((f(binned) - lo) / width), 0, 1023)
        mine = np.clip(np.floor((f(x) - lo) / width), 0, 1023)
        counts.append(int(np.sum(index == mine)))
    return min(counts)


def check_rank_quantile(got, values, q, what):
    """``got`` lies between NumPy's order statistics at ranks within 1% of
    ``q``'s, or within the share of values in the bin holding the quantile
    where more (ties: docs/reducers.md), rounded to float32 at most; NaN
    where a value is NaN."""
    v = np.sort(np.ravel(values).astype(np.float64))
    got = float(got)
    if np.isnan(v).any():
        assert math.isnan(got), (what, q, got)
        return
    n = v.size
    rank = q * (n - 1)
    slack = max(0.01 * n, bin_share(v, linear_quantile(v, q)) + 1)
    low = v[max(0, math.floor(rank - slack))]
    high = v[min(n - 1, math.ceil(rank + slack))]
    pad = 4 * EPS  # float32 rounding of the estimate
    low = low - pad * abs(low) if math.isfinite(low) else low
    high = high + pad * abs(high) if math.isfinite(high) else high
    assert low <= got <= high, (what, q, got, low, high, slack / n)


def linear_quantile(values, q):
    """NumPy's default (linear) rule in float64; between a finite value and
    an infinity, the infinity, and at an exact rank the value there
    (``np.quantile`` gives NaN next to an infinity: inf * 0 in its
    interpolation)."""
    v = np.sort(np.asarray(values, np.float64))
    if np.isnan(v).any():
        return math.nan
    rank = q * (v.size - 1)
    v0, v1 = v[math.floor(rank)], v[math.ceil(rank)]
    frac = rank - math.floor(rank)
    if frac == 0 or v0 == v1 or math.isinf(v0):
        return float(v0)
    if math.isinf(v1):
        return float(v1)
    return float(v0 + frac * (v1 - v0))


def check_histogram(got, values, bins, range_, log, what):
    """NumPy's counts, up to the values whose place lies within float32
    rounding of a bin edge (they may fall either side); a value exactly on
    an edge of exactly representable edges is in NumPy's bin."""
    v = np.ravel(values).astype(np.float64)
    v = v[~np.isnan(v)]
    lo, hi = range_
    if log:
        edges = np.geomspace(lo, hi, bins + 1)
        with np.errstate(all="ignore"):
            t = np.log(np.where(v > 0, v, np.nan))
        t_lo, t_hi = math.log(lo), math.log(hi)
    else:
        edges = np.linspace(lo, hi, bins + 1)
        t, t_lo, t_hi = v, lo, hi
    want, _ = np.histogram(v, edges)
    with np.errstate(all="ignore"):
        place = (t - t_lo) * bins / (t_hi - t_lo)
        err = 8 * EPS * (np.abs(t) + abs(t_lo) + 1) * bins / (t_hi - t_lo)
        off = np.abs(place - np.round(place))
    exact = np.isin(v, edges) if not log else np.zeros(v.shape, bool)
    near = int(np.sum((off <= err) & ~exact))
    got = np.asarray(got, np.float64)
    assert np.abs(got - want).sum() <= 2 * near, (what, got.tolist(), want.tolist())
    assert abs(got.sum() - want.sum()) <= near, (what, got.sum(), want.sum())


_Q_FNS = {}


def quantile_fns(dtype):
    if dtype not in _Q_FNS:
        hists = HISTOGRAMS[dtype]
        _Q_FNS[dtype] = (
            jax.jit(lambda t: jh.distributed_stats(t, quantiles=QS)),
            jax.jit(lambda x: [jh.histogram(x, b, r, log=g) for b, r, g in hists]),
        )
    return _Q_FNS[dtype]


def run_quantile_layout(index, draws):
    mesh_shape, shape, spec, per_spec, dtype = Q_LAYOUTS[index]
    names = ("a", "b")[: len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(100 + index)
    kinds = Q_KINDS["int32" if dtype == "int32" else "float"]
    stats_fn, hist_fn = quantile_fns(dtype)
    for draw in range(draws):
        kind = kinds[(draw + index) % len(kinds)]
        large = draw_large(rng, shape, dtype, kind)
        per = draw_large(rng, (8,), dtype, str(rng.choice(kinds)))
        what = f"layout={index} draw={draw} {dtype} {kind}"
        tree = {
            "large": jax.device_put(jnp.asarray(large), NamedSharding(mesh, spec)),
            "per": jax.device_put(jnp.asarray(per), NamedSharding(mesh, per_spec)),
        }
        out = stats_fn(tree)
        per64 = per.astype(np.float32).astype(np.float64)
        exact = [linear_quantile(per64, q) for q in QS]
        top = float(np.max(np.abs(per64[np.isfinite(per64)]), initial=0.0))
        for q, name, want in zip(QS, Q_NAMES, exact, strict=True):
            check_rank_quantile(out[f"large/{name}"], large, q, what)
            if kind == "labels" and dtype == "int32":  # NumPy's exactly
                want_exact = linear_quantile(large.ravel(), q)
                assert float(out[f"large/{name}"]) == want_exact, (
                    what,
                    q,
                    float(out[f"large/{name}"]),
                )
            # one value per device: NumPy's linear rule, in float32
            close(out[f"per/{name}"], want, 4 * EPS * top, (what, "per", name))
        counts = hist_fn(tree["large"])
        for (bins, range_, log), got in zip(HISTOGRAMS[dtype], counts, strict=True):
            check_histogram(got, large, bins, range_, log, what)


@pytest.mark.parametrize("layout", range(len(Q_LAYOUTS)))
def test_quantiles_and_histograms_agree_with_numpy(layout):
    run_quantile_layout(layout, draws=8)
