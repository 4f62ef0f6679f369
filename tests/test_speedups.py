"""The compiled host-path helpers (``jaxhistory/_speedups.c``) against the
Python they stand in for.

Each helper must give what its Python form gives, or decline (None or
NotImplemented) where the caller then takes the Python form: same rows, same
states, same log bytes, same summary lines. Random inputs (hypothesis) cover
the edges: non-floats, NaN and inf, steps at the int64 limits, keys that
differ by type, names that break the log's fast split, values whose decimals
sit on a rounding tie. The ``host_path`` fixture (conftest) also runs the
History tests of the fast path both ways.
"""

import gc
import math
import os
import string
import threading
import time

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxhistory as jh
from jaxhistory import (
    _codec,
    _compiled,
    _fan_out,
    _history_state,
    _recorder,
    _summary,
    _writer,
)
from jaxhistory._history_state import Appender
from jaxhistory._record import Batch
from jaxhistory._row import Repeat, Row, RowKind, parse_row, queued, repeated
from jaxhistory._summary import SummaryLine
from jaxhistory._table import STAGE, Table

C = _compiled.speedups
FINITE = RowKind.FINITE_FLOATS
SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_compiled_helpers_are_built():
    """``make test`` installs from source with a C compiler: the helpers must
    be there (a build that failed would leave every update on the slower
    Python path without a word), unless turned off on purpose."""
    if os.environ.get("JAXHISTORY_PURE_PYTHON", "").strip() not in ("", "0"):
        assert C is None
    else:
        assert C is not None, "jaxhistory._speedups was not built (a C compiler?)"


def test_pure_python_can_be_chosen_in_the_environment():
    import importlib.util
    import subprocess
    import sys

    code = "import jaxhistory._compiled as c; print(c.speedups is None)"
    built = importlib.util.find_spec("jaxhistory._speedups") is not None
    # (this process may run with the variable set: what is built decides)
    for value, pure in (("1", "True"), ("0", str(not built)), ("", str(not built))):
        env = dict(os.environ, JAXHISTORY_PURE_PYTHON=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        )
        assert out.stdout.strip() == pure, (value, out.stderr)


needs_c = pytest.mark.skipif(C is None, reason="JAXHISTORY_PURE_PYTHON is set")

# --- repeated -----------------------------------------------------------------

NAMES = ["a", "b", "loss", "lr"]
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    st.just(np.float64(1.5)),
    st.just(np.float32(2.5)),
)
steps = st.one_of(
    st.integers(-5, 20),
    st.sampled_from([2**63 - 2, 2**63 - 1, 2**63, -(2**63), 2**64]),
    st.booleans(),
    st.floats(0, 10),
    st.none(),
    st.just(np.int64(3)),
)


@st.composite
def repeats_and_dicts(draw):
    names = st.lists(st.sampled_from(NAMES), max_size=4, unique=True)
    names = tuple(draw(names))
    at = draw(st.sampled_from([None, 0, -1]))
    keys = names if at is None else (("step", *names) if at == 0 else (*names, "step"))
    repeat = Repeat(keys, names, at)
    # the next dict: the same keys (mostly), maybe reordered, extended or cut
    forms = ["same"] * 6 + ["shuffled", "extra", "fewer", "int_key"]
    form = draw(st.sampled_from(forms))
    new_keys = list(keys)
    if form == "shuffled":
        new_keys = draw(st.permutations(keys))
    elif form == "extra":
        new_keys.append("zz")
    elif form == "fewer" and new_keys:
        new_keys.pop()
    elif form == "int_key" and new_keys:
        new_keys[0] = 0
    metrics = {}
    for k in new_keys:
        if k == "step":
            metrics[k] = draw(steps)
        else:
            metrics[k] = draw(st.one_of(st.floats(-1e6, 1e6), values))
    return repeat, metrics


@needs_c
@SETTINGS
@given(
    repeats_and_dicts(),
    st.one_of(st.integers(0, 30), st.sampled_from([2**63 - 1, 2**63])),
    st.one_of(st.none(), steps),
)
def test_repeated_compiled_gives_the_python_row_or_none(case, next_step, step):
    repeat, metrics = case
    want = repeated(repeat, metrics, next_step, 1.5, step)
    got = C.repeated(repeat, metrics, next_step, 1.5, step, Row, FINITE)
    if got is None and want is not None:  # declined: only values near the range
        assert any(abs(v) > 2.0**1000 for v in want.values)
    else:
        assert got == want
    if want is not None:
        assert type(got) is Row and got.kind is FINITE and got.label == "step"
        assert all(type(v) is float for v in got.values)
        assert type(got.step) is int


