"""TensorBoard event files, written with tensorboardX (no TensorFlow)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np

from jaxhistory._optional import import_optional
from jaxhistory.sinks._base import values, written_after_close

__all__ = ["TensorBoardSink"]

# tensorboardX names an event file by the second and the host, and opens it
# truncated: two sinks in one logdir within a second (a resumed run) would
# share the file, the second wiping the first's events. Each sink's file also
# gets the process id and a number of its own.
_numbers = itertools.count()


class TensorBoardSink:
    """Writes every scalar of each record (metrics and aggregated statistics) as a
    TensorBoard scalar at the record's step; array metrics as histograms.

    Records without a step (published metrics) are numbered per tag. Event files
    go to ``logdir`` (view them with ``tensorboard --logdir``), one of its own
    for each sink (a resumed run adds one); once closed, the sink writes nothing
    more. No TensorFlow is needed. Needs ``pip install 'jaxhistory[tensorboard]'``.

    Examples:
        >>> import tempfile
        >>> from jaxhistory.sinks import Record, TensorBoardSink
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.write(Record(step=0, timestamp=1.0, metrics={"loss": 0.5}))
        >>> sink.close()
    """

    all_processes = False

    def __init__(self, logdir: str | os.PathLike, flush_secs: int = 10):
        tbx = import_optional("tensorboardX", "the TensorBoard sink")
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary = Summary
        self.logdir = os.fspath(logdir)
        self._writer = tbx.SummaryWriter(
            self.logdir,
            flush_secs=flush_secs,
            max_queue=1024,
            filename_suffix=f".{os.getpid()}.{next(_numbers)}",
        )
        self._counts: dict[str, int] = {}
        # TensorFlow's histogram buckets: tensorboardX's, which stop at 1e20
        # (a value past them went uncounted, and an array of only such values
        # raised, losing the record), closed by -DBL_MAX and DBL_MAX as
        # TensorFlow closes them
        top = float(np.finfo(np.float64).max)
        self._bins = [-top, *self._writer.default_bins, top]
        # tensorboardX starts a new writer (and file) for a write after close
        self._closed = False

    def _step(self, tag: str, step: int | None) -> int:
        if step is not None:
            return step
        n = self._counts.get(tag, 0)
        self._counts[tag] = n + 1
        return n

    def write(self, record: Any) -> None:
        if self._closed:
            written_after_close(self, self.logdir)
            return
        Value = self._summary.Value
        scalars = []  # one event for all the scalars of a record with a step
        for tag, number, arr in values(record):
            if number is not None:
                if record.step is None:
                    step = self._step(tag, None)
                    self._add([Value(tag=tag, simple_value=number)], step, record)
                else:
                    scalars.append(Value(tag=tag, simple_value=number))
                continue
            step = self._step(tag, record.step)
            finite = arr[np.isfinite(arr)].astype(np.float64)
            if finite.size:
                with np.errstate(over="ignore"):  # sums past 1e308 are inf
                    self._writer.add_histogram(
                        tag,
                        finite,
                        global_step=step,
                        bins=self._bins,
                        walltime=record.timestamp,
                    )

        if scalars:
            self._add(scalars, record.step, record)

    def _add(self, values: list, step: int, record: Any) -> None:
        self._writer._get_file_writer().add_summary(
            self._summary(value=values), step, record.timestamp
        )

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        self._closed = True
        self._writer.close()
