"""HistoryState against a reference model, over seeded random operation sequences.

Each sequence drives a pool of states (every one a branch that later operations
may update again) with updates, packed rows, extends, merges, selections,
attrs, pickle, deep-copy and pytree round trips, and bad input at random
points. After every operation the state it made, and at the end every state of
the pool, is compared with a model: ``{name: [(step, value), ...]}`` plus each
metric's expected dtype and shape, ``next_step`` and ``attrs``.

The dtype rule checked is the one docs/history.md ("The record: HistoryState",
Values) states: Python floats are float64, Python ints int64, Python bools
bool; NumPy and JAX dtypes are kept, except float16/bfloat16, stored as
float32; a metric given values of another dtype takes NumPy's promotion of the
two (so an integer metric that receives a Python float is float64), except
that a Python int or bool recorded into a metric that already holds floats is
stored as float64; and an integer is never rounded: a value (new or already
recorded) that the promoted dtype cannot hold exactly is a ValueError and the
state is unchanged. ``merge`` follows ``common_dtype`` (int64 beside uint64
stays integer where the values allow). Bad input must raise the documented
error type and leave the state equal to a pickled copy taken before, and to
its model.
"""

from __future__ import annotations

import copy
import math
import pickle
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhistory as jh

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
F64 = np.dtype(np.float64)

# name -> kind of the values it gets (fixed per name, so branches merge)
KINDS = {
    "loss": "pyfloat",
    "lr": "pyfloat",
    "train/acc": "pyfloat",
    "train/tokens": "pyint",
    "train/ok": "pybool",
    "mix": "mixed",  # Python ints and floats: int64 until the first float
    "eval/f32": "np:float32",
    "eval/f16": "np:float16",
    "eval/deep/i64": "np:int64x",  # int64 extremes
    "eval/deep/u64": "np:uint64x",  # uint64 near 2**64
    "eval/i8": "np:int8",
    "eval/b": "np:bool",
    "f32i": "f32int",  # float32 values, Python ints now and then
    "j/f32": "jax:float32",
    "j/bf16": "jax:bfloat16",
    "j/i32": "jax:int32",
    "vec": "arr:float64:3",
    "grid": "arr:int32:2x2",
}
NAMES = list(KINDS)
GROUPS = [
    ("loss", "lr"),
    ("loss", "lr", "train/acc"),
    ("train/tokens", "mix"),
    ("eval/f32", "eval/i8", "vec"),
    ("j/f32", "j/bf16", "j/i32"),
]
PACKED = [("pk/a", "pk/b", "pk/c"), ("pk2/x", "pk2/y")]
STORE = {"float16": np.dtype(np.float32), "bfloat16": np.dtype(np.float32)}


TICK = [0]  # the operation being modelled (when names were first recorded)


class Model:
    """What a state should hold: records per name, dtypes, shapes, order."""

    def __init__(self):
        self.recs: dict[str, list] = {}  # name -> [(step, value)] in step order
        self.dtypes: dict[str, np.dtype] = {}
        self.shapes: dict[str, tuple] = {}
        # name -> when first recorded: names come in that order (within one
        # update, in any order: nested dicts flatten sorted)
        self.order: dict[str, int] = {}
        self.next_step = 0
        self.attrs: dict = {}

    def copy(self) -> Model:
        m = Model()
        m.recs = {k: list(v) for k, v in self.recs.items()}
        m.dtypes, m.shapes = dict(self.dtypes), dict(self.shapes)
        m.order, m.next_step, m.attrs = (
            dict(self.order),
            self.next_step,
            dict(self.attrs),
        )
        return m

    def last_step(self, name):
        recs = self.recs.get(name)
        return recs[-1][0] if recs else None


class Refused(Exception):
    """The model says the operation must raise this error type."""

    def __init__(self, *errors):
        super().__init__(", ".join(e.__name__ for e in errors))
        self.error = errors


