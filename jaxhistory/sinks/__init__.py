"""Sinks: where records go besides the history's own files.

A sink has three methods, ``write(record)``, ``flush()`` and ``close()`` (the
:class:`Sink` protocol). :class:`~jaxhistory.History` hands every update to its
sinks as a :class:`Record` of their own whose values are already on the host
(each sink from a thread of its own: neither the training loop nor the JSONL log
waits for a sink, and close waits a bounded time), and
:mod:`jaxhistory.publish` can send published metrics to one. Sinks write from
process 0 only unless they have ``all_processes = True``. A sink may also define
``write_batch(batch)`` to take many records at once (:class:`JsonlSink` does).

Built in: :class:`ConsoleSink`, :class:`NullSink`, :class:`JsonlSink`,
:class:`CsvSink`, :class:`TensorBoardSink` (``pip install
'jaxhistory[tensorboard]'``, no TensorFlow) and :class:`WandbSink` (``pip
install 'jaxhistory[wandb]'``); the last two import their package only when
created. ``History(sinks="console,csv")``, or the ``JAXHISTORY_SINKS``
environment variable when History is given no ``sinks``, makes them by name.
A sink may also define ``log_table(key, columns, rows)``: ``finalize`` hands
it the run's :func:`training_history` table.

Examples:
    >>> import io
    >>> from jaxhistory.sinks import ConsoleSink, Record
    >>> sink = ConsoleSink(stream=io.StringIO())
    >>> sink.write(Record(step=3, timestamp=0.0, metrics={"loss": 0.25}))
    >>> sink.stream.getvalue()
    'step=3 loss=0.250000\\n'
"""

from jaxhistory._record import Record
from jaxhistory.sinks._base import Sink, scalars, values
from jaxhistory.sinks._base import moved_name as __getattr__  # noqa: F401
from jaxhistory.sinks._console import ConsoleSink, NullSink
from jaxhistory.sinks._csv import CsvSink
from jaxhistory.sinks._jsonl import JsonlSink
from jaxhistory.sinks._named import SINK_NAMES, SINKS_VARIABLE
from jaxhistory.sinks._tensorboard import TensorBoardSink
from jaxhistory.sinks._training_history import training_history
from jaxhistory.sinks._wandb import WandbSink

__all__ = [
    "SINKS_VARIABLE",
    "SINK_NAMES",
    "ConsoleSink",
    "CsvSink",
    "JsonlSink",
    "NullSink",
    "Record",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "scalars",
    "training_history",
    "values",
]
