"""MetricBuffer: an on-device ring buffer written inside scan / fori_loop, and the
values it refuses."""

import doctest
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory._buffer
from jaxhistory._buffer import MetricBuffer


def _loss(step):
    return 1.0 / (1.0 + step.astype(jnp.float32))


@jax.jit
def _scan_chunk(buf, first_step):
    def inner(buf, i):
        step = first_step + i
        metrics = {"train": {"loss": _loss(step), "n": step * 2}}
        return buf.write(step, metrics), None

    buf, _ = jax.lax.scan(inner, buf, jnp.arange(100))
    return buf


def _example():
    return {"train": {"loss": jnp.float32(0), "n": jnp.int32(0)}}


def test_create():
    example = {
        "train": {"loss": 0.0, "hist": np.zeros((3, 2), np.float32)},
        "eval": [jnp.int32(0), jax.ShapeDtypeStruct((4,), jnp.float32)],
        "ok": True,
    }
    buf = MetricBuffer.create(5, example)
    assert buf.capacity == 5
    assert buf.steps.dtype == jnp.int32 and buf.steps.shape == (5,)
    np.testing.assert_array_equal(buf.steps, -np.ones(5))
    assert buf.count.dtype == jnp.int32 and buf.count.shape == ()
    assert int(buf.count) == 0
    shapes = {k: (v.shape, v.dtype) for k, v in buf.values.items()}
    assert shapes == {
        "train/loss": ((5,), jnp.float32),
        "train/hist": ((5, 3, 2), jnp.float32),
        "eval/0": ((5,), jnp.int32),
        "eval/1": ((5, 4), jnp.float32),
        "ok": ((5,), jnp.bool_),
    }
    # A pytree: steps, count and one array per metric, nothing else.
    assert len(jax.tree.leaves(buf)) == 2 + 5
    assert buf.dropped == 0
    steps, values = buf.to_host()
    assert steps.dtype == np.int64 and steps.shape == (0,)
    assert {k: v.shape for k, v in values.items()} == {
        "train/loss": (0,),
        "train/hist": (0, 3, 2),
        "eval/0": (0,),
        "eval/1": (0, 4),
        "ok": (0,),
    }


@pytest.mark.parametrize("capacity", [128, 100])
def test_scan_all_kept(capacity):
    buf = _scan_chunk(MetricBuffer.create(capacity, _example()), 7)
    steps, values = buf.to_host()
    want = np.arange(7, 107)
    assert isinstance(steps, np.ndarray) and steps.dtype == np.int64
    np.testing.assert_array_equal(steps, want)
    assert all(isinstance(v, np.ndarray) for v in values.values())
    np.testing.assert_allclose(values["train/loss"], 1.0 / (1.0 + want), rtol=1e-6)
    np.testing.assert_array_equal(values["train/n"], want * 2)
    assert values["train/n"].dtype == np.int32
    assert buf.dropped == 0
    assert int(buf.count) == 100
    # Unused slots stay empty.
    np.testing.assert_array_equal(np.asarray(buf.steps)[100:], -1)


def test_scan_wraps_around():
    buf = _scan_chunk(MetricBuffer.create(32, _example()), 0)
    steps, values = buf.to_host()
    want = np.arange(68, 100)  # the 32 newest, oldest first
    np.testing.assert_array_equal(steps, want)
    np.testing.assert_allclose(values["train/loss"], 1.0 / (1.0 + want), rtol=1e-6)
    np.testing.assert_array_equal(values["train/n"], want * 2)
    assert buf.dropped == 68
    assert int(buf.count) == 100
    # Also readable from a buffer fetched once.
    assert jax.device_get(buf).dropped == 68


def test_wrap_exactly_full_and_one_over():
    buf = MetricBuffer.create(3, {"x": 0})
    for step in range(3):
        buf = buf.write(step, {"x": step * 10})
    steps, values = buf.to_host()
    np.testing.assert_array_equal(steps, [0, 1, 2])
    assert buf.dropped == 0
    buf = buf.write(3, {"x": 30})
    steps, values = buf.to_host()
    np.testing.assert_array_equal(steps, [1, 2, 3])
    np.testing.assert_array_equal(values["x"], [10, 20, 30])
    assert buf.dropped == 1


