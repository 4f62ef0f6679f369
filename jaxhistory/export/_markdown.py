"""The markdown report of a run."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxhistory._dtypes import warmup_count
from jaxhistory._env import ENV_LABELS, INFO_LABELS
from jaxhistory._files import atomic_write
from jaxhistory._names import PROVENANCE, aggregated_names, grouped
from jaxhistory._provenance import device_label
from jaxhistory._stragglers import straggler_table
from jaxhistory.export._units import PlotUnit, printable, same_value

if TYPE_CHECKING:
    from jaxhistory._history_state import HistoryState

__all__ = [
    "MAX_CELL",
    "devices_section",
    "environment_section",
    "md_escape",
    "metadata_rows",
    "stats_table",
    "terminal_cell",
    "to_markdown",
]

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|<>~#&])")
TABLE_STATS = ("mean", "std", "median", "min", "max", "last", "nonfinite", "count")
MAX_CELL = 200  # characters of a config or env_info value shown in the report


def metadata_rows(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(key, text)`` rows of a config or env_info (plain JSON data): nested
    dicts give dotted keys (``optimizer.lr``), a list or an empty dict is one
    value as JSON text, a string itself; a text over :data:`MAX_CELL`
    characters is cut there with an ellipsis (the dataset holds it whole).
    Neither is escaped: :func:`md_escape` them for a table."""
    rows: list[tuple[str, str]] = []
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict) and item:
            rows += metadata_rows(item, f"{name}.")
            continue
        text = item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
        if len(text) > MAX_CELL:
            text = text[: MAX_CELL - 1] + "\u2026"
        rows.append((name, text))
    return rows


def environment_section(
    environment: dict[str, Any] | None, env_info: dict[str, Any] | None = None
) -> list[str]:
    """The report's "Environment" table: the environment recorded with every
    run (:data:`~jaxhistory._env.ENV_LABELS`), then the rows of ``env_info``
    that it does not already show with the same value. Names and values are
    escaped."""
    env = environment or {}
    rows = [(label, env[key]) for key, label in ENV_LABELS.items() if key in env]
    for key, text in metadata_rows(env_info or {}):
        if key in ENV_LABELS and str(env.get(key)) == text:
            continue  # shown above
        rows.append((ENV_LABELS.get(key) or INFO_LABELS.get(key) or key, text))
    if not rows:
        return ["Not recorded."]
    lines = ["| | |", "|---|---|"]
    lines += [f"| {md_escape(label)} | {md_escape(value)} |" for label, value in rows]
    return lines


def sentinel_section(events: Sequence[Any]) -> list[str]:
    """The events the run's sentinels found: how many of each kind, and a
    table of the first 50 (step, metric, what)."""
    kinds: dict[str, int] = {}
    for event in events:
        kinds[event.kind] = kinds.get(event.kind, 0) + 1
    counted = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    lines = [f"{len(events)} event(s): {counted}.", ""]
    lines += ["| step | metric | sentinel | what |", "|---:|---|---|---|"]
    for event in list(events)[:50]:
        lines.append(
            f"| {event.step} | {md_escape(event.metric)} | {event.kind} | "
            f"{md_escape(event.detail)} |"
        )
    if len(events) > 50:
        lines += [
            "",
            f"... and {len(events) - 50} more (the JSONL log has the counts).",
        ]
    return lines


def md_escape(text: Any) -> str:
    """``text`` with markdown punctuation backslash-escaped and control
    characters, newlines included, written as ``\\xNN`` (:func:`printable`, as
    the summary line shows them), so that a metric name cannot break a table,
    start a link or send a terminal escape to whoever reads the report, and
    two names that differ by a newline and a space stay two names."""
    line = printable(str(text))
    return _MD_SPECIAL.sub(r"\\\1", line)


def _number(value: Any, nan: str = "-") -> str:
    """A statistic in the table: ``-`` where it has none (NaN: no finite
    value to take it over); ``nan`` gives what a recorded NaN shows as."""
    if isinstance(value, int):
        return str(value)
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return nan
    return f"{value:.6g}"


def terminal_cell(text: Any) -> str:
    """``text`` as a table cell on a terminal: control characters as ``\\xNN``
    (:func:`printable`, as the summary line shows them) and ``|`` escaped, so
    that the columns hold; no other markdown escapes."""
    return printable(str(text)).replace("|", "\\|")


