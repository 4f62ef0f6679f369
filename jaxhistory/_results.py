"""End-of-stage metric tables and result files, in the style of the HF Trainer."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orjson

from jaxhistory._files import atomic_write, check_target
from jaxhistory._history_state import HistoryState
from jaxhistory._names import printable

__all__ = ["log_metrics", "metrics_format", "save_metrics", "save_state"]

logger = logging.getLogger("jaxhistory")

_MIB = 2**20


def _scalar(value: Any) -> Any:
    """NumPy and JAX scalars (and 0-d arrays) as Python numbers; others unchanged.

    A float narrower than float64 becomes the shortest Python float that rounds
    back to it: ``np.float32(0.2113)`` is ``0.2113``, not ``0.21130000054836273``.
    """
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.ndim == 0:
            if arr.dtype.kind in "fV" and arr.dtype.itemsize < 8:
                return _short_float(arr[()])
            if arr.dtype.kind not in "biuf":  # bfloat16 and other ml_dtypes
                return float(arr) if arr.dtype.kind == "V" else arr.item()
            return arr.item()
    return value


def _short_float(x: Any) -> float:
    """A narrow float (float32, float16, bfloat16) as the shortest Python float
    that reads back as the same narrow value (NumPy's repr is the shortest)."""
    as_float = float(x)
    if not math.isfinite(as_float):
        return as_float
    return float(str(x))


def _on_host(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with device values fetched in one transfer, order kept (a dict
    through ``jax.device_get`` comes back with its keys sorted)."""
    values = jax.device_get(list(metrics.values()))
    return dict(zip(metrics.keys(), values, strict=True))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _runtime(seconds: float) -> str:
    """``H:MM:SS.cc`` (hours not wrapped at a day)."""
    sign = "-" if seconds < 0 else ""
    centis = round(abs(seconds) * 100)
    whole, cc = divmod(centis, 100)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{sign}{hours}:{minutes:02d}:{secs:02d}.{cc:02d}"


def _format(key: str, value: Any) -> Any:
    value = _scalar(value)
    if value is None:
        return "n/a"
    if not _is_number(value):
        return value  # strings, bools, lists: shown as they are
    if not math.isfinite(value):
        return str(float(value))  # nan, inf, -inf
    if "_mem_" in key:
        text = f"{value / _MIB:.1f}"
        return "0.0MiB" if text == "-0.0" else f"{text}MiB"  # (no negative zero)
    if key.endswith("_runtime"):
        return _runtime(value)
    if key.endswith("_flos"):  # floating-point operations, shown in 2**30 units
        return f"{int(value) >> 30}GF"
    if isinstance(value, float):
        rounded = round(value, 4)
        if rounded == 0 and value != 0:  # a learning rate of 1e-5 is not 0
            return float(f"{value:.4g}")
        return rounded
    return value


def metrics_format(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``metrics`` with values made readable for a log.

    Keys containing ``_mem_`` (bytes) become MiB with one decimal, keys ending in
    ``_runtime`` (seconds) become ``H:MM:SS.cc``, keys ending in ``_flos``
    (``total_flos``) whole multiples of 2**30 floating-point operations
    (``"12GF"``), other floats are rounded to 4
    decimals (one that this would make 0, ``1e-05``, keeps 4 significant
    digits instead) and ints stay as they are. NumPy and JAX scalars count as numbers.
    NaN and infinities become ``"nan"``/``"inf"``/``"-inf"``, None becomes
    ``"n/a"``, and anything else (a string such as ``"Not available"``, a list) is
    kept as it is. ``metrics`` is not changed.

    Examples:
        >>> import jaxhistory as jh
        >>> jh.metrics_format(
        ...     {"train_runtime": 3725.5, "train_mem_cpu_alloc_delta": 3 * 2**20,
        ...      "loss": 0.123456, "steps": 10, "note": None}
        ... )  # doctest: +NORMALIZE_WHITESPACE
        {'train_runtime': '1:02:05.50', 'train_mem_cpu_alloc_delta': '3.0MiB',
         'loss': 0.1235, 'steps': 10, 'note': 'n/a'}
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping, got {type(metrics).__name__}")
    return {k: _format(str(k), v) for k, v in _on_host(metrics).items()}


def log_metrics(split: str, metrics: Mapping[str, Any]) -> str:
    """Prints ``metrics`` as an aligned table sorted by key, on process 0 only.

    The table is ``***** {split} metrics *****`` followed by ``  key = value``
    lines, values formatted by :func:`metrics_format` (control characters in
    the split, keys and values shown as ``\\xNN``). It is also logged (INFO) to
    the ``jaxhistory`` logger. Other processes print and log nothing. Returns the
    table (``""`` on other processes).

    Examples:
        >>> import jaxhistory as jh
        >>> _ = jh.log_metrics("eval", {"eval_loss": 0.25, "eval_runtime": 61.5})
        ***** eval metrics *****
          eval_loss    =       0.25
          eval_runtime = 0:01:01.50
    """
    if not isinstance(split, str):
        raise TypeError(f"split must be a str, got {type(split).__name__}")
    formatted = metrics_format(metrics)
    if jax.process_index() != 0:
        return ""
    lines = [f"***** {printable(split)} metrics *****"]
    if formatted:
        # a control character in a name (a terminal escape, a newline) is shown
        # as \xNN, as in the summary line
        shown = sorted((printable(k), printable(v)) for k, v in formatted.items())
        k_width = max(len(k) for k, _ in shown)
        v_width = max(len(v) for _, v in shown)
        lines += [f"  {k:<{k_width}} = {v:>{v_width}}" for k, v in shown]
    text = "\n".join(lines)
    print(text)
    logger.info("%s", text)
    return text


def _json_value(key: str, value: Any) -> Any:
    """A JSON-ready value: Python numbers, NaN/inf as None, arrays as lists."""
    value = _scalar(value)
    if isinstance(value, jax.Array | np.ndarray):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biu" and arr.dtype.itemsize < 8:
            if arr.ndim == 1:
                return [_json_value(key, _short_float(v)) for v in arr]
            return [_json_value(key, row) for row in arr]
        if arr.dtype.kind not in "biuf":
            arr = arr.astype(np.float64)
        return [_json_value(key, v) for v in arr.tolist()]
    if isinstance(value, list | tuple):
        return [_json_value(key, v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    raise TypeError(
        f"metric {key!r} is {type(value).__name__} {value!r:.40}; results must be "
        "numbers, strings, None or arrays"
    )


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def _check_split(split: str) -> None:
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty str, got {split!r}")
    if split in (".", "..") or any(c in split for c in "/\\\0"):
        raise ValueError(f"split {split!r} must be a plain name (it names a file)")
    if split == "all":
        raise ValueError("split 'all' is reserved: all_results.json holds every split")


def _read_results(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # bare NaN/Infinity, as json.dump writes them: read, rewrite strict
            data = json.loads(raw)
        except ValueError as err:
            raise ValueError(
                f"{path} is not valid JSON ({err}); it was left as it is: fix or "
                "remove it, or pass combined=False"
            ) from None
        data = (
            {k: _json_value(k, v) for k, v in data.items()}
            if (isinstance(data, dict))
            else data
        )
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}, not an object of results; "
            "it was left as it is"
        )
    return data


def save_metrics(
    split: str,
    metrics: Mapping[str, Any],
    output_dir: str | os.PathLike,
    combined: bool = True,
) -> list[Path]:
    """Writes ``{split}_results.json`` and merges it into ``all_results.json``.

    Strict JSON, keys sorted: NumPy and JAX scalars become Python numbers, arrays
    lists, NaN and infinities ``null``. Each file is written to a temporary name
    and renamed, so a crash never leaves half a file. With ``combined``, the
    metrics are merged into ``all_results.json`` (new values win); if that file
    exists but is not a JSON object, ValueError names it and nothing is written;
    so is a file of these names that is a symbolic link, a device or a folder
    (OSError naming it).
    Only process 0 writes. Returns the paths written.

    Examples:
        >>> import tempfile, jaxhistory as jh
        >>> out = tempfile.mkdtemp()
        >>> [p.name for p in jh.save_metrics("eval", {"eval_loss": 0.25}, out)]
        ['eval_results.json', 'all_results.json']
    """
    _check_split(split)
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping, got {type(metrics).__name__}")
    results = {str(k): _json_value(str(k), v) for k, v in _on_host(metrics).items()}
    if jax.process_index() != 0:
        return []
    out = Path(output_dir)
    for name in (f"{split}_results.json", "all_results.json"):
        check_target(out / name)  # a link, a device: refused before any write
    everything = None
    if combined:
        path = out / "all_results.json"
        everything = _read_results(path) if path.exists() else {}
        everything.update(results)
    paths = [out / f"{split}_results.json"]
    atomic_write(paths[0], lambda tmp: tmp.write_bytes(_dumps(results)))
    if everything is not None:
        paths.append(out / "all_results.json")
        atomic_write(paths[1], lambda tmp: tmp.write_bytes(_dumps(everything)))
    return paths


def save_state(history: Any, output_dir: str | os.PathLike) -> Path | None:
    """Writes a whole history to ``{output_dir}/history_state.json``; returns the path.

    ``history`` is a :class:`~jaxhistory.History` or a
    :class:`~jaxhistory.HistoryState`. The file holds
    ``{"attrs": ..., "metrics": {name: {"dtype", "shape", "steps", "values"}},
    "next_step": ...}`` with keys sorted, NaN and infinities as ``null``; it is
    written atomically, by process 0 only (others return None).

    Examples:
        >>> import tempfile, json, jaxhistory as jh
        >>> s = jh.HistoryState().update({"loss": 0.5}).update({"loss": 0.25})
        >>> path = jh.save_state(s, tempfile.mkdtemp())
        >>> json.loads(path.read_text())["metrics"]["loss"]["values"]
        [0.5, 0.25]
    """
    state = getattr(history, "state", history)
    if not isinstance(state, HistoryState):
        raise TypeError(
            f"save_state needs a History or HistoryState, got {type(history).__name__}"
        )
    metrics = {}
    for name in state.keys:
        values = state.values(name)  # waits for device values
        if values.dtype.kind == "f":
            values = values.astype(np.float64)
        metrics[name] = {
            "dtype": str(state.dtype(name)),
            "shape": list(state.shape(name)),
            "steps": state.steps(name),
            "values": np.ascontiguousarray(values),
        }
    doc = {
        "attrs": {str(k): _json_value(str(k), v) for k, v in state.attrs},
        "metrics": metrics,
        "next_step": state.next_step,
    }
    if jax.process_index() != 0:
        return None
    path = Path(output_dir) / "history_state.json"
    option = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
    atomic_write(path, lambda tmp: tmp.write_bytes(orjson.dumps(doc, option=option)))
    return path
