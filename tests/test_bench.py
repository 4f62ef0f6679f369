"""Smoke tests of the benchmarks: each script's --quick run, in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_quick(script: str, tmp_path: Path, *extra: str) -> tuple[str, str]:
    """Runs ``benchmarks/{script} --quick --out FILE`` (and ``extra``); returns
    (stdout, FILE text)."""
    env = dict(os.environ)
    env["JAX_NUM_CPU_DEVICES"] = "8"  # the subprocess starts its own JAX
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    out_file = tmp_path / f"{script}.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / script),
            "--quick",
            "--out",
            out_file,
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, out_file.read_text()


def test_bench_reducers_quick(tmp_path):
    out, _ = run_quick("bench_reducers.py", tmp_path)
    header = (
        "| K | implementation | collectives | compile s | median µs/call "
        "| ratio vs fused |"
    )
    assert header in out
    fused = re.findall(r"^\| (\d+) \| fused \| (\d+) \|", out, re.MULTILINE)
    assert [k for k, _ in fused] == ["1", "10", "100"], out
    for k, collectives in fused:
        assert int(collectives) <= 2, f"fused uses {collectives} collectives at K={k}"


def test_bench_history_quick(tmp_path):
    out, _ = run_quick("bench_history.py", tmp_path)
    for text in (
        "## 1. Host recording speed",
        "## 2. Memory",
        "## 3. Train loop on 8 simulated CPU devices",
        "| recorder | µs/step, 1k steps | µs/step, 10k steps |",
        "| measurement | steps | metrics | MiB | bytes per float64 | target |",
        "| variant | recording per step | steps/s | ms/step | ms/step range |",
    ):
        assert text in out, f"missing {text!r} in:\n{out}"
    # | `HistoryState.nbytes()` | steps | metrics | MiB | bytes per float64 | target |
    row = re.search(
        r"^\| `HistoryState\.nbytes\(\)` \| [\d,]+ \| 16 \| [\d.]+ \| ([\d.]+) \|",
        out,
        re.MULTILINE,
    )
    assert row, out
    assert float(row.group(1)) <= 12, row.group(0)
    # Every train-loop variant has a positive rate; `history` recorded every step
    # (the script fails otherwise).
    for variant in ("baseline", "history", "history_per_device", "float_per_metric"):
        rate = re.search(rf"^\| `{variant}` \| [^|]+ \| ([\d.]+) \|", out, re.MULTILINE)
        assert rate and float(rate.group(1)) > 0, f"no steps/s for {variant}"


def test_bench_export_quick(tmp_path):
    _, text = run_quick("bench_export.py", tmp_path)
    for part in (
        "finalize(plot=False), JSONL streamed during the run",
        "finalize(plot=False), JSONL written by finalize",
        "finalize() with plots, JSONL streamed",
        "to_jsonl",
        "to_png (10 PNGs)",
    ):
        row = re.search(rf"\|\s+{re.escape(part)} \| ([\d.]+) \|", text)
        assert row and float(row.group(1)) > 0, f"no time for {part}:\n{text}"
    assert "| 100,000 x 16 | to_netcdf |" in text
    assert "reads back exactly" in text


def test_bench_memory_quick(tmp_path):
    _, text = run_quick("bench_memory.py", tmp_path)
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", text, re.M)
    assert len(rows) == 2 and all(float(r[1]) > 0 for r in rows), text
    assert re.search(r"start \+ stop \| [\d.]+ \|", text), text
    assert re.search(r"inside `tracker.stage\(...\)` \| [\d.]+ \| [\d.]+ \|", text)


def test_bench_publish_quick(tmp_path):
    _, text = run_quick("bench_publish.py", tmp_path)
    for part in ("`put_metric` (null default handler)", "trace `counter` event"):
        assert re.search(rf"\| {re.escape(part)} \| [\d.]+ \|", text), text
    for sink in ("none", "`JsonlSink`", "`TensorBoardSink`"):
        assert re.search(rf"\| {re.escape(sink)} \| [\d.]+ \| [\d.]+ \|", text), text


def test_bench_multihost_quick(tmp_path):
    _, text = run_quick("bench_multihost.py", tmp_path)
    assert "| processes x devices | variant |" in text
    for variant in (
        "baseline",
        "history",
        "bare step",
        "history \\+ host",
        "history \\+ host, log_every=16",
    ):
        row = re.search(rf"^\| 2 \S 2 \| `{variant}` \| ([\d.]+) \|", text, re.M)
        assert row and float(row.group(1)) > 0, f"no ms/step for {variant}:\n{text}"
    launches = re.findall(
        r"^\| (every device|one device)[^|]* \| ([\d.]+)-", text, re.M
    )
    assert len(launches) == 3 and all(float(ms) > 0 for _, ms in launches), text


def test_bench_scale_quick(tmp_path):
    _, text = run_quick("bench_scale.py", tmp_path)
    for label in ("30 metrics x 200 steps, with plots", "1,000 key sets, no plots"):
        row = re.search(rf"^\| {re.escape(label)} \| [\d.]+ \| ([\d.]+) \|", text, re.M)
        assert row and float(row.group(1)) > 0, f"no figure for {label}:\n{text}"


def test_bench_metrics_quick(tmp_path):
    _, text = run_quick("bench_metrics.py", tmp_path)
    row = re.search(
        r"^\| jaxhistory `Collection`[^|]* \| 0 \| ([12]) \| (\d+) \| ([\d.]+) "
        r"\| yes \|",
        text,
        re.M,
    )
    assert row, text  # no collective per update, at most 2 per compute, exact
    assert re.search(
        r"^\| flax `nnx.MultiMetric`[^|]* \| \d+ \| \d+ \| \d+ \|", text, re.M
    )


def test_bench_watch_quick(tmp_path):
    _, text = run_quick("bench_watch.py", tmp_path)
    rows = re.findall(
        r"^\| (bare|watch|by_hand) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|", text, re.M
    )
    assert len(rows) == 6, text  # three variants, two placements
    bare = [int(n) for v, n, *_ in rows if v == "bare"]
    watched = [int(n) for v, n, *_ in rows if v == "watch"]
    # replicated gradients: no extra collective; sharded: at most two
    assert watched[0] == bare[0] and watched[1] - bare[1] <= 2, rows
    assert all(float(ms) > 0 for *_, ms, _ in rows)


def test_bench_stall_quick(tmp_path):
    _, text = run_quick("bench_stall.py", tmp_path)
    assert re.search(r"^\| sleeps \| 2 \| [\d.]+, [\d.]+ \| .*: met \|$", text, re.M), (
        text
    )
    assert re.search(r"^\| 2 \| 10% \| \d+, [\d.]+ \|", text, re.M), text
    assert re.search(
        r"^\| none \| 0% \| never \| 0 \(all processes\) \|$", text, re.M
    ), text
    assert "`HangWatch.beat`" in text


def test_bench_pod_quick(tmp_path):
    _, text = run_quick("bench_pod.py", tmp_path)
    rows = re.findall(
        r"^\| 10 \| (\d+) \| ([^|]+) \| (gather|O\(K\)) \| (\d) \| ([\d, ]+) \| "
        r"([\d,]+) \|$",
        text,
        re.M,
    )
    assert len(rows) == 8, text  # 2 device counts x 2 kinds of metric x 2 forms
    ok = {(d, kind): total for d, kind, form, _, _, total in rows if form == "O(K)"}
    # O(K): at most three all-reduces whose bytes do not grow with the devices
    assert all(int(n) <= 3 for *_, n, _, _ in rows), rows
    assert len(set(ok.values())) == 1, ok
    gather = {(d, k): t for d, k, form, _, _, t in rows if form == "gather"}
    assert gather[("16", "1 per device")] == "640", gather
    timed = re.findall(
        r"^\| 10 \| (8|16) \| [^|]+ \| (\d+) \| (\d+) \| ([\d.]+) \|$", text, re.M
    )
    assert len(timed) == 4 and all(float(r) > 0 for *_, r in timed), text


def test_bench_gpu_quick_on_cpu_devices(tmp_path):
    """The accelerator checks run their code on CPU devices with --allow-cpu."""
    _, text = run_quick("bench_gpu.py", tmp_path, "--allow-cpu")
    # | dtype | elements | mean err | std err | exact | ms | norm err | rms err | ms |
    rows = re.findall(
        r"^\| (float32|bfloat16) \| [\d,]+ \| ([\d.e+-]+) \| ([\d.e+-]+) \| "
        r"(\S+) \| [\d.]+ \| ([\d.e+-]+) \| ([\d.e+-]+) \| [\d.]+ \|",
        text,
        re.M,
    )
    assert len(rows) == 4, text
    for _, mean, std, exact, norm, rms in rows:
        assert exact == "yes", text
        assert max(map(float, (mean, std, norm, rms))) < 1e-6, text
    assert re.search(r"^\| watch \| \d+ \| [\d.]+ \| [\d.]+ \|", text, re.M), text
    assert "| `history` | " in text, text
    assert "| alloc: a 1 GiB array made | 1,024.0 |" in text, text
    loops = re.findall(r"^\| [^|]+ \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    # bare, per value, stacked, none, packed
    assert len(loops) == 5 and float(loops[2][0]) > 0, text
    assert float(loops[4][0]) > 0, text
    assert "| `History.update(m, summarize=False)` | " in text, text


def test_bench_gpu_runs_only_the_sections_named(tmp_path):
    _, text = run_quick("bench_gpu.py", tmp_path, "--allow-cpu", "--only", "scalars")
    assert "## Recording device scalars" in text, text
    assert "`jh.Stats.of` of the 10" in text, text
    assert "| `history` | " not in text and "float32" not in text, text


def test_bench_gpu_stops_without_an_accelerator(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "no accelerator" in proc.stderr, proc.stderr