def test_fori_loop():
    @jax.jit
    def run(buf):
        def body(i, buf):
            return buf.write(i, {"loss": i * 0.5, "grad": jnp.full((2,), i)})

        return jax.lax.fori_loop(0, 10, body, buf)

    example = {"loss": jnp.float32(0), "grad": jnp.zeros((2,), jnp.float32)}
    buf = run(MetricBuffer.create(16, example))
    steps, values = buf.to_host()
    np.testing.assert_array_equal(steps, np.arange(10))
    np.testing.assert_array_equal(values["loss"], np.arange(10) * 0.5)
    np.testing.assert_array_equal(
        values["grad"], np.repeat(np.arange(10), 2).reshape(10, 2)
    )


def test_reset_and_reuse():
    buf = _scan_chunk(MetricBuffer.create(32, _example()), 0)
    empty = buf.reset()
    assert int(empty.count) == 0
    np.testing.assert_array_equal(empty.steps, -np.ones(32))
    steps, values = empty.to_host()
    assert steps.shape == (0,) and values["train/loss"].shape == (0,)
    assert empty.dropped == 0
    # The original is unchanged (reset is pure).
    assert int(buf.count) == 100

    # Reset inside jit between chunks, with the buffer donated.
    step_fn = jax.jit(lambda b, s: _scan_chunk(b.reset(), s), donate_argnums=0)
    buf = MetricBuffer.create(128, _example())
    buf = step_fn(buf, 0)
    buf = step_fn(buf, 100)
    steps, values = buf.to_host()
    np.testing.assert_array_equal(steps, np.arange(100, 200))
    np.testing.assert_array_equal(values["train/n"], np.arange(100, 200) * 2)


def test_dtypes():
    example = {
        "i": jnp.int32(0),
        "f": jnp.float32(0),
        "bf": jnp.zeros((), jnp.bfloat16),
        "h": np.float16(0),
        "b": False,
    }
    buf = MetricBuffer.create(4, example)
    dtypes = {k: v.dtype for k, v in buf.values.items()}
    assert dtypes == {
        "i": jnp.int32,
        "f": jnp.float32,
        "bf": jnp.float32,
        "h": jnp.float32,
        "b": jnp.bool_,
    }

    @jax.jit
    def run(buf):
        def body(buf, i):
            metrics = {
                "i": i,
                "f": i * 0.25,
                "bf": (i * 0.5).astype(jnp.bfloat16),
                "h": (i * 0.5).astype(jnp.float16),
                "b": i % 2 == 1,
            }
            return buf.write(i, metrics), None

        return jax.lax.scan(body, buf, jnp.arange(3))[0]

    _, values = run(buf).to_host()
    np.testing.assert_array_equal(values["i"], [0, 1, 2])
    np.testing.assert_array_equal(values["f"], [0, 0.25, 0.5])
    np.testing.assert_array_equal(values["bf"], [0, 0.5, 1.0])
    np.testing.assert_array_equal(values["h"], [0, 0.5, 1.0])
    np.testing.assert_array_equal(values["b"], [False, True, False])
    assert values["bf"].dtype == np.float32 and values["h"].dtype == np.float32
    assert values["i"].dtype == np.int32 and values["b"].dtype == np.bool_


def test_float_into_int_metric_raises():
    buf = MetricBuffer.create(4, {"n": 0})
    with pytest.raises(TypeError, match="'n'"):
        buf.write(0, {"n": 1.5})


