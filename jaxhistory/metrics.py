"""Metric accumulators that merge across batches and devices.

Each metric is an immutable pytree (a frozen dataclass registered with
``jax.tree_util.register_dataclass``) of fixed shapes and dtypes, so it can be
carried through ``jax.jit`` / ``nnx.jit``, ``lax.scan`` and ``lax.fori_loop``
without retracing, and used from host code alike. The protocol:

* ``M.empty(num_shards=0)``: the identity of ``merge``;
* ``M.from_model_output(**outputs)``: the metric of one batch;
* ``m.merge(other)``, and ``m.update(**outputs)``: the merge with one batch's;
* ``m.compute(axis_name=None)``: the value.

Per-device state. Every array of a metric has a leading *shard* axis: a batch
sharded over ``S`` devices gives ``S`` partial states, each computed from its own
shard (the batch is viewed as ``(S, B // S, ...)``), so updating moves no data
between devices. ``compute`` gathers the partial states of every metric of a
:class:`Collection` in one all-reduce per dtype (at most 2 collectives, float32
and int32, for any number of metrics) and merges them on every device in shard
order, which keeps it exact for uneven masks and padded last batches. ``S`` is
read from the batch's sharding (explicitly sharded arrays, ``jax.make_mesh``'s
default, and concrete arrays); on an ``Auto`` mesh inside jit pass
``num_shards=`` (else ``S`` is 1 and each update reduces across devices, which is
exact but costs an all-reduce per statistic per batch). Inside ``jax.shard_map``
each device holds its own state (``S`` is 1 there) and ``compute(axis_name=...)``
gathers over the mesh axis.

``empty()`` has zero shards: merging it with anything returns the other side, so
it can start a Python loop. A loop carry (``lax.scan``, ``fori_loop``) keeps one
shape, so start it from ``M.empty(num_shards=S)``, ``S`` the number of shards of
the batches (1 inside ``shard_map``).

Accumulation is in float32 (float64 with ``jax_enable_x64``; bfloat16 and float16
inputs are widened); counts are int32 (int64 with ``jax_enable_x64``). ``NaN`` in a
counted value makes the result NaN, as in NumPy; masked values are never read, so
padding may hold anything. ``Sum`` and ``Count`` of nothing are 0, the others NaN.

Numbers that do not fit are refused, not rounded or wrapped: host (NumPy, Python)
integers beyond int32 without x64, or beyond the exact integers of the float state
(2**24 in float32, 2**53 in float64) in a float statistic, raise a ``ValueError``
naming the metric and the value; complex inputs raise a ``TypeError``. Integers
already on device (int32 arrays, traced values) are not read back to be checked.
A count that passes 2**31 - 1 without x64 reads -1 (an ``Accuracy`` over it NaN),
never a wrapped number. An output named ``weights``, ``weight``,
``sample_weight`` or ``sample_weights`` that no metric reads raises a
``ValueError`` (declare
``Average.from_output("loss", weights="weights")``) instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhistory._collective import bound_axis_size, check_axis_name, fused_by_dtype
from jaxhistory._stats import pow2_scale, shard_count
from jaxhistory._tree import acc_dtype, wrapped_extreme

__all__ = [
    "Accuracy",
    "Average",
    "BatchView",
    "Collection",
    "Count",
    "Last",
    "Max",
    "Metric",
    "Min",
    "Std",
    "Sum",
]

# Outputs that hold per-example weights: refused by a metric that reads none.
WEIGHT_NAMES = ("weights", "weight", "sample_weight", "sample_weights")


def _float() -> jnp.dtype:
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


def _int() -> jnp.dtype:
    """The dtype of counts: int32, int64 with ``jax_enable_x64``."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.int64))


