"""jaxhistory.metrics: every accumulator against float64 NumPy, on the host, on
an 8-device mesh under jit and per device under shard_map (check_vma=True)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhistory as jh
from jaxhistory import metrics as M

C = 5  # classes
ALL = M.Collection.create(
    mean=M.Average.from_output("values"),
    total=M.Sum.from_output("values"),
    n=M.Count.from_output("values"),
    hi=M.Max.from_output("values"),
    lo=M.Min.from_output("values"),
    last=M.Last.from_output("values"),
    std=M.Std.from_output("values"),
    acc=M.Accuracy,
    acc3=M.Accuracy.top(3),
)


def reference(batches) -> dict[str, float]:
    """Float64 NumPy over the unmasked examples of every batch, in order."""
    v = np.concatenate([np.asarray(b["values"], np.float64) for b in batches])
    m = np.concatenate([np.asarray(b["mask"], bool) for b in batches])
    logits = np.concatenate([np.asarray(b["logits"], np.float64) for b in batches])
    labels = np.concatenate([b["labels"] for b in batches])
    x = v[m]
    none = not x.size
    hit = logits.argmax(-1) == labels
    mine = np.take_along_axis(logits, labels[:, None], -1)
    hit3 = (logits > mine).sum(-1) < 3
    return {
        "mean": math.nan if none else x.mean(),
        "total": x.sum(),
        "n": x.size,
        "hi": math.nan if none else x.max(),
        "lo": math.nan if none else x.min(),
        "last": math.nan if none else x[-1],
        "std": math.nan if none else x.std(),
        "acc": math.nan if none else hit[m].mean(),
        "acc3": math.nan if none else hit3[m].mean(),
    }


def make_batches(case: str, rng) -> list[dict]:
    sizes = [16, 16, 8] if case != "empty" else [16, 0, 8]
    batches = []
    for i, b in enumerate(sizes):
        values = rng.normal(size=b)
        if case == "offset":
            values = 1e4 + values  # sum of squares would lose every digit
        mask = rng.random(b) > 0.3
        if i == len(sizes) - 1:
            mask[b // 2 :] = False  # a padded last batch: uneven across devices
        if case == "all_masked" and i == 1:
            mask[:] = False
            values[:] = np.nan  # padding may hold anything
        if case == "nan" and i == 1:
            values[3], mask[3] = np.nan, True
        if case == "ints":
            values = rng.integers(-50, 50, size=b).astype(np.int32)
        elif case == "bf16":
            values = jnp.asarray(values, jnp.bfloat16)
        else:
            values = values.astype(np.float32)
        batches.append(
            {
                "values": values,
                "mask": mask,
                "logits": rng.normal(size=(b, C)).astype(np.float32),
                "labels": rng.integers(0, C, size=b).astype(np.int32),
            }
        )
    return batches


def run_host(batches):
    m = ALL.empty()
    for b in batches:
        m = m.update(**b)
    return m.compute()


def run_spmd(batches, mesh):
    sharded = NamedSharding(mesh, P("data"))
    step = jax.jit(lambda m, b: m.update(**b))
    m = ALL.empty(num_shards=8)
    for b in batches:
        m = step(m, jax.device_put(b, sharded))
    return jax.jit(lambda m: m.compute())(m)


def run_shard_map(batches, mesh):
    step = jax.jit(
        jax.shard_map(
            lambda m, b: m.update(**b),
            mesh=mesh,
            in_specs=(P("data"), P("data")),
            out_specs=P("data"),
            check_vma=True,
        )
    )
    compute = jax.jit(
        jax.shard_map(
            lambda m: m.compute(axis_name="data"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
            check_vma=True,
        )
    )
    sharded = NamedSharding(mesh, P("data"))
    # one shard per device inside shard_map
    m = jax.device_put(ALL.empty(num_shards=8), sharded)
    for b in batches:
        m = step(m, jax.device_put(b, sharded))
    return compute(m)


CASES = ["plain", "offset", "nan", "bf16", "ints", "empty", "all_masked"]


@pytest.mark.parametrize("mode", ["host", "spmd", "shard_map"])
@pytest.mark.parametrize("case", CASES)
def test_every_metric_matches_float64_numpy(case, mode, mesh):
    batches = make_batches(case, np.random.default_rng(CASES.index(case)))
    run = {"host": run_host, "spmd": run_spmd, "shard_map": run_shard_map}[mode]
    got = run(batches) if mode == "host" else run(batches, mesh)
    want = reference(batches)
    assert set(got) == set(want)
    for name, value in want.items():
        assert isinstance(got[name], jax.Array), name  # never waited for
        rtol = 2e-4 if name == "std" and case == "offset" else 1e-5
        np.testing.assert_allclose(
            np.asarray(got[name], np.float64),
            value,
            rtol=rtol,
            atol=1e-4 if name in ("total", "std") else 0,
            err_msg=f"{name} ({case}, {mode})",
        )


def test_std_is_stable_in_float32_where_sums_of_squares_fail():
    x = (1e4 + np.random.default_rng(0).normal(size=4096)).astype(np.float32)
    m = M.Std.empty()
    for chunk in np.split(x, 16):
        m = m.update(values=chunk, num_shards=8)
    got = float(m.compute())
    want = x.astype(np.float64).std()
    assert abs(got - want) / want < 1e-4
    with np.errstate(invalid="ignore"):  # float32 sums of squares: var < 0 here
        naive = np.sqrt(np.mean(np.square(x)) - np.square(np.mean(x)))
    assert not abs(naive - want) / want < 1e-2  # what the merge avoids


# ----- collectives -------------------------------------------------------------------


def test_a_collection_computes_in_2_collectives_and_updates_in_none(mesh):
    batch = jax.device_put(
        make_batches("plain", np.random.default_rng(0))[0],
        NamedSharding(mesh, P("data")),
    )
    m = ALL.empty(num_shards=8).update(**batch)
    counts = jh.collective_counts(lambda m: m.compute(), m)
    assert sum(counts.values()) <= 2, counts
    assert jh.collective_counts(lambda m, b: m.update(**b), m, batch) == {}
    one = M.Collection.create(loss=M.Average.from_output("values"))
    single = one.empty(num_shards=8).update(values=batch["values"])
    assert sum(jh.collective_counts(lambda m: m.compute(), single).values()) == 1


def test_shard_map_compute_gathers_in_2_collectives(mesh):
    m = jax.device_put(ALL.empty(num_shards=8), NamedSharding(mesh, P("data")))
    f = jax.shard_map(
        lambda m: m.compute(axis_name="data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=True,
    )
    counts = jh.collective_counts(f, m)
    assert sum(counts.values()) <= 2, counts


def test_one_shard_computes_without_collectives():
    m = ALL.empty().update(**make_batches("plain", np.random.default_rng(1))[0])
    assert m.acc.num_shards == 1
    assert jh.collective_counts(lambda m: m.compute(), m) == {}


# ----- loops -------------------------------------------------------------------------


def test_scan_and_fori_loop_carry_a_collection_without_retracing(mesh):
    batches = make_batches("plain", np.random.default_rng(2))[:2]
    stacked = jax.device_put(
        jax.tree.map(lambda *x: np.stack(x), *batches),
        NamedSharding(mesh, P(None, "data")),
    )
    traces = []

    @jax.jit
    def evaluate(stacked):
        traces.append(1)

        def body(m, b):
            return m.update(**b), None

        m, _ = jax.lax.scan(body, ALL.empty(num_shards=8), stacked)
        return m.compute()

    got = evaluate(stacked)
    evaluate(stacked)
    assert len(traces) == 1
    want = reference(batches)
    for name in want:
        np.testing.assert_allclose(
            float(got[name]), want[name], rtol=1e-5, err_msg=name
        )

    @jax.jit
    def fori(stacked):
        def body(i, m):
            return m.update(**jax.tree.map(lambda x: x[i], stacked))

        return jax.lax.fori_loop(0, 2, body, ALL.empty(num_shards=8)).compute()

    np.testing.assert_allclose(float(fori(stacked)["mean"]), want["mean"], rtol=1e-5)


# ----- merge: associative, empty() its identity ---------------------------------------

# No subnormals: XLA's CPU arithmetic flushes float32 subnormals to zero, so a
# merge with the identity (x + 0) would turn 1.4e-45 into 0.
batch_values = st.lists(
    st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False, width=32),
    min_size=0,
    max_size=12,
).map(lambda v: v[: len(v) - len(v) % 4])


def host_metric(values, seed):
    rng = np.random.default_rng(seed)
    n = len(values)
    return ALL.from_model_output(
        values=np.asarray(values, np.float32),
        mask=rng.random(n) > 0.3,
        logits=rng.normal(size=(n, C)).astype(np.float32),
        labels=rng.integers(0, C, size=n).astype(np.int32),
        num_shards=4,
    )


@settings(max_examples=25, deadline=None)
@given(batch_values, batch_values, batch_values)
def test_merge_is_associative_and_empty_is_its_identity(a, b, c):
    x, y, z = host_metric(a, 0), host_metric(b, 1), host_metric(c, 2)
    left = x.merge(y).merge(z).compute()
    right = x.merge(y.merge(z)).compute()
    for name in left:
        np.testing.assert_allclose(
            np.asarray(left[name]), np.asarray(right[name]), rtol=1e-5, atol=1e-3
        )
    for identity in (ALL.empty(), ALL.empty(num_shards=4)):
        for merged in (identity.merge(x), x.merge(identity)):
            for got, want in zip(
                jax.tree.leaves(merged), jax.tree.leaves(x), strict=True
            ):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----- host use, History, flax --------------------------------------------------


def test_history_records_a_collections_compute_in_one_update():
    m = ALL.empty()
    for b in make_batches("plain", np.random.default_rng(3)):
        m = m.update(**b)
    h = jh.History(distributed_history=False)
    h.update({"eval": m.compute()}, step=10)
    state = h.state
    assert sorted(k for k in state.keys if k.startswith("eval/")) == sorted(
        f"eval/{k}" for k in ALL._metrics
    )
    assert state.steps("eval/acc").tolist() == [10]
    h.close()


def test_scalars_count_once_and_follow_the_batch_shards(mesh):
    Lr = M.Collection.create(
        lr=M.Last.from_output("lr"), loss=M.Average.from_output("loss")
    )
    loss = jax.device_put(
        np.arange(16.0, dtype=np.float32), NamedSharding(mesh, P("data"))
    )
    m = Lr.empty(num_shards=8)
    for lr in (0.1, 0.05):
        m = jax.jit(lambda m, lr, loss: m.update(lr=lr, loss=loss))(m, lr, loss)
    out = m.compute()
    assert float(out["lr"]) == pytest.approx(0.05) and float(out["loss"]) == 7.5
    avg = M.Average.empty().update(values=2.0).update(values=4.0)
    assert float(avg.compute()) == 3.0


def test_weighted_average_and_arrays_per_example():
    m = M.Average.from_output("x", weights="w").from_model_output(
        x=np.array([[1.0, 3.0], [10.0, 10.0], [np.nan, 0.0]]),
        w=np.array([1.0, 3.0, 0.0]),
    )
    assert float(m.compute()) == pytest.approx((1 + 3 + 3 * 20) / 8)
    s = M.Std.from_output("x").from_model_output(x=np.arange(8.0).reshape(4, 2))
    assert float(s.compute()) == pytest.approx(np.arange(8.0).std())


def test_collection_lives_in_an_nnx_module_and_in_a_train_state():
    nnx = pytest.importorskip("flax.nnx")
    Metrics = M.Collection.create(
        loss=M.Average.from_output("loss"), accuracy=M.Accuracy
    )

    class Classifier(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, C, rngs=rngs)
            self.metrics = nnx.data(Metrics.empty(num_shards=1))

    model = Classifier(nnx.Rngs(0))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.integers(0, C, size=8).astype(np.int32)

    @nnx.jit
    def eval_step(model, x, y):
        logits = model.linear(x)
        loss = -jax.nn.log_softmax(logits)[jnp.arange(len(y)), y]
        model.metrics = model.metrics.update(loss=loss, logits=logits, labels=y)

    eval_step(model, x, y)
    eval_step(model, x, y)
    got = model.metrics.compute()
    logits = np.asarray(model.linear(x))
    assert float(got["accuracy"]) == pytest.approx((logits.argmax(1) == y).mean())

    # ... or carried beside the parameters in a train state (a plain pytree).
    state = {"params": nnx.state(model.linear), "metrics": Metrics.empty(num_shards=1)}
    state = jax.jit(
        lambda s: {
            **s,
            "metrics": s["metrics"].update(loss=x[:, 0], logits=logits, labels=y),
        }
    )(state)
    assert float(state["metrics"].compute()["loss"]) == pytest.approx(x[:, 0].mean())


# ----- bad input ----------------------------------------------------------------------


def test_bad_input_gets_a_clear_error():
    with pytest.raises(TypeError, match=r"needs loss= \(given: values\)"):
        M.Average.from_output("loss").from_model_output(values=np.ones(4))
    with pytest.raises(ValueError, match="mask has 3"):
        M.Average.from_model_output(values=np.ones(4), mask=np.ones(3, bool))
    with pytest.raises(ValueError, match=r"mask must be one flag per example"):
        M.Average.from_model_output(values=np.ones(4), mask=np.ones((4, 1), bool))
    with pytest.raises(ValueError, match="does not split into 3 equal shards"):
        M.Average.from_model_output(values=np.ones(4), num_shards=3)
    with pytest.raises(ValueError, match="num_shards must be a positive int"):
        M.Average.from_model_output(values=np.ones(4), num_shards=0)
    with pytest.raises(ValueError, match="num_shards must be an int >= 0"):
        M.Average.empty(-1)
    with pytest.raises(TypeError, match="must be numeric"):
        M.Average.from_model_output(values=np.array(["a"]))
    with pytest.raises(TypeError, match="must be numeric"):
        M.Average.from_model_output(values=[object()])
    with pytest.raises(TypeError, match="labels must be integers"):
        M.Accuracy.from_model_output(predictions=np.ones(2), labels=np.ones(2))
    with pytest.raises(TypeError, match="needs logits="):
        M.Accuracy.from_model_output(labels=np.ones(2, np.int32))
    with pytest.raises(ValueError, match="plus a class axis"):
        M.Accuracy.from_model_output(logits=np.ones(2), labels=np.ones(2, np.int32))
    with pytest.raises(ValueError, match="needs logits"):
        M.Accuracy.top(2).from_model_output(
            predictions=np.ones(2, np.int32), labels=np.ones(2, np.int32)
        )
    for k in (0, 1.5, True):
        with pytest.raises(ValueError, match="positive int k"):
            M.Accuracy.top(k)
    with pytest.raises(ValueError, match="one value per example"):
        M.Last.from_model_output(values=np.ones((2, 2)))
    with pytest.raises(ValueError, match="one weight per example"):
        M.Average.from_output("x", weights="w").from_model_output(
            x=np.ones(4), w=np.ones(3)
        )


def test_merging_what_does_not_fit_is_refused():
    a = M.Average.from_model_output(values=np.ones(8), num_shards=8)
    b = M.Average.from_model_output(values=np.ones(8), num_shards=4)
    with pytest.raises(ValueError, match="of 8 shards with one of 4"):
        a.merge(b)
    with pytest.raises(TypeError, match="cannot merge Average with Sum"):
        a.merge(M.Sum.empty())
    with pytest.raises(TypeError, match="different declarations"):
        ALL.empty().merge(M.Collection.create(x=M.Sum).empty())
    assert float(a.merge(a).compute()) == 1.0  # and nothing recorded changed


def test_collection_declarations_are_checked():
    with pytest.raises(ValueError, match="at least one metric"):
        M.Collection.create()
    with pytest.raises(TypeError, match="loss= must be a metric class"):
        M.Collection.create(loss=M.Average.empty())
    with pytest.raises(TypeError, match="loss= must be a metric class"):
        M.Collection.create(loss="Average")
    with pytest.raises(TypeError, match="declare a Collection"):
        M.Collection.empty()
    with pytest.raises(AttributeError, match="no metric 'los' in this Collection"):
        _ = ALL.empty().los
    assert M.Average.from_output("x") is M.Average.from_output("x")  # one pytree type


def test_an_auto_mesh_needs_num_shards_for_per_device_state():
    from jax.sharding import AxisType

    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    batch = jax.device_put(
        make_batches("plain", np.random.default_rng(5))[0],
        NamedSharding(auto, P("data")),
    )
    want = reference([batch])
    # Inside jit the shard count of an Auto axis is unknown: given, the state is
    # per device (no collective per update); not given, one shard (still exact).
    for num_shards, shards in ((8, 8), (None, 1)):

        def step(m, b, num_shards=num_shards):
            return m.update(num_shards=num_shards, **b)

        m = jax.jit(step)(ALL.empty(num_shards=shards), batch)
        assert m.acc.num_shards == shards
        got = m.compute()
        for name in ("mean", "std", "acc", "last"):
            np.testing.assert_allclose(float(got[name]), want[name], rtol=1e-5)
        if shards == 8:
            counts = jh.collective_counts(step, ALL.empty(num_shards=8), batch)
            assert counts == {}, counts
    with pytest.raises(ValueError, match="num_shards=4 but values's batch axis"):
        M.Average.from_model_output(
            values=jax.device_put(np.ones(8), NamedSharding(auto, P("data"))),
            num_shards=4,
        )


# ----- review findings ----------------------------------------------------------------


def test_padding_may_hold_a_nan_weight():
    w = np.array([1.0, 2.0, np.nan, np.inf])
    m = M.Average.from_output("x", weights="w").from_model_output(
        x=np.array([1.0, 4.0, 5.0, 6.0]), w=w, mask=np.array([1, 1, 0, 0], bool)
    )
    assert float(m.compute()) == pytest.approx(3.0)


def test_a_scalar_counts_once_inside_shard_map(mesh):
    C = M.Collection.create(
        lr_sum=M.Sum.from_output("lr"),
        lr_n=M.Count.from_output("lr"),
        loss=M.Average.from_output("loss"),
    )
    f = jax.jit(
        jax.shard_map(
            lambda b: (
                C.empty(num_shards=1).update(lr=0.5, loss=b).compute(axis_name="data")
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
            check_vma=True,
        )
    )
    out = f(jax.device_put(np.arange(16.0), NamedSharding(mesh, P("data"))))
    assert float(out["lr_sum"]) == 0.5 and int(out["lr_n"]) == 1
    assert float(out["loss"]) == 7.5


def test_states_keep_their_dtypes_with_x64():
    with jax.enable_x64(True):
        a = ALL.from_model_output(**make_batches("plain", np.random.default_rng(7))[0])
        e = ALL.empty(num_shards=1)
        for got, want in zip(jax.tree.leaves(a), jax.tree.leaves(e), strict=True):
            assert got.dtype == want.dtype
        assert {x.dtype for x in jax.tree.leaves(a)} == {
            np.dtype(np.float64),
            np.dtype(np.int64),
        }


def test_labels_outside_the_classes_are_misses_at_any_k():
    logits = np.array([[3.0, 2.0, 1.0]] * 4, np.float32)
    labels = np.array([-100, 5, 0, 1], np.int32)
    for k, want in ((1, 0.25), (2, 0.5), (3, 0.5)):
        m = M.Accuracy.top(k).from_model_output(logits=logits, labels=labels)
        assert float(m.compute()) == want, k


def test_a_nan_logit_is_never_a_hit_at_any_k():
    """A model that blew up (NaN logits) read as perfect top-k accuracy: NaN
    compares false, so nothing ranked above the label's NaN. A label whose
    logit is NaN is a miss, and a NaN elsewhere ranks above every number (as
    argmax takes it), at k = 1 and above, under jit too."""
    nan = np.nan
    logits = np.array(
        [
            [nan, nan, nan, nan],  # all NaN: a miss, whatever the label
            [nan, 1.0, 2.0, 3.0],  # the label's logit is NaN: a miss
            [3.0, nan, 2.0, 1.0],  # label 0: one NaN above it, then itself
            [3.0, 2.0, 1.0, 0.0],  # no NaN: a hit at any k
        ],
        np.float32,
    )
    labels = np.array([0, 0, 0, 0], np.int32)
    for k, want in ((1, 0.25), (2, 0.5), (3, 0.5), (4, 0.5)):
        fn = M.Accuracy.top(k).from_model_output
        for f in (fn, jax.jit(fn)):
            for dtype in (np.float32, jnp.bfloat16):
                m = f(logits=logits.astype(dtype), labels=labels)
                assert float(m.compute()) == want, (k, dtype)
        ints = fn(logits=np.array([[3, 1, 2]], np.int32), labels=np.array([2]))
        assert float(ints.compute()) == (1.0 if k >= 2 else 0.0)
    # all NaN, every label: nothing counts
    for k in (1, 3):
        m = M.Accuracy.top(k).from_model_output(
            logits=np.full((4, 4), nan, np.float32), labels=np.arange(4, dtype=np.int32)
        )
        assert float(m.compute()) == 0.0, k


def test_count_of_a_scalar_is_one_mask_or_not():
    C = M.Collection.create(n=M.Count.from_output("lr"))
    for mask in (None, np.arange(16) < 5):
        m = C.empty().update(lr=0.5, loss=np.ones(16), mask=mask)
        assert int(m.compute()["n"]) == 1


def test_a_sharded_carry_takes_a_scalar_and_unsharded_batches():
    m = M.Last.empty(num_shards=8).update(values=0.1).update(values=0.2)
    assert m.num_shards == 8 and float(m.compute()) == pytest.approx(0.2)
    a = M.Average.empty(num_shards=8).update(values=np.arange(16.0))
    assert a.num_shards == 8 and float(a.compute()) == 7.5


def test_a_declaration_with_the_defaults_is_the_class_itself():
    assert M.Accuracy.top(1) is M.Accuracy
    assert M.Average.from_output("values") is M.Average
    merged = M.Average.from_model_output(values=np.ones(2)).merge(
        M.Average.from_output("values").from_model_output(values=np.ones(2))
    )
    assert float(merged.compute()) == 1.0


def test_sum_and_count_of_nothing_are_zero():
    m = ALL.empty().update(**make_batches("all_masked", np.random.default_rng(0))[1])
    out = m.compute()
    assert float(out["total"]) == 0.0 and int(out["n"]) == 0
    assert np.isnan(float(out["mean"])) and np.isnan(float(out["hi"]))


def test_a_sum_over_many_merges_keeps_its_digits():
    """10^4 batches of 1e7 + noise over 8 shards are within 1e-7 of NumPy's
    float64 sum (2.8e-5 off before: each merge rounded the running total), and
    integers summed past 2**24 over 20,000 merges are exact (19,999 off)."""
    x = (1e7 + np.random.default_rng(0).normal(size=(10_000, 64))).astype(np.float32)
    run = jax.jit(
        lambda x: jax.lax.scan(
            lambda m, b: (m.update(values=b), None), M.Sum.empty(num_shards=8), x
        )[0].compute()
    )
    want = x.astype(np.float64).sum()
    assert float(run(x)) == pytest.approx(want, rel=1e-7)
    ints = np.tile(np.array([126, *[125] * 7], np.int32), (20_000, 1))
    assert ints.sum() == 20_020_000 > 2**24
    run = jax.jit(
        lambda x: jax.lax.scan(
            lambda m, b: (m.update(values=b), None), M.Sum.empty(num_shards=1), x
        )[0].compute()
    )
    assert float(run(ints)) == 20_020_000


@pytest.mark.slow
def test_a_collection_over_the_devices_of_several_processes():
    """2 processes x 2 devices, one global batch assembled from each process's
    part: every process computes the same exact values."""
    results = jh.launch_local(
        "mp_workers:metrics_across_processes", 2, 2, timeout=180, output=None
    )
    for r in results:
        for name, want in r["want"].items():
            rtol = 2e-4 if name == "loss_std" else 1e-5
            np.testing.assert_allclose(r["got"][name], want, rtol=rtol, err_msg=name)
    assert results[0]["got"] == results[1]["got"]


# ----- numbers a user can trust -------------------------------------------------------


def test_weights_given_to_a_metric_that_reads_none_are_refused():
    """Weights passed to an Average declared without weights are not dropped."""
    x = np.array([0.1, 0.5, 0.3], np.float32)
    w = np.array([1.0, 3.0, 0.0], np.float32)
    m = M.Average.empty().update(values=x)
    for name in ("weights", "weight", "sample_weight", "sample_weights"):
        with pytest.raises(ValueError, match=rf"ignores {name}=.*weights='{name}'"):
            m.update(values=x, **{name: w})
        with pytest.raises(ValueError, match=rf"Sum ignores {name}="):
            M.Sum.from_model_output(values=x, **{name: w})
    assert float(m.compute()) == pytest.approx(0.3)  # nothing recorded lost
    weighted = M.Average.from_output("values", weights="weights")
    got = weighted.empty().update(values=x, weights=w).compute()
    assert float(got) == pytest.approx((0.1 + 1.5) / 4)
    # In a Collection the output is fine once one member reads it, and refused
    # when none does.
    Both = M.Collection.create(loss=weighted, total=M.Sum.from_output("values"))
    out = Both.empty().update(values=x, weights=w).compute()
    assert float(out["loss"]) == pytest.approx(0.4)
    Plain = M.Collection.create(loss=M.Average, total=M.Sum)
    with pytest.raises(ValueError, match=r"no metric of this Collection reads"):
        Plain.empty().update(values=x, weights=w)


def test_integers_that_do_not_fit_the_state_are_refused_naming_the_value():
    """Without x64, int64 values beyond int32 and integers beyond float32's
    exact range (2**24) give an error instead of a wrapped or rounded result."""
    cases = [
        (M.Sum, np.array([2**40, 1]), "1099511627776"),
        (M.Average, np.array([2**32, 2**32]), "4294967296"),
        (M.Max, np.array([2**24 + 1]), "16777217"),
        (M.Min, np.array([-(2**24) - 1]), "-16777217"),
        (M.Std, [2**30, 0], "1073741824"),
        (M.Last, np.array([2**25], np.int32), "33554432"),
    ]
    for metric, values, shown in cases:
        with pytest.raises(ValueError, match=rf"{metric.__name__}: values .*({shown})"):
            metric.from_model_output(values=values)
    with pytest.raises(ValueError, match=r"jax_enable_x64"):
        M.Sum.from_model_output(values=np.array([2**40, 1]))
    m = M.Sum.empty().update(values=np.array([2, 3]))
    with pytest.raises(ValueError, match="Sum: values"):
        m.update(values=np.array([2**40]))
    assert float(m.compute()) == 5.0  # nothing recorded lost
    # in range: exact
    assert float(M.Max.from_model_output(values=np.array([2**24])).compute()) == 2**24
    assert float(M.Sum.from_model_output(values=np.array([-7, 9])).compute()) == 2.0


def test_integers_are_exact_with_x64():
    with jax.enable_x64(True):
        s = M.Sum.from_model_output(values=np.array([2**40, 1])).compute()
        assert int(s) == 2**40 + 1
        a = M.Average.from_model_output(values=np.array([2**32, 2**32])).compute()
        assert float(a) == 2**32
        hi = M.Max.from_model_output(values=np.array([2**24 + 1])).compute()
        assert int(hi) == 2**24 + 1
        with pytest.raises(ValueError, match=r"Max: values .*9007199254740993"):
            M.Max.from_model_output(values=np.array([2**53 + 1]))


def test_complex_values_are_refused_naming_the_metric():
    for metric in (M.Average, M.Sum, M.Max, M.Std, M.Last, M.Count):
        with pytest.raises(TypeError, match=rf"{metric.__name__}: values .*complex"):
            metric.from_model_output(values=np.array([1 + 2j, 3.0]))
    with pytest.raises(TypeError, match=r"Accuracy: logits .*complex"):
        M.Accuracy.from_model_output(
            logits=np.ones((2, 3), np.complex64), labels=np.zeros(2, np.int32)
        )
    with pytest.raises(TypeError, match=r"Average: values .*complex"):
        jax.jit(lambda v: M.Average.from_model_output(values=v))(
            jnp.ones(2, jnp.complex64)
        )


def test_an_ignored_label_predicted_as_itself_is_a_miss():
    """A -100 label predicted -100 is a miss, as with logits."""
    m = M.Accuracy.from_model_output(
        predictions=np.array([-100, 1, 2, -1]), labels=np.array([-100, 1, 3, -1])
    )
    assert float(m.compute()) == 0.25
    f = jax.jit(lambda p, y: M.Accuracy.from_model_output(predictions=p, labels=y))
    got = f(np.array([-100, 1], np.int32), np.array([-100, 1], np.int32)).compute()
    assert float(got) == 0.5


def test_a_label_beyond_int32_is_refused_not_wrapped_to_class_0():
    with pytest.raises(ValueError, match=r"Accuracy: labels .*4294967296"):
        M.Accuracy.from_model_output(
            logits=np.array([[1.0, 0.0]], np.float32), labels=np.array([2**32])
        )
    with jax.enable_x64(True):  # in range there: a label past the classes misses
        m = M.Accuracy.from_model_output(
            logits=np.array([[1.0, 0.0], [1.0, 0.0]]), labels=np.array([2**32, 0])
        )
        assert float(m.compute()) == 0.5
        p = M.Accuracy.from_model_output(
            predictions=np.array([0, 0]), labels=np.array([2**32, 0])
        )
        assert float(p.compute()) == 0.5


def test_a_count_past_int32_never_wraps():
    """Without x64 a count that passes 2**31 - 1 reads -1 (never a wrapped
    value) and an Accuracy over it NaN; with x64 counts are int64 and exact."""
    big = M.Count.from_model_output(values=np.ones(2**16, bool))
    m = big
    for _ in range(15):  # 2**31 examples
        m = m.merge(m)
    assert int(m.compute()) == -1
    assert int(m.merge(big).compute()) == -1  # and stays so
    shards = M.Count.from_model_output(values=np.ones(2**16, bool), num_shards=2)
    for _ in range(15):
        shards = shards.merge(shards)  # 2**30 per shard: the fold passes 2**31 - 1
    assert int(shards.compute()) == -1
    a = M.Accuracy.from_model_output(
        predictions=np.zeros(2**16, np.int32), labels=np.zeros(2**16, np.int32)
    )
    for _ in range(15):
        a = a.merge(a)
    assert np.isnan(float(a.compute()))
    with jax.enable_x64(True):
        m = M.Count.from_model_output(values=np.ones(2**16, bool))
        for _ in range(15):
            m = m.merge(m)
        assert int(m.compute()) == 2**31
        assert m.count.dtype == np.int64


def test_a_member_named_like_a_collection_method_is_refused():
    for name in ("update", "compute", "merge", "empty", "create", "_metrics", "_x"):
        with pytest.raises(ValueError, match=rf"'{name}'"):
            M.Collection.create(**{name: M.Sum, "n": M.Count})
    ok = M.Collection.create(total=M.Sum, n=M.Count)
    out = ok.empty().update(values=np.arange(4.0)).compute()
    assert float(out["total"]) == 6.0 and int(out["n"]) == 4


def test_a_float32_average_of_values_near_the_largest_float_stays_finite():
    big = np.float32(3e38)
    x = np.array([big, big, -big, big], np.float32)
    got = M.Average.from_model_output(values=x).compute()
    assert float(got) == pytest.approx(1.5e38, rel=1e-6)
    m = M.Average.empty(num_shards=4)
    for _ in range(3):
        m = m.update(values=np.full(8, big))
    assert float(m.compute()) == pytest.approx(3e38, rel=1e-6)
    w = M.Average.from_output("x", weights="w").from_model_output(
        x=np.array([big, big]), w=np.array([1.0, 3.0], np.float32)
    )
    assert float(w.compute()) == pytest.approx(3e38, rel=1e-6)


def test_an_output_named_like_weights_is_read_where_it_is_a_metrics_own():
    """Sum.from_output("weights") sums the weights: it reads them, so they are
    not refused as unread, alone or in a Collection."""
    w = np.array([1.0, 2.0, 4.0], np.float32)
    total = M.Sum.from_output("weights").from_model_output(weights=w)
    assert float(total.compute()) == 7
    got = M.Average.from_output("weight").empty().update(weight=w).compute()
    assert float(got) == pytest.approx(7 / 3)
    n = M.Count.from_output("sample_weight").from_model_output(sample_weight=w)
    assert int(n.compute()) == 3
    C = M.Collection.create(mean_w=M.Average.from_output("weights"), n=M.Count)
    out = C.empty().update(weights=w, values=np.ones(3)).compute()
    assert float(out["mean_w"]) == pytest.approx(7 / 3) and int(out["n"]) == 3
    with pytest.raises(ValueError, match=r"ignores weight="):  # another name still
        M.Sum.from_output("weights").from_model_output(weights=w, weight=w)


def test_unsigned_labels_never_match_a_negative_prediction():
    """uint32 labels 2**32 - 1 and 2**31 against int32 predictions -1 and -2**31
    are misses (the comparison does not wrap)."""
    labels = np.array([2**32 - 1, 2**31, 3], np.uint32)
    predictions = np.array([-1, -(2**31), 3], np.int32)
    m = M.Accuracy.from_model_output(predictions=predictions, labels=labels)
    assert float(m.compute()) == pytest.approx(1 / 3)
    f = jax.jit(lambda p, y: M.Accuracy.from_model_output(predictions=p, labels=y))
    assert float(f(predictions, labels).compute()) == pytest.approx(1 / 3)
    swapped = M.Accuracy.from_model_output(
        predictions=labels, labels=predictions.astype(np.int32)
    )
    assert float(swapped.compute()) == pytest.approx(1 / 3)


def test_a_float32_std_of_values_whose_squares_overflow_stays_finite(mesh):
    """Std of +-1e20 is 1e20 and of +-3e38 is 3e38 in float32, in one batch,
    merged over batches and shards, and on the 8-device mesh under jit."""
    for big in (1e20, 3e38):
        x = np.array([big, -big] * 8, np.float32)
        want = np.asarray(x, np.float64).std()
        got = M.Std.from_model_output(values=x).compute()
        assert float(got) == pytest.approx(want, rel=1e-6)
        m = M.Std.empty(num_shards=4)
        for chunk in np.split(x, 2):
            m = m.update(values=chunk)
        assert float(m.compute()) == pytest.approx(want, rel=1e-6)
        step = jax.jit(lambda m, v: m.update(values=v))
        sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
        m = step(step(M.Std.empty(num_shards=8), sharded), sharded)
        assert float(jax.jit(lambda m: m.compute())(m)) == pytest.approx(want, rel=1e-6)
    mixed = np.array([3e38, 3e38, -3e38, 1.0], np.float32)
    got = M.Std.from_model_output(values=mixed).compute()
    assert float(got) == pytest.approx(np.asarray(mixed, np.float64).std(), rel=1e-6)


def test_a_float32_std_keeps_its_digits_far_from_zero(mesh):
    """A constant has a std of exactly 0 (0.001 at 12345.678 before), and
    values 1e6 +- 1 merged over 4 batches of 8 shards are within float32
    rounding of NumPy (0.6% off before)."""
    step = jax.jit(lambda m, v: m.update(values=v))
    for c in (12345.678, 0.1):
        x = jax.device_put(np.full(64, c, np.float32), NamedSharding(mesh, P("data")))
        assert float(step(M.Std.empty(num_shards=8), x).compute()) == 0.0
    rng = np.random.default_rng(5)
    batches = [(1e6 + rng.normal(size=64)).astype(np.float32) for _ in range(4)]
    m = M.Std.empty(num_shards=8)
    for b in batches:
        m = step(m, jax.device_put(b, NamedSharding(mesh, P("data"))))
    want = np.concatenate(batches).astype(np.float64).std()
    assert float(m.compute()) == pytest.approx(want, rel=1e-3)


def test_a_float32_std_of_a_spread_of_a_few_float32_steps_keeps_its_digits(mesh):
    """Values 1e7 +- 3 (float32's step there is 1) merged over 64 batches of 8
    shards and over 512 batches of one value per shard, are within 1e-5 of NumPy's
    float64 std (each group's mean rounded to a float32 made it up to 9% off,
    0.9% in the first case; NumPy's float32 two-pass std is 1e-4 off)."""
    rng = np.random.default_rng(0)
    x = (1e7 + rng.normal(size=4096)).astype(np.float32)
    want = x.astype(np.float64).std()
    step = jax.jit(lambda m, v: m.update(values=v))
    m = M.Std.empty(num_shards=8)
    for b in np.split(x, 64):
        m = step(m, jax.device_put(b, NamedSharding(mesh, P("data"))))
    assert float(jax.jit(lambda m: m.compute())(m)) == pytest.approx(want, rel=1e-5)
    m = M.Std.empty(num_shards=8)
    for b in np.split(x, 512):
        m = step(m, b)
    assert float(m.compute()) == pytest.approx(want, rel=1e-5)
    ints = (1e7 + rng.choice([-3.0, 3.0], size=512)).astype(np.float32)
    m = M.Std.empty()
    for b in np.split(ints, 64):
        m = m.update(values=b)
    assert float(m.compute()) == pytest.approx(ints.astype(np.float64).std(), rel=1e-5)


def test_a_float32_std_over_many_merges_keeps_its_digits():
    """10^5 batches of 64 normal values merged in a scan are within 1e-5 of
    NumPy's float64 std (4e-4 off before: each merge rounded the shares and
    the std, which the next merge squared)."""
    x = np.random.default_rng(0).normal(size=(100_000, 64)).astype(np.float32)
    run = jax.jit(
        lambda x: jax.lax.scan(
            lambda m, b: (m.update(values=b), None), M.Std.empty(num_shards=1), x
        )[0].compute()
    )
    assert float(run(x)) == pytest.approx(x.astype(np.float64).std(), rel=1e-5)


def test_a_float32_average_over_many_merges_keeps_its_digits():
    """10^5 batches of 1e4 + normal noise merged in a scan, and the same over
    8 shards folded, are within 2 float32 steps of NumPy's float64 mean (9
    steps off before: each merge rounded the weighted shares of both means)."""
    x = (1e4 + np.random.default_rng(0).normal(size=(100_000, 64))).astype(np.float32)
    want = x.astype(np.float64).mean()
    step = float(np.spacing(np.float32(want)))
    for shards in (1, 8):
        run = jax.jit(
            lambda x, shards=shards: jax.lax.scan(
                lambda m, b: (m.update(values=b), None),
                M.Average.empty(num_shards=shards),
                x,
            )[0].compute()
        )
        assert abs(float(run(x)) - want) <= 2 * step


def test_an_average_of_means_near_the_float32_limits_stays_finite():
    """Batches whose means are near +-3e38 merge without overflow, and
    equal means merge to exactly that mean."""
    big = np.float32(3e38)
    m = M.Average.empty().update(values=np.array([big, big], np.float32))
    m = m.merge(M.Average.empty().update(values=np.array([-big, -big], np.float32)))
    assert float(m.compute()) == 0.0
    m = M.Average.empty().update(values=np.array([big], np.float32))
    m = m.merge(M.Average.empty().update(values=np.array([big], np.float32)))
    assert float(m.compute()) == float(big)


class DeclaredMetrics(jh.metrics.Collection):
    loss: jh.metrics.Average.from_output("loss")
    accuracy: jh.metrics.Accuracy


def test_a_collection_declared_as_a_class_is_a_dataclass_pytree():
    import dataclasses

    assert dataclasses.is_dataclass(DeclaredMetrics)
    assert [f.name for f in dataclasses.fields(DeclaredMetrics)] == ["loss", "accuracy"]
    logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 2.0]])
    labels = jnp.array([0, 1, 1, 1])
    loss = jnp.array([1.0, 2.0, 3.0, 6.0])

    @jax.jit
    def step(m, loss, logits, labels):
        return m.update(loss=loss, logits=logits, labels=labels)

    m = step(DeclaredMetrics.empty(), loss, logits, labels)
    out = m.compute()
    assert float(out["loss"]) == 3.0 and float(out["accuracy"]) == 0.75
    leaves = jax.tree.leaves(m)
    again = jax.tree.unflatten(jax.tree.structure(m), leaves)
    assert type(again) is DeclaredMetrics and float(again.compute()["loss"]) == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.loss = None
    one_line = jh.metrics.Collection.create(
        loss=jh.metrics.Average.from_output("loss"), accuracy=jh.metrics.Accuracy
    )
    assert dataclasses.is_dataclass(one_line)
    assert set(one_line.empty()._metrics) == {"loss", "accuracy"}


