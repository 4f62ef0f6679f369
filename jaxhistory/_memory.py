"""Memory reports: host RSS and JAX device memory per stage, and compiled sizes."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

__all__ = [
    "MemorySample",
    "MemoryTracker",
    "compiled_memory",
    "device_memory",
    "host_rss",
    "live_array_bytes",
]


_process: list = []  # (pid, psutil.Process), rebuilt after a fork


def host_rss() -> int:
    """This process's resident set size in bytes (psutil)."""
    pid = os.getpid()
    if not _process or _process[0][0] != pid:
        try:
            import psutil
        except ImportError as err:  # a declared dependency, but say what to do
            raise ImportError(
                "memory reports need psutil: pip install psutil (or jaxhistory)"
            ) from err
        _process[:] = [(pid, psutil.Process(pid))]
    return int(_process[0][1].memory_info().rss)


def live_array_bytes(devices: Sequence[Any]) -> int:
    """Bytes held on ``devices`` by live JAX arrays (each replica counted once per
    device it is on). This is what the arrays hold, not what the allocator holds:
    the stand-in for ``bytes_in_use`` where a backend (CPU) reports no memory
    statistics.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxhistory as jh
        >>> device = jax.devices()[3]
        >>> before = jh.live_array_bytes([device])
        >>> x = jax.device_put(jnp.zeros(1000, jnp.float32), device)
        >>> jh.live_array_bytes([device]) - before
        4000
    """
    wanted = set(devices)
    total = 0
    for arr in jax.live_arrays():
        try:
            sharding = arr.sharding
            on = wanted.intersection(sharding.device_set)
            if on:
                total += (
                    len(on)
                    * math.prod(sharding.shard_shape(arr.shape))
                    * (arr.dtype.itemsize)
                )
        except Exception:
            continue
    return total


class MemorySample:
    """Device memory of a set of devices at one moment.

    ``in_use`` is the sum of ``bytes_in_use`` over the devices (or, for a device
    whose backend reports no statistics, the bytes its live JAX arrays hold);
    ``peak`` the sum of their ``peak_bytes_in_use`` high-water marks, or None when
    any device does not report one (CPU). ``source`` says which:
    ``"memory_stats"``, ``"live_arrays"`` or ``"mixed"``.
    """

    __slots__ = ("in_use", "peak", "per_device", "source")

    def __init__(
        self,
        in_use: int,
        peak: int | None,
        source: str,
        per_device: tuple[tuple[int | None, int | None], ...] = (),
    ):
        self.in_use, self.peak, self.source = in_use, peak, source
        # (bytes_in_use, peak_bytes_in_use) as each device reported them (None
        # where it did not): what the peaked delta is computed from, per device.
        self.per_device = per_device

    def __repr__(self) -> str:
        return f"MemorySample(in_use={self.in_use}, peak={self.peak}, {self.source})"


def _stat(stats: Any, key: str) -> int | None:
    """A usable byte count from a memory_stats() dict: present, an int, not -1."""
    if not isinstance(stats, dict):
        return None
    value = stats.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _devices(devices: Sequence[Any] | None) -> list[Any]:
    """``devices`` as a list (this process's devices for None); TypeError
    naming what is no device (a name such as ``"cpu"`` measured nothing, with
    no word), ValueError for none at all."""
    if devices is None:
        return list(jax.local_devices())
    if isinstance(devices, str | bytes) or not isinstance(devices, Iterable):
        raise TypeError(
            "devices must be a sequence of devices (jax.devices() or some of "
            f"them), got {type(devices).__name__} {devices!r:.60}"
        )
    out = list(devices)
    if not out:
        raise ValueError("devices is empty: there is nothing to measure")
    for i, device in enumerate(out):
        if not callable(getattr(device, "memory_stats", None)):
            raise TypeError(
                f"devices[{i}] is {type(device).__name__} {device!r:.60}, not a "
                "device (use jax.devices() or jax.local_devices())"
            )
    return out


def device_memory(devices: Sequence[Any] | None = None) -> MemorySample:
    """Device memory in use (and its high-water mark) over ``devices``.

    ``devices`` defaults to this process's devices. Uses
    ``jax.Device.memory_stats()`` where the backend has it (GPU, TPU); a device
    whose stats are None, lack ``bytes_in_use`` or report -1 falls back to the
    bytes of the live JAX arrays on it, and then the peak is unknown (None).
    Anything in ``devices`` that is no device (a name such as ``"cpu"``) is a
    TypeError naming it; an empty ``devices`` a ValueError.

    Examples:
        >>> import jaxhistory as jh
        >>> sample = jh.device_memory()  # CPU here: no memory_stats
        >>> sample.source, sample.peak
        ('live_arrays', None)
    """
    devices = _devices(devices)
    in_use, fallback, sources = 0, [], set()
    peak: int | None = 0
    per_device: list[tuple[int | None, int | None]] = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:
            stats = None
        used = _stat(stats, "bytes_in_use")
        top = _stat(stats, "peak_bytes_in_use")
        if used is None:
            # Live-array bytes and an allocator peak measure different things.
            top = None
            fallback.append(device)
            sources.add("live_arrays")
        else:
            in_use += used
            sources.add("memory_stats")
            if top is not None:
                top = max(top, used)
        per_device.append((used, top))
        peak = None if top is None or peak is None else peak + top
    if fallback:
        in_use += live_array_bytes(fallback)
    source = sources.pop() if len(sources) == 1 else "mixed"
    return MemorySample(
        in_use, peak, source if devices else "memory_stats", tuple(per_device)
    )


