"""HistoryState <-> xarray.Dataset, exactly.

Layout: a ``step`` coordinate (the sorted union of every metric's steps), one data
variable per metric under its own name (``loss``, ``train/loss``, ``loss/std``), NaN
where a metric was not recorded. An array metric keeps its shape as extra dimensions
named ``{name}_dim_{i}``. Each variable's attrs hold its original dtype, so
``from_xarray`` restores integers that gaps turned into floats; where a metric both
has gaps and records NaN, a ``_recorded`` mask (dims ``step`` x ``_metric``) tells a
recorded NaN from a missing record. A generated name that a metric already uses
(a metric named ``_recorded``, or ``x_dim_0`` beside an array metric ``x``) gets
``_`` appended until it is free; the mask's names are kept in the dataset's attrs.

Sparse metrics in bulk (more than :data:`LONG_FROM` scalar metrics, each recorded
at fewer than one step in :data:`SPARSE_RATIO`: a metric per sample, say) would
make a huge, mostly-NaN dataset and one netCDF variable each. They are stored
instead in one long table of records: ``_long_step``, ``_long_index`` (into the
``_long_metric`` coordinate of their names) and ``_long_value`` (float64), along
a ``_long`` dimension, with each metric's dtype in ``_long_dtype``. The names used
are kept in the ``jaxhistory_long`` attribute; ``from_dataset`` restores these
metrics exactly, after the others.

The dataset file (:func:`to_tree`, :func:`write_tree`, :func:`from_tree`) holds
the same variables with each metric path as netCDF groups, so plain xarray reads
``train/loss/mean`` as ``xr.open_datatree(path)["train/loss/mean"]``; every group
holds its own copy of the ``step`` coordinate, so a group opened alone,
``xr.open_dataset(path, group="train/loss")``, selects by step too.
"""

from __future__ import annotations

import os
import unicodedata
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhistory._dtypes import INT64_MAX, INT64_MIN, as_steps, numeric_dtype
from jaxhistory._names import decode_netcdf, encode_netcdf, printable
from jaxhistory._optional import import_optional
from jaxhistory._version import __version__

__all__ = [
    "MASK",
    "MASK_DIM",
    "from_dataset",
    "from_tree",
    "read_netcdf",
    "read_state",
    "to_dataset",
    "to_tree",
    "write_tree",
]

# A column: (name, steps, values, storage dtype, record shape)
Column = tuple[str, np.ndarray, np.ndarray, np.dtype, tuple[int, ...]]

DTYPE_ATTR = "jaxhistory_dtype"
NAME_ATTR = "jaxhistory_name"  # a metric's name where the file holds a short one
NC_MAX_NAME = 255  # bytes in a netCDF name
GAPS_ATTR = "jaxhistory_gaps"
MASK = "_recorded"
MASK_DIM = "_metric"
MASK_ATTR = "jaxhistory_mask"
MASK_DIM_ATTR = "jaxhistory_mask_dim"
NEXT_STEP_ATTR = "jaxhistory_next_step"
LONG_ATTR = "jaxhistory_long"
LONG_NAMES = (
    "_long",
    "_long_metric",
    "_long_step",
    "_long_index",
    "_long_value",
    "_long_dtype",
)
LONG_FROM = 256  # sparse scalar metrics in a dataset before they go long
SPARSE_RATIO = 8  # sparse: recorded at fewer than 1 step in this many
_GENERATED_ATTRS = (
    NEXT_STEP_ATTR,
    MASK_ATTR,
    MASK_DIM_ATTR,
    LONG_ATTR,
    "jaxhistory_version",
    "jax_version",
)


