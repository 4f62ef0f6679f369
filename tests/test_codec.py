"""The JSONL log (jaxhistory._codec): damaged lines skipped exactly, files that are
not logs refused, empty and cut-off logs."""

import pytest

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
