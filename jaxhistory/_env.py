"""Run metadata: where and with what a run happened."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import threading
from typing import Any

import jax
import numpy as np

__all__ = [
    "ENV_LABELS",
    "check_run_id",
    "check_run_name",
    "env_flag",
    "environment",
    "netcdf_attrs",
    "new_run_id",
    "not_a_name",
]

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


_CLAIMED: set[str] = set()  # run ids given out in this process
_CLAIM_LOCK = threading.Lock()
MAX_RUN_NAME = 200  # characters: the run id must stay a valid file name


def not_a_name(text: str, limit: int = MAX_RUN_NAME) -> str | None:
    """Why ``text`` is not one safe file-name component (``"it contains '/'"``),
    or None when it is one: no separators, not empty, ``.`` or ``..`` (so never
    an absolute path nor a way out of a folder), no control characters, at most
    ``limit`` bytes in UTF-8."""
    bad = [c for c in ("/", "\\", os.sep, os.altsep) if c and c in text]
    if bad:
        return f"it contains {bad[0]!r}"
    if len(text.encode("utf-8", "surrogatepass")) > limit:
        return f"it is longer than {limit} bytes in UTF-8"
    if (
        not text
        or text in (".", "..")
        or "\0" in text
        or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text)
    ):
        return "it is empty, '.', '..' or holds control characters"
    return None


def check_run_name(
    run_name: Any, what: str = "run_name", limit: int = MAX_RUN_NAME
) -> str | None:
    """``run_name`` if it is a name (it becomes part of file names), else a
    ValueError saying why: a run name is never a path."""
    if run_name is None:
        return None
    if not isinstance(run_name, str):
        raise TypeError(f"{what} must be a str, got {type(run_name).__name__}")
    why = not_a_name(run_name, limit)
    if why is not None:
        raise ValueError(
            f"{what} {run_name!r:.80} is not a name ({why}): it names files, so "
            "it may not be a path; put the folder in report_dir or jsonl_path"
        )
    return run_name


MAX_RUN_ID = 255 - len(".jsonl")  # bytes: the run id names the file {run_id}.jsonl


def check_run_id(run_id: Any, source: Any) -> str | None:
    """``run_id`` as read from ``source`` (a log, a dataset, a state) if it is
    one safe file-name component, else a ValueError (TypeError for a non-str)
    naming ``source``: a run id names the run's log, so it is never a path."""
    if run_id is None:
        return None
    if not isinstance(run_id, str):
        raise TypeError(
            f"the run id recorded in {source} must be a str, got "
            f"{type(run_id).__name__}"
        )
    why = not_a_name(run_id, MAX_RUN_ID)
    if why is not None:
        raise ValueError(
            f"the run id {run_id!r:.80} recorded in {source} is not a name "
            f"({why}): it names the run's log file, so it may not be a path; "
            "nothing was written"
        )
    return run_id


def new_run_id(run_name: str | None = None, taken: Any = None) -> str:
    """``{run_name}-{YYYYmmdd-HHMMSS}`` in local time (``run-...`` without a
    name), unique in this process: a second id in the same second gets
    ``-2``, ``-3``, ... appended, as does one that ``taken(id)`` says is in use
    (a log file that exists, for example)."""
    check_run_name(run_name)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{run_name or 'run'}-{stamp}"
    with _CLAIM_LOCK:
        run_id, k = base, 1
        while run_id in _CLAIMED or (taken is not None and taken(run_id)):
            k += 1
            run_id = f"{base}-{k}"
        _CLAIMED.add(run_id)
    return run_id


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