def _shown(value: Any) -> str:
    """An attribute's value as a message shows it (arrays as lists, control
    characters escaped, cut to 60 characters)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    return printable(f"{value!r:.60}")


def _text(value: Any, what: str) -> str:
    """The attribute ``what`` (``value``), which must be text: ValueError
    naming it otherwise (a list, a number)."""
    if not isinstance(value, str):
        raise ValueError(f"{what} attribute is {_shown(value)}, not text")
    return str(value)


def _whole(value: Any, what: str, top: int = INT64_MAX) -> int:
    """The attribute ``what`` (``value``), which must be one whole number within
    int64 (up to ``top``): ValueError naming it otherwise (a list, a string,
    2.5)."""
    whole = isinstance(value, int | np.integer)
    if isinstance(value, bool | np.bool_):
        whole = False
    if isinstance(value, float | np.floating):
        whole = bool(np.isfinite(value) and value == np.floor(value))
    if not whole or not INT64_MIN <= int(value) <= top:
        raise ValueError(
            f"{what} attribute is {_shown(value)}, not a whole number within int64"
        )
    return int(value)


def _gaps(value: Any, what: str) -> bool:
    """The attribute ``what`` (``value``): 0 or 1 (a bool too), else a
    ValueError naming it."""
    if isinstance(value, int | np.integer | np.bool_) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{what} attribute is {_shown(value)}, not 0 or 1")


def _fill_dtype(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def to_dataset(
    columns: Iterable[Column], steps: np.ndarray, attrs: dict[str, Any], next_step: int
):
    """The dataset of ``columns`` over the sorted union of their ``steps``."""
    xr = import_optional("xarray", "HistoryState.to_xarray")
    columns = list(columns)
    taken = {"step", *(c[0] for c in columns)}

    def free(base: str) -> str:  # a generated name no metric uses
        return _free(base, taken)

    data_vars, masks = {}, {}
    columns, long = _split_long(columns, len(steps))
    for name, col_steps, values, dtype, shape in columns:
        dims = ("step", *(free(f"{name}_dim_{i}") for i in range(len(shape))))
        gaps = len(col_steps) < len(steps)
        attrs_ = {DTYPE_ATTR: str(dtype), GAPS_ATTR: int(gaps)}
        if not gaps:
            full = np.array(values)
        else:
            where = np.searchsorted(steps, col_steps)
            recorded = np.zeros(len(steps), bool)
            recorded[where] = True
            huge = dtype.kind in "iu" and len(values) and np.abs(values).max() > 2**53
            if huge:
                # float64 would round these integers: keep int64, mark the gaps.
                full = np.zeros((len(steps), *shape), dtype)
                masks[name] = recorded
            else:
                full = np.full((len(steps), *shape), np.nan, _fill_dtype(dtype))
                if dtype.kind == "f" and np.isnan(values).any():
                    masks[name] = recorded
            full[where] = values
        data_vars[name] = xr.Variable(dims, full, attrs=attrs_)
    coords: dict[str, tuple[str, np.ndarray | list]] = {"step": ("step", steps)}
    attrs = dict(attrs)
    if masks:
        mask, mask_dim = free(MASK), free(MASK_DIM)
        coords[mask_dim] = (mask_dim, list(masks))
        data_vars[mask] = xr.Variable(
            ("step", mask_dim), np.stack(list(masks.values()), axis=1)
        )
        attrs.update({MASK_ATTR: mask, MASK_DIM_ATTR: mask_dim})
    if long:
        names = [free(n) for n in LONG_NAMES]
        dim, metric_dim, step_, index_, value_, dtype_ = names
        coords[metric_dim] = (metric_dim, [c[0] for c in long])
        data_vars[step_] = xr.Variable(dim, np.concatenate([c[1] for c in long]))
        data_vars[index_] = xr.Variable(
            dim,
            np.repeat(np.arange(len(long), dtype=np.int32), [len(c[1]) for c in long]),
        )
        data_vars[value_] = xr.Variable(
            dim, np.concatenate([np.asarray(c[2], np.float64) for c in long])
        )
        data_vars[dtype_] = xr.Variable(metric_dim, [str(c[3]) for c in long])
        attrs[LONG_ATTR] = ",".join(names)
    attrs.update(
        {
            NEXT_STEP_ATTR: next_step,
            "jaxhistory_version": __version__,
            "jax_version": jax.__version__,
        }
    )
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


def _split_long(columns: list[Column], n_steps: int) -> tuple[list, list]:
    """(the columns stored one variable each, those stored in the long table)."""
    sparse = [
        i
        for i, (_, col_steps, values, dtype, shape) in enumerate(columns)
        if not shape
        and len(col_steps) * SPARSE_RATIO < n_steps
        and dtype.kind in "biuf"
        and (dtype.kind == "f" or not len(values) or np.abs(values).max() <= 2**53)
    ]
    if len(sparse) <= LONG_FROM:
        return columns, []
    chosen = set(sparse)
    return (
        [c for i, c in enumerate(columns) if i not in chosen],
        [columns[i] for i in sparse],
    )


def _long_names(ds) -> list[str] | None:
    names = ds.attrs.get(LONG_ATTR)
    if names is None:
        return None
    return _text(names, f"the dataset's {LONG_ATTR}").split(",")


def _from_long(ds, names: list[str]) -> dict[str, tuple]:
    if len(names) != len(LONG_NAMES) or not set(names[2:]) <= set(ds.variables):
        raise ValueError(
            f"the dataset's {LONG_ATTR} attribute ({','.join(names)}) does not name "
            "its long table"
        )
    _, metric_dim, step_, index_, value_, dtype_ = names
    variables = ds.variables
    metrics = [str(n) for n in variables[metric_dim].values]
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"the long table's {metric_dim} names a metric twice")
    dtypes = []
    for name, text in zip(metrics, variables[dtype_].values, strict=True):
        try:
            dtypes.append(numeric_dtype(text))
        except ValueError as err:
            raise ValueError(f"metric {name!r} of the long table: {err}") from None
    steps = as_steps(variables[step_].values, f"the long table's {step_}")
    index = as_steps(variables[index_].values, f"the long table's {index_}")
    values = np.asarray(variables[value_].values, np.float64)
    if not len(steps) == len(index) == len(values):
        raise ValueError(f"the long table's {step_}, {index_}, {value_} differ in size")
    if len(index) and (index.min() < 0 or index.max() >= len(metrics)):
        raise ValueError(f"{index_} points past the {len(metrics)} long metrics")
    order = np.argsort(index, kind="stable")
    ends = np.cumsum(np.bincount(index, minlength=len(metrics)))
    starts = ends - np.bincount(index, minlength=len(metrics))
    steps, values, index = steps[order], values[order], index[order]
    back = (steps[1:] <= steps[:-1]) & (index[1:] == index[:-1])
    if back.any():
        name = metrics[index[np.argmax(back)]]
        raise ValueError(
            f"the steps of metric {name!r} in the long table are not strictly "
            "increasing"
        )
    return {
        name: (steps[a:b].copy(), _cast(name, values[a:b], dtype))
        for name, dtype, a, b in zip(metrics, dtypes, starts, ends, strict=True)
    }


def _cast(name: str, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` (of one metric, as a file holds them) as ``dtype``, which
    must hold every one of them exactly where ``dtype`` is an integer one."""
    if dtype.kind in "biu" and values.dtype.kind == "f" and values.size:
        info = np.iinfo(dtype) if dtype.kind != "b" else np.iinfo(np.uint8)
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(values) & (values == np.floor(values))
            ok &= (values >= float(info.min)) & (values < float(info.max) + 1)
        if dtype.kind == "b":
            ok &= (values == 0) | (values == 1)
        if not ok.all():
            bad = values[~ok].reshape(-1)[0].item()
            raise ValueError(f"metric {name!r} is {dtype} but holds {bad!r}")
    elif values.dtype.kind not in "biuf":
        raise ValueError(f"metric {name!r} holds {values.dtype} values, not numbers")
    return values.astype(dtype)