def contrib(value, current):
    """The dtype ``value`` brings to a metric whose dtype is ``current``."""
    if type(value) is bool or type(value) is int:
        if current is not None and current.kind == "f":
            return F64  # docs: a Python int (or bool) into a float metric
        if type(value) is bool:
            return np.dtype(bool)
        if not INT64_MIN <= value <= INT64_MAX:
            raise Refused(ValueError)
        return np.dtype(np.int64)
    if type(value) is float:
        return F64
    if isinstance(value, str) or value is None:
        raise Refused(TypeError)
    dtype = np.dtype(value.dtype)
    return STORE.get(dtype.name, dtype)


def exact_in(values, dtype) -> bool:
    """Whether ``dtype`` holds every integer among ``values`` exactly."""
    if dtype.kind != "f":
        return True
    for v in values:
        if type(v) is bool or isinstance(v, np.bool_ | bool):
            continue
        if type(v) is int or np.asarray(v).dtype.kind in "iu":
            ints = np.asarray(v).reshape(-1).tolist() if type(v) is not int else [v]
            for i in ints:
                try:
                    if int(np.asarray(i, dtype).item()) != i:
                        return False
                except OverflowError:
                    return False
    return True


def shape_of(value):
    return () if type(value) in (int, float, bool) else tuple(np.shape(value))


def model_record(m: Model, step: int, row: dict) -> Model:
    """``m`` with ``row`` (name -> value) recorded at ``step``, or Refused with
    every error type the row deserves (the docs do not say which check of
    several comes first)."""
    if step > INT64_MAX or step < INT64_MIN:
        raise Refused(ValueError)
    out, errors = m.copy(), set()
    for name, value in row.items():
        current = m.dtypes.get(name)
        last = m.last_step(name)
        if name == "step" or (last is not None and step <= last):
            errors.add(ValueError)
        if current is not None and m.shapes[name] != shape_of(value):
            errors.add(ValueError)
        try:
            new = contrib(value, current)
        except Refused as r:
            errors.update(r.error)
            continue
        if current is not None:
            new = np.result_type(current, new)
        old_values = [v for _, v in m.recs.get(name, [])]
        if new.kind == "f" and not exact_in([*old_values, value], new):
            errors.add(ValueError)
        out.dtypes[name], out.shapes[name] = new, shape_of(value)
        out.recs.setdefault(name, []).append((step, value))
        if name not in out.order:
            out.order[name] = TICK[0]
    if errors:
        raise Refused(*errors)
    out.next_step = max(m.next_step, step + 1)
    return out


def merge_dtype(a: np.dtype, b: np.dtype, values) -> np.dtype:
    out = np.result_type(a, b)
    if out.kind == "f" and a.kind in "iub" and b.kind in "iub":
        ints = [int(x) for v in values for x in np.asarray(v).reshape(-1).tolist()]
        if ints and min(ints) >= INT64_MIN and max(ints) <= INT64_MAX:
            return np.dtype(np.int64)
        if not ints or min(ints) >= 0:
            return np.dtype(np.uint64)
        raise Refused(ValueError)
    return out


def model_merge(a: Model, b: Model) -> Model:
    out = a.copy()
    span = max(b.order.values(), default=0) + 1  # b's new names: after a's
    for name in b.order:
        if name not in a.recs:
            out.recs[name] = list(b.recs[name])
            out.dtypes[name], out.shapes[name] = b.dtypes[name], b.shapes[name]
            out.order[name] = TICK[0] + b.order[name] / span
            continue
        by_step = dict(a.recs[name])
        by_step.update(b.recs[name])  # other's record wins
        out.recs[name] = sorted(by_step.items(), key=lambda r: r[0])
        values = [v for _, v in out.recs[name]]
        dtype = merge_dtype(a.dtypes[name], b.dtypes[name], values)
        if not exact_in(values, dtype):
            raise Refused(ValueError)
        out.dtypes[name] = dtype
    out.next_step = max(a.next_step, b.next_step)
    return out


