"""Row: one update, parsed once on its way through the host.

:func:`parse_row` turns what a user passes to ``update`` (a dict with or without
a ``step`` entry, nested dicts, any pytree) into a :class:`Row`: the step, the
metric names and their values, and a :class:`RowKind` saying what the values
are. :meth:`HistoryState.append <jaxhistory.HistoryState.append>`, the
writer and the summary line all take the same row, so nothing parses the step
or classifies the values twice.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from jaxhistory._compiled import speedups
from jaxhistory._dtypes import INT64_MAX, INT64_MIN, NESTED, as_step
from jaxhistory._names import STEP_KEYS, check_text, flatten

__all__ = [
    "Repeat",
    "Row",
    "RowKind",
    "kind_of",
    "owned",
    "parse_row",
    "queued",
    "repeat_of",
    "repeated",
    "step_entry",
]

_FLOATS = frozenset({float})
_NUMBERS = frozenset({float, int})
_is_str = str.__instancecheck__


class RowKind(enum.IntEnum):
    """What a row's values are, which says what the host path may skip (a
    higher kind promises more).

    ``FINITE_FLOATS``: every value a finite Python float (nothing to convert or
    check). ``FLOATS``: every value a Python float. ``NUMBERS``: every value a
    Python float or int. ``VALUES``: anything recordable (NumPy or JAX arrays,
    :class:`~jaxhistory.Stats`), converted on the writer's thread.
    """

    VALUES = 0
    NUMBERS = 1
    FLOATS = 2
    FINITE_FLOATS = 3


_VALUES, _NUMBERS_KIND = RowKind.VALUES, RowKind.NUMBERS
_FLOATS_KIND, _FINITE = RowKind.FLOATS, RowKind.FINITE_FLOATS


class Row(NamedTuple):
    """One update: the step it is recorded at, the metric names and their
    values in order, what kind of values they are, the wall time of the update
    and the name its step goes by in the summary line (``step`` or ``iter``).
    Immutable: the history, the writer and the summary line read the same row.

    Examples:
        >>> from jaxhistory._row import parse_row
        >>> row = parse_row({"step": 3, "loss": 0.5, "lr": 1e-3})
        >>> row.step, row.names, row.kind.name
        (3, ('loss', 'lr'), 'FINITE_FLOATS')
    """

    step: int
    names: tuple[str, ...]
    values: tuple
    kind: RowKind
    timestamp: float = 0.0
    label: str = "step"

    def as_dict(self) -> dict[str, Any]:
        """The row's metrics as a new dict."""
        return dict(zip(self.names, self.values, strict=True))

    def extended(self, names: tuple[str, ...], values: tuple) -> Row:
        """This row with ``names`` (new ones) and their ``values`` after its own."""
        if not names:
            return self
        kind = min(self.kind, kind_of(values))
        return self._replace(
            names=self.names + names,
            values=self.values + values,
            kind=kind,
        )


def kind_of(values: tuple) -> RowKind:
    """The :class:`RowKind` of ``values``."""
    types = set(map(type, values))
    if types == _FLOATS:
        total = sum(values, 0.0)  # inf or NaN anywhere makes total - total NaN
        return _FINITE if total - total == 0.0 else _FLOATS_KIND
    if types <= _NUMBERS:
        return _NUMBERS_KIND
    return _VALUES


def step_entry(metrics: dict, step: Any) -> tuple[dict, Any, str]:
    """Takes the ``step`` (or ``iter``) entry out of ``metrics`` as the step:
    (the rest, the step, the entry's name). With an explicit ``step`` too, a
    ``step`` entry must agree with it (it is the coordinate of the record,
    never a metric of its own) and an ``iter`` entry stays a metric."""
    if step is None:
        for key in STEP_KEYS:
            if key in metrics:
                rest = metrics.copy()  # (the caller's dict is never changed)
                value = rest.pop(key)
                if type(value) is not int or not INT64_MIN <= value <= INT64_MAX:
                    value = as_step(key, value)
                return rest, value, key
        return metrics, None, "step"
    if "step" in metrics:
        entry = as_step("step", metrics["step"])
        if entry != as_step("step", step):
            raise ValueError(
                f"two steps given: step={step} and a 'step' entry of {entry}"
            )
        rest = metrics.copy()
        del rest["step"]
        return rest, step, "step"
    return metrics, step, "step"