def test_a_declared_collection_refuses_what_is_not_a_metric():
    with pytest.raises(TypeError, match="x= must be a metric class"):

        class Bad(jh.metrics.Collection):
            x: int

    with pytest.raises(ValueError, match="'merge' would hide"):

        class Hiding(jh.metrics.Collection):
            merge: jh.metrics.Sum


class SumOfSquares(M.Metric):
    """A metric written only with the public override points."""

    total: jax.Array

    @classmethod
    def identity(cls, n):
        return {"total": jnp.zeros(n, jnp.float32)}

    @classmethod
    def from_batch(cls, batch, outputs):
        v, w = batch.values("values")
        return cls(total=jnp.sum(jnp.where(w, v * v, 0), axis=1))

    def combine(self, other):
        return self.replace(total=self.total + other.total)

    def result(self):
        return self.total[0]


def test_a_metric_written_with_public_overrides_under_jit_and_shard_map(mesh):
    x = np.arange(32, dtype=np.float32)
    mask = np.arange(32) % 3 != 0
    expected = float(np.sum(x[mask] ** 2))
    sharded = NamedSharding(mesh, P("data"))
    xs, ms = jax.device_put((x, mask), sharded)
    step = jax.jit(lambda m, v, k: m.update(values=v, mask=k))
    m = step(SumOfSquares.empty(num_shards=8), xs, ms)
    m = step(m, xs, ms)
    assert float(jax.jit(lambda m: m.compute())(m)) == 2 * expected
    in_map = jax.jit(
        jax.shard_map(
            lambda m, v, k: m.update(values=v, mask=k).compute(axis_name="data"),
            mesh=mesh,
            in_specs=(P("data"), P("data"), P("data")),
            out_specs=P(),
            check_vma=True,
        )
    )
    local = jax.device_put(SumOfSquares.empty(num_shards=8), sharded)
    assert float(in_map(local, xs, ms)) == expected
    declared = M.Collection.create(sq=SumOfSquares, total=M.Sum)
    out = declared.empty().update(values=xs, mask=ms).compute()
    assert float(out["sq"]) == expected and float(out["total"]) == x[mask].sum()


