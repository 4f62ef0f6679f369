"""The jaxhistory command (jaxhistory.cli): help and version, summary and report,
user errors as one line with status 2, outputs that are links, the launch command."""

import subprocess
import sys

import numpy as np
import pytest
from test_export import _cli as run_cli  # the command in a fresh process

import jaxhistory as jh
from jaxhistory import cli, export

# ----- help and version -------------------------------------------------------------


def test_help_is_plain_text_and_every_option_is_explained(capsys):
    for args in (["--help"], ["report", "--help"], ["summary", "--help"]):
        with pytest.raises(SystemExit) as done:
            cli.main(args)
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text and ":func:" not in text
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = capsys.readouterr().out
    for option in ("--warmup", "--num-chains", "--run-name", "--max-plots"):
        line = next(ln for ln in text.splitlines() if option in ln)
        following = text[text.index(line) :].split("\n  -")[0]
        assert len(following.split()) > 3, f"{option} has no help:\n{text}"


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"jaxhistory {jh.__version__}"


# ----- summary and report -----------------------------------------------------------


def saved_run(tmp_path, warmup=0.0):
    s = jh.HistoryState()
    for i in range(20):
        s = s.update({"loss": 10.0 if i < 10 else float(i)}, step=i)
    export.finalize(s, tmp_path / "run", run_id="r1", plot=False, warmup=warmup)
    return s


def test_summary_on_a_terminal_shows_names_as_the_summary_line_does(
    tmp_path, capsys, monkeypatch
):
    """Finding: on a terminal ``jaxhistory summary`` showed ``max_abs`` as
    ``max\\_abs`` and a name's ``\\x1b`` as ``\\\\x1b``: the markdown escapes.
    On a terminal names show as the summary line shows them (only ``|``
    escaped, to keep the columns); piped, the table is markdown."""
    s = jh.HistoryState()
    for i in range(3):
        s = s.update({"grads/max_abs": float(i), "a\x1bb": 2.0 * i, "p|q": 1.0 * i})
    export.to_netcdf(s, tmp_path / "r.nc")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(["summary", str(tmp_path / "r.nc")]) == 0
    shown = capsys.readouterr().out
    assert "| grads/max_abs | 1 |" in shown, shown
    assert "| a\\x1bb | 2 |" in shown and "\x1b" not in shown
    assert "| p\\|q | 1 |" in shown
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert cli.main(["summary", str(tmp_path / "r.nc")]) == 0
    piped = capsys.readouterr().out
    assert "| grads/max\\_abs | 1 |" in piped and "| a\\\\x1bb | 2 |" in piped