@needs_c
def test_repeated_compiled_leaves_values_near_floats_range_to_python():
    """The Python form takes the row as finite floats where ``sum(values,
    0.0)`` is finite, and from Python 3.12 that sum is compensated: near
    float's range it may overflow where a plain sum does not. The compiled
    form takes only values of at most 2**1000 (no sum of them overflows) and
    leaves larger ones to the Python form, which a History then runs."""
    big = 1.7976931348623157e308
    for values in ((big, 9e291, 9e291), (big, 9e291), (-big, -9e291), (2.0**1001,)):
        names = tuple("abc"[: len(values)])
        repeat = Repeat(names, names, None)
        metrics = dict(zip(names, values, strict=True))
        assert C.repeated(repeat, metrics, 0, 1.5, None, Row, FINITE) is None
    edge = {"a": 2.0**1000, "b": -(2.0**1000), "c": 2.0**1000}
    repeat = Repeat(("a", "b", "c"), ("a", "b", "c"), None)
    got = C.repeated(repeat, edge, 0, 1.5, None, Row, FINITE)
    assert got == repeated(repeat, edge, 0, 1.5, None) and got is not None
    for use_c in (True, False):  # a History records them the same either way
        saved = _recorder.speedups
        _recorder.speedups = C if use_c else None
        try:
            h = jh.History(distributed_history=False)
            for s in range(4):
                h.update({"a": big, "b": 9e291 * s})
            assert h.state.values("a").tolist() == [big] * 4
        finally:
            _recorder.speedups = saved


@needs_c
def test_repeated_compiled_declines_what_is_not_a_plain_dict():
    repeat = Repeat(("a",), ("a",), None)

    class D(dict):
        pass

    for metrics in (D(a=1.0), [("a", 1.0)], {"a": 1.0, "b": 2.0}, {}):
        assert C.repeated(repeat, metrics, 0, 0.0, None, Row, FINITE) is None
    assert C.repeated(Repeat((), (), None), {}, 0, 0.0, None, Row, FINITE) is None
    # only the step entry: no values, as the Python form
    only_step = Repeat(("step",), (), 0)
    assert repeated(only_step, {"step": 3}, 0, 0.0) is None
    assert C.repeated(only_step, {"step": 3}, 0, 0.0, None, Row, FINITE) is None
    with pytest.raises(TypeError):
        C.repeated(repeat, {"a": 1.0})


@needs_c
def test_repeated_compiled_declines_keys_that_are_not_plain_str():
    """Comparing a str subclass may run Python code, which could change the
    dict under the compiled loop: such keys are left to the Python path,
    which gives the same row."""

    class Name(str):
        def __eq__(self, other):
            metrics.clear()  # what a comparison may do
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    repeat = Repeat(("a", "b"), ("a", "b"), None)
    metrics = {Name("a"): 1.0, "b": 2.0}
    assert C.repeated(repeat, metrics, 0, 0.0, None, Row, FINITE) is None
    assert len(metrics) == 2
    plain = Repeat((Name("a"), "b"), ("a", "b"), None)
    assert C.repeated(plain, {"a": 1.0, "b": 2.0}, 0, 0.0, None, Row, FINITE) is None
    h = jh.History(distributed_history=False)
    for s in range(4):
        h.update({Name("a"): float(s), "b": 2.0})
    assert h.state.values("a").tolist() == [0.0, 1.0, 2.0, 3.0]


# --- queued, unqueued and the log's lines ----------------------------------------


