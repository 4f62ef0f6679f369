"""Batches of a multi-process History reduced on the host: each process's
partials, combined, give what the device reduction gives (in float64, rounded
once); the thread, the store and its keys (the multi-process runs are in
test_history.py)."""

import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import _distributed, _host_batches
from jaxhistory._host_batches import (
    GROUP,
    HostBatch,
    batch_key,
    combine,
    of_rows,
    pack,
    partials,
    results,
    unpack,
)
from jaxhistory._provenance import global_index


def _reduce(names, dtypes, everyone, arrival=None):
    """Each update's combination (what every process gets) of partials."""
    arrays = combine(names, dtypes, everyone, arrival, 1024.0, "\x00same/")
    arrays = unpack(pack(arrays))  # through the store's bytes
    return results(names, arrays, arrival, "\x00same/", "lags", ("s/p", "s/l"))


def _combine(updates, everyone):
    """``updates``: each update's items (the same names)."""
    names = tuple(n for n, _ in updates[0])
    dtypes = tuple(_host_batches.result_dtype(v) for _, v in updates[0])
    return _reduce(names, dtypes, everyone)


def _one(everyone, names=("v",), dtype=np.float64, arrival=None):
    """The one update's combination of partials of ``names``."""
    [got] = _reduce(names, (np.dtype(dtype),) * len(names), everyone, arrival)
    return got


def _device_stats(metrics, mesh):
    return jax.device_get(
        jax.jit(lambda m: jh.distributed_stats(m, provenance=True, mesh=mesh))(metrics)
    )


def _arrays(mesh, mesh2d, rng):
    vec = rng.normal(size=8).astype(np.float32)
    vec[[2, 5]] = vec.max() + 1  # a tie for the max: the lowest device wins
    block = rng.normal(size=(8, 3)).astype(np.float32)
    with_nan = rng.normal(size=8).astype(np.float32)
    with_nan[[6, 3]] = np.nan
    return {
        "a_vec": jax.device_put(vec, NamedSharding(mesh, P("data"))),
        "b_block": jax.device_put(block, NamedSharding(mesh, P("data"))),
        # held twice (replicated over the second axis): each element counts once
        "c_rows": jax.device_put(block, NamedSharding(mesh2d, P("data"))),
        "d_int": jax.device_put(
            np.arange(8, dtype=np.int32) % 3, NamedSharding(mesh, P("data"))
        ),
        "e_bf16": jax.device_put(
            vec.astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("data"))
        ),
        "f_nan": jax.device_put(with_nan, NamedSharding(mesh, P("data"))),
        "g_const": jax.device_put(
            np.full(8, 0.003, np.float32), NamedSharding(mesh, P("data"))
        ),
        "h_inf": jax.device_put(
            np.where(np.arange(8) == 4, np.inf, vec), NamedSharding(mesh, P("data"))
        ),
    }


def test_one_process_gives_the_device_reductions_statistics(mesh, mesh2d):
    arrays = _arrays(mesh, mesh2d, np.random.default_rng(0))
    items = sorted(arrays.items())
    [(stats, straggler, differs)] = _combine(
        [items], {0: partials([items], 8, 0, global_index())}
    )
    assert stats.names == tuple(arrays) and straggler == {} and differs is None
    assert stats.table.dtype == np.float32
    for j, (name, value) in enumerate(items):  # one mesh per device call
        device = _device_stats({name: value}, value.sharding.mesh)
        np.testing.assert_array_equal(stats.where[:, j], device.where[:, 0], name)
        np.testing.assert_allclose(
            stats.table[:, j], device.table[:, 0], rtol=3e-7, atol=1e-7, err_msg=name
        )
    # NaN, inf, constants and ties as the device reduction has them
    s = dict(stats)
    assert np.isnan(s["f_nan/max"]) and s["f_nan/nan_device"] == 3
    assert s["f_nan/argmax"] == s["f_nan/argmin"] == 3
    assert s["h_inf/max"] == np.inf and s["h_inf/mean"] == np.inf
    assert np.isnan(s["h_inf/std"])
    assert s["g_const/mean"] == np.float32(0.003) and s["g_const/std"] == 0
    assert s["a_vec/argmax"] == 2


