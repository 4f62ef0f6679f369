"""What XLA compiled a function into: its collectives and its FLOPs."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["collective_counts", "step_flops"]

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
_DEVICE_FIELDS = ("num_partitions", "replica_count")
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

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.collective_counts(jh.distributed_stats, {"loss": jnp.ones(4)})
        {}
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args, **kwargs).compile()
    return count_in_hlo(compiled.as_text())


def devices_in_hlo(hlo_text: str) -> int:
    """The number of devices a compiled HLO module runs on: its partitions
    (SPMD) times its replicas, from the module's header line."""
    header = hlo_text.split("\n", 1)[0]
    count = 1
    for field in _DEVICE_FIELDS:
        found = re.search(rf"\b{field}=(\d+)", header)
        count *= int(found.group(1)) if found else 1
    return count


def step_flops(fn: Callable, *args: Any, **kwargs: Any) -> float:
    """The FLOPs of one call of ``fn`` on ``args``, all devices together: the
    ``flops_per_step`` for ``History(..., peak_flops=...)``'s model FLOPs
    utilisation, with ``peak_flops`` the peak FLOP/s of all those devices.

    XLA's cost analysis of a compiled SPMD program counts one device's share;
    this is that count times the number of devices the program runs on. So
    the same global computation gives the same count on one device or with its
    batch sharded over many (a ``1024x256 @ 256x512`` matmul is 268,435,456
    either way), and work that every device repeats counts once per device (the
    same matmul on replicated inputs on 8 devices is 8 times as much): that is
    the work the devices do, which is what ``peak_flops`` bounds. Collectives'
    arithmetic (an all-reduce's additions) counts too.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> jh.step_flops(lambda a, b: a @ b, jnp.ones((4, 8)), jnp.ones((8, 2)))
        128.0
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args, **kwargs).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # one entry per program on older JAX
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    if flops is None or flops < 0:
        raise ValueError(f"XLA's cost analysis of {fn!r} holds no FLOP count")
    # The module header says how many devices run it; the shardings of its
    # arguments and results say it too, should a JAX version word the header
    # otherwise (the larger count wins: neither undercounts).
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    placed = max(
        (len(s.device_set) for s in shardings if hasattr(s, "device_set")), default=1
    )
    return float(flops) * max(devices_in_hlo(compiled.as_text()), placed)
