"""On-device metric buffer for inner steps run inside one jitted call."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxhistory._names import named_leaves
from jaxhistory._stats import Stats
from jaxhistory._tree import check_integer_range

__all__ = ["MetricBuffer"]


def _named(metrics: Any) -> dict[str, Any]:
    """Returns ``{"a/b/0": leaf}``; raises ValueError on a repeated name. A
    :class:`~jaxhistory.Stats` is taken as the mapping it is (``st/loss/mean``,
    as History records it), not as its one packed array."""
    metrics = jax.tree_util.tree_map(
        lambda x: dict(x) if isinstance(x, Stats) else x,
        metrics,
        is_leaf=lambda x: isinstance(x, Stats),
    )
    return dict(named_leaves(metrics, refuse_none=True)[0])


_INT32_MAX = 2**31 - 1
_SMALL_INTS = frozenset(map(np.dtype, ("int8", "int16", "int32", "uint8", "uint16")))


def _step(step: Any) -> jax.Array:
    """``step`` as an int32 scalar; a value int32 cannot hold raises."""
    if isinstance(step, bool | np.bool_):
        raise TypeError(f"step must be an integer scalar, got {step!r}")
    concrete = not isinstance(step, jax.core.Tracer)
    if concrete and isinstance(step, int | np.integer | np.ndarray | jax.Array):
        arr = np.asarray(step)
        if arr.shape == () and arr.dtype.kind in "iu":
            if not 0 <= int(arr) <= _INT32_MAX:
                raise ValueError(
                    f"step {int(arr)} does not fit the buffer's int32 steps "
                    f"(0 to {_INT32_MAX})"
                )
            return jnp.asarray(np.int32(arr))
    try:
        step = jnp.asarray(step)
    except (TypeError, OverflowError) as err:
        raise TypeError(
            f"step must be an integer scalar, got {step!r} ({err})"
        ) from None
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"step must be an integer scalar, got {jax.typeof(step)}")
    if np.dtype(step.dtype) not in _SMALL_INTS:
        raise TypeError(
            f"a traced step of dtype {step.dtype} may not fit the buffer's int32 "
            "steps; pass an int32 step"
        )
    return step


def _check_fits(name: str, value: jax.Array, dtype: Any) -> None:
    """Refuses concrete integers the slots' integer dtype would wrap."""
    dtype = np.dtype(dtype)
    if (
        dtype.kind not in "iu"
        or isinstance(value, jax.core.Tracer)
        or not jnp.issubdtype(value.dtype, jnp.integer)
        or value.size == 0
        or np.can_cast(value.dtype, dtype)  # every value fits: nothing to read
        or (isinstance(value, jax.Array) and not value.is_fully_addressable)
    ):
        return
    info = np.iinfo(dtype)
    host = np.asarray(value)
    lo, hi = int(host.min()), int(host.max())
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"metric {name!r} holds {lo}..{hi}, outside the {dtype} the buffer "
            "stores it in; they would wrap around"
        )


def _check_numeric(name: str, dtype: Any) -> None:
    if not any(
        jnp.issubdtype(dtype, t) for t in (jnp.bool_, jnp.integer, jnp.floating)
    ):
        raise TypeError(f"metric {name or '<root>'!r} has non-numeric dtype {dtype}")


def _slots(capacity: int, leaf: Any, dtype: Any) -> jax.Array:
    """``capacity`` slots for ``leaf``; sharded like it when it is mesh-sharded."""
    shape, device = (capacity, *leaf.shape), None
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        device = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return jnp.zeros(shape, dtype, device=device)