@pytest.mark.parametrize("sharded_slots", [True, False])
def test_sharded_per_device_metric(mesh, sharded_slots):
    sharding = NamedSharding(mesh, P("data"))
    per_device = jax.device_put(jnp.zeros(8, jnp.float32), sharding)
    example = {"per_device": per_device if sharded_slots else np.zeros(8, np.float32)}
    buf = MetricBuffer.create(16, example)
    if sharded_slots:
        assert buf.values["per_device"].sharding.spec == P(None, "data")

    @jax.jit
    def run(buf, x):
        def body(buf, i):
            return buf.write(i, {"per_device": x * i}), None

        return jax.lax.scan(body, buf, jnp.arange(20))[0]

    x = jax.device_put(jnp.arange(8, dtype=jnp.float32), sharding)
    buf = run(buf, x)
    if sharded_slots:  # writing kept the slots' sharding
        assert buf.values["per_device"].sharding.spec == P(None, "data")
    steps, values = buf.to_host()
    np.testing.assert_array_equal(steps, np.arange(4, 20))
    want = np.arange(4, 20)[:, None] * np.arange(8)[None, :]
    np.testing.assert_array_equal(values["per_device"], want)
    assert buf.dropped == 4
    # Eager writes of replicated and sharded values work too.
    buf = buf.write(20, {"per_device": np.ones(8, np.float32)}).write(
        21, {"per_device": x}
    )
    steps, values = buf.to_host()
    np.testing.assert_array_equal(steps[-2:], [20, 21])
    np.testing.assert_array_equal(values["per_device"][-2:], [np.ones(8), np.arange(8)])


def test_to_host_is_one_transfer():
    buf = _scan_chunk(MetricBuffer.create(32, _example()), 0)
    with mock.patch.object(jax, "device_get", wraps=jax.device_get) as get:
        steps, values = buf.to_host()
    assert get.call_count == 1
    (arg,), _ = get.call_args
    assert arg is buf  # the whole buffer at once
    assert len(steps) == 32 and set(values) == {"train/loss", "train/n"}


@pytest.mark.parametrize(
    "leaf, match",
    [
        ("abc", "'train/bad'"),
        (object(), "'train/bad'"),
        (jnp.complex64(1j), "'train/bad'"),
        (np.array(["a"]), "'train/bad'"),
    ],
)
def test_non_numeric_example_raises(leaf, match):
    with pytest.raises(TypeError, match=match):
        MetricBuffer.create(4, {"train": {"ok": 0.0, "bad": leaf}})


@pytest.mark.parametrize(
    "capacity, error",
    [
        (0, ValueError),
        (-3, ValueError),
        (2.0, TypeError),
        (True, TypeError),
        ("8", TypeError),
    ],
)
def test_bad_capacity_raises(capacity, error):
    with pytest.raises(error, match="capacity"):
        MetricBuffer.create(capacity, {"loss": 0.0})


def test_numpy_int_capacity():
    assert MetricBuffer.create(np.int64(4), {"loss": 0.0}).capacity == 4


def test_duplicate_names_raise():
    with pytest.raises(ValueError, match="'a/b'"):
        MetricBuffer.create(4, {"a/b": 0.0, "a": {"b": 1.0}})


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "metrics, error, match",
    [
        ({"train": {"loss": 1.0}}, ValueError, "train/n"),  # missing
        ({"train": {"loss": 1.0, "n": 1, "acc": 0.5}}, ValueError, "train/acc"),
        ({"train": {"loss": jnp.ones(3), "n": 1}}, ValueError, "train/loss"),
        ({"train": {"loss": 1.0, "n": "x"}}, TypeError, "train/n"),
    ],
)
def test_bad_write_raises(jit, metrics, error, match):
    buf = MetricBuffer.create(4, _example())
    write = (
        jax.jit(lambda b: b.write(0, metrics))
        if jit
        else (lambda b: b.write(0, metrics))
    )
    with pytest.raises(error, match=match):
        write(buf)


@pytest.mark.parametrize("step", [1.5, jnp.arange(2)])
def test_bad_step_raises(step):
    with pytest.raises(TypeError, match="step"):
        MetricBuffer.create(4, {"x": 0.0}).write(step, {"x": 1.0})


