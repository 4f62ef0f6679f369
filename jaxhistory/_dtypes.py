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
    "as_flag",
    "as_step",
    "as_steps",
    "check_ints",
    "common_dtype",
    "first_inexact",
    "host_value",
    "is_whole",
    "numeric_dtype",
    "warmup_count",
]


def warmup_count(warmup: float, n: int) -> int:
    """How many of ``n`` distinct steps ``warmup`` drops.

    ``warmup`` below 1 is a fraction of the steps (``0.05`` drops the first 5%);
    1 or more is a number of steps. The same rule holds everywhere jaxhistory
    takes a ``warmup``.

    Examples:
        >>> import jaxhistory as jh
        >>> jh.warmup_count(0.05, 200), jh.warmup_count(3, 200), jh.warmup_count(0, 200)
        (10, 3, 0)
    """
    if isinstance(warmup, bool | np.bool_) or not isinstance(warmup, numbers.Real):
        raise TypeError(f"warmup must be a number, got {warmup!r}")
    warmup = int(warmup) if isinstance(warmup, numbers.Integral) else float(warmup)
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


def host_value(
    name: str, value: Any, copy: bool = True
) -> tuple[Any, np.dtype, tuple[int, ...]]:
    """Validates one metric value; returns (value, storage dtype, record shape).

    A NumPy array comes back as a copy of its own unless ``copy`` is False (an
    array the caller already copied for the record); anything read through a
    view of someone else's buffer is copied either way."""
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
    if (arr is value and copy) or not arr.flags.owndata:
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


def is_whole(value: Any) -> bool:
    """Whether ``value`` is a whole number: a Python or NumPy int, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(
        value, bool | np.bool_
    )


def as_flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True or False (a NumPy bool too). Anything else (a
    string ``"false"``, which ``bool()`` makes True, 0, None) is a TypeError
    naming ``name``: a flag such as ``overwrite`` must never be guessed.

    Examples:
        >>> from jaxhistory._dtypes import as_flag
        >>> as_flag("overwrite", False)
        False
    """
    if value is True or value is False:
        return value
    if type(value) is np.bool_:
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r:.60}")


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


def as_steps(steps: Any, what: str = "steps") -> np.ndarray:
    """``steps`` as an int64 array: whole numbers within int64 (ValueError naming
    ``what`` and the first value that is not one; never truncated or wrapped)."""
    arr = np.asarray(steps)
    if arr.dtype.kind not in "iuf" and arr.size:
        raise ValueError(
            f"{what} must be whole numbers within int64, got dtype {arr.dtype}"
        )
    if arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.floor(arr))
            bad |= (arr < -(2.0**63)) | (arr >= 2.0**63)
    elif arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
        bad = arr > INT64_MAX
    else:
        return arr.astype(np.int64)
    if bad.any():
        raise ValueError(
            f"{what} must be whole numbers within int64, got "
            f"{arr[bad].reshape(-1)[0].item()!r}"
        )
    return arr.astype(np.int64)


_MAX_ITEMSIZE = 16  # bytes of the widest value stored (float128)


def numeric_dtype(text: Any) -> np.dtype:
    """The dtype named ``text`` (a file's record of a metric's dtype), if it is
    one a metric is stored as: bool, int, uint or float, at most 16 bytes.

    Checked before anything of that dtype is allocated; ValueError otherwise.
    """
    try:
        dtype = np.dtype(str(text))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{str(text)!r:.60} is not a dtype ({err})") from None
    if (
        dtype.kind not in "biuf"
        or dtype.itemsize > _MAX_ITEMSIZE
        or dtype.fields is not None
        or dtype.subdtype is not None
    ):
        raise ValueError(
            f"{str(text)!r:.60} is not a numeric dtype (bool, int, uint or float)"
        )
    return dtype


_EXACT = 2**53  # beyond this magnitude not every integer is a float64
_EXACT_F = float(_EXACT)


def first_inexact(values: Any) -> int | None:
    """The first integer of ``values`` that float64 cannot hold exactly."""
    if type(values) is int:
        big = [values] if abs(values) > _EXACT else []
    else:
        arr = np.asarray(values)
        if arr.dtype.kind not in "iu" or not arr.size:
            return None
        big = arr[np.abs(arr.astype(np.float64)) >= _EXACT_F].tolist()
    for v in big:
        try:
            if int(float(v)) != v:
                return v
        except OverflowError:
            return v
    return None


def common_dtype(name: str, arrays: list[np.ndarray]) -> np.dtype:
    """The dtype that holds every value of ``arrays`` (parts of one metric)
    exactly, or ValueError naming the metric, the dtypes and a value.

    NumPy's promotion, except where it would round integers: signed and
    unsigned 64-bit integers stay int64 where every value fits it, uint64 where
    none is negative; integers join floats only where float64 holds each one.
    """
    out = np.result_type(*(a.dtype for a in arrays))
    ints = [a for a in arrays if a.dtype.kind in "iu" and a.size]
    if out.kind != "f" or not ints:
        return out
    kinds = {a.dtype.kind for a in arrays if a.size}
    if kinds <= {"i", "u", "b"}:  # uint64 beside signed integers
        low = min(int(a.min()) for a in ints)
        high = max(int(a.max()) for a in ints)
        if low >= INT64_MIN and high <= INT64_MAX:
            return np.dtype(np.int64)
        if low >= 0:
            return np.dtype(np.uint64)
        dtypes = " and ".join(dict.fromkeys(str(a.dtype) for a in ints))
        raise ValueError(
            f"metric {name!r} holds {dtypes} values {high} and {low}: no integer "
            "dtype holds both, and float64 would round them"
        )
    floats = sorted({str(a.dtype) for a in arrays if a.dtype.kind == "f"})
    for a in ints:
        bad = first_inexact(a)
        if bad is not None:
            raise ValueError(
                f"metric {name!r} is {a.dtype} in one part and {', '.join(floats)} "
                f"in another, and {out} cannot hold its integer {bad} exactly"
            )
    return out
