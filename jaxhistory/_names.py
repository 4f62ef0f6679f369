"""Metric names: one flatten for everything the host records, name rules, and
names in places that restrict them (netCDF variables, file names).

A metric's name is the ``/``-joined path of its leaf in what the user passed
(``{"train": {"loss": x}}`` gives ``"train/loss"``; list items are named by their
index). Cross-device statistics of a metric are ``{name}/{stat}`` for each stat in
:data:`STATS`.
"""

from __future__ import annotations

import functools
import numbers
import re
import urllib.parse
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "COUNTER_KEYS",
    "MAX_DEPTH",
    "PROVENANCE",
    "STATS",
    "STEP_KEYS",
    "WATCH_STATS",
    "aggregated_names",
    "check_depth",
    "check_nul",
    "check_text",
    "decode_netcdf",
    "empty_name",
    "encode_netcdf",
    "file_stems",
    "flatten",
    "named_leaves",
    "path_name",
    "printable",
    "stat_names",
]

STATS = ("mean", "max", "min", "std")
# What jaxhistory.watch computes per leaf (and over every leaf together).
WATCH_STATS = ("norm", "rms", "max_abs", "zero_frac", "nonfinite", "mean", "std")
# With provenance: the device holding the max, the min and the first NaN.
PROVENANCE = ("argmax", "argmin", "nan_device")
STEP_KEYS = ("step", "iter")  # an entry with one of these names is the step
COUNTER_KEYS = ("step", "epoch", "iter")  # shown first, as integers
_CONTAINERS = (list, tuple)
MAX_DEPTH = 100  # levels of nesting in a metrics tree
_ATOMS = (jax.Array, np.ndarray, np.generic, numbers.Number, str, bytes)
# control characters, bidirectional-text controls (which reorder what a
# terminal shows) and lone surrogates (not text: no file can hold them)
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)


def printable(name: object) -> str:
    """``name`` with control characters (a terminal escape ``\\x1b``, a newline,
    a bell) written as ``\\xNN``: how a metric name is shown on a terminal (the
    summary line, the console sink), where it could otherwise clear the screen
    or break the line.

    Examples:
        >>> from jaxhistory._names import printable
        >>> printable("loss\\x1b[2J")
        'loss\\\\x1b[2J'
    """
    text = str(name)
    if text.isprintable():
        return text
    return _CONTROL.sub(_escaped, text)


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def check_text(names: Any) -> None:
    """Raises ValueError naming the first of ``names`` (str) that is not text
    every file can hold: one with a lone surrogate (``"\\udc80"``, as
    ``os.fsdecode`` makes of undecodable bytes), which UTF-8 cannot encode."""
    joined = "".join(names)
    if joined.isascii():
        return
    try:
        joined.encode("utf-8")
    except UnicodeEncodeError:
        for name in names:
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"metric name {printable(name)!r} holds a lone surrogate, "
                    "which no log or dataset can store; decode the name's "
                    "bytes first (errors='replace')"
                ) from None


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_name(path: Sequence[Any]) -> str:
    """The ``/``-joined name of a pytree key path (``""`` for a bare leaf)."""
    return "/".join(_key_name(k) for k in path)


def check_depth(tree: Any, what: str = "metrics") -> None:
    """Raises ValueError if ``tree`` nests more than :data:`MAX_DEPTH` levels.

    The walk keeps its own stack (no recursion) and opens one level of a node
    at a time, so any depth, and a container that holds itself, is refused
    cleanly. ``what`` names the tree in the message (``"weights"``).
    """
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        children = _children(node)
        if not children:
            continue
        if depth >= MAX_DEPTH:
            _too_deep(what)
        stack.extend((child, depth + 1) for child in children)


def _too_deep(what: str) -> None:
    raise ValueError(
        f"{what} nest more than {MAX_DEPTH} levels deep; jaxhistory takes "
        f"trees at most {MAX_DEPTH} levels deep: flatten the nesting (join "
        "the keys with '/')"
    )


def _children(node: Any) -> list | tuple:
    """The subtrees one level below ``node`` (empty for a leaf)."""
    kind = type(node)
    if kind is dict:
        return list(node.values())
    if kind is list or kind is tuple:
        return node
    if node is None or isinstance(node, _ATOMS):
        return ()
    children = jax.tree_util.tree_leaves(
        node, is_leaf=lambda x: x is not node and x is not None
    )
    return () if len(children) == 1 and children[0] is node else children