def from_dataset(ds) -> tuple[dict[str, tuple], int, dict[str, Any]]:
    """The columns ``{name: (steps, values)}``, next step and run attrs of a
    dataset made by :func:`to_dataset`; the root group of a dataset file
    (``xr.open_dataset``, which leaves the file's other groups out) is a
    ValueError saying how to read the whole file."""
    if LAYOUT_ATTR in ds.attrs:
        raise ValueError(
            f"this dataset has the {LAYOUT_ATTR} attribute of a dataset file's "
            "root group: xr.open_dataset reads that group only, leaving out the "
            "metrics stored in the file's groups (train/loss, ...). Read the "
            "whole file with HistoryState.from_netcdf(path) or "
            "jaxhistory.export.read_netcdf(path)"
        )
    if "step" not in ds.coords:
        raise ValueError("the dataset has no 'step' coordinate")
    steps = as_steps(ds["step"].values, "the step coordinate")
    back = steps[1:] <= steps[:-1]  # (np.diff could overflow int64)
    if back.any():
        at = int(np.argmax(back))
        raise ValueError(
            "the step coordinate must be strictly increasing, but "
            f"{steps[at]} is followed by {steps[at + 1]}"
        )
    mask_names = _mask_names(ds)
    masks = {}
    if mask_names and mask_names[0] in ds.data_vars:
        mask, mask_dim = mask_names
        names = np.asarray(ds[mask_dim].values).reshape(-1)
        table = np.asarray(ds[mask].values, bool)
        expected = (len(steps), len(names))
        if table.shape != expected:
            raise ValueError(
                f"the mask {printable(mask)!r} (the dataset's {MASK_ATTR}) has "
                f"the shape {table.shape}, not {expected}: a row per step and a "
                f"column per name of its {printable(mask_dim)!r} coordinate"
            )
        masks = {str(n): table[:, i] for i, n in enumerate(names)}
    columns = {}
    long = _long_names(ds)
    long_columns = {} if long is None else _from_long(ds, long)  # checked first
    skip = {*mask_names, *(long or ())}
    variables = ds.variables  # not ds[name]: that builds a DataArray per name
    for name in ds.data_vars:
        if name in skip:
            continue
        var = variables[name]
        if var.dims[0] != "step":
            raise ValueError(f"variable {name!r} is not indexed by step first")
        values = np.asarray(var.values)
        dtype = values.dtype
        its = f"metric {printable(name)!r}: its"
        if DTYPE_ATTR in var.attrs:  # checked before anything of it is made
            text = _text(var.attrs[DTYPE_ATTR], f"{its} {DTYPE_ATTR}")
            try:
                dtype = numeric_dtype(text)
            except ValueError as err:
                raise ValueError(f"{its} {DTYPE_ATTR} {err}") from None
        gaps = _gaps(var.attrs.get(GAPS_ATTR, 0), f"{its} {GAPS_ATTR}")
        if name in masks:
            recorded = masks[name]
        elif gaps and values.dtype.kind == "f":
            # Gaps but no mask: the metric recorded no NaN, so NaN means missing.
            flat = values.reshape(len(steps), -1)
            recorded = ~np.all(np.isnan(flat), axis=1)
        else:
            recorded = np.ones(len(steps), bool)
        kept = np.array(steps[recorded])
        columns[str(name)] = (kept, _cast(str(name), values[recorded], dtype))
    both = long_columns.keys() & columns.keys()
    if both:
        raise ValueError(
            f"metric {min(both)!r} is both a variable and in the long table"
        )
    columns.update(long_columns)
    attrs = {k: v for k, v in ds.attrs.items() if k not in _GENERATED_ATTRS}
    lasts = [int(c[0][-1]) for c in columns.values() if len(c[0])]
    last = max([*lasts, *steps[-1:].tolist()], default=None)
    if NEXT_STEP_ATTR in ds.attrs:
        what = f"the dataset's {NEXT_STEP_ATTR}"
        # (one past int64: a state recorded up to the last step int64 holds)
        next_step = _whole(ds.attrs[NEXT_STEP_ATTR], what, INT64_MAX + 1)
        if last is not None and next_step <= last:
            # an update at next_step would land at or before a recorded step
            raise ValueError(
                f"{what} attribute is {next_step}, not past the last step "
                f"{last}: a state's next step is one past its records at least"
            )
    else:
        next_step = last + 1 if last is not None else 0
    return columns, next_step, attrs


