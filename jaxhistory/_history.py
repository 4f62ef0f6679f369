"""History: the stateful update() -> summary line object most users touch."""

from __future__ import annotations

import array
import math
import os
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhistory import _memory, _trace_state
from jaxhistory._history_state import HistoryState, _append_floats
from jaxhistory._dtypes import NESTED, STEP_KEYS, as_step, flatten
from jaxhistory._stats import Stats, distributed_stats, stat_names
from jaxhistory.export._env import new_run_id
from jaxhistory.export._jsonl import JsonlStream

__all__ = ["COUNTER_KEYS", "DISTRIBUTED_LIMIT", "History", "distributed_default"]

COUNTER_KEYS = ("step", "epoch", "iter")
DISTRIBUTED_LIMIT = 384  # devices; above this the per-update all-reduce is off
_OFF_VARS = ("JAXHISTORY_NO_DISTRIBUTED_HISTORY", "JAXHISTORY_LOCAL_HISTORY")


def _env_flag(name: str) -> bool:
    """An on/off environment variable: 1/true/yes/on, or 0/false/no/off/empty (not
    set); anything else is a ValueError naming the variable."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/true/yes or 0/false/no")


def distributed_default() -> bool:
    """Whether distributed history is on when not set explicitly.

    Off when ``JAXHISTORY_NO_DISTRIBUTED_HISTORY`` or ``JAXHISTORY_LOCAL_HISTORY``
    is 1/true/yes, or when there are more than 384 devices (the all-reduce per
    update costs too much there); on otherwise.

    Example:
        >>> import jaxhistory as jh
        >>> jh.distributed_default()  # 8 devices here, no variable set
        True
    """
    if any(_env_flag(v) for v in _OFF_VARS):
        return False
    return jax.device_count() <= DISTRIBUTED_LIMIT


def _is_per_device(value: Any) -> bool:
    return (
        isinstance(value, jax.Array)
        and value.ndim >= 1
        and not value.sharding.is_fully_replicated
    )


def _format(value: Any, precision: int, counter: bool) -> str:
    if type(value) is float and not counter:
        return f"{value:.{precision}f}"
    if type(value) is int:
        return str(value)
    arr = np.asarray(value)
    if arr.ndim:
        if arr.size <= 4:
            return "[" + ",".join(_format(v, precision, counter) for v in arr) + "]"
        return f"{_format(arr.mean(), precision, False)}(mean of {arr.size})"
    if counter or arr.dtype.kind in "iub":
        if arr.dtype.kind == "f" and not math.isfinite(float(arr)):
            return str(float(arr))
        return str(int(arr))
    return f"{float(arr):.{precision}f}"


class History:
    """Records metrics step by step and returns a one-line summary of each update.

    Args:
        keys: metric names to show first, in this order, in the summary line.
        distributed_history: reduce per-device values (sharded JAX arrays) and, with
            several processes, per-process host scalars into ``name/mean``,
            ``name/max``, ``name/min`` and ``name/std`` across all devices or
            processes, in one fused jitted call per update (two all-reduces).
            Every process must then call :meth:`update`. ``None`` picks
            :func:`distributed_default`.
        report_dir: the default ``outdir`` of :meth:`finalize`; the JSONL log is
            streamed to ``{report_dir}/{run_id}.jsonl`` when no ``jsonl_path`` is
            given.
        report_enabled: whether :meth:`finalize` writes the markdown report.
        jsonl_path: stream the JSONL log here during the run (one line per update,
            written about twice a second from a background thread). Written by
            process 0 only, unless the path holds ``{process_index}``, which gives
            each process its own file.
        jsonl_overwrite: truncate an existing JSONL log instead of appending to it
            (appending continues a resumed run).
        log_every: summarize (and so wait for device values) only every N updates;
            the others record without waiting and return ``""``.
        run_name: the first part of ``run_id`` (``{run_name}-{YYYYmmdd-HHMMSS}``),
            which names the JSONL log and is recorded in the outputs.
        sinks: more places each update goes (:mod:`jaxhistory.sinks`: console,
            JSONL, TensorBoard, W&B, or anything with ``write``/``flush``/``close``).
            A background thread hands them each update as a
            :class:`~jaxhistory.sinks.Record` once its device values are on the
            host; ``update`` never waits for them. Process 0 only, unless a sink
            has ``all_processes = True``. :meth:`flush` flushes them,
            :meth:`close` closes them.
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
        self._attached: dict[str, Any] = {}  # values waiting for the next update
        self._attached_at: list[tuple[int, dict]] = []  # ... with steps of their own
        self._attach_lock = threading.Lock()
        self.sinks = _sinks_here(sinks, use_wandb)
        self._sinks_open = True  # False after close(): nothing more is written
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
        self.state = HistoryState()
        self.run_id = new_run_id(run_name)
        self.mesh = None  # the mesh of the per-device metrics, once one is seen
        self._updates = 0
        self._multi_process = jax.process_count() > 1
        self._stats_fn = jax.jit(distributed_stats)
        # (step, wall time) per update, in arrays: no objects for the GC to scan
        self._stamp_steps = array.array("q")
        self._stamp_times = array.array("d")
        self._stream: JsonlStream | None = None
        self._stream_path = self._jsonl_target()
        # Whether updates go to the background writer (a JSONL log or open sinks;
        # an active trace handler is checked apart): one flag on the hot path.
        self._writing = self._stream_path is not None or bool(self.sinks)
        self._streamed = False  # a log was opened at _stream_path
        self._stream_failed = False

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
        """
        if type(precision) is not int or precision < 0:
            raise ValueError(f"precision must be a non-negative int, got {precision!r}")
        label = "step"
        if type(metrics) is dict and step is None:
            # A step entry is the step: parse it once, and record the rest (which
            # lets rows with a step entry take the fast path).
            for key in STEP_KEYS:
                if key in metrics:
                    label, step = key, as_step(key, metrics[key])
                    metrics = {k: v for k, v in metrics.items() if k != key}
                    break
        new = None
        if type(metrics) is dict:
            if not (self._multi_process and self.distributed_history):
                new = _append_floats(self.state, metrics, step)  # the common case
            if new is None and self._simple(metrics):
                # Nothing to reduce or flatten: record the dict as it is.
                new = self.state.update(metrics, step=step)
                if self.mesh is None and len(new.data.tables) > len(
                    self.state.data.tables
                ):  # a new key set: look for the mesh once
                    self._note_mesh(metrics.values())
        if new is None:
            return self._update(metrics, precision, step, summarize, label)
        step_used = new.next_step - 1 if step is None else as_step("step", step)
        self.state = new
        want_line = summarize and not (self._updates % self.log_every)
        self._updates += 1
        now = time.time()
        self._stamp_steps.append(step_used)
        self._stamp_times.append(now)
        side = self.memory_every or self._attached or self._attached_at
        fanout = self._writing or _trace_state._stack
        if not (side or fanout or want_line):
            return ""  # the common case: recorded, nothing else to do
        # With an explicit step, a "step" entry (checked to agree) is not a metric.
        items = [(n, v) for n, v in metrics.items() if n != "step"]
        token = (
            self._after_record(step_used, items, None, now) if (side or fanout) else ""
        )
        if not want_line:
            return ""
        order = [n for n, _ in items]
        line = self._line(order, items, (), None, (label, step_used), precision)
        return f"{line} {token}" if token else line

    def _after_record(self, step: int, plain, aggregated, now: float) -> str:
        """After an update is recorded: memory metrics and attached values (both
        recorded locally, at ``step``), then the line for the log, the sinks and
        an active trace handler. Returns the memory summary token, if any."""
        token, side = self._memory(step) if self.memory_every else ("", ())
        earlier = ()
        if self._attached or self._attached_at:
            now_items, earlier = self._record_attached(step)
            side = (*side, *now_items)
        if self._writing or _trace_state._stack:
            for at, items in earlier:  # attached with a step of their own
                self._emit(at, items)
            self._emit(step, [*plain, *side], aggregated, now)
        return token

    def _simple(self, metrics: dict) -> bool:
        """A flat dict whose values need no cross-device or cross-process reduction."""
        types = set(map(type, metrics.values()))
        if NESTED.intersection(types):
            return False
        if not self.distributed_history:
            return True
        if self._multi_process:
            return False  # host values are reduced across processes
        return not any(issubclass(t, jax.Array) for t in types) or not any(
            _is_per_device(v) for v in metrics.values()
        )

    def _update(self, metrics, precision, step, summarize, label="step") -> str:
        items = flatten(metrics)
        counters = {n: v for n, v in items if n in COUNTER_KEYS}
        if step is None:
            for key in STEP_KEYS:
                if key in counters:
                    step, label = as_step(key, counters[key]), key
                    items = [(n, v) for n, v in items if n != key]
                    break
        plain, reduce = self._split(items)
        state = self.state
        state = state.update(dict(plain), step=step)
        step_used = state.next_step - 1 if step is None else as_step("step", step)
        names: tuple[str, ...] = ()
        if reduce:
            names, packed = self._reduce(reduce)
            state = state.update_packed(names, packed, step=step_used)
        self.state = state
        self._updates += 1
        now = time.time()
        self._stamp_steps.append(step_used)
        self._stamp_times.append(now)
        aggregated = (names, packed) if reduce else None
        token = self._after_record(step_used, plain, aggregated, now)
        if not summarize or (self._updates - 1) % self.log_every:
            return ""
        order = [n for n, _ in items]
        packed = packed if reduce else None
        line = self._line(order, plain, names, packed, (label, step_used), precision)
        return f"{line} {token}" if token else line

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

        Example:
            >>> import jaxhistory as jh
            >>> h = jh.History(distributed_history=False)
            >>> h.attach({"timing": {"data": 0.25}})
            >>> h.update({"loss": 0.5}, step=3)
            'step=3 loss=0.500000'
            >>> h.state.steps("timing/data").tolist()
            [3]
        """
        items = dict(flatten(metrics))
        if step is not None:
            step = as_step("step", step)
        with self._attach_lock:
            if step is None:
                self._attached.update(items)
            elif items:
                self._attached_at.append((step, items))

    def _record_attached(self, step: int) -> tuple[tuple, list]:
        """Records the attached values: those without a step at ``step``, the
        others at theirs. Returns (pairs recorded at ``step``, [(step, pairs)])."""
        with self._attach_lock:
            waiting, self._attached = self._attached, {}
            at, self._attached_at = self._attached_at, []
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
        a record there."""
        if not (self._attached or self._attached_at):
            return
        state = self.state
        step = max(state.next_step - 1, 0)
        with self._attach_lock:
            names = list(self._attached)
            if with_step_only:
                held, self._attached = self._attached, {}
        for name in names:
            last = state.last_step(name) if name in state else None
            if last is not None and last >= step:
                step = state.next_step
                break
        now_items, earlier = self._record_attached(step)
        if with_step_only:
            with self._attach_lock:
                self._attached = {**held, **self._attached}
        if self._writing or _trace_state._stack:
            for at, items in earlier:
                self._emit(at, items)
            if now_items:
                self._emit(step, list(now_items))

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

    def _timestamps(self) -> dict[int, float]:
        return dict(zip(self._stamp_steps, self._stamp_times, strict=True))

    def _note_mesh(self, values) -> None:
        """Remembers the mesh of the first sharded value seen (for the outputs)."""
        for value in values:
            array = value.table if isinstance(value, Stats) else value
            mesh = getattr(getattr(array, "sharding", None), "mesh", None)
            if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1:
                self.mesh = mesh
                return

    def _emit(self, step: int, plain, aggregated=None, timestamp=None) -> None:
        if self._stream is None:
            try:
                self._stream = JsonlStream(
                    self._stream_path, self.jsonl_overwrite, sinks=self._live_sinks()
                )
            except OSError as err:  # the step is recorded; only the log stops
                warnings.warn(
                    f"cannot write the JSONL log {self._stream_path} ({err}); "
                    "finalize will write it from the history instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._stream_path = None
                self._stream_failed = True
                self._writing = bool(self._live_sinks())
                self._stream = JsonlStream(None, sinks=self._live_sinks())
            self._streamed = self._stream_path is not None
            # Closes the log (writing what is queued) when this History goes.
            weakref.finalize(self, self._stream.close)
        self._stream.add(step, plain, aggregated, timestamp)
        if self._stream.error is not None:
            self._stream_failed = True

    def _live_sinks(self) -> tuple:
        return self.sinks if self._sinks_open else ()

    def flush(self) -> None:
        """Writes the queued JSONL lines and sink records now (waiting for their
        device values), then flushes the sinks."""
        self._record_leftover(with_step_only=True)
        if self._stream is not None:
            self._stream.flush()
        for sink in self._live_sinks():
            sink.flush()

    def close(self) -> None:
        """Records values still attached, writes the queued JSONL lines, closes
        the log and closes the sinks (nothing more is written to them; a W&B
        sink still logs the outputs at :meth:`finalize`). Recording may go on (a
        later update reopens the log in append mode)."""
        self._record_leftover()
        if self._stream is not None:
            self._stream.close()
            self._stream_failed |= self._stream.error is not None
            self._stream = None
            self.jsonl_overwrite = False
        if self._sinks_open:
            for sink in self.sinks:
                sink.close()
            self._sinks_open = False
        self._writing = self._stream_path is not None

    def finalize(
        self,
        outdir: str | os.PathLike | None = None,
        run_name: str | None = None,
        warmup: float = 0.0,
        num_chains: int = 128,
        plot: bool = True,
        save: bool = True,
    ):
        """Writes every output of the run into ``outdir``; returns the dataset.

        See :func:`jaxhistory.export.finalize` for what is written where. In a
        multi-process run only process 0 writes; every process returns the
        dataset. ``outdir`` defaults to ``report_dir``.
        """
        from jaxhistory.export._finalize import finalize

        if outdir is None:
            if self.report_dir is None:
                raise ValueError("finalize needs an outdir (or a History report_dir)")
            outdir = self.report_dir
        began = time.time() - 0.05  # file times are a little coarser
        self._record_leftover()
        self.flush()
        if self._stream is not None and self._stream.error is not None:
            self._stream_failed = True
        # The streamed log stays where it is (also after close()); one whose
        # writing failed is written again from the state.
        streamed = self._stream_path if self._streamed else None
        if self._stream_failed:
            streamed = None
        ds = finalize(
            self.state,
            outdir,
            run_id=self.run_id,
            run_name=run_name,
            warmup=warmup,
            num_chains=num_chains,
            plot=plot,
            save=save,
            report=self.report_enabled,
            jsonl=streamed,
            timestamps=None if streamed else self._timestamps(),
            mesh=self.mesh,
        )
        for sink in self.sinks:  # e.g. W&B: the history table and the plots
            log_outputs = getattr(sink, "log_outputs", None)
            if log_outputs is not None:
                # The PNGs this finalize wrote (not those of an earlier one).
                mplot = Path(outdir) / "plots" / "mplot"
                images = [
                    p for p in sorted(mplot.glob("*.png")) if p.stat().st_mtime >= began
                ]
                log_outputs(self.state, images if plot else [])
        return ds

    # ----- distributed history -------------------------------------------------
    def _split(self, items: list[tuple[str, Any]]):
        """(recorded as they are, reduced across devices/processes)."""
        if not self.distributed_history:
            return items, []
        multi = jax.process_count() > 1
        plain, reduce = [], []
        for name, value in items:
            if name in COUNTER_KEYS:
                plain.append((name, value))
            elif _is_per_device(value) or (
                multi and not isinstance(value, jax.Array) and np.ndim(value) == 0
            ):
                reduce.append((name, value))
            else:
                plain.append((name, value))
        return plain, reduce

    def _reduce(self, items: list[tuple[str, Any]]) -> tuple[tuple[str, ...], Any]:
        names = [n for n, _ in items]
        if jax.process_count() > 1:
            self._check_same_names(names)
        meshes = [v.sharding.mesh for _, v in items if isinstance(v, jax.Array)]
        mesh = meshes[0] if meshes else jax.sharding.Mesh(jax.devices(), ("devices",))
        if meshes and self.mesh is None:
            self.mesh = mesh
        metrics = {}
        for name, value in items:
            if isinstance(value, jax.Array):
                metrics[name] = value
            else:
                metrics[name] = _per_process_array(name, value, mesh)
        stats = self._stats_fn(metrics)
        # Stat-major, the order of the (4, K) table: a/mean, b/mean, ..., a/max, ...
        return stat_names(stats.names), stats.table

    @staticmethod
    def _check_same_names(names: list[str]) -> None:
        from jax.experimental import multihost_utils

        digest = zlib.crc32("\0".join(sorted(names)).encode())
        everyone = np.asarray(
            multihost_utils.process_allgather(np.array([digest, len(names)], np.int64))
        ).reshape(-1, 2)
        if len(set(map(tuple, everyone.tolist()))) > 1:
            raise ValueError(
                f"processes passed different metrics to History.update (process "
                f"{jax.process_index()} has {sorted(names)}); every process must "
                "record the same names for distributed history"
            )

    # ----- summary line ----------------------------------------------------------
    def _line(self, order, plain, names, packed, step, precision) -> str:
        values = dict(plain)
        host_packed = None
        if packed is not None:
            host_packed = np.asarray(jax.device_get(packed))
        device = {k: v for k, v in values.items() if isinstance(v, jax.Array | Stats)}
        if device:
            values.update(jax.device_get(device))
        parts = {}
        parts[step[0]] = str(step[1])
        by_name = {}
        if host_packed is not None:
            by_name = dict(zip(names, host_packed.ravel().tolist(), strict=True))
        for name in order:
            if isinstance(values.get(name), Stats):  # statistics from the step
                stats = values[name]
                for metric in stats.names:
                    key = f"{name}/{metric}" if metric else name
                    mean = float(stats[f"{metric}/mean" if metric else "mean"])
                    std = float(stats[f"{metric}/std" if metric else "std"])
                    parts[key] = f"{mean:.{precision}f}(±{std:.{precision}f})"
            elif name in values:
                parts[name] = _format(values[name], precision, name in COUNTER_KEYS)
            elif f"{name}/mean" in by_name:
                mean, std = by_name[f"{name}/mean"], by_name[f"{name}/std"]
                parts[name] = f"{mean:.{precision}f}(±{std:.{precision}f})"
        first = [k for k in ("step", "epoch", "iter") if k in parts]
        first += [k for k in self.keys if k in parts and k not in first]
        return " ".join(
            f"{k}={parts[k]}" for k in [*first, *(k for k in parts if k not in first)]
        )


def _sinks_here(sinks: Sequence[Any], use_wandb: bool | None) -> tuple:
    """The sinks this process writes to (process 0 only, unless a sink says
    ``all_processes``), with a W&B sink added when ``use_wandb`` asks for one."""
    from jaxhistory.sinks import WandbSink, is_sink, writes_here
    from jaxhistory.sinks._wandb import wandb_run

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
        use_wandb is None
        and wandb_run() is not None
        and not _env_flag("WANDB_DISABLED")
    )
    if wanted and first and not any(isinstance(s, WandbSink) for s in out):
        out.append(WandbSink())  # on process 0, where the run is
    return tuple(s for s in out if writes_here(s))


def memory_token(sample: _memory.MemorySample, rss: int, rss_peak: int = 0) -> str:
    """``memory=X.XX/Y.YYGiB``: device memory in use and its peak where the backend
    reports a peak, else host RSS and its peak over the updates so far."""
    if sample.peak is not None:
        now, peak = sample.in_use, sample.peak
    else:
        now, peak = rss, max(rss, rss_peak)
    return f"memory={now / 2**30:.2f}/{peak / 2**30:.2f}GiB"


def _per_process_array(name: str, value: Any, mesh: jax.sharding.Mesh) -> jax.Array:
    """A global array over ``mesh`` holding this process's scalar on its devices.

    Each process fills the entries of its own devices with its value, so with the
    same number of devices per process, statistics over the array are statistics
    over processes. Sharing the per-device metrics' mesh keeps one fused call.
    """
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r} is not numeric ({type(value).__name__})")
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    )
    local = np.float32(arr)
    return jax.make_array_from_callback(
        (mesh.size,), sharding, lambda index: np.full(mesh.size, local)[index]
    )
