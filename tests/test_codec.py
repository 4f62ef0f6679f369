"""The JSONL log (jaxhistory._codec): damaged lines skipped exactly, files that are
not logs refused, empty and cut-off logs; the run id and the times read back."""

import numpy as np
import orjson
import pytest
from test_export import _cli as run_cli  # the command in a fresh process

import jaxhistory as jh
from jaxhistory import export

# ----- damaged JSONL logs -----------------------------------------------------------


def test_damaged_jsonl_lines_are_skipped_exactly(tmp_path):
    good = b'{"step": 0, "metrics": {"a": 1.0}}\n'
    lines = [
        b"\xef\xbb\xbf" + good,  # a byte order mark on the first line
        b"\x00\x9f\xff garbage \xfe\n",  # binary
        b'{"step": 1, "metrics": {"a": "\xff\xfe"}}\n',  # invalid UTF-8
        '{"step": 2, "metrics": {"\u00e9": 1.0}}\n'.encode()[:-8] + b"\n",
        b'{"step": 9223372036854775808, "metrics": {"a": 3.0}}\n',  # 2**63
        b'{"step": 5, "metrics": {"a": 5.0}}\n',
        '{"step": 6, "metrics": {"\u00e9": 6.0}}'.encode()[:-3],  # cut, last
    ]
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.warns(RuntimeWarning, match=r"skipped 5 .*line 2, 3, 4, 5, 7\)"):
        s = export.from_jsonl(path)
    assert s.steps("a").tolist() == [0, 5]
    assert s.values("a").tolist() == [1.0, 5.0]


# ----- files that are not logs, empty logs ------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4,  # gzip
        b"step,loss\n0,0.5\n1,0.25\n",  # a CSV file
        b'{"step": -1.5, "metrics": {"a": 1.0}}\n{"not": "a record"}\n',
    ],
)
def test_a_file_without_one_complete_record_is_not_a_log(tmp_path, content):
    path = tmp_path / "run.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path.name}.*no complete record"):
        jh.HistoryState.from_jsonl(path)
    with pytest.raises(ValueError, match=f"{path.name}.*no complete record"):
        jh.History(resume=path, report_dir=tmp_path / "out")
    assert path.read_bytes() == content  # untouched


def test_an_empty_log_is_an_empty_history(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"\n")
    assert jh.HistoryState.from_jsonl(path).keys == ()


