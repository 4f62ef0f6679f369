"""Metric pytrees: leaf names, numeric validation and accumulation dtypes.

Every reducer in jaxhistory treats a metrics pytree the same way:

* each leaf is named by its ``/``-joined path (``{"train": {"loss": x}}`` gives
  ``"train/loss"``; list items are named by their index);
* each leaf is converted with :func:`jax.numpy.asarray`, so Python numbers, NumPy
  arrays, 0-d arrays and JAX arrays all follow one rule: *a leaf is an array and is
  reduced over all of its elements*. A Python number or 0-d array is a one-element
  array;
* booleans count as integers 0/1; strings, objects and complex numbers are rejected
  with a :class:`TypeError` that names the leaf;
* a tree may nest at most :data:`MAX_DEPTH` levels: a deeper one is refused
  before anything walks it recursively (JAX's flattening would exhaust Python's
  stack and leave the interpreter unable to run the next JAX call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhistory._names import MAX_DEPTH, check_depth, named_leaves

__all__ = [
    "MAX_DEPTH",
    "Leaf",
    "acc_dtype",
    "check_depth",
    "check_integer_range",
    "flatten_metrics",
    "wrapped_extreme",
]


class Leaf:
    """One metric leaf: its name and its value as a numeric JAX array."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: jax.Array):
        self.name = name
        self.value = value


def _as_numeric(name: str, value: Any) -> jax.Array:
    shown = name or "<root>"
    if isinstance(value, str | bytes):
        raise TypeError(
            f"metric {shown!r} is a {type(value).__name__} ({value!r:.40}); "
            "metrics must be numbers or numeric arrays"
        )
    check_integer_range(shown, value)
    try:
        arr = jnp.asarray(value)
    except OverflowError:
        raise ValueError(
            f"metric {shown!r} holds an integer too large for JAX's integer dtype "
            f"({value!r:.40}); pass it as a float or enable jax_enable_x64"
        ) from None
    except TypeError as err:
        raise TypeError(
            f"metric {shown!r} is not numeric: {type(value).__name__} cannot become "
            f"a JAX array ({err})"
        ) from None
    dtype = arr.dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"metric {shown!r} is complex ({dtype}); reduce its real part, imaginary "
            "part or magnitude instead"
        )
    if dtype == jnp.bool_:
        return arr.astype(jnp.int32)
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"metric {shown!r} has non-numeric dtype {dtype}")
    return arr


def check_integer_range(name: str, value: Any) -> None:
    """Refuses host integers that JAX would wrap around silently.

    With x64 disabled, JAX turns int64/uint64 host arrays into 32-bit ones, and
    ``2**40`` would become a different number without a word.
    """
    if isinstance(value, jax.Array) or not isinstance(value, np.ndarray | np.integer):
        return
    arr = np.asarray(value)
    if wrapped_extreme(arr) is None:
        return
    target = jax.dtypes.canonicalize_dtype(arr.dtype)
    raise ValueError(
        f"metric {name!r} holds {arr.dtype} values outside the {target} range "
        f"JAX uses with x64 disabled ({arr.min()}..{arr.max()}); they would wrap "
        "around. Pass them as floats or enable jax_enable_x64"
    )


def wrapped_extreme(arr: np.ndarray) -> Any:
    """The min or max of the host integers ``arr`` that the integer dtype JAX
    gives them (int32 / uint32 with x64 disabled) cannot hold, or None when
    every value fits (and for non-integer or empty arrays)."""
    if arr.dtype.kind not in "iu" or arr.size == 0:
        return None
    info = np.iinfo(jax.dtypes.canonicalize_dtype(arr.dtype))
    lo, hi = arr.min(), arr.max()
    if hi > info.max:
        return hi
    if lo < info.min:
        return lo
    return None


def flatten_metrics(
    metrics: Any,
) -> tuple[list[Leaf], jax.tree_util.PyTreeDef]:
    """Flattens ``metrics`` into named, validated numeric leaves.

    Raises:
        TypeError: a leaf is not numeric (or is None); the message names its
            path.
        ValueError: two leaves share a name (``{"a/b": x, "a": {"b": y}}``);
            the tree nests more than :data:`MAX_DEPTH` levels.
    """
    pairs, treedef = named_leaves(metrics, refuse_none=True)  # checks the depth
    return [Leaf(name, _as_numeric(name, value)) for name, value in pairs], treedef


def acc_dtype(dtype: Any) -> np.dtype:
    """Returns the dtype statistics of ``dtype`` values accumulate in.

    Floating types narrower than 32 bits (bfloat16, float16, float8) accumulate in
    float32, float64 stays float64 (when x64 is enabled), and integers use JAX's
    default float type.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.promote_types(dtype, jnp.float32)
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


def map_leaves(fn: Callable[[Leaf], Any], leaves: list[Leaf], treedef: Any) -> Any:
    """Rebuilds the pytree with ``fn(leaf)`` in place of every leaf."""
    return jax.tree_util.tree_unflatten(treedef, [fn(leaf) for leaf in leaves])
