"""Hostile names, damaged files and values that cannot be stored: a clear error
at the call that received them, or an exact round trip; nothing recorded lost."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory import MetricBuffer, export

# ----- names that collide with the dataset's own -------------------------------


def hostile_state():
    s = jh.HistoryState()
    long = "m" * 250
    s = s.update({"_recorded": 1.0, "_metric": 2.0, "x": np.arange(2.0)}, step=0)
    s = s.update({"x_dim_0": 3.0, long: 4.0, f"{long}/w": np.ones(3)}, step=1)
    s = s.update({"_recorded": math.nan, "x_dim_0": 5.0}, step=3)  # gaps and NaN
    return s


def assert_same(a, b):
    assert sorted(a.keys) == sorted(b.keys)
    for name in a.keys:
        assert a.steps(name).tolist() == b.steps(name).tolist(), name
        np.testing.assert_array_equal(a.values(name), b.values(name), err_msg=name)
        assert a.values(name).dtype == b.values(name).dtype, name


def test_names_the_dataset_uses_round_trip_through_xarray():
    s = hostile_state()
    assert_same(s, jh.HistoryState.from_xarray(s.to_xarray()))


def test_names_the_dataset_uses_round_trip_through_netcdf(tmp_path):
    s = hostile_state()
    export.to_netcdf(s, tmp_path / "d.nc")
    back = jh.HistoryState.from_netcdf(tmp_path / "d.nc")
    assert_same(s, back)
    names = set(export.read_netcdf(tmp_path / "d.nc").data_vars)
    assert "m" * 250 in names and "_recorded" in names


# ----- damaged JSONL logs --------------------------------------------------------


def test_damaged_jsonl_lines_are_skipped_exactly(tmp_path):
    good = b'{"step": 0, "metrics": {"a": 1.0}}\n'
    lines = [
        b"\xef\xbb\xbf" + good,  # a byte order mark on the first line
        b"\x00\x9f\xff garbage \xfe\n",  # binary
        b'{"step": 1, "metrics": {"a": "\xff\xfe"}}\n',  # invalid UTF-8
        '{"step": 2, "metrics": {"\u00e9": 1.0}}\n'.encode()[:-8] + b"\n",
        b'{"step": 9223372036854775808, "metrics": {"a": 3.0}}\n',  # 2**63
        b'{"step": 5, "metrics": {"a": 5.0}}\n',
        "{\"step\": 6, \"metrics\": {\"\u00e9\": 6.0}}".encode()[:-3],  # cut, last
    ]
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.warns(RuntimeWarning, match=r"skipped 5 .*line 2, 3, 4, 5, 7\)"):
        s = export.from_jsonl(path)
    assert s.steps("a").tolist() == [0, 5]
    assert s.values("a").tolist() == [1.0, 5.0]


# ----- values that cannot be stored -----------------------------------------------


@pytest.mark.parametrize(
    "reduce",
    [jh.reduce_mean, jh.reduce_sum, jh.reduce_max, jh.distributed_stats],
)
def test_reducers_refuse_a_none_leaf(reduce):
    with pytest.raises(TypeError, match="metric 'bad' is None"):
        reduce({"bad": None, "ok": jnp.ones(3)})


def test_collective_reducers_refuse_a_none_leaf(mesh):
    from jax.sharding import PartitionSpec as P

    f = jax.shard_map(
        lambda v: jh.reduce_mean_collective({"x": v, "n": {"bad": None}}, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    with pytest.raises(TypeError, match="metric 'n/bad' is None"):
        jax.jit(f)(jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("data"))))


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