def stats_table(
    state: HistoryState,
    warmup: float = 0,
    summary: dict | None = None,
    escape: Callable[[Any], str] = md_escape,
) -> list[str]:
    """Markdown table rows of run-level statistics per metric after ``warmup``:
    one metric's rows together (``loss/mean``, ``/std``, ``/min``, ``/max``),
    and the metrics that never changed listed once, below the table.
    ``summary``: ``state.summary(warmup)``, where the caller has it already.
    ``escape``: how a name is written (:func:`terminal_cell` for a terminal)."""
    if summary is None:
        summary = state.summary(warmup)
    if not summary:
        return ["No metrics were recorded."]
    header = "| metric | " + " | ".join(TABLE_STATS) + " |"
    rows = [header, "|---|" + "---:|" * len(TABLE_STATS)]
    where = _provenance_names(state.keys)
    held = _constant_groups(summary)
    constants = [f"{escape(base)} = {_number(v)}" for base, v in held.items()]
    for name in grouped(tuple(summary)):
        stats = summary[name]
        if name in where or name.rpartition("/")[0] in held:
            continue  # device indices: in the devices section; constants: below
        if _constant(stats):
            constants.append(f"{escape(name)} = {_number(stats['last'])}")
            continue
        # (the last record is a value as recorded: a NaN shows as nan, as an
        # inf shows as inf; the other statistics are over finite values)
        cells = " | ".join(
            _number(stats[s], "nan" if s == "last" else "-") for s in TABLE_STATS
        )
        rows.append(f"| {escape(name)} | {cells} |")
    if len(rows) == 2:
        rows = []
    if constants:
        rows += ["", "Constant (the same at every record): " + ", ".join(constants)]
    return rows


def _constant(stats: dict) -> bool:
    """Whether a metric's summary shows one value at every record (to within a
    few float32 roundings: :func:`same_value`; integers, whose extremes the
    summary holds as ints, exactly)."""
    if type(stats["min"]) is int:
        return stats["count"] >= 2 and stats["min"] == stats["max"]
    return bool(
        stats["count"] >= 2
        and not stats["nonfinite"]
        and same_value(stats["min"], stats["max"])
    )


def _constant_groups(summary: dict) -> dict[str, float]:
    """``{name: value}`` for each metric with cross-device statistics whose
    mean, min and max are all one value at every record (a host scalar of a
    multi-process run: its std is a rounding error); listed once, as a
    constant, instead of four rows."""
    out = {}
    for name in summary:
        base, _, stat = name.rpartition("/")
        if stat != "mean" or base in out:
            continue
        found = [summary.get(f"{base}/{s}") for s in ("mean", "min", "max", "std")]
        parts = [p for p in found if p is not None]
        if len(parts) < len(found) or not all(map(_constant, parts[:3])):
            continue
        value = parts[0]["mean"]
        lows = [p["min"] for p in parts[:3]]
        highs = [p["max"] for p in parts[:3]]
        if same_value(min(lows), max(highs), value if value else None):
            out[base] = value
    return out


def _plot_sections(summary: dict, images: list) -> list[str]:
    """The report's plots, one section per family: the train-vs-eval figures,
    then each first part of a metric path (``train``, ``eval``, ``timing``) in the
    order first recorded, then the metrics without one. ``images`` holds paths,
    ``(title, path)`` pairs, or ``(unit, path)`` pairs (a
    :class:`~jaxhistory.export._units.PlotUnit`: a comparison is told by its
    lines, never by its title, which a metric may have too); constants are left
    out (the table lists them). ``summary``: the run's statistics
    (:meth:`HistoryState.summary`)."""
    families: dict[str, list[str]] = {}
    held = _constant_groups(summary)
    for item in images:
        key, image = item if isinstance(item, tuple) else (None, item)
        unit = key if isinstance(key, PlotUnit) else None
        title = unit.title if unit is not None else key
        if unit is not None:
            compared = bool(unit.others)
        else:  # a title alone: a comparison is told by its title
            compared = title is not None and ": " in title and " vs " in title
        # A comparison is never one constant metric; a title alone cannot
        # tell it from a metric named like it, a unit can.
        one_metric = title is not None and (unit is None or not compared)
        if one_metric and (
            title in held or (title in summary and _constant(summary[title]))
        ):
            continue  # its value is listed once, below the table
        if title is None:
            family = ""
        elif compared:  # a comparison, e.g. train vs eval
            family = title.split(": ", 1)[1]
        else:
            family = title.split("/", 1)[0] if "/" in title else "other"
        families.setdefault(family, []).append(image)
    order = sorted(families, key=lambda f: (" vs " not in f, f == "other"))
    lines = []
    for family in order:
        if family:
            lines += [f"### {md_escape(family)}", ""]
        for image in families[family]:
            lines += [f"![{md_escape(Path(image).stem)}](<{image}>)", ""]
    return lines


