"""finalize: every output of a run, composed from the exporters."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from jaxhistory._codec import read_stamps
from jaxhistory._dtypes import warmup_count
from jaxhistory._env import (
    MAX_RUN_ID,
    check_run_name,
    environment_info,
    metadata_json,
    netcdf_attrs,
    new_run_id,
    plain_metadata,
)
from jaxhistory._env import environment as run_environment
from jaxhistory._files import (
    NotAFile,
    WriteError,
    as_path,
    check_target,
    remove_stale,
)
from jaxhistory._history_state import HistoryState
from jaxhistory.export._jsonl import to_jsonl
from jaxhistory.export._markdown import to_markdown
from jaxhistory.export._mpl import start_png
from jaxhistory.export._netcdf import to_netcdf
from jaxhistory.export._tplot import summary_choice, write_all, write_layers
from jaxhistory.export._units import (
    MAX_PLOTS,
    PlotUnit,
    capped,
    layer_families,
    plot_units,
)

__all__ = ["Progress", "checked_metadata", "finalize"]


class Progress:
    """A one-line progress bar on a terminal (nothing when ``stream`` is not one)."""

    def __init__(self, total: int, label: str, stream=None, width: int = 30):
        self.total, self.label, self.width, self.done = total, label, width, 0
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.enabled = total > 0 and isatty()

    def __call__(self, _item: Any = None) -> None:
        self.done += 1
        if self.enabled:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "-" * (self.width - filled)
            end = "\n" if self.done >= self.total else ""
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}{end}")
            self.stream.flush()

    def finish(self) -> None:
        """Completes the bar (array plots skipped because of warmup count as done)."""
        if self.done < self.total:
            self.done = self.total - 1
            self()


_STAGING = itertools.count()
PLOT_FOLDERS = ("mplot", "tplot")  # what finalize owns under {outdir}/plots
# What a finalize killed before it finished leaves: the plots it was drawing
# ({outdir}/.plots-{pid}-...) and the plots it was replacing
# ({outdir}/plots/.mplot-old-{pid}-{n}); removed by the next finalize there once
# that process is gone.
STAGED = re.compile(r"\.plots-(?P<pid>\d+)-[A-Za-z0-9_]+")
REPLACED = re.compile(r"\.(?:mplot|tplot)-old-(?P<pid>\d+)-\d+")
# The temporary files of earlier versions: {outdir}/.dataset.nc.{pid}.tmp
OLD_TMP = re.compile(r"\.(?:dataset\.nc|report\.md|.+\.jsonl)\.(?P<pid>\d+)\.tmp")


def remove_leftovers(outdir: Path) -> list[Path]:
    """Removes what finalizes killed in ``outdir`` left behind (their plot
    folders and temporary files), once their processes are gone; returns it."""
    removed = remove_stale(outdir, patterns=(STAGED, OLD_TMP))
    plots = outdir / "plots"
    if plots.is_dir() and not plots.is_symlink():
        removed += remove_stale(plots, patterns=(REPLACED,))
    return removed


def replace_folder(new: Path, target: Path) -> None:
    """Puts the folder ``new`` at ``target``, replacing what was there; if the
    swap fails the old folder stays."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}-old-{os.getpid()}-{next(_STAGING)}")
        os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def checked_metadata(config: Any, env_info: Any, mesh: Any = None) -> tuple:
    """``(config, env_info)`` as plain JSON data (None where not given):
    ``env_info=True`` collects :func:`~jaxhistory._env.environment_info`,
    False is None. Raises TypeError or ValueError naming what is wrong."""
    if config is not None:
        config = plain_metadata(config, "config")
    if env_info is True:
        env_info = environment_info(mesh)
    elif env_info is False:
        env_info = None
    if env_info is not None:
        if not isinstance(env_info, Mapping):
            raise TypeError(
                "env_info must be a dict, True (collect it) or None, got "
                f"{type(env_info).__name__}"
            )
        env_info = plain_metadata(env_info, "env_info")
    return config, env_info


