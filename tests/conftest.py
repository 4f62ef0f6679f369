"""Test setup: 8 simulated CPU devices, set before JAX starts.

Every reducer is tested on a real 8-device mesh; a run that ends up with a different
device count stops here instead of passing vacuously on one device.

Each test process keeps JAX's compiled programs in a compilation cache of its
own for the session: many tests build the same programs anew (a new closure
under ``jax.jit``), and reading them back costs a fraction of compiling them.
The cache is this process's alone (processes the tests start do not inherit
it) and is removed at exit.

Compiling the tests' small programs is most of the suite's time, so XLA
compiles them the quick way (flags inherited by the processes the tests
start): without LLVM's optimisation passes
(``--xla_backend_optimization_level=0``: about a sixth of the suite's CPU
time), with XLA CPU's older LLVM IR emitters for fusions
(``--xla_cpu_use_fusion_emitters=false``) and in one piece
(``--xla_cpu_parallel_codegen_split_count=1``): together about a third less
compile time again. Neither changes what a program computes: fast math is off
either way, and every reducer test compares against float64 NumPy within
float32 rounding. A JAX that no longer knows one of these flags (XLA aborts on
an unknown flag) runs the suite without it: a child process tries them first.
The benchmarks, run by ``make bench``, keep XLA's defaults.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

QUICK_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _with_quick_compile_flags(flags: str) -> str:
    """``flags`` (XLA_FLAGS) with those of QUICK_COMPILE that this JAX knows
    and the user did not set, tried in a child process first."""
    extra = [f for f in QUICK_COMPILE if f.split("=")[0] not in flags]
    if not extra:
        return flags
    trial = " ".join([flags, *extra]).strip()
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env=dict(os.environ, XLA_FLAGS=trial, JAX_PLATFORMS="cpu"),
        capture_output=True,
        timeout=120,
        check=False,
    )
    return trial if probe.returncode == 0 else flags


os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# (pytest-xdist's workers inherit the result: they find every flag set)
os.environ["XLA_FLAGS"] = _with_quick_compile_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402 (after the environment above)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

if os.environ.get("JAX_COMPILATION_CACHE_DIR") is None:
    _CACHE = tempfile.mkdtemp(prefix="jaxhistory-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

if jax.device_count() != 8:
    raise RuntimeError(
        f"the jaxhistory tests need 8 devices, JAX sees {jax.device_count()}: "
        "JAX was initialised before tests/conftest.py could set JAX_NUM_CPU_DEVICES"
    )


@pytest.fixture(scope="session")
def mesh():
    """A 1-D mesh of all 8 devices, axis "data" (Explicit axes, the default)."""
    return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="session")
def mesh2d():
    """A 4x2 mesh, axes ("data", "model")."""
    return jax.make_mesh((4, 2), ("data", "model"))


# The modules that call the compiled helpers (each holds ``speedups``), which
# host_path switches; test_speedups checks the list against the sources.
HOST_PATH_MODULES = (
    "_codec",
    "_history_state",
    "_recorder",
    "_row",
    "_summary",
    "_table",
)


@pytest.fixture(params=["compiled", "python"])
def host_path(request, monkeypatch):
    """Runs a test of the host path's common case twice: with the compiled
    helpers (``jaxhistory._speedups``) and with the Python they stand in for.
    Returns the compiled module, or None on the Python run."""
    import importlib

    from jaxhistory import _compiled

    if request.param == "compiled" and _compiled.speedups is None:
        if os.environ.get("JAXHISTORY_PURE_PYTHON", "").strip() not in ("", "0"):
            pytest.skip("JAXHISTORY_PURE_PYTHON is set: the Python run only")
        pytest.fail("the compiled helpers (jaxhistory._speedups) are not built")
    chosen = _compiled.speedups if request.param == "compiled" else None
    for name in HOST_PATH_MODULES:
        module = importlib.import_module(f"jaxhistory.{name}")
        monkeypatch.setattr(module, "speedups", chosen)
    return chosen