def _provenance_names(keys) -> set[str]:
    grouped = aggregated_names(keys)
    return {n for n in grouped if n.rpartition("/")[2] in PROVENANCE}


def devices_section(state: HistoryState) -> list[str]:
    """Markdown lines naming, for each metric with device indices, the device
    that most often held its max and its min, and where it first went NaN.
    Processes are named while the run's devices are known (in the run). A
    metric whose devices all held one value at every step (a host scalar every
    process records, such as a learning rate) is left out: no device stands out."""
    here = jax.process_count() > 1

    def label(index: int) -> str:
        return device_label(index) if here else f"device {index}"

    lines = []
    for name in sorted(_provenance_names(state.keys)):
        base, _, stat = name.rpartition("/")
        if stat != "argmax" or _agreed(state, base):
            continue
        parts = []
        for which, key in (("max", "argmax"), ("min", "argmin")):
            values = np.asarray(state.values(f"{base}/{key}"))
            values = values[values >= 0]
            if len(values):
                found, counts = np.unique(values, return_counts=True)
                top = int(np.argmax(counts))
                parts.append(
                    f"{which} most often on {label(int(found[top]))} "
                    f"({int(counts[top])} of {len(values)} steps)"
                )
        nan_key = f"{base}/nan_device"
        if nan_key in state.keys:
            values = np.asarray(state.values(nan_key))
            hit = np.flatnonzero(values >= 0)
            if len(hit):
                step = int(state.steps(nan_key)[hit[0]])
                parts.append(
                    f"first NaN at step {step} on {label(int(values[hit[0]]))} "
                    f"({len(hit)} step(s) with NaN)"
                )
            else:
                parts.append("no NaN")
        lines.append(f"- {md_escape(base)}: " + "; ".join(parts))
    return lines


def _agreed(state: HistoryState, base: str) -> bool:
    """Whether every step's max and min of ``base`` are one value (to within
    :func:`same_value`), with no NaN anywhere."""
    if f"{base}/max" not in state.keys or f"{base}/min" not in state.keys:
        return False
    hi = np.asarray(state.values(f"{base}/max"), np.float64)
    lo = np.asarray(state.values(f"{base}/min"), np.float64)
    if hi.shape != lo.shape or not hi.size or hi.ndim != 1:
        return False
    nan_key = f"{base}/nan_device"
    if nan_key in state.keys and (np.asarray(state.values(nan_key)) >= 0).any():
        return False
    return all(same_value(a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True))


def _relative(path: str | os.PathLike, here: Path) -> str:
    return Path(os.path.relpath(path, here)).as_posix()