class Metric:
    """The base of every metric: subclasses are made frozen dataclasses and
    registered as pytrees (every field an array with a leading shard axis).

    A new metric declares its fields (arrays with a leading shard axis) and
    overrides four public methods; :meth:`empty`, :meth:`from_model_output`,
    :meth:`update`, :meth:`merge` and :meth:`compute` are built from them:

    * ``identity(num_shards)`` (classmethod): its fields' identity values.
    * ``from_batch(batch, outputs)`` (classmethod): one batch's per-shard
      state; ``batch`` is a :class:`BatchView` (``batch.values(name)`` gives
      the output split into shards and the mask's weights).
    * ``combine(other)``: two states of the same shards, shard by shard.
    * ``result()``: the value of a one-shard state.

    Merging every shard into one, :meth:`fold`, is ``combine`` folded over the
    shard axis (override it only for a vectorised form).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxhistory as jh
        >>> class Total(jh.metrics.Metric):
        ...     total: jax.Array
        ...     @classmethod
        ...     def identity(cls, n):
        ...         return {"total": jnp.zeros(n)}
        ...     @classmethod
        ...     def from_batch(cls, batch, outputs):
        ...         v, w = batch.values("values")
        ...         return cls(total=jnp.sum(jnp.where(w, v, 0), axis=1))
        ...     def combine(self, other):
        ...         return self.replace(total=self.total + other.total)
        ...     def result(self):
        ...         return self.total[0]
        >>> m = Total.empty().update(values=jnp.arange(4.0))
        >>> float(m.compute())
        6.0
    """

    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__annotations__" in cls.__dict__ or not dataclasses.is_dataclass(cls):
            dataclasses.dataclass(frozen=True)(cls)
        # Already a frozen dataclass and a pytree: flax.struct.dataclass, which
        # CLU users keep on their classes, leaves a class so marked as it is.
        cls._flax_dataclass = True
        cls._fields = tuple(f.name for f in dataclasses.fields(cls))
        jax.tree_util.register_dataclass(
            cls, data_fields=list(cls._fields), meta_fields=[]
        )

    # ----- the protocol -----------------------------------------------------------
    @classmethod
    def empty(cls, num_shards: int = 0) -> Metric:
        """The identity of :meth:`merge`, with ``num_shards`` shards (0: merging
        returns the other side; give the batches' shard count for a loop carry)."""
        if (
            isinstance(num_shards, bool)
            or not isinstance(num_shards, numbers.Integral)
            or num_shards < 0
        ):
            raise ValueError(f"num_shards must be an int >= 0, got {num_shards!r}")
        return cls(**cls.identity(int(num_shards)))

    @classmethod
    def from_model_output(
        cls, *values: Any, num_shards: int | None = None, **outputs
    ) -> Metric:
        """The metric of one batch. ``outputs`` are the model's outputs by name
        (each metric reads the ones it needs and ignores the rest), with an
        optional ``mask`` (batch-first, true for the examples to count).
        A metric of one output (``Average``, ``Std``, ...) also takes it as
        the one positional argument, as CLU and metrax write it:
        ``Average.from_model_output(loss, mask=mask)``.
        ``num_shards``: see the module notes (read from the sharding if omitted).

        Raises:
            ValueError: an output of per-example weights (``weights``, ``weight``,
                ``sample_weight`` or ``sample_weights``) that this metric does
                not read.
            TypeError: a positional value given twice, more than one, or to a
                metric that reads several outputs by name.
        """
        outputs = cls._positional(values, outputs)
        for name in cls.unread_weights(outputs):
            argname = getattr(cls, "argname", "loss")
            raise ValueError(
                f"{cls.__name__} ignores {name}=: it reads no weights; for a "
                f"weighted mean declare Average.from_output({argname!r}, "
                f"weights={name!r})"
            )
        return cls._of_batch(num_shards, outputs)

    @classmethod
    def _positional(cls, values: tuple, outputs: dict) -> dict:
        """``outputs`` with a positional value under the output this metric
        reads (its ``argname``)."""
        if not values:
            return outputs
        argname = getattr(cls, "argname", None)
        if argname is None:
            reads = getattr(cls, "reads", ())
            raise TypeError(
                f"{cls.__name__} takes the model outputs by name"
                + (f" ({', '.join(f'{r}=...' for r in reads)})" if reads else "")
                + f", got {len(values)} positional value(s)"
            )
        if len(values) > 1:
            raise TypeError(
                f"{cls.__name__} takes one positional value ({argname}), got "
                f"{len(values)}"
            )
        if argname in outputs:
            raise TypeError(
                f"{cls.__name__} got {argname} twice: positionally and by name"
            )
        return {argname: values[0], **outputs}

    @classmethod
    def unread_weights(cls, outputs: Mapping[str, Any]) -> list[str]:
        """The outputs named like per-example weights that this metric ignores
        (neither its weights nor its own values, as ``Sum.from_output("weights")``
        reads them)."""
        read = {getattr(cls, "weightname", None), getattr(cls, "argname", None)}
        return [k for k in WEIGHT_NAMES if k not in read and outputs.get(k) is not None]

    @classmethod
    def _of_batch(cls, num_shards: int | None, outputs: Mapping[str, Any]) -> Metric:
        batch = cls.from_batch(BatchView(cls, outputs, num_shards), outputs)
        # The identity's dtypes (float32 or float64 by jax_enable_x64, int32
        # counts): a loop carry keeps one type, and compute stays at 2 dtypes.
        like = cls.identity(0)
        return batch.replace(
            **{f: getattr(batch, f).astype(like[f].dtype) for f in cls._fields}
        )

    def update(self, *values: Any, num_shards: int | None = None, **outputs) -> Metric:
        """``self.merge(type(self).from_model_output(*values, **outputs))``, the
        batch split into this metric's shard count unless ``num_shards`` says
        otherwise."""
        if num_shards is None and self.num_shards:
            num_shards = self.num_shards
        return self.merge(
            type(self).from_model_output(*values, num_shards=num_shards, **outputs)
        )

    @property
    def num_shards(self) -> int:
        """How many partial states this metric holds."""
        return int(np.shape(getattr(self, self._fields[0]))[0])

    def merge(self, other: Metric) -> Metric:
        """The metric of both: associative, with :meth:`empty` as identity."""
        if type(other) is not type(self):
            raise TypeError(
                f"cannot merge {type(self).__name__} with {type(other).__name__}"
            )
        if other.num_shards == 0:
            return self
        if self.num_shards == 0:
            return other
        if self.num_shards != other.num_shards:
            raise ValueError(
                f"cannot merge a {type(self).__name__} of {self.num_shards} shards "
                f"with one of {other.num_shards}: batches split over different "
                "device counts (start a loop carry from empty(num_shards=...))"
            )
        a, b = _aligned(self, other)
        return a.combine(b)

    def compute(self, axis_name: Any = None) -> jax.Array:
        """The value over every shard (and, inside ``shard_map``, over the mesh
        axis ``axis_name``). Returns a JAX array without waiting for it."""
        (gathered,) = _gather([self], axis_name)
        return gathered.fold().result()

    @classmethod
    def identity(cls, num_shards: int) -> dict[str, jax.Array]:
        """The fields of :meth:`empty` with ``num_shards`` shards."""
        raise NotImplementedError(f"{cls.__name__} must define identity()")

    @classmethod
    def from_batch(cls, batch: BatchView, outputs: Mapping[str, Any]) -> Metric:
        """The per-shard state of one batch."""
        raise NotImplementedError(f"{cls.__name__} must define from_batch()")

    def combine(self, other: Metric) -> Metric:
        """Two states of the same shards combined, shard by shard."""
        raise NotImplementedError(f"{type(self).__name__} must define combine()")

    def result(self) -> jax.Array:
        """The value of a one-shard state."""
        raise NotImplementedError(f"{type(self).__name__} must define result()")

    def fold(self) -> Metric:
        """Every shard merged into one, in shard order: :meth:`merge`'s
        shard-by-shard combine folded over the shard axis, as CLU builds its
        reduce from merge. A metric overrides it only for a vectorised form
        that rounds better (Average, Std) or keeps an order (Last)."""
        n = self.num_shards
        if n == 0:
            return type(self).empty(1)
        fields = [getattr(self, f) for f in self._fields]
        out = self.replace(
            **{f: x[:1] for f, x in zip(self._fields, fields, strict=True)}
        )
        for k in range(1, n):
            shard = {f: x[k : k + 1] for f, x in zip(self._fields, fields, strict=True)}
            out = out.combine(self.replace(**shard))
        return out

    def replace(self, **fields) -> Metric:
        """This metric with ``fields`` replaced."""
        # every subclass is made a dataclass in __init_subclass__; Metric is not
        return dataclasses.replace(self, **fields)  # type: ignore[type-var]

    def _leaves(self) -> list[jax.Array]:
        return [getattr(self, f) for f in self._fields]