def model_select(m: Model, prefixes) -> Model:
    heads = [p.rstrip("/") for p in prefixes]
    keep = {
        n: g
        for n, g in m.order.items()
        if any(n == h or n.startswith(h + "/") for h in heads)
    }
    out = Model()
    out.recs = {n: list(m.recs[n]) for n in keep}
    out.dtypes = {n: m.dtypes[n] for n in keep}
    out.shapes = {n: m.shapes[n] for n in keep}
    out.order, out.next_step, out.attrs = keep, m.next_step, dict(m.attrs)
    return out


def same_attr(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_attr(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_attr, a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    return type(a) is type(b) and a == b


def check(s: jh.HistoryState, m: Model, full: bool = True) -> None:
    """``s`` holds exactly what ``m`` says."""
    assert s.next_step == m.next_step
    assert set(s.keys) == set(m.order) and len(s) == len(m.order)
    groups = [m.order[n] for n in s.keys]
    assert groups == sorted(groups), (s.keys, m.order)
    assert same_attr(dict(s.attrs), m.attrs), (dict(s.attrs), m.attrs)
    every = set()
    for name in m.order:
        assert name in s
        recs = m.recs[name]
        steps, values = s.records(name)
        want_steps = [st for st, _ in recs]
        every.update(want_steps)
        assert steps.dtype == np.int64 and steps.tolist() == want_steps, name
        dtype = m.dtypes[name]
        assert s.dtype(name) == dtype and values.dtype == dtype, (name, values.dtype)
        assert s.shape(name) == m.shapes[name] and values.shape[1:] == m.shapes[name]
        assert s.count(name) == len(recs) and s.last_step(name) == want_steps[-1]
        assert not values.flags.writeable
        if full:
            want = np.array([np.asarray(v).astype(dtype) for _, v in recs])
            want = want.reshape(len(recs), *m.shapes[name])
            eq_nan = dtype.kind == "f"
            assert np.array_equal(values, want, equal_nan=eq_nan), (name, values, want)
            last = np.asarray(s.last(name))
            assert np.array_equal(last, want[-1], equal_nan=eq_nan)
    assert s.all_steps().tolist() == sorted(every)


# ----- random values -----------------------------------------------------------


def rand_value(rng: random.Random, name: str):
    kind = KINDS[name]
    special = [math.nan, math.inf, -math.inf, 0.0, -0.0]
    if kind == "pyfloat":
        return rng.choice(special) if rng.random() < 0.15 else rng.uniform(-10, 10)
    if kind == "pyint":
        return rng.choice(
            [0, 1, -5, 2**53 + 1, INT64_MAX, INT64_MIN, rng.randrange(1000)]
        )
    if kind == "pybool":
        return rng.random() < 0.5
    if kind == "mixed":
        return rng.randrange(-1000, 1000) if rng.random() < 0.5 else rng.uniform(-5, 5)
    if kind == "f32int":  # Python ints and bools into a float32 metric
        r = rng.random()
        if r < 0.1:
            return r < 0.05
        return rng.randrange(2**25) if r < 0.4 else np.float32(rng.random())
    if kind.startswith("np:"):
        dt = kind[3:]
        if dt == "int64x":
            return np.int64(rng.choice([INT64_MAX, INT64_MIN, 0, -1, 2**53 + 1]))
        if dt == "uint64x":
            # past int64 only: beside int64 values float64 would round each
            return np.uint64(rng.choice([2**64 - 1, 2**64 - 2, 2**63 + 1, 2**63 + 5]))
        if dt == "bool":
            return np.bool_(rng.random() < 0.5)
        if dt == "int8":
            return np.int8(rng.choice([-128, 127, 0, 3]))
        v = rng.choice([math.nan, math.inf, 65504.0, rng.uniform(-2, 2)])
        return np.dtype(dt).type(v)
    if kind.startswith("jax:"):
        dt = kind[4:]
        if dt == "int32":
            return jnp.int32(rng.choice([2**31 - 1, -(2**31), 5]))
        return jnp.asarray(rng.choice([math.nan, 1.5, -0.25, math.inf]), dt)
    _, dt, shape = kind.split(":")
    shape = tuple(int(x) for x in shape.split("x"))
    arr = np.array([rng.uniform(-100, 100) for _ in range(math.prod(shape))])
    if rng.random() < 0.2 and dt.startswith("float"):
        arr[0] = math.nan
    return arr.astype(dt).reshape(shape)


def column(rng: random.Random, name: str, k: int) -> np.ndarray:
    """``k`` records of ``name`` as one array, for extend."""
    kind = KINDS[name]
    vals = [rand_value(rng, name) for _ in range(max(k, 1))][:k]
    dtype = np.asarray(rand_value(rng, name)).dtype
    if kind in ("mixed", "f32int"):
        return np.array(
            [float(v) for v in vals], np.float64 if kind == "mixed" else np.float32
        )
    if kind.startswith("jax:"):
        return jnp.stack(vals) if vals else jnp.zeros(0, kind[4:])
    if kind == "pyint":
        return np.array(vals, np.int64)
    if kind.startswith("np:"):
        return np.array(vals, dtype=dtype)
    return np.array(vals, dtype).reshape(k, *np.shape(rand_value(rng, name)))


def nest(rng: random.Random, row: dict) -> dict:
    """``row`` as a dict whose names are split into nested dicts at random."""
    out: dict = {}
    for name, value in row.items():
        parts = name.split("/")
        cut = rng.randrange(len(parts))  # how many leading parts become dict levels
        node = out
        for part in parts[:cut]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return dict(row)  # collides with a flat name: keep it flat
        key = "/".join(parts[cut:])
        if key in node:
            return dict(row)
        node[key] = value
    return out


def pick_step(rng: random.Random, m: Model, names, valid: bool):
    """A step for recording ``names``: past each one's last (valid) or not."""
    lasts = [m.last_step(n) for n in names if m.last_step(n) is not None]
    if not valid and lasts:
        return rng.choice(lasts) - rng.randrange(3)
    low = max(lasts) + 1 if lasts else -5
    if rng.random() < 0.5 or low > m.next_step:
        return m.next_step + rng.randrange(3)
    return rng.randrange(low, m.next_step + 1)


# ----- operations -------------------------------------------------------------


def op_update(rng, s, m):
    if rng.random() < 0.6:  # key sets that repeat take the fast paths
        names = list(GROUPS[0] if rng.random() < 0.5 else rng.choice(GROUPS))
    else:
        names = rng.sample(NAMES, rng.randrange(0, 6))
    row = {n: rand_value(rng, n) for n in names}
    bad = rng.random() < 0.15
    if bad:
        which = rng.randrange(7)
        if which == 0:
            row[rng.choice(names or ["x"])] = "text"
        elif which == 1:
            row[rng.choice(names or ["x"])] = None
        elif which == 2 and "vec" in m.dtypes:
            row["vec"] = np.zeros(4)
        elif which == 3 and m.dtypes.get("train/tokens") == np.int64:
            row["train/tokens"] = rng.choice([2**63, -(2**63) - 1])
        elif which == 4 and m.dtypes.get("eval/deep/i64") is not None:
            row["eval/deep/i64"] = np.uint64(2**64 - 1)
        elif which == 5 and m.dtypes.get("loss") is not None:
            row["loss"] = 2**53 + 1  # a float metric cannot hold it
        elif which == 6 and m.dtypes.get("eval/deep/u64") is not None:
            row["eval/deep/u64"] = -3
    how = rng.randrange(4)  # no step, step=, a "step" entry, an "iter" entry
    step = m.next_step if how == 0 else pick_step(rng, m, row, rng.random() > 0.1)
    try:
        want = model_record(m, step, row)
    except Refused as r:
        want = r
    metrics = nest(rng, row)
    call = [
        (metrics, None),
        (metrics, step),
        ({"step": step, **metrics}, None),
        ({**metrics, "iter": step}, None),
    ][how]
    return lambda st: st.update(*call), want


def op_bad_name(rng, s, m):
    kind = rng.randrange(3)
    if kind == 0:
        metrics = {"ok\udc80": 1.0}
    elif kind == 1:
        metrics = {"a/b": 1.0, "a": {"b": 2.0}}
    else:
        metrics = {"step": 1, "loss": 1.0}
        return lambda st: st.update(metrics, step=m.next_step + 5), Refused(ValueError)
    return lambda st: st.update(metrics), Refused(ValueError)


def op_packed(rng, s, m):
    names = rng.choice(PACKED)
    dt = rng.choice(["float32", "int32", "float64", "float16", "jax"])
    vals = [rng.choice([1.5, -2.0, 7.0, math.nan]) for _ in names]
    if dt == "jax":
        vector = jnp.asarray(vals, jnp.float32)
    elif dt == "int32":
        vector = np.array([0 if math.isnan(v) else v for v in vals]).astype(dt)
    else:
        vector = np.array(vals, dt)
    vector_dt = np.dtype(vector.dtype)
    step = pick_step(rng, m, names, valid=rng.random() > 0.1)
    if rng.random() < 0.05:
        vector = vector[:-1]  # too few values
        return lambda st: st.update_packed(names, vector, step=step), Refused(
            ValueError
        )
    row = {
        n: vector_dt.type(v) if dt != "jax" else jnp.float32(v)
        for n, v in zip(names, vector.tolist(), strict=True)
    }
    try:
        want = model_record(m, step, row)
    except Refused as r:
        want = r
    return lambda st: st.update_packed(names, vector, step=step), want


def op_extend(rng, s, m):
    names = rng.sample([n for n in NAMES if KINDS[n] != "f32int"], rng.randrange(1, 4))
    k = rng.randrange(0, 5)
    start = pick_step(rng, m, names, valid=rng.random() > 0.1)
    steps = [start + i * rng.randrange(1, 3) for i in range(k)]
    values = {n: column(rng, n, k) for n in names}
    bad = rng.random() < 0.1
    if bad and k >= 2:
        which = rng.randrange(3)
        if which == 0:
            steps[1] = steps[0]
        elif which == 1:
            steps = [float(x) + 0.5 for x in steps]
        else:
            values[names[0]] = values[names[0]][:-1]
        return lambda st: st.extend(steps, values), Refused(ValueError)
    if k == 0:
        return lambda st: st.extend(np.zeros(0, np.int64), values), m
    want = m
    try:
        for i, st in enumerate(steps):
            want = model_record(want, st, {n: np.asarray(values[n])[i] for n in names})
    except Refused as r:
        want = r
    return lambda st: st.extend(np.asarray(steps), values), want


def op_attrs(rng, s, m):
    value = rng.choice([1, 0.5, math.nan, "run-1", [1, 2, [3]], {"a": [math.nan]}])
    key = rng.choice(["run", "seed", "cfg"])
    want = m.copy()
    want.attrs[key] = copy.deepcopy(value)

    def apply(st):
        out = st.with_attrs(**{key: value})
        if isinstance(value, list):
            value.append("changed later")  # the state keeps its own copy
        return out

    return apply, want


def fresh_other(rng, m):
    """A new state (and its model) with records at steps that ``m``'s names
    have too, with other values."""
    o, om = jh.HistoryState(), Model()
    names = [n for n in m.order if not n.startswith("pk")] or ["loss"]
    for _ in range(rng.randrange(1, 4)):
        row = {n: rand_value(rng, n) for n in rng.sample(names, min(2, len(names)))}
        steps = [st for n in row for st, _ in m.recs.get(n, [])]
        last = max([om.last_step(n) or -10 for n in row])
        later = [st for st in steps if st > last]
        step = rng.choice(later) if later else last + 1
        try:
            om = model_record(om, step, row)
        except Refused:
            continue
        o = o.update(row, step=step)
    check(o, om)
    return o, om


def check_pickles(s, m):
    for again in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s), copy.copy(s)):
        assert again == s and hash(again) == hash(s)
        check(again, m, full=False)
    leaves, treedef = jax.tree.flatten(s)
    back = jax.tree.unflatten(treedef, leaves)
    assert back == s
    got = jax.device_get(s)
    assert got == s
    return back


