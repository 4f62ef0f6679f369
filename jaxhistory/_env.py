"""Run metadata: where and with what a run happened."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import enum
import importlib.metadata
import json
import math
import os
import platform
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxhistory._names import MAX_DEPTH

__all__ = [
    "ENV_LABELS",
    "INFO_LABELS",
    "MAX_CONFIG_BYTES",
    "check_run_id",
    "check_run_name",
    "env_flag",
    "environment",
    "environment_info",
    "metadata_json",
    "netcdf_attrs",
    "new_run_id",
    "not_a_name",
    "plain_metadata",
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


# ----- run metadata the user gives: a run config, environment info -------------------
MAX_CONFIG_BYTES = 1 << 20  # a config (or env_info) as JSON: one dataset attribute
MAX_CONFIG_ARRAY = 1024  # elements of one array inside a config
_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}

# Labels in the report of the keys environment_info() adds to environment().
INFO_LABELS = {
    "python_implementation": "Python implementation",
    "executable": "Python executable",
    "platform": "OS",
    "platform_detail": "platform",
    "process_index": "process",
    "pid": "process id",
    "cwd": "working folder",
    "jaxhistory_version": "jaxhistory",
    "flax_version": "flax",
    "optax_version": "optax",
    "orbax_version": "orbax-checkpoint",
    "numpy_version": "numpy",
}
# distribution -> key: versions read from the installed metadata (nothing imported)
_VERSIONS = {
    "jaxhistory": "jaxhistory_version",
    "flax": "flax_version",
    "optax": "optax_version",
    "orbax-checkpoint": "orbax_version",
    "numpy": "numpy_version",
}


def _fields(value: Any) -> Mapping | None:
    """The named fields of a mapping, a dataclass instance or a namespace."""
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, argparse.Namespace | types.SimpleNamespace):
        return vars(value)
    return None


def plain_metadata(value: Any, what: str = "config") -> dict[str, Any]:
    """``value`` (a dict, a dataclass instance or a namespace, nested) as plain
    JSON data: a new copy, so changing ``value`` later changes nothing recorded.

    Dicts (and any mapping), dataclass instances and ``argparse`` or ``types``
    namespaces become dicts with str keys (int keys become their digits); lists
    and tuples lists; str, int, float, bool and None stay; NumPy and JAX scalars
    become numbers, their arrays of at most 1024 elements lists; paths become
    str, enum members their value, dates and times ISO text; NaN and infinities
    the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (as in the JSONL
    log).

    Args:
        value: the run config (or environment info).
        what: how errors name it (``"config"``, ``"env_info"``).

    Raises:
        TypeError: ``value`` is not a mapping, a dataclass instance or a
            namespace; a value of another kind (a function, an object), or a key
            that is not a str or an int, named by its path
            (``config['optimizer']['schedule']``).
        ValueError: two keys that become one (``1`` and ``"1"``), a container
            that holds itself, nesting deeper than 100 levels, an array of more
            than 1024 elements, or more than 1 MiB of JSON in all.

    Examples:
        >>> import dataclasses
        >>> from jaxhistory._env import plain_metadata
        >>> @dataclasses.dataclass
        ... class Optimizer:
        ...     lr: float = 1e-3
        ...     betas: tuple = (0.9, 0.999)
        >>> plain_metadata({"opt": Optimizer(), "seed": 0, 1: float("nan")})
        {'opt': {'lr': 0.001, 'betas': [0.9, 0.999]}, 'seed': 0, '1': 'NaN'}
    """
    if _fields(value) is None:
        raise TypeError(
            f"{what} must be a dict, a dataclass instance or a namespace, got "
            f"{type(value).__name__}"
        )
    out = _plain(value, what, what, 0, set())
    size = len(metadata_json(out).encode("utf-8"))
    if size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{what} is {size} bytes as JSON, more than the {MAX_CONFIG_BYTES} "
            "it may hold (it is stored as one dataset attribute): leave out the "
            "large values"
        )
    return out


def _plain(value: Any, where: str, what: str, depth: int, seen: set) -> Any:
    """One value of :func:`plain_metadata` (``where``: its path, for errors)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} nests more than {MAX_DEPTH} levels deep at {where}")
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or type(value) in (bool, int, str):
        return value
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        number = float(value)
        if math.isnan(number):
            return "NaN"
        return _NONFINITE.get(number, number)
    if isinstance(value, str):
        return str.__str__(value)  # a plain str, not the subclass
    if isinstance(value, os.PathLike):
        return os.fsdecode(value)
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, np.ndarray | jax.Array):
        return _plain_array(value, where, what, depth, seen)
    fields = _fields(value)
    if fields is None and not isinstance(value, list | tuple):
        raise TypeError(
            f"{where} is a {type(value).__name__}, which {what} cannot hold: give "
            "str, int, float, bool, None, lists, dicts or dataclasses (convert it "
            "first, e.g. with str())"
        )
    if id(value) in seen:
        raise ValueError(f"{where} holds itself: {what} must not be circular")
    seen.add(id(value))
    try:
        if fields is None:
            return [
                _plain(v, f"{where}[{i}]", what, depth + 1, seen)
                for i, v in enumerate(value)
            ]
        out: dict[str, Any] = {}
        for key, item in fields.items():
            if isinstance(key, str):
                name = str.__str__(key)
            elif isinstance(key, int | np.integer) and not isinstance(
                key, bool | np.bool_
            ):
                name = str(int(key))
            else:
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}): keys "
                    "must be str or int"
                )
            if name in out:
                raise ValueError(
                    f"{where} has two keys that both become {name!r} ({key!r} and "
                    f"{name!r})"
                )
            out[name] = _plain(item, f"{where}[{name!r}]", what, depth + 1, seen)
        return out
    finally:
        seen.discard(id(value))


def _plain_array(value: Any, where: str, what: str, depth: int, seen: set) -> Any:
    try:
        arr = np.asarray(value)
    except Exception as err:  # a tracer: not a value yet
        raise TypeError(f"{where} is not a concrete array ({err})") from None
    if arr.size > MAX_CONFIG_ARRAY:
        raise ValueError(
            f"{where} is an array of {arr.size} elements; {what} holds arrays of "
            f"at most {MAX_CONFIG_ARRAY}"
        )
    if arr.dtype.kind not in "biufU":
        if not jax.dtypes.issubdtype(arr.dtype, np.floating):  # bfloat16 and kin
            raise TypeError(f"{where} is an array of {arr.dtype}, not of numbers")
        arr = arr.astype(np.float64)
    return _plain(arr.tolist(), where, what, depth, seen)


def metadata_json(value: Any) -> str:
    """``value`` (from :func:`plain_metadata`) as strict JSON text, as it is
    stored in the dataset's attributes."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def environment_info(mesh: Any = None) -> dict[str, Any]:
    """What ``finalize(env_info=True)`` records: :func:`environment` (Python,
    jax/jaxlib, backend, device kind and count, processes, host, mesh), the
    Python implementation and executable, the platform, the working folder and
    the versions of jaxhistory, flax, optax, orbax-checkpoint and NumPy where
    installed (read from their metadata: nothing is imported). No environment
    variables, so no secrets."""
    env = environment(mesh)
    env["python_implementation"] = platform.python_implementation()
    env["executable"] = sys.executable
    env["platform_detail"] = platform.platform()
    with contextlib.suppress(OSError):  # the working folder was removed
        env["cwd"] = os.getcwd()
    for dist, key in _VERSIONS.items():
        try:
            env[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return env
