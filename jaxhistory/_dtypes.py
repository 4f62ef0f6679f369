"""Dtype rules for recorded values: what a value is stored as, the int64 range of
steps and integer metrics, and the checks that refuse what cannot be stored."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhistory._names import STEP_KEYS

__all__ = [
    "ALL_FLOATS",
    "FLOAT_ONLY",
    "INT64_MAX",
    "NESTED",
    "PY_SCALARS",
    "STEP_KEYS",
    "as_step",
    "check_ints",
    "host_value",
    "warmup_count",
]


def warmup_count(warmup: float, n: int) -> int:
    """How many of ``n`` distinct steps ``warmup`` drops.

    ``warmup`` below 1 is a fraction of the steps (``0.05`` drops the first 5%);
    1 or more is a number of steps. The same rule holds everywhere jaxhistory
    takes a ``warmup``.

    Example:
        >>> import jaxhistory as jh
        >>> jh.warmup_count(0.05, 200), jh.warmup_count(3, 200), jh.warmup_count(0, 200)
        (10, 3, 0)
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int | float):
        raise TypeError(f"warmup must be a number, got {warmup!r}")
    if not math.isfinite(warmup) or warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    if warmup < 1:
        return math.floor(warmup * n)
    return min(int(warmup), n)


@functools.lru_cache(maxsize=64)
def _storage_dtype(dtype: np.dtype, min_float_bytes: int) -> np.dtype | None:
    if jnp.issubdtype(dtype, jnp.floating):  # ml_dtypes floats included
        if dtype.itemsize < min_float_bytes:
            return np.dtype(f"float{8 * min_float_bytes}")
        return dtype
    return dtype if dtype.kind in "biu" else None


def device_storage_dtype(name: str, dtype: Any, min_float_bytes: int) -> np.dtype:
    """How a device array of ``dtype`` is stored on the host: floats narrower than
    ``min_float_bytes`` (bf16, fp16, fp8) widen; non-numeric dtypes raise TypeError
    naming the metric. Cached per dtype (``jnp.issubdtype`` is slow)."""
    out = _storage_dtype(np.dtype(dtype), min_float_bytes)
    if out is None:
        raise TypeError(f"metric {name!r} has non-numeric dtype {np.dtype(dtype)}")
    return out


def host_value(name: str, value: Any) -> tuple[Any, np.dtype, tuple[int, ...]]:
    """Validates one metric value; returns (value, storage dtype, record shape)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"metric {name!r} is a JAX tracer: a HistoryState cannot record inside "
            "jit, scan or a loop body. Return the metric from the jitted step, or "
            "write it into a jaxhistory.MetricBuffer inside the loop and append the "
            "buffer with HistoryState.extend_from_buffer."
        )
    if isinstance(value, jax.Array):
        dtype = device_storage_dtype(name, value.dtype, 4)
        if not (value.is_fully_addressable or value.sharding.is_fully_replicated):
            # A replicated value (a global norm, a fully reduced loss) is read
            # from this process's own copy; only values that differ across the
            # processes' devices cannot be.
            raise ValueError(
                f"metric {name!r} holds different values on the devices of other "
                f"processes ({value.sharding}), which this process cannot read. "
                "Reduce it inside the step (jaxhistory.distributed_stats, "
                "jaxhistory.reduce_mean, ...), or pass it to "
                "History(distributed_history=True), which reduces per-device "
                "arrays across all processes"
            )
        return value, dtype, tuple(value.shape)
    if isinstance(value, str | bytes) or value is None:
        raise TypeError(
            f"metric {name!r} is {type(value).__name__} {value!r:.40}; metrics "
            "must be numbers or numeric arrays"
        )
    try:
        arr = np.asarray(value)
    except Exception as err:
        raise TypeError(f"metric {name!r} cannot become an array: {err}") from None
    if arr is value or not arr.flags.owndata:
        arr = arr.copy()  # the caller may reuse its buffer; rows stay staged a while
    if arr.dtype.kind not in "biuf":
        if jnp.issubdtype(arr.dtype, jnp.floating):  # ml_dtypes bfloat16 and friends
            arr = arr.astype(np.float32)
        elif arr.dtype == object and isinstance(value, numbers.Real):
            try:  # fractions.Fraction and other real numbers: stored as float64
                arr = np.asarray(float(value))
            except (TypeError, ValueError, OverflowError) as err:
                raise TypeError(
                    f"metric {name!r} ({type(value).__name__}) is not a float: {err}"
                ) from None
        else:
            raise TypeError(
                f"metric {name!r} is not numeric ({type(value).__name__}, "
                f"dtype {arr.dtype})"
            )
    elif arr.dtype.kind == "f" and arr.dtype.itemsize < 4:
        arr = arr.astype(np.float32)
    return arr, arr.dtype, arr.shape


NESTED = frozenset({dict, list, tuple})
PY_SCALARS = {float: np.dtype(np.float64), int: np.dtype(np.int64)}
FLOAT_ONLY = frozenset({float})
ALL_FLOATS = "every value a Python float"  # a row type signature, see update()


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the one int64 range


def check_ints(names: tuple[str, ...], row: tuple, dtypes: tuple) -> None:
    """Refuses Python ints that do not fit the column they are stored in.

    An int metric is stored as int64; an int recorded into a metric that already
    holds floats is stored as float64.
    """
    for name, value, dtype in zip(names, row, dtypes, strict=True):
        if type(value) is not int:
            continue
        if dtype.kind == "f":
            try:
                exact = int(float(value)) == value
            except OverflowError:
                raise ValueError(
                    f"metric {name!r} is an int too large for float64"
                ) from None
            if not exact:
                raise ValueError(
                    f"metric {name!r} is stored as {dtype} and cannot hold the "
                    f"integer {value} exactly; record it as float or keep it integer"
                )
        elif not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(
                f"metric {name!r} is {value}, outside int64; pass it as a float"
            )


def as_step(name: str, value: Any) -> int:
    """``value`` as a step: a whole number within int64 (ValueError otherwise).

    A JAX array is fetched from the device: pass steps as Python ints in a loop.
    """
    if type(value) is not int:
        if isinstance(value, jax.Array):
            value = jax.device_get(value)
        arr = np.asarray(value)
        if (
            arr.ndim != 0
            or arr.dtype.kind not in "iuf"
            or not np.isfinite(arr)
            or arr != np.floor(arr)
        ):
            raise ValueError(f"{name!r} must be a whole number to be used as the step")
        value = int(arr)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name!r} is {value}, outside the int64 range of steps")
    return value