class BatchView:
    """One batch's mask, shard count and the view of arrays as shards."""

    def __init__(self, metric: type, outputs: Mapping[str, Any], num_shards):
        self.metric = metric.__name__
        self.outputs = outputs
        self.given = num_shards
        mask = outputs.get("mask")
        self.mask = None if mask is None else jnp.asarray(mask)
        if self.mask is not None and self.mask.ndim != 1:
            raise ValueError(
                f"{self.metric}: mask must be one flag per example (shape (batch,)), "
                f"got shape {self.mask.shape}"
            )
        self.shards: int | None = None

    def get(self, name: str) -> jax.Array:
        if name not in self.outputs or self.outputs[name] is None:
            given = ", ".join(sorted(self.outputs)) or "none"
            raise TypeError(
                f"{self.metric}.from_model_output needs {name}= (given: {given})"
            )
        value = self.outputs[name]
        if isinstance(value, jax.core.Tracer | jax.Array):
            self._check_real(value.dtype, name)
            return value
        host = np.asarray(value)
        if not (jnp.issubdtype(host.dtype, jnp.number) or host.dtype == bool):
            raise TypeError(f"{self.metric}: {name} must be numeric, got {host.dtype}")
        self._check_real(host.dtype, name)
        bad = wrapped_extreme(host)
        if bad is not None:
            raise ValueError(
                f"{self.metric}: {name} holds {bad}, beyond "
                f"{jax.dtypes.canonicalize_dtype(host.dtype)} (JAX runs without "
                "jax_enable_x64): enable jax_enable_x64 or cast the values to float "
                "yourself"
            )
        return jnp.asarray(host)

    def _check_real(self, dtype: Any, name: str) -> None:
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"{self.metric}: {name} is complex ({dtype}); pass its real part, "
                "imaginary part or magnitude"
            )

    def _check_exact(self, name: str, acc: Any) -> None:
        """Refuses host integers that ``acc`` (a float dtype) would round."""
        value = self.outputs[name]
        if isinstance(value, jax.core.Tracer | jax.Array):
            return  # on device: not read back (see the module notes)
        host = np.asarray(value)
        if host.dtype.kind not in "iu" or not host.size:
            return
        limit = 2 ** (jnp.finfo(acc).nmant + 1)
        lo, hi = int(host.min()), int(host.max())
        if max(-lo, hi) > limit:
            raise ValueError(
                f"{self.metric}: {name} holds {hi if hi > limit else lo}, beyond "
                f"+-{limit}, where {jnp.dtype(acc)} stops holding every integer: "
                + (
                    "enable jax_enable_x64 (float64 holds them up to 2**53) or "
                    if jnp.dtype(acc).itemsize < 8
                    else ""
                )
                + "cast the values to float yourself to accept the rounding"
            )

    def split(self, x: jax.Array, name: str) -> jax.Array:
        """``x`` (batch first) viewed as ``(S, B // S, ...)``."""
        if x.ndim == 0:
            raise ValueError(f"{self.metric}: {name} needs a batch axis, got a scalar")
        if self.mask is not None and self.mask.shape[0] != x.shape[0]:
            raise ValueError(
                f"{self.metric}: {name} has {x.shape[0]} examples but mask has "
                f"{self.mask.shape[0]}"
            )
        s = self._shards(x, name)
        if x.shape[0] == 0:  # an empty batch: nothing to view (nor to move)
            return jnp.zeros((s, 0, *x.shape[1:]), x.dtype)
        return x.reshape((s, x.shape[0] // s, *x.shape[1:]))

    def _shards(self, x: jax.Array, name: str) -> int:
        if self.shards is not None:
            return self.shards
        known = shard_count(x)
        given = self._given()
        if given is not None:
            if known is not None and known != given:
                raise ValueError(
                    f"{self.metric}: num_shards={given} but {name}'s batch axis is "
                    f"sharded {known} ways"
                )
            known = given
        s = known or 1
        if x.shape[0] % s:
            raise ValueError(
                f"{self.metric}: a batch of {x.shape[0]} does not split into {s} "
                "equal shards (pad the batch to a multiple)"
            )
        self.shards = s
        return s

    def weights(self, x: jax.Array, name: str) -> jax.Array:
        """The mask as ``(S, B // S, 1...)`` flags for ``x`` split."""
        shards = self.split(x, name)
        if self.mask is None:
            return jnp.ones(shards.shape[:2] + (1,) * (shards.ndim - 2), bool)
        m = self.split(self.mask.astype(bool), "mask")
        return m.reshape(m.shape + (1,) * (shards.ndim - 2))

    def values(self, name: str, exact: bool = True) -> tuple[jax.Array, jax.Array]:
        """Output ``name`` in its accumulation dtype as ``(S, B // S, ...)`` and
        the flags of the values to count, of the same shape. A scalar is one
        value, in the last shard (it is not per example: the mask does not
        apply). ``exact``: refuse host integers that the accumulation dtype
        would round."""
        x = self.get(name)
        if exact:
            self._check_exact(name, acc_dtype(x.dtype))
        x = x.astype(acc_dtype(x.dtype))
        if x.ndim == 0:
            s = self._given() or 1
            self.shards = self.shards or s
            s = self.shards
            flags = (jnp.arange(s) == s - 1)[:, None]
            manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
            if manual:  # in shard_map every device holds the scalar: count it once
                flags = flags & (lax.axis_index(tuple(manual)) == 0)
            return jnp.broadcast_to(x, (s, 1)), flags
        v = self.split(x, name)
        return v, jnp.broadcast_to(self.weights(x, name), v.shape)

    def _given(self) -> int | None:
        given = self.given
        if given is None:
            return None
        if (
            isinstance(given, bool)
            or not isinstance(given, numbers.Integral)
            or given < 1
        ):
            raise ValueError(f"num_shards must be a positive int, got {given!r}")
        return int(given)


def _sum(x: jax.Array, dtype: Any = None) -> jax.Array:
    """Sum over everything but the shard axis."""
    return jnp.sum(x, axis=tuple(range(1, x.ndim)), dtype=dtype)


def _add(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` of counts, -1 where either is -1 or the sum passes the dtype's
    largest value (int32 without x64): an overflow is never a wrapped count."""
    n = a + b
    return jnp.where((a < 0) | (b < 0) | (n < a), -1, n).astype(a.dtype)


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a + b`` rounded, and what the rounding lost, exactly (Knuth's two-sum;
    0 where the sum is not finite)."""
    total = a + b
    back = total - a
    lost = (a - (total - back)) + (b - back)
    return total, jnp.where(jnp.isfinite(lost), lost, 0)


def _two_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a * b`` rounded, and what the rounding lost, exactly (Dekker's
    two-product, each factor split in halves that multiply exactly; for values
    well inside the dtype's range)."""
    split = 2.0 ** ((jnp.finfo(a.dtype).nmant + 2) // 2) + 1

    def halves(x):
        t = split * x
        hi = t - (t - x)
        return hi, x - hi

    (ah, al), (bh, bl) = halves(a), halves(b)
    p = a * b
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _nonzero(x: jax.Array) -> jax.Array:
    """``x`` with 1 for 0: a divisor for states that hold nothing."""
    return jnp.where(x != 0, x, 1)


# ----- the metrics -----------------------------------------------------------------


class _OfOutput(Metric):
    """A metric of one model output: ``values``, or the name given to
    :meth:`from_output`."""

    argname: ClassVar[str] = "values"

    @classmethod
    def from_output(cls, argname: str):
        """This metric of the model output named ``argname``."""
        # a class is hashable: mypy checks type[...] against Hashable wrongly
        return _variant(cls, argname=argname)  # type: ignore[arg-type]


class Average(_OfOutput):
    """The (weighted) mean of every value counted.

    Reads ``values`` (one per example, or an array per example whose elements all
    count), an optional ``mask`` and, with :meth:`from_output`'s ``weights=``, a
    weight per example. Scalars count as one example.

    The state is the weighted mean, the total weight and what the mean lost
    to rounding (``residual``). A merge moves the mean toward the other's by
    the other's share of the total weight and keeps what that addition lost,
    so a mean merged over 10^5 batches keeps its digits; means too far apart
    for their difference (near float32's largest, 3e38) are pooled by their
    shares instead, without overflow.
    """

    mean: jax.Array
    weight: jax.Array
    residual: jax.Array  # what ``mean`` lost to rounding

    weightname: ClassVar[str | None] = None

    @classmethod
    def from_output(cls, argname: str, weights: str | None = None) -> type[Average]:
        """An Average of the model output ``argname`` (weighted by the output
        ``weights`` per example, if given)."""
        # a class is hashable: mypy checks type[...] against Hashable wrongly
        return _variant(cls, argname=argname, weightname=weights)  # type: ignore[arg-type]

    @classmethod
    def identity(cls, n):
        f = _float()
        return {
            "mean": jnp.zeros(n, f),
            "weight": jnp.zeros(n, f),
            "residual": jnp.zeros(n, f),
        }

    @classmethod
    def from_batch(cls, batch, outputs):
        v, flags = batch.values(cls.argname)
        w = flags.astype(v.dtype)
        if cls.weightname is not None:
            given = batch.get(cls.weightname)
            shape = batch.get(cls.argname).shape
            if given.ndim != 1 or not shape or given.shape[0] != shape[0]:
                raise ValueError(
                    f"Average: {cls.weightname} must be one weight per example of "
                    f"{cls.argname} (shape ({shape[0] if shape else 'batch'},)), got "
                    f"shape {given.shape}"
                )
            g = batch.split(given.astype(v.dtype), cls.weightname)
            g = g.reshape(g.shape + (1,) * (v.ndim - g.ndim))
            w = jnp.where(flags, g, 0)  # not a product: padding's weight is unread
        weight = _sum(w)
        share = w / _nonzero(weight).reshape((-1,) + (1,) * (v.ndim - 1))
        # where, not a product: a masked NaN must not count
        mean = _sum(jnp.where(w != 0, v * share, 0))
        # weights that sum to 0 without being 0 (negative weights): the
        # weighted sum cannot be kept as a mean, so the result is undefined
        undefined = (weight == 0) & (_sum(jnp.abs(w)) > 0)
        weight = jnp.where(undefined, jnp.nan, weight)
        mean = jnp.where(undefined, jnp.nan, mean)
        return cls(mean=mean, weight=weight, residual=jnp.zeros_like(mean))

    def combine(self, o):
        # the mean moved toward o's by o's share of the weight, and what that
        # addition lost kept (elementwise: one fused loop in the step)
        n = self.weight + o.weight
        share = o.weight / _nonzero(n)
        step = ((o.mean - self.mean) + (o.residual - self.residual)) * share
        mean, lost = _two_sum(self.mean, step)
        residual = self.residual + lost
        # means too far apart for their difference (near +-3e38), or an
        # infinite one (inf - inf would be NaN where inf is the mean): shares
        # first, as NumPy's formula (inf and -inf together: NaN)
        far = ~jnp.isfinite(step) | ~jnp.isfinite(self.mean) | ~jnp.isfinite(o.mean)
        mean = jnp.where(
            far, self.mean * (self.weight / _nonzero(n)) + o.mean * share, mean
        )
        residual = jnp.where(far, 0, residual)
        # merging nothing returns the other side exactly
        keep, take = o.weight == 0, self.weight == 0
        mean = jnp.where(keep, self.mean, jnp.where(take, o.mean, mean))
        residual = jnp.where(keep, self.residual, jnp.where(take, o.residual, residual))
        # weights that add up to 0 (negative ones): undefined, as in from_batch
        undefined = (n == 0) & ~keep & ~take
        n = jnp.where(undefined, jnp.nan, n)
        mean = jnp.where(undefined, jnp.nan, mean)
        return self.replace(mean=mean, weight=n, residual=residual)

    def fold(self):
        n, mean, lost = _pooled_mean(self.weight, self.mean, self.residual)
        return self.replace(mean=mean[:1], weight=n[:1], residual=lost[:1])

    def result(self):
        return jnp.where(self.weight[0] != 0, self.mean[0] + self.residual[0], jnp.nan)


def _pooled_mean(weight, mean, residual):
    """The weighted mean of the groups (weight, mean + residual) along axis 0,
    kept: (the total weight, the mean rounded, what the rounding lost). The
    means are pooled as offsets from their midrange (no overflow near the
    dtype's largest; close means lose no digits), weighted by their shares of
    the total; groups of weight 0 are never read."""
    has = weight != 0
    n = jnp.sum(weight, axis=0, keepdims=True)
    share = jnp.where(has, weight / _nonzero(n), 0)
    hi = jnp.max(
        jnp.where(has, mean, -jnp.inf), axis=0, keepdims=True, initial=-jnp.inf
    )
    lo = jnp.min(jnp.where(has, mean, jnp.inf), axis=0, keepdims=True, initial=jnp.inf)
    ref = hi / 2 + lo / 2  # (halves: no overflow near the dtype's largest)
    ref = jnp.where(jnp.isfinite(ref), ref, 0)
    offset = jnp.where(has, (mean - ref) + residual, 0)  # a masked NaN stays out
    total, lost = _two_sum(ref, jnp.sum(share * offset, axis=0, keepdims=True))
    # groups whose weights add up to 0 (negative ones): undefined, NaN
    undefined = (n == 0) & jnp.any(has, axis=0, keepdims=True)
    n = jnp.where(undefined, jnp.nan, n)
    total = jnp.where(undefined, jnp.nan, total)
    return n, total, lost


class Sum(_OfOutput):
    """The sum of every value counted (``values``, optional ``mask``).

    The state is the total and what merging lost to rounding (``residual``,
    Kahan and Babuska's compensated sum), so the total keeps its digits over
    many merges, and integers summed stay exact past 2**24 in float32."""

    total: jax.Array
    residual: jax.Array

    @classmethod
    def identity(cls, n):
        return {"total": jnp.zeros(n, _float()), "residual": jnp.zeros(n, _float())}

    @classmethod
    def from_batch(cls, batch, outputs):
        v, w = batch.values(cls.argname)
        total = _sum(jnp.where(w, v, 0))
        return cls(total=total, residual=jnp.zeros_like(total))

    def combine(self, o):
        total, lost = _two_sum(self.total, o.total)
        return self.replace(total=total, residual=self.residual + o.residual + lost)

    def result(self):
        return self.total[0] + self.residual[0]


class Count(_OfOutput):
    """How many examples were counted: the true entries of ``mask``, or the
    batch size of ``values`` without one. In int32 without ``jax_enable_x64``:
    a count past 2**31 - 1 reads -1 (never a wrapped number); int64 with x64."""

    count: jax.Array

    @classmethod
    def identity(cls, n):
        return {"count": jnp.zeros(n, _int())}

    @classmethod
    def from_batch(cls, batch, outputs):
        if batch.mask is not None and outputs.get(cls.argname) is None:
            m = batch.split(batch.mask.astype(bool), "mask")
            return cls(count=_sum(m, _int()))
        # a scalar is one value, mask or not; only the flags are read
        _, w = batch.values(cls.argname, exact=False)
        return cls(count=jnp.sum(w[:, :, *(0,) * (w.ndim - 2)], axis=1, dtype=_int()))

    def combine(self, o):
        return self.replace(count=_add(self.count, o.count))

    def result(self):
        return self.count[0]


class _Extreme(_OfOutput):
    value: jax.Array
    count: jax.Array

    _pick: ClassVar[Callable] = staticmethod(jnp.maximum)
    _reduce: ClassVar[Callable] = staticmethod(jnp.max)
    _start: ClassVar[float] = -math.inf

    @classmethod
    def identity(cls, n):
        return {
            "value": jnp.full(n, cls._start, _float()),
            "count": jnp.zeros(n, _int()),
        }

    @classmethod
    def from_batch(cls, batch, outputs):
        v, w = batch.values(cls.argname)
        axes = tuple(range(1, v.ndim))
        value = cls._reduce(jnp.where(w, v, cls._start), axis=axes, initial=cls._start)
        return cls(value=value, count=jnp.sum(w, axis=axes, dtype=_int()))

    def combine(self, o):
        return self.replace(
            value=self._pick(self.value, o.value), count=_add(self.count, o.count)
        )

    def result(self):
        return jnp.where(self.count[0] != 0, self.value[0], jnp.nan)


class Max(_Extreme):
    """The largest value counted (``values``, optional ``mask``; NaN wins)."""


class Min(_Extreme):
    """The smallest value counted (``values``, optional ``mask``; NaN wins)."""

    _pick: ClassVar[Callable] = staticmethod(jnp.minimum)
    _reduce: ClassVar[Callable] = staticmethod(jnp.min)
    _start: ClassVar[float] = math.inf


class Last(_OfOutput):
    """The last value counted: of the last batch merged that counted any, its
    last unmasked example (in batch order across devices). ``values``: a scalar
    (a learning rate) or one value per example.

    State per shard: the value, ``stamp`` (the position, among the batches
    merged, of the batch it came from; 0 for none) and ``clock`` (how many
    batches were merged), so that merging stays associative and the shards'
    values can be ordered when gathered."""

    value: jax.Array
    stamp: jax.Array
    clock: jax.Array

    @classmethod
    def identity(cls, n):
        zeros = jnp.zeros(n, _int())
        return {"value": jnp.zeros(n, _float()), "stamp": zeros, "clock": zeros}

    @classmethod
    def from_batch(cls, batch, outputs):
        if batch.get(cls.argname).ndim > 1:
            raise ValueError(
                f"Last: {cls.argname} must be a scalar or one value per example, "
                f"got shape {batch.get(cls.argname).shape}"
            )
        v, w = batch.values(cls.argname)
        per = v.shape[1]
        if per:  # the index of the last true flag of each shard (0 where none)
            last = per - 1 - jnp.argmax(w[:, ::-1], axis=1)
            value = jnp.take_along_axis(v, last[:, None], axis=1)[:, 0]
        else:
            value = jnp.zeros(v.shape[0], v.dtype)
        has = jnp.any(w, axis=1)
        return cls(
            value=jnp.where(has, value, 0),
            stamp=has.astype(_int()),
            clock=jnp.ones(v.shape[0], _int()),
        )

    def combine(self, o):
        later = o.stamp > 0
        return self.replace(
            value=jnp.where(later, o.value, self.value),
            stamp=jnp.where(later, self.clock + o.stamp, self.stamp),
            clock=self.clock + o.clock,
        )

    def fold(self):
        n = self.stamp.shape[0]
        if n == 0:
            return type(self).empty(1)
        # the latest batch; within it, the last shard that counted any
        k = n - 1 - jnp.argmax(self.stamp[::-1])
        return self.replace(
            value=self.value[k][None], stamp=self.stamp[k][None], clock=self.clock[:1]
        )

    def result(self):
        return jnp.where(self.stamp[0] > 0, self.value[0], jnp.nan)


def _pooled(count, mean, std, residual, std_residual, axis: int):
    """Chan's merge of the groups (count, mean, population std) along ``axis``,
    kept: ``var = sum(share * (std**2 + (mean - pooled mean)**2))``, computed on
    the means' offsets from their midrange divided by a power of two, so no
    square overflows (+-1e20 in float32) and a large common offset loses no
    digits (1e7 +- 3). ``residual`` and ``std_residual`` (None for none) are
    what each mean and std lost to rounding: a group's mean is ``mean +
    residual``. Returns the count and the pooled mean and std, each in the same
    two parts. Groups of count 0 are never read."""
    has = count > 0
    n = jnp.sum(count, axis=axis, keepdims=True)
    share = jnp.where(has, count / _nonzero(n), 0)
    # the means as offsets from their midrange (exact for close means: a large
    # common offset keeps its digits, and equal means give a std of exactly 0)
    hi = jnp.max(
        jnp.where(has, mean, -jnp.inf), axis=axis, keepdims=True, initial=-jnp.inf
    )
    lo = jnp.min(
        jnp.where(has, mean, jnp.inf), axis=axis, keepdims=True, initial=jnp.inf
    )
    ref = hi / 2 + lo / 2  # (halves: no overflow near the dtype's largest)
    ref = jnp.where(jnp.isfinite(ref), ref, 0)
    offset = mean - ref if residual is None else (mean - ref) + residual
    offset = jnp.where(has, offset, 0)  # where: a masked NaN stays out
    size = jnp.abs(offset) if std is None else jnp.maximum(jnp.abs(offset), std)
    s = pow2_scale(
        jnp.max(jnp.where(has, size, 0), axis=axis, keepdims=True, initial=0)
    )
    m = jnp.where(has, offset / s, 0)
    pooled = jnp.sum(share * m, axis=axis, keepdims=True)
    d = jnp.where(has, m - pooled, 0)
    spread = d * d
    if std is not None:
        r = jnp.where(has, std / s, 0)
        spread = spread + (r * r + 2 * r * jnp.where(has, std_residual / s, 0))
    # counts times spreads over the total count: shares (count / n) rounded to
    # float32 did not sum to 1, and over 10^5 merges the std drifted by 4e-4
    var = jnp.sum(count * spread, axis=axis, keepdims=True) / _nonzero(n)
    q = jnp.sqrt(var)
    # what the std lost to rounding: (var - q**2) / (2 q), q**2 exactly
    # (Dekker's two-product); a merge squares the std, so its rounding was
    # read back as spread at every merge
    p, p_lost = _two_product(q, q)
    q_lost = jnp.where(q > 0, ((var - p) - p_lost) / (2 * _nonzero(q)), 0)
    # the mean rounded, and what the rounding lost (exactly: Knuth's two-sum),
    # so that a merge of groups whose spread is a few float32 steps (1e7 +- 3)
    # does not read their means' rounding as spread
    total, lost = _two_sum(ref, pooled * s)
    q_lost = jnp.where(jnp.isfinite(q_lost), q_lost, 0)
    return n, total, q * s, lost, q_lost * s


class Std(_OfOutput):
    """The standard deviation (population, ``ddof=0``) of every value counted,
    by Chan's parallel merge of (count, mean, std): stable in float32 for values
    like 1e4 +- 1, where sums of squares lose every digit, and finite for values
    near float32's largest (+-1e20, +-3e38), whose squares would overflow: each
    merge works on the values divided by a power of two. Each mean and std is
    kept with what it lost to rounding (``residual``, ``std_residual``), so
    values 1e7 +- 3, a few of float32's steps apart, keep their digits too, and
    so does a std merged over 10^5 batches. ``values`` (every element counts),
    optional ``mask``."""

    count: jax.Array
    mean: jax.Array
    std: jax.Array
    residual: jax.Array  # what ``mean`` lost to rounding
    std_residual: jax.Array  # what ``std`` lost to rounding

    @classmethod
    def identity(cls, n):
        f = _float()
        return {
            "count": jnp.zeros(n, f),
            "mean": jnp.zeros(n, f),
            "std": jnp.zeros(n, f),
            "residual": jnp.zeros(n, f),
            "std_residual": jnp.zeros(n, f),
        }

    @classmethod
    def from_batch(cls, batch, outputs):
        v, w = batch.values(cls.argname)
        s = v.shape[0]
        count = w.reshape(s, -1).astype(v.dtype)
        pooled = _pooled(count, v.reshape(s, -1), None, None, None, axis=1)
        return cls(**{f: x[:, 0] for f, x in zip(cls._fields, pooled, strict=True)})

    def combine(self, o):
        both = [jnp.stack([getattr(self, f), getattr(o, f)]) for f in self._fields]
        merged = dict(zip(self._fields, _pooled(*both, axis=0), strict=True))
        # merging nothing returns the other side exactly (empty() is the identity)
        return self.replace(
            **{
                f: jnp.where(
                    o.count > 0,
                    jnp.where(self.count > 0, merged[f][0], getattr(o, f)),
                    getattr(self, f),
                )
                for f in self._fields
            }
        )

    def fold(self):
        pooled = _pooled(*self._leaves(), axis=0)
        return self.replace(**dict(zip(self._fields, pooled, strict=True)))

    def result(self):
        return jnp.where(self.count[0] > 0, self.std[0] + self.std_residual[0], jnp.nan)


class Accuracy(Metric):
    """The fraction of examples whose label is predicted: from ``logits``
    (batch x classes; with :meth:`top` a label among the ``k`` largest counts,
    ties in the label's favour) or from ``predictions`` (class ids), against
    ``labels``, with an optional ``mask``. A label outside the classes (an
    ignore index such as -100, or a class the logits do not have) is a miss,
    whatever the prediction; so is a label whose logit is NaN, and a NaN logit
    ranks above every number (as ``argmax`` takes it)."""

    reads: ClassVar[tuple[str, ...]] = ("logits", "labels")

    correct: jax.Array
    count: jax.Array

    top_k: ClassVar[int] = 1

    @classmethod
    def top(cls, k: int) -> type[Accuracy]:
        """Top-``k`` accuracy from ``logits``."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"Accuracy.top needs a positive int k, got {k!r}")
        return _variant(cls, top_k=int(k))

    @classmethod
    def identity(cls, n):
        return {"correct": jnp.zeros(n, _int()), "count": jnp.zeros(n, _int())}

    @classmethod
    def from_batch(cls, batch, outputs):
        labels = batch.get("labels")
        if labels.dtype.kind not in "iu":
            raise TypeError(f"Accuracy: labels must be integers, got {labels.dtype}")
        if outputs.get("logits") is not None:
            logits = batch.get("logits")
            if logits.ndim != labels.ndim + 1 or logits.shape[:-1] != labels.shape:
                raise ValueError(
                    f"Accuracy: logits {logits.shape} must be labels {labels.shape} "
                    "plus a class axis"
                )
            floating = jnp.issubdtype(logits.dtype, jnp.floating)
            # NaN ranks above every number (argmax takes the first NaN), and
            # a label whose logit is NaN is a miss: a model that blew up does
            # not read as accurate
            mine = jnp.take_along_axis(
                logits, jnp.clip(labels, 0, logits.shape[-1] - 1)[..., None], axis=-1
            )
            if cls.top_k == 1:
                hit = jnp.argmax(logits, axis=-1) == labels
            else:
                nan = jnp.isnan(logits) if floating else False
                above = jnp.sum((logits > mine) | nan, axis=-1)
                hit = above < cls.top_k
            if floating:
                hit = hit & ~jnp.isnan(mine[..., 0])
            # a label outside the classes (an ignore index such as -100) misses
            hit = hit & (labels >= 0) & (labels < logits.shape[-1])
        elif outputs.get("predictions") is not None:
            if cls.top_k != 1:
                raise ValueError("Accuracy.top(k) with k > 1 needs logits=")
            predictions = batch.get("predictions")
            if predictions.shape != labels.shape:
                raise ValueError(
                    f"Accuracy: predictions {predictions.shape} and labels "
                    f"{labels.shape} differ in shape"
                )
            # a negative label (an ignore index such as -100) misses; both
            # non-negative, compared unsigned: int32 -1 never equals uint32 2**32 - 1
            unsigned = jax.dtypes.canonicalize_dtype(jnp.uint64)
            hit = (
                (labels >= 0)
                & (predictions >= 0)
                & (predictions.astype(unsigned) == labels.astype(unsigned))
            )
        else:
            batch.get("logits")  # raises, naming what is needed
        if labels.ndim == 0:
            raise ValueError("Accuracy: labels needs a batch axis, got a scalar")
        hit = batch.split(hit, "labels")
        w = jnp.broadcast_to(batch.weights(labels, "labels"), hit.shape)
        return cls(correct=_sum(hit & w, _int()), count=_sum(w, _int()))

    def combine(self, o):
        return self.replace(
            correct=_add(self.correct, o.correct), count=_add(self.count, o.count)
        )

    def result(self):
        value = self.correct[0].astype(_float()) / self.count[0]
        return jnp.where(self.count[0] < 0, jnp.nan, value)  # counted past int32


@functools.cache
def _variant(base: type, **config) -> type:
    """A subclass of ``base`` with ``config`` as class attributes (cached, so the
    same declaration gives the same pytree type, as jit and scan carries need)."""
    for name, value in config.items():
        if name.endswith("name") and value is not None and not isinstance(value, str):
            raise TypeError(f"{base.__name__}: {name} must be a str, got {value!r}")
    if all(getattr(base, k) == v for k, v in config.items()):
        return base  # Accuracy.top(1) is Accuracy: one pytree type
    label = ",".join(f"{k}={v!r}" for k, v in config.items())
    return type(f"{base.__name__}[{label}]", (base,), dict(config))


def _sharded(x: Any) -> Any:
    """``x``'s sharding if explicit axes shard it, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(p is None for p in spec):
        return None
    if not isinstance(x, jax.core.Tracer) and isinstance(x, jax.Array):
        return x.sharding  # concrete: on real devices
    return sharding


def _aligned(*trees: Any) -> tuple:
    """``trees`` with every leaf on the sharding of the first leaf that explicit
    axes shard (a replicated identity beside a sharded batch's state): JAX's
    select needs its operands sharded alike."""
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    target = next((sh for sh in map(_sharded, leaves) if sh is not None), None)
    if target is None:
        return trees

    def move(x):
        sh = _sharded(x)
        if sh is not None and sh.spec == target.spec:
            return x
        if isinstance(x, jax.core.Tracer):
            return jax.sharding.reshard(x, target)
        return jax.device_put(x, target)

    return tuple(jax.tree.map(move, t) for t in trees)


# ----- gathering partial states ------------------------------------------------------


def _gather(metrics: list[Metric], axis_name: Any) -> list[Metric]:
    """``metrics`` with every shard's partial state on every device (shard
    order), in one all-reduce per dtype; unchanged when there is nothing to
    gather (one shard and no axis)."""
    leaves, treedef = jax.tree.flatten(metrics)
    shards = {int(np.shape(x)[0]) for x in leaves}
    if len(shards) > 1:
        raise ValueError(
            f"the metrics hold different shard counts ({sorted(shards)}): compute "
            "them separately"
        )
    s = shards.pop() if shards else 0
    if s == 0 or (axis_name is None and s == 1):
        return metrics
    if axis_name is None:
        slots, mine = s, jnp.eye(s, dtype=bool)[:, :, None]  # (S, S, 1)
    else:
        size = bound_axis_size(axis_name, "compute")
        axis_name = check_axis_name(axis_name)
        here = lax.axis_index(axis_name)
        slots, mine = size, (jnp.arange(size) == here)[:, None, None]  # (P, 1, 1)
    (leaves,) = _aligned(leaves)  # a scalar's state beside a sharded batch's

    def gather(table: jax.Array) -> jax.Array:  # (S, K): shards x states
        if axis_name is None:
            # Row r of the result is shard r's state; summing away the sharded
            # axis is the one all-reduce. where, not a product: NaN * 0 is NaN.
            return jnp.sum(jnp.where(mine, table[None], 0), axis=1)  # (S, K)
        full = lax.psum(jnp.where(mine, table[None], 0), axis_name)  # (P, S, K)
        return full.reshape(slots * s, table.shape[-1])

    out = fused_by_dtype(gather, leaves, axis=-1)
    return jax.tree.unflatten(treedef, out)


# ----- Collection --------------------------------------------------------------------


class Collection:
    """A named group of metrics, updated, merged and computed together: a
    frozen dataclass with one field per metric, registered as a pytree.

    Declared as a class, as CLU's is::

        class Metrics(jh.metrics.Collection):
            loss: jh.metrics.Average.from_output("loss")
            accuracy: jh.metrics.Accuracy

    or in one line::

        Metrics = jh.metrics.Collection.create(
            loss=jh.metrics.Average.from_output("loss"),
            accuracy=jh.metrics.Accuracy,
            loss_std=jh.metrics.Std.from_output("loss"),
        )
        m = Metrics.empty()
        m = m.update(loss=per_example_loss, logits=logits, labels=y, mask=valid)
        m.compute()  # {"loss": ..., "accuracy": ..., "loss_std": ...}

    ``compute`` gathers every metric's per-device state in at most 2 collectives
    (one per state dtype), whatever the number of metrics.
    """

    _metrics: ClassVar[dict[str, type[Metric]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = inspect.get_annotations(cls)
        if not own:
            return
        hints = typing.get_type_hints(cls)  # (annotations written as strings)
        metrics = {name: hints[name] for name in own if name != "_metrics"}
        _check_metrics(metrics)
        cls._metrics = {**cls._metrics, **metrics}
        dataclasses.dataclass(frozen=True, repr=False, eq=False)(cls)
        cls._flax_dataclass = True  # see Metric.__init_subclass__
        jax.tree_util.register_dataclass(
            cls, data_fields=list(cls._metrics), meta_fields=[]
        )

    @staticmethod
    def create(**metrics: type[Metric]) -> type[Collection]:
        """A Collection class holding ``metrics`` (name -> metric class): the
        same class as one declared with a field per metric."""
        _check_metrics(metrics)
        return type("Collection", (Collection,), {"__annotations__": dict(metrics)})

    def __getattr__(self, name: str):
        raise AttributeError(
            f"no metric {name!r} in this Collection; it has {', '.join(self._metrics)}"
        )

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{k}={type(getattr(self, k)).__name__}" for k in self._metrics
        )
        return f"Collection({inner})"

    @classmethod
    def empty(cls, num_shards: int = 0) -> Collection:
        cls._check_declared()
        return cls(*(m.empty(num_shards) for m in cls._metrics.values()))

    @classmethod
    def from_model_output(
        cls, *, num_shards: int | None = None, **outputs
    ) -> Collection:
        """Every metric of one batch (each reads the outputs it needs); one shard
        count for all, read from ``mask`` or the first batched output."""
        cls._check_declared()
        unread = [m.unread_weights(outputs) for m in cls._metrics.values()]
        for name in set.intersection(*map(set, unread)):
            raise ValueError(
                f"no metric of this Collection reads {name}= (it has "
                f"{', '.join(cls._metrics)}): declare one that does, e.g. "
                f"Average.from_output('loss', weights={name!r})"
            )
        if num_shards is None:
            num_shards = _batch_shards(outputs)
        return cls(*(m._of_batch(num_shards, outputs) for m in cls._metrics.values()))

    def update(self, *, num_shards: int | None = None, **outputs) -> Collection:
        """``self.merge(type(self).from_model_output(**outputs))``, the batch
        split into this collection's shard count unless ``num_shards`` says
        otherwise."""
        if num_shards is None:
            metrics = [getattr(self, k) for k in self._metrics]
            num_shards = next((m.num_shards for m in metrics if m.num_shards), None)
        return self.merge(
            type(self).from_model_output(num_shards=num_shards, **outputs)
        )

    def merge(self, other: Collection) -> Collection:
        if type(other) is not type(self):
            raise TypeError("cannot merge Collections of different declarations")
        return type(self)(
            *(getattr(self, k).merge(getattr(other, k)) for k in self._metrics)
        )

    def compute(self, axis_name: Any = None) -> dict[str, jax.Array]:
        """Every metric's value, by name: one gather for all of them (at most 2
        collectives). Returns JAX arrays without waiting for them."""
        metrics = [getattr(self, k) for k in self._metrics]
        counted = [m for m in metrics if m.num_shards]
        gathered = iter(_gather(counted, axis_name))
        values = {}
        for name, m in zip(self._metrics, metrics, strict=True):
            done = next(gathered) if m.num_shards else m
            values[name] = done.fold().result()
        return values

    @classmethod
    def _check_declared(cls) -> None:
        if not cls._metrics:
            raise TypeError(
                "declare a Collection with Collection.create(name=Metric, ...)"
            )


def _batch_shards(outputs: Mapping[str, Any]) -> int | None:
    names = ["mask", *(k for k in outputs if k != "mask")]
    for name in names:
        x = outputs.get(name)
        if isinstance(x, jax.Array | jax.core.Tracer) and x.ndim:
            known = shard_count(x)
            if known is not None:
                return known
    return None


def _check_metrics(metrics: dict) -> None:
    """Refuses a declaration that is not one concrete metric class per name."""
    if not metrics:
        raise ValueError("Collection.create needs at least one metric")
    for name, metric in metrics.items():
        if not (isinstance(metric, type) and issubclass(metric, Metric)):
            raise TypeError(
                f"Collection.create: {name}= must be a metric class (Average, "
                f"Accuracy, Std.from_output('loss'), ...), got {metric!r}"
            )
        if metric in (Metric, _OfOutput, _Extreme):
            raise TypeError(f"Collection.create: {name}= is not a concrete metric")
        if name.startswith("_") or hasattr(Collection, name):
            raise ValueError(
                f"Collection.create: a metric named {name!r} would hide the "
                "Collection's own attribute of that name (names must not "
                "start with '_' nor be update, compute, merge, empty, ...): "
                "rename it"
            )
