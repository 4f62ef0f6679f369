"""Launch N local JAX processes that form one multi-controller job.

This is how to run (and test) multi-host code on one machine: each process calls
``jax.distributed.initialize`` with a coordinator on 127.0.0.1, owns a few simulated
CPU devices, and together they see one global mesh.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["LaunchError", "free_port", "launch_local"]

_LOG_TAIL_LINES = 60


class LaunchError(RuntimeError):
    """A launched process failed or the job ran past its timeout.

    ``logs`` maps each process id to its combined stdout/stderr; ``summary``
    is the message without the logs' tails (what failed, one line a process).
    """

    def __init__(self, message: str, logs: dict[int, str], summary: str = ""):
        super().__init__(message)
        self.logs = logs
        self.summary = summary or message


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _target_name(target: str | Callable) -> str:
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(
                f"target {target!r} must look like 'package.module:function'"
            )
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"target {target!r} must be a module-level function so that the launched "
            "processes can import it; nested functions and lambdas cannot be"
        )
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None)
        if spec is not None and spec.name:
            module = spec.name  # run as `python -m package.module`
        elif path:
            module = Path(path).stem
        else:
            raise ValueError(
                "a target defined in an interactive __main__ cannot be imported"
            )
    return f"{module}:{qualname}"


def _check_importable(module: str, pythonpath: str) -> None:
    """A ValueError where the processes could not import ``module``'s top
    package (found on ``sys.path``, their ``pythonpath`` or in the working
    folder, as they look; nothing is imported here), instead of N identical
    tracebacks."""
    top = module.partition(".")[0]
    try:
        if not top or importlib.util.find_spec(top) is not None:
            return
    except (ImportError, ValueError):
        pass
    places = [*sys.path, *pythonpath.split(os.pathsep), os.getcwd()]
    if importlib.machinery.PathFinder.find_spec(top, places) is None:
        raise ValueError(
            f"no module named {top!r}: the launched processes could not import "
            f"{module!r} (they look on sys.path and in the working folder "
            f"{os.getcwd()})"
        )


def _tail(text: str) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _kill(procs: Sequence[subprocess.Popen]) -> set[int]:
    """Kills the processes still running; returns their indices."""
    killed = set()
    for i, p in enumerate(procs):
        if p.poll() is None:
            killed.add(i)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    return killed


def launch_local(
    target: str | Callable,
    num_processes: int = 2,
    devices_per_process: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    output: str | os.PathLike | None = "stream",
) -> list[Any]:
    """Runs ``target`` in ``num_processes`` local JAX processes; returns their results.

    Each process gets ``devices_per_process`` CPU devices, joins the job through
    ``jax.distributed.initialize("127.0.0.1:<free port>", num_processes, process_id)``
    before anything else touches JAX, calls ``target(*args, **kwargs)``, and sends
    back its (picklable) return value. The launcher sees its own ``sys.path``, so a
    target defined in a test module or script works as long as it is module-level.

    Args:
        target: a module-level function or a ``"package.module:function"`` string.
        num_processes: how many processes (one "host" each).
        devices_per_process: simulated CPU devices in each process.
        args: passed to ``target`` in every process; they must pickle.
        kwargs: passed to ``target`` in every process; they must pickle.
        timeout: seconds for the whole job. Past it every process is killed: a
            process that skips a collective would otherwise hang the others forever.
        env: extra environment variables for the processes.
        output: where each process's output (stdout and stderr) goes while it
            runs: ``"stream"`` (default) prints every line to this process's
            stdout as ``[process i] line``; a folder writes
            ``{folder}/process-{i}.log`` per process; None keeps it only for
            the error message of a failed job.

    Returns:
        The return values, indexed by process id.

    Raises:
        LaunchError: a process exited with an error, raised, or the job timed out.
            The message holds the tail of every process's log.

    Examples:
        >>> import jaxhistory as jh
        >>> jh.launch_local("jax:process_count", num_processes=2)  # doctest: +SKIP
        [2, 2]
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("num_processes and devices_per_process must be at least 1")
    if output is not None and output != "stream":
        if not isinstance(output, str | os.PathLike):
            raise TypeError(
                f"output must be 'stream', a folder or None, got {output!r}"
            )
        Path(output).mkdir(parents=True, exist_ok=True)
    name = _target_name(target)
    port = free_port()
    env_out = dict(os.environ)
    env_out.pop("XLA_FLAGS", None)  # a forced device count would fight ours
    env_out["JAX_PLATFORMS"] = "cpu"
    env_out["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env_out.update(env or {})
    if isinstance(target, str):
        _check_importable(name.partition(":")[0], env_out.get("PYTHONPATH", ""))
    common = {
        "target": name,
        "args": tuple(args),
        "kwargs": dict(kwargs or {}),
        "port": port,
        "num_processes": num_processes,
        "devices_per_process": devices_per_process,
        "timeout": max(1, int(timeout)),
    }

    with tempfile.TemporaryDirectory(prefix="jaxhistory-launch-") as tmp:
        tmpdir = Path(tmp)
        procs: list[subprocess.Popen] = []
        logs: list[Any] = []
        readers: list[threading.Thread] = []
        timed_out = False
        killed: set[int] = set()
        try:
            for pid in range(num_processes):
                spec = dict(
                    common,
                    process_id=pid,
                    result_path=str(tmpdir / f"result-{pid}.pkl"),
                )
                spec_path = tmpdir / f"spec-{pid}.pkl"
                spec_path.write_bytes(pickle.dumps(spec))
                if output is None or output == "stream":
                    log_path = tmpdir / f"log-{pid}.txt"
                else:
                    log_path = Path(output) / f"process-{pid}.log"
                logs.append(open(log_path, "w+b"))  # noqa: SIM115
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "jaxhistory._launch_worker", spec_path],
                        stdout=logs[-1] if output != "stream" else subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env_out,
                        start_new_session=True,
                    )
                )
                if output == "stream":
                    readers.append(_stream(procs[-1], pid, logs[-1]))
            timed_out = _wait(procs, time.monotonic() + timeout)
        finally:
            killed = _kill(procs)
            for reader in readers:
                reader.join(timeout=5)
        texts = {}
        for pid, log in enumerate(logs):
            log.seek(0)
            texts[pid] = log.read().decode(errors="replace")
            log.close()
        results, failures = [], []
        for pid, p in enumerate(procs):
            status, value = _read_result(tmpdir / f"result-{pid}.pkl")
            if status == "ok" and p.returncode == 0:
                results.append(value)
            elif status == "error":
                failures.append(f"process {pid}: {value}")
            elif pid in killed:
                why = "at the timeout" if timed_out else "as another process failed"
                done = " (its function had returned)" if status == "ok" else ""
                failures.append(f"process {pid}: killed {why}{done}")
            else:
                failures.append(f"process {pid}: exit code {p.returncode}")
    if timed_out or failures:
        head = (
            f"job timed out after {timeout:g}s"
            if timed_out
            else "launched processes failed"
        )
        detail = "\n".join(failures)
        shown = "\n".join(
            f"----- process {pid} log (last {_LOG_TAIL_LINES} lines) -----\n{_tail(t)}"
            for pid, t in texts.items()
        )
        summary = f"{head} ({name})\n{detail}"
        raise LaunchError(f"{summary}\n{shown}", texts, summary)
    return results


_PRINT = threading.Lock()  # one line at a time from the processes' readers


def _stream(proc: subprocess.Popen, pid: int, log) -> threading.Thread:
    """A thread copying ``proc``'s output to ``log`` and, line by line with a
    ``[process i]`` prefix, to this process's stdout."""

    def copy():
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            text = line.decode(errors="replace").rstrip("\n")
            with _PRINT, contextlib.suppress(Exception):  # a closed stdout
                print(f"[process {pid}] {text}", flush=True)
        proc.stdout.close()

    thread = threading.Thread(target=copy, name=f"launch-output-{pid}", daemon=True)
    thread.start()
    return thread


def _wait(procs: Sequence[subprocess.Popen], deadline: float) -> bool:
    """Waits for every process; returns True if the deadline passed first."""
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return True
        # One failed rank means the others will wait forever on it.
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(2.0)  # let the others print what they were doing
            return False
        time.sleep(0.05)
    return False


def _read_result(path: Path) -> tuple[str, Any]:
    if not path.exists():
        return "missing", None
    try:
        return pickle.loads(path.read_bytes())
    except Exception as err:
        return "error", f"its result could not be read: {err}"