def _check_unique(pairs: list[tuple[str, Any]]) -> None:
    check_text([name for name, _ in pairs])
    if len({name for name, _ in pairs}) != len(pairs):
        seen = set()
        for name, _ in pairs:
            if name in seen:
                raise ValueError(f"two metrics are both named {name!r}")
            seen.add(name)


def named_leaves(
    tree: Any, refuse_none: bool = False
) -> tuple[list[tuple[str, Any]], Any]:
    """``[(name, leaf)]`` of a pytree and its treedef; duplicate names raise.

    ``refuse_none``: a ``None`` (which JAX treats as an empty subtree, so it
    would vanish without a word) raises TypeError naming it. A tree nested more
    than :data:`MAX_DEPTH` levels raises ValueError before anything walks it.
    """
    check_depth(tree)
    if refuse_none:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
    else:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = [(path_name(path), value) for path, value in pairs]
    if refuse_none:
        for name, value in out:
            if value is None:
                raise TypeError(
                    f"metric {name or '<root>'!r} is None; metrics must be numbers "
                    "or numeric arrays"
                )
    _check_unique(out)
    return out, treedef


def check_nul(names: Any) -> None:
    """Raises ValueError naming the first of ``names`` that holds a NUL
    character: netCDF stores a name kept as text as a C string, cut there.
    (Only recorded names: the packed names of one collective start with NUL
    on purpose.)"""
    if "\x00" in "".join(names):
        for name in names:
            if "\x00" in name:
                raise ValueError(
                    f"metric name {printable(name)!r} holds a NUL character, at "
                    "which a netCDF file cuts the name (another metric's, or "
                    "none): remove it"
                )


def empty_name() -> None:
    """Raises the ValueError for a metric whose name is ``""``."""
    raise ValueError("a metric name is empty (the key ''): give every value a name")


def _is_none(x: Any) -> bool:
    return x is None


def _items(metrics: Mapping, prefix: str, out: list, depth: int = 0) -> bool:
    """Appends the leaves of plain nested dicts; False if a list/tuple shows up.
    A dict ``depth`` levels down holding another at :data:`MAX_DEPTH` raises
    ValueError (before Python's stack runs out)."""
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if type(value) is dict:
            if value and depth + 1 >= MAX_DEPTH:
                _too_deep("metrics")
            if not _items(value, name + "/", out, depth + 1):
                return False
        elif type(value) in _CONTAINERS:
            return False
        else:
            out.append((name, value))
    return True


def flatten(metrics: Any) -> list[tuple[str, Any]]:
    """Named leaves of ``metrics``: ``[("train/loss", x), ...]``.

    Plain nested dicts take a fast path; any other pytree goes through
    ``jax.tree_util``. Raises ValueError when two leaves get the same name or
    the tree nests more than :data:`MAX_DEPTH` levels, and TypeError for a bare
    leaf (it has no name).

    Examples:
        >>> from jaxhistory._names import flatten
        >>> flatten({"train": {"loss": 0.5}, "lr": 1e-3})
        [('train/loss', 0.5), ('lr', 0.001)]
        >>> flatten({"lr": [1e-3, 2e-3]})  # other pytrees: jax.tree_util's order
        [('lr/0', 0.001), ('lr/1', 0.002)]
    """
    out: list[tuple[str, Any]] = []
    if not (isinstance(metrics, Mapping) and _items(metrics, "", out)):
        out = named_leaves(metrics)[0]
        if any(not name for name, _ in out):
            raise TypeError("metrics must be a dict (or other pytree) of named values")
        return out
    _check_unique(out)
    return out


@functools.lru_cache(maxsize=1024)
def stat_names(
    names: tuple[str, ...], prefix: str = "", rows: tuple[str, ...] = STATS
) -> tuple[str, ...]:
    """``{prefix}{name}/{stat}`` for each cell of a ``(len(rows), K)`` table of
    statistics (or of :data:`PROVENANCE`), in C order (all means, then all
    maxes, ...); an empty name gives ``{prefix}{stat}``. Cached: the same names
    are asked for at every update."""
    return tuple(
        f"{prefix}{n}/{s}" if n else f"{prefix}{s}" for s in rows for n in names
    )


_ORDER = {s: i for i, s in enumerate(("mean", "std", "min", "max", *PROVENANCE))}