@needs_c
@SETTINGS
@given(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False))
def test_queued_compiled_holds_what_python_queues(with_step, step, stamp):
    """The compiled form queues (dict, step, time) where the Python form puts
    step and time into the dict; both resolve to the same record."""
    metrics = {"loss": 0.5, "lr": 1e-3}
    if with_step:
        metrics = {"step": step, **metrics}
    row = Row(step, ("loss", "lr"), (0.5, 1e-3), FINITE, stamp)
    want = queued(row, metrics)
    got = C.queued(metrics, 2, step, stamp)
    assert got == ({"loss": 0.5, "lr": 1e-3}, step, stamp)
    assert want == {"loss": 0.5, "lr": 1e-3, 0: step, 1: stamp}
    assert metrics.get("step", step) == step  # the caller's dict is kept
    assert not gc.is_tracked(got)  # thousands may wait in the log's queue
    fan = _fan_out.FanOut([])
    for rows in ([got, got], [dict(want), dict(want)], [got, dict(want)]):
        batch = fan._resolve(rows)
        assert batch.steps == [step, step] and batch.stamps == [stamp, stamp]
        assert batch.metrics == [{"loss": 0.5, "lr": 1e-3}] * 2


@needs_c
def test_queued_compiled_tracks_what_may_hold_a_cycle():
    holder = {"a": 1.0}
    holder["self"] = [holder]  # (not a fast-path dict: still queued safely)
    item = C.queued(holder, 2, 3, 0.5)
    assert gc.is_tracked(item)
    assert gc.is_tracked(C.queued({"a": 1.0}, 1, 3, object()))


name_chars = st.sampled_from(list(string.ascii_letters + '{},:"\\ é_/'))
log_names = st.one_of(
    st.text(name_chars, min_size=1, max_size=6),
    st.text(name_chars, max_size=2).map(lambda t: t + "},{"),
)


@needs_c
@SETTINGS
@given(
    st.lists(log_names, min_size=1, max_size=4, unique=True),
    st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=5),
    st.one_of(st.none(), st.text(max_size=5)),
    st.data(),
)
def test_the_log_lines_compiled_match_python(names, step_list, run_id, data):
    k = len(step_list)
    floats = st.floats(allow_nan=False, allow_infinity=False)
    stamp = st.one_of(st.none(), st.floats(0, 2e9))
    metrics = [{n: data.draw(floats) for n in names} for _ in range(k)]
    stamps = [data.draw(stamp) for _ in range(k)]

    def batch():
        b = Batch(list(step_list), list(stamps), [dict(m) for m in metrics])
        b.finite, b.run_id, b.process_index = True, run_id, 3
        return b

    with_c = _codec.encode_records(batch())
    saved = _codec.speedups
    try:
        _codec.speedups = None
        without = _codec.encode_records(batch())
    finally:
        _codec.speedups = saved
    assert with_c == without
    lines = [orjson.loads(x) for x in with_c.splitlines()]
    assert [x["metrics"] for x in lines] == metrics
    assert [x["step"] for x in lines] == step_list


@needs_c
def test_lines_declines_text_it_cannot_split():
    both = orjson.dumps([[1, 2], [0.5, None]])
    heads = (b"<", b"|", b"|", b">\n")
    assert C.lines(b'[{"a":1},{"b":2}]', both, 2, *heads) == (
        b'<1|0.5|"a":1>\n<2|null|"b":2>\n'
    )
    assert C.lines(b'[{"a":1},{"b":2}]', both, 3, *heads) is None  # k too big
    assert C.lines(b'[{"a":1}]', both, 2, *heads) is None  # too few dicts
    assert C.lines(b'[{"},{":1},{"b":2}]', both, 2, *heads) is None  # a name holds it
    assert C.lines(b"[]", both, 2, *heads) is None
    with pytest.raises(TypeError):
        C.lines("text", both, 2, *heads)


# --- the summary line ------------------------------------------------------------

tricky_floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-1e13, 1e13),
    st.floats(-1e-5, 1e-5),
    # halves at the last shown decimal, and their neighbours
    st.integers(-(10**12), 10**12).map(lambda i: (i + 0.5) / 10**6),
    st.integers(-(10**7), 10**7).map(lambda i: math.nextafter((i + 0.5) / 10**6, 0)),
    st.sampled_from([0.0, -0.0, 5e-7, 4.9999999e-7, 2.5e-7, 1.0000005]),
    st.sampled_from([2.0**40, 2.0**40 + 0.5, 2.0**53, 1e22, 5e-324]),
)


@needs_c
@SETTINGS
@given(
    st.lists(tricky_floats, min_size=1, max_size=6),
    st.integers(0, 20),
    st.integers(-(2**63), 2**63 - 1),
)
def test_the_summary_line_compiled_matches_python(values, precision, step):
    names = tuple(f"m{i}" for i in range(len(values)))
    row = Row(step, names, tuple(values), FINITE)

    def line(use_c):
        saved = _summary.speedups
        _summary.speedups = C if use_c else None
        try:
            summary = SummaryLine()
            summary.format_floats(row, precision)  # the first makes the template
            return summary.format_floats(row, precision)
        finally:
            _summary.speedups = saved

    assert line(True) == line(False)


