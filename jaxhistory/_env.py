"""Run metadata: where and with what a run happened."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from typing import Any

import jax
import numpy as np

__all__ = ["ENV_LABELS", "env_flag", "environment", "netcdf_attrs", "new_run_id"]

# The keys of environment() that describe a run, with their labels in the report.
ENV_LABELS = {
    "python": "Python",
    "jax_version": "jax",
    "jaxlib_version": "jaxlib",
    "backend": "backend",
    "device_kind": "device kind",
    "device_count": "devices",
    "local_device_count": "devices in this process",
    "process_count": "processes",
    "mesh": "mesh",
    "hostname": "host",
}


def new_run_id(run_name: str | None = None) -> str:
    """``{run_name}-{YYYYmmdd-HHMMSS}`` in local time (``run-...`` without a name)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{run_name or 'run'}-{stamp}"


def _mesh_text(mesh: Any) -> str | None:
    if mesh is None:
        try:
            mesh = jax.sharding.get_abstract_mesh()
        except Exception:
            return None
    shape = getattr(mesh, "shape", None)
    if not shape:
        return None
    return " x ".join(f"{name}={size}" for name, size in dict(shape).items())


def environment(mesh: Any = None) -> dict[str, Any]:
    """Python, jax/jaxlib versions, backend, devices, processes and mesh.

    ``mesh`` (a ``jax.sharding.Mesh`` or its shape) is described when given, else
    the mesh set with ``jax.set_mesh`` if any.
    """
    import jaxlib

    devices = jax.devices()
    env = {
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind if devices else "",
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "process_index": jax.process_index(),
        "platform": sys.platform,
        "hostname": platform.node(),
        "pid": os.getpid(),
    }
    mesh_text = _mesh_text(mesh)
    if mesh_text:
        env["mesh"] = mesh_text
    return env


def netcdf_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with values netCDF can store (others as JSON or ``str``)."""
    out = {}
    for key, value in attrs.items():
        if value is None:
            continue
        if isinstance(value, bool | np.bool_):
            value = int(value)
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, str | int | float):
            out[str(key)] = value
        else:
            try:
                out[str(key)] = json.dumps(value, default=str)
            except (TypeError, ValueError):
                out[str(key)] = str(value)
    return out


def env_flag(name: str) -> bool:
    """An on/off environment variable: 1/true/yes/on, or 0/false/no/off/empty (not
    set); anything else is a ValueError naming the variable."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/true/yes or 0/false/no")
