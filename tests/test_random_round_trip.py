"""A seeded, randomized round trip: random runs recorded through History (random
metric names, values of every kind History takes, steps with gaps, metrics that
start late or stop, attached values, refused names), then read back by every
reader of a saved run (the JSONL log, resume from the log and from the dataset,
the command line's summary, the dataset file), each compared with the history's
state value by value, bit for bit, with the dtypes the docs give each reader."""

import contextlib
import io
import math
import random
import re
import string

import jax.numpy as jnp
import numpy as np
import pytest
from test_export import _cli as run_cli  # the command in a fresh process

import jaxhistory as jh
from jaxhistory import cli
from jaxhistory._names import STEP_KEYS, printable
from jaxhistory.export._markdown import stats_table

SEEDS = range(10)
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # NumPy's too
# What no terminal or report may show raw: control characters (a newline
# only as the end of a line) and bidirectional-text controls.
RAW_CONTROL = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)

# ----- random names ------------------------------------------------------------------
PARTS = [
    *"abcxyz", "loss", "train", "eval", "é", "ß", "λΩ", "日本語", "e\u0301",  # not NFC
    "\uff21", "0", "42", "007", "1e5", "-0", "NaN", "inf", "0x1F", "3.14", "1_000",
    " ", "a b", " lead", "trail ", "\u3000", "%", "%2F", "a%b", "_", ".", "..",
    "...", "~", "|", "*x*", "$x$", "[l](u)", "#", ":", "\\", "step", "std", "mean",
    "\x1b[2J", "\n", "a\tb", "\r", "\x7f", "\x85", "\u202e", "\u200f", "\u2028",
    "\x07",
]  # fmt: skip
REFUSED = ["\udc80", "\ud800", "x\udfffy", "\x00"]  # lone surrogates, NUL