@pytest.mark.parametrize("seed", range(5))
def test_partials_combine_to_the_statistics_of_all_values(seed):
    """Values split among processes in any way: the same statistics, in
    float64, as NumPy's over all of them, and the lowest device holding each."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(3.0, 2.0, size=40), 1)  # ties among the values
    devices = rng.integers(0, 16, size=40)
    cuts = np.sort(rng.choice(np.arange(1, 40), size=3, replace=False))
    parts = {
        p: _host_batches.of_values(x[idx], devices[idx])[None]
        for p, idx in enumerate(np.split(np.arange(40), cuts))
    }
    parts[9] = _host_batches.of_values(x[:0], devices[:0])[None]  # holds none
    stats, _, _ = _one(parts)
    assert stats.table.dtype == np.float64
    np.testing.assert_allclose(
        stats.table[:, 0], [x.mean(), x.max(), x.min(), x.std()], rtol=1e-13
    )
    assert stats.where[:, 0].tolist() == [
        devices[x == x.max()].min(),
        devices[x == x.min()].min(),
        -1,
    ]


def test_rows_of_a_batch_are_reduced_each_on_its_own():
    """A batch's updates at once: each row's statistics are its own."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 10))
    x[2, 3] = np.nan
    x[4] = 1.5  # a constant row
    devices = rng.integers(0, 4, size=10)
    halves = {0: slice(0, 4), 1: slice(4, 10)}
    parts = {
        p: _host_batches.of_rows(x[:, cut], devices[cut])[None]
        for p, cut in halves.items()
    }
    got = _reduce(("v",), (np.dtype(np.float64),), parts)
    for u, (stats, _, _) in enumerate(got):
        row = x[u]
        if u == 2:
            assert np.isnan(stats.table[:, 0]).all()
            assert stats.where[:, 0].tolist() == [devices[3]] * 3
            continue
        np.testing.assert_allclose(
            stats.table[:, 0], [row.mean(), row.max(), row.min(), row.std()]
        )
        assert stats.where[0, 0] == devices[row == row.max()].min()
    assert got[4][0].table[3, 0] == 0.0 and got[4][0].table[0, 0] == 1.5


