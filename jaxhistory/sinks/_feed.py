"""SinkFeed: hands records to the user's sinks, each from a thread of its own.

A sink is the user's code: it may be slow, hang or raise. History's JSONL log
is written by the :class:`~jaxhistory._writer.Writer` thread first, and that
thread only queues each batch here, never waiting: a sink can cost the log
nothing. Each sink has a bounded queue and a thread of its own, so a hung sink
holds back no other sink either. The thread starts with the feed, not at the
first record: that may come at exit (a script that ends without ``close``),
where Python 3.12.0 and 3.12.1 refuse to start a thread.

- A full queue drops the batch from that sink (counted in :attr:`dropped`, one
  warning naming the sink); nothing waits for room.
- Each sink gets its own copy of every record (arrays as read-only views): a
  sink that changes what it is given changes nothing another sink sees.
- :meth:`flush` and :meth:`close` wait at most :attr:`SinkFeed.TIMEOUT` seconds
  for all the sinks together, then warn naming each sink that did not finish
  and return. A sink whose ``write``, ``flush`` or ``close`` raises gets a
  warning naming it, and the others carry on.
- Called from a sink's own thread (a sink whose ``write`` closes the history),
  they do not wait for that sink: it goes on once its call returns.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxhistory._record import Batch
from jaxhistory._writer import warn_quietly

__all__ = [
    "EXTRAS_TIMEOUT",
    "CallsInOrder",
    "SinkFeed",
    "call_bounded",
    "call_extras",
    "copied",
    "sink_name",
]


def sink_name(sink: Any, index: int | None = None) -> str:
    """How warnings name ``sink``: its class, and its place among the sinks."""
    where = "" if index is None else f" (sinks[{index}])"
    return f"{type(sink).__name__}{where}"


def _own(metrics: dict) -> dict:
    out = dict(metrics)
    if np.ndarray in set(map(type, out.values())):
        for name, value in out.items():
            if type(value) is np.ndarray:
                view = value.view()
                view.flags.writeable = False
                out[name] = view
    return out


def copied(batch: Batch) -> Batch:
    """A copy of ``batch`` whose metric and aggregated dicts are new (arrays as
    read-only views), for one sink to keep or change."""
    aggregated = batch.aggregated
    out = Batch(
        list(batch.steps),
        list(batch.stamps),
        [_own(m) for m in batch.metrics],
        None if aggregated is None else [dict(a) for a in aggregated],
        None if batch.groups is None else list(batch.groups),
        batch.process_index,
    )
    out.finite, out.run_id = batch.finite, batch.run_id
    return out


class _Mark:
    """A flush or close request in a sink's queue; ``done`` once carried out
    (``stop``: the thread ends after the flush, the sink left open)."""

    __slots__ = ("close", "done", "stop")

    def __init__(self, close: bool, stop: bool = False):
        self.close, self.stop = close, stop
        self.done = threading.Event()


class _Feed:
    """One sink, its queue and its thread."""

    def __init__(self, sink: Any, name: str, limit: int):
        self.sink, self.name, self.limit = sink, name, limit
        self.queued = 0  # records waiting
        self.dropped = 0  # records never handed to the sink
        self.closing = False
        self.abandoned = False  # close gave up waiting: drop what is left
        self.writing = 0  # records of the batch being written, not yet written
        self.busy_since: float | None = None  # when the call in progress began
        self.doing = ""  # and which it is: write, flush or close
        self.warned: set[str] = set()
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        # (started now, not at the first record: see the module docstring)
        self.thread = threading.Thread(
            target=self._run, name=f"jaxhistory-sink-{self.name}", daemon=True
        )
        self.thread.start()

    def put(self, batch: Batch) -> None:
        n = len(batch)
        with self._cond:
            if self.closing:
                return
            if self.queued + n > self.limit:
                self.dropped += n
                full = True
            else:
                self._items.append(batch)
                self.queued += n
                full = False
                self._cond.notify()
        if full:
            self.warn(
                "full",
                f"sink {self.name} fell {self.limit} records behind; records are "
                "dropped from it (never from the history or its JSONL log)",
            )

    def mark(self, close: bool) -> _Mark | None:
        """Queues a flush (close) request; None where nothing is to wait for."""
        with self._cond:
            if self.closing:
                return None
            last = self._items[-1] if self._items else None
            if not close and type(last) is _Mark:
                return last  # a flush already waiting: no new request
            mark = _Mark(close)
            self.closing = close
            self._items.append(mark)
            self._cond.notify()
        return mark

    def retire(self) -> None:
        """Has the thread hand the sink what is queued, flush it and end,
        without closing it; waits for nothing. Later records are not taken."""
        with self._cond:
            if self.closing:
                return
            self.closing = True
            self._items.append(_Mark(False, stop=True))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
                if type(item) is not _Mark:
                    self.queued -= len(item)
                    if self.abandoned:
                        self.dropped += len(item)
                        continue
            if type(item) is not _Mark:
                self._deliver(item)
                continue
            self._call("flush", self.sink.flush)
            if item.close:
                self._call("close", self.sink.close)
            item.done.set()
            if item.close or item.stop:
                return

    def _deliver(self, batch: Batch) -> None:
        own = copied(batch)
        write_batch = getattr(self.sink, "write_batch", None)
        if write_batch is not None:
            self._call("write", write_batch, own)
        else:
            records = list(own.records())
            self.writing = len(records)
            for k, record in enumerate(records):  # one bad one costs only itself
                if self.abandoned:  # close gave up on this sink: no more writes
                    self.dropped += len(records) - k
                    break
                self._call("write", self.sink.write, record)
                self.writing -= 1
            self.writing = 0

    def _call(self, what: str, call: Any, *args: Any) -> None:
        self.doing = what
        self.busy_since = time.monotonic()
        try:
            call(*args)
        except BaseException as err:  # a failing sink must not stop the others
            # (nor end its thread: SystemExit or KeyboardInterrupt raised by a
            # sink here would, silently, and every flush would then wait)
            self.warn(what, f"sink {self.name}: {what} failed: {err!r}")
        finally:
            self.busy_since = None

    def warn(self, key: str, text: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warn_quietly(text, stacklevel=3)


class SinkFeed:
    """Feeds ``sinks`` from threads of their own (see the module docstring).

    Examples:
        >>> import io
        >>> from jaxhistory.sinks import ConsoleSink, Record
        >>> from jaxhistory.sinks._feed import SinkFeed
        >>> from jaxhistory._record import Batch
        >>> sink = ConsoleSink(stream=io.StringIO())
        >>> feed = SinkFeed([sink])
        >>> feed.put(Batch.of([Record(step=1, timestamp=0.0, metrics={"x": 0.5})]))
        >>> feed.close()
        >>> sink.stream.getvalue()
        'step=1 x=0.500000\\n'
    """

    TIMEOUT = 5.0  # seconds flush and close wait for all the sinks together
    MAX_QUEUED = 16384  # records a sink may fall behind before they are dropped

    def __init__(self, sinks: Sequence[Any]):
        self._pid = os.getpid()  # the process whose threads write the sinks
        many = len(sinks) > 1
        self._feeds = [
            _Feed(s, sink_name(s, i if many else None), self.MAX_QUEUED)
            for i, s in enumerate(sinks)
        ]

    @property
    def dropped(self) -> dict[str, int]:
        """Records dropped from each sink that lost any, by its name."""
        return {f.name: f.dropped for f in self._feeds if f.dropped}

    def put(self, batch: Batch, flush: bool = False) -> None:
        """Queues ``batch`` for every sink (``flush``: and a flush after it,
        which nothing waits for); never waits."""
        for feed in self._feeds:
            feed.put(batch)
            if flush:
                feed.mark(False)

    def flush(self, timeout: float | None = None) -> None:
        """Waits (at most ``timeout``, default :attr:`TIMEOUT`, seconds) until
        every sink has been handed what is queued and has flushed."""
        self._wait(False, self.TIMEOUT if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> None:
        """Hands every sink what is queued, flushes and closes it, waiting at
        most ``timeout`` (default :attr:`TIMEOUT`) seconds in all; later
        records are not taken. A sink still busy then is left to its thread,
        with a warning naming it."""
        self._wait(True, self.TIMEOUT if timeout is None else timeout)

    def retire(self) -> None:
        """Ends the sinks' threads once each has handed its sink what is queued
        and flushed it; closes no sink (the caller's, maybe fed elsewhere too)
        and waits for nothing. Later records are not taken."""
        if os.getpid() != self._pid:
            return  # (a child of os.fork(): the threads are the parent's)
        for feed in self._feeds:
            feed.retire()

    def _wait(self, close: bool, timeout: float) -> None:
        if os.getpid() != self._pid:
            # A child of os.fork(): the sinks' threads are the parent's (gone
            # here), and so are the sinks, which the parent flushes and closes.
            return
        here = threading.current_thread()
        now = time.monotonic()
        waits = []
        for feed in self._feeds:
            busy = feed.busy_since
            # a flush does not wait again for a sink already known to be stuck
            stuck = not close and busy is not None and now - busy > timeout
            mark = feed.mark(close)
            if mark is not None and feed.thread is not here and not stuck:
                waits.append((feed, mark))
        deadline = now + timeout
        for feed, mark in waits:
            if not mark.done.wait(max(deadline - time.monotonic(), 0)):
                if close:
                    feed.abandoned = True
                what = "close" if close else "flush"
                busy = feed.busy_since
                doing = "" if busy is None else f" (its {feed.doing} is running)"
                feed.warn(
                    f"stuck-{what}",
                    f"sink {feed.name} did not finish within {timeout:g} s"
                    f"{doing}; {what} went on without it "
                    f"({feed.queued + feed.writing} record(s) "
                    "still queued for it" + (", not written to it)" if close else ")"),
                )


EXTRAS_TIMEOUT = 60.0  # seconds finalize waits for one sink's extra call


def call_extras(sinks: Sequence[Any], method: str, *args: Any) -> None:
    """Calls ``method(*args)`` of every sink of ``sinks`` that has it, each in a
    thread of its own: a sink is untrusted code, and finalize has written the
    outputs already. One that raises, or has not returned after
    :data:`EXTRAS_TIMEOUT` seconds (it is left to its thread), gets a warning
    naming it; nothing reaches the caller."""
    many = len(sinks) > 1
    for index, sink in enumerate(sinks):
        call = getattr(sink, method, None)
        if not callable(call):
            continue
        name = sink_name(sink, index if many else None)
        returned, error = call_bounded(
            call, args, EXTRAS_TIMEOUT, f"jaxhistory-sink-{method}"
        )
        if not returned:
            text = (
                f"sink {name}: {method} did not return within "
                f"{EXTRAS_TIMEOUT:g} s; finalize went on without it"
            )
        elif error is not None:
            what = f"{method}({args[0]!r})" if method == "log_table" else method
            text = f"sink {name}: {what} failed: {error!r}"
        else:
            continue
        warn_quietly(text, stacklevel=3)  # (-W error: never into finalize)


def call_bounded(
    call: Any, args: tuple, timeout: float, name: str
) -> tuple[bool, BaseException | None]:
    """Calls the user's ``call(*args)`` in a thread of its own (named
    ``name``) and waits for it at most ``timeout`` seconds: returns whether it
    returned, and what it raised (SystemExit included). One still running then
    is left to its thread."""
    failed: list[BaseException] = []

    def run():
        try:
            call(*args)
        except BaseException as err:  # (SystemExit from the user's code too)
            failed.append(err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, None
    return True, failed[0] if failed else None


class CallsInOrder:
    """Calls the user's ``call(arg)`` for each of ``args``, in order, on a
    thread of its own (named ``name``), started at once; :meth:`stop` then
    says how far it got. Several run side by side: one that hangs holds back
    no other."""

    def __init__(self, call: Any, args: Sequence, name: str):
        self.call, self.args = call, list(args)
        self._lock = threading.Lock()
        self._done = 0  # calls returned (or raised)
        self._in_call = False
        self._stopped = False
        self.errors: list[tuple[Any, BaseException]] = []  # (arg, what it raised)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for arg in self.args:
            with self._lock:
                if self._stopped:
                    return
                self._in_call = True
            try:
                self.call(arg)
            except BaseException as err:  # (SystemExit from the user's code too)
                self.errors.append((arg, err))
            with self._lock:
                self._in_call = False
                self._done += 1

    def join(self, deadline: float) -> None:
        """Waits for the calls until ``deadline`` (``time.monotonic()``)."""
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> tuple[Any, list]:
        """Calls nothing more; returns the argument of the call still running
        (None: none) and the arguments never called."""
        with self._lock:
            self._stopped = True
            done, running = self._done, self._in_call
        if running:
            return self.args[done], self.args[done + 1 :]
        return None, self.args[done:]