@jax.jit
def _write(buf: MetricBuffer, step: jax.Array, new: dict[str, jax.Array]):
    slot = buf.count % buf.capacity
    values = {}
    for name, old in buf.values.items():
        value, have = new[name].astype(old.dtype), jax.typeof(old).sharding
        want = PartitionSpec(*have.spec[1:])
        spec = jax.typeof(value).sharding.spec
        if any(s is not None for s in spec) and tuple(spec) != tuple(want):
            # Explicitly sharded value, differently sharded slots: move it.
            mesh = have.mesh if not have.mesh.empty else jax.typeof(value).sharding.mesh
            value = jax.sharding.reshard(value, NamedSharding(mesh, want))
        values[name] = old.at[slot].set(value)
    steps = buf.steps.at[slot].set(step.astype(jnp.int32))
    return MetricBuffer(steps=steps, values=values, count=buf.count + 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["steps", "values", "count"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, eq=False)
class MetricBuffer:
    """A fixed-size ring buffer of per-step metrics that lives on the device.

    Host recording is impossible inside ``jax.lax.scan`` / ``lax.fori_loop``; carry a
    buffer through the loop instead, :meth:`write` each inner step's metrics, return
    it from the jitted call and read it with :meth:`to_host` (one transfer).

    **Ring buffer:** when more than ``capacity`` writes happen, each new write
    overwrites the oldest entry. :meth:`to_host` returns the surviving entries
    oldest first and :attr:`dropped` says how many were lost, so pick ``capacity``
    at least the number of inner steps per jitted call and :meth:`reset` between
    calls. ``count`` is int32, so a buffer holds at most ``2**31 - 1`` writes.

    A metric leaf that is an explicitly mesh-sharded array (e.g. one value per
    device) gets slots sharded the same way, so writing it needs no communication.

    Attributes:
        steps: int32 ``(capacity,)``, the step of each slot; -1 marks an empty slot.
        values: ``{name: (capacity, *leaf_shape)}``, one array per metric leaf named
            by its ``/``-joined path; 16-bit (and narrower) floats are stored as
            float32, other dtypes as given.
        count: int32 scalar, the number of writes so far.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jaxhistory._buffer import MetricBuffer
        >>> def train_chunk(buf, first_step):
        ...     def inner(carry, i):
        ...         buf, w = carry
        ...         loss = w * w  # stands in for a real train step
        ...         buf = buf.write(first_step + i, {"train": {"loss": loss}})
        ...         return (buf, w * 0.5), None
        ...     carry = (buf, jnp.float32(2.0))
        ...     (buf, _), _ = jax.lax.scan(inner, carry, jnp.arange(6))
        ...     return buf
        >>> buf = MetricBuffer.create(4, {"train": {"loss": jnp.float32(0)}})
        >>> buf = jax.jit(train_chunk)(buf, 100)
        >>> steps, values = buf.to_host()
        >>> steps
        array([102, 103, 104, 105])
        >>> values["train/loss"]
        array([0.25      , 0.0625    , 0.015625  , 0.00390625], dtype=float32)
        >>> buf.dropped  # steps 100 and 101 were overwritten
        2
        >>> buf.reset().to_host()
        (array([], dtype=int64), {'train/loss': array([], dtype=float32)})
    """

    steps: jax.Array
    values: dict[str, jax.Array]
    count: jax.Array

    @classmethod
    def create(cls, capacity: int, example: Any) -> MetricBuffer:
        """Allocates an empty buffer of ``capacity`` slots.

        Args:
            capacity: number of entries kept (a positive int).
            example: a pytree of arrays, numbers or :class:`jax.ShapeDtypeStruct`
                giving each metric's shape and dtype (their values are not used).

        Raises:
            TypeError: ``capacity`` is not an int, or a leaf is not numeric
                (bool, int or float); the message names the leaf.
            ValueError: ``capacity`` is not positive, or two leaves share a name.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if capacity > _INT32_MAX:
            raise ValueError(
                f"capacity {capacity} is more than a buffer can hold: writes are "
                f"counted in int32, so at most 2**31 - 1 ({_INT32_MAX}) slots"
            )
        capacity = int(capacity)
        values = {}
        for name, leaf in _named(example).items():
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                leaf = np.asarray(leaf)
            _check_numeric(name, leaf.dtype)
            dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
            if jnp.issubdtype(dtype, jnp.floating):
                dtype = jnp.promote_types(dtype, jnp.float32)
            values[name] = _slots(capacity, leaf, dtype)
        steps = jnp.full((capacity,), -1, jnp.int32)
        return cls(steps=steps, values=values, count=jnp.zeros((), jnp.int32))

    @property
    def capacity(self) -> int:
        """The number of slots."""
        return self.steps.shape[0]

    def write(self, step: Any, metrics: Any) -> MetricBuffer:
        """Returns a new buffer with ``metrics`` recorded at ``step``.

        Pure and usable inside ``jit``, ``scan`` and ``fori_loop``. Writes slot
        ``count % capacity``, overwriting the oldest entry once the buffer is full.

        Args:
            step: integer scalar (Python int or int array, traced or not).
            metrics: a pytree with the example's leaf names and shapes; values are
                cast to the stored dtype.

        Raises:
            ValueError: a name is missing or extra, or a shape differs (checked at
                trace time); the message names the metric.
            TypeError: ``step`` is not an integer scalar, a value is not numeric,
                or a float is written into an integer or bool metric.
        """
        step = _step(step)
        named = _named(metrics)
        missing = sorted(set(self.values) - set(named))
        extra = sorted(set(named) - set(self.values))
        if missing or extra:
            raise ValueError(
                f"metrics do not match the buffer: missing {missing}, extra {extra}"
            )
        new = {}
        for name, value in named.items():
            shown, slots = name or "<root>", self.values[name]
            check_integer_range(shown, value)
            try:
                value = jnp.asarray(value)
            except OverflowError:
                raise ValueError(
                    f"metric {shown!r} is an integer too large for "
                    f"{slots.dtype} ({value!r:.40}); write it as a float"
                ) from None
            except TypeError as err:
                raise TypeError(f"metric {shown!r} is not numeric ({err})") from None
            _check_fits(shown, value, slots.dtype)
            _check_numeric(name, value.dtype)
            if value.shape != slots.shape[1:]:
                raise ValueError(
                    f"metric {shown!r} has shape {value.shape}, the buffer holds "
                    f"{slots.shape[1:]}"
                )
            if jnp.issubdtype(value.dtype, jnp.floating) and not jnp.issubdtype(
                slots.dtype, jnp.floating
            ):
                raise TypeError(
                    f"metric {shown!r} is {value.dtype}, the buffer holds "
                    f"{slots.dtype}; a float would be truncated"
                )
            new[name] = value
        return _write(self, step, new)

    def reset(self) -> MetricBuffer:
        """Returns the buffer emptied (count 0, steps -1), reusing its arrays.

        Stale values stay in the slots but are never read. Under ``jit`` with the
        buffer donated (``donate_argnums``) no new memory is allocated.
        """
        steps = jnp.full_like(self.steps, -1)
        return MetricBuffer(
            steps=steps, values=self.values, count=jnp.zeros_like(self.count)
        )

    def to_host(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Fetches the buffer with one ``jax.device_get`` (host side, not in jit).

        Returns:
            ``(steps, values)``: int64 steps and ``{name: array}`` of the entries
            still held, oldest first (write order), as NumPy arrays.
        """
        host = self if _fetched(self.count) else jax.device_get(self)
        count, capacity = int(host.count), host.steps.shape[0]
        if count <= capacity:
            order = np.arange(max(count, 0))
        else:
            order = (count + np.arange(capacity)) % capacity
        values = {name: np.asarray(v)[order] for name, v in host.values.items()}
        return np.asarray(host.steps)[order].astype(np.int64), values

    @property
    def dropped(self) -> int:
        """How many entries were overwritten (host side): ``max(count - capacity, 0)``.

        Fetches ``count``; on a buffer already fetched with ``jax.device_get``
        there is nothing to transfer.
        """
        count = self.count if _fetched(self.count) else jax.device_get(self.count)
        return max(int(count) - self.capacity, 0)


def _fetched(value: Any) -> bool:
    """Whether ``value`` is already a host value (a buffer fetched with
    ``jax.device_get``): reading it transfers nothing."""
    return isinstance(value, np.ndarray | np.generic | int)
