"""Test setup: 8 simulated CPU devices, set before JAX starts.

Every reducer is tested on a real 8-device mesh; a run that ends up with a different
device count stops here instead of passing vacuously on one device.

Each test process keeps JAX's compiled programs in a compilation cache of its
own for the session: many tests build the same programs anew (a new closure
under ``jax.jit``), and reading them back costs a fraction of compiling them.
The cache is this process's alone (processes the tests start do not inherit
it) and is removed at exit.

XLA compiles the tests' programs without LLVM's optimisation passes
(``--xla_backend_optimization_level=0``, inherited by the processes the tests
start): the programs are small, compiling them is most of the suite's time,
and this cuts the suite's CPU time by about a sixth. The results are the same:
no pass changes floating-point arithmetic (fast math is off either way), and
the benchmarks, run by ``make bench``, keep XLA's default.
"""

import atexit
import os
import shutil
import tempfile

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        f
        for f in (os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0")
        if f
    )
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

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