def finalize(
    state: HistoryState,
    outdir: str | os.PathLike,
    run_id: str | None = None,
    run_name: str | None = None,
    warmup: float = 0.0,
    num_chains: int = 128,
    plot: bool = True,
    save: bool = True,
    report: bool = True,
    jsonl: str | os.PathLike | None = None,
    timestamps: dict[int, float] | None = None,
    mesh: Any = None,
    echo: bool = True,
    environment: dict[str, Any] | None = None,
    written: list[Path] | None = None,
    max_plots: int | None = MAX_PLOTS,
    events: Sequence[Any] = (),
    config: Any = None,
    env_info: Any = None,
):
    """Writes the outputs of a run into ``outdir``; returns its ``xarray.Dataset``.

    ============================  ===========================================
    dataset (netCDF-4)            ``{outdir}/dataset.nc`` (when ``save``)
    matplotlib plots              ``{outdir}/plots/mplot/*.png`` (``plot``)
    terminal plots                ``{outdir}/plots/tplot/*.txt`` (``plot``)
    markdown report               ``{outdir}/report.md`` (``report``)
    JSONL log                     ``{outdir}/{run_id}.jsonl``, or ``jsonl``
    ============================  ===========================================

    ``jsonl`` is the log History streamed during the run, left where it is;
    without one, the log is written from ``state`` (with ``timestamps``, a step
    to wall-time map, where known) when ``save``. The dataset holds every step;
    ``warmup`` (a fraction below 1 or a number of steps) is left out of the plots
    and statistics, and its step count is recorded as the ``warmup_steps``
    attribute. With ``plot``, the summary terminal plots are printed (``echo``).
    In a multi-process run only process 0 writes; the others return the dataset.
    ``environment`` replaces the description of this process's environment (the
    ``jaxhistory report`` command passes the one recorded with the run). The
    path of every file written is appended to ``written`` when it is a list.

    At most ``max_plots`` metrics are plotted (None: all; a figure costs about
    0.1 s of CPU): those with cross-device statistics first, then the others in
    recording order. The report names the rest, whose statistics it holds
    like every metric's. ``events``: what the run's sentinels found
    (:class:`~jaxhistory.sentinels.Event`), listed in the report.

    ``config``: the run's configuration (a dict, a dataclass instance or a
    namespace, nested; see :class:`~jaxhistory.History`), recorded as JSON in
    the dataset attribute ``config`` and as a table in the report's "Config"
    section. ``env_info``: more about the environment (a dict, nested dicts
    allowed), or True to collect it (versions of jax, jaxlib, flax, optax,
    NumPy; devices, processes, host, Python, platform), recorded as JSON in the
    dataset attribute ``env_info`` and as rows of the report's "Environment"
    section (names and values escaped like metric names). Both are checked
    before anything is written: a value that is not plain data is a TypeError
    naming its path.
    """
    outdir = as_path("outdir", outdir)
    check_run_name(run_name)
    config, env_info = checked_metadata(config, env_info, mesh)
    if run_id is None:
        run_id = new_run_id(run_name)
    check_run_name(run_id, "run_id", MAX_RUN_ID)  # the limit resume= reads with
    env = dict(environment) if environment is not None else run_environment(mesh)
    attrs = {"run_id": run_id, **env}
    if run_name:
        attrs["run_name"] = run_name
    if config is not None:
        attrs["config"] = metadata_json(config)
    if env_info is not None:
        attrs["env_info"] = metadata_json(env_info)
    attrs["warmup_steps"] = warmup_count(warmup, len(state.all_steps()))
    families = layer_families(state.keys) if plot else []
    # A watch family's entries are drawn in its heatmap; its total keeps a plot.
    in_heatmaps = {name for f in families for name in f.names}
    units = (
        [u for u in plot_units(state) if not in_heatmaps.issuperset(u.names)]
        if plot
        else []
    )
    units, unplotted = capped(units, max_plots) if plot else ([], [])
    if jax.process_index() != 0:
        ds = state.to_xarray()
        ds.attrs.update(netcdf_attrs(attrs))
        return ds
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise NotADirectoryError(
            f"finalize: the output folder {outdir} exists and is not a folder; "
            "nothing was written"
        )
    # Nothing finalize writes or deletes may be a link (or a device, a pipe):
    # refused before anything is written.
    check_target(outdir / "plots", folder=True)
    for kind in PLOT_FOLDERS:
        check_target(outdir / "plots" / kind, folder=True)
    for name, wanted in (("dataset.nc", save), ("report.md", report)):
        if wanted:
            check_target(outdir / name)
    if jsonl is None and save:
        check_target(outdir / f"{run_id}.jsonl")
    outdir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(outdir)
    files: list[Path] = []
    if save:
        path = outdir / "dataset.nc"
        stamps = timestamps
        if stamps is None and jsonl is not None and Path(jsonl).is_file():
            stamps = read_stamps(Path(jsonl))  # the times the log recorded
        ds = to_netcdf(state, path, attrs=attrs, timestamps=stamps)
        files.append(path)
    else:
        ds = state.to_xarray()
        ds.attrs.update(netcdf_attrs(attrs))
    if jsonl is not None:
        files.append(Path(jsonl))
    elif save:
        log = to_jsonl(state, outdir / f"{run_id}.jsonl", timestamps, run_id=run_id)
        files.append(log)
    images: list[Path] = []
    owners: dict[Path, PlotUnit] = {}  # image -> the plot unit it draws
    per_layer: list[tuple] = []  # (title, heatmap image, text) per watch family
    heatmaps: dict[str, Path] = {}  # family total -> its heatmap image
    terminal: dict[Path, tuple[str, str]] = {}  # text file -> (title, text)
    if plot:
        arrays = sum(1 for u in units if u.raw is not None and state.shape(u.raw))
        progress = Progress(2 * len(units) + 2 * arrays, "finalize: plots")
        # Drawn into folders of their own, which then replace plots/mplot and
        # plots/tplot whole: no plot of an earlier finalize stays beside these.
        # (Only those two folders: anything else under plots/ is the user's.)
        try:
            staging = Path(
                tempfile.mkdtemp(prefix=f".plots-{os.getpid()}-", dir=outdir)
            )
        except OSError as err:
            raise WriteError(outdir / "plots", err) from err
        pending = None
        try:
            marks: dict[str, list[int]] = {}  # where sentinels fired
            for event in events:
                marks.setdefault(event.metric, []).append(event.step)
            pending = start_png(
                state,
                staging / "mplot",
                warmup,
                num_chains,
                progress,
                units,
                families,
                marks,
            )  # drawn by worker processes while the terminal plots are made
            tplots = write_all(state, staging / "tplot", warmup, progress, units)
            layer_texts = write_layers(
                state, staging / "tplot", warmup, families, units
            )
            images = pending.wait()
            owners = pending.units
            heatmaps = pending.layers
            pending = None
            (outdir / "plots").mkdir(exist_ok=True)
            for kind in PLOT_FOLDERS:
                (staging / kind).mkdir(parents=True, exist_ok=True)
                replace_folder(staging / kind, outdir / "plots" / kind)
        except (OSError, RuntimeError) as err:
            if isinstance(err, WriteError | NotAFile):
                raise
            raise WriteError(outdir / "plots", err) from err
        finally:
            if pending is not None:
                pending.cancel()
            shutil.rmtree(staging, ignore_errors=True)
        progress.finish()
        final = outdir / "plots"
        owners = {final / p.relative_to(staging): u for p, u in owners.items()}
        images = [final / p.relative_to(staging) for p in images]
        tplots = [(u, final / p.relative_to(staging), t) for u, p, t in tplots]
        layer_texts = [
            (f, final / p.relative_to(staging), t) for f, p, t in layer_texts
        ]
        files += images + [path for _, path, _ in tplots + layer_texts]
        heatmaps = {t: final / p.relative_to(staging) for t, p in heatmaps.items()}
        per_layer = [(f.title, heatmaps.get(f.total), t) for f, _, t in layer_texts]
        # by file, not title: two plots may share one (a metric named
        # "loss: train vs eval" beside that comparison)
        chosen = {id(u) for u in summary_choice(units)}
        terminal = {p: (u.title, text) for u, p, text in tplots if id(u) in chosen}
        if echo:
            for _, text in terminal.values():
                print(text)
            if unplotted:
                print(
                    f"finalize: {len(unplotted)} more metric(s) not plotted "
                    f"(max_plots={max_plots}); their statistics are in report.md"
                )
    else:  # plots of an earlier finalize are not this run's
        for kind in PLOT_FOLDERS:
            shutil.rmtree(outdir / "plots" / kind, ignore_errors=True)
        with contextlib.suppress(OSError):
            (outdir / "plots").rmdir()  # only if nothing else is in it
    if report:
        path = outdir / "report.md"
        files.append(path)
        shown_per_layer = set(heatmaps.values())
        to_markdown(
            state,
            path,
            warmup=warmup,
            run_id=run_id,
            run_name=run_name,
            environment=env,
            images=[
                (owners[p], p)
                for p in images
                if p.suffix == ".png" and p not in shown_per_layer
            ],
            terminal_plots=list(terminal.values()),
            files=files,
            unplotted=[(u.title, max_plots) for u in unplotted],
            events=events,
            per_layer=per_layer,
            config=config,
            env_info=env_info,
        )
    if written is not None:
        written.extend(files)
    return ds