def _part(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.05:
        return rng.choice("xé") * rng.randint(130, 300)  # past netCDF's 255 bytes
    if roll < 0.12:
        return ""  # an empty segment, or a leading or trailing '/'
    if roll < 0.2:
        return "".join(rng.choices(string.ascii_letters + string.digits, k=6))
    return rng.choice(PARTS)


def _name(rng: random.Random, refused: bool = False) -> str:
    parts = [_part(rng) for _ in range(rng.choice([1, 1, 2, 2, 3, 4]))]
    if refused:
        parts[rng.randrange(len(parts))] += rng.choice(REFUSED)
    return "/".join(parts)


def _names(rng: random.Random, count: int, taken: set) -> list[str]:
    out = []
    while len(out) < count:
        name = _name(rng)
        if name and name not in taken and name not in STEP_KEYS:  # "": refused
            taken.add(name)
            out.append(name)
    return out


# ----- random values -----------------------------------------------------------------
F64 = [
    math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, -5e-324,
    2.2250738585072014e-308, 2.225073858507201e-308, 1e308, -1e308,
    1.7976931348623157e308, 0.1, 1 / 3, 2.0**53 + 2, -1e-300,
]  # fmt: skip
I64 = [0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1, -(2**53 + 1), 2**31, -(2**31) - 1]
F32 = [math.nan, math.inf, -math.inf, -0.0, 1e-45, -1e-45, 1.1754942e-38,
       3.4028235e38, -3.4028235e38, 0.1, 1 / 3]  # fmt: skip
F16 = [math.nan, math.inf, -0.0, 6e-8, 65504.0, -65504.0, 0.1, 1e-5]
KINDS = [
    "f64", "i64", "bool", "np_bool", "u64", "u64_small", "f32", "f16", "i8", "u32",
    "jax_f32", "jax_i32", "jax_bf16", "jax_bool", "array", "jax_array", "widen",
]  # fmt: skip
ARRAY_DTYPES = [np.float64, np.float32, np.int32, np.uint64, np.bool_, np.int16]


def _f64(rng: random.Random) -> float:
    if rng.random() < 0.4:
        return rng.choice(F64)
    return rng.choice([1.0, -1.0]) * math.ldexp(rng.random(), rng.randint(-1074, 1023))


def _scalar(rng: random.Random, kind: str, count: int):
    """A value of ``kind``; ``count``: how many records the metric has."""
    if kind == "f64":
        return _f64(rng)
    if kind == "i64":
        return (
            rng.choice(I64) if rng.random() < 0.5 else rng.randint(-(2**63), 2**63 - 1)
        )
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "np_bool":
        return np.bool_(rng.random() < 0.5)
    if kind == "u64":
        return np.uint64(2**64 - 1 - rng.randint(0, 2**12) if rng.random() < 0.8 else 7)
    if kind == "u64_small":  # int64 holds them: only the log's mark says uint64
        return np.uint64(rng.choice([0, 1, 2**63 - 1, rng.randint(0, 2**63 - 1)]))
    if kind == "f32":
        return np.float32(rng.choice(F32) if rng.random() < 0.5 else _f64(rng) % 1e6)
    if kind == "f16":
        return np.float16(rng.choice(F16) if rng.random() < 0.5 else rng.random())
    if kind == "i8":
        return np.int8(rng.randint(-128, 127))
    if kind == "u32":
        return np.uint32(rng.randint(0, 2**32 - 1))
    if kind == "jax_f32":
        return jnp.float32(rng.choice(F32))
    if kind == "jax_i32":
        return jnp.int32(rng.randint(-(2**31), 2**31 - 1))
    if kind == "jax_bf16":
        return jnp.bfloat16(rng.choice([*F16[:5], rng.random(), 3e38]))
    if kind == "jax_bool":
        return jnp.bool_(rng.random() < 0.5)
    if kind == "widen":  # integers, then floats: the metric becomes float64
        return rng.randint(-(2**53), 2**53) if count < 3 else _f64(rng)
    raise AssertionError(kind)


def _array(rng: random.Random, dtype, shape: tuple) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == np.uint64:
        flat = [
            2**64 - 1 - rng.randint(0, 9) if rng.random() < 0.7 else 3 for _ in range(n)
        ]
    elif dtype == np.bool_:
        flat = [rng.random() < 0.5 for _ in range(n)]
    elif np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        flat = [
            rng.choice([info.min, info.max, rng.randint(info.min, info.max)])
            for _ in range(n)
        ]
    else:
        flat = [rng.choice(F32) if dtype == np.float32 else _f64(rng) for _ in range(n)]
    return np.array(flat, dtype=dtype).reshape(shape)


class Metric:
    def __init__(self, rng: random.Random, name: str, updates: int):
        self.name = name
        self.kind = rng.choice(KINDS)
        self.shape = rng.choice([(1,), (3,), (2, 2), (2, 1, 3)])
        self.dtype = rng.choice(
            ARRAY_DTYPES if self.kind == "array" else ARRAY_DTYPES[1:3]
        )
        start = rng.randrange(updates) if rng.random() < 0.4 else 0  # appears late
        stop = rng.randrange(start, updates) + 1 if rng.random() < 0.4 else updates
        self.window = range(start, stop)  # and may stop early
        self.density = rng.choice([1.0, 0.7, 0.3])
        self.count = 0

    def value(self, rng: random.Random):
        self.count += 1
        if self.kind in ("array", "jax_array"):
            value = _array(rng, self.dtype, self.shape)
            return jnp.asarray(value) if self.kind == "jax_array" else value
        return _scalar(rng, self.kind, self.count)


# ----- comparing a read-back state with the history's ------------------------------


def _log_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a JSONL log gives back for a metric recorded as ``dtype``:
    floats float64, bools bool, uint64 uint64, other integers int64."""
    if dtype.kind == "f":
        return np.dtype(np.float64)
    if dtype.kind == "b" or dtype == np.uint64:
        return dtype
    return np.dtype(np.int64)


def _assert_same(state: jh.HistoryState, back: jh.HistoryState, reader: str, log: bool):
    """``back`` holds exactly what ``state`` recorded: the same metrics, steps,
    shapes and values (floats bit for bit, -0.0 and subnormals included; NaN
    where NaN was recorded), with the dtype each reader documents (``log``: the
    JSONL dtypes of :func:`_log_dtype`; otherwise the recorded ones)."""
    assert set(back.keys) == set(state.keys), (reader, set(back.keys) ^ set(state.keys))
    for key in state.keys:
        where = f"{reader}: {key!r}"
        np.testing.assert_array_equal(back.steps(key), state.steps(key), err_msg=where)
        want = state.values(key)
        dtype = _log_dtype(want.dtype) if log else want.dtype
        got = back.values(key)
        assert got.dtype == dtype and got.shape == want.shape, (
            where,
            got.dtype,
            got.shape,
        )
        want = want.astype(dtype)  # exact: float32 and ints widen without rounding
        if dtype.kind == "f":
            nan = np.isnan(want)
            np.testing.assert_array_equal(np.isnan(got), nan, err_msg=where)
            got, want = np.where(nan, 0.0, got), np.where(nan, 0.0, want)
        assert got.tobytes() == want.tobytes(), (where, got, want)
    assert back.next_step == state.next_step, reader


def _summary(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["summary", *args]) == 0
    return out.getvalue()


def _check_shown(text: str, what: str) -> None:
    """No raw control character in ``text``."""
    assert RAW_CONTROL.search(text) is None, (what, RAW_CONTROL.search(text))


# ----- the run ------------------------------------------------------------------------


def _record(seed: int, tmp_path):
    """Records a random run; returns its History, closed."""
    rng = random.Random(seed)
    updates = rng.randint(8, 30)
    taken: set = set()
    metrics = [Metric(rng, n, updates) for n in _names(rng, rng.randint(6, 16), taken)]
    attached = _names(rng, 3, taken)
    h = jh.History(
        distributed_history=False, report_dir=tmp_path / "run", run_name="fz"
    )
    step = rng.choice([0, 5, -7, 2**40])
    for u in range(updates):
        step += rng.choice([1, 1, 1, 2, 17, 1000])
        present = [m for m in metrics if u in m.window and rng.random() < m.density]
        rng.shuffle(present)
        cut = rng.randint(0, len(present)) if rng.random() < 0.25 else len(present)
        if rng.random() < 0.3:  # attached for the next update's step
            h.attach({rng.choice(attached): _f64(rng)})
        for group in (present[:cut], present[cut:]):  # a second update: an eval
            if not group:
                continue
            row = {m.name: m.value(rng) for m in group}
            if rng.random() < 0.15:  # a name no file can hold: refused, nothing lost
                bad = _name(rng, refused=True)
                before = h.state
                with pytest.raises(ValueError, match="lone surrogate|NUL") as info:
                    h.update({**row, bad: 1.0}, step=step, summarize=False)
                said = str(info.value)
                assert repr(printable(bad)) in said and not RAW_CONTROL.search(said), (
                    said
                )
                assert h.state == before
            line = h.update(row, step=step, summarize=rng.random() < 0.3)
            assert RAW_CONTROL.search(line) is None, line
            if rng.random() < 0.1:  # a step recorded again: refused, naming the metric
                again = group[0]
                before = h.state
                with pytest.raises(ValueError) as info:
                    h.update({again.name: again.value(rng)}, step=step, summarize=False)
                said = str(info.value)  # the name as repr() or printable() shows it
                named = (repr(again.name), repr(printable(again.name)))
                assert any(n in said for n in named) and not RAW_CONTROL.search(said), (
                    said
                )
                assert h.state == before
    h.close()
    return h


@pytest.mark.parametrize("seed", SEEDS)
def test_random_runs_read_back_exactly_by_every_reader(seed, tmp_path):
    h = _record(seed, tmp_path)
    state = h.state
    assert len(state.keys) >= 3
    log = h.log_path
    _assert_same(state, jh.HistoryState.from_jsonl(log), "from_jsonl", log=True)
    _assert_same(state, jh.export.from_jsonl(log), "export.from_jsonl", log=True)
    text = _summary(str(log), "--warmup", "0")
    assert text == "\n".join(stats_table(state, 0)) + "\n"
    _check_shown(text, "summary")
    resumed = jh.History(distributed_history=False, resume=log)
    _assert_same(state, resumed.state, "resume from the log", log=True)
    resumed.close()

    h.finalize(plot=False)
    out = tmp_path / "run"
    _assert_same(
        state, jh.HistoryState.from_netcdf(out / "dataset.nc"), "from_netcdf", log=False
    )
    assert jh.HistoryState.from_netcdf(out / "dataset.nc").keys == state.keys
    resumed = jh.History(distributed_history=False, resume=out)
    _assert_same(state, resumed.state, "resume from the dataset", log=False)
    resumed.close()
    _check_shown((out / "report.md").read_text(), "report.md")
    _check_shown(_summary(str(out / "dataset.nc")), "summary of the dataset")
    _assert_same(
        state, jh.HistoryState.from_jsonl(log), "the log after finalize", log=True
    )


def test_the_command_shows_names_with_control_characters_escaped(tmp_path):
    """In a fresh process, as a user runs it: the names of a random run with
    control characters in them are shown escaped, never raw."""
    h = _record(3, tmp_path)
    out = run_cli("summary", h.log_path, "--warmup", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "\n".join(stats_table(h.state, 0)) + "\n"
    assert RAW_CONTROL.search(out.stdout) is None
    assert any(RAW_CONTROL.search(k) for k in h.state.keys)  # there was one to escape