def parse_row(
    metrics: Any, step: Any = None, next_step: int = 0, timestamp: float = 0.0
) -> Row:
    """``metrics`` at ``step`` as a :class:`Row`.

    Args:
        metrics: a dict (or any pytree) of values; nested names join with
            ``/``. When ``step`` is None, a ``step`` (or ``iter``) entry is the
            step and is not a metric.
        step: the step; None: the entry, else ``next_step``.
        next_step: the step of a row that gives none.
        timestamp: the wall time of the update.

    Raises:
        ValueError: a step that is not a whole number within int64, two steps
            that disagree, two leaves with one name.
        TypeError: a bare leaf (it has no name).
    """
    label = "step"
    if type(metrics) is dict:
        if step is None:
            repeat = LAST_REPEAT[0]
            if repeat is not None:
                if speedups is None:
                    row = repeated(repeat, metrics, next_step, timestamp)
                else:  # the same, compiled
                    row = speedups.repeated(
                        repeat, metrics, next_step, timestamp, None, Row, _FINITE
                    )
                if row is not None:
                    return row
            given = metrics  # (the dict the next one is compared with)
        else:
            given = None
        if "step" in metrics or "iter" in metrics:
            raw = metrics.get("step")
            if step is None and type(raw) is int and INT64_MIN <= raw <= INT64_MAX:
                metrics = metrics.copy()  # (the caller's dict is never changed)
                del metrics["step"]
                step = raw
            else:
                if _container_step(metrics):
                    _check_step_entries(metrics)
                metrics, step, label = step_entry(metrics, step)
        names = tuple(metrics)
        values = tuple(metrics.values())
        types = set(map(type, values))
        if not NESTED.intersection(types) and (names == _checked[0] or _all_str(names)):
            if types == _FLOATS:
                total = sum(values, 0.0)
                kind = _FINITE if total - total == 0.0 else _FLOATS_KIND
            else:
                kind = _NUMBERS_KIND if types <= _NUMBERS else _VALUES
            if step is None:
                step = next_step
            elif type(step) is not int or not INT64_MIN <= step <= INT64_MAX:
                step = as_step("step", step)
            row = _new_row(Row, (step, names, values, kind, timestamp, label))
            if given is not None and kind is _FINITE:
                LAST_REPEAT[0] = repeat_of(given, row)
            return row
    # Nested dicts, other pytrees, names that are not str (1 and "1" would both
    # be "1" in every file: flatten names them and refuses that).
    if metrics is None:  # (a step function that returned nothing)
        raise TypeError(
            "metrics is None: update takes a dict (or other pytree) of named values"
        )
    _check_step_entries(metrics)
    items = dict(flatten(metrics))
    if label == "step":
        items, step, label = step_entry(items, step)
    step = next_step if step is None else as_step("step", step)
    values = tuple(items.values())
    return Row(step, tuple(items), values, kind_of(values), timestamp, label)


def _container_step(metrics: dict) -> bool:
    for key in STEP_KEYS:
        value = metrics.get(key)
        if type(value) is not int and isinstance(value, Mapping | list | tuple):
            return True
    return False


def owned(row: Row) -> Row:
    """``row`` with a copy of each NumPy array in it: a caller may refill its
    buffer after the update, and the log, the sinks and the sentinels read the
    row later."""
    values = row.values
    if not any(type(v) is np.ndarray for v in values):
        return row
    copied = tuple(np.array(v) if type(v) is np.ndarray else v for v in values)
    return row._replace(values=copied)


_checked: list[tuple] = [()]  # the names the last row had, all str
# How the last dict of finite floats parsed with no explicit step looked (any
# thread's: a Repeat is immutable, and a stale one only costs the cheap try);
# HistoryState.update's compiled form reads it too.
LAST_REPEAT: list[Repeat | None] = [None]


def _all_str(names: tuple) -> bool:
    """Whether every name is a str (remembered for the next row's names)."""
    if all(map(_is_str, names)):
        check_text(names)
        _checked[0] = names
        return True
    return False


_new_row = tuple.__new__