@needs_c
def test_fixed_line_writes_each_value_as_percent_format_does():
    pieces = (b"step=", b" a=", b" \xc3\xa9=")
    for value in (0.5, -0.0, 1e300, -2.5e-7, 123456.0000005, 0.1 + 0.2):
        for p in (0, 1, 6, 12, 13, 30):
            got = C.fixed_line(pieces, 7, (1.0, value), p)
            text = f"%.{p}f" % value
            if value != 0 and not text.strip("-0."):
                assert got is None  # shown as zero: the caller writes e-notation
            else:
                assert got == f"step=7 a={1.0:.{p}f} é={text}"
    assert C.fixed_line(pieces, 2**63, (1.0, 2.0), 6) is None  # step past int64
    assert C.fixed_line(pieces, 1, (1.0, 2), 6) is None  # an int: not this form
    with pytest.raises(ValueError):
        C.fixed_line(pieces, 1, (1.0,), 6)
    with pytest.raises(ValueError):
        C.fixed_line(pieces, 1, (1.0, 2.0), -1)


def test_a_name_is_shown_escaped_on_the_compiled_line_too(host_path):
    """Control characters and lone surrogates in a name are escaped
    (printable), so the compiled line's UTF-8 text always encodes."""
    names = ("a\ud800", "b\x1b[31m", "é")
    summary = SummaryLine()
    row = Row(1, names, (0.5, 1.5, 2.5), FINITE)
    summary.format_floats(row, 3)
    assert summary.format_floats(row, 3) == (
        "step=1 a\\ud800=0.500 b\\x1b[31m=1.500 é=2.500"
    )


# --- staging, moving, the writer -------------------------------------------------


@needs_c
def test_move_floats_fills_the_arrays_as_move_stage_does():
    def staged(n):
        state = jh.HistoryState()
        for s in range(n):
            state = state.update({"a": float(s), "b": -float(s) / 3})
        return state

    for n in (1, 5, STAGE - 1):
        state = staged(n)
        table, _ = state.data.tables[("a", "b")]
        with table.lock:
            assert C.move_floats(table) is True
            assert table.rows == [] and table.fill == n
        assert state.values("b").tolist() == [-float(s) / 3 for s in range(n)]
        assert state.steps("a").tolist() == list(range(n))
    # a float32 table, or rows of other values: left to move_stage
    for dtype, row in ((np.float32, (1.5, 2.5)), (np.float64, (1.5, np.float64(2)))):
        table = Table(("a", "b"), (np.dtype(dtype),) * 2, ((), ()))
        assert C.stage(table, 0, 7, row, STAGE) == 1
        with table.lock:
            assert C.move_floats(table) is False
            assert len(table.rows) == 1
            table.move_stage()
        assert table.fill == 1 and table.values[1][0] == row[1]
    empty = Table(("a",), (np.dtype(np.float64),), ((),))
    with empty.lock:
        assert C.move_floats(empty) is False


@needs_c
def test_stage_declines_a_table_another_state_appended_to():
    state = jh.HistoryState().update({"a": 1.0})
    table, n = state.data.tables[("a",)]
    assert C.stage(table, n, 5, (2.0,), STAGE) == 1
    assert C.stage(table, n, 6, (3.0,), STAGE) == 0  # n rows no more
    assert C.stage(table, n + 1, 6, (3.0,), 3) == 2  # and now the stage is full
    with pytest.raises(AttributeError):
        C.stage(object(), 0, 0, (1.0,), STAGE)


