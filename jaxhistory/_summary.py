"""The summary line History returns: ``step=42 loss=0.123457 acc=0.910000``."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxhistory._compiled import speedups
from jaxhistory._host_copies import host_copies
from jaxhistory._memory import MemorySample
from jaxhistory._names import COUNTER_KEYS, STATS, printable
from jaxhistory._provenance import device_label
from jaxhistory._row import Row, RowKind
from jaxhistory._stats import Stats

__all__ = [
    "NonfiniteWatch",
    "SummaryLine",
    "fixed",
    "memory_token",
    "nonfinite_notes",
    "summary_line",
]


def nonfinite_notes(stats: Stats, prefix: str = "") -> dict[str, str]:
    """``{metric: "NaN on device 3 (process 1)"}`` for every metric of a
    host-side ``stats`` whose statistics are not all finite; the device comes
    from its provenance (``nan_device``, else the device of an infinite max or
    min) and is left out when unknown."""
    if stats.rows[:4] != STATS:  # watch(): its nonfinite row counts them
        return {}
    table = np.asarray(stats.table, np.float64)[:4]  # (quantiles after them)
    if np.isfinite(table).all():
        return {}
    where = None if stats.where is None else np.asarray(stats.where)
    notes = {}
    for col, metric in enumerate(stats.names):
        mean, mx, mn, _ = table[:, col]
        if np.isfinite(table[:, col]).all():
            continue
        if math.isnan(mx):
            what, row = "NaN", 2
        elif mx == math.inf:
            what, row = "inf", 0
        elif mn == -math.inf:
            what, row = "-inf", 1
        else:  # finite values whose mean or std overflowed
            what, row = ("inf" if mean > 0 else "-inf" if mean < 0 else "NaN"), None
        device = None if where is None or row is None else int(where[row, col])
        if device is not None and device >= 0:
            what += f" on {device_label(device)}"
        name = f"{prefix}{metric}" if metric else prefix.rstrip("/") or "<stats>"
        notes[name] = what
    return notes


class NonfiniteWatch:
    """Warns once per metric when its cross-device statistics turn NaN or
    infinite, naming the step, the metric and the device with its process.
    Called with host values by the summary line and by the background writer,
    whichever sees them first."""

    def __init__(self):
        self._lock = threading.Lock()
        self.warned: set[str] = set()

    def check(self, step: int, stats: Stats, prefix: str = "") -> dict[str, str]:
        notes = nonfinite_notes(stats, prefix)
        if not notes:
            return notes
        with self._lock:
            new = {k: v for k, v in notes.items() if k not in self.warned}
            self.warned.update(new)
        kept = (
            " ({name}/nan_device, /argmax and /argmin keep the devices)"
            if stats.where is not None
            else ""
        )
        for name, what in new.items():
            where = kept.format(name=printable(name))
            warnings.warn(
                f"step {step}: {name!r} is {what}{where}; later "
                f"non-finite values of {name!r} are recorded without a warning",
                RuntimeWarning,
                stacklevel=2,
            )
        return notes


def _mean(arr: np.ndarray) -> Any:
    """The mean of ``arr`` without NumPy's warnings (inf and -inf together are
    NaN; a sum past the largest float is taken in parts), which under -W error
    would make ``update`` raise after recording."""
    with np.errstate(all="ignore"):
        mean = arr.mean()
        if arr.dtype.kind == "f" and not np.isfinite(mean) and np.isfinite(arr).all():
            mean = (arr / arr.size).sum()
    return mean


def fixed(value: float, precision: int) -> str:
    """``value`` with ``precision`` decimals, as the summary line shows a
    float; in scientific notation (e-notation) with as many decimals where
    those would show none of its digits (``3e-08``: ``3.000000e-08``, not
    ``0.000000``). Zero stays ``0.000000``."""
    text = f"{value:.{precision}f}"
    if value != 0.0 and not text.strip("-0.") and math.isfinite(value):
        return f"{value:.{precision}e}"
    return text


def _shows_zero(values: Sequence, below: float) -> bool:
    """Whether a float among ``values`` is nonzero and below ``below`` in
    magnitude (``10**-precision``: one the decimals may show as zero)."""
    return any(type(v) is float and 0.0 < abs(v) < below for v in values)


def _format(value: Any, precision: int, counter: bool) -> str:
    if type(value) is float and not counter:
        return fixed(value, precision)
    if type(value) is int:
        return str(value)
    arr = np.asarray(value)
    if arr.dtype == object:  # adds like a float, yet is none: stored as NaN
        try:
            arr = np.asarray(arr, np.float64)
        except (TypeError, ValueError):
            return "nan"
    if arr.ndim:
        if arr.size <= 4:
            return "[" + ",".join(_format(v, precision, counter) for v in arr) + "]"
        return f"{_format(_mean(arr), precision, False)}(mean of {arr.size})"
    if counter or arr.dtype.kind in "iub":
        if arr.dtype.kind == "f":
            value = float(arr)
            if not math.isfinite(value) or not value.is_integer():
                return f"{value:g}"  # epoch=1.5, not epoch=1
        return str(int(arr))
    return fixed(float(arr), precision)


def summary_line(
    step: tuple[str, int],
    items: Sequence[tuple[str, Any]],
    precision: int,
    first: Sequence[str] = (),
    host: bool = False,
    watch: NonfiniteWatch | None = None,
) -> str:
    """``{label}={step}`` then each item: counters (``step``, ``epoch``,
    ``iter``) as integers, then the names in ``first``, then the rest in order.

    A :class:`~jaxhistory.Stats` value shows each of its metrics as its mean with
    the std inlined, ``loss=0.123457(±0.002100)``. Control characters in names
    are shown as ``\\xNN``. Device values are fetched (this waits for them).
    ``host``: every value is a Python number.
    """
    parts = {step[0]: str(step[1])}
    if host:  # Python floats and ints only: no conversions
        for name, value in items:
            if type(value) is float and name not in COUNTER_KEYS:
                parts[name] = fixed(value, precision)
            else:
                parts[name] = _format(value, precision, name in COUNTER_KEYS)
    else:
        device = [(n, v) for n, v in items if isinstance(v, jax.Array | Stats)]
        values = dict(items)
        if device:
            rest: dict[str, Any] = {}
            for name, value in device:  # scalars sent in a stacked transfer
                read = host_copies.read(value) if type(value) is not Stats else None
                if read is None:
                    rest[name] = value
                else:
                    values[name] = read
            if rest:  # the others' copies started together, then read
                values.update(jax.device_get(rest))
        for name, _ in items:
            value = values[name]
            if isinstance(value, Stats) and value.rows[:4] != STATS:
                # watch(): the statistics over every leaf together (the last
                # column) stand for the rest, which only the history holds
                table = np.asarray(value.table, np.float64)
                base = "/".join(p for p in (name, value.names[-1]) if p)
                for i, stat in enumerate(value.rows):
                    key = f"{base}/{stat}" if base else stat
                    value = float(table[i, -1])
                    if stat == "nonfinite" and math.isfinite(value):
                        parts[key] = str(int(value))  # a count
                    else:
                        parts[key] = _format(value, precision, False)
            elif isinstance(value, Stats):
                prefix = f"{name}/" if name else ""
                notes = (
                    watch.check(step[1], value, prefix)
                    if watch is not None
                    else nonfinite_notes(value, prefix)
                )
                for metric in value.names:
                    key = f"{name}/{metric}" if name and metric else name or metric
                    mean = float(value[f"{metric}/mean" if metric else "mean"])
                    std = float(value[f"{metric}/std" if metric else "std"])
                    if key in notes:
                        parts[key] = f"{fixed(mean, precision)}({notes[key]})"
                    else:
                        parts[key] = (
                            f"{fixed(mean, precision)}(±{fixed(std, precision)})"
                        )
            else:
                parts[name] = _format(value, precision, name in COUNTER_KEYS)
    head = [k for k in COUNTER_KEYS if k in parts]
    head += [k for k in first if k in parts and k not in head]
    order = head + [k for k in parts if k not in head]
    return " ".join(f"{printable(k)}={parts[k]}" for k in order)


class SummaryLine:
    """Formats History's summary lines.

    Rows of Python numbers (the common case) are formatted by one ``%``-format
    with a template made once per (names, value types, precision); anything
    else goes through :func:`summary_line`.
    """

    def __init__(self, first: Sequence[str] = (), watch: NonfiniteWatch | None = None):
        self.first = tuple(first)
        self.watch = watch
        # (label, names, precision, kinds) -> (template, the order of the
        # values in it or None, the text of a float shown as zero,
        # 10**-precision), or None where a row needs summary_line
        self._templates: dict[tuple, tuple | None] = {}
        # ((label, precision, kinds), names, template) of the last host row
        self._last: tuple = (None, None, None)
        # (names, precision, its _templates entry, the line's text between the
        # numbers for the compiled form or None) of the last row of finite
        # floats at a "step" whose values are shown in their order
        self._floats: tuple = (None, None, None, None)

    def format_floats(self, row: Row, precision: int) -> str:
        """:meth:`format` for a row of finite floats (``FINITE_FLOATS``) at a
        ``step``; the template of the last such row is reused while the names
        (the same tuple) and ``precision`` stay."""
        names, cached, entry, pieces = self._floats
        if row[1] is names and precision == cached:
            if pieces is not None:  # the compiled form of the template
                line = speedups.fixed_line(pieces, row[0], row[2], precision)
                return self._general(row, precision) if line is None else line
            template, _, zero, below = entry
            line = template % (row[0], *row[2])
            if zero in line and _shows_zero(row[2], below):
                return self._general(row, precision)  # fixed(): e-notation
            return line
        line = self.format(row, precision)
        head, last_names, entry = self._last  # (one read: other threads format)
        if (
            head == ("step", precision, True)
            and last_names == row[1]
            and entry is not None
            and entry[1] is None
        ):
            self._floats = (row[1], precision, entry, _pieces(row[1]))
        return line

    def format(self, row: Row, precision: int) -> str:
        """The summary line of ``row`` with ``precision`` decimals."""
        names, values, kind, label = row.names, row.values, row.kind, row.label
        if kind is not RowKind.VALUES:  # Python numbers: one %-format
            last_head, last_names, entry = self._last
            floats = kind >= RowKind.FLOATS
            if (
                not floats
                or names is not last_names  # (rows parsed alike share one tuple)
                or last_head != (label, precision, True)
            ):
                kinds = (float,) * len(values) if floats else tuple(map(type, values))
                head = (label, precision, floats or kinds)
                if head != last_head or names != last_names:
                    key = (label, names, precision, kinds)
                    entry = self._templates.get(key, False)
                    if entry is False:
                        entry = self._templates[key] = self._template(*key)
                    self._last = (head, names, entry)
            if entry is not None:
                template, order, zero, below = entry
                if order is None:
                    line = template % (row.step, *values)
                else:
                    full = (row.step, *values)
                    line = template % tuple([full[i] for i in order])
                if zero not in line or not _shows_zero(values, below):
                    return line
        return self._general(row, precision)

    def _general(self, row: Row, precision: int) -> str:
        """:meth:`format` without a template."""
        names, values, kind = row.names, row.values, row.kind
        items = list(zip(names, values, strict=True))
        return summary_line(
            (row.label, row.step),
            items,
            precision,
            self.first,
            kind is not RowKind.VALUES,
            self.watch,
        )

    def _template(self, label, names, precision, types):
        """A template for rows of these names and types, the order of the
        values in it (None: step then the row as given) and what tells a float
        shown as zero (see ``_templates``); None where a row needs the general
        path."""
        if len(self._templates) > 256:
            self._templates.clear()  # name sets that keep changing: no cache
        keys = [label, *names]
        if len(set(keys)) != len(keys):
            return None
        specs = ["%d"]
        for name, kind in zip(names, types, strict=True):
            if kind is float:
                if name in COUNTER_KEYS:
                    return None  # counters show as integers
                specs.append(f"%.{precision}f")
            else:
                specs.append("%d")
        head = [k for k in COUNTER_KEYS if k in keys]
        head += [k for k in self.first if k in keys and k not in head]
        shown = head + [k for k in keys if k not in head]
        order = tuple(keys.index(k) for k in shown)
        template = " ".join(
            f"{printable(k).replace('%', '%%')}={specs[i]}"
            for k, i in zip(shown, order, strict=True)
        )
        # A line that shows a nonzero float as zero is made again value by
        # value (fixed() shows it in e-notation). Where the line holds no
        # "0.000000" (one search: "=-0.000000" too; "10.000000" only costs a
        # look at the values), none does.
        zero = f"{0.0:.{precision}f}" if precision else "0"
        order_or_none = None if order == tuple(range(len(keys))) else order
        return template, order_or_none, zero, 10.0**-precision


def _pieces(names: tuple[str, ...]) -> tuple[bytes, ...] | None:
    """The text of a summary line of ``names`` at a ``step`` between its
    numbers, as the compiled ``fixed_line`` takes it; None without it."""
    if speedups is None:
        return None
    try:
        return (b"step=", *(f" {printable(k)}=".encode() for k in names))
    except UnicodeEncodeError:  # (a lone surrogate: the template writes it)
        return None


def memory_token(sample: MemorySample, rss: int, rss_peak: int = 0) -> str:
    """``memory=X.XX/Y.YYGiB``: device memory in use and its peak where the backend
    reports a peak, else host RSS and its peak over the updates so far."""
    if sample.peak is not None:
        now, peak = sample.in_use, sample.peak
    else:
        now, peak = rss, max(rss, rss_peak)
    return f"memory={now / 2**30:.2f}/{peak / 2**30:.2f}GiB"