def test_a_log_cut_off_in_its_first_line_is_an_empty_history(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"step":0,"timestamp":1.7e9,"metrics":{"lo')
    with pytest.warns(RuntimeWarning, match="line 1"):
        assert jh.HistoryState.from_jsonl(path).keys == ()
    path.write_bytes(b'{"step":0,"timestamp":1.7e9,"metrics":{"lo\n')  # complete
    with pytest.raises(ValueError, match="holds no complete record"):
        jh.HistoryState.from_jsonl(path)


# ----- a 'step' entry in a line's metrics ----------------------------------------


def _step_entry_log(path, entries):
    """A log of ``(line step, metrics, aggregated)`` lines."""
    lines = [
        orjson.dumps({"step": s, "metrics": m, "aggregated": a}) + b"\n"
        for s, m, a in entries
    ]
    path.write_bytes(b"".join(lines))
    return path


def test_a_step_entry_in_a_logs_metrics_is_the_step_of_its_line(tmp_path):
    """As History.update(metrics, step=s) takes a 'step' entry that agrees with
    s: the step of the record, not a metric. It was read as a metric named
    'step', and the dataset (the step coordinate) then failed inside xarray."""
    path = _step_entry_log(
        tmp_path / "run.jsonl",
        [
            (0, {"loss": 1.0, "step": 0}, {}),
            (1, {"step": 1.0, "loss": 0.5}, {"loss/mean": 0.5, "step": 1}),
            (2, {"loss": 0.25}, {}),
        ],
    )
    s = jh.HistoryState.from_jsonl(path)
    assert s.keys == ("loss", "loss/mean")
    assert s.steps("loss").tolist() == [0, 1, 2]
    assert s.values("loss").tolist() == [1.0, 0.5, 0.25]
    assert s.steps("loss/mean").tolist() == [1]
    ds = s.to_xarray()
    assert "step" not in ds.data_vars
    assert ds["loss"].values.tolist() == [1.0, 0.5, 0.25]


@pytest.mark.parametrize(
    ("metrics", "aggregated", "said"),
    [
        ({"loss": 0.5, "step": 7}, {}, "its metric 'step' is 7"),
        ({"loss": 0.5}, {"step": 2.5}, "its aggregated value 'step' is 2.5"),
        ({"loss": 0.5, "step": "NaN"}, {}, "its metric 'step' is nan"),
        ({"loss": 0.5, "step": [1]}, {}, "its metric 'step' is [1]"),
    ],
)
def test_a_step_entry_that_is_not_the_step_of_its_line_is_refused(
    tmp_path, metrics, aggregated, said
):
    """Two steps for one record (History.update refuses them too): a
    ValueError naming the file, the line and the entry, the file untouched."""
    path = _step_entry_log(
        tmp_path / "run.jsonl",
        [(0, {"loss": 1.0}, {}), (1, metrics, aggregated), (2, {"loss": 0.25}, {})],
    )
    content = path.read_bytes()
    with pytest.raises(ValueError) as info:
        jh.HistoryState.from_jsonl(path)
    message = str(info.value)
    assert str(path) in message and "line 2" in message, message
    assert said in message and "step of the line is 1" in message, message
    with pytest.raises(ValueError, match="line 2"):
        jh.History(resume=path, report_dir=tmp_path / "out")
    assert path.read_bytes() == content


# ----- the run id and the times of a log --------------------------------------------


def test_every_log_line_carries_the_run_id(tmp_path):
    """Finding: the JSONL carried no run id; resume took it from the file name."""
    import json

    h = jh.History(distributed_history=False, report_dir=tmp_path, run_name="exp")
    for i in range(3):
        h.update({"loss": float(i)}, summarize=False)
    h.close()
    log = tmp_path / f"{h.run_id}.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3 and {r["run_id"] for r in lines} == {h.run_id}
    renamed = log.rename(tmp_path / "copied.jsonl")  # the name no longer says it
    assert dict(jh.HistoryState.from_jsonl(renamed).attrs)["run_id"] == h.run_id
    again = jh.History(distributed_history=False, resume=renamed)
    assert again.run_id == h.run_id
    again.close()
    assert run_cli(
        "report", str(renamed), "--outdir", str(tmp_path / "r"), "--no-plots"
    )
    assert f"# Run report: {h.run_id}" in (tmp_path / "r" / "report.md").read_text()
    # A whole state written out, and a stream of one's own
    export.to_jsonl(
        jh.HistoryState().update({"a": 1.0}), tmp_path / "w.jsonl", run_id="w1"
    )
    assert json.loads((tmp_path / "w.jsonl").read_text())["run_id"] == "w1"
    odd = 'a"b%s\\n'
    stream = export.JsonlStream(tmp_path / "s.jsonl", run_id=odd)
    stream.add(0, {"x": 1.0})
    stream.close()
    assert json.loads((tmp_path / "s.jsonl").read_text())["run_id"] == odd
    assert dict(jh.HistoryState.from_jsonl(tmp_path / "s.jsonl").attrs)["run_id"] == odd


def test_the_run_id_of_a_log_whose_last_lines_are_long(tmp_path):
    """Found in review: a last line over the 1 MiB read from the end lost it."""
    path = tmp_path / "big.jsonl"
    stream = export.JsonlStream(path, run_id="exp-1")
    stream.add(0, {"loss": 1.0})
    stream.add(1, {"big": np.arange(200_000, dtype=np.float64)})
    stream.close()
    assert path.stat().st_size > 1 << 20
    assert dict(jh.HistoryState.from_jsonl(path).attrs)["run_id"] == "exp-1"
    h = jh.History(distributed_history=False, resume=path)
    assert h.run_id == "exp-1"
    h.close()


def test_the_times_of_a_log_are_read_whatever_wrote_it(tmp_path):
    from jaxhistory._codec import read_stamps

    ours = tmp_path / "ours.jsonl"
    ours.write_text(
        '{"step":1,"timestamp":1700000000.5,"process_index":0,"metrics":{}}\n'
        '{"step":2,"timestamp":null,"process_index":0,"metrics":{}}\n'
        '{"step":1,"timestamp":1700000009.0,"process_index":0,"metrics":{}}\n'
        '{"step":3,"timestamp":1.7e9,"process_index":0,"metr'  # cut off
    )
    assert read_stamps(ours) == {1: 1700000000.5, 3: 1.7e9}  # the first wins
    other = tmp_path / "other.jsonl"  # keys in another order
    other.write_text('{"timestamp": 5.0, "step": 4}\nnot json\n{"step": 5}\n')
    assert read_stamps(other) == {4: 5.0}
    (tmp_path / "empty.jsonl").write_text("")
    assert read_stamps(tmp_path / "empty.jsonl") == {}


def test_the_times_of_a_log_mixing_its_lines_with_others(tmp_path):
    """Found in review: a log with both kinds of line lost the others' times."""
    from jaxhistory._codec import read_stamps

    path = tmp_path / "mixed.jsonl"
    path.write_text(
        '{"timestamp": 10.0, "step": 0}\n'
        '{"step":1,"timestamp":11.0,"process_index":0,"metrics":{}}\n'
        '{"step":2,"timestamp":null,"process_index":0,"metrics":{}}\n'
    )
    assert read_stamps(path) == {0: 10.0, 1: 11.0}


# ----- records of one set of names, written from their value tuples -----------------


def _both_ways(names, values, steps, stamps, run_id="run-1", index=0):
    """A batch of value tuples and the same records as dicts, both finite."""
    from jaxhistory._record import Batch

    tuples = Batch.of_rows(list(steps), list(stamps), names, list(values), index)
    dicts = Batch(
        list(steps),
        list(stamps),
        [dict(zip(names, v, strict=True)) for v in values],
        None,
        None,
        index,
    )
    for batch in (tuples, dicts):
        batch.finite, batch.run_id = True, run_id
    return tuples, dicts


@pytest.mark.parametrize("rows", [1, 3, 4096, 4097, 9000])
def test_records_of_one_set_of_names_are_written_as_their_dicts_are(rows):
    from jaxhistory._codec import encode_records

    rng = np.random.default_rng(rows)
    names = ("loss", "a/b", 'q"%s%%', "\u00e9\x01", "x y", "lr")
    scale = 10.0 ** rng.integers(-300, 300, size=(rows, len(names)))
    values = [tuple(map(float, r)) for r in rng.normal(size=(rows, len(names))) * scale]
    values[0] = (0.0, -0.0, 5e-324, 1.7976931348623157e308, -1.0, 1e16)
    steps = range(10, 10 + rows)
    stamps = [1.7e9 + i / 7 if i % 5 else None for i in range(rows)]
    tuples, dicts = _both_ways(names, values, steps, stamps, run_id='r%d"')
    text = encode_records(tuples)
    assert text == encode_records(dicts)
    assert tuples.uniform() is None  # the dicts were made to write it
    lines = text.splitlines()
    assert len(lines) == rows
    for k in (0, rows // 2, rows - 1):
        got = orjson.loads(lines[k])
        assert got["metrics"] == dict(zip(names, values[k], strict=True))
        assert got["step"] == steps[k] and got["timestamp"] == stamps[k]
        assert list(got["metrics"]) == list(names)  # in the order recorded


@pytest.mark.parametrize("aggregated", [False, True])
@pytest.mark.parametrize("unsigned", [False, True])
@pytest.mark.parametrize("run_id", [None, 'r%s%%"\u00e9'])
def test_a_batch_is_written_as_each_record_written_alone(aggregated, unsigned, run_id):
    """The batch's lines, put together from a few joined columns, are the
    lines each record gives written on its own (one orjson call per record):
    aggregated values, uint64 marks, NaN and infinities, unknown times."""
    from jaxhistory._codec import _encode_each, encode_records
    from jaxhistory._record import Batch

    rows = 7
    metrics = []
    for i in range(rows):
        m = {"loss": 0.5 / (i + 1), "n": i, "odd": [np.nan, np.inf, -np.inf][i % 3]}
        if unsigned and i % 2:
            m["big"] = np.uint64(2**64 - 1 - i)
        metrics.append(m)
    agg = [{"loss/mean": 0.25 * i, "loss/max": np.float32(i)} for i in range(rows)]
    if aggregated:
        agg[3] = {}

    def batch() -> Batch:
        b = Batch(
            list(range(5, 5 + rows)),
            [1.7e9 + i / 3 if i % 4 else None for i in range(rows)],
            [dict(m) for m in metrics],
            [dict(a) for a in agg] if aggregated else None,
            None,
            3,
        )
        b.run_id = run_id
        return b

    text = encode_records(batch())
    assert text == _encode_each(batch())
    assert len(text.splitlines()) == rows
    second = orjson.loads(text.splitlines()[1])
    assert second["process_index"] == 3 and second.get("run_id") == run_id
    assert ("uint64" in second) == unsigned


def test_a_batch_of_value_tuples_gives_sinks_its_dicts():
    from jaxhistory._codec import encode_records

    names = ("loss", "lr")
    tuples, dicts = _both_ways(names, [(1.0, 2.0), (3.0, 4.0)], [0, 1], [None] * 2)
    assert tuples.uniform() == (names, [(1.0, 2.0), (3.0, 4.0)])
    assert [r.metrics for r in tuples.records()] == [r.metrics for r in dicts.records()]
    assert tuples.uniform() is None  # its dicts are made: they are what is written
    tuples.metrics[0]["loss"] = 9.0
    assert orjson.loads(encode_records(tuples).splitlines()[0])["metrics"] == {
        "loss": 9.0,
        "lr": 2.0,
    }


# ----- dtypes a log keeps -------------------------------------------------------------


def test_a_uint64_metric_comes_back_as_uint64_from_its_log(tmp_path):
    """Finding: the log wrote a uint64 as a bare JSON integer, so one whose values
    all fit int64 came back int64, and a resumed run recording a uint64 past
    2**63 into it was refused (or the metric changed dtype on the way)."""
    log = tmp_path / "run.jsonl"
    h = jh.History(distributed_history=False, jsonl_path=log)
    h.update({"u": np.uint64(3), "a": np.array([1, 2], np.uint64), "x": 0.5}, step=0)
    h.update({"u": np.uint64(7), "a": np.array([3, 4], np.uint64), "x": 0.25}, step=1)
    h.update({"i": 5}, step=1)  # another key set, merged into the step's line
    h.close()
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert [r["metrics"]["u"] for r in lines] == [3, 7]  # numbers, as before
    back = jh.HistoryState.from_jsonl(log)
    assert back.dtype("u") == np.uint64 and back.values("u").tolist() == [3, 7]
    assert back.dtype("a") == np.uint64 and back.values("a").tolist() == [
        [1, 2],
        [3, 4],
    ]
    assert back.dtype("i") == np.int64 and back.dtype("x") == np.float64
    # a resumed run goes on recording uint64 past int64 into the same metrics
    again = jh.History(distributed_history=False, resume=log)
    big = 2**64 - 1
    again.update({"u": np.uint64(big), "a": np.array([big, 0], np.uint64)}, step=2)
    again.close()
    assert again.state.dtype("u") == np.uint64
    assert again.state.values("u").tolist() == [3, 7, big]
    final = jh.HistoryState.from_jsonl(log)
    assert final.dtype("u") == np.uint64 and final.values("u").tolist() == [3, 7, big]
    assert final.values("a").tolist() == [[1, 2], [3, 4], [big, 0]]
    # a state written whole keeps them too, as do the dataset and the CLI's
    export.to_jsonl(final, tmp_path / "whole.jsonl")
    whole = jh.HistoryState.from_jsonl(tmp_path / "whole.jsonl")
    assert whole.dtype("u") == np.uint64 and whole.dtype("a") == np.uint64
    assert whole.values("u").tolist() == [3, 7, big]
    small = jh.HistoryState().update({"u": np.uint64(1)}, step=0)
    export.to_jsonl(small, tmp_path / "small.jsonl")
    assert jh.HistoryState.from_jsonl(tmp_path / "small.jsonl").dtype("u") == np.uint64
    export.to_netcdf(final, tmp_path / "d.nc")
    ds = jh.HistoryState.from_netcdf(tmp_path / "d.nc")
    assert ds.dtype("u") == np.uint64 and ds.values("u").tolist() == [3, 7, big]
    out = run_cli("report", log, "--outdir", tmp_path / "r", "--no-plots")
    assert out.returncode == 0, out.stderr
    cli = jh.HistoryState.from_netcdf(tmp_path / "r" / "dataset.nc")
    assert cli.dtype("u") == np.uint64 and cli.values("u").tolist() == [3, 7, big]
    assert cli.dtype("a") == np.uint64


# ----- values whose sum overflows ---------------------------------------------------


def test_writing_values_whose_sum_overflows_gives_no_numpy_warning(tmp_path):
    """Found by a randomized round trip: the writer's check for values orjson
    writes as they are sums them, and float32 arrays beside large floats or
    infinities, or large floats together, overflowed in that sum with NumPy's
    RuntimeWarning (overflow in cast or add, invalid value), printed from the
    log's thread for values that were recorded and written correctly."""
    import warnings

    big = np.float32(3.4e38)
    rows = [
        {"w": np.array([big, big], np.float32), "x": 1e300},  # overflow in cast
        {"w": np.array([np.inf, 1.0], np.float32), "x": -np.inf},  # invalid
        {"w": np.array([1e-45, 2.0], np.float32), "x": 1e308, "y": 1e308},  # add
    ]
    s = jh.HistoryState()
    for i, row in enumerate(rows):
        s = s.update(row, step=i)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export.to_jsonl(s, tmp_path / "a.jsonl")
        h = jh.History(distributed_history=False, jsonl_path=tmp_path / "b.jsonl")
        for i, row in enumerate(rows):
            h.update(row, step=i, summarize=False)
        h.close()
    assert [str(w.message) for w in caught] == []
    for log in (path, tmp_path / "b.jsonl"):
        back = jh.HistoryState.from_jsonl(log)
        for key in s.keys:
            assert back.values(key).tolist() == s.values(key).tolist(), key
