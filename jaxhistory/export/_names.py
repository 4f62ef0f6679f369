"""Metric names in places that restrict them: netCDF variables and file names."""

from __future__ import annotations

import re
import urllib.parse
import zlib

__all__ = ["decode_netcdf", "encode_netcdf", "file_stems"]

# netCDF-4 names may hold any UTF-8 except "/", must start with a letter, a digit,
# "_" or a multi-byte character, and must not end in whitespace. The encoding
# percent-encodes "%", "/", control characters, a leading "_" and trailing
# whitespace, then prefixes "_" where the result starts with anything else.
_ESCAPE = re.compile(r"[%/\x00-\x1f\x7f]")


def _quote(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode())


def encode_netcdf(name: str) -> str:
    """A netCDF-safe variable name that :func:`decode_netcdf` turns back into ``name``.

    Example:
        >>> from jaxhistory.export import encode_netcdf, decode_netcdf
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

    Example:
        >>> from jaxhistory.export import file_stems
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
            stem = (
                f"{stem}-{zlib.crc32(n.encode()):08x}"
                if stem
                else (f"metric-{zlib.crc32(n.encode()):08x}")
            )
        out[n] = stem
    return out