def test_summary_piped_to_head_ends_quietly(tmp_path):
    # More output than a pipe holds (1,000 rows of 100-character names), so the
    # command is still writing when head has gone.
    s = jh.HistoryState().update(
        {f"metric_{i:04d}_{'x' * 88}": float(i) for i in range(1000)}
    )
    export.to_netcdf(s, tmp_path / "big.nc")
    done = subprocess.run(
        f"{sys.executable} -m jaxhistory summary {tmp_path / 'big.nc'} | head -2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert len(done.stdout.splitlines()) == 2
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_summary_of_a_dataset_uses_its_recorded_warmup(tmp_path):
    saved_run(tmp_path, warmup=10)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| loss | 14.5 |" in report  # the first 10 steps (loss 10) left out
    out = run_cli("summary", tmp_path / "run" / "dataset.nc")
    assert out.returncode == 0 and "| loss | 14.5 |" in out.stdout, out.stdout
    out = run_cli("summary", tmp_path / "run" / "dataset.nc", "--warmup", "0")
    assert "| loss | 12.25 |" in out.stdout  # asked for: every step


def test_report_names_the_run_given_for_a_jsonl_log(tmp_path):
    saved_run(tmp_path)
    out = run_cli(
        "report", tmp_path / "run" / "r1.jsonl", "-o", tmp_path / "again",
        "--run-name", "baseline", "--no-plots",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "again" / "report.md").read_text()
    assert report.startswith("# Run report: baseline\n")
    assert "- run id: r1" in report


@pytest.mark.parametrize("content", ["", "not json\n", '{"step": 1, "metr'])
def test_a_log_with_no_complete_record_exits_2(tmp_path, content):
    log = tmp_path / "empty.jsonl"
    log.write_text(content)
    for args in (("summary", log), ("report", log, "-o", tmp_path / "out")):
        out = run_cli(*args)
        assert out.returncode == 2, out.stdout
        assert "holds no complete record" in out.stderr


def test_summary_rows_match_numpy(tmp_path):
    s = saved_run(tmp_path)
    out = run_cli("summary", tmp_path / "run", "--warmup", "0")
    mean = np.mean(s.values("loss"))
    assert f"| loss | {mean:g} |" in out.stdout


def test_cli_report_takes_max_plots(tmp_path):
    from jaxhistory import cli

    s = jh.HistoryState()
    for step in range(2):
        s = s.update({f"m{i}": float(step) for i in range(4)}, step=step)
    export.to_netcdf(s, tmp_path / "dataset.nc")
    out = tmp_path / "out"

    def report(cap):
        args = ["report", str(tmp_path / "dataset.nc"), "-o", str(out)]
        return cli.main([*args, "--max-plots", cap])

    assert report("1") == 0
    assert [p.name for p in (out / "plots" / "mplot").iterdir()] == ["m0.png"]
    assert report("all") == 0
    assert len(list((out / "plots" / "mplot").iterdir())) == 4
    with pytest.raises(SystemExit):
        report("many")


# ----- user errors, outputs that are links ------------------------------------------


def _dataset_with_run_id(tmp_path, run_id):
    import xarray as xr

    saved_run(tmp_path)
    tree = xr.open_datatree(tmp_path / "run" / "dataset.nc").load()
    tree.attrs["run_id"] = run_id
    tree.to_netcdf(tmp_path / "crafted.nc")
    return tmp_path / "crafted.nc"


def test_cli_user_errors_are_one_line_and_status_2(tmp_path, capsys):
    """Bad option values, an output that is a file or a device, a dataset
    whose run id holds escapes: one line on stderr naming what was wrong
    (control characters escaped), status 2, no traceback, nothing written."""
    saved_run(tmp_path)
    run = tmp_path / "run" / "dataset.nc"
    crafted = _dataset_with_run_id(tmp_path, "r\x1b[2J\nid")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "dur": 1}]}')
    out = tmp_path / "out"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")  # said only "[Errno 17] File exists"
    cases = [
        (["report", run, "-o", dangling], f"{dangling} is a link to {tmp_path}"),
        (["summary", run, "--warmup", "nan"], "warmup must be a number >= 0"),
        (["summary", run, "--warmup", "inf"], "got 'inf'"),
        (["summary", run, "--warmup", "1\x1b[2J"], "got '1\\x1b[2J'"),  # was \\\\x1b
        (["report", run, "-o", out, "--warmup", "-1"], "got '-1'"),
        (["report", run, "-o", out, "--num-chains", "0"], "num-chains must be a"),
        (["report", run, "-o", out, "--num-chains", "-5"], "got '-5'"),
        (["report", run, "-o", afile], f"{afile} exists and is a regular file"),
        (["report", run, "-o", "/dev/null"], "/dev/null exists and is a device"),
        (["report", crafted, "-o", out], "run id 'r\\x1b[2J\\nid' recorded in"),
        (["merge-traces", trace, "-o", "/dev/null"], "/dev/null"),
    ]
    for args, said in cases:
        try:
            status = cli.main([str(a) for a in args])
        except SystemExit as done:  # argparse's own exit
            status = done.code
        err = capsys.readouterr().err
        assert status == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("jaxhistory"), (args, err)
        assert said in err, (args, err)
        assert "\x1b" not in err and "Traceback" not in err
    assert afile.read_text() == "mine" and not out.exists()
    assert not (tmp_path / "nowhere").exists()