@needs_c
def test_take_declines_with_nothing_done_where_the_python_take_decides():
    ap = Appender()
    m = {"a": 1.0}
    assert C.take(ap, m, 0.0, None, Row, FINITE, STAGE) is None  # no repeat yet
    for s in range(2):  # the second goes onto the first's table: remembered
        row = parse_row(m, next_step=s)
        ap.append(row)
        ap.remember(m, row)
    got = C.take(ap, {"a": 2.0}, 0.0, None, Row, FINITE, STAGE)
    assert got == Row(2, ("a",), (2.0,), FINITE, 0.0)
    assert ap.state.count("a") == 3  # read: no table held until the next append
    assert C.take(ap, {"a": 3.0}, 0.0, None, Row, FINITE, STAGE) is NotImplemented
    assert ap.take({"a": 3.0}, 0.0) is not None  # the Python take goes on
    assert C.take(ap, {"a": 4.0}, 0.0, None, Row, FINITE, STAGE) is not None
    assert C.take(ap, {"b": 4.0}, 0.0, None, Row, FINITE, STAGE) is None
    assert ap.state.values("a").tolist() == [1.0, 1.0, 2.0, 3.0, 4.0]


class _Target:
    def __init__(self):
        self.items = []

    def write(self, items, final):
        self.items += items


@needs_c
def test_add_compiled_queues_wakes_and_refuses_as_writer_add_does():
    w = _writer.Writer(_Target())
    try:
        woken = []
        w._wake_thread = lambda: woken.append(1)
        for i in range(w.WAKE_AT):
            C.add(w, {"i": i}, _writer.WriterClosed)
        assert woken == [1] and w.pending() == w.WAKE_AT
        pressed = []
        w._backpressure = lambda: pressed.append(w.pending())
        for i in range(w.MAX_PENDING - w.WAKE_AT):
            C.add(w, {"i": i}, _writer.WriterClosed)
        assert pressed == [w.MAX_PENDING]
    finally:
        del w._wake_thread
        w.close()
    assert len(w.target.items) == w.MAX_PENDING
    with pytest.raises(_writer.WriterClosed):
        C.add(w, {"i": 0}, _writer.WriterClosed)
    assert len(w.target.items) == w.MAX_PENDING


@needs_c
def test_add_compiled_loses_nothing_beside_takes_and_a_close_on_other_threads():
    """The compiled add() takes no lock: items added on one thread while
    others flush (take the queue) and one closes the writer are each written
    once, in order, or refused once it is closed."""
    w = _writer.Writer(_Target())
    added, refused = [], []
    stop = threading.Event()

    def flush():
        while not stop.is_set():
            w.flush()

    flushers = [threading.Thread(target=flush) for _ in range(2)]
    for t in flushers:
        t.start()

    def close_soon():
        time.sleep(0.3)
        w.close()

    closer = threading.Thread(target=close_soon)
    closer.start()
    try:
        deadline = time.monotonic() + 30
        i = 0
        while time.monotonic() < deadline:
            try:
                C.add(w, i, _writer.WriterClosed)
                added.append(i)
            except _writer.WriterClosed:
                refused.append(i)
                break
            i += 1
    finally:
        stop.set()
        closer.join()
        for t in flushers:
            t.join()
    w.close()
    assert refused and added
    assert w.target.items == added  # each once, in order
    assert refused[0] == added[-1] + 1


# --- whole runs, both ways --------------------------------------------------------

updates = st.lists(
    st.one_of(
        st.fixed_dictionaries({"loss": st.floats(-10, 10), "lr": st.just(0.1)}),
        st.fixed_dictionaries(
            {"loss": st.floats(allow_nan=True, allow_infinity=True), "lr": st.just(0.1)}
        ),
        st.fixed_dictionaries({"step": st.integers(0, 400), "loss": st.floats(-1, 1)}),
        st.fixed_dictionaries({"acc": st.integers(0, 5)}),
        st.just("read"),
    ),
    min_size=1,
    max_size=300,
)


def _host_modules():
    import importlib

    from conftest import HOST_PATH_MODULES

    return [importlib.import_module(f"jaxhistory.{n}") for n in HOST_PATH_MODULES]


def test_the_fixtures_switch_every_module_that_calls_the_helpers():
    """host_path, these tests and bench_history turn the helpers off module
    by module: a module that calls them and is missing from the list would
    keep its compiled path in the runs meant to be Python alone."""
    import pathlib
    import re

    from conftest import HOST_PATH_MODULES

    root = pathlib.Path(jh.__file__).parent
    calling = sorted(
        p.stem
        for p in root.rglob("*.py")
        if "from jaxhistory._compiled import speedups" in p.read_text()
    )
    assert calling == sorted(HOST_PATH_MODULES)
    bench = (root.parent / "benchmarks" / "bench_history.py").read_text()
    listed = re.search(r"modules = \(([^)]*)\)", bench)
    assert listed is not None
    assert sorted(n.strip() for n in listed[1].split(",") if n.strip()) == calling


