"""provenance=True: which device holds each max, min and NaN, in two collectives."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import export


def put(mesh, values, spec=P("data")):
    return jax.device_put(np.asarray(values, np.float32), NamedSharding(mesh, spec))


def spmd(mesh):
    def fn(metrics):
        return jh.distributed_stats(metrics, provenance=True, mesh=mesh)

    return fn


def collective(mesh, axes="data", spec=P("data")):
    return jax.shard_map(
        lambda m: jh.collective.distributed_stats(
            jax.tree.map(lambda v: v[0], m), axes, provenance=True, mesh=mesh
        ),
        mesh=mesh,
        in_specs=spec,
        out_specs=P(),
        check_vma=True,
    )


def device_of(mesh, spec=P("data"), shape=(8,)):
    """Global device index holding each element (lowest of its holders)."""
    index = {d.id: i for i, d in enumerate(jax.devices())}
    owner = np.full(shape, 10**6)
    for d, sl in NamedSharding(mesh, spec).devices_indices_map(shape).items():
        owner[sl] = np.minimum(owner[sl], index[d.id])
    return owner


def reference(values, owner):
    """argmax, argmin, nan_device by brute force (lowest device on ties)."""
    v = np.asarray(values, np.float64).reshape(-1)
    o = owner.reshape(-1)
    nan = np.isnan(v)
    if nan.any():
        first = int(o[nan].min())
        return first, first, first
    return int(o[v == v.max()].min()), int(o[v == v.min()].min()), -1


@pytest.mark.parametrize("family", ["spmd", "collective"])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_exact_indices_with_ties_in_two_collectives(family, k, mesh):
    rng = np.random.default_rng(k)
    # Few distinct values: many ties across devices.
    data = {f"m{i}": rng.integers(0, 3, size=8).astype(np.float32) for i in range(k)}
    data["m0"][[2, 5]] = 9.0  # a tie for the max: device 2 wins
    metrics = {n: put(mesh, v) for n, v in data.items()}
    fn = spmd(mesh) if family == "spmd" else collective(mesh)
    assert sum(jh.collective_counts(fn, metrics).values()) <= 2
    out = jax.jit(fn)(metrics)
    assert len(out) == 7 * k and out.where.dtype == jnp.int32
    owner = device_of(mesh)
    for name, values in data.items():
        want = reference(values, owner)
        got = tuple(int(out[f"{name}/{s}"]) for s in jh.PROVENANCE)
        assert got == want, name
        assert float(out[f"{name}/max"]) == values.max()
    assert int(out["m0/argmax"]) == 2


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_nan_and_infinities_name_their_devices(family, mesh):
    fn = jax.jit(spmd(mesh) if family == "spmd" else collective(mesh))
    nan = np.arange(8.0)
    nan[[6, 3]] = np.nan
    inf = np.arange(8.0)
    inf[5], inf[1] = np.inf, -np.inf
    out = fn({"nan": put(mesh, nan), "inf": put(mesh, inf)})
    assert [int(out[f"nan/{s}"]) for s in jh.PROVENANCE] == [3, 3, 3]
    assert math.isnan(float(out["nan/max"]))
    assert [int(out[f"inf/{s}"]) for s in jh.PROVENANCE] == [5, 1, -1]


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_indices_follow_jax_devices_order_not_mesh_order(family):
    devices = np.array(jax.devices()[::-1])  # mesh position i is device 7 - i
    mesh = jax.sharding.Mesh(
        devices, ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    values = np.array([5.0, 1, 1, 0, 5, 2, 3, 0], np.float32)
    fn = jax.jit(spmd(mesh) if family == "spmd" else collective(mesh))
    out = fn({"x": put(mesh, values)})
    # max 5 at positions 0 and 4 -> devices 7 and 3: the lowest index wins.
    assert int(out["x/argmax"]) == 3
    assert int(out["x/argmin"]) == 0  # min 0 at positions 3 and 7 -> devices 4, 0


def test_two_dimensional_meshes_and_replicated_axes(mesh2d):
    values = np.array([3.0, 1, 7, 7, 0, 0, 2, 5], np.float32)
    # Sharded over "data" only: each block is held by two devices.
    out = jh.distributed_stats({"x": put(mesh2d, values)}, provenance=True)
    owner = device_of(mesh2d)
    assert tuple(int(out[f"x/{s}"]) for s in jh.PROVENANCE) == reference(values, owner)
    # A reduction over both axes in shard_map: one value per device.
    both = ("data", "model")
    fn = jax.jit(collective(mesh2d, both, P(both)))
    out = fn({"x": put(mesh2d, values, P(both))})
    assert (int(out["x/argmax"]), int(out["x/argmin"])) == (2, 4)
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


def test_many_values_per_device(mesh):
    rng = np.random.default_rng(0)
    values = rng.normal(size=64).astype(np.float32)
    out = jax.jit(spmd(mesh))({"x": put(mesh, values)})
    want = reference(values, device_of(mesh, shape=(64,)))
    assert tuple(int(out[f"x/{s}"]) for s in jh.PROVENANCE) == want
    np.testing.assert_allclose(float(out["x/std"]), values.std(), rtol=1e-5)


def test_bf16_and_unsharded_values(mesh):
    values = np.array([1, 2, 8, 3, 4, 5, 6, 7], np.float32)
    x = jax.device_put(
        jnp.asarray(values, jnp.bfloat16), NamedSharding(mesh, P("data"))
    )
    with jax.set_mesh(mesh):  # the mesh from the context
        out = jax.jit(lambda m: jh.distributed_stats(m, provenance=True))(
            {"x": x, "scalar": jnp.float32(2.0)}
        )
    assert int(out["x/argmax"]) == 2 and int(out["x/argmin"]) == 0
    assert int(out["scalar/argmax"]) == 0  # replicated: the lowest device
    # Without any mesh a plain array is on the default device.
    out = jax.jit(lambda m: jh.distributed_stats(m, provenance=True))(
        {"y": jnp.arange(3.0)}
    )
    assert int(out["y/argmax"]) == 0


def test_stats_with_provenance_is_a_two_leaf_pytree(mesh):
    out = jax.jit(spmd(mesh))({"a": put(mesh, np.arange(8.0))})
    leaves, treedef = jax.tree.flatten(out)
    assert [leaf.shape for leaf in leaves] == [(4, 1), (3, 1)]
    back = jax.tree.unflatten(treedef, leaves)
    assert list(back) == [f"a/{s}" for s in (*jh.STATS, *jh.PROVENANCE)]
    host = jax.device_get(out)
    assert host["a/argmax"] == 7 and len(host) == 7
    plain = jh.distributed_stats({"a": put(mesh, np.arange(8.0))})
    assert plain.where is None and len(plain) == 4


def test_clear_errors_when_devices_cannot_be_named(mesh):
    x = put(mesh, np.arange(8.0))
    # Eager, on concrete arrays: the sharding is known, no mesh needed.
    assert int(jh.distributed_stats({"x": x}, provenance=True)["x/argmax"]) == 7
    with pytest.raises(ValueError, match=r"jax.set_mesh\(mesh\)"):
        jax.jit(lambda m: jh.distributed_stats(m, provenance=True))({"x": x})
    other = jax.make_mesh((4, 2), ("data", "model"))
    with pytest.raises(ValueError, match="mesh= has axes"):
        jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=other))(
            {"x": x}
        )
    auto = jax.sharding.Mesh(jax.devices(), ("data",))  # Auto axes
    y = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(auto, P("data")))
    with pytest.raises(ValueError, match="Auto axes"):
        jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=auto))({"y": y})
    no_mesh = jax.shard_map(
        lambda v: jh.collective.distributed_stats({"x": v[0]}, "data", True),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="distributed_stats_collective"):
        jax.jit(no_mesh)(x)


def nan_loss(mesh, step, start=2):
    values = np.arange(8.0) + step
    if step >= start:
        values[5] = np.nan
    return put(mesh, values)


def test_history_names_the_device_of_a_nan_once(mesh, tmp_path):
    h = jh.History(report_dir=tmp_path, run_name="nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lines = [h.update({"loss": nan_loss(mesh, s, 3), "lr": 0.1}) for s in range(5)]
    assert "loss=nan(NaN on device 5 (process 0))" in lines[3]
    assert "NaN on device 5" in lines[4] and "±" in lines[2]
    mine = [str(w.message) for w in caught if "is NaN" in str(w.message)]
    assert len(mine) == 1, mine  # one warning per metric
    assert mine[0].startswith("step 3: 'loss' is NaN on device 5 (process 0)")
    assert h.state.values("loss/nan_device").tolist() == [-1, -1, -1, 5, 5]
    assert h.state.values("loss/argmax").tolist() == [7, 7, 7, 5, 5]
    h.flush()
    log = export.from_jsonl(h.log_path)
    assert log.values("loss/nan_device").tolist() == [-1, -1, -1, 5, 5]
    ds = h.finalize(tmp_path / "out", plot=False)
    assert ds["loss/nan_device"].values.tolist() == [-1, -1, -1, 5, 5]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- loss: max most often on device 7 (3 of 5 steps)" in report
    assert "first NaN at step 3 on device 5 (2 step(s) with NaN)" in report
    assert "| loss/argmax |" not in report  # not a row of the statistics table


def test_the_writer_warns_when_no_line_is_built(mesh, tmp_path):
    h = jh.History(jsonl_path=tmp_path / "log.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            h.update({"loss": nan_loss(mesh, s)}, summarize=False)
        h.flush()
    assert any("'loss' is NaN on device 5" in str(w.message) for w in caught)


def test_infinite_statistics_name_the_device_of_the_extreme(mesh):
    h = jh.History()
    values = np.arange(8.0)
    values[6] = -np.inf
    with pytest.warns(RuntimeWarning, match="'g' is -inf on device 6"):
        line = h.update({"g": put(mesh, values)})
    assert "g=-inf(-inf on device 6 (process 0))" in line


def test_history_provenance_off(mesh):
    h = jh.History(provenance=False)
    h.update({"loss": put(mesh, np.arange(8.0))})
    assert set(h.state.keys) == {f"loss/{s}" for s in jh.STATS}
    with pytest.warns(RuntimeWarning, match=r"'loss' is NaN; later"):
        line = h.update({"loss": nan_loss(mesh, 3)})
    assert "loss=nan(NaN)" in line  # no device without provenance


@pytest.mark.slow
def test_provenance_is_exact_on_two_processes():
    """2 processes x 2 devices: devices 2 and 3 belong to process 1."""
    results = jh.launch_local("mp_workers:provenance_run", 2, 2, args=(4,))
    for r in results:
        for family in ("spmd", "collective"):
            got = r[family]
            assert (got["x/argmax"], got["x/argmin"], got["x/nan_device"]) == (
                1,
                3,
                -1,
            ), family
            assert got["x/max"] == 9.0 and got["x/min"] == -4.0
        records = r["records"]
        assert records["loss/nan_device"] == [-1, -1, 3, 3]
        assert records["loss/argmax"] == [3, 3, 3, 3]
        # A host scalar: each process's value on its devices; process 1 is larger.
        assert records["host/argmax"] == [2] * 4 and records["host/argmin"] == [0] * 4
        assert "loss=nan(NaN on device 3 (process 1))" in r["lines"][2]
        assert len(r["warnings"]) == 1
        assert r["warnings"][0].startswith(
            "step 2: 'loss' is NaN on device 3 (process 1)"
        )
    where = [k for k in results[0]["records"] if k.rpartition("/")[2] in jh.PROVENANCE]
    assert len(where) == 6
    assert all(results[0]["records"][k] == results[1]["records"][k] for k in where)


@pytest.mark.slow
def test_stragglers_are_named_with_their_lag():
    """3 processes; process 2 sleeps 0.2 s before each update."""
    results = jh.launch_local(
        "mp_workers:straggler_run", 3, 1, args=(8, 2, 0.2), timeout=240
    )
    first = results[0]
    assert {"straggler/process", "straggler/lag"} <= set(first["keys"])
    assert not any(k.startswith("straggler/arrival") for k in first["keys"])
    assert all(r["process"] == first["process"] for r in results)
    later = first["process"][1:]
    assert later.count(2) >= len(later) - 1, first["process"]
    lags = np.asarray(first["lag"][1:])[np.asarray(later) == 2]
    assert np.median(lags) > 0.1, first["lag"]
    assert np.all(lags < 5.0)


def test_in_step_provenance_is_recorded_and_named(mesh, tmp_path):
    step = jax.jit(
        lambda x: {
            "dist": jh.distributed_stats({"loss": x}, provenance=True, mesh=mesh),
            "lr": 0.5,
        }
    )
    h = jh.History(jsonl_path=tmp_path / "log.jsonl")
    h.update(step(nan_loss(mesh, 0)))
    with pytest.warns(RuntimeWarning, match="'dist/loss' is NaN on device 5"):
        line = h.update(step(nan_loss(mesh, 2)))
    assert "dist/loss=nan(NaN on device 5 (process 0))" in line
    assert h.state.values("dist/loss/nan_device").tolist() == [-1, 5]
    h.close()
    log = export.from_jsonl(tmp_path / "log.jsonl")
    assert log.values("dist/loss/argmax").tolist() == [7, 5]


@pytest.mark.parametrize("provenance", [False, True])
def test_one_value_per_device_takes_one_all_reduce(provenance, mesh, mesh2d):
    """Per-device values are gathered whole in one all-reduce and summarised on
    every device; larger values take the two-pass form (two)."""
    rng = np.random.default_rng(0)
    per_device = {f"m{i}": put(mesh, rng.normal(size=8)) for i in range(10)}

    def fn(m):
        return jh.distributed_stats(m, provenance=provenance, mesh=mesh)

    assert jh.collective_counts(fn, per_device) == {"all-reduce": 1}
    shard_map = jax.shard_map(
        lambda m: jh.collective.distributed_stats(
            jax.tree.map(lambda v: v[0], m), "data", provenance, mesh=mesh
        ),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=True,
    )
    assert jh.collective_counts(shard_map, per_device) == {"all-reduce": 1}
    got, want = jax.jit(shard_map)(per_device), jax.jit(fn)(per_device)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    big = {"x": put(mesh, rng.normal(size=64))}
    assert sum(jh.collective_counts(fn, big).values()) == 2
    # A block held by two devices of a 4 x 2 mesh is one value per holder too.
    values = np.array([1.0, -2.0, 7.0, 3.0], np.float32)
    out = jax.jit(
        lambda m: jh.distributed_stats(m, provenance=provenance, mesh=mesh2d)
    )({"x": put(mesh2d, values)})
    np.testing.assert_allclose(float(out["x/std"]), values.std(), rtol=1e-6)
    assert float(out["x/max"]) == 7.0 and float(out["x/mean"]) == values.mean()
    if provenance:
        assert (int(out["x/argmax"]), int(out["x/argmin"])) == (4, 2)


@pytest.mark.parametrize("size", [8, 64])  # gathered whole, two passes
def test_nan_and_inf_do_not_spread_to_other_values(size, mesh):
    values = np.arange(float(size))
    values[3] = np.inf
    out = jax.jit(spmd(mesh))({"x": put(mesh, values)})
    assert float(out["x/max"]) == np.inf and float(out["x/min"]) == 0.0
    assert int(out["x/argmax"]) == device_of(mesh, shape=(size,))[3]
    values[5] = np.nan
    ok = put(mesh, np.zeros_like(values))
    out = jax.jit(spmd(mesh))({"x": put(mesh, values), "ok": ok})
    assert math.isnan(float(out["x/mean"])) and float(out["ok/max"]) == 0.0
    assert int(out["x/nan_device"]) == device_of(mesh, shape=(size,))[5]


def test_statistics_without_provenance_on_any_mesh_order():
    devices = np.array(jax.devices()[::-1]).reshape(4, 2)
    mesh = jax.sharding.Mesh(
        devices, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    rng = np.random.default_rng(1)
    values = rng.normal(size=8).astype(np.float32)
    x = put(mesh, values, P(("data", "model")))
    out = jax.jit(jh.distributed_stats)({"x": x, "y": put(mesh, values[:4])})
    np.testing.assert_allclose(float(out["x/mean"]), values.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(out["x/std"]), values.std(), rtol=1e-5)
    np.testing.assert_allclose(float(out["y/std"]), values[:4].std(), rtol=1e-5)
    assert float(out["x/max"]) == values.max()


def reversed_mesh():
    devices = np.array(jax.devices()[::-1])
    return jax.sharding.Mesh(
        devices, ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
    )


def test_a_mesh_listing_the_devices_in_another_order_is_refused(mesh):
    """Values on devices 0..7, mesh= lists 7..0: no device is named from the
    wrong order (the min, on device 0, was named device 7)."""
    x = put(mesh, np.arange(8.0))
    rev = reversed_mesh()
    step = jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=rev))
    with pytest.raises(ValueError, match=r"incompatible devices") as err:
        step({"x": x})
    assert "[0, 1, 2, 3, 4, 5, 6, 7]" in str(err.value)
    assert "[7, 6, 5, 4, 3, 2, 1, 0]" in str(err.value)
    # The mesh the values are on names the device that holds the min.
    right = jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=mesh))
    out = right({"x": x})
    assert [int(out[f"x/{s}"]) for s in ("argmax", "argmin")] == [7, 0]
    # Values on the reversed mesh with that mesh: the holder of the min, by id.
    y = put(rev, np.arange(8.0))  # position 0 (the min) is on device 7
    out = jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=rev))(
        {"y": y}
    )
    assert [int(out[f"y/{s}"]) for s in ("argmax", "argmin")] == [0, 7]


@pytest.mark.parametrize("family", ["spmd", "collective"])
def test_a_mesh_unlike_the_context_mesh_is_refused(family, mesh):
    """Under jax.set_mesh, a mesh= listing the devices in another order."""
    x = put(mesh, np.arange(8.0))
    rev = reversed_mesh()
    if family == "spmd":
        fn, arg = jax.jit(spmd(rev)), {"x": x}
    else:
        inner = jax.shard_map(
            lambda m: jh.collective.distributed_stats(
                {"x": m[0]}, "data", provenance=True, mesh=rev
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
        fn, arg = jax.jit(inner), x
    refused = pytest.raises(ValueError, match=r"mesh= lists devices \[7, 6")
    with jax.set_mesh(mesh), refused as err:
        fn(arg)
    assert "jax.set_mesh" in str(err.value)


@pytest.mark.parametrize("bad", ["yes", 1, None, np.array(True)])
def test_provenance_must_be_a_bool(bad, mesh):
    x = put(mesh, np.arange(8.0))
    with pytest.raises(TypeError, match=r"provenance must be True or False"):
        jh.distributed_stats({"x": x}, provenance=bad)
    with pytest.raises(TypeError, match=r"distributed_stats_collective: provenance"):
        jax.jit(
            jax.shard_map(
                lambda v: jh.collective.distributed_stats({"x": v[0]}, "data", bad),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )(x)
    with pytest.raises(TypeError, match=r"History: provenance must be True or False"):
        jh.History(provenance=bad)
    # np.bool_ is a bool
    out = jh.distributed_stats({"x": x}, provenance=np.True_)
    assert int(out["x/argmin"]) == 0


# ----- meshes with Auto axes --------------------------------------------------------


def test_provenance_refuses_a_mesh_with_any_auto_axis():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), (AxisType.Explicit, AxisType.Auto))
    x = jax.device_put(np.arange(4.0, dtype=np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="Auto axes"):
        jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=mesh))({"x": x})
