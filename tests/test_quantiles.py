"""histogram: counts over fixed bins across devices, against NumPy on 8 devices
and under shard_map; History records it as an array metric."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh


@pytest.mark.parametrize("spec", [P("data"), P(None, "model"), P("data", "model"), P()])
def test_histogram_matches_numpy_on_any_sharding(mesh2d, spec):
    values = np.random.default_rng(0).normal(size=(8, 1000)).astype(np.float32)
    values[0, :3] = [np.nan, 10.0, -10.0]  # left out: NaN and outside the range
    values[1, 0] = 3.0  # the high edge: in the last bin, as NumPy counts it
    x = jax.device_put(values, NamedSharding(mesh2d, spec))
    fn = jax.jit(lambda v: jh.histogram(v, 30, (-3, 3)))
    want, _ = np.histogram(values[~np.isnan(values)], 30, (-3, 3))
    np.testing.assert_array_equal(np.asarray(fn(x)), want)
    counts = jh.collective_counts(lambda v: jh.histogram(v, 30, (-3, 3)), x)
    assert sum(counts.values()) == (0 if spec == P() else 1), counts


def test_log_spaced_bins_match_numpy_on_geometric_edges(mesh):
    values = np.random.default_rng(1).lognormal(0, 2, size=8000).astype(np.float32)
    x = jax.device_put(values, NamedSharding(mesh, P("data")))
    got = jax.jit(lambda v: jh.histogram(v, 20, (1e-2, 1e2), log=True))(x)
    edges = np.geomspace(1e-2, 1e2, 21)
    want, _ = np.histogram(values, edges)
    # a value on an edge may fall either side of it in float32 logs
    assert np.abs(np.asarray(got) - want).sum() <= 2 and got.sum() == want.sum()


def test_the_shard_map_form_adds_the_blocks_in_one_psum(mesh):
    values = np.arange(8 * 50, dtype=np.float32).reshape(8, 50)
    fn = jax.jit(
        jax.shard_map(
            lambda v: jh.collective.histogram(v, "data", 8, (0, 400)),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
    )
    x = jax.device_put(values, NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(np.asarray(fn(x)), [50.0] * 8)
    assert jh.collective_counts(fn, x) == {"all-reduce": 1}


def test_history_records_a_histogram_as_an_array_metric_and_draws_it(tmp_path):
    h = jh.History(distributed_history=False)
    rng = np.random.default_rng(2)
    fn = jax.jit(lambda v: jh.histogram(v, 16, (-4, 4)))
    for s in range(20):
        h.update({"act": fn(jnp.asarray(rng.normal(size=500) * (1 + s / 10)))}, step=s)
    assert h.state.shape("act") == (16,) and h.state.values("act").sum() > 0
    h.finalize(tmp_path)
    mplot = tmp_path / "plots" / "mplot"
    assert (mplot / "act.heatmap.png").is_file() and (mplot / "act.png").is_file()


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"bins": 0}, ValueError, "bins"),
        ({"bins": 2.5}, ValueError, "bins"),
        ({"range": (1, 1)}, ValueError, "low below high"),
        ({"range": (0, float("inf"))}, ValueError, "finite"),
        ({"range": 3}, ValueError, "range"),
        ({"range": (0, 1), "log": True}, ValueError, "above 0"),
        ({"log": "yes"}, TypeError, "log"),
    ],
)
def test_bad_histogram_arguments_are_refused_naming_them(kw, error, match):
    with pytest.raises(error, match=match):
        jh.histogram(jnp.ones(4), **kw)


# More than 2**24 values in one bin on one device: float32 counts stop growing
# there (16,777,216 + 1 rounds back), so counts are kept as integers until the
# all-reduce.
BIG = 2**24 + 3_000_000


def test_a_bin_past_two_to_the_24_counts_every_value():
    x = jnp.ones(BIG, jnp.float32)
    counts = jax.jit(lambda x: jh.histogram(x, 2, (0.0, 2.0)))(x)
    assert counts.tolist() == [0.0, float(BIG)]
    log = jax.jit(lambda x: jh.histogram(x, 2, (0.5, 2.0), log=True))(x)
    assert log.tolist() == [0.0, float(BIG)]


def test_quantiles_of_a_leaf_past_two_to_the_24_in_one_bin():
    # BIG ones then 2,000,000 twos: p90 sits among the ones (rank 0.9 of
    # 21.8 M is 19.6 M); with the ones' bin stuck at 16.8 M it read 2.0
    twos = 2_000_000
    x = jnp.concatenate([jnp.ones(BIG, jnp.float32), jnp.full(twos, 2.0)])
    got = jax.jit(lambda x: jh.distributed_stats({"x": x}, quantiles=(0.9, 0.95)))(x)
    assert float(got["x/p90"]) == pytest.approx(1.0, abs=1e-3)
    assert float(got["x/p95"]) == pytest.approx(2.0, abs=1e-3)


def test_a_histogram_of_an_empty_array_is_all_zeros(mesh):
    spread = NamedSharding(mesh, P("data"))
    for x in (jnp.zeros((8, 0)), jax.device_put(np.zeros((8, 0), np.float32), spread)):
        counts = jax.jit(lambda x: jh.histogram(x, 4, (0.0, 1.0)))(x)
        assert counts.tolist() == [0.0] * 4


def test_a_numpy_int_is_a_number_of_bins():
    """np.int64(4), as a NumPy computation gives it, was refused as 'not a
    positive int'."""
    x = jnp.arange(4.0)
    assert jh.histogram(x, np.int64(4), (0, 4)).tolist() == [1.0] * 4
    assert jh.histogram(x, np.int32(2), (0, 4)).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="bins"):
        jh.histogram(x, np.bool_(True), (0, 4))