@pytest.mark.parametrize("seed", range(4))
def test_rows_over_ordered_devices_give_what_any_order_gives(seed):
    """of_rows(ordered=True), devices in increasing order: the partial of the
    general path, bit for bit, ties (0.0 and -0.0 among them), infinities
    and NaN rows included; the lowest device holding each extreme."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=(7, 12)), 0)  # many ties
    x[1, [2, 9]] = [0.0, -0.0]
    x[1, x[1] != 0] = -1.0
    x[2, 5], x[3, [0, 11]] = np.inf, [-np.inf, np.inf]
    x[4, 7] = np.nan
    x[5] = 2.5
    devices = np.sort(rng.integers(0, 6, size=12))
    for rows in (x, np.delete(x, 4, axis=0)):  # with a NaN row, and without
        fast, general = of_rows(rows, devices, ordered=True), of_rows(rows, devices)
        np.testing.assert_array_equal(fast, general)
        assert np.signbit(fast).tolist() == np.signbit(general).tolist()
        assert fast[_host_batches.ARGMAX, 2] == devices[5]
        assert fast[_host_batches.ARGMIN, 3] == devices[0]
        assert fast[_host_batches.ARGMAX, -2] == devices[0]  # the constant row


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_the_median_of_a_batchs_arrival_times_is_numpys(p):
    rng = np.random.default_rng(p)
    x = rng.normal(size=(p, 9))
    x[:, 1] = 4.0
    x[0, 2] = np.inf
    np.testing.assert_array_equal(_host_batches._median(x), np.median(x, axis=0))
    x[-1, 3] = np.nan
    np.testing.assert_array_equal(_host_batches._median(x), np.median(x, axis=0))


def test_combined_without_nan_matches_the_general_path():
    """Partials with no NaN (the fast path) give what they give with one NaN
    elsewhere, on every name the NaN does not touch."""
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=(3, 20)), 1)
    devices = np.arange(20)
    cuts = {0: slice(0, 7), 1: slice(7, 8), 2: slice(8, 20)}
    clean = np.stack([of_rows(x[:, c], devices[c])[None] for c in cuts.values()])
    y = np.concatenate([x, [[np.nan] * 20]])
    dirty = np.stack([of_rows(y[:, c], devices[c])[None] for c in cuts.values()])
    stats, where = _host_batches._combined(clean)
    stats2, where2 = _host_batches._combined(dirty)
    np.testing.assert_array_equal(stats, stats2[..., :3])
    np.testing.assert_array_equal(where, where2[..., :3])
    assert (where[:, 2] == -1).all() and (where2[:, 2, 3] == 0).all()
    for u in range(3):
        assert stats[0, 0, u] == pytest.approx(x[u].mean(), rel=1e-13)
        assert where[0, 0, u] == devices[x[u] == x[u].max()].min()


def test_host_scalars_count_each_process_by_its_devices():
    """Process 0 holds 3 devices of the mesh (from device 0), process 1 one
    (device 3): the mean weighs them so, as one value per device does."""
    index = {0: 0}
    mine = partials([[("x", 1.0), ("y", 5.0)]], 3, 0, index)
    theirs = partials([[("x", 5.0), ("y", 5.0)]], 1, 3, index)
    s = dict(_one({0: mine, 1: theirs}, names=("x", "y"), dtype=np.float32)[0])
    assert s["x/mean"] == 2.0 and s["x/argmax"] == 3 and s["x/argmin"] == 0
    assert s["x/std"] == pytest.approx(np.std([1.0, 1.0, 1.0, 5.0]))
    assert s["y/mean"] == 5.0 and s["y/std"] == 0.0 and s["y/argmax"] == 0
    nan = partials([[("x", float("nan"))]], 1, 3, index)
    s = dict(_one({0: mine[:1], 1: nan}, names=("x",), dtype=np.float32)[0])
    assert np.isnan(s["x/mean"]) and s["x/nan_device"] == s["x/argmax"] == 3
    inf = partials([[("x", float("inf"))]], 1, 3, index)
    s = dict(_one({0: mine[:1], 1: inf}, names=("x",))[0])
    assert s["x/mean"] == s["x/max"] == np.inf and np.isnan(s["x/std"])
    assert s["x/argmax"] == 3 and s["x/nan_device"] == -1
    outside = partials([[("x", 9.0)]], 0, -1, index)  # no device in the mesh
    s = dict(_one({0: mine[:1], 2: outside}, names=("x",))[0])
    assert s["x/mean"] == 1.0 and s["x/max"] == 1.0


def test_a_constant_stays_exactly_a_constant():
    """0.003 on 3 processes of unequal weight: mean 0.003 and std 0 exactly."""
    parts = {p: partials([[("lr", 0.003)]], p + 1, 2 * p, {}) for p in range(3)}
    s = dict(_one(parts, names=("lr",))[0])
    assert s["lr/mean"] == 0.003 and s["lr/std"] == 0.0


def test_arrival_times_and_checksums_are_read_not_recorded():
    names = ("\x00same/w", "hi", "lo", "loss")
    rows = {  # process -> (checksum, arrival hi, arrival lo, loss)
        0: (7.0, 100.0, 1000.5, 1.0),
        1: (7.0, 101.0, 0.25, 2.0),
        2: (8.0, 100.0, 1023.0, 3.0),
    }
    everyone = {
        p: partials([list(zip(names, row, strict=True))], 1, p, {})
        for p, row in rows.items()
    }
    stats, straggler, differs = _one(
        everyone, names=names, dtype=np.float32, arrival=("hi", "lo")
    )
    assert stats.names == ("loss",) and dict(stats)["loss/mean"] == 2.0
    assert differs.tolist() == [True]
    times = np.asarray([1000.5, 1024.25, 1023.0])
    assert straggler["s/p"] == 1 and straggler["s/p"].dtype == np.int32
    np.testing.assert_allclose(straggler["lags"], times - np.median(times))
    assert straggler["s/l"] == np.float32(1024.25 - 1023.0)


class Store:
    """The distributed runtime's key-value store, in memory."""

    def __init__(self, fail_set: bool = False):
        self.data, self.deleted = {}, []
        self.cond = threading.Condition()
        self.fail_set = fail_set
        self.timeouts = 0

    def key_value_set_bytes(self, key, value):
        if self.fail_set:
            raise RuntimeError("UNAVAILABLE: the store is gone")
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000):
                self.timeouts += 1
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() {key}")
            return self.data[key]

    def key_value_delete(self, key):
        """Deletes ``key`` and every key under it, as the runtime's store does."""
        self.deleted.append(key)
        for k in [k for k in self.data if k == key or k.startswith(f"{key}/")]:
            del self.data[k]