def _run(tmp_path, sequence, use_c, tag):
    modules = _host_modules()
    saved = {m: m.speedups for m in modules}
    for module in saved:
        module.speedups = C if use_c else None
    lines, errors = [], []
    try:
        h = jh.History(distributed_history=False, jsonl_path=tmp_path / f"{tag}.jsonl")
        for m in sequence:
            if m == "read":
                h.state  # noqa: B018 (a read between updates)
                continue
            try:
                lines.append(h.update(dict(m)))
            except ValueError as err:  # a step behind: refused the same way
                errors.append(str(err))
        h.close()
        state = h.state
    finally:
        for module, value in saved.items():
            module.speedups = value
    log = []
    path = tmp_path / f"{tag}.jsonl"  # (no update: no log)
    for line in path.read_bytes().splitlines() if path.exists() else []:
        record = orjson.loads(line)
        record.pop("timestamp")
        record.pop("run_id", None)
        log.append(record)
    return lines, errors, state, log


@needs_c
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(updates)
def test_a_run_records_logs_and_summarizes_the_same_compiled_or_not(
    tmp_path_factory, sequence
):
    tmp_path = tmp_path_factory.mktemp("both")
    a = _run(tmp_path, sequence, True, "c")
    b = _run(tmp_path, sequence, False, "py")
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
    assert a[2].keys == b[2].keys
    for key in a[2].keys:
        np.testing.assert_array_equal(a[2].steps(key), b[2].steps(key))
        np.testing.assert_array_equal(a[2].values(key), b[2].values(key))


@needs_c
def test_the_compiled_update_marks_the_log_failed_when_queueing_raises(tmp_path):
    """A row recorded whose line could not be queued (Ctrl-C in the
    back-pressure wait): finalize must write the log from the history."""
    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "m.jsonl")
    for s in range(3):
        h.update({"a": float(s)})
    writer = h._recorder.out.writer

    def interrupted():
        raise KeyboardInterrupt

    writer._backpressure = interrupted
    writer.MAX_PENDING = 0
    with pytest.raises(KeyboardInterrupt):
        h.update({"a": 3.0})
    assert h._recorder.out.failed
    del writer._backpressure
    writer.MAX_PENDING = _writer.Writer.MAX_PENDING
    assert h.state.values("a").tolist() == [0.0, 1.0, 2.0, 3.0]
    h.update({"a": 4.0})
    h.close()
    assert h.state.count("a") == 5


def test_compiled_helpers_run_beside_threads_that_read_the_state():
    """Updates on one thread (the compiled path) and state reads on another
    (which move the staged rows) lose nothing."""
    h = jh.History(distributed_history=False)
    stop = time.monotonic() + 0.5
    done = threading.Event()

    def read():
        while not done.is_set():
            h.state.values("a")

    h.update({"a": 0.0, "b": 1.0})
    reader = threading.Thread(target=read)
    reader.start()
    n = 1
    try:
        while time.monotonic() < stop:
            h.update({"a": float(n), "b": 1.0}, summarize=n % 7 == 0)
            n += 1
    finally:
        done.set()
        reader.join()
    assert h.state.values("a").tolist() == [float(i) for i in range(n)]


# --- HistoryState.update ------------------------------------------------------

state_dicts = st.one_of(
    st.fixed_dictionaries({"a": st.floats(-1e6, 1e6), "b": st.floats(-1e6, 1e6)}),
    st.fixed_dictionaries({"step": st.integers(-2, 40), "a": st.floats(-1e6, 1e6)}),
    st.fixed_dictionaries({"a": st.floats(-1e6, 1e6), "step": st.integers(-2, 40)}),
    st.fixed_dictionaries({"a": values, "b": st.floats()}),
    st.fixed_dictionaries({"c": st.floats(-1e6, 1e6)}),
)
state_ops = st.lists(
    st.tuples(st.integers(0, 3), state_dicts), min_size=1, max_size=120
)