def _check_step_entries(metrics: Any) -> None:
    """A ``step``/``iter`` entry that is a container would be flattened into
    metrics (``step/0``, ...): it must be one whole number."""
    if isinstance(metrics, Mapping):
        for key in STEP_KEYS:
            if key in metrics and isinstance(metrics[key], Mapping | list | tuple):
                raise ValueError(
                    f"{key!r} must be a whole number to be used as the step, got "
                    f"{metrics[key]!r:.60}"
                )


class Repeat(NamedTuple):
    """How a dict that parsed to a row of finite floats looked, so that the
    next dict with the same keys parses without :func:`parse_row`'s checks
    (see :func:`repeated`): its keys in order, the row's names, and where its
    ``step`` entry is (``None``: it has none, the step is the next one)."""

    keys: tuple
    names: tuple[str, ...]
    step_at: int | None


def repeat_of(metrics: Any, row: Row) -> Repeat | None:
    """The :class:`Repeat` of ``metrics``, which :func:`parse_row` (with no
    explicit step) turned into ``row``; None where the cheap way cannot take
    the next one: values that are not all finite floats, a step named
    ``iter``, a ``step`` entry neither first nor last, nested dicts."""
    if type(metrics) is not dict or row.kind is not _FINITE or row.label != "step":
        return None
    keys, names = tuple(metrics), row.names
    if keys == names:
        return Repeat(keys, names, None)
    if keys == ("step", *names):
        return Repeat(keys, names, 0)
    if keys == (*names, "step"):
        return Repeat(keys, names, -1)
    return None


def repeated(
    repeat: Repeat,
    metrics: Any,
    next_step: int,
    timestamp: float,
    step: Any = None,
) -> Row | None:
    """``metrics`` at ``step`` as :func:`parse_row` would parse it, where it
    has ``repeat``'s keys and finite floats as values and its step is past
    ``next_step - 1`` (an explicit ``step`` an int, for a dict without a step
    entry); None for anything else (then use :func:`parse_row`). About a third
    of :func:`parse_row`'s cost."""
    if type(metrics) is not dict:
        return None
    if tuple(metrics) != repeat.keys:
        return None
    values = tuple(metrics.values())
    at = repeat.step_at
    if step is not None:
        if at is not None or type(step) is not int:
            return None
        if not next_step <= step <= INT64_MAX:
            return None
    elif at is None:
        step = next_step
        if step > INT64_MAX:  # past the last step int64 holds: refused there
            return None
    else:
        step = values[at]
        if type(step) is not int or not next_step <= step <= INT64_MAX:
            return None
        values = values[1:] if at == 0 else values[:-1]
    if set(map(type, values)) != _FLOATS:
        return None
    total = sum(values, 0.0)  # inf or NaN anywhere makes total - total NaN
    if total - total != 0.0:
        return None
    return _new_row(Row, (step, repeat.names, values, _FINITE, timestamp, "step"))


def queued(row: Row, metrics: dict) -> dict:
    """What the JSONL log's writer queues for ``row``, made by :func:`repeated`
    from ``metrics``: a copy of ``metrics`` without its ``step`` entry, with the
    row's step under the key ``0`` and its time under ``1`` (no metric name is
    an int). Its writer pops both and writes the rest as the line's metrics.

    Why a dict: the queue keeps rows for up to thousands of updates, and a
    dict of numbers is not tracked by the garbage collector, where a
    :class:`Row` (a tuple subclass, which holds an enum member) or any tuple
    holding a dict stays tracked as long as it lives. Every collection then
    walks the queued rows and moves them into the oldest generation, which
    brings on full collections: about 1.4 µs an update (of 10 floats), with
    the log on.

    Examples:
        >>> from jaxhistory._row import queued, repeat_of, repeated, parse_row
        >>> m = {"step": 3, "loss": 0.5}
        >>> repeat = repeat_of(m, parse_row(m))
        >>> later = {"step": 4, "loss": 0.25}
        >>> queued(repeated(repeat, later, 4, 1.5), later)
        {'loss': 0.25, 0: 4, 1: 1.5}
    """
    item = metrics.copy()  # (the caller's dict may change after the update)
    if len(item) != len(row.names):
        del item["step"]
    item[0] = row.step
    item[1] = row.timestamp
    return item
