"""What XLA compiled a function into: its collectives, their bytes, its FLOPs."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["collective_bytes", "collective_counts", "step_flops"]

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


# One instruction per line: `[ROOT] %name = <shape> opcode(operands), ...`; the
# shape is an array type (`f32[8,4]{1,0}`) or a tuple of them (`(f32[], s32[4])`).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>" + "|".join(re.escape(op) for op in COLLECTIVES) + r")"
    r"(?P<phase>-start|-done)?\((?P<operands>[^)]*)\)",
    re.MULTILINE,
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


def count_in_hlo(hlo_text: str) -> dict[str, int]:
    """Counts collective instructions in compiled HLO text, by opcode."""
    return dict(Counter(m.group(1) for m in _OPCODE.finditer(hlo_text)))


def _element_bits(dtype: str) -> int:
    """Bits of one element of an HLO primitive type (``f32``, ``bf16``, ``pred``,
    ``f8e4m3fn``, ``c64``); 0 for ``token``."""
    if dtype == "pred":
        return 8
    if dtype == "token":
        return 0
    found = re.match(r"[a-z]+(\d+)", dtype)
    if found is None:
        raise ValueError(f"collective_bytes: unknown HLO element type {dtype!r}")
    return int(found.group(1))


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: an array type (``f32[8,4]{1,0}``, ``f32[<=8]`` by
    its bound), or the sum of the parts of a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for dim in filter(
            None, (d.strip().removeprefix("<=") for d in dims.split(","))
        ):
            count *= int(dim)
        total += -(-count * _element_bits(dtype) // 8)
    return total


def bytes_in_hlo(hlo_text: str) -> dict[str, list[int]]:
    """The bytes of every collective in compiled HLO text, by opcode, in the
    order the text lists them (see :func:`collective_bytes`)."""
    done: dict[str, int] = {}  # async start -> the bytes of its -done's result
    for m in _INSTRUCTION.finditer(hlo_text):
        if m.group("phase") == "-done":
            operand = m.group("operands").split(",")[0].split()[-1:]
            if operand:
                done[operand[0].lstrip("%")] = shape_bytes(m.group("shape"))
    out: dict[str, list[int]] = {}
    for m in _INSTRUCTION.finditer(hlo_text):
        phase = m.group("phase")
        if phase == "-done":
            continue
        size = shape_bytes(m.group("shape"))
        if phase == "-start":
            size = done.get(m.group("name"), size)
        out.setdefault(m.group("op"), []).append(size)
    return out


def _compiled_text(fn: Callable, args: tuple, kwargs: dict, caller: str) -> str:
    """The compiled HLO text of ``fn`` (jitted when it is not already) on ``args``."""
    if not callable(fn):
        raise TypeError(
            f"{caller} takes the function to compile first, then its arguments; "
            f"got {type(fn).__name__} {fn!r:.40} for the function"
        )
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def collective_bytes(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, list[int]]:
    """Compiles ``fn`` for ``args`` and measures each collective XLA emitted.

    The bytes of a collective are the size of its result on one device: an
    all-reduce's reduced array (what every device sends and receives, up to
    the algorithm's constant factor; three float32 summed over the devices
    below: 12 bytes), an all-gather's gathered array. A tuple
    collective (XLA combines several into one) counts the sum of its parts;
    an asynchronous ``-start``/``-done`` pair counts once, by the result of
    its ``-done``. ``fn`` may be jitted already or a plain function, which is
    jitted, as for :func:`collective_counts`.

    Returns:
        ``{opcode: [bytes, ...]}``, one entry per collective in program order
        (the order of the compiled text), e.g. ``{"all-reduce": [3200, 400]}``;
        empty when there are none.

    Raises:
        TypeError: ``fn`` is not callable.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxhistory as jh
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> x = jax.device_put(jnp.ones((jax.device_count(), 3)),
        ...                    NamedSharding(mesh, P("data")))
        >>> jh.collective_bytes(lambda x: x.sum(axis=0), x)  # on 2+ devices
        {'all-reduce': [12]}
        >>> jh.collective_bytes(lambda x: x + 1, x)
        {}
    """
    return bytes_in_hlo(_compiled_text(fn, args, kwargs, "collective_bytes"))


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
    return count_in_hlo(_compiled_text(fn, args, kwargs, "collective_counts"))


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
