"""Writer: the one background thread that writes what the training thread
queues, wrapping any target (as CLU's ``AsyncWriter`` wraps any writer).

History queues each update's :class:`~jaxhistory._record.Row` here (device
values as they are: nothing waits in the training loop), and its
:class:`~jaxhistory._fan_out.FanOut` target turns them into host records for the
JSONL log and the sinks; a :class:`~jaxhistory.trace.JSONTraceHandler` queues
its events here for its trace file. The target is anything with
``write(items, final)``: called on the thread with every item queued since the
last call (``final`` on :meth:`Writer.flush` and :meth:`Writer.close`, when
nothing may be held back).

How far behind it may fall is bounded. The thread writes at least every
:attr:`Writer.INTERVAL` seconds, and as soon as :attr:`Writer.WAKE_AT` items are
queued. When :attr:`Writer.MAX_PENDING` items are queued the training thread
waits (back-pressure) until the thread has taken them, so the file on disk
stays a fraction of a second behind even a loop that does nothing but record. A
target that hangs (a stuck file system) cannot stop the training: after
:attr:`Writer.MAX_WAIT` seconds of waiting the oldest queued items are dropped,
with one warning, and :attr:`Writer.dropped` counts them; ``flush`` and
``close`` wait for a write that does not return at most that long each, with a
warning (what is still queued stays queued).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from typing import Any

__all__ = ["AtExit", "Writer", "WriterClosed", "warn_quietly"]

logger = logging.getLogger("jaxhistory")


def warn_quietly(text: str, stacklevel: int = 2) -> None:
    """Warns (a ``RuntimeWarning``) from code that must not raise: a background
    thread, or the training thread's path when the log falls behind. Where the
    warning filters make warnings errors (``-W error``), the text goes to the
    ``jaxhistory`` logger instead of ending the thread or the training."""
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=stacklevel + 1)
    except Exception:
        logger.warning("%s", text)


class AtExit:
    """Calls ``obj.<method>()`` at interpreter exit while ``obj`` lives.

    The exit callback is removed again by :meth:`cancel` (a ``close``) or when
    ``obj`` is freed, so a process that makes and drops many objects does not
    keep a callback for each until it ends. The callback holds ``obj`` weakly.
    """

    __slots__ = ("hook",)

    def __init__(self, obj: Any, method: str):
        def forget(_ref: Any, unregister: Any = atexit.unregister) -> None:
            unregister(hook)  # obj was freed (bound now: late in shutdown the
            # module's globals may already be gone)

        ref = weakref.ref(obj, forget)

        def hook() -> None:
            target = ref()
            if target is not None:
                getattr(target, method)()

        self.hook = hook
        atexit.register(hook)

    def cancel(self) -> None:
        atexit.unregister(self.hook)


class WriterClosed(ValueError):
    """:meth:`Writer.add` after :meth:`Writer.close` began (also one that a
    Ctrl-C cut short)."""


class Writer:
    """Writes queued items to ``target`` from a background thread.

    ``add`` is the only call on the training thread's path; ``flush`` writes
    what is queued now (from any thread), ``close`` writes the rest and stops
    the thread (the target stays open: it belongs to the caller). ``what``
    names the target in the warning about dropped items, and ``kept`` says
    where dropped items are still kept.
    """

    INTERVAL = 0.2  # seconds between writes when few items are queued
    WAKE_AT = 2048  # queued items that wake the thread at once
    MAX_PENDING = 8192  # queued items at which the training thread waits
    MAX_WAIT = 10.0  # seconds it waits at most before items are dropped

    def __init__(
        self,
        target: Any,
        name: str = "jaxhistory-writer",
        what: str = "the JSONL log",
        kept: str = "",
    ):
        self.target = target
        self.what, self.kept = what, kept
        self.dropped = 0  # items dropped because the target could not keep up
        self.broken = False  # a write raised: the target may lack its items
        self._queue: list = []
        # add() against close(); re-entrant: the garbage collector may end a
        # StopWatch span (whose event is added here) on a thread inside add()
        self._lock = threading.RLock()
        # One write at a time, in order. An RLock knows its holder: a Ctrl-C
        # raised as its acquire returns (before the write's ``try:``) still
        # lets the thread that took it release it, instead of every later
        # write waiting on a lock nobody holds.
        self._drain_lock = threading.RLock()
        self._writing: int | None = None  # the thread in target.write
        # Tokens, not an Event and a Condition: the training thread wakes the
        # thread and waits for room through C calls alone, with no Python-level
        # lock a Ctrl-C could leave held (one landing inside Event.set()'s
        # `with` held its Condition's lock for good: the next close() hung)
        self._space: queue.SimpleQueue = queue.SimpleQueue()  # room was made
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # items to write
        self._closed = False
        self._closed_here = False  # close() was called on the thread itself
        self._done = False  # a close() has written what was queued
        self._warned: set[str] = set()
        self._stalled = False  # a wait for the thread ran out; it took nothing since
        self._pid = os.getpid()  # the process whose items these are
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            self._thread.start()  # (waits for the thread: Ctrl-C may land there)
            self._at_exit = AtExit(self, "close")
        except BaseException:
            # No one will hold this writer to close it: a thread that started
            # ends at its next wake, instead of living on with the process.
            self._closed = True
            self._wake_thread()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def add(self, item: Any) -> None:
        """Queues one item (the writer keeps it: pass one nobody changes later).
        Raises :class:`WriterClosed` (a ValueError) once :meth:`close` began."""
        # (a with: Ctrl-C landing between an acquire and its release would
        # leave the lock held, and every later add and close waiting forever)
        with self._lock:
            if self._closed:
                raise WriterClosed("the writer is closed")
            queue = self._queue
            queue.append(item)
            n = len(queue)
        if n == self.WAKE_AT:  # (the thread then takes every item queued)
            self._wake_thread()
        elif n >= self.MAX_PENDING:
            self._backpressure()

    def pending(self) -> int:
        """Items queued and not yet taken by the thread."""
        return len(self._queue)

    def _wake_thread(self) -> None:
        """Has the thread write what is queued now."""
        self._wake.put(None)

    @staticmethod
    def _wait(tokens: queue.SimpleQueue, timeout: float) -> None:
        """Waits at most ``timeout`` seconds for a token, then takes the others."""
        try:
            tokens.get(timeout=timeout)
            while True:
                tokens.get_nowait()
        except queue.Empty:
            pass

    def _backpressure(self) -> None:
        self._wake_thread()
        if self._stalled:
            # The thread has taken nothing since a wait ran out (a write that
            # does not return): waiting again would stall the caller another
            # MAX_WAIT at every fill, for as long as the file system hangs.
            self._drop(self.pending() - self.MAX_PENDING // 2)
            return
        deadline = time.monotonic() + self.MAX_WAIT
        while self.pending() >= self.MAX_PENDING and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0 or not self._thread.is_alive():
                self._stalled = True  # until the thread takes items again
                self._drop(self.pending() - self.MAX_PENDING // 2)
                return
            self._wait(self._space, min(left, 0.05))

    def _take(self, k: int | None = None) -> list:
        """Removes the first ``k`` (all) queued items and returns them."""
        with self._lock:
            if k is None or k >= len(self._queue):
                taken, self._queue = self._queue, []
            else:
                taken = self._queue[:k]
                del self._queue[:k]
        return taken

    def _drop(self, k: int) -> None:
        dropped = len(self._take(k))
        self.dropped += dropped
        self._warn_once(
            "dropped",
            f"{self.what} fell {self.MAX_WAIT:.0f} s behind; {dropped} queued "
            f"item(s) were not written to it{self.kept}",
        )

    def _run(self) -> None:
        while not self._closed:
            self._wait(self._wake, self.INTERVAL)
            try:
                self.write_queued(final=False)
            except Exception as err:  # never let the thread die
                self._warn_once("thread", f"writing {self.what} failed: {err!r}")
        if self._closed_here:  # closed from this thread: it writes the rest
            try:
                self.write_queued(final=True)
            except Exception as err:
                self._warn_once("thread", f"writing {self.what} failed: {err!r}")

    def write_queued(self, final: bool = True, wait: float | None = None) -> None:
        """Hands every queued item to the target now (on the calling thread);
        ``final``: the target holds nothing back. The thread calls this with
        ``final=False`` on its own schedule. A write in progress elsewhere is
        waited for at most ``wait`` seconds (None: :attr:`MAX_WAIT`)."""
        if os.getpid() != self._pid:
            # A child of os.fork() (whose copy of the thread is gone), closing
            # or flushing what it inherited: the items are the parent's, which
            # writes them itself; the target (the parent's log) is not touched.
            return
        me = threading.get_ident()
        if self._writing == me:
            return  # called from inside this thread's own write: it goes on
        lock = self._drain_lock
        got = False
        try:
            # A write that has not returned for MAX_WAIT seconds (a stuck file
            # system) is not waited for longer: flush and close go on without it.
            wait = self.MAX_WAIT if wait is None else max(wait, 0.0)
            got = lock.acquire(timeout=wait)
            if not got:
                self._warn_once(
                    "stuck",
                    f"a write to {self.what} has not returned for "
                    f"{self.MAX_WAIT:.0f} s (a stuck file system?); went on "
                    f"without it, {self.pending()} item(s) still queued",
                )
                return
            self._writing = me
            items = self._take()
            self._stalled = False
            self._space.put(None)
            try:
                self.target.write(items, final)
            except BaseException:  # (Ctrl-C on a flush's thread, too)
                self.broken = True  # what it was given may be lost
                raise
        finally:
            if got:
                self._writing = None
            # Released also where ``got`` was never set (Ctrl-C as the acquire
            # returned): an RLock this thread does not hold refuses
            # (RuntimeError), one it holds is released.
            with contextlib.suppress(RuntimeError):
                lock.release()

    def flush(self) -> None:
        """Writes every queued item now and has the target hold nothing back."""
        self.write_queued(final=True)

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_quietly(text, stacklevel=3)

    def close(self) -> None:
        """Writes what is queued and stops the thread (idempotent: a close cut
        short, by Ctrl-C while it waits, is completed by the next one)."""
        with self._lock:
            if self._done:
                return
            first = not self._closed
            if first:
                self._closed_here = self._thread is threading.current_thread()
                self._closed = True
        if first:
            self._wake_thread()
            self._space.put(None)
        if self._closed_here:
            # On the thread itself (a finalizer the garbage collector ran there,
            # maybe in the middle of a write that holds the drain lock): the
            # thread writes what is queued when its loop ends.
            return
        # MAX_WAIT in all, the thread's last write and this one's together
        # (bounded: a stuck write stays stuck)
        deadline = time.monotonic() + self.MAX_WAIT
        self._thread.join(self.MAX_WAIT)
        self.write_queued(final=True, wait=deadline - time.monotonic())
        if self._thread.is_alive() or self.pending():
            # gave up on a write that has not returned: it, and what is still
            # queued, may never reach the target
            self.broken = True
        self._done = True  # (not where the join or the flush raised)
        self._at_exit.cancel()