def test_a_range_spanning_past_the_float32_maximum_counts_like_numpy():
    """A range wider than about 8.5e37 put every value in bin 0: the bin
    index was divided by the width, whose reciprocal is below float32's
    smallest normal number (read as 0), or which overflowed ((-3e38, 3e38):
    [5, 0, 0, 0] where NumPy gives [1, 1, 2, 1]; (-5e37, 5e37) too). A range
    past float32's values is refused."""
    x = np.array([-2e38, -1e38, 0, 1e38, 2e38], np.float32)
    got = jax.jit(lambda v: jh.histogram(v, 4, (-3e38, 3e38)))(x)
    want = np.histogram(x.astype(np.float64), 4, (-3e38, 3e38))[0]
    assert got.tolist() == want.tolist()
    with pytest.raises(ValueError, match="float32"):
        jh.histogram(jnp.asarray(x), 4, (-1e300, 1e300))

    y = np.array([-0.9e38, -0.4e38, 0, 0.4e38, 0.9e38], np.float32)
    got = jax.jit(lambda v: jh.histogram(v, 4, (-5e37, 5e37)))(y)
    assert (
        got.tolist() == np.histogram(y.astype(np.float64), 4, (-5e37, 5e37))[0].tolist()
    )


def test_a_quantile_near_0_or_1_is_named_as_it_is():
    """Names had 10 significant digits: 0.99999999999 was named p100, as if it
    were the max. Each name now keeps the digits that keep it inside (0,
    100)."""
    x = jnp.arange(1000.0)
    stats = jh.distributed_stats({"x": x}, quantiles=(0.5, 0.999, 0.99999999999))
    rows = stats.rows
    assert {"p50", "p99.9", "p99.999999999"} <= set(rows), rows
    assert "p100" not in rows


def _compiles(fn) -> int:
    """How many XLA programs ``fn()`` compiles."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def test_outside_jit_a_second_call_compiles_nothing(mesh):
    """Called outside jit on sharded arrays, histogram, watch and
    distributed_stats with quantiles compiled their shard_map again at every
    call (2 s, 0.4 s and 44 s a call here, every call): each is now one
    cached jitted program per structure, with the values of the jitted
    call."""
    x = jax.device_put(
        np.random.default_rng(0).normal(size=(1024,)).astype(np.float32),
        NamedSharding(mesh, P("data")),
    )
    y = x * 2
    calls = {
        "histogram": lambda v: jh.histogram(v, 16, (-4, 4)),
        "watch": lambda v: jh.watch({"a": v, "b": v}, stats=("norm", "max_abs")),
        "quantiles": lambda v: (
            jh.distributed_stats({"x": v}, provenance=False, quantiles=(0.5, 0.9)).table
        ),
    }
    for name, call in calls.items():
        first = call(x)
        assert _compiles(lambda call=call: call(y)) == 0, name
        jitted = jax.jit(call)(y)
        np.testing.assert_allclose(
            np.asarray(jax.tree.leaves(call(y))[0]),
            np.asarray(jax.tree.leaves(jitted)[0]),
            rtol=1e-6,
            err_msg=name,
        )
        assert jax.tree.structure(first) == jax.tree.structure(jitted), name


def test_quantiles_of_values_spanning_past_8e37_are_not_the_minimum(mesh):
    """Values spread over more than about 8.5e37 (uniform in +-1e38) read
    every quantile as about their minimum (-1e38 for p10, p50 and p90): the
    histogram's bin index divided by half the range, which XLA turns into a
    product by its reciprocal, below float32's smallest normal number (read
    as 0 on CPU), so every value fell in the first bin."""
    rng = np.random.default_rng(4)
    qs = (0.1, 0.5, 0.9)
    for scale in (1e38, 3e38):
        values = (rng.uniform(-1, 1, size=(8, 1024)) * scale).astype(np.float32)
        want = np.quantile(values.astype(np.float64), qs)
        for x in (
            jnp.asarray(values),
            jax.device_put(values, NamedSharding(mesh, P("data"))),
        ):
            got = jax.jit(lambda v: jh.distributed_stats({"x": v}, quantiles=qs))(x)
            for q, w in zip(("p10", "p50", "p90"), want, strict=True):
                # within 1% of the range: the rank within 1% (uniform values)
                assert abs(float(got[f"x/{q}"]) - w) <= 0.01 * scale, (scale, q)