def _crafted(tmp_path, name, **attrs):
    import xarray as xr

    if not (tmp_path / "run" / "dataset.nc").exists():
        saved_run(tmp_path)
    tree = xr.open_datatree(tmp_path / "run" / "dataset.nc").load()
    tree.attrs.update(attrs)
    tree.to_netcdf(tmp_path / name)
    return tmp_path / name


def test_crafted_runs_give_one_line_errors_and_write_nothing(tmp_path, capsys):
    """Attributes of the wrong type, a JSONL line nested past the stack, a log
    whose file name is no run id: one line on stderr, status 2, no traceback;
    nothing written before the check."""
    out = tmp_path / "out"
    deep = tmp_path / "deep.jsonl"
    deep.write_text(
        '{"step":0,"metrics":{"loss":1.0}}\n'
        + '{"step":1,"metrics":{"x":'
        + "[" * 5000
        + "]" * 5000
        + "}}\n"
    )
    escaped = tmp_path / "bad\x1b[31m.jsonl"
    escaped.write_text('{"step":0,"metrics":{"loss":1.0}}\n')
    cases = [
        (
            ["report", _crafted(tmp_path, "int.nc", run_id=5), "-o", out],
            "must be a str",
        ),
        (["summary", _crafted(tmp_path, "w.nc", warmup_steps="abc")], "warmup_steps"),
        (["summary", _crafted(tmp_path, "n.nc", warmup_steps=-1.0)], "warmup_steps"),
        (["report", escaped, "-o", out], "bad\\x1b[31m"),
        (
            ["summary", _crafted(tmp_path, "s.nc", jaxhistory_next_step=[1, 2])],
            "s.nc: the dataset's jaxhistory_next_step attribute is [1, 2], not a",
        ),
        (
            ["report", _crafted(tmp_path, "l.nc", jaxhistory_layout=5), "-o", out],
            "l.nc: the dataset's jaxhistory_layout attribute is 5, not text",
        ),
    ]
    for args, said in cases:
        status = cli.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert status == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("jaxhistory"), (args, err)
        assert said in err, (args, err)
        assert "\x1b" not in err and "Traceback" not in err
    assert not out.exists()
    assert cli.main(["summary", str(deep)]) == 0  # the deep line is skipped
    printed = capsys.readouterr()
    assert "loss" in printed.out
    assert printed.err.startswith("jaxhistory: warning: ")
    assert "skipped 1 incomplete or damaged" in printed.err


def test_a_log_with_step_entries_in_its_metrics(tmp_path, capsys):
    """A 'step' entry in a line's metrics is the line's step (as History takes
    it): summary and report read the log as if it were not there; one that
    disagrees with its line is one line on stderr naming the file and the
    line, status 2, nothing written. Both failed inside xarray before."""
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"step":0,"metrics":{"loss":1.0,"step":0}}\n'
        '{"step":1,"metrics":{"step":1,"loss":0.5}}\n'
    )
    assert cli.main(["summary", str(good)]) == 0
    table = capsys.readouterr().out
    assert "| loss |" in table and "| step |" not in table
    out = tmp_path / "out"
    args = ["report", str(good), "-o", str(out), "--no-plots"]
    assert cli.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert jh.HistoryState.from_netcdf(out / "dataset.nc").keys == ("loss",)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"step":0,"metrics":{"loss":1.0}}\n{"step":1,"metrics":{"step":9}}\n'
    )
    again = tmp_path / "again"
    for args in (["summary", bad], ["report", bad, "-o", again]):
        status = cli.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert status == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("jaxhistory"), err
        assert f"{bad}, line 2" in err and "'step' is 9" in err, err
        assert "Traceback" not in err
    assert not again.exists()