def _batch(
    store,
    key,
    drop=None,
    mesh=None,
    updates=None,
    current=lambda: True,
    previous=None,
):
    if updates is None:
        updates = [(0, 0.0, [("loss", 1.5), ("x", 2.0)])]
    return HostBatch(
        updates,
        key,
        drop,
        store,
        current,
        _distributed._combine_batch,
        _distributed._split_batch,
        mesh if mesh is not None else jax.sharding.Mesh(jax.devices(), ("d",)),
        previous,
    )


def test_the_leader_combines_posts_the_result_and_deletes_the_group_before(mesh):
    store = Store()
    loss = jax.device_put(
        np.arange(8, dtype=np.float32), NamedSharding(mesh, P("data"))
    )
    first = _batch(store, "k/group0/batch0", updates=[(3, 0.0, [("loss", loss)])])
    second = _batch(store, "k/group1/batch8", drop="k/group0")
    [(stats, straggler, differs)] = first.result()
    assert dict(stats)["loss/mean"] == 3.5 and dict(stats)["loss/argmax"] == 7
    assert straggler == {} and differs is None
    [(stats, _, _)] = second.result()
    assert dict(stats)["x/mean"] == 2.0 and dict(stats)["loss/max"] == 1.5
    posted = unpack(store.data["k/group1/batch8/result"])
    assert posted["table"].shape == (1, 4, 2)  # one update, two values
    # group0's keys, every result and post of its batches, went in one call
    assert store.deleted == ["k/group0"]
    assert sorted(store.data) == ["k/group1/batch8/result"]


@pytest.mark.parametrize(
    ("n", "key", "drop"),
    [
        (0, "p/group0/batch0", None),
        (1, "p/group0/batch1", None),
        (GROUP - 1, f"p/group0/batch{GROUP - 1}", None),
        (GROUP, f"p/group1/batch{GROUP}", "p/group0"),
        (GROUP + 1, f"p/group1/batch{GROUP + 1}", None),
        (3 * GROUP, f"p/group3/batch{3 * GROUP}", "p/group2"),
    ],
)
def test_batches_are_kept_and_deleted_in_groups(n, key, drop):
    """A group's batches share one key, deleted at the first batch of the
    next group (one call to the store every GROUP batches). A group's key is
    not a prefix of another's: the store deletes "p/group1" and everything
    under "p/group1/", never "p/group10/"."""
    assert batch_key("p", n) == (key, drop)
    store = Store()
    store.data = {"p/group1/batch8/result": b"", "p/group10/batch80/result": b""}
    store.key_value_delete("p/group1")
    assert list(store.data) == ["p/group10/batch80/result"]


