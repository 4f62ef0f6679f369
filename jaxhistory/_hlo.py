"""Counting the collectives XLA compiled into a function."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["collective_counts"]

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
# An HLO instruction reads `%name = <type> opcode(operands), ...`; async collectives
# appear as `opcode-start(` / `opcode-done(` pairs, counted once by their start.
_OPCODE = re.compile(
    r"\s(" + "|".join(re.escape(op) for op in COLLECTIVES) + r")(-start)?\("
)


def count_in_hlo(hlo_text: str) -> dict[str, int]:
    """Counts collective instructions in compiled HLO text, by opcode."""
    return dict(Counter(m.group(1) for m in _OPCODE.finditer(hlo_text)))


def collective_counts(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Compiles ``fn`` for ``args`` and counts the collectives XLA emitted.

    Use it to check what a metrics computation costs inside a train step: each
    collective is a synchronisation point between devices. ``fn`` may be jitted
    already (``jax.jit``/``nnx.jit`` functions) or a plain function, which is jitted.
    Tuple all-reduces that XLA combined count once.

    Returns:
        ``{opcode: count}``, e.g. ``{"all-reduce": 2}``; empty when there are none.

    Example:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.collective_counts(jh.distributed_stats, {"loss": jnp.ones(4)})
        {}
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args, **kwargs).compile()
    return count_in_hlo(compiled.as_text())