def to_markdown(
    state: HistoryState,
    path: str | os.PathLike,
    warmup: float = 0,
    run_id: str | None = None,
    environment: dict[str, Any] | None = None,
    images: Sequence[str | os.PathLike | tuple[str | PlotUnit, str | os.PathLike]] = (),
    terminal_plots: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    files: Sequence[str | os.PathLike] = (),
    unplotted: Sequence[tuple[str, int | None]] = (),
    run_name: str | None = None,
    events: Sequence[Any] = (),
    per_layer: Sequence[tuple] = (),
    config: dict[str, Any] | None = None,
    env_info: dict[str, Any] | None = None,
) -> Path:
    """Writes the run's markdown report to ``path``; returns it.

    Sections: a header (the run name given, else its id; the id; when, steps,
    metrics, warmup dropped), the
    environment, a table of run-level statistics per metric after ``warmup``
    (mean, std, median, min, max, last, non-finite count, count), each image
    embedded by a link relative to the report (``images``: paths, or ``(title,
    path)`` pairs, which are grouped per family: train vs eval first, then by
    the first part of the metric path; constants are left out), the terminal
    plots in fenced blocks (``terminal_plots``: title -> text, or ``(title,
    text)`` pairs where two plots share a title), the metrics left out of the
    plots (``unplotted``:
    ``(title, cap)`` pairs), and the list of output ``files``. Names are escaped
    so ``|`` or ``*`` in a metric name cannot break the markdown.

    ``env_info`` (plain JSON data) adds rows to the environment table; a
    ``config`` (plain JSON data, see
    :func:`~jaxhistory._env.plain_metadata`) gets a "Config" section after it,
    one row per value (``optimizer.lr``); keys and values are escaped like
    metric names.
    """
    path = Path(path)
    here = path.parent
    steps = state.all_steps()
    dropped = warmup_count(warmup, len(steps))
    lines = [f"# Run report: {md_escape(run_name or run_id or 'run')}", ""]
    if run_name and run_id and run_id != run_name:
        lines.append(f"- run id: {md_escape(run_id)}")
    when = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    lines.append(f"- written: {when}")
    if len(steps):
        lines.append(
            f"- steps: {int(steps[0])} to {int(steps[-1])} ({len(steps)} recorded)"
        )
    else:
        lines.append("- steps: none recorded")
    lines.append(f"- metrics: {len(state.keys)}")
    lines.append(f"- warmup: first {dropped} step(s) left out of the statistics")
    lines += ["", "## Environment", ""]
    lines += environment_section(environment, env_info)
    if config is not None:
        lines += ["", "## Config", ""]
        rows = metadata_rows(config)
        if rows:
            lines += ["| key | value |", "|---|---|"]
            lines += [f"| {md_escape(k)} | {md_escape(v)} |" for k, v in rows]
        else:
            lines.append("Empty.")
    lines += ["", "## Metrics", ""]
    summary = state.summary(warmup)  # once, for the table and the plots
    lines += stats_table(state, warmup, summary)
    devices = devices_section(state)
    if devices:
        lines += ["", "## Devices", "", *devices]
    stragglers = straggler_table(state)
    if stragglers:
        lines += ["", "## Stragglers", "", *stragglers]
    if events:
        lines += ["", "## Sentinels", "", *sentinel_section(events)]
    if per_layer:
        lines += ["", "## Per layer", ""]
        lines += [
            "Each watched statistic, one row per entry (layer, leaf or group) and "
            "the steps across; the text form of each is beside the terminal plots.",
            "",
        ]
        for title, image, text in per_layer:
            lines += [f"### {md_escape(title)}", ""]
            if image is not None:
                lines += [f"![{md_escape(title)}](<{_relative(image, here)}>)", ""]
            else:
                lines += ["```", text.rstrip("\n"), "```", ""]
    if images:
        relative = [
            (item[0], _relative(item[1], here))
            if isinstance(item, tuple)
            else _relative(item, here)
            for item in images
        ]
        lines += ["", "## Plots", "", *_plot_sections(summary, relative)]
    if unplotted:
        cap = unplotted[0][1]
        names = ", ".join(
            f"`{printable(t)}`" if "`" not in t else md_escape(t) for t, _ in unplotted
        )
        lines += [
            "",
            f"Not plotted ({len(unplotted)} metric(s), over finalize's "
            f"max_plots={cap}; their statistics are in the table above): {names}",
        ]
    if terminal_plots:
        lines += ["", "## Terminal plots", ""]
        plots: Iterable[tuple[str, str]] = (
            terminal_plots.items()
            if isinstance(terminal_plots, Mapping)
            else terminal_plots
        )
        for title, text in plots:
            fence = "```"
            while fence in text:
                fence += "`"
            lines += [
                f"### {md_escape(title)}",
                "",
                f"{fence}text",
                text.rstrip(),
                fence,
                "",
            ]
    if files:
        lines += ["", "## Files", ""]
        for f in files:
            rel = printable(Path(os.path.relpath(f, here)).as_posix())
            lines.append(f"- `{rel}`" if "`" not in rel else f"- {md_escape(rel)}")
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(lines).rstrip() + "\n"))
    return path
