"""CsvSink: rows, widening, appending, crash safety, and failures that never raise."""

import csv
import io
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from unittest import mock

import numpy as np
import pytest

import jaxhistory as jh
from jaxhistory._files import LogInUse, NotAFile, in_use
from jaxhistory._record import Batch
from jaxhistory.sinks import CsvSink, Record
from jaxhistory.sinks._csv import csv_column


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _dicts(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_one_row_per_record_with_exact_numbers(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    assert sink.columns == ()
    sink.write(
        Record(
            step=0,
            timestamp=100.25,
            metrics={"loss": 0.1, "tokens": 2**53 + 1, "ok": True, "w": np.ones(3)},
            aggregated={"g/mean": 1 / 3, "g/std": math.nan},
        )
    )
    sink.write(Record(step=1, timestamp=101.0, metrics={"loss": math.inf, "ok": False}))
    sink.write(Record(step=None, timestamp=102.0, metrics={"lat": 1.5}, group="agent"))
    sink.close()
    rows = _rows(path)
    assert rows[0] == [
        "step",
        "timestamp",
        "loss",
        "tokens",
        "ok",
        "g/mean",
        "g/std",
        "agent/lat",
    ]
    first = dict(zip(rows[0], rows[1], strict=True))
    assert float(first["loss"]) == 0.1 and int(first["tokens"]) == 2**53 + 1
    assert float(first["g/mean"]) == 1 / 3 and first["g/std"] == "nan"
    assert first["ok"] == "True" and first["timestamp"] == "100.25"
    assert "w" not in rows[0]  # array metrics are left out
    assert rows[2][:5] == ["1", "101.0", "inf", "", "False"]
    assert rows[3][0] == "" and rows[3][-1] == "1.5"  # a published metric: no step
    assert all(len(r) == len(rows[0]) for r in rows)  # rectangular
    assert sink.widened == 1  # agent/lat came late


def test_new_names_widen_the_header_and_pad_earlier_rows(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    for step in range(5):
        sink.write(Record(step=step, timestamp=float(step), metrics={"loss": step}))
    sink.write(Record(step=5, timestamp=5.0, metrics={"loss": 5, "eval/acc": 0.5}))
    sink.write(Record(step=6, timestamp=6.0, metrics={"eval/acc": 0.75}))
    sink.flush()
    rows = _dicts(path)
    assert [r["eval/acc"] for r in rows] == [""] * 5 + ["0.5", "0.75"]
    assert [r["loss"] for r in rows] == ["0", "1", "2", "3", "4", "5", ""]
    assert sink.widened == 1 and sink.columns[-1] == "eval/acc"
    text = path.read_text()
    assert text.splitlines()[1] == "0,0.0,0,"  # padded, not ragged
    sink.close()
    with pytest.warns(RuntimeWarning, match=r"after close\(\)"):  # ignored
        sink.write(Record(step=7, timestamp=7.0, metrics={"loss": 7}))
    assert path.read_text() == text


def test_one_widening_per_batch_and_a_header_of_odd_names(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    odd = ["a,b", 'say "hi"', "two\nlines", "step", "timestamp_", "\x1b[2J"]
    sink.write(Record(step=0, timestamp=0.0, metrics={"x": 1}))

    sink.write_batch(
        Batch.of(
            [
                Record(
                    step=1, timestamp=1.0, metrics={n: k for k, n in enumerate(odd)}
                ),
                Record(step=2, timestamp=2.0, metrics={"y": 2.0}),
            ]
        )
    )
    assert sink.widened == 1
    sink.close()
    header = _rows(path)[0]
    assert header == [
        "step",
        "timestamp",
        "x",
        "a,b",
        'say "hi"',
        "two\nlines",
        "step_",
        "timestamp__",
        "\x1b[2J",
        "y",
    ]
    # appending reads the same header back (a quoted newline included)
    again = CsvSink(path)
    assert list(again.columns) == header
    again.write(Record(step=3, timestamp=3.0, metrics={"two\nlines": 9, "y": 3.0}))
    again.close()
    last = _dicts(path)[-1]
    assert last["two\nlines"] == "9" and last["y"] == "3.0" and last["x"] == ""
    assert csv_column("timestamp") == "timestamp_" and csv_column("steps") == "steps"


def test_appending_continues_the_file_and_drops_a_row_cut_by_a_crash(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    sink.write(Record(step=0, timestamp=0.0, metrics={"loss": 1.0, "lr": 0.1}))
    sink.close()
    with open(path, "ab") as f:
        f.write(b"1,1.0,0.12")  # a killed run cut this row
    sink = CsvSink(path)
    assert sink.columns == ("step", "timestamp", "loss", "lr")
    sink.write(Record(step=1, timestamp=1.0, metrics={"lr": 0.2, "loss": 0.5}))
    sink.close()
    assert path.read_text().splitlines() == [
        "step,timestamp,loss,lr",
        "0,0.0,1.0,0.1",
        "1,1.0,0.5,0.2",
    ]
    CsvSink(path, overwrite=True).close()
    assert path.read_text() == ""


def test_widening_a_file_with_crlf_rows_keeps_them_whole(tmp_path):
    path = tmp_path / "m.csv"
    with open(path, "w", newline="") as f:  # csv.writer ends rows with \r\n
        csv.writer(f).writerows([["step", "timestamp", "loss"], [0, 0.5, 0.25]])
    sink = CsvSink(path)
    sink.write(Record(step=1, timestamp=1.0, metrics={"loss": 0.5, "lr": 0.1}))
    sink.close()
    assert _rows(path) == [
        ["step", "timestamp", "loss", "lr"],
        ["0", "0.5", "0.25", ""],
        ["1", "1.0", "0.5", "0.1"],
    ]


def test_a_file_that_is_no_csv_of_this_sink_is_refused_untouched(tmp_path):
    for content in (b"a,b\n1,2\n", b"\xff\xfe\x00garbage\n", b'"never ended\n'):
        path = tmp_path / "other.csv"
        path.write_bytes(content)
        with pytest.raises(ValueError, match="cannot append to .*other.csv"):
            CsvSink(path)
        assert path.read_bytes() == content
        assert not in_use(path)
    path.write_bytes(b"step,timestamp,a,a\n")
    with pytest.raises(ValueError, match="names a column twice"):
        CsvSink(path)


def test_a_live_writer_and_a_link_are_refused(tmp_path):
    path = tmp_path / "m.csv"
    first = CsvSink(path)
    with pytest.raises(LogInUse):
        CsvSink(path)
    with pytest.raises(LogInUse):
        CsvSink(path, overwrite=True)
    first.close()
    link = tmp_path / "link.csv"
    link.symlink_to(path)
    with pytest.raises(NotAFile, match="symbolic link"):
        CsvSink(link)


class _Flaky:
    """A file whose writes fail while ``failing`` is set."""

    def __init__(self, f):
        self.f, self.failing = f, True

    def write(self, data):
        if self.failing:
            self.f.write(data[:3])  # part of it reached the file
            raise OSError(28, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_failed_write_warns_once_counts_and_never_raises(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    sink.write(Record(step=0, timestamp=0.0, metrics={"loss": 1.0}))
    flaky = sink._file = _Flaky(sink._file)
    with pytest.warns(RuntimeWarning, match="writing failed") as caught:
        sink.write(Record(step=1, timestamp=1.0, metrics={"loss": 2.0}))
        sink.write(Record(step=2, timestamp=2.0, metrics={"loss": 3.0}))
    assert len(caught) == 1
    assert sink.lost == 2 and isinstance(sink.error, OSError)
    flaky.failing = False
    sink.write(Record(step=3, timestamp=3.0, metrics={"loss": 4.0}))
    sink.close()
    lines = path.read_text().splitlines()
    assert lines[0] == "step,timestamp,loss" and lines[-1] == "3,3.0,4.0"
    assert lines[1] == "0,0.0,1.0"  # the cut bytes are a line of their own


def test_a_failed_widening_keeps_the_file_and_the_rows(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    sink.write(Record(step=0, timestamp=0.0, metrics={"loss": 1.0}))
    boom = OSError(28, "No space left on device")
    failing = mock.patch("jaxhistory.sinks._csv.atomic_write", side_effect=boom)
    with failing, pytest.warns(RuntimeWarning, match="cannot add the columns"):
        sink.write(Record(step=1, timestamp=1.0, metrics={"loss": 2.0, "acc": 1}))
    assert sink.columns == ("step", "timestamp", "loss") and sink.error is boom
    sink.write(Record(step=2, timestamp=2.0, metrics={"acc": 0.5}))  # works now
    sink.close()
    assert _dicts(path) == [
        {"step": "0", "timestamp": "0.0", "loss": "1.0", "acc": ""},
        {"step": "1", "timestamp": "1.0", "loss": "2.0", "acc": ""},
        {"step": "2", "timestamp": "2.0", "loss": "", "acc": "0.5"},
    ]


def test_columns_are_capped_with_one_warning(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    sink.MAX_COLUMNS = 4
    with pytest.warns(RuntimeWarning, match="more than 4 columns") as caught:
        sink.write(Record(step=0, timestamp=0.0, metrics={"a": 1, "b": 2, "c": 3}))
        sink.write(Record(step=1, timestamp=0.0, metrics={"d": 4}))
    assert len(caught) == 1
    sink.close()
    assert _rows(path)[0] == ["step", "timestamp", "a", "b"]


def test_log_table_writes_a_file_beside_it(tmp_path):
    sink = CsvSink(tmp_path / "run.csv")
    out = sink.log_table("training_history", ["step", "loss"], [[0, 1.5], [1, None]])
    assert out == tmp_path / "run.training_history.csv"
    assert out.read_text() == "step,loss\n0,1.5\n1,\n"
    for bad in ("../x", "a/b", "", "..", "t\x00", 3):
        with pytest.raises(ValueError, match="is not a name"):
            sink.log_table(bad, ["a"], [])
    sink.close()


def test_history_feeds_the_csv_sink_from_several_threads(tmp_path):
    path = tmp_path / "m.csv"
    h = jh.History(distributed_history=False, sinks=[CsvSink(path)])

    def work(k):
        for i in range(50):
            h.update({f"t{k}": float(i)}, summarize=False)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h.close()
    rows = _dicts(path)
    assert len(rows) == 200
    assert sorted(int(r["step"]) for r in rows) == list(range(200))
    for k in range(4):
        assert sum(r[f"t{k}"] != "" for r in rows) == 50


CHILD = textwrap.dedent(
    """
    import sys, time
    from jaxhistory.sinks import CsvSink, Record
    sink = CsvSink(sys.argv[1])
    step = 0
    while True:
        names = {"loss": step * 0.5, f"m{step // 100}": 1.0}  # widens every 100
        sink.write(Record(step=step, timestamp=time.time(), metrics=names))
        step += 1
        if step == 300:
            print("ready", flush=True)
    """
)


def test_sigkill_leaves_every_complete_row(tmp_path):
    path = tmp_path / "m.csv"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    rows = list(csv.reader(io.StringIO(complete.decode())))
    assert rows[0][:3] == ["step", "timestamp", "loss"]
    assert len(rows) > 300
    assert [int(r[0]) for r in rows[1:]] == list(range(len(rows) - 1))
    assert all(len(r) == len(rows[0]) for r in rows)
    assert [float(r[2]) for r in rows[1:]] == [k * 0.5 for k in range(len(rows) - 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = CsvSink(path)  # a cut row is dropped, the columns read back
    again.close()
    assert path.read_bytes() == complete


def test_a_csv_deleted_during_the_run_is_started_again_with_its_header(tmp_path):
    """The CSV's folder removed mid-run (a clean-up): later rows went into the
    deleted file and were lost without a word. A new file with the header is
    started at the path, with one warning saying what the old one held."""
    import shutil

    path = tmp_path / "run" / "m.csv"
    sink = CsvSink(path)
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 1.0}))
    shutil.rmtree(tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.write(Record(step=1, timestamp=2.0, metrics={"loss": 0.5}))
        sink.write(Record(step=2, timestamp=3.0, metrics={"loss": 0.25}))
    sink.close()
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "was deleted" in texts[0], texts
    assert str(path) in texts[0]
    assert _rows(path) == [
        ["step", "timestamp", "loss"],
        ["1", "2.0", "0.5"],
        ["2", "3.0", "0.25"],
    ]


@pytest.mark.parametrize("how", ["deleted", "widened"])
def test_a_folder_swapped_for_a_link_mid_run_is_never_written_through(tmp_path, how):
    """Finding: the CSV's folder removed and a link to another folder put in
    its place mid-run: the sink started its file again through the link (or
    rewrote it there, adding columns), writing into a folder it never made."""
    import shutil

    folder, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    sink = CsvSink(folder / "m.csv")
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 1.0}))
    if how == "deleted":
        shutil.rmtree(folder)
    else:
        (folder / "m.csv").rename(tmp_path / "kept.csv")
        shutil.rmtree(folder)
        (elsewhere / "m.csv").write_bytes(b"step,timestamp,loss\n")
    folder.symlink_to(elsewhere)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        metrics = {"loss": 0.5} if how == "deleted" else {"loss": 0.5, "new": 1.0}
        sink.write(Record(step=1, timestamp=2.0, metrics=metrics))
    sink.close()
    if how == "deleted":
        assert list(elsewhere.iterdir()) == []
    else:
        assert (elsewhere / "m.csv").read_bytes() == b"step,timestamp,loss\n"


def test_a_folder_that_was_a_link_from_the_start_is_followed(tmp_path):
    """The user's own link (outputs -> a scratch disk) stays followed, also when
    the file is started again mid-run."""
    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "run").symlink_to(real)
    sink = CsvSink(tmp_path / "run" / "m.csv")
    sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 1.0}))
    (real / "m.csv").unlink()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        sink.write(Record(step=1, timestamp=2.0, metrics={"loss": 0.5}))
    sink.close()
    assert _rows(real / "m.csv")[1:] == [["1", "2.0", "0.5"]]


def test_a_name_a_spreadsheet_would_run_as_a_formula_is_written_as_text(tmp_path):
    """Finding: a metric named '=HYPERLINK(...)' went into the header as it
    is, which a spreadsheet runs as a formula. Such a column starts with ',
    and appending to the file again finds its columns."""
    path = tmp_path / "m.csv"
    names = ["=HYPERLINK(1)", "+x", "-loss", "@a", "'=HYPERLINK(1)", "loss"]
    sink = CsvSink(path)
    sink.write(Record(step=0, timestamp=1.0, metrics=dict.fromkeys(names, 1.0)))
    sink.close()
    header = _rows(path)[0]
    assert header == [
        "step",
        "timestamp",
        "'=HYPERLINK(1)",
        "'+x",
        "'-loss",
        "'@a",
        "''=HYPERLINK(1)",
        "loss",
    ]
    again = CsvSink(path)
    again.write(Record(step=1, timestamp=2.0, metrics=dict.fromkeys(names, 2.0)))
    again.close()
    rows = _rows(path)
    assert rows[0] == header and len(rows) == 3 and rows[2][2:] == ["2.0"] * 6