class _Stage:
    __slots__ = ("cpu_peak", "cpu_start", "dev_start")

    def __init__(self, cpu_start: int, dev_start: MemorySample):
        self.cpu_start = self.cpu_peak = cpu_start
        self.dev_start = dev_start


class MemoryTracker:
    """Host and device memory used by the stages of a run (init, train, eval, ...).

    Stages are timed spans: ``with tracker.stage("train"):`` or
    ``tracker.start("train")`` ... ``tracker.stop("train")``. Different stages may
    overlap; one stage may not be started again while it runs. A stage run again
    later replaces its earlier figures. :meth:`metrics` returns, in bytes::

        before_init_mem_cpu, before_init_mem_device    # when the tracker was made
        {stage}_mem_cpu_alloc_delta      # RSS at stop - RSS at start
        {stage}_mem_cpu_peaked_delta     # peak RSS during the stage - RSS at stop
        {stage}_mem_device_alloc_delta   # device bytes in use, stop - start
        {stage}_mem_device_peaked_delta  # see below; None where unknown

    Alloc deltas can be negative (the stage freed memory); peaked deltas never
    are: ``alloc_delta + peaked_delta`` is what the stage needed above its start.

    Host RSS comes from psutil; its peak is sampled by a thread that sleeps
    ``interval`` seconds between samples (it runs only while a stage is active and
    is joined when the last one stops), so a spike shorter than the interval may
    be missed.

    Device memory is summed over ``devices`` (default: this process's devices),
    see :func:`device_memory`. JAX has no call to reset the peak, so each
    device's peaked delta comes from its high-water mark ``peak_bytes_in_use``:
    if the stage raised that device's mark, the device peaked at the mark
    (exact); if not, its peak during the stage cannot be seen and the larger of
    its start and end usage is taken (a lower bound). The device peaked delta is
    the sum over devices. Where a device reports no statistics (CPU), the alloc
    delta counts the bytes of live JAX arrays and the peaked delta is None:
    unavailable, never a made-up 0.

    Examples:
        >>> import jax.numpy as jnp, jaxhistory as jh
        >>> tracker = jh.MemoryTracker()
        >>> with tracker.stage("train"):
        ...     x = jnp.ones((1024, 1024))  # 4 MiB on one device
        >>> m = tracker.metrics()
        >>> m["train_mem_device_alloc_delta"] >= 4 * 2**20
        True
        >>> m["train_mem_device_peaked_delta"] is None  # CPU: no peak statistics
        True
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        interval: float = 0.005,
        rss: Callable[[], int] = host_rss,
    ):
        if not isinstance(interval, int | float) or not 0 < interval <= 10:
            raise ValueError(f"interval must be in (0, 10] seconds, got {interval!r}")
        self.devices = _devices(devices)
        self.interval = float(interval)
        self._rss = rss
        self._lock = threading.Lock()
        self._active: dict[str, _Stage] = {}
        self._results: dict[str, dict[str, int | None]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.before_cpu = self._rss()
        self.before_device = device_memory(self.devices).in_use

    # ----- stages ----------------------------------------------------------------
    def start(self, stage: str) -> None:
        """Starts measuring ``stage``."""
        if not isinstance(stage, str) or not stage.strip():
            raise ValueError(f"a stage name must be a non-empty str, got {stage!r}")
        with self._lock:
            if stage in self._active:
                raise RuntimeError(
                    f"stage {stage!r} is already running: a stage cannot be nested "
                    "in itself (stop it first)"
                )
        cpu = self._rss()
        record = _Stage(cpu, device_memory(self.devices))
        with self._lock:
            if stage in self._active:  # started meanwhile by another thread
                raise RuntimeError(f"stage {stage!r} is already running")
            self._active[stage] = record
            if self._thread is None:
                # Each sampler has its own stop event: a sampler being stopped
                # can never be confused with a new one.
                self._wake = threading.Event()
                self._thread = threading.Thread(
                    target=self._sample,
                    args=(self._wake,),
                    name="jaxhistory-memory",
                    daemon=True,
                )
                self._thread.start()

    def stop(self, stage: str) -> dict[str, int | None]:
        """Stops measuring ``stage``; returns its four metrics."""
        self._running_record(stage)  # raises if it is not running
        # Measured before the stage is let go: if reading fails, it keeps running.
        cpu = self._rss()
        dev = device_memory(self.devices)
        with self._lock:
            record = self._active.pop(stage, None)
            if record is None:  # stopped meanwhile by another thread
                raise RuntimeError(f"stage {stage!r} is not running")
            thread = self._thread if not self._active else None
            if thread is not None:
                self._thread = None
                self._wake.set()
        if thread is not None:
            thread.join()
        cpu_peak = max(record.cpu_peak, cpu)
        out = {
            f"{stage}_mem_cpu_alloc_delta": cpu - record.cpu_start,
            f"{stage}_mem_cpu_peaked_delta": max(0, cpu_peak - cpu),
            f"{stage}_mem_device_alloc_delta": dev.in_use - record.dev_start.in_use,
            f"{stage}_mem_device_peaked_delta": _device_peaked(record.dev_start, dev),
        }
        with self._lock:
            self._results[stage] = out
        return dict(out)

    def _running_record(self, stage: str) -> _Stage:
        with self._lock:
            record = self._active.get(stage)
            if record is None:
                known = "it was already stopped" if stage in self._results else None
                running = ", ".join(map(repr, self._active)) or "none"
                raise RuntimeError(
                    f"stage {stage!r} is not running ({known or 'it was never started'}"
                    f"; running: {running})"
                )
            return record

    @contextlib.contextmanager
    def stage(self, stage: str) -> Iterator[MemoryTracker]:
        """``with tracker.stage("eval"):`` measures the block (also if it raises)."""
        self.start(stage)
        try:
            yield self
        finally:
            self.stop(stage)

    def _sample(self, wake: threading.Event) -> None:
        while not wake.wait(self.interval):
            try:
                rss = self._rss()
            except Exception:
                continue
            with self._lock:
                for record in self._active.values():
                    if rss > record.cpu_peak:
                        record.cpu_peak = rss

    # ----- results ---------------------------------------------------------------
    @property
    def running(self) -> tuple[str, ...]:
        """The stages started and not yet stopped."""
        with self._lock:
            return tuple(self._active)

    def metrics(self) -> dict[str, int | None]:
        """``before_init_mem_*`` and the metrics of every stopped stage, in bytes."""
        out: dict[str, int | None] = {
            "before_init_mem_cpu": self.before_cpu,
            "before_init_mem_device": self.before_device,
        }
        with self._lock:
            for stage_metrics in self._results.values():
                out.update(stage_metrics)
        return out


def _device_peaked(start: MemorySample, end: MemorySample) -> int | None:
    """The sum over devices of each device's peaked delta (None if any device
    has no peak): a device whose high-water mark rose during the stage peaked at
    that mark; one whose mark did not rise peaked at least at the larger of its
    start and end usage."""
    if start.peak is None or end.peak is None:
        return None
    total = 0
    for (used0, peak0), (used1, peak1) in zip(
        start.per_device, end.per_device, strict=True
    ):
        if used0 is None or peak0 is None or used1 is None or peak1 is None:
            return None  # a device without a peak
        stage_peak = peak1 if peak1 > peak0 else max(used0, used1)
        total += max(0, stage_peak - used1)
    return total


def compiled_memory(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Memory XLA plans for one call of ``fn`` (jitted if it is not already).

    Returns bytes: ``argument``, ``output``, ``alias`` (outputs sharing an
    argument's buffer, e.g. donated), ``temp`` (scratch), ``generated_code``, and
    ``peak``, the compiler's peak estimate where it gives one, else
    argument + output - alias + temp. Per device for a sharded computation.
    Compiles ``fn`` for ``args`` (abstract ``jax.ShapeDtypeStruct`` values work
    too) without running it.

    Examples:
        >>> import jax.numpy as jnp, jaxhistory as jh
        >>> m = jh.compiled_memory(lambda x: (x @ x).sum(), jnp.ones((256, 256)))
        >>> m["argument"], m["output"]
        (262144, 4)
    """
    if not callable(fn):
        raise TypeError(f"compiled_memory needs a function, got {type(fn).__name__}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    stats = jitted.lower(*args, **kwargs).compile().memory_analysis()
    if stats is None:
        raise RuntimeError("this backend gives no memory analysis of compiled code")
    if isinstance(stats, list | tuple):  # one entry per device program
        stats = stats[0]

    def get(name: str) -> int:
        return int(getattr(stats, name, 0) or 0)

    out = {
        "argument": get("argument_size_in_bytes"),
        "output": get("output_size_in_bytes"),
        "alias": get("alias_size_in_bytes"),
        "temp": get("temp_size_in_bytes"),
        "generated_code": get("generated_code_size_in_bytes"),
    }
    peak = get("peak_memory_in_bytes")
    out["peak"] = peak or out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out