def test_a_metric_missing_an_override_names_it():
    class Half(M.Metric):
        total: jax.Array

        @classmethod
        def identity(cls, n):
            return {"total": jnp.zeros(n)}

    with pytest.raises(NotImplementedError, match="Half must define from_batch"):
        Half.from_model_output(values=jnp.ones(4))
    with pytest.raises(NotImplementedError, match="Half must define result"):
        Half.empty(1).compute()


def test_values_may_be_passed_positionally_as_clu_and_metrax_users_write():
    """``Average.from_model_output(values, mask=...)``: the positional value is
    the output the metric reads (``values``, or its ``from_output`` name)."""
    v = jnp.array([1.0, 2.0, 6.0])
    mask = jnp.array([True, True, False])
    m = jh.metrics.Average.from_model_output(v, mask=mask)
    assert float(m.compute()) == 1.5
    assert float(m.update(jnp.array([4.5])).compute()) == 2.5
    loss = jh.metrics.Average.from_output("loss")
    assert float(loss.from_model_output(v).compute()) == 3.0
    assert float(jh.metrics.Std.from_model_output(v).compute()) == pytest.approx(
        float(np.std([1.0, 2.0, 6.0])), rel=1e-6
    )


def test_a_positional_value_that_cannot_be_placed_is_refused_naming_why():
    v = jnp.ones(3)
    with pytest.raises(TypeError, match="values.*twice"):
        jh.metrics.Average.from_model_output(v, values=v)
    with pytest.raises(TypeError, match="one positional"):
        jh.metrics.Average.from_model_output(v, v)
    with pytest.raises(TypeError, match="by name.*logits.*labels"):
        jh.metrics.Accuracy.from_model_output(v)


