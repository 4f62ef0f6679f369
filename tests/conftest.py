"""Test setup: 8 simulated CPU devices, set before JAX starts.

Every reducer is tested on a real 8-device mesh; a run that ends up with a different
device count stops here instead of passing vacuously on one device.
"""

import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

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
