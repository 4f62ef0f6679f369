"""Benchmark: distributed_stats' collective bytes as the device count grows.

``jaxhistory.distributed_stats(metrics, provenance=True)`` compiles to one of two
forms (``jaxhistory._stats.GATHER_DEVICES`` picks, by the number of devices
holding a leaf):

* ``gather``: leaves with one value per device are gathered whole in one
  all-reduce of ``K x D`` values; larger leaves take two all-reduces, provenance
  counting per device the elements equal to the max and the min in the sum
  (``2 x K x D`` values);
* ``O(K)``: two passes for every leaf (a max all-reduce, then the shifted sum)
  and, for provenance, a third max all-reduce of ``2 x K`` values: the lowest
  rank holding each max and min. No all-reduce grows with ``D``.

Two parts, each device count ``D`` in a subprocess of its own started with
``JAX_NUM_CPU_DEVICES=D``:

1. Bytes (compiled, not run): for K in (10, 100) and D in (8, 64, 256), K
   metrics of one value per device and K arrays of ``4 x D`` values, both
   forms: the number of all-reduces and the bytes of each
   (``jaxhistory.collective_bytes``).
2. Time: K = 100 metrics of one value per device, and 100 arrays of ``4 x D``
   values, at D = 8, 16, 32, 64: both forms compiled once, then called in
   pairs (the order alternating), each call waiting for its result; the median
   time per call of each form and the median of the per-pair ratio. Simulated
   CPU devices are threads of one process sharing this machine's cores: a
   stand-in for a real interconnect, where the latency of each all-reduce
   (which the ``O(K)`` form pays up to three times) is larger, and so is the
   cost of each byte (which the ``gather`` form pays ``D`` times).

Run: ``make bench`` or ``python benchmarks/bench_pod.py [--out PATH]``;
``--quick`` is a smoke run (K = 10, D in (8, 16), few repeats).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BYTES_KS, BYTES_DS = (10, 100), (8, 64, 256)
TIME_K, TIME_DS = 100, (8, 16, 32, 64)
QUICK_K, QUICK_DS = 10, (8, 16)
SHAPES = ("1 per device", "4 x D")
FORMS = {"gather": 1 << 30, "O(K)": 0}  # GATHER_DEVICES for each form


def _worker(devices: int, byte_ks: list[int], time_k: int, repeats: int) -> dict:
    """In a process with ``devices`` simulated CPU devices: the bytes of each
    form for ``byte_ks`` metrics, and the timing of both at ``time_k`` (0: none)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhistory as jh
    from jaxhistory import _stats

    jax.config.update("jax_num_cpu_devices", devices)
    if jax.device_count() != devices:
        raise SystemExit(f"asked for {devices} devices, JAX sees {jax.device_count()}")
    mesh = jax.make_mesh((devices,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(devices)

    def metrics(k: int, per_device: int) -> dict:
        size = per_device * devices
        return {
            f"m{i}": jax.device_put(
                (1e3 + rng.standard_normal(size)).astype(np.float32), sharding
            )
            for i in range(k)
        }

    def compiled(form: str, m: dict):
        _stats.GATHER_DEVICES = FORMS[form]  # read while tracing, below
        fn = jax.jit(lambda v: jh.distributed_stats(v, provenance=True, mesh=mesh))
        lowered = fn.lower(m)
        return lowered.compile(), jh.collective_bytes(fn, m)

    out: dict = {"bytes": [], "time": []}
    for k in byte_ks:
        for shape, per_device in zip(SHAPES, (1, 4), strict=True):
            m = metrics(k, per_device)
            for form in FORMS:
                found = compiled(form, m)[1]
                out["bytes"].append(
                    {
                        "k": k,
                        "shape": shape,
                        "form": form,
                        "bytes": found.get("all-reduce", []),
                        "other": {
                            op: b for op, b in found.items() if op != "all-reduce"
                        },
                    }
                )
    if time_k:
        calls = 20
        for shape, per_device in zip(SHAPES, (1, 4), strict=True):
            m = metrics(time_k, per_device)
            fns = {form: compiled(form, m)[0] for form in FORMS}
            results = {form: jax.device_get(dict(fn(m))) for form, fn in fns.items()}
            _check_same(results, time_k)
            seconds: dict[str, list[float]] = {form: [] for form in FORMS}
            for r in range(repeats):
                order = list(FORMS) if r % 2 == 0 else list(FORMS)[::-1]
                for form in order:
                    fn = fns[form]
                    start = time.perf_counter()
                    for _ in range(calls):
                        jax.block_until_ready(fn(m))
                    seconds[form].append((time.perf_counter() - start) / calls)
            out["time"].append({"k": time_k, "shape": shape, "seconds": seconds})
    return out


def _check_same(results: dict, k: int) -> None:
    """Both forms give the same statistics and the same device indices."""
    import numpy as np

    gather, ok = results["gather"], results["O(K)"]
    for key, want in gather.items():
        got = ok[key]
        same = (
            got == want
            if key.rsplit("/", 1)[1] in ("argmax", "argmin", "nan_device")
            else np.allclose(got, want, rtol=1e-5)
        )
        if not same:
            raise AssertionError(f"the forms differ on {key}: {want} and {got} (K={k})")


def run_worker(devices: int, byte_ks, time_k: int, repeats: int) -> dict:
    """Runs :func:`_worker` in a fresh process with ``devices`` CPU devices."""
    env = dict(os.environ)
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["JAX_PLATFORMS"] = "cpu"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        json.dumps([devices, list(byte_ks), time_k, repeats]),
    ]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"the {devices}-device worker failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bytes_section(found: dict[int, dict]) -> str:
    rows = [
        "## All-reduce bytes, compiled (`distributed_stats(provenance=True)`)",
        "",
        "float32 metrics; bytes per device of each all-reduce, in program order "
        "(`jaxhistory.collective_bytes`).",
        "",
        "| K | D | metrics | form | all-reduces | bytes of each | total bytes |",
        "|---:|---:|---|---|---:|---|---:|",
    ]
    entries = [(d, e) for d, out in sorted(found.items()) for e in out["bytes"]]
    entries.sort(key=lambda de: (de[1]["k"], SHAPES.index(de[1]["shape"]), de[0]))
    for devices, e in entries:
        each = ", ".join(f"{b:,}" for b in e["bytes"]) or "none"
        other = f" (and {e['other']})" if e["other"] else ""
        rows.append(
            f"| {e['k']} | {devices} | {e['shape']} | {e['form']} | "
            f"{len(e['bytes'])} | {each}{other} | {sum(e['bytes']):,} |"
        )
    return "\n".join(rows) + "\n"


def time_section(found: dict[int, dict], repeats: int) -> str:
    rows = [
        "## Time per call, both forms (`distributed_stats(provenance=True)`)",
        "",
        f"{repeats} paired repeats of 20 calls each (the forms' order alternating), "
        "each call waiting for its result; median µs per call, and the median "
        "over pairs of gather's time over O(K)'s (above 1: O(K) is faster). "
        "Simulated CPU devices (threads of one process on "
        f"{os.cpu_count()} cores) stand in for a real interconnect, where the "
        "per-all-reduce latency (three all-reduces for O(K), one or two for "
        "gather) is larger, and so is the cost per byte (K x D values for "
        "gather).",
        "",
        "| K | D | metrics | gather µs/call | O(K) µs/call | gather / O(K), paired |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    entries = [(d, e) for d, out in sorted(found.items()) for e in out["time"]]
    entries.sort(key=lambda de: (SHAPES.index(de[1]["shape"]), de[0]))
    faster = []  # device counts at which the gather is faster, one value per device
    for devices, e in entries:
        s = e["seconds"]
        ratio = statistics.median(
            g / o for g, o in zip(s["gather"], s["O(K)"], strict=True)
        )
        if ratio < 1 and e["shape"] == SHAPES[0]:
            faster.append(devices)
        rows.append(
            f"| {e['k']} | {devices} | {e['shape']} | "
            f"{statistics.median(s['gather']) * 1e6:.0f} | "
            f"{statistics.median(s['O(K)']) * 1e6:.0f} | {ratio:.2f} |"
        )
    from jaxhistory._stats import GATHER_DEVICES

    rows += [
        "",
        "The gather is faster, for one value per device, at D = "
        f"{', '.join(map(str, faster)) or 'none measured'}; "
        f"`jaxhistory._stats.GATHER_DEVICES` is {GATHER_DEVICES} (the gather up to "
        "that many devices, O(K) above).",
    ]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--repeats", type=int, default=0, help="paired repeats")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*json.loads(args.worker))), flush=True)
        return 0
    if args.quick:
        byte_ks, byte_ds, time_k, time_ds = (QUICK_K,), QUICK_DS, QUICK_K, QUICK_DS
        repeats = args.repeats or 3
    else:
        byte_ks, byte_ds, time_k, time_ds = BYTES_KS, BYTES_DS, TIME_K, TIME_DS
        repeats = args.repeats or 25
    found = {}
    for devices in sorted(set(byte_ds) | set(time_ds)):
        found[devices] = run_worker(
            devices,
            byte_ks if devices in byte_ds else (),
            time_k if devices in time_ds else 0,
            repeats,
        )
        print(f"D={devices}: done", flush=True)
    sys.path.insert(0, str(HERE))
    import jax
    from _common import report

    info = (
        f"jax {jax.__version__}, python {platform.python_version()}, D simulated "
        f"CPU devices in a subprocess per D, os.cpu_count()={os.cpu_count()}"
    )
    sections = [bytes_section(found), time_section(found, repeats)]
    report(info, args.quick, sections, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