def _states(ops, use_c):
    """The states a run of ``state = states[-1 - back].update(m)`` makes, with
    the compiled helpers or without (and each update's error, if any)."""
    from jaxhistory import _row

    modules = _host_modules()
    saved = {m: m.speedups for m in modules}
    saved_repeat = _row.LAST_REPEAT[0]
    for module in modules:
        module.speedups = C if use_c else None
    _row.LAST_REPEAT[0] = None
    states, errors = [jh.HistoryState()], []
    try:
        for back, m in ops:
            base = states[max(0, len(states) - 1 - back)]
            try:
                states.append(base.update(dict(m)))
            except (TypeError, ValueError) as err:
                errors.append(str(err))
    finally:
        for module, value in saved.items():
            module.speedups = value
        _row.LAST_REPEAT[0] = saved_repeat
    return states, errors


def _assert_same_states(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys == y.keys and x.next_step == y.next_step
        for key in x.keys:
            np.testing.assert_array_equal(x.steps(key), y.steps(key))
            np.testing.assert_array_equal(x.values(key), y.values(key))
            assert x.dtype(key) == y.dtype(key)


@needs_c
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(state_ops)
def test_state_updates_compiled_record_what_python_records(ops):
    """Every state of a run, older states updated again (branches) included,
    holds the same steps and values with the compiled update or without, and
    the same updates are refused with the same errors."""
    a, errors_a = _states(ops, True)
    b, errors_b = _states(ops, False)
    assert errors_a == errors_b
    _assert_same_states(a, b)


@needs_c
def test_state_updates_compiled_past_the_stage_and_across_branches():
    """Hundreds of rows (the staged rows move into the arrays every 256),
    with a branch taken from an old state now and then: its rows go into a
    copy, and the state it came from keeps what it had."""
    ops = []
    for i in range(700):
        back = 5 if i % 97 == 50 else 0
        m = {"step": 2 * i, "a": i / 3, "b": -i} if i % 2 else {"a": i / 7, "b": 0.5}
        ops.append((back, m))
    a, errors_a = _states(ops, True)
    b, errors_b = _states(ops, False)
    assert errors_a == errors_b
    _assert_same_states(a, b)
    assert a[-1].count("a") > 600


@needs_c
def test_state_update_compiled_declines_with_nothing_done():
    """Where the compiled update does not apply, NotImplemented and no
    change: no remembered dict, another dict, a table with no rows yet, a
    table of non-float values, an explicit step, another state's end."""
    from jaxhistory import _row

    consts = _history_state._STATE_COMPILED
    saved = _row.LAST_REPEAT[0]
    try:
        s = jh.HistoryState().update({"a": 1.0})
        _row.LAST_REPEAT[0] = None
        assert C.state_update(s, {"a": 2.0}, consts) is NotImplemented
        s = s.update({"a": 2.0})  # remembers {"a": float}
        assert C.state_update(s, {"b": 2.0}, consts) is NotImplemented
        assert C.state_update(s, {"a": 2}, consts) is NotImplemented
        assert C.state_update(s, {"a": math.inf}, consts) is NotImplemented
        assert C.state_update(s, [("a", 2.0)], consts) is NotImplemented
        empty = Table(("a",), (np.float64,), ((),))
        empty.ptypes = s.data.tables[("a",)][0].ptypes  # floats, but no rows
        fresh = jh.HistoryState(data=s.data.__class__({("a",): (empty, 0)}))
        assert C.state_update(fresh, {"a": 2.0}, consts) is NotImplemented
        for placeholder in (np.zeros(2), object()):  # not a Table
            odd = jh.HistoryState(data=s.data.__class__({("a",): (placeholder, 2)}))
            assert C.state_update(odd, {"a": 2.0}, consts) is NotImplemented
        ints = jh.HistoryState().update({"a": 1}).update({"a": 2})
        _row.LAST_REPEAT[0] = Repeat(("a",), ("a",), None)
        assert C.state_update(ints, {"a": 3.0}, consts) is NotImplemented
        older = s
        newer = C.state_update(s, {"a": 3.0}, consts)
        assert newer.values("a").tolist() == [1.0, 2.0, 3.0]
        assert C.state_update(older, {"a": 4.0}, consts) is NotImplemented
        assert older.values("a").tolist() == [1.0, 2.0]
        assert older.update({"a": 4.0}).values("a").tolist() == [1.0, 2.0, 4.0]
        assert newer.values("a").tolist() == [1.0, 2.0, 3.0]
        with pytest.raises(TypeError, match="3 arguments"):
            C.state_update(s, {"a": 1.0})
    finally:
        _row.LAST_REPEAT[0] = saved