def test_cli_report_never_writes_or_deletes_through_a_link(tmp_path, capsys):
    """OUT/RUN.jsonl a link to another file, OUT/plots a link to a folder: the
    command refuses, naming it, and what they point to is untouched."""
    saved_run(tmp_path)
    log = tmp_path / "run" / "r1.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "a.png").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "r1.jsonl").symlink_to(victim)
    assert cli.main(["report", str(log), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'r1.jsonl'}: it is a symbolic link" in err
    assert victim.read_text() == "keep"
    (out / "r1.jsonl").unlink()
    (out / "plots").symlink_to(folder)
    for extra in ([], ["--no-plots"]):
        assert cli.main(["report", str(log), "-o", str(out), *extra]) == 2
        assert f"{out / 'plots'}: it is a symbolic link" in capsys.readouterr().err
        assert [p.name for p in folder.iterdir()] == ["a.png"]
    (out / "plots").unlink()
    assert cli.main(["report", str(log), "-o", str(out), "--no-plots"]) == 0
    assert (out / "report.md").is_file() and (out / "r1.jsonl").is_file()


# ----- the launch command -----------------------------------------------------------


@pytest.mark.slow
def test_the_launch_command(tmp_path):
    import os
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    cmd = [sys.executable, "-m", "jaxhistory", "launch", "-n", "2"]
    done = subprocess.run(
        [*cmd, "mp_workers:say", "yo"], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[process 1] yo from 1" in done.stdout
    assert "[process 0] returned 0" in done.stdout
    failed = subprocess.run(
        [*cmd, "mp_workers:fail_on_process_one", "--timeout", "120"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert failed.returncode == 1 and "launched processes failed" in failed.stderr
    # One line a process, not one line with every newline shown as \x0a, and
    # the traceback once (it was streamed; the summary repeated it).
    assert "\\x0a" not in failed.stderr
    lines = failed.stderr.splitlines()
    assert "process 1: RuntimeError: process one gives up" in lines, lines
    assert "exit code -9" not in failed.stderr
    assert (failed.stdout + failed.stderr).count("Traceback") == 1
    quiet = subprocess.run(
        [*cmd, "mp_workers:fail_on_process_one", "--timeout", "120", "--output",
         "none"], capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert quiet.returncode == 1 and quiet.stdout == ""
    assert quiet.stderr.count("Traceback") == 1  # the log not shown before
    assert "----- process 1 log -----" in quiet.stderr.splitlines()
    bad = subprocess.run(
        [*cmd, "no_colon"], capture_output=True, text=True, env=env, timeout=300
    )
    assert bad.returncode == 2 and "must look like" in bad.stderr


@pytest.mark.slow
def test_the_launch_command_takes_the_functions_arguments_after_its_options():
    import os
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    cmd = [sys.executable, "-m", "jaxhistory", "launch", "-n", "2", "mp_workers:say"]
    done = subprocess.run(
        [*cmd, "--devices-per-process", "2", "--timeout", "120", "yo"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[process 1] yo from 1" in done.stdout
    assert "[process 0] returned 0" in done.stdout


def test_the_folder_of_a_run_that_never_finalized_is_read_from_its_log(
    tmp_path, capsys
):
    """Finding: ``jaxhistory summary out`` on the report_dir of a run that
    crashed before finalize (its JSONL log whole, no dataset.nc) said only
    "out is a folder without a dataset.nc". Its one log is read instead; a
    folder of several logs is an error naming them; a folder of none, as
    before."""
    out = tmp_path / "out"
    h = jh.History(distributed_history=False, report_dir=out)
    for step in range(4):
        h.update({"loss": 1.0 + step})
    h.close()  # (no finalize: what a crash leaves)
    assert cli.main(["summary", str(out)]) == 0
    assert "| loss | 2.5 |" in capsys.readouterr().out
    rep = tmp_path / "rep"
    assert cli.main(["report", str(out), "-o", str(rep), "--no-plots"]) == 0
    assert "| loss | 2.5 |" in (rep / "report.md").read_text()

    (out / "other.jsonl").write_bytes((out / h.log_path.name).read_bytes())
    assert cli.main(["summary", str(out)]) == 2
    err = capsys.readouterr().err
    assert "other.jsonl" in err and h.log_path.name in err and "dataset.nc" in err

    (tmp_path / "empty").mkdir()
    assert cli.main(["summary", str(tmp_path / "empty")]) == 2
    assert "without a dataset.nc or a JSONL log" in capsys.readouterr().err
    # A log that is a link, or hidden, is not read; a link is named, not
    # passed over in silence (the message was that of an empty folder).
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "x.jsonl").symlink_to(out / h.log_path.name)
    (linked / ".hidden.jsonl").write_bytes((out / h.log_path.name).read_bytes())
    assert cli.main(["summary", str(linked)]) == 2
    err = capsys.readouterr().err
    assert "x.jsonl is a link" in err and "not followed" in err, err


# ----- a new user's mistakes ----------------------------------------------------------


def test_merge_traces_given_a_folder_says_to_give_its_files(tmp_path, capsys):
    # it said "no trace file demo/traces"
    (tmp_path / "traces").mkdir()
    assert cli.main(["merge-traces", str(tmp_path / "traces"), "-o", "m.json"]) == 2
    err = capsys.readouterr().err
    assert "is a folder: give its trace files" in err and err.count("\n") == 1


def test_warnings_are_one_line_without_a_source_line(tmp_path, capsys):
    """Finding: the command's warnings showed jaxhistory's own file and line,
    ``.../jaxhistory/export/_load.py:57: RuntimeWarning: t.jsonl: skipped``."""
    log = tmp_path / "t.jsonl"
    log.write_bytes(
        b'{"step":0,"timestamp":null,"metrics":{"x":1.0},"aggregated":{}}\n'
        b"garbage\n"
        b'{"step":1,"timestamp":null,"metrics":{"x":2.0},"aggregated":{}}\n'
    )
    assert cli.main(["summary", str(log)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("jaxhistory: warning: ") and "skipped" in err
    assert ".py:" not in err and "RuntimeWarning" not in err


def test_a_damaged_dataset_beside_a_good_log_points_to_the_log(tmp_path, capsys):
    saved_run(tmp_path)
    run = tmp_path / "run"
    s = jh.HistoryState().update({"loss": 1.0})
    export.to_jsonl(s, run / "r1.jsonl")
    (run / "dataset.nc").write_bytes(b"not netCDF")
    assert cli.main(["summary", str(run)]) == 2
    err = capsys.readouterr().err
    assert "r1.jsonl beside it can be read instead" in err
    assert cli.main(["summary", str(run / "r1.jsonl")]) == 0


def test_a_warmup_that_leaves_no_step_is_said(tmp_path, capsys):
    # a table of '-' with count 0, and no word why
    saved_run(tmp_path)
    assert cli.main(["summary", str(tmp_path / "run"), "--warmup", "500"]) == 0
    err = capsys.readouterr().err
    assert "a warmup of 500 leaves none of the run's 20 steps" in err
    assert cli.main(["summary", str(tmp_path / "run"), "--warmup", "5"]) == 0
    assert capsys.readouterr().err == ""


def test_a_report_from_the_log_into_the_runs_own_folder_is_refused(tmp_path, capsys):
    """Finding: ``jaxhistory report run/x.jsonl -o run`` replaced finalize's
    dataset.nc with one rebuilt from the log: no config, no environment,
    float32 metrics as float64."""
    h = jh.History(distributed_history=False, report_dir=tmp_path / "run")
    h.update({"loss": np.float32(0.5)})
    h.finalize(plot=False)
    h.close()
    dataset = tmp_path / "run" / "dataset.nc"
    before = dataset.read_bytes()
    status = cli.main(["report", str(h.log_path), "-o", str(tmp_path / "run")])
    assert status == 2
    err = capsys.readouterr().err
    assert "would replace it with less" in err and err.count("\n") == 1
    assert dataset.read_bytes() == before
    # from the folder itself (its dataset), or into another folder: as before
    assert cli.main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "run")]) == 0
    assert cli.main(["report", str(h.log_path), "-o", str(tmp_path / "again")]) == 0