@functools.lru_cache(maxsize=256)
def grouped(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` with each metric's rows together: ``name`` itself, then
    ``name/mean``, ``/std``, ``/min``, ``/max`` and its device indices (a
    multi-metric ``Stats`` records all means, then all maxes, ...); metrics in
    order of first appearance. Cached: the same names come at every update."""
    families: dict[str, list[str]] = {}
    for n in names:
        base, _, stat = n.rpartition("/")
        families.setdefault(base if base and stat in _ORDER else n, []).append(n)
    out: list[str] = []
    for base, members in families.items():
        out += sorted(
            members, key=lambda n: -1 if n == base else _ORDER[n[len(base) + 1 :]]
        )
    return tuple(out)


def aggregated_names(names) -> set[str]:
    """The names that belong to a complete ``name/{mean,max,min,std}`` group,
    with the group's :data:`PROVENANCE` names where recorded."""
    names = set(names)
    out: set[str] = set()
    for name in names:
        base, _, stat = name.rpartition("/")
        if stat == "mean" and all(f"{base}/{s}" in names for s in STATS):
            out.update(f"{base}/{s}" for s in STATS)
            out.update(f"{base}/{s}" for s in PROVENANCE if f"{base}/{s}" in names)
    return out


# netCDF-4 names may hold any UTF-8 except "/", must start with a letter, a digit,
# "_" or a multi-byte character, and must not end in whitespace. The encoding
# percent-encodes "%", "/", control characters, a leading "_" and trailing
# whitespace, then prefixes "_" where the result starts with anything else.
_ESCAPE = re.compile(r"[%/\x00-\x1f\x7f]")


def _quote(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode())


def encode_netcdf(name: str) -> str:
    """A netCDF-safe variable name that :func:`decode_netcdf` turns back into ``name``.

    Examples:
        >>> from jaxhistory._names import encode_netcdf, decode_netcdf
        >>> encode_netcdf("train/loss"), decode_netcdf("train%2Floss")
        ('train%2Floss', 'train/loss')
    """
    out = _ESCAPE.sub(lambda m: _quote(m.group()), name)
    if out and out[-1].isspace():
        out = out[:-1] + _quote(out[-1])
    if out.startswith("_"):
        out = "%5F" + out[1:]  # so that a leading "_" always marks the prefix below
    if not out or not (out[0].isalnum() or ord(out[0]) > 127):
        out = "_" + out
    return out


def decode_netcdf(name: str) -> str:
    """The metric name encoded by :func:`encode_netcdf`."""
    if name.startswith("_"):
        name = name[1:]
    return urllib.parse.unquote(name, errors="strict")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def file_stems(names) -> dict[str, str]:
    """A distinct, safe file stem for each name.

    Runs of characters other than letters, digits, ``.``, ``_`` and ``-`` become
    ``_`` (so ``../../x`` cannot leave the folder and ``a/b`` is ``a_b``); leading
    dots and dashes go. Where two names would share a stem (also ignoring case, for
    case-insensitive file systems) or a stem is empty, each gets the CRC-32 of its
    name appended.

    Examples:
        >>> from jaxhistory._names import file_stems
        >>> file_stems(["train/loss", "../../x"])
        {'train/loss': 'train_loss', '../../x': 'x'}
        >>> file_stems(["a/b", "a_b"])
        {'a/b': 'a_b-07f4401c', 'a_b': 'a_b-28cb39ea'}
    """
    names = list(dict.fromkeys(names))
    base = {n: _UNSAFE.sub("_", n).lstrip("._-")[:100] for n in names}
    seen: dict[str, int] = {}
    for stem in base.values():
        seen[stem.casefold()] = seen.get(stem.casefold(), 0) + 1
    out = {}
    for n, stem in base.items():
        if not stem or seen[stem.casefold()] > 1:
            crc = zlib.crc32(n.encode("utf-8", "surrogatepass"))
            stem = f"{stem}-{crc:08x}" if stem else f"metric-{crc:08x}"
        out[n] = stem
    # a stem with its CRC appended may be another name's plain stem ("a/b" and
    # a metric named "a_b-07f4401c"): the later one takes a number as well
    taken: set[str] = set()
    for n, stem in out.items():
        unique, k = stem, 1
        while unique.casefold() in taken:
            k += 1
            unique = f"{stem}-{k}"
        taken.add(unique.casefold())
        out[n] = unique
    return out