def run_sequence(seed: int, log: list, n_ops: int = 20) -> dict:
    rng = random.Random(seed)
    pool = [(jh.HistoryState(), Model())]
    counts: dict[str, int] = {}
    for _ in range(n_ops):
        # mostly the newest state, sometimes an older one (a branch)
        r = rng.random()
        if r < 0.6:
            i = len(pool) - 1
        elif r < 0.8:  # a recent one: its tables have likely grown since
            i = max(len(pool) - rng.randrange(2, 4), 0)
        else:
            i = rng.randrange(len(pool))
        s, m = pool[i]
        TICK[0] += 1
        r = rng.random()
        if r < 0.45:
            name, (apply, want) = "update", op_update(rng, s, m)
        elif r < 0.52:
            name, (apply, want) = "bad_name", op_bad_name(rng, s, m)
        elif r < 0.62:
            name, (apply, want) = "packed", op_packed(rng, s, m)
        elif r < 0.74:
            name, (apply, want) = "extend", op_extend(rng, s, m)
        elif r < 0.82:
            o, om = pool[rng.randrange(len(pool))]
            if rng.random() < 0.5:  # records at steps m has: other's must win
                o, om = fresh_other(rng, m)
            name = "merge"
            try:
                want = model_merge(m, om)
            except Refused as e:
                want = e

            def apply(st, o=o):
                return st.merge(o)
        elif r < 0.87:
            prefixes = rng.sample(
                ["train", "eval", "eval/deep/", "pk", "j", "loss", "nope"], 2
            )
            name, want = "select", model_select(m, prefixes)

            def apply(st, prefixes=prefixes):
                return st.select(*prefixes)
        elif r < 0.92:
            name, (apply, want) = "attrs", op_attrs(rng, s, m)
        else:
            name = "roundtrip"
            log.append(f"{name} of #{i}")
            s = check_pickles(s, m)
            pool.append((s, m))
            counts[name] = counts.get(name, 0) + 1
            continue
        log.append(
            f"{name} of #{i}: " + (str(want) if isinstance(want, Refused) else "ok")
        )
        if isinstance(want, Refused):
            before = pickle.loads(pickle.dumps(s))
            with pytest.raises(want.error):
                apply(s)
            assert s == before
            check(s, m)
            name += "_refused"
        else:
            new = apply(s)
            check(new, want)
            pool.append((new, want))
        counts[name] = counts.get(name, 0) + 1
    for s, m in pool:  # every branch still holds what it held
        check(s, m)
    last_state, last_model = pool[-1]
    assert last_state == pickle.loads(pickle.dumps(last_state))
    if rng.random() < 0.1:
        back = jh.HistoryState.from_xarray(last_state.to_xarray())
        assert back == last_state
        check(back, last_model)
    return counts


def test_history_state_matches_its_model_over_random_operation_sequences():
    t0 = time.perf_counter()
    totals: dict[str, int] = {}
    for seed in range(250):
        log: list[str] = []
        try:
            counts = run_sequence(seed, log)
        except AssertionError as err:
            ops = "; ".join(log)
            raise AssertionError(f"seed={seed}, after {ops}: {err}") from err
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    # every kind of operation ran, valid and refused
    for kind in ("update", "update_refused", "bad_name_refused", "packed", "extend"):
        assert totals.get(kind, 0) > 20, totals
    for kind in ("extend_refused", "merge", "select", "attrs", "roundtrip"):
        assert totals.get(kind, 0) > 5, totals
    assert time.perf_counter() - t0 < 60, totals
