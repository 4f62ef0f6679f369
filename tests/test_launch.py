"""Multi-process runs: real JAX processes on 127.0.0.1, each under a timeout."""

import os

import numpy as np
import pytest
from mp_workers import global_data

import jaxhistory as jh

pytestmark = pytest.mark.slow


def _reference(seed, n_metrics, n_values):
    out = {}
    for name, v in global_data(seed, n_metrics, n_values).items():
        v = v.astype(np.float64)
        out.update(
            {
                f"{name}/mean": v.mean(),
                f"{name}/max": v.max(),
                f"{name}/min": v.min(),
                f"{name}/std": v.std(),
            }
        )
    return out


def test_two_processes_match_one_process_with_the_same_devices():
    args = (7, 5)
    two = jh.launch_local(
        "mp_workers:stats_on_global_mesh", 2, 2, args=args, timeout=180
    )
    one = jh.launch_local(
        "mp_workers:stats_on_global_mesh", 1, 4, args=args, timeout=180
    )
    assert [r["process_index"] for r in two] == [0, 1]
    assert all(r["process_count"] == 2 and r["device_count"] == 4 for r in two)
    assert one[0]["process_count"] == 1 and one[0]["device_count"] == 4
    # Each process really holds different data.
    assert two[0]["local_values"] != two[1]["local_values"]
    ref = _reference(*args, 4)
    for result in (*two, *one):
        for family in ("spmd", "collective"):
            got = result[family]
            assert set(got) == set(ref)
            for key, want in ref.items():
                np.testing.assert_allclose(got[key], want, rtol=1e-5, err_msg=key)
                # Bit-for-bit the same as the single-process run.
                assert got[key] == one[0][family][key], key


def test_a_failing_process_fails_the_job_with_its_log():
    with pytest.raises(jh.LaunchError) as info:
        jh.launch_local("mp_workers:fail_on_process_one", 2, 1, timeout=120)
    message = str(info.value)
    assert "process 1: RuntimeError: process one gives up" in message
    assert "Traceback" in info.value.logs[1]
    # what failed without the logs; a process the launcher killed says so
    summary = info.value.summary.splitlines()
    assert summary[1:] in (
        ["process 0: killed as another process failed (its function had returned)",
         "process 1: RuntimeError: process one gives up"],
        ["process 1: RuntimeError: process one gives up"],  # 0 had exited
    ), summary  # fmt: skip
    assert "Traceback" not in info.value.summary


def test_a_failure_is_reported_at_once_while_others_wait_in_a_collective():
    import time

    start = time.monotonic()
    with pytest.raises(jh.LaunchError) as info:
        jh.launch_local(
            "mp_workers:fail_while_the_other_waits_in_a_collective", 2, 1, timeout=90
        )
    assert "timed out" not in str(info.value)
    assert "process 1: RuntimeError: rank one gives up" in str(info.value)
    assert time.monotonic() - start < 60


def test_a_hung_job_is_killed_at_the_timeout():
    with pytest.raises(jh.LaunchError, match="timed out after 6s") as info:
        jh.launch_local("mp_workers:sleep_forever", 2, 1, timeout=6)
    assert "process 1: killed at the timeout" in info.value.summary.splitlines()


def test_callable_targets_must_be_importable():
    with pytest.raises(ValueError, match="module-level"):
        jh.launch_local(lambda: 1)
    with pytest.raises(ValueError, match="package.module:function"):
        jh.launch_local("no_colon_here")
    with pytest.raises(ValueError, match="at least 1"):
        jh.launch_local("mp_workers:sleep_forever", 0)


def test_free_port_can_be_bound_on_loopback():
    import socket

    from jaxhistory.launch import free_port

    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_name_mismatch_error_lists_only_the_metrics_the_user_recorded():
    results = jh.launch_local(
        "mp_workers:names_differ_beside_a_shared_one", 2, 1, timeout=120
    )
    for message in results:
        assert "processes passed different metrics to History.update" in message
        assert "process 0 has ['acc']" in message, message
        assert "process 1 has ['lost']" in message, message
        assert "(all have ['loss'])" in message, message
        assert "straggler" not in message, message
    timed_out = jh.launch_local("mp_workers:names_timeout", 2, 1, timeout=120)[0]
    assert "(process 0 records ['loss'] from step 0)" in timed_out["error"], timed_out


# ----- the output of launched processes ---------------------------------------------


@pytest.mark.slow
def test_launched_processes_output_is_streamed_with_a_prefix(capsys, tmp_path):
    import mp_workers

    assert jh.launch_local(mp_workers.say, 2, args=("hey",), timeout=120) == [0, 1]
    out = capsys.readouterr().out
    for pid in (0, 1):
        assert f"[process {pid}] hey from {pid}" in out
        assert f"[process {pid}] hey on stderr" in out
    # To files it names instead, or nowhere.
    jh.launch_local(mp_workers.say, 2, timeout=120, output=tmp_path / "logs")
    assert capsys.readouterr().out == ""
    assert "hi from 1" in (tmp_path / "logs" / "process-1.log").read_text()
    jh.launch_local(mp_workers.say, 2, timeout=120, output=None)
    assert capsys.readouterr().out == ""
    with pytest.raises(TypeError, match="output must be 'stream', a folder or None"):
        jh.launch_local(mp_workers.say, 2, output=3)


def test_a_replicated_tree_is_spread_over_the_devices_of_every_process():
    results = jh.launch_local(
        "mp_workers:spread_watch_across_processes", 2, 2, timeout=240
    )
    assert [r["process_index"] for r in results] == [0, 1]
    for r in results:
        assert r["counts True"] == {"all-reduce": 1}
        assert r["counts False"] == {}
        keys = sorted(r["False"])
        assert sorted(r["True"]) == keys
        np.testing.assert_allclose(
            [r["True"][k] for k in keys], [r["False"][k] for k in keys], rtol=3e-7
        )
        for name, values in r["host"].items():
            x = np.asarray(values, np.float32).astype(np.float64)
            assert r["True"][f"{name}/max_abs"] == np.abs(x[~np.isnan(x)]).max()
            assert r["True"][f"{name}/nonfinite"] == np.isnan(x).sum()
    first, second = (np.array(list(r["True"].values())) for r in results)
    np.testing.assert_array_equal(first, second)  # the same on every process


def test_a_target_whose_module_does_not_exist_fails_before_any_process_starts(
    monkeypatch, tmp_path
):
    """Finding: a misspelt module started N processes that each printed the
    same ModuleNotFoundError traceback."""
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(
        jh.launch.subprocess, "Popen", lambda *a, **k: started.append(a)
    )
    with pytest.raises(ValueError, match=r"no module named 'nosuchmod_x'"):
        jh.launch_local("nosuchmod_x.sub:main", 2)
    assert started == []
    (tmp_path / "mine_here.py").write_text("def main():\n    return 1\n")
    jh.launch._check_importable("mine_here", "")  # the working folder counts
    jh.launch._check_importable("json", "")  # and what sys.path holds
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "only_there.py").write_text("def main():\n    return 1\n")
    with pytest.raises(ValueError, match="only_there"):
        jh.launch._check_importable("only_there", "")
    jh.launch._check_importable("only_there", f"/nowhere{os.pathsep}{extra}")