def read_netcdf(path: str | os.PathLike):
    """The dataset in a file written by :func:`jaxhistory.export.to_netcdf`, flat,
    with the metric names as recorded (``train/loss``), as :func:`to_dataset`
    makes it.

    The file is read into memory and closed. A file without the
    ``jaxhistory_layout`` attribute is of the earlier flat layout, which has no
    groups: one whose groups hold variables is a ValueError naming them, never
    read without them.
    """
    xr = import_optional("xarray", "read_netcdf")
    import_optional("netCDF4", "read_netcdf")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset file at {path}")
    try:
        with xr.open_datatree(path, engine="netcdf4") as tree:
            tree = tree.load()
    except (OSError, RuntimeError) as err:  # netCDF's "HDF error" and friends
        raise OSError(
            f"cannot read the dataset {path}: {err} (the file is cut off, damaged "
            "or not netCDF-4)"
        ) from err
    try:
        grouped = _layout(tree.attrs)
        # (else a file of an earlier version: percent-encoded names, no groups)
        if not grouped:
            _check_flat(tree)
        ds = from_tree(tree) if grouped else tree.to_dataset(inherit=False)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    ds.attrs = {
        k: v.item() if isinstance(v, np.generic) else v for k, v in ds.attrs.items()
    }
    if grouped:
        return ds
    variables = ds.variables
    try:  # the metric each variable holds, checked before any is renamed
        keep = {*_mask_names(ds), *(_long_names(ds) or ())}
        _check_once(
            [("step", "step")]
            + [
                (n if n in keep else _flat_name(n, variables[n].attrs), n)
                for n in map(str, ds.data_vars)
            ]
        )
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    ds = renamed(ds, decode_netcdf)
    variables = ds.variables
    long = {
        n: variables[n].attrs[NAME_ATTR]
        for n in ds.data_vars
        if NAME_ATTR in variables[n].attrs
    }
    if long:
        ds = ds.rename(long)
        for name in long.values():
            del ds.variables[name].attrs[NAME_ATTR]
    return ds


