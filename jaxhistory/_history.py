"""History: the stateful update() -> summary line object most users touch."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np

from jaxhistory import _trace_state
from jaxhistory._distributed import (
    Reducer,
    agreed_run_id,
    client_is_current,
    distributed_client,
    distributed_default,
    is_per_device,
    mesh_of,
)
from jaxhistory._env import check_run_name, metadata_json, plain_metadata
from jaxhistory._hang import HANG_TIMEOUT_S, HangWatch, check_hang_timeout, hang_key
from jaxhistory._history_state import Appender, HistoryState
from jaxhistory._names import aggregated_names
from jaxhistory._progress import Progress
from jaxhistory._row import Row, RowKind, parse_row
from jaxhistory._run_log import RunLog, log_target
from jaxhistory._run_setup import (
    check_not_erased,
    check_options,
    resumed,
    run_id_for,
    sinks_here,
)
from jaxhistory._side_values import SideValues
from jaxhistory._stragglers import StragglerScores, check_window
from jaxhistory._summary import NonfiniteWatch, SummaryLine, memory_token
from jaxhistory.export._finalize import checked_metadata
from jaxhistory.export._finalize import finalize as write_outputs
from jaxhistory.export._units import MAX_PLOTS
from jaxhistory.sentinels import Guard, SentinelError
from jaxhistory.sinks._feed import sink_name
from jaxhistory.sinks._named import SINKS_VARIABLE
from jaxhistory.sinks._training_history import TRAINING_HISTORY, training_history
from jaxhistory.sinks._wandb import WandbSink

__all__ = [
    "GroupsView",
    "History",
    "MetricsView",
    "distributed_default",
    "memory_token",
]


class MetricsView(Mapping):
    """A read-only ``{name: values}`` mapping over one
    :class:`~jaxhistory.HistoryState`: ``History.data`` and each group of
    ``History.groups``.

    Names come in the order first recorded; each value is the metric's values,
    one per record (a read-only NumPy array, read when asked for: only that
    metric waits for its device values). :attr:`state` is the state it views,
    for the steps (``view.state.steps(view.name(key))``). Later updates do not
    change a view: read ``History.data`` again for them.

    Examples:
        >>> import jaxhistory as jh
        >>> h = jh.History(distributed_history=False)
        >>> _ = h.update({"train": {"loss": 0.5}, "lr": 0.1}, step=0)
        >>> list(h.data), h.data["train/loss"].tolist()
        (['train/loss', 'lr'], [0.5])
    """

    __slots__ = ("_names", "_state", "_what")

    def __init__(
        self,
        state: HistoryState,
        names: Mapping[str, str] | None = None,
        what: str = "History.data",
    ):
        self._state = state
        self._names = dict(names) if names is not None else {k: k for k in state.keys}
        self._what = what

    @property
    def state(self) -> HistoryState:
        """The state this view reads."""
        return self._state

    def name(self, key: str) -> str:
        """The full metric name of ``key`` (``"loss"`` in the group ``train``:
        ``"train/loss"``)."""
        return self._names[key]

    def __getitem__(self, key: str) -> np.ndarray:
        return self._state.values(self._names[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __setitem__(self, key: str, value: Any) -> NoReturn:
        _read_only(self._what)

    def __delitem__(self, key: str) -> NoReturn:
        _read_only(self._what)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._names)!r})"


class GroupsView(Mapping):
    """``History.groups``: the metrics by group, ``{group: MetricsView}``, as
    ezpz's ``History.groups`` holds them.

    A metric's group is the first part of its name (``train/loss`` is ``loss``
    in the group ``train``); a name without ``/`` (or one starting with it) is
    in the group ``""`` under its whole name. Cross-device statistics stay with
    their metric: ``loss/mean`` of a metric ``loss`` is ``loss/mean`` in the
    group ``""``, and ``train/loss/mean`` is ``loss/mean`` in ``train``. Groups
    come in the order first recorded.

    Examples:
        >>> import jaxhistory as jh
        >>> h = jh.History(distributed_history=False)
        >>> _ = h.update({"train": {"loss": 0.5}, "eval/acc": 0.9, "lr": 0.1}, step=0)
        >>> {group: list(view) for group, view in h.groups.items()}
        {'train': ['loss'], 'eval': ['acc'], '': ['lr']}
    """

    __slots__ = ("_groups", "_state")

    def __init__(self, state: HistoryState):
        self._state = state
        groups: dict[str, dict[str, str]] = {}
        family = aggregated_names(state.keys)
        for name in state.keys:
            base = name.rpartition("/")[0] if name in family else name
            head, slash, _ = base.partition("/")
            group = head if slash and head else ""
            key = name[len(group) + 1 :] if group else name
            groups.setdefault(group, {})[key] = name
        self._groups = groups

    @property
    def state(self) -> HistoryState:
        """The state this view reads."""
        return self._state

    def __getitem__(self, group: str) -> MetricsView:
        return MetricsView(
            self._state, self._groups[group], f"History.groups[{group!r}]"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    def __setitem__(self, key: str, value: Any) -> NoReturn:
        _read_only("History.groups")

    def __delitem__(self, key: str) -> NoReturn:
        _read_only("History.groups")

    def __repr__(self) -> str:
        groups = {g: list(names) for g, names in self._groups.items()}
        return f"{type(self).__name__}({groups!r})"


def _read_only(what: str) -> NoReturn:
    raise TypeError(
        f"{what} is a read-only view of the recorded history: record with "
        "History.update (or set History.state to a HistoryState)"
    )


class History:
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
            each process its own file.
        jsonl_overwrite: truncate an existing JSONL log instead of appending to it
            (appending continues a resumed run).
        log_every: summarize (and so wait for device values) only at steps that
            are multiples of N (N, 2N, ...; and step 0); the others record without
            waiting and return ``""``. With several processes and N > 1, the
            values to reduce across processes also wait, reduced in one program
            per batch at those steps (each recorded at its own step); then
            :meth:`close` and :meth:`finalize` are collective.
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
            or finalize folder (the run id recorded there), or a HistoryState.
            Its records become this History's; later updates go on from its
            last step.
        resume_step: with ``resume``, leave out the records at this step and
            later: the steps a restart from an earlier checkpoint (of step
            ``resume_step - 1``) records again. In the log, the later line wins.
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
            :meth:`finalize`; with one process there is nothing to watch.
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
        # the run config, as JSON text: every read of .config gets a new copy
        self._config = None if config is None else metadata_json(plain_metadata(config))
        self._use_wandb_warned = False
        self.hang_timeout = check_hang_timeout(hang_timeout)
        self._guard = Guard(sentinels) if sentinels else None
        self.memory_every = memory  # 0: off
        # One lock for everything below: update, attach, flush and close may run
        # on several threads at once (attach takes only the side values' lock).
        self._lock = threading.Lock()
        self._side = SideValues(memory)
        self.keys = tuple(keys or ())
        self.distributed_history = (
            distributed_default()
            if distributed_history is None
            else bool(distributed_history)
        )
        self.report_dir = None if report_dir is None else Path(report_dir)
        self.report_enabled = bool(report_enabled)
        self.jsonl_path = None if jsonl_path is None else Path(jsonl_path)
        self.jsonl_overwrite = bool(jsonl_overwrite)
        self.log_every = log_every
        self._progress = Progress.of(total_steps, flops_per_step, peak_flops)
        self._rec = Appender()  # the newest state
        check_run_name(run_name)
        resumed_id = None
        if resume is not None or resume_step is not None:
            state, resumed_id, log = resumed(resume, resume_step, run_name)
            self._rec.set(state)
            if log is not None and self.jsonl_path is None and self.report_dir is None:
                self.jsonl_path = log  # the run's own log goes on
            check_not_erased(log, self.jsonl_path, self.jsonl_overwrite)
        self.run_id = resumed_id or agreed_run_id(
            run_id_for(
                run_name, None if self.jsonl_path is not None else self.report_dir
            ),
            run_name,
        )
        self.mesh = None  # the mesh of the per-device metrics, once one is seen
        self._updates = 0
        self._reducer = Reducer(provenance)
        # With several processes: a report when one stalls (started by the
        # first update, so a History never used posts nothing).
        self._hang: HangWatch | None = None
        self._hang_key = hang_key() if self._reducer.multi_process else None
        # host scalars are reduced across processes: no fast path then
        self._reduce_host = self.distributed_history and self._reducer.multi_process
        window = check_window(straggler_window)
        self._stragglers = StragglerScores(window) if self._reduce_host else None
        self._pending_found: list = []  # sentinel events of rows reduced in a batch
        self._watch = NonfiniteWatch()  # one warning per metric gone NaN/inf
        self._line = SummaryLine(self.keys, self._watch)
        log_path = log_target(self.jsonl_path, self.report_dir, self.run_id)
        folder = self.report_dir
        if folder is None and self.jsonl_path is not None:
            folder = self.jsonl_path.parent
        self.sinks = sinks_here(
            sinks, use_wandb, folder, self.run_id, self.jsonl_overwrite
        )
        given = () if sinks is None or isinstance(sinks, str) else tuple(sinks)
        try:
            self._out = RunLog(
                log_path,
                self.jsonl_overwrite,
                self.run_id,
                self.sinks,
                self._watch.check,
            )
        except BaseException:
            for sink in self.sinks:  # the ones made here from names
                if not any(sink is s for s in given):
                    with contextlib.suppress(Exception):
                        sink.close()
            raise

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
            precision: decimals in the summary line.
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
        with self._lock:
            now = time.time()
            # A dict like the last one, of finite floats, with nothing else due:
            # parsed and appended in one call, then queued for the log.
            row = self._rec.take(metrics, now) if step is None else None
            if row is not None and not self._side.due and self._guard is None:
                self._updates += 1
                out = self._out
                out.stamp_steps.append(row.step)
                out.stamp_times.append(now)
                if out.writing or _trace_state.active() is not None:
                    writer = out.writer
                    if writer is not None:
                        writer.add(row)
                    else:
                        out.add(row)  # (starts the writer)
                if not summarize or row.step % self.log_every:
                    return ""
                line = self._line.format_floats  # (out of the lock)
            else:
                row, token, found = self._update_locked(
                    row, metrics, step, now, summarize
                )
                line = None
        if line is not None:
            return line(row, precision)
        if found:
            self._act(found)
        if not summarize or row.step % self.log_every:
            return ""
        line = self._line.format(row, precision)
        return f"{line} {token}" if token else line

    def _update_locked(
        self, row: Row | None, metrics: Any, step: Any, now: float, summarize: bool
    ) -> tuple[Row, str, list | None]:
        """:meth:`update` under the lock, for everything but a repeated dict of
        floats with nothing else due: records ``metrics`` (``row``: recorded
        already), its side values, logs it and runs the sentinels. Returns the
        row, the memory token and the sentinels' events."""
        if row is None:
            row = self._recorded(metrics, step, now, summarize)
        self._updates += 1
        out = self._out
        out.stamp(row.step, now)
        token, logged = "", row
        if self._side.due:
            rec = self._rec
            state, token, side, earlier = self._side.at_update(
                rec.state, row.step, self._updates
            )
            rec.set(state)
            self._emit(earlier)
            if side:
                names, values = zip(*side, strict=True)
                logged = row._replace(
                    names=row.names + names,
                    values=row.values + values,
                    kind=RowKind.VALUES,
                )
        if out.writing or _trace_state.active() is not None:
            out.add(logged)
        found = self._checked(row) if self._guard is not None else None
        if self._pending_found:  # from earlier rows reduced in a batch
            found = [*self._pending_found, *(found or [])]
            self._pending_found = []
        if self._reduce_host:
            self._same_everywhere()
        return row, token, found

    def _ignore_use_wandb(self, use_wandb: Any) -> None:
        """Checks ``update(use_wandb=...)`` and warns, once, that it is ignored."""
        if use_wandb not in (True, False):
            raise ValueError(
                f"use_wandb must be True, False or None, got {use_wandb!r}"
            )
        with self._lock:
            first, self._use_wandb_warned = not self._use_wandb_warned, True
        if first:
            has = any(isinstance(s, WandbSink) for s in self.sinks)
            now = "every update goes to" if has else "this History has no"
            warnings.warn(
                f"update(use_wandb={use_wandb}) is ignored ({now} W&B sink): "
                "jaxhistory decides W&B once, with History(use_wandb=...) or "
                f"sinks= ({SINKS_VARIABLE}=wandb), and sends every update to "
                "every sink; this warning is given once per History",
                UserWarning,
                stacklevel=3,
            )

    def _recorded(
        self, metrics: Any, step: Any, now: float, summarize: bool = True
    ) -> Row:
        """Parses, completes (progress), reduces and records one update (the
        caller holds the lock)."""
        rec = self._rec
        row = parse_row(metrics, step, rec.next_step, now)
        if self._hang_key is not None:  # before the reduction, which may wait
            self._beat(row.step)
        if self._progress is not None:
            row = self._progress.add(row, self.log_every)
        if self.distributed_history and (
            self._reduce_host
            or (row.kind is RowKind.VALUES and any(map(is_per_device, row.values)))
        ):
            row, earlier, mesh = self._reducer.reduced_row(
                row, self.log_every, summarize
            )
            if mesh is not None and self.mesh is None:
                self.mesh = mesh
            if earlier:
                self._record_reduced(earlier)
        rec.append(row)
        if (
            step is None
            and self._progress is None
            and self._hang_key is None
            and not self._reduce_host
        ):
            rec.remember(metrics, row)  # the next dict like it takes rec.take
        self._take_lags()
        if row.kind is RowKind.VALUES and self.mesh is None:
            self.mesh = mesh_of(row.values)
        return row

    def _beat(self, step: int) -> None:
        """Tells the hang watch this process reached ``step`` (started here
        the first time; the caller holds the lock)."""
        hang = self._hang
        if hang is None:
            client = distributed_client()
            if self.hang_timeout is None or client is None:
                self._hang_key = None  # nothing to watch: never asked again
                return
            hang = self._hang = HangWatch(
                self.hang_timeout,
                client,
                self._hang_key,
                jax.process_index(),
                jax.process_count(),
                self._hang_report,
                self._reducer.answer_names,
                functools.partial(client_is_current, client),
            )
        hang.beat(step)

    def _hang_report(self, stalled: list, front: int) -> None:
        """Writes a hang report to the log and the trace, on the watch thread.
        The recording thread may be the one waiting (holding the lock): the
        row goes straight to the log's writer, which takes rows from any
        thread; before the log has started, only if the lock comes free."""
        first = stalled[0]
        handler = _trace_state.active()
        if handler is not None:
            args = {"process": first.process, "step": first.step, "span": first.span}
            handler.instant("hang", args, scope="g")
        names = ("hang/process", "hang/last_step", "hang/seconds", "hang/processes")
        values = (first.process, first.step, round(first.seconds, 3), len(stalled))
        row = Row(max(front, 0), names, values, RowKind.VALUES, time.time())
        writer = self._out.writer
        if writer is not None:
            with contextlib.suppress(ValueError):  # closed meanwhile
                writer.add(row)
                return
        if self._lock.acquire(timeout=1.0):
            try:
                if self._out.writing:
                    self._out.add(row)
            finally:
                self._lock.release()

    def _stop_hang_watch(self) -> None:
        hang, self._hang = self._hang, None
        if hang is not None:
            hang.stop()

    def _checked(self, row: Row | None, wait: bool = False) -> list:
        """Runs the sentinels on ``row`` (and on earlier device rows now on the
        host) and records their counts (the caller holds the lock)."""
        guard = self._guard
        found = guard.ready(wait) if guard.pending else []
        if row is None:
            pass
        elif row.kind is not RowKind.VALUES:
            finite = row.kind is RowKind.FINITE_FLOATS
            found += guard.host_row(row.step, row.names, row.values, finite)
        else:
            guard.device_row(row.step, row.names, row.values)
            if wait:
                found += guard.ready(wait)
        if found:
            rows = []
            for step, name, total in guard.counted(found):
                state = self._rec.state
                if name in state:  # each metric's steps increase
                    step = max(step, int(state.steps(name)[-1]) + 1)
                self._rec.append(Row(step, (name,), (total,), RowKind.FINITE_FLOATS))
                rows.append((step, [(name, total)]))
            self._emit(rows)
        return found

    def _record_reduced(self, rows: list[Row]) -> None:
        """Records, logs and checks rows of earlier updates reduced in a batch
        (the caller holds the lock)."""
        for r in rows:
            self._rec.append(r)
            if self._guard is not None:
                self._pending_found += self._checked(r)
        self._emit([(r.step, list(zip(r.names, r.values, strict=True))) for r in rows])

    def _take_lags(self) -> None:
        """Hands the reduced arrival lags to the straggler scores, and records
        the scores of every window due (the caller holds the lock)."""
        lags = self._reducer.lags
        if lags and self._stragglers is not None:
            for entry in lags:
                self._stragglers.add(*entry)
            lags.clear()
            if self._stragglers.due():
                self._record_scores(self._stragglers.take())

    def _finish_batch(self) -> None:
        """Reduces the values still waiting in a batch and fetches every batch
        (every process calls this at the same point: close and finalize; the
        caller holds the lock)."""
        if self._reduce_host and self.log_every > 1:
            self._reducer.run_batch()
            rows, _ = self._reducer.collect(everything=True)
            if rows:
                self._record_reduced(rows)
                self._take_lags()

    def _record_scores(self, rows: list) -> None:
        """Records and logs straggler score rows (the caller holds the lock)."""
        emitted = []
        for step, values in rows:
            names, vals = tuple(values), tuple(values.values())
            self._rec.append(Row(step, names, vals, RowKind.VALUES))
            emitted.append((step, list(values.items())))
        self._emit(emitted)

    def _same_everywhere(self, wait_all: bool = False) -> None:
        """Raises ValueError (after the log has the step's line) when a value
        recorded as it is differed across processes (the caller holds the
        lock)."""
        try:
            self._reducer.check_same(wait_all)
        except ValueError:
            writer = self._out.writer
            if writer is not None:
                writer.flush()
            raise

    def _act(self, found: list) -> None:
        """Warns, calls back, or raises for the sentinels' events (not under the
        lock: a callback may record); a raise once the step's line is in the
        log."""
        error = self._guard.act(found)
        if error is not None:
            writer = self._out.writer
            if writer is not None:
                writer.flush()
            raise error

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
        self._side.attach(metrics, step)

    def _record_leftover(self, with_step_only: bool = False) -> None:
        """Records the values still attached (the caller holds the lock)."""
        state, recorded = self._side.leftover(self._rec.state, with_step_only)
        self._rec.set(state)
        self._emit(recorded)

    def _emit(self, rows: list) -> None:
        """Queues log lines of ``(step, pairs)`` recorded apart from an update."""
        out = self._out
        if rows and (out.writing or _trace_state.active() is not None):
            now = time.time()
            for step, pairs in rows:
                names, values = zip(*pairs, strict=True)
                out.add(Row(step, names, values, RowKind.VALUES, now))

    @property
    def state(self) -> HistoryState:
        """Everything recorded so far, as an immutable
        :class:`~jaxhistory.HistoryState` (later updates never change it)."""
        with self._lock:
            return self._rec.state

    @state.setter
    def state(self, state: HistoryState) -> None:
        if not isinstance(state, HistoryState):
            raise TypeError(f"state must be a HistoryState, got {type(state).__name__}")
        with self._lock:
            self._rec.set(state)

    # ----- outputs -----------------------------------------------------------------
    @property
    def log_path(self) -> Path | None:
        """Where this process streams its JSONL log (None: nowhere)."""
        return self._out.path

    @property
    def history(self) -> dict[str, np.ndarray]:
        """Every metric's values so far, by name (read-only NumPy arrays, one
        value per record; the steps are ``history.state.steps(name)``): the dict
        view of the run, as ezpz's ``History.history``. Waits for device values."""
        state = self.state
        return {name: state.values(name) for name in state.keys}

    @property
    def data(self) -> MetricsView:
        """Every metric's values so far, by full name, as a read-only mapping
        (:class:`MetricsView`; ezpz's ``History.data``, an alias of its
        ``history``): the same names and arrays as :attr:`history`, each read
        when asked for (only that metric waits for its device values). A view
        of the state when read; read it again for later updates."""
        return MetricsView(self.state)

    @data.setter
    def data(self, value: Any) -> NoReturn:
        _read_only("History.data")

    @property
    def groups(self) -> GroupsView:
        """The metrics by group, ``{group: {name: values}}`` (read-only,
        :class:`GroupsView`; ezpz's ``History.groups``): ``train/loss`` is
        ``groups["train"]["loss"]``, a name without ``/`` is in the group
        ``""``, and cross-device statistics stay with their metric
        (``groups[""]["loss/mean"]``, ``groups["train"]["loss/mean"]``)."""
        return GroupsView(self.state)

    @groups.setter
    def groups(self, value: Any) -> NoReturn:
        _read_only("History.groups")

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
        with self._lock:
            self._record_leftover(with_step_only=True)
            if self._reduce_host:  # every process flushes: the reads line up
                self._same_everywhere(wait_all=True)
                self._record_scores(self._stragglers.take(wait_all=True))
            found = self._checked(None, wait=True) if self._guard else None
            writer, feed = self._out.flush()
        if writer is not None:
            writer.flush()
        if feed is not None:  # waits a bounded time; warns naming a stuck sink
            feed.flush()
        if found:
            self._act(found)

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
        self._stop_hang_watch()
        with self._lock:
            self._finish_batch()
            self._record_leftover()
            feed = self._out.close()
        if feed is not None:
            # Not under the lock: a sink that records or closes from its write
            # must not wait on it. Bounded; a stuck sink gets a warning.
            feed.close()

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
        if outdir is None:
            if self.report_dir is None:
                raise ValueError("finalize needs an outdir (or a History report_dir)")
            outdir = self.report_dir
        self._stop_hang_watch()  # the run is over here
        if self._reduce_host:
            try:
                with self._lock:
                    self._finish_batch()
                    self._same_everywhere(wait_all=True)
            except ValueError as err:  # the run is over: the outputs still come
                warnings.warn(str(err), RuntimeWarning, stacklevel=2)
        try:
            self.flush()
        except SentinelError as err:  # the run is over: the outputs still come
            warnings.warn(f"sentinel at finalize: {err}", RuntimeWarning, stacklevel=2)
        guard = self._guard
        if guard is not None:
            for sentinel in guard.unmatched():
                warnings.warn(
                    f"{sentinel!r} matched no recorded metric (metrics are named "
                    f"like {', '.join(map(repr, self.state.keys[:3]))})",
                    RuntimeWarning,
                    stacklevel=2,
                )
        with self._lock:
            self._record_leftover()
            writer = self._out.writer
        if writer is not None:
            writer.flush()
        with self._lock:
            state = self._rec.state
            self._out.check_failed()
            # The streamed log stays where it is (also after close()); one whose
            # writing failed is written again from the state.
            streamed = self._out.streamed_path()
            stamps = self._out.timestamps(state.all_steps())
        files: list[Path] = []
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
            jsonl=streamed,
            timestamps=stamps,
            mesh=self.mesh,
            written=files,
            events=list(guard.events) if guard is not None else (),
            config=config,
            env_info=env_info,
        )
        images = [p for p in files if p.suffix == ".png"]
        for sink in self.sinks:  # e.g. W&B: the history table and the plots
            log_outputs = getattr(sink, "log_outputs", None)
            if log_outputs is not None:
                log_outputs(state, images)
        self._log_tables(state)
        return ds

    def _log_tables(self, state: HistoryState) -> None:
        """Hands ``training_history`` to every sink that takes tables; one that
        raises gets a warning naming it (the outputs are written already)."""
        takers = [s for s in self.sinks if callable(getattr(s, "log_table", None))]
        if not takers:
            return
        columns, rows = training_history(state)
        many = len(self.sinks) > 1
        for sink in takers:
            try:
                sink.log_table(TRAINING_HISTORY, columns, rows)
            except Exception as err:
                index = next(i for i, s in enumerate(self.sinks) if s is sink)
                name = sink_name(sink, index if many else None)
                warnings.warn(
                    f"sink {name}: log_table({TRAINING_HISTORY!r}) failed: {err!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )
