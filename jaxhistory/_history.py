"""History: the stateful update() -> summary line object most users touch."""

from __future__ import annotations

import array
import collections
import os
import statistics
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhistory import _memory, _trace_state
from jaxhistory._codec import read_stamps
from jaxhistory._distributed import Reducer, distributed_default, is_per_device
from jaxhistory._dtypes import as_step, host_value
from jaxhistory._env import check_run_id, check_run_name, env_flag, new_run_id
from jaxhistory._files import in_use
from jaxhistory._history_state import HistoryState, append_floats
from jaxhistory._names import STEP_KEYS, flatten
from jaxhistory._stats import Stats
from jaxhistory._summary import NonfiniteWatch, SummaryLine, memory_token
from jaxhistory._writer import Writer
from jaxhistory.export._finalize import finalize as write_outputs
from jaxhistory.export._load import load_run, run_file
from jaxhistory.export._units import MAX_PLOTS
from jaxhistory.sinks import WandbSink, is_sink, writes_here
from jaxhistory.sinks._feed import SinkFeed
from jaxhistory.sinks._jsonl import JsonlSink
from jaxhistory.sinks._wandb import wandb_run

__all__ = ["History", "distributed_default", "memory_token"]

_PY_NUMBERS = frozenset({float, int})
_FLOATS = frozenset({float})
_NESTED = frozenset({dict, list, tuple})
_is_str = str.__instancecheck__


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
            waiting and return ``""``.
        run_name: the first part of ``run_id`` (``{run_name}-{YYYYmmdd-HHMMSS}``,
            with ``-2``, ``-3``, ... where that id is taken), which names the
            JSONL log and is recorded in the outputs. A name, never a path:
            separators, ``..`` and control characters raise ValueError.
        sinks: more places each update goes (:mod:`jaxhistory.sinks`: console,
            JSONL, TensorBoard, W&B, or anything with ``write``/``flush``/``close``).
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
        total_steps, flops_per_step, peak_flops: progress. At each step that is
            a multiple of ``log_every``, to a dict update, History adds
            ``perf/steps_per_sec`` (since the previous summarized step), with
            ``total_steps`` ``perf/eta_sec`` (seconds to the last step, at the
            median time a step took over the last 32 such intervals: one slow
            interval, a compilation, does not throw it), and with
            ``flops_per_step`` (:func:`~jaxhistory.step_flops` of the compiled
            step) and ``peak_flops`` (the peak FLOP/s of every device the step
            runs on, together) ``perf/mfu``, the model FLOPs utilisation.

    With several processes and distributed history, each update that reduces
    something also records ``straggler/process`` (the process that reached the
    update last) and ``straggler/lag`` (seconds after the median process), in
    the same all-reduces as the host scalars.

    Every method may be called from any thread: updates from several threads are
    all recorded (each thread's in its order), and ``attach``, ``flush`` and
    ``close`` may run beside them.

    Example:
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
        sinks: Sequence[Any] = (),
        use_wandb: bool | None = None,
        provenance: bool = True,
        resume: str | os.PathLike | HistoryState | None = None,
        resume_step: int | None = None,
        total_steps: int | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
    ):
        if keys is not None and (
            isinstance(keys, str) or not all(isinstance(k, str) for k in keys)
        ):
            raise TypeError(f"keys must be a sequence of metric names, got {keys!r}")
        if (
            isinstance(log_every, bool)
            or not isinstance(log_every, int)
            or log_every < 1
        ):
            raise ValueError(f"log_every must be a positive int, got {log_every!r}")
        if memory is True or memory is False:
            memory = int(memory)
        elif isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
            raise ValueError(
                f"memory must be True/False or a positive int (every N updates), "
                f"got {memory!r}"
            )
        self.memory_every = memory  # 0: off
        # One lock for everything below: update, attach, flush and close may run
        # on several threads at once.
        self._lock = threading.Lock()
        self._attached: dict[str, Any] = {}  # values waiting for the next update
        self._attached_at: list[tuple[int, dict]] = []  # ... with steps of their own
        # attach() takes only this lock, never held while anything waits: a sink or
        # a timer on another thread can attach while an update waits for the writer
        self._attach_lock = threading.Lock()
        # whether the next update has memory metrics or attached values to record
        self._side = bool(memory)
        self.sinks = _sinks_here(sinks, use_wandb)
        self._sinks_open = True  # False after close(): nothing more is written
        # the user's sinks, each written from a thread of its own (started at
        # its first record): a slow or hung sink never holds the log back
        self._feed = SinkFeed(self.sinks) if self.sinks else None
        self._mem_last_step: int | None = None
        self._rss_peak = 0
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
        self.state = HistoryState()
        check_run_name(run_name)
        resumed_id = None
        if resume is not None:
            self.state, resumed_id, log = _resumed(resume, resume_step, run_name)
            if log is not None and self.jsonl_path is None and self.report_dir is None:
                self.jsonl_path = log  # the run's own log goes on
            if log is not None and self.jsonl_overwrite and self._same(log):
                raise ValueError(
                    f"jsonl_overwrite=True would erase {log}, the log this run "
                    "resumes from"
                )
        elif resume_step is not None:
            raise ValueError("resume_step needs resume= (the run to continue)")
        taken = None
        if self.report_dir is not None and self.jsonl_path is None:
            # a log of that name exists (an earlier run, or another process's
            # started in the same second): take the next id
            report_dir = self.report_dir
            taken = lambda run_id: (report_dir / f"{run_id}.jsonl").exists()
        self.run_id = resumed_id or new_run_id(run_name, taken)
        self.mesh = None  # the mesh of the per-device metrics, once one is seen
        self._updates = 0
        self._reducer = Reducer(provenance)
        # host scalars are reduced across processes: no fast path then
        self._reduce_host = self.distributed_history and self._reducer.multi_process
        self._watch = NonfiniteWatch()  # one warning per metric gone NaN/inf
        self._line = SummaryLine(self.keys, self._watch)
        # (step, wall time) per update, in arrays: no objects for the GC to scan
        self._stamp_steps = array.array("q")
        self._stamp_times = array.array("d")
        self._writer: Writer | None = None  # started by the first update it needs
        self._log: JsonlSink | None = None  # the JSONL log, one of its sinks
        self._log_path = self._jsonl_target()
        if self._log_path is not None and in_use(self._log_path):
            raise ValueError(
                f"the JSONL log {self._log_path} is being written by another live "
                "History or sink; two runs must not share one log (give this one "
                "its own jsonl_path, or close the other first)"
            )
        # Whether updates go to the writer (a JSONL log or open sinks; an active
        # trace handler is checked apart): one flag on the hot path.
        self._writing = self._log_path is not None or bool(self.sinks)
        self._streamed = False  # a log was opened at _log_path
        self._log_failed = False  # then finalize writes it again from the state

    def update(
        self,
        metrics: Mapping[str, Any],
        precision: int = 6,
        step: int | None = None,
        summarize: bool = True,
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
        label = "step"
        if (
            type(metrics) is dict
            and step is None
            and ("step" in metrics or "iter" in metrics)
        ):
            label, step, metrics = _step_entry(metrics)
        with self._lock:
            if self._progress is not None and type(metrics) is dict:
                at = self.state.next_step if step is None else step
                metrics = self._progress.add(metrics, at, self.log_every)
            fast = None
            if type(metrics) is dict and not self._reduce_host:
                # The state's fast path: the same names as earlier all-float
                # rows, and numbers again (recorded as float64, and shown so).
                fast = append_floats(self.state, metrics, step, True)
            if fast is not None:
                self.state, finite = fast
                record, step_used = metrics, self.state.next_step - 1
                host = 3 if finite else 2
            else:
                record, host, step_used = self._record_dict(metrics, step)
            if record is None:  # nested, a pytree, or values to reduce
                items = dict(flatten(metrics))
                if step is None:
                    label, step, items = _step_entry(items, label)
                record, step_used = self._record_items(list(items.items()), step)
            want_line = summarize and not (step_used % self.log_every)
            self._updates += 1
            now = time.time()
            self._stamp_steps.append(step_used)  # 16 bytes an update
            self._stamp_times.append(now)
            token, side = "", ()
            if self._side:
                token, side = self._side_values(step_used)
            if self._writing or _trace_state._stack:
                if host and not side and self._writer is not None:
                    # the caller may change its dict later: the log gets a copy
                    self._writer.add(step_used, now, record.copy(), (), host)
                else:
                    self._emit(step_used, now, record, side, host)
        if not want_line:
            return ""
        line = self._line.format(label, step_used, record, precision, host)
        return f"{line} {token}" if token else line

    def _record_dict(self, metrics: Any, step: int | None):
        """Records a flat dict that needs no reduction as it is (the common case).
        Returns (the dict recorded, 2 if every value is a Python float, 1 if
        every one is a Python number, else 0, the step), or Nones where this does
        not apply. (3, from the state's fast path in :meth:`update`: finite
        Python floats.)"""
        if type(metrics) is not dict or not all(map(_is_str, metrics)):
            return None, False, None  # (names that are not str: flatten's, "1")
        types = set(map(type, metrics.values()))
        host = 2 if types == _FLOATS else 1 if types <= _PY_NUMBERS else 0
        if not host:
            if _NESTED.intersection(types) or Stats in types:
                return None, False, None
            if self.distributed_history and (
                self._reducer.multi_process
                or any(is_per_device(v) for v in metrics.values())
            ):
                return None, False, None
        elif self.distributed_history and self._reducer.multi_process:
            return None, False, None  # host scalars are reduced across processes
        new = self.state.update(metrics, step=step)
        if not host and self.mesh is None:
            self._note_mesh(metrics.values())
        self.state = new
        if step is None:
            step_used = new.next_step - 1
        else:
            step_used = step if type(step) is int else as_step("step", step)
            if "step" in metrics:  # checked to agree with step: not a metric
                metrics = {k: v for k, v in metrics.items() if k != "step"}
        return metrics, host, step_used

    def _record_items(self, items: list[tuple[str, Any]], step: int | None):
        """Records flattened items, reducing across devices (and processes) what
        needs it, as one :class:`~jaxhistory.Stats` named ``{name}/{stat}``.
        Returns the dict recorded and the step."""
        plain, reduce = (
            self._reducer.split(items) if self.distributed_history else (items, [])
        )
        record = dict(plain)
        if reduce:
            stats, straggler, mesh = self._reducer.reduce(reduce)
            if mesh is not None and self.mesh is None:
                self.mesh = mesh
            # Where the first reduced value was, so the summary keeps the order.
            first = next(i for i, (n, _) in enumerate(items) if n == reduce[0][0])
            kept = [(n, v) for n, v in items[:first] if n in record]
            record = {**dict(kept), "": stats, **record, **straggler}
        new = self.state.update(record, step=step)
        if self.mesh is None:
            self._note_mesh(record.values())
        self.state = new
        step_used = new.next_step - 1 if step is None else as_step("step", step)
        if step is not None:
            record.pop("step", None)  # checked to agree with step: not a metric
        return record, step_used

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

        Example:
            >>> import jaxhistory as jh
            >>> h = jh.History(distributed_history=False)
            >>> h.attach({"timing": {"data": 0.25}})
            >>> h.update({"loss": 0.5}, step=3)
            'step=3 loss=0.500000'
            >>> h.state.steps("timing/data").tolist()
            [3]
        """
        # Checked here, so a bad value fails this call and never costs the
        # good values already waiting.
        items = {n: host_value(n, v)[0] for n, v in flatten(metrics)}
        if step is not None:
            step = as_step("step", step)
        with self._attach_lock:
            if step is None:
                self._attached.update(items)
            elif items:
                self._attached_at.append((step, items))
            self._side = self._side or bool(items)

    def _side_values(self, step: int) -> tuple[str, tuple]:
        """Memory metrics and attached values, recorded locally at ``step`` (or at
        their own steps, emitted apart). Returns the memory token and the
        (name, value) pairs that join this update's log line."""
        token, side = self._memory(step) if self.memory_every else ("", ())
        with self._attach_lock:
            waiting, self._attached = self._attached, {}
            at, self._attached_at = self._attached_at, []
            self._side = bool(self.memory_every)
        if waiting or at:
            now_items, earlier = self._record_attached(waiting, at, step)
            side = (*side, *now_items)
            if self._writing or _trace_state._stack:
                for at, pairs in earlier:  # attached with a step of their own
                    self._emit(at, time.time(), dict(pairs))
        return token, side

    def _record_attached(self, waiting: dict, at: list, step: int):
        """Records attached values taken from the queue: ``waiting`` at ``step``,
        ``at`` at their own steps. Returns (pairs recorded at ``step``,
        [(step, pairs)])."""
        now_items: tuple = ()
        if waiting and self._record_local(waiting, step):
            now_items = tuple(waiting.items())
        earlier = [(s, list(v.items())) for s, v in at if self._record_local(v, s)]
        return now_items, earlier

    def _record_local(self, values: dict, step: int) -> bool:
        try:
            self.state = self.state.update(values, step=step)
        except (TypeError, ValueError) as err:  # e.g. already recorded there
            warnings.warn(
                f"attached values {sorted(values)} were not recorded at step "
                f"{step}: {err}",
                RuntimeWarning,
                stacklevel=5,
            )
            return False
        return True

    def _record_leftover(self, with_step_only: bool = False) -> None:
        """Values still attached (at flush: only those with a step of their own):
        those without a step at the latest step (no new step where the other
        metrics would be NaN), or at the next one where one of them already has
        a record there. The caller holds the lock."""
        with self._attach_lock:
            if not (self._attached or self._attached_at):
                return
            waiting: dict[str, Any] = {}
            if not with_step_only:
                waiting, self._attached = self._attached, {}
            at, self._attached_at = self._attached_at, []
            self._side = bool(self.memory_every or self._attached)
        state = self.state
        step = max(state.next_step - 1, 0)
        for name in waiting:
            last = state.last_step(name) if name in state else None
            if last is not None and last >= step:
                step = state.next_step
                break
        now_items, earlier = self._record_attached(waiting, at, step)
        if self._writing or _trace_state._stack:
            now = time.time()
            for at_step, pairs in earlier:
                self._emit(at_step, now, dict(pairs))
            if now_items:
                self._emit(step, now, dict(now_items))

    def _memory(self, step: int) -> tuple[str, tuple]:
        """Records ``mem/*`` at ``step`` every ``memory_every`` updates; returns the
        summary token and the (name, value) pairs for the log (empty when not
        due)."""
        if (self._updates - 1) % self.memory_every:
            return "", ()
        if self._mem_last_step is not None and step <= self._mem_last_step:
            return "", ()  # an update at an earlier step (another metric's cadence)
        rss = _memory.host_rss()
        self._rss_peak = max(self._rss_peak, rss)
        sample = _memory.device_memory()
        mem = {"mem/host_rss": rss, "mem/device_in_use": sample.in_use}
        if sample.peak is not None:
            mem["mem/device_peak"] = sample.peak
        self.state = self.state.update(mem, step=step)
        self._mem_last_step = step
        return memory_token(sample, rss, self._rss_peak), tuple(mem.items())

    # ----- outputs -----------------------------------------------------------------
    def _same(self, log: Path) -> bool:
        return self.jsonl_path is not None and Path(self.jsonl_path) == log

    def _jsonl_target(self) -> Path | None:
        """Where this process streams its JSONL log, or None.

        ``jsonl_path`` if given (each process writes its own file when the path
        holds ``{process_index}``, else only process 0 writes), else
        ``{report_dir}/{run_id}.jsonl`` on process 0 when ``report_dir`` is given.
        """
        index = jax.process_index()
        if self.jsonl_path is not None:
            text = str(self.jsonl_path)
            if "{process_index}" in text:
                return Path(text.replace("{process_index}", str(index)))
            return self.jsonl_path if index == 0 else None
        if self.report_dir is not None and index == 0:
            return self.report_dir / f"{self.run_id}.jsonl"
        return None

    def _timestamps(self, state: HistoryState) -> dict[int, float]:
        """Step -> wall time of the updates (the first at a step), for the
        dataset's time coordinate and a log written from the state; the log's
        times for steps this History did not record (a resumed run's)."""
        steps, times = self._stamp_steps, self._stamp_times
        stamps = dict(zip(reversed(steps), reversed(times), strict=True))
        path = self._log_path
        if (
            path is not None
            and path.is_file()
            and not stamps.keys() >= set(state.all_steps().tolist())
        ):
            for step, stamp in read_stamps(path).items():
                stamps.setdefault(step, stamp)
        return stamps

    def _note_mesh(self, values) -> None:
        """Remembers the mesh of the first sharded value seen (for the outputs)."""
        for value in values:
            array = value.table if isinstance(value, Stats) else value
            mesh = getattr(getattr(array, "sharding", None), "mesh", None)
            if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1:
                self.mesh = mesh
                return

    def _emit(self, step, now, metrics: dict, side=(), host=False) -> None:
        """Queues one log line for the writer (the caller holds the lock):
        ``metrics`` as recorded (Stats among them are written as aggregated
        values), then the (name, value) pairs of ``side``. ``host``: every value
        is a Python number."""
        if self._writer is None:
            self._start_writer()
        stats: tuple = ()
        if not host and Stats in set(map(type, metrics.values())):
            stats = tuple(
                (f"{n}/" if n else "", v)
                for n, v in metrics.items()
                if type(v) is Stats
            )
            metrics = {n: v for n, v in metrics.items() if type(v) is not Stats}
        else:
            metrics = metrics.copy()  # the caller may change its dict later
        if side:
            metrics.update(side)
            host = False
        self._writer.add(step, now, metrics, stats, host)

    def _start_writer(self) -> None:
        if self._log_path is not None and self._log is None:
            try:
                self._log = JsonlSink(self._log_path, overwrite=self.jsonl_overwrite)
                self._streamed = True
            except OSError as err:  # the step is recorded; only the log stops
                warnings.warn(
                    f"cannot write the JSONL log {self._log_path} ({err}); "
                    "finalize will write it from the history instead",
                    RuntimeWarning,
                    stacklevel=5,
                )
                self._log_path = None
                self._log_failed = True
                self._writing = bool(self._live_sinks())
        feed = self._feed if self._live_sinks() else None
        sinks = [self._log] if self._log is not None else []
        self._writer = Writer(sinks, self._watch.check, run_id=self.run_id, feed=feed)
        # Writes what is queued when this History goes (or at exit), and hands
        # it to the sinks, whose threads then close them and end.
        weakref.finalize(self, _close_quietly, self._writer, feed)

    def _live_sinks(self) -> tuple:
        return self.sinks if self._sinks_open else ()

    @property
    def history(self) -> dict[str, np.ndarray]:
        """Every metric's values so far, by name (read-only NumPy arrays, one
        value per record; the steps are ``history.state.steps(name)``): the dict
        view of the run, as ezpz's ``History.history``. Waits for device values."""
        state = self.state
        return {name: state.values(name) for name in state.keys}

    def flush(self) -> None:
        """Writes the queued JSONL lines and sink records now (waiting for their
        device values), then flushes the sinks, waiting for them at most
        :attr:`SinkFeed.TIMEOUT <jaxhistory.sinks._feed.SinkFeed.TIMEOUT>`
        seconds (5) in all: a sink that does not finish by then gets a warning
        naming it."""
        with self._lock:
            self._record_leftover(with_step_only=True)
            writer = self._writer
            feed = self._feed if self._live_sinks() else None
        if writer is not None:
            writer.flush()
        if feed is not None:  # waits a bounded time; warns naming a stuck sink
            feed.flush()

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
        feed = None
        with self._lock:
            self._record_leftover()
            if self._writer is not None:
                self._writer.close()
                if self._writer.dropped:
                    self._log_failed = True
                self._writer = None
            if self._log is not None:
                self._log.close()
                self._log_failed |= self._log.error is not None
                self._log = None
                self.jsonl_overwrite = False
            if self._sinks_open:
                feed, self._sinks_open = self._feed, False
            self._writing = self._log_path is not None
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
    ):
        """Writes every output of the run into ``outdir``; returns the dataset.

        See :func:`jaxhistory.export.finalize` for what is written where. In a
        multi-process run only process 0 writes; every process returns the
        dataset. ``outdir`` defaults to ``report_dir``. Called on another
        thread while updates run, it writes the steps recorded when it began.
        """
        if outdir is None:
            if self.report_dir is None:
                raise ValueError("finalize needs an outdir (or a History report_dir)")
            outdir = self.report_dir
        self.flush()
        with self._lock:
            self._record_leftover()
            writer = self._writer
        if writer is not None:
            writer.flush()
        with self._lock:
            state = self.state
            if self._log is not None and self._log.error is not None:
                self._log_failed = True
            if writer is not None and writer.dropped:
                self._log_failed = True
            # The streamed log stays where it is (also after close()); one whose
            # writing failed is written again from the state.
            streamed = self._log_path if self._streamed else None
            if self._log_failed:
                streamed = None
            stamps = self._timestamps(state)
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
        )
        images = [p for p in files if p.suffix == ".png"]
        for sink in self.sinks:  # e.g. W&B: the history table and the plots
            log_outputs = getattr(sink, "log_outputs", None)
            if log_outputs is not None:
                log_outputs(state, images)
        return ds


def _close_quietly(writer: Writer, feed: SinkFeed | None) -> None:
    """Closes ``writer`` (the log) and then ``feed`` (the sinks, bounded by
    :attr:`SinkFeed.TIMEOUT`) for a History dropped, or alive at exit, without
    :meth:`History.close`."""
    writer.close()
    if feed is not None:
        feed.close()


def _step_entry(metrics: dict, label: str = "step") -> tuple[str, Any, dict]:
    """(label, step, the rest) for a dict whose ``step`` (or ``iter``) entry is
    the step; ``(label, None, metrics)`` when it has none."""
    for key in STEP_KEYS:
        if key in metrics:
            step = as_step(key, metrics[key])
            return key, step, {k: v for k, v in metrics.items() if k != key}
    return label, None, metrics


class Progress:
    """Steps per second, the time left and the model FLOPs utilisation, added
    to the metrics of summarized steps.

    ``perf/steps_per_sec`` is the rate since the previous summarized step;
    ``perf/eta_sec`` uses the median time a step took over the last
    :attr:`WINDOW` intervals, so one slow interval (a compilation, an
    evaluation, a checkpoint) does not throw it.
    """

    WINDOW = 32  # intervals the time left is estimated from

    def __init__(
        self,
        total: int | None,
        flops: float | None,
        peak: float | None,
        clock: Any = None,
    ):
        self.total, self.flops, self.peak = total, flops, peak
        self.clock = clock  # None: time.perf_counter
        self.last: tuple[int, float] | None = None
        self.per_step: collections.deque[float] = collections.deque(
            maxlen=self.WINDOW
        )  # seconds a step took, one entry per interval

    @classmethod
    def of(cls, total, flops, peak) -> Progress | None:
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int) or total < 1
        ):
            raise ValueError(f"total_steps must be a positive int, got {total!r}")
        for name, value in (("flops_per_step", flops), ("peak_flops", peak)):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not value > 0
                or value == float("inf")
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if (flops is None) != (peak is None):
            raise ValueError(
                "MFU needs both flops_per_step (jaxhistory.step_flops of the step) "
                "and peak_flops (the devices' peak FLOP/s)"
            )
        if total is None and flops is None:
            return None
        return cls(total, flops, peak)

    def add(self, metrics: dict, step: int, log_every: int) -> dict:
        if not isinstance(step, int) or step % log_every:
            return metrics
        now = time.perf_counter() if self.clock is None else self.clock()
        last, self.last = self.last, (step, now)
        if last is None or step <= last[0] or now <= last[1]:
            return metrics  # the first line: no rate yet
        rate = (step - last[0]) / (now - last[1])
        out = {**metrics, "perf/steps_per_sec": rate}
        if self.total is not None:
            self.per_step.append((now - last[1]) / (step - last[0]))
            out["perf/eta_sec"] = max(self.total - step, 0) * statistics.median(
                self.per_step
            )
        if self.flops is not None:
            out["perf/mfu"] = rate * self.flops / self.peak
        return out


def _resumed(resume: Any, resume_step: int | None, run_name: str | None):
    """(state, run id, log) of the run ``resume`` names: a HistoryState, a JSONL
    log (the run id on its lines, else its name; History goes on appending to
    it), a dataset file or a finalize folder; records at ``resume_step`` and
    later are left out (the steps a restart from an earlier checkpoint records
    again)."""
    log = None
    if isinstance(resume, HistoryState):
        state, run_id = resume, dict(resume.attrs).get("run_id")
        source = "the HistoryState given as resume"
    elif isinstance(resume, str | os.PathLike):
        try:
            state, attrs = load_run(resume)  # as `jaxhistory report` reads a run
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"resume: no run log or dataset at {resume} ({err})"
            ) from None
        path = source = run_file(resume)
        if path.suffix == ".jsonl":  # the run id of its lines (older logs: its name)
            run_id, log = attrs.get("run_id") or path.stem, path
        else:
            run_id = attrs.get("run_id")
    else:
        raise TypeError(
            "resume takes a HistoryState, a JSONL log, a dataset file or a finalize "
            f"folder, got {type(resume).__name__}"
        )
    check_run_id(run_id, source)  # it names the log: never a path
    if run_name is not None:
        raise ValueError(
            "resume continues the run with its own run id; give run_name only to a "
            "new run"
        )
    if resume_step is not None:
        step = as_step("resume_step", resume_step)
        state = state.before(step)
    return state, run_id, log


def _sinks_here(sinks: Sequence[Any], use_wandb: bool | None) -> tuple:
    """The sinks this process writes to (process 0 only, unless a sink says
    ``all_processes``), with a W&B sink added when ``use_wandb`` asks for one."""
    if isinstance(sinks, str) or not isinstance(sinks, Sequence):
        raise TypeError(f"sinks must be a sequence of sinks, got {sinks!r}")
    for sink in sinks:
        if not is_sink(sink):
            raise TypeError(
                f"{type(sink).__name__} is not a sink: it needs write, flush and close"
            )
    if use_wandb not in (None, True, False):
        raise ValueError(f"use_wandb must be True, False or None, got {use_wandb!r}")
    out = list(sinks)
    first = jax.process_index() == 0
    wanted = use_wandb is True or (
        use_wandb is None and wandb_run() is not None and not env_flag("WANDB_DISABLED")
    )
    if wanted and first and not any(isinstance(s, WandbSink) for s in out):
        out.append(WandbSink())  # on process 0, where the run is
    return tuple(s for s in out if writes_here(s))