@pytest.mark.parametrize("keep", [0, _host_batches.KEEP_BYTES])
def test_a_large_batch_is_deleted_at_the_next_not_with_its_group(monkeypatch, keep):
    """Where a batch's posts and result came to more than KEEP_BYTES, the
    leader deletes its keys at the next batch (the store holds at most two
    such); a small one waits for its group. A batch of the group deleted
    with the next is not deleted twice."""
    monkeypatch.setattr(_host_batches, "KEEP_BYTES", keep)
    store = Store()
    first = _batch(store, "k/group0/batch0")
    first.result()
    assert first.size == len(store.data["k/group0/batch0/result"]) > 0
    second = _batch(store, "k/group0/batch1", previous=first)
    second.result()
    large = first.size > keep
    assert large == (keep == 0)
    assert store.deleted == (["k/group0/batch0"] if large else [])
    third = _batch(store, "k/group1/batch8", drop="k/group0", previous=second)
    third.result()
    assert store.deleted[-1:] == ["k/group0"] and store.deleted.count("k/group0") == 1
    assert "k/group0/batch1" not in store.deleted
    assert second._previous is None and third._previous is None  # let go
    assert sorted(store.data) == ["k/group1/batch8/result"]


def test_another_process_posts_and_reads_the_leaders_result(monkeypatch):
    """Process 0 playing a process other than the leader: it posts its
    partials and waits for the leader's result; its post stays (the leader
    deletes the whole batch once every process has posted the next)."""
    monkeypatch.setattr(_host_batches, "LEADER", 1)
    store = Store()
    items = [("loss", 1.5), ("x", 2.0)]
    batch = _batch(store, "k/batch0", updates=[(0, 0.0, items)])
    post = unpack(store.blocking_key_value_get_bytes("k/batch0/0", 5000))
    assert post["steps"].tolist() == [0]  # the leader checks them
    mine = post["parts"]
    assert mine.shape == (2, len(_host_batches.FIELDS), 1)
    theirs = partials([[("loss", 3.5), ("x", 2.0)]], 8, 8, {})
    arrays = _distributed._combine_batch(items, {0: mine, 1: theirs})
    store.key_value_set_bytes("k/batch0/result", pack(arrays))
    [(stats, _, _)] = batch.result()
    assert dict(stats)["loss/mean"] == 2.5 and dict(stats)["loss/argmax"] == 8
    assert dict(stats)["x/std"] == 0.0
    assert store.deleted == [] and "k/batch0/0" in store.data