def test_docstring_examples_run():
    result = doctest.testmod(jaxhistory._buffer, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----- values that cannot be stored -------------------------------------------------


def test_metric_buffer_refuses_none_and_values_it_would_wrap():
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        MetricBuffer.create(4, {"bad": None, "ok": 0.0})
    buf = MetricBuffer.create(4, {"loss": 0.0, "n": np.int32(0)})
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        buf.write(0, {"loss": 1.0, "n": 1, "bad": None})
    for step in (np.int64(2**31 + 5), jnp.uint32(3_000_000_000), -1, 2**40):
        with pytest.raises(ValueError, match="does not fit the buffer's int32 steps"):
            buf.write(step, {"loss": 1.0, "n": 1})
    for n in (np.int64(2**40), 2**40, np.uint32(3_000_000_000)):
        with pytest.raises(ValueError, match="metric 'n'"):
            buf.write(0, {"loss": 1.0, "n": n})
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1"):
        MetricBuffer.create(2**40, {"loss": 0.0})

    @jax.jit
    def traced(buf, step):
        return buf.write(step, {"loss": 1.0, "n": 1})

    with pytest.raises(TypeError, match="traced step of dtype uint32"):
        traced(buf, jnp.uint32(3))
    # Nothing was written by the refused calls; a good write still works.
    buf = traced(buf, jnp.int32(7))
    steps, values = buf.to_host()
    assert steps.tolist() == [7] and values["n"].tolist() == [1]


def test_extending_from_a_buffer_that_overwrote_entries_warns_how_many():
    """Finding: a scan writing 10 steps into a buffer of capacity 4 lost 6
    steps, and extend_from_buffer recorded steps 6-9 without a word (even
    under -W always)."""
    import warnings

    import jaxhistory as jh

    buf = MetricBuffer.create(4, {"x": 0.0})
    for step in range(10):
        buf = buf.write(step, {"x": float(step)})
    with pytest.warns(RuntimeWarning, match=r"capacity 4 .* 6 oldest .* steps 6 to 9"):
        state = jh.HistoryState().extend_from_buffer(buf)
    assert state.steps("x").tolist() == [6, 7, 8, 9]
    full = MetricBuffer.create(4, {"x": 0.0})
    for step in range(4):
        full = full.write(step, {"x": float(step)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jh.HistoryState().extend_from_buffer(full).count("x") == 4


def test_a_step_written_twice_names_the_step_and_records_nothing():
    import jaxhistory as jh

    buf = MetricBuffer.create(4, {"loss": 0.0})
    for step in (0, 1, 1, 2):
        buf = buf.write(step, {"loss": float(step)})
    state = jh.HistoryState().update({"loss": -1.0}, step=-5)
    with pytest.raises(
        ValueError, match=r"step 1 \(at index 1\) is followed by 1.*'loss'"
    ):
        state.extend_from_buffer(buf)
    assert state.count("loss") == 1


def test_a_stats_value_in_a_buffer_keeps_its_names(mesh):
    """Finding: distributed_stats written into a MetricBuffer came back as
    one anonymous (steps, 4, 1) array 'st/0'; History.update records the same
    value as st/l/mean, st/l/max, ... It is now taken as the mapping it is."""
    import jaxhistory as jh

    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P(mesh.axis_names[0])))

    def stats(i):
        return {"st": jh.distributed_stats({"l": jh.per_shard(x * i, num_shards=8)})}

    buf = MetricBuffer.create(8, stats(0))

    @jax.jit
    def run(buf):
        def body(b, i):
            return b.write(i, stats(i)), None

        return jax.lax.scan(body, buf, jnp.arange(3))[0]

    state = jh.HistoryState().extend_from_buffer(run(buf))
    assert state.keys == ("st/l/max", "st/l/mean", "st/l/min", "st/l/std")
    shards = np.arange(16.0).reshape(8, 2).mean(axis=1)
    for i in range(3):
        np.testing.assert_allclose(state.values("st/l/mean")[i], shards.mean() * i)
        np.testing.assert_allclose(state.values("st/l/max")[i], shards.max() * i)