def _layout(attrs) -> bool:
    """Whether a file's attributes say it is of the grouped layout (a file
    without the attribute is of the earlier flat one); ValueError for a
    layout this version does not read."""
    if LAYOUT_ATTR not in attrs:
        return False
    what = f"the dataset's {LAYOUT_ATTR}"
    layout = _text(attrs[LAYOUT_ATTR], what)
    if layout != LAYOUT:
        raise ValueError(
            f"{what} attribute is {_shown(layout)}, not {LAYOUT!r}: a layout "
            "this version does not read"
        )
    return True


def _check_flat(tree) -> None:
    """ValueError naming the groups holding variables in a file of the flat
    layout (no groups: its reader would leave them out)."""
    held = [
        node.path.strip("/")
        for node in tree.subtree
        if node is not tree and node.to_dataset(inherit=False).variables
    ]
    if held:
        shown = ", ".join(repr(printable(g)) for g in held[:5])
        more = f" and {len(held) - 5} more" if len(held) > 5 else ""
        raise ValueError(
            f"the file has no {LAYOUT_ATTR} attribute, so it is of the earlier "
            f"flat layout, which has no groups, yet the groups {shown}{more} hold "
            "variables, which that layout would leave out (a file of the grouped "
            f"layout has {LAYOUT_ATTR} = {LAYOUT!r})"
        )


def _flat_name(name: str, attrs) -> str:
    """The metric a variable of a flat file holds: its ``jaxhistory_name``,
    else its own name decoded."""
    given = attrs.get(NAME_ATTR)
    if given is None:
        return decode_netcdf(name)
    return _text(given, f"variable {printable(name)!r}: its {NAME_ATTR}")


def _mask_names(ds) -> tuple[str, ...]:
    """(the mask's name, its dimension's) where ``ds`` has a mask, else ();
    ValueError where the attributes naming it are not text, or name a
    variable that is no mask."""
    if MASK_ATTR in ds.attrs:
        mask = _text(ds.attrs[MASK_ATTR], f"the dataset's {MASK_ATTR}")
        mask_dim = _text(
            ds.attrs.get(MASK_DIM_ATTR, MASK_DIM), f"the dataset's {MASK_DIM_ATTR}"
        )
        var = ds.variables.get(mask)
        if var is not None and var.dims != ("step", mask_dim):
            raise ValueError(
                f"the dataset's {MASK_ATTR} and {MASK_DIM_ATTR} attributes "
                f"({_shown(mask)}, {_shown(mask_dim)}) name no mask: variable "
                f"{_shown(mask)} has the dimensions {_shown(var.dims)}, not "
                f"('step', {_shown(mask_dim)})"
            )
        return mask, mask_dim
    var = ds.variables.get(MASK)
    if var is not None and var.dims == ("step", MASK_DIM):  # an older file's
        return MASK, MASK_DIM
    return ()  # a metric may be named _recorded


def renamed(ds, fn):
    """``ds`` with its metric variables and dimensions renamed by ``fn``."""
    names = {}
    keep = {"step", *_mask_names(ds), *(_long_names(ds) or ())}
    for name in (*ds.data_vars, *ds.dims):
        if name not in keep and fn(str(name)) != name:
            names[name] = fn(str(name))
    return ds.rename(names) if names else ds