def test_a_process_that_posts_other_steps_makes_every_process_raise(monkeypatch):
    """The leader (process 0) holds steps 4-5, process 1 posted step 4 alone:
    the result names each one's steps, and both raise ValueError with them."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    store = Store()
    theirs = partials([[("x", 1.0)]], 4, 4, {})
    store.key_value_set_bytes(
        "k/batch0/1", pack({"parts": theirs, "steps": np.asarray([4])})
    )
    updates = [(4, 0.0, [("x", 1.0)]), (5, 0.0, [("x", 2.0)])]
    batch = _batch(store, "k/batch0", updates=updates)
    with pytest.raises(ValueError, match="different updates") as info:
        batch.result()
    text = str(info.value)
    assert "process 0 at steps [4, 5]; process 1 at steps [4]" in text, text
    result = unpack(store.data["k/batch0/result"])
    assert {k: v.tolist() for k, v in result.items()} == {
        "steps/0": [4, 5],
        "steps/1": [4],
    }


def test_what_the_thread_meets_is_raised_at_result():
    batch = _batch(Store(fail_set=True), "k/batch0")
    with pytest.raises(RuntimeError, match="the store is gone"):
        batch.result()


def test_a_read_waits_past_deadlines_and_stops_when_the_runtime_is_shut_down(
    monkeypatch,
):
    monkeypatch.setattr(_host_batches, "POLL_S", 0.01)
    store = Store()
    live = [True]
    batch = _batch(store, "k/batch0", current=lambda: live[0])
    batch.result()
    found = []
    reader = threading.Thread(target=lambda: found.append(batch._read("k/other")))
    reader.start()
    while store.timeouts < 3:  # polls again after each deadline
        threading.Event().wait(0.01)
    store.key_value_set_bytes("k/other", b"late")
    reader.join(5)
    assert found == [b"late"]
    live[0] = False
    with pytest.raises(RuntimeError, match="shut down before every process"):
        batch._read("k/never")


def test_a_value_of_a_narrow_dtype_reduces_in_float32(mesh):
    x = jnp.asarray(np.linspace(-1, 1, 8), jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    [(stats, _, _)] = _batch(Store(), "k/b", updates=[(0, 0.0, [("x", x)])]).result()
    assert stats.table.dtype == np.float32
    expected = np.asarray(x, np.float64)
    assert dict(stats)["x/mean"] == np.float32(expected.mean())


def test_a_result_goes_through_the_store_as_it_was():
    """Every dtype and shape a combined batch holds comes back equal, in its
    dtype and writable; bytes that are not such a result are refused by name."""
    arrays = {
        "table": np.arange(48, dtype=np.float32).reshape(16, 3, 1),
        "where": np.full((16, 3, 1), 7.0),
        "differs": np.zeros((16, 0), bool),
        "lags": np.array([[0.5, -np.inf], [np.nan, 1e-30]], np.float16),
        "ids": np.arange(2, dtype=np.int32),
        "last": np.array([1, 0], np.int64),
        "scalar": np.float64(3.5),
    }
    back = unpack(pack(arrays))
    assert list(back) == list(arrays)
    for k, a in arrays.items():
        assert back[k].dtype == np.asarray(a).dtype and back[k].shape == np.shape(a)
        np.testing.assert_array_equal(back[k], a)
        assert back[k].flags.writeable
    raw = pack(arrays)
    for bad in (b"", raw[:3], raw[:20], raw[:-1], raw + b"\x00", b"PK\x03\x04" + raw):
        with pytest.raises(ValueError, match="batch result"):
            unpack(bad)
    with pytest.raises(TypeError, match="'names'"):
        pack({"names": np.array(["a"])})  # not numbers


def test_partials_of_mixed_names_are_those_of_each_name_alone(mesh):
    """Host scalars (their partials made in one pass) among JAX arrays, over
    three updates: each name's partials are what it gives on its own."""
    index = global_index()
    rng = np.random.default_rng(3)
    sharded = NamedSharding(mesh, P("data"))
    updates = []
    for u in range(3):
        a = rng.normal(size=8).astype(np.float32)
        updates.append(
            [
                ("a", jax.device_put(a, sharded)),
                ("b", [0.5, float("nan"), float("inf")][u]),
                ("c", jax.device_put(a * 2, sharded)),
                ("d", float(u)),
            ]
        )
    together = partials(updates, 4, 2, index)
    for j, (name, _) in enumerate(updates[0]):
        alone = partials([[items[j]] for items in updates], 4, 2, index)
        np.testing.assert_array_equal(together[j], alone[0], err_msg=name)
    assert together[1, _host_batches.NAN_DEVICE].tolist() == [-1, 2, -1]
    outside = partials(updates, 0, -1, index)  # no device of the mesh here
    for j in (1, 3):  # the host scalars count nothing; the arrays as before
        assert outside[j, _host_batches.COUNT].tolist() == [0, 0, 0]
        assert outside[j, _host_batches.NAN_DEVICE].tolist() == [-1, -1, -1]
    np.testing.assert_array_equal(outside[[0, 2]], together[[0, 2]])


def test_a_names_split_follows_its_sharding(mesh):
    """What split makes of a name is kept per sharding: the same name as a
    replicated array (recorded as it is), then per device (reduced), then
    replicated again, then a host scalar (recorded as it is with one
    process)."""
    reducer = _distributed.Reducer()
    replicated = jax.device_put(np.float32(1.0), NamedSharding(mesh, P()))
    per_device = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("data")))
    for value, reduced in [
        (replicated, False),
        (replicated + 1, False),
        (per_device, True),
        (per_device * 2, True),
        (replicated, False),
        (2.5, False),
        (per_device, True),
    ]:
        plain, reduce = reducer.split([("x", value), ("step", 3)])
        assert [n for n, _ in reduce] == (["x"] if reduced else []), value
        assert [n for n, _ in plain] == (["step"] if reduced else ["x", "step"])