def test_metrax_spelling_of_weights_is_not_silently_ignored():
    """metrax writes sample_weights=: refused, never an unweighted mean."""
    x = np.array([1.0, 4.0], np.float32)
    with pytest.raises(ValueError, match="sample_weights"):
        M.Average.from_model_output(x, sample_weights=np.array([1.0, 0.0], np.float32))
    weighted = M.Average.from_output("values", weights="sample_weights")
    got = weighted.from_model_output(x, sample_weights=np.array([1.0, 0.0], np.float32))
    assert float(got.compute()) == 1.0


def test_flax_struct_dataclass_on_a_metric_or_collection_is_accepted():
    """CLU users keep @flax.struct.dataclass on their classes: it changes nothing."""
    from flax import struct

    @struct.dataclass
    class Metrics(M.Collection):
        loss: M.Average.from_output("loss")

    @struct.dataclass
    class Top(M.Sum):
        pass

    m = Metrics.empty().update(loss=np.array([1.0, 3.0], np.float32))
    assert float(m.compute()["loss"]) == 2.0
    assert (
        float(Top.from_model_output(np.array([2.0, 5.0], np.float32)).compute()) == 7.0
    )
    assert jax.tree.structure(m) == jax.tree.structure(Metrics.empty())


def test_an_infinity_in_an_earlier_batch_gives_an_infinite_average_in_any_order():
    """Finding: Average of [inf, 1] then [2, 3] was NaN (the other order inf):
    merging a mean of inf computed inf - inf."""
    from jaxhistory import metrics as M

    for first, second, want in [
        ([np.inf, 1], [2, 3], np.inf),
        ([2, 3], [np.inf, 1], np.inf),
        ([-np.inf, 1], [2, 3], -np.inf),
        ([np.inf, 1], [-np.inf, 3], np.nan),
    ]:
        got = (
            M.Average.empty()
            .update(np.float32(first))
            .update(np.float32(second))
            .compute()
        )
        np.testing.assert_equal(float(got), want)


def test_average_weights_that_add_up_to_zero_give_nan_not_a_wrong_number():
    """Finding: a batch (or a running total) whose weights summed to 0 with
    negative weights was dropped: weights [1, -1] then [1, 1] over [1, 5] and
    [2, 4] gave 3.0 (NumPy 1.0). The mean of such a state is undefined: NaN.
    Negative weights whose totals stay away from 0 are exact."""
    from jaxhistory import metrics as M

    avg = M.Average.from_output("loss", weights="w")
    f = np.float32
    cases = [
        [([1, 5], [1, -1]), ([2, 4], [1, 1])],
        [([1.0], [1]), ([5.0], [-1]), ([3.0], [1])],
    ]
    for batches in cases:
        m = avg.empty()
        for loss, w in batches:
            m = m.update(loss=f(loss), w=f(w))
        assert np.isnan(float(m.compute()))
    m = avg.empty().update(loss=f([1, 5, 3]), w=f([1, -3, 1]))
    np.testing.assert_allclose(
        float(m.compute()), np.average([1, 5, 3], weights=[1, -3, 1])
    )