# ----- the dataset file: one netCDF group per metric path ------------------------
LAYOUT_ATTR = "jaxhistory_layout"
LAYOUT = "groups"
ORDER_ATTR = "jaxhistory_order"  # a metric's place in the history's order


def _component(part: str) -> str:
    """One part of a metric's path as a netCDF name: encoded, in Unicode's NFC
    form (netCDF normalizes names to it), at most 255 bytes."""
    return _fit(unicodedata.normalize("NFC", encode_netcdf(part)))


def _fit(name: str) -> str:
    """``name``, or ``_h{crc32}`` where it is too long for netCDF."""
    if len(name.encode()) <= NC_MAX_NAME:
        return name
    return f"_h{zlib.crc32(name.encode()):08x}"


def _free(name: str, taken: set[str]) -> str:
    """``name`` with ``_`` appended until ``taken`` does not hold it (as
    :func:`to_dataset` names dimensions in memory); added to ``taken``."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _free_in(name: str, taken: set[str]) -> str:
    """``name`` (hashed where too long for netCDF) with ``_`` appended until
    ``taken`` does not hold it; added to ``taken``."""
    name = _fit(name)
    while name in taken:
        name = _fit(name + "_")
    taken.add(name)
    return name


def to_tree(ds):
    """The ``xarray.DataTree`` a dataset file holds for :func:`to_dataset`'s ``ds``.

    A metric ``a/b/c`` is the variable ``c`` of the group ``a/b``, so plain xarray
    reads it as ``xr.open_datatree(path)["a/b/c"]`` (and ``xr.open_dataset(path,
    group="a/b")["c"]``); metrics without ``/`` and the coordinates (``step``,
    ``time``) are in the root group, whose coordinates every group inherits. Each
    part of a path is :func:`~jaxhistory._names.encode_netcdf`-encoded (a plain
    name stays as it is). Where a name cannot be used as it is (a metric
    ``loss`` beside the group of ``loss/std``: netCDF has one namespace for both;
    a part named like a coordinate, ``x/step``; a part over 255 bytes; two parts
    that are the same name to netCDF) a free one is used instead (``_``
    appended, or ``_h`` and a CRC-32), and a variable whose path no longer spells
    its name has the name in its ``jaxhistory_name`` attribute. Each metric's
    place in the history is in ``jaxhistory_order``.
    """
    xr = import_optional("xarray", "to_netcdf")
    internal = {*_mask_names(ds), *(_long_names(ds) or ())}
    metrics = [str(n) for n in ds.data_vars if n not in internal]
    coords = {str(n) for n in ds.coords}  # inherited by every group
    # The names taken in each group: the coordinates everywhere; in the root,
    # the internal variables too. Groups are named before variables, so a
    # clash renames the one variable, not every metric under the group.
    taken: dict[tuple[str, ...], set[str]] = {(): {*coords, *map(str, internal)}}
    groups: dict[tuple[tuple[str, ...], str], str] = {}
    paths: dict[str, tuple[str, ...]] = {}
    for name in metrics:
        group: tuple[str, ...] = ()
        for part in name.split("/")[:-1]:
            comp = groups.get((group, part))
            if comp is None:
                comp = _free_in(_component(part), taken.setdefault(group, {*coords}))
                groups[group, part] = comp
            group = (*group, comp)
        paths[name] = group
    leaves = {
        name: _free_in(
            _component(name.split("/")[-1]), taken.setdefault(paths[name], {*coords})
        )
        for name in metrics
    }
    # Dimension names unique in the whole tree (a group sees its parents' ones)
    # and apart from every variable's and group's name.
    used_dims = {*map(str, ds.dims)} - {
        d for n in metrics for d in ds.variables[n].dims[1:]
    }
    for names in taken.values():
        used_dims |= names
    nodes: dict[tuple[str, ...], dict[str, Any]] = {}
    for order, name in enumerate(metrics):
        group, leaf = paths[name], leaves[name]
        var = ds.variables[name]
        extra = [_free_in(f"{leaf}_dim_{i}", used_dims) for i in range(var.ndim - 1)]
        attrs = {**var.attrs, ORDER_ATTR: order}
        if "/".join(decode_netcdf(p) for p in (*group, leaf)) != name:
            attrs[NAME_ATTR] = name
        nodes.setdefault(group, {})[leaf] = xr.Variable(
            ("step", *extra), var.data, attrs=attrs
        )
    root = xr.Dataset(
        {n: ds.variables[n] for n in ds.data_vars if n in internal} | nodes.pop((), {}),
        coords=ds.coords,
        attrs={**ds.attrs, LAYOUT_ATTR: LAYOUT},
    )
    tree = {"/": root}
    tree.update({"/".join(g): xr.Dataset(v) for g, v in nodes.items()})
    return xr.DataTree.from_dict(tree)


def write_tree(tree, path: str | os.PathLike) -> None:
    """Writes :func:`to_tree`'s ``tree`` to a netCDF-4 file at ``path``, each
    group with its own copy of the ``step`` coordinate, so that
    ``xr.open_dataset(path, group="eval")["loss"].sel(step=50)`` selects by
    step (a group opened alone does not see its parents' coordinates). The
    copies are compressed: a few bytes for a run of consecutive steps."""
    packed = {"zlib": True, "shuffle": True, "complevel": 1}
    encoding = {node.path: {"step": packed} for node in tree.subtree if node.parent}
    tree.to_netcdf(
        path, engine="netcdf4", write_inherited_coords=True, encoding=encoding
    )


def from_tree(tree):
    """The flat dataset (metric names with ``/``, as :func:`to_dataset` makes)
    of a tree written by :func:`to_tree`."""
    xr = import_optional("xarray", "read_netcdf")
    root = tree.to_dataset(inherit=False)
    internal = {*_mask_names(root), *(_long_names(root) or ())}
    found = []
    for node in tree.subtree:
        local = node.to_dataset(inherit=False)
        parts = () if node is tree else tuple(node.path.strip("/").split("/"))
        for leaf, var in local.data_vars.items():
            if node is tree and leaf in internal:
                continue
            attrs = dict(var.attrs)
            where = "/".join((*parts, str(leaf)))
            its = f"variable {printable(where)!r}: its"
            name = attrs.pop(NAME_ATTR, None)
            if name is None:
                name = "/".join(decode_netcdf(p) for p in (*parts, str(leaf)))
            else:
                name = _text(name, f"{its} {NAME_ATTR}")
            order = _whole(attrs.pop(ORDER_ATTR, len(found)), f"{its} {ORDER_ATTR}")
            found.append((order, name, var.variable, attrs, where))
    found.sort(key=lambda item: item[0])
    _check_once(
        [("step", "step")]
        + [(n, n) for n in internal if n in root.data_vars]
        + [(name, where) for _, name, _, _, where in found]
    )
    taken = {"step", *(name for _, name, _, _, _ in found)}
    data_vars = {}
    for _, name, var, attrs, _ in found:
        if var.dims[:1] != ("step",):
            raise ValueError(f"variable {name!r} is not indexed by step first")
        dims = (
            "step",
            *(_free(f"{name}_dim_{i}", taken) for i in range(var.ndim - 1)),
        )
        data_vars[name] = xr.Variable(dims, var.data, attrs=attrs)
    for n in internal:
        if n in root.data_vars:
            data_vars[n] = root.variables[n]
    attrs = {k: v for k, v in root.attrs.items() if k != LAYOUT_ATTR}
    return xr.Dataset(data_vars, coords=root.coords, attrs=attrs)


def _check_once(names: Iterable[tuple[str, str]]) -> None:
    """ValueError naming both variables where two of ``(metric name,
    variable)`` give one metric name: reading both would lose one."""
    seen: dict[str, str] = {}
    for name, variable in names:
        other = seen.setdefault(name, variable)
        if other != variable:
            first, second = sorted((other, variable))
            raise ValueError(
                f"the variables {printable(first)!r} and {printable(second)!r} "
                f"both hold the metric {printable(name)!r} (by their {NAME_ATTR} "
                "attribute or their own name); a metric is one variable"
            )


def read_state(path) -> tuple[dict, int, dict]:
    """The columns, next step and attributes of the state saved in the dataset
    file at ``path`` (a crafted or damaged file is a ValueError naming it)."""
    ds = read_netcdf(path)
    for name in ds.data_vars:
        ds.variables[name].attrs.pop("long_name", None)
    try:
        return from_dataset(ds)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
