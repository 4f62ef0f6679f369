"""History: the stateful update() -> summary line object most users touch."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxhistory._distributed import distributed_default
from jaxhistory._dtypes import as_flag
from jaxhistory._env import metadata_json, plain_metadata
from jaxhistory._files import as_path, check_folder, still_folder
from jaxhistory._hang import HANG_TIMEOUT_S, check_hang_timeout
from jaxhistory._history_state import Appender, HistoryState
from jaxhistory._job import JobSync
from jaxhistory._progress import Progress
from jaxhistory._recorder import Recorder
from jaxhistory._run_setup import (
    check_options,
    open_outputs,
    run_identity,
    use_wandb_ignored,
)
from jaxhistory._side_values import SideValues
from jaxhistory._stragglers import check_window
from jaxhistory._summary import NonfiniteWatch, SummaryLine, memory_token
from jaxhistory._views import GroupsView, MetricsView, RunViews
from jaxhistory.export._finalize import checked_metadata
from jaxhistory.export._finalize import finalize as write_outputs
from jaxhistory.export._units import MAX_PLOTS
from jaxhistory.sentinels import Guard
from jaxhistory.sinks._feed import call_extras
from jaxhistory.sinks._training_history import log_tables

__all__ = [
    "GroupsView",
    "History",
    "MetricsView",
    "distributed_default",
    "memory_token",
]


class History(RunViews):
    """Records metrics step by step and returns a one-line summary of each update.

    Args:
        keys: metric names to show first, in this order, in the summary line.
        distributed_history: reduce per-device values (sharded JAX arrays) and, with
            several processes, per-process host scalars into ``name/mean``,
            ``name/max``, ``name/min`` and ``name/std`` across all devices or
            processes, in one fused jitted call per update (one all-reduce for
            per-device values and host scalars, at most two in all).
            Every process must then call :meth:`update`. ``None`` picks
            :func:`distributed_default`.
        report_dir: the default ``outdir`` of :meth:`finalize`; the JSONL log is
            streamed to ``{report_dir}/{run_id}.jsonl`` when no ``jsonl_path`` is
            given.
        report_enabled: whether :meth:`finalize` writes the markdown report.
        jsonl_path: stream the JSONL log here during the run (one line per update,
            written from a background thread at least five times a second and
            never more than a bounded number of updates behind; see
            :meth:`update`). Written by
            process 0 only, unless the path holds ``{process_index}``, which gives
            each process its own file. A symbolic link, a folder or a device
            there is refused at once (``NotAFile``, an ``OSError``); nothing is
            ever written through a link.
        jsonl_overwrite: truncate an existing JSONL log instead of appending to it
            (appending continues a resumed run).
        log_every: summarize (and so wait for device values) only at steps that
            are multiples of N (N, 2N, ...; and step 0); the others record without
            waiting and return ``""``. With several processes and N > 1, the
            values to reduce across processes also wait, reduced per batch at
            those steps on the host, through the distributed runtime's
            key-value store from a background thread, with no device program
            (each recorded at its own step); then :meth:`close` and
            :meth:`finalize` are collective.
        run_name: the first part of ``run_id`` (``{run_name}-{YYYYmmdd-HHMMSS}``,
            with ``-2``, ``-3``, ... where that id is taken), which names the
            JSONL log and is recorded in the outputs. Every process of a
            multi-process job uses the same id (the k-th History made with a
            name shares the first process's id, through the distributed
            runtime's key-value store). A name, never a path: separators,
            ``..`` and control characters raise ValueError.
        sinks: more places each update goes (:mod:`jaxhistory.sinks`: console,
            JSONL, CSV, TensorBoard, W&B, or anything with
            ``write``/``flush``/``close``), or their names,
            ``"console,csv,tensorboard,wandb"`` (``csv`` writes
            ``{report_dir}/{run_id}.csv``, ``tensorboard``
            ``{report_dir}/tensorboard/{run_id}``; without ``report_dir``, the
            JSONL log's folder). None (the default): the names in the
            ``JAXHISTORY_SINKS`` environment variable, else none. Names are
            the whole list: W&B is used when ``wandb`` is among them, not for
            an active run alone. An unknown name is a ValueError naming it, a
            sink whose package is missing an ImportError naming the
            ``pip install``.
            Each gets every update as a :class:`~jaxhistory.sinks.Record` of its
            own (changing it changes nothing another sink sees) once its device
            values are on the host, from a thread of its own: ``update`` and the
            JSONL log never wait for a sink. A sink more than 16384 records
            behind loses records (with a warning naming it), never the log.
            Process 0 only, unless a sink has ``all_processes = True``.
            :meth:`flush` flushes them, :meth:`close` closes them.
        use_wandb: log to Weights & Biases through a
            :class:`~jaxhistory.sinks.WandbSink` (metrics at each update; the
            history as a ``wandb.Table`` and the PNGs as ``wandb.Image`` at
            :meth:`finalize`). None: when a W&B run is active and
            ``WANDB_DISABLED`` is not 1/true/yes. False never, True requires a run.
        memory: record memory with the metrics: True on every update, an int N
            every N updates. Adds ``mem/host_rss`` (bytes, psutil),
            ``mem/device_in_use`` and, where the backend reports it,
            ``mem/device_peak`` (bytes over this process's devices, see
            :func:`~jaxhistory.device_memory`) at the update's step, and a
            ``memory=X.XX/Y.YYGiB`` token (current/peak) to the summary line:
            device memory where the backend reports a peak, else host RSS.
        provenance: with distributed history, also record which device holds
            each statistic's max, min and first NaN (``name/argmax``,
            ``name/argmin``, ``name/nan_device``: global indices in
            ``jax.devices()`` order; see :func:`~jaxhistory.distributed_stats`),
            in the same all-reduces. When a statistic turns NaN or
            infinite, the summary line shows the device and its process
            (``loss=nan(NaN on device 3 (process 1))``) and a warning, once per
            metric, names the step, the metric, the device and the process.
        resume: continue a run: its JSONL log (the run id is on its lines; an
            older log's is its file name; the log is appended to unless
            ``jsonl_path`` or ``report_dir`` says otherwise), its ``dataset.nc``
            or finalize folder (the run id recorded there; a folder without one:
            its one JSONL log), or a HistoryState.
            Its records become this History's; later updates go on from its
            last step.
        resume_step: with ``resume``, leave out the records at this step and
            later: the steps a restart from an earlier checkpoint (of step
            ``resume_step - 1``) records again (their log lines are set aside).
        total_steps: progress. At each step that is a multiple of
            ``log_every``, to a dict update, History adds ``perf/steps_per_sec``
            (since the previous summarized step) and, with ``total_steps``,
            ``perf/eta_sec`` (seconds to the last step, at the median time a
            step took over the last 32 such intervals: one slow interval, a
            compilation, does not throw it).
        flops_per_step: with ``peak_flops``, History also adds ``perf/mfu``,
            the model FLOPs utilisation: :func:`~jaxhistory.step_flops` of the
            compiled step.
        peak_flops: the peak FLOP/s of every device the step runs on, together.

        sentinels: :mod:`jaxhistory.sentinels` checks on the recorded values
            (:class:`~jaxhistory.sentinels.NonFinite`,
            :class:`~jaxhistory.sentinels.Spike`) that warn, raise or call back,
            and record ``sentinel/nonfinite`` and ``sentinel/spike``.
        hang_timeout: with several processes, seconds a process may stay behind
            the step the others are at before every other process names it (a
            ``RuntimeWarning``, a ``jaxhistory`` logger record, a ``hang/*``
            line in the log); None turns the watch off. Its background thread
            starts at the first update and stops at :meth:`close` or
            :meth:`finalize` (once the values they wait for are in), posting
            the step this process closed at: a process that closed behind the
            step the others wait at is named too. With one process there is
            nothing to watch.
        straggler_window: with several processes, updates per window of the
            straggler scores: at the end of each, every process's median and
            p90 arrival lag (``straggler/median_lag``, ``straggler/p90_lag``),
            the slowest process and its score, and a warning for a process
            consistently slower.
        config: the run's configuration (hyperparameters): a dict, a dataclass
            instance or an ``argparse``/``types`` namespace, nested. Copied at
            once as plain JSON data (:attr:`config`; later changes to the
            object are not recorded), and written by :meth:`finalize` into the
            dataset (attribute ``config``, JSON) and the report (a "Config"
            table, one row per value, ``optimizer.lr``, escaped). A value that
            is not plain data (a function, an object) is a TypeError naming its
            path (``config['optimizer']['schedule']``), before anything is
            recorded.

    With several processes and distributed history, each update that reduces
    something also records ``straggler/process`` (the process that reached the
    update last) and ``straggler/lag`` (seconds after the median process), in
    the same all-reduces as the host scalars.

    Every method may be called from any thread: updates from several threads are
    all recorded (each thread's in its order), and ``attach``, ``flush`` and
    ``close`` may run beside them.

    Examples:
        >>> import jaxhistory as jh
        >>> h = jh.History(distributed_history=False)
        >>> h.update({"step": 42, "loss": 0.1234567, "lr": 1e-3})
        'step=42 loss=0.123457 lr=0.001000'
        >>> h.state.steps("loss").tolist()
        [42]
    """

    def __init__(
        self,
        keys: Sequence[str] | None = None,
        distributed_history: bool | None = None,
        report_dir: str | os.PathLike | None = None,
        report_enabled: bool = True,
        jsonl_path: str | os.PathLike | None = None,
        jsonl_overwrite: bool = False,
        log_every: int = 1,
        run_name: str | None = None,
        memory: bool | int = False,
        sinks: Sequence[Any] | str | None = None,
        use_wandb: bool | None = None,
        provenance: bool = True,
        resume: str | os.PathLike | HistoryState | None = None,
        resume_step: int | None = None,
        total_steps: int | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        sentinels: Sequence[Any] = (),
        hang_timeout: float | None = HANG_TIMEOUT_S,
        straggler_window: int = 100,
        config: Any = None,
    ):
        memory = check_options(keys, log_every, memory)
        window = check_window(straggler_window)
        # the run config, as JSON text: every read of .config gets a new copy
        self._config = None if config is None else metadata_json(plain_metadata(config))
        self._use_wandb_warned = False
        self.hang_timeout = check_hang_timeout(hang_timeout)
        guard = Guard(sentinels) if sentinels else None
        self.memory_every = memory  # 0: off
        self.keys = tuple(keys or ())
        self.distributed_history = (
            distributed_default()
            if distributed_history is None
            else as_flag("distributed_history", distributed_history)
        )
        self.report_dir = (
            None if report_dir is None else as_path("report_dir", report_dir)
        )
        if self.report_dir is not None:
            check_folder("report_dir", self.report_dir)
        self._report_dir_was_link = os.path.islink(self.report_dir or "")
        self.report_enabled = as_flag("report_enabled", report_enabled)
        self.jsonl_path = (
            None if jsonl_path is None else as_path("jsonl_path", jsonl_path)
        )
        self.jsonl_overwrite = as_flag("jsonl_overwrite", jsonl_overwrite)
        self.log_every = int(log_every)
        progress = Progress.of(total_steps, flops_per_step, peak_flops)
        state, self.run_id, self.jsonl_path = run_identity(
            resume,
            resume_step,
            run_name,
            self.jsonl_path,
            self.report_dir,
            self.jsonl_overwrite,
        )
        rec = Appender()  # the newest state; it carries the run id, so that
        # History(resume=history.state) goes on under it
        start = state if state is not None else HistoryState()
        rec.set(start.with_attrs(run_id=self.run_id))
        job = JobSync(
            provenance,
            self.distributed_history,
            self.hang_timeout,
            window,
            lambda row: self._recorder.post_row(row),
        )
        watch = NonfiniteWatch()  # one warning per metric gone NaN/inf
        self.sinks, out = open_outputs(
            sinks,
            use_wandb,
            self.jsonl_path,
            self.report_dir,
            self.run_id,
            self.jsonl_overwrite,
            watch.check,
        )
        # the run while it runs; everything here is an option or an output
        self._recorder = Recorder(
            rec,
            out,
            job,
            SideValues(memory),
            SummaryLine(self.keys, watch),
            progress,
            guard,
            log_every,
            self.distributed_history,
        )

    def update(
        self,
        metrics: Mapping[str, Any],
        precision: int = 6,
        step: int | None = None,
        summarize: bool = True,
        use_wandb: bool | None = None,
    ) -> str:
        """Records ``metrics`` and returns the summary line for this step.

        Args:
            metrics: a dict of Python, NumPy or JAX values (nested dicts join names
                with ``/``). A ``step``/``iter`` entry sets the step.
            precision: decimals in the summary line (e-notation where they show 0).
            step: the step, overriding any entry in ``metrics``.
            summarize: build the summary line. It needs the values, so it waits for
                device values of this step; with False (or between ``log_every``
                updates) nothing waits and ``""`` is returned.
            use_wandb: accepted for code written for ezpz, and ignored, with
                one warning per History: every update goes to every sink, W&B
                included. Whether W&B is used is decided once, by
                ``History(use_wandb=...)`` or ``sinks``. Anything but
                None/True/False is a ValueError (nothing recorded).

        Returns:
            ``"step=42 loss=0.123457 lr=0.001000"``: counters (``step``, ``epoch``,
            ``iter``) as integers; a distributed metric as its mean with the std
            inlined, ``loss=0.123457(±0.002100)``.

        Raises:
            TypeError, ValueError: bad values, as for :meth:`HistoryState.update`
                (nothing is recorded then). With distributed history, processes
                that pass different metric names all raise ValueError.

        The JSONL log is written by a background thread, at least five times a
        second. It is never more than a few thousand updates (and, unless the
        disk hangs, well under a second, the latest step's line aside: it waits
        up to 1 s for more of its step) behind: when it cannot keep up,
        ``update`` waits for it. The sinks are written after the log, each from
        a thread of its own; nothing waits for them.
        """
        if type(precision) is not int or precision < 0:
            raise ValueError(f"precision must be a non-negative int, got {precision!r}")
        if use_wandb is not None:
            self._ignore_use_wandb(use_wandb)
        return self._recorder.update(metrics, precision, step, summarize)

    def _ignore_use_wandb(self, use_wandb: Any) -> None:
        """Checks ``update(use_wandb=...)`` and warns, once, that it is ignored."""
        text = use_wandb_ignored(use_wandb, self.sinks)
        with self._recorder.lock:
            first, self._use_wandb_warned = not self._use_wandb_warned, True
        if first:
            warnings.warn(text, UserWarning, stacklevel=3)

    def attach(self, metrics: Any, step: int | None = None) -> None:
        """Records host values of this process alone, never reduced across devices
        or processes, so any process may call it at any time, from any thread.

        The values wait for the next :meth:`update` (or :meth:`flush`,
        :meth:`finalize`, :meth:`close`), which records them on the thread that
        records. With ``step`` None they are recorded at that update's step (a
        name attached twice before it keeps the later value), without moving the
        step counter; values still waiting at :meth:`finalize` or :meth:`close`
        are recorded at the latest step (the next one if one of them already has
        a record there). With a ``step``, at that step (which, as for
        :meth:`update`, moves ``next_step`` past it). Nested dicts join names
        with ``/``. This is how :class:`~jaxhistory.StopWatch` timings and
        :class:`~jaxhistory.publish.HistoryHandler` metrics arrive.

        Raises:
            TypeError, ValueError: a value that cannot be recorded (a string,
                None, a JAX tracer, ...); nothing of this call is kept, and the
                values already waiting are not affected.

        Examples:
            >>> import jaxhistory as jh
            >>> h = jh.History(distributed_history=False)
            >>> h.attach({"timing": {"data": 0.25}})
            >>> h.update({"loss": 0.5}, step=3)
            'step=3 loss=0.500000'
            >>> h.state.steps("timing/data").tolist()
            [3]
        """
        self._recorder.side.attach(metrics, step)

    @property
    def state(self) -> HistoryState:
        """Everything recorded so far, as an immutable
        :class:`~jaxhistory.HistoryState` (later updates never change it)."""
        return self._recorder.state

    @state.setter
    def state(self, state: HistoryState) -> None:
        if not isinstance(state, HistoryState):
            raise TypeError(f"state must be a HistoryState, got {type(state).__name__}")
        self._recorder.state = state

    @property
    def mesh(self) -> Any:
        """The mesh of the per-device metrics, once one is recorded (else None)."""
        return self._recorder.mesh

    # ----- outputs -----------------------------------------------------------------
    @property
    def log_path(self) -> Path | None:
        """Where this process streams its JSONL log (None: nowhere)."""
        return self._recorder.out.path

    @property
    def config(self) -> dict[str, Any] | None:
        """The run config given as ``History(config=...)``, as plain JSON data
        (a new copy at each read), or None."""
        return None if self._config is None else json.loads(self._config)

    def flush(self) -> None:
        """Writes the queued JSONL lines and sink records now (waiting for their
        device values), then flushes the sinks, waiting for them at most
        :attr:`SinkFeed.TIMEOUT <jaxhistory.sinks._feed.SinkFeed.TIMEOUT>`
        seconds (5) in all: a sink that does not finish by then gets a warning
        naming it."""
        self._recorder.flush()

    def close(self) -> None:
        """Records values still attached, writes the queued JSONL lines, closes
        the log and closes the sinks (nothing more is written to them; a W&B
        sink still logs the outputs at :meth:`finalize`). Recording may go on (a
        later update reopens the log in append mode).

        The log is complete when this returns. The sinks get what is queued for
        them, then ``flush`` and ``close``, within 5 s in all: a sink still
        busy then (a ``write`` that never returns) is left to its thread, with
        a warning naming it and the records it did not get. One that raises
        gets a warning; the others are closed all the same. A sink may call
        this from its own ``write``."""
        self._recorder.close()

    def finalize(
        self,
        outdir: str | os.PathLike | None = None,
        run_name: str | None = None,
        warmup: float = 0.0,
        num_chains: int = 128,
        plot: bool = True,
        save: bool = True,
        max_plots: int | None = MAX_PLOTS,
        env_info: Mapping[str, Any] | bool | None = None,
    ):
        """Writes every output of the run into ``outdir``; returns the dataset.

        See :func:`jaxhistory.export.finalize` for what is written where. In a
        multi-process run only process 0 writes; every process returns the
        dataset. ``outdir`` defaults to ``report_dir``. Called on another
        thread while updates run, it writes the steps recorded when it began.
        Later updates append to the log, held until :meth:`close` (call it
        before another History resumes the run in this process).

        The run config (``History(config=...)``) goes into the dataset
        attribute ``config`` and the report's "Config" table. ``env_info``: more
        about where the run ran, a dict (nested dicts allowed, as ezpz's
        sections), or True to collect it (jax, jaxlib, flax, optax, NumPy and
        jaxhistory versions; backend, device kind and count, processes, host,
        Python, platform, working folder; no environment variables), recorded
        in the dataset attribute ``env_info`` (JSON) and as rows of the
        report's environment table (escaped like metric names). A bad
        ``env_info`` is a TypeError or ValueError naming it, raised before
        anything is written or flushed.

        Every sink with ``log_table(key, columns, rows)`` then gets the run's
        ``training_history`` table (:func:`~jaxhistory.sinks.training_history`);
        one that raises gets a warning naming it.
        """
        config, env_info = checked_metadata(self.config, env_info, self.mesh)
        if outdir is not None:
            outdir = as_path("outdir", outdir)
        if outdir is None:
            if self.report_dir is None:
                raise ValueError("finalize needs an outdir (or a History report_dir)")
            outdir = self.report_dir
            still_folder(outdir, self._report_dir_was_link)
        done = self._recorder.finish()  # the run is over here
        files: list[Path] = []
        state = done.state
        ds = write_outputs(
            state,
            outdir,
            run_id=self.run_id,
            run_name=run_name,
            warmup=warmup,
            num_chains=num_chains,
            plot=plot,
            save=save,
            max_plots=max_plots,
            report=self.report_enabled,
            jsonl=done.streamed,
            timestamps=done.stamps,
            mesh=self.mesh,
            written=files,
            events=done.events,
            config=config,
            env_info=env_info,
        )
        if done.streamed is None and save:  # the log was written again
            self._recorder.rewritten(Path(outdir) / f"{self.run_id}.jsonl")
        images = [p for p in files if p.suffix == ".png"]
        # e.g. W&B: the history table and the plots (each sink bounded in time)
        call_extras(self.sinks, "log_outputs", state, images)
        log_tables(self.sinks, state)
        return ds
