"""Entry point of one process started by :func:`jaxhistory.launch_local`.

Run as ``python -m jaxhistory._launch_worker SPEC`` where SPEC is a pickle written by
the launcher. The process initialises JAX's multi-controller runtime, calls the
target and pickles its return value (or the exception) for the launcher.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import sys
import traceback


def _resolve(target: str):
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(spec_path: str) -> int:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    os.environ["JAX_NUM_CPU_DEVICES"] = str(spec["devices_per_process"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", spec["devices_per_process"])
    address = f"127.0.0.1:{spec['port']}"
    jax.distributed.initialize(
        coordinator_address=address,
        coordinator_bind_address=address,  # loopback only, never every interface
        num_processes=spec["num_processes"],
        process_id=spec["process_id"],
        initialization_timeout=int(spec["timeout"]),
    )
    # At exit, after what the target registered there (last in, first out): a
    # History the target never closed stops watching for hangs (its thread
    # inside the runtime's client would abort the process) before the runtime
    # shuts down.
    atexit.register(jax.distributed.shutdown)
    try:
        fn = _resolve(spec["target"])
        result = ("ok", fn(*spec["args"], **spec["kwargs"]))
    except BaseException as err:  # reported to the launcher, then re-raised
        traceback.print_exc()
        result = ("error", f"{type(err).__name__}: {err}")
    try:
        payload = pickle.dumps(result)
    except Exception as err:
        result = ("error", f"the return value does not pickle: {err}")
        payload = pickle.dumps(result)
    with open(spec["result_path"], "wb") as f:
        f.write(payload)
    if result[0] != "ok":
        # Leave at once: jax.distributed.shutdown() is a barrier, and the other
        # processes may be stuck in a collective this one will never join.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0  # jax.distributed.shutdown() runs at exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
