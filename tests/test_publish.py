"""jaxhistory.publish: handlers, groups, put_metric, prof, MetricStream."""

import functools
import gc
import io
import threading
import time
import weakref
from unittest import mock

import pytest

import jaxhistory as jh
from jaxhistory import publish


class Collect(publish.MetricHandler):
    def __init__(self):
        self.data = []
        self.lock = threading.Lock()

    def emit(self, metric_data):
        with self.lock:
            self.data.append(metric_data)

    def names(self):
        return [(d.group_name, d.name) for d in self.data]


class Broken(publish.MetricHandler):
    def emit(self, metric_data):
        raise RuntimeError("handler down")


@pytest.fixture(autouse=True)
def private_registry():
    with publish.scoped():
        yield


# ----- handlers and groups ----------------------------------------------------------
def test_default_is_null_and_a_groups_own_handler_wins():
    default, app = Collect(), Collect()
    publish.put_metric("before", 1)  # the null default: dropped
    publish.configure(default)
    publish.configure(app, group="app")
    publish.put_metric("a", 1)
    publish.put_metric("b", 2, metric_group="app")
    publish.put_metric("c", 3, metric_group="other")
    assert default.names() == [("jaxhistory", "a"), ("other", "c")]
    assert app.names() == [("app", "b")]
    d = app.data[0]
    assert d.value == 2 and abs(d.timestamp - time.time()) < 5


def test_a_stream_taken_before_configure_follows_it():
    stream = publish.get_stream("late")
    handler = Collect()
    publish.configure(handler, group="late")
    stream.add_value("x", 1.5)
    assert handler.names() == [("late", "x")] and stream.handler is handler


def test_console_handler_format():
    out = io.StringIO()
    publish.ConsoleMetricHandler(stream=out).emit(
        publish.MetricData(1574213883.4182858, "my_app", "my_metric", 7)
    )
    assert out.getvalue() == "[1574213883.4182858][my_app]: my_metric=7\n"


def test_reset_and_scoped_registries():
    handler = Collect()
    publish.configure(handler, group="g")
    with publish.scoped():
        publish.put_metric("inner", 1, metric_group="g")  # fresh registry: null
    publish.put_metric("outer", 1, metric_group="g")
    publish.reset()
    publish.put_metric("after_reset", 1, metric_group="g")
    assert handler.names() == [("g", "outer")]


def test_bad_configuration_and_names():
    with pytest.raises(TypeError, match="MetricHandler or a sink"):
        publish.configure(print)
    with pytest.raises(ValueError, match="group"):
        publish.configure(Collect(), group="")
    with pytest.raises(ValueError, match="metric name"):
        publish.put_metric("", 1)
    with pytest.raises(ValueError, match="group"):
        publish.get_stream(None)
    with pytest.raises(ValueError, match="^metric_group must be a non-empty str"):
        publish.put_metric("x", 1, metric_group=None)  # named as its argument


def test_many_threads_publish_and_configure_safely():
    handler = Collect()
    publish.configure(handler, group="t")
    registry = publish._registry()

    def work(i):
        with publish.scoped():  # scopes are per thread: this one stays private
            publish.put_metric("private", i, metric_group="t")
        for j in range(200):
            registry.publish("t", f"m{i}", j)
            if j % 50 == 0:
                registry.configure(handler, "t")  # late configure, same handler

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(handler.data) == 8 * 200
    assert "private" not in {d.name for d in handler.data}


def test_history_handler_attaches_metrics_to_the_next_update():
    h = jh.History(distributed_history=False)
    publish.configure(publish.HistoryHandler(h), group="agent")

    @publish.prof(group="agent")
    def checkpoint():
        return "saved"

    h.update({"loss": 1.0})
    publish.put_metric("restarts", 1, metric_group="agent")
    assert checkpoint() == "saved"
    h.update({"loss": 0.5})
    h.update({"loss": 0.25})
    state = h.state
    assert state.steps("loss").tolist() == [0, 1, 2]  # no step taken by them
    assert state.steps("agent/restarts").tolist() == [1]
    assert state.steps("agent/test_publish.checkpoint.success").tolist() == [1]
    assert state.steps("agent/test_publish.checkpoint.duration.ms").tolist() == [1]
    with pytest.raises(TypeError, match="needs a History"):
        publish.HistoryHandler(object())


def test_history_handler_from_another_thread_loses_nothing():
    h = jh.History(distributed_history=False)
    publish.configure(publish.HistoryHandler(h), group="loader")
    registry = publish._registry()
    stop = threading.Event()

    def loader():
        i = 0
        while not stop.is_set():
            registry.publish("loader", "batches", i)
            i += 1

    thread = threading.Thread(target=loader)
    thread.start()
    for i in range(300):
        h.update({"loss": float(i)}, summarize=False)
    stop.set()
    thread.join()
    h.close()
    assert h.state.steps("loss").tolist() == list(range(300))
    assert h.state.count("loader/batches") >= 1


def test_a_raising_handler_under_warnings_as_errors_still_returns(caplog):
    import warnings

    publish.configure(Broken())

    @publish.prof
    def ok():
        return 42

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ok() == 42
    assert "handler down" in caplog.text


def test_a_sink_handler_writes_from_process_zero_only():
    out = io.StringIO()
    sink = jh.sinks.ConsoleSink(stream=out)
    handler = publish.SinkHandler(sink)
    with mock.patch("jax.process_index", return_value=1):
        handler.emit(publish.MetricData(1.0, "g", "x", 1))
    handler.flush()
    assert out.getvalue() == ""
    sink.all_processes = True
    with mock.patch("jax.process_index", return_value=1):
        handler.emit(publish.MetricData(1.0, "g", "x", 1))
    handler.flush()
    assert out.getvalue() == "[g] x=1\n"
    handler.close()


def test_a_sink_can_be_configured_as_a_handler():
    out = io.StringIO()
    publish.configure(jh.sinks.ConsoleSink(stream=out), group="io")
    publish.put_metric("bytes", 4096, metric_group="io")
    publish.flush()  # the sink writes from a thread of its own
    assert out.getvalue() == "[io] bytes=4096\n"


class _Untrusted:
    """A user's sink: its write raises, or blocks until ``go`` is set."""

    def __init__(self, raises: bool):
        self.raises, self.go = raises, threading.Event()
        self.written, self.flushes, self.closed = [], 0, False

    def write(self, record):
        if self.raises:
            raise OSError("disk full")
        self.go.wait()
        self.written.append(record.metrics)

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_a_sink_that_raises_costs_put_metric_nothing():
    """A sink handler wrote on the caller's thread: a sink whose write raised
    raised out of put_metric into the training loop. It warns once, naming
    the sink and the error, and put_metric returns."""
    sink = _Untrusted(raises=True)
    publish.configure(sink, group="io")
    with pytest.warns(
        RuntimeWarning, match=r"sink _Untrusted: write failed.*disk full"
    ):
        for i in range(3):
            publish.put_metric("bytes", i, metric_group="io")
        publish.flush()
    publish.close()
    assert sink.closed


def test_a_sink_that_hangs_holds_back_neither_put_metric_nor_close():
    """A sink whose write blocks held put_metric (and so the training loop)
    for as long; now put_metric returns while the sink is still blocked, and
    flush and close wait at most their timeout, then warn naming it."""
    sink = _Untrusted(raises=False)
    handler = publish.SinkHandler(sink)
    publish.configure(handler, group="io")
    publish.put_metric("a", 1, metric_group="io")
    publish.put_metric("b", 2, metric_group="io")  # returned: write is blocked
    assert sink.written == [] and not sink.go.is_set()
    with pytest.warns(RuntimeWarning, match=r"sink _Untrusted did not finish"):
        handler.flush(timeout=0.2)
    sink.go.set()  # the sink comes back: what was published reaches it
    handler.close()
    assert sink.written == [{"a": 1}, {"b": 2}] and sink.flushes >= 1 and sink.closed


def test_a_replaced_sink_handler_s_thread_ends_with_its_records_written():
    """configure called again for a group (or reset) drops a SinkHandler:
    its sink's thread waited forever, one idle thread per replacement. It
    writes what was published, flushes the sink (not closed: the sink is the
    caller's, maybe configured elsewhere too) and ends."""
    first, second = _Untrusted(raises=False), _Untrusted(raises=False)
    first.go.set()
    second.go.set()
    with publish.scoped():
        before = set(threading.enumerate())
        publish.configure(first, group="io")
        publish.put_metric("a", 1, metric_group="io")
        publish.flush()
        (thread,) = set(threading.enumerate()) - before
        publish.configure(second, group="io")  # the first handler is dropped
        thread.join(5)
        assert not thread.is_alive(), "the replaced handler's thread stayed"
        assert first.written == [{"a": 1}] and first.flushes >= 1
        assert not first.closed
        publish.put_metric("b", 2, metric_group="io")
        publish.flush()
        (thread,) = set(threading.enumerate()) - before
        publish.reset()
        thread.join(5)
        assert not thread.is_alive()
    assert second.written == [{"b": 2}] and not second.closed


def test_sink_handlers_closed_or_replaced_leave_no_exit_callback():
    """Each SinkHandler registered a callback at exit that was never removed:
    a program that configures handlers over and over kept every one."""
    closed = publish.SinkHandler(_Untrusted(raises=False))
    hooks = [weakref.ref(closed._at_exit.hook)]
    closed.close()
    del closed
    with publish.scoped():
        for _ in range(3):
            publish.configure(_Untrusted(raises=False), group="io")
            hooks.append(weakref.ref(publish._registry().handler("io")._at_exit.hook))
        publish.reset()
    gc.collect()
    assert [h for h in hooks if h() is not None] == []


# ----- prof ------------------------------------------------------------------------
def test_prof_bare_publishes_success_and_float_ms_duration():
    handler = Collect()
    publish.configure(handler)

    @publish.prof
    def quick():
        return "done"

    assert quick() == "done"
    names = handler.names()
    assert names == [
        ("jaxhistory", "test_publish.quick.success"),
        ("jaxhistory", "test_publish.quick.duration.ms"),
    ]
    duration = handler.data[1].value
    assert isinstance(duration, float) and 0 < duration < 1000  # sub-ms is not 0


def test_prof_with_a_group_keyword_on_a_method_and_a_failure():
    handler = Collect()
    publish.configure(handler, group="agent")

    class Worker:
        @publish.prof(group="agent")
        def run(self, fail):
            time.sleep(0.002)
            if fail:
                raise KeyError("boom")
            return 1

    assert Worker().run(False) == 1
    with pytest.raises(KeyError, match="boom"):
        Worker().run(True)
    assert handler.names() == [
        ("agent", "Worker.run.success"),
        ("agent", "Worker.run.duration.ms"),
        ("agent", "Worker.run.failure"),
        ("agent", "Worker.run.duration.ms"),
    ]
    assert handler.data[1].value >= 2.0  # milliseconds, monotonic clock


def test_prof_times_a_partial_and_a_callable_object():
    """A callable without ``__name__`` (a ``functools.partial``, an object with
    ``__call__``) made ``prof`` raise AttributeError when decorating it."""
    handler = Collect()
    publish.configure(handler)

    def add(a, b):
        return a + b

    class Loader:
        def __call__(self):
            return "batch"

    assert publish.prof(functools.partial(add, 1))(2) == 3
    assert publish.prof(Loader())() == "batch"
    assert [name for _, name in handler.names()] == [
        "test_publish.add.success",
        "test_publish.add.duration.ms",
        "test_publish.Loader.success",
        "test_publish.Loader.duration.ms",
    ]


def test_a_raising_handler_never_changes_the_outcome():
    publish.configure(Broken())

    @publish.prof
    def ok():
        return 5

    @publish.prof
    def bad():
        raise ValueError("user error")

    with pytest.warns(RuntimeWarning, match="handler down"):
        assert ok() == 5
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="user error"):
        bad()


def test_prof_positional_group_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"@prof\(group='agent'\)"):

        @publish.prof("agent")
        def f():
            pass


def test_prof_of_an_async_function_times_its_await_and_sees_its_failure():
    """Finding: ``@prof`` on an ``async def`` timed only the making of the
    coroutine (0.002 ms) and published success before the body ran, even when
    it then raised."""
    import asyncio

    handler = Collect()
    publish.configure(handler, group="agent")

    @publish.prof(group="agent")
    async def rendezvous(fail):
        await asyncio.sleep(0.05)
        if fail:
            raise TimeoutError("nobody came")
        return 7

    assert asyncio.run(rendezvous(False)) == 7
    with pytest.raises(TimeoutError):
        asyncio.run(rendezvous(True))
    names = [n.rpartition(".rendezvous.")[2] for _, n in handler.names()]
    assert names == ["success", "duration.ms", "failure", "duration.ms"]
    assert handler.data[1].value >= 40 and handler.data[3].value >= 40  # ms


def test_prof_of_a_generator_function_is_a_type_error():
    # it was "success" in 0.001 ms: the call only makes the generator
    with pytest.raises(TypeError, match=r"generator function '.*\.gen'"):

        @publish.prof
        def gen():
            yield 1

    with pytest.raises(TypeError, match=r"generator function '.*\.agen'"):

        @publish.prof
        async def agen():
            yield 1


class _Raising(publish.MetricHandler):
    def __init__(self, error):
        self.error = error

    def emit(self, metric_data):
        raise self.error


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), ValueError("closed file")]
)
def test_a_handler_that_raises_never_raises_into_the_caller(error, caplog):
    """Finding: ``put_metric`` (and a stream's ``add_value``) raised the
    handler's own error (a closed stream, a full disk) into the training
    thread. It warns, naming the group and metric, and the call returns."""
    publish.configure(_Raising(error), group="agent")
    with pytest.warns(RuntimeWarning, match="'agent' failed on 'a'"):
        publish.put_metric("a", 1, metric_group="agent")
    with pytest.warns(RuntimeWarning, match="'agent' failed on 'b'"):
        publish.get_stream("agent").add_value("b", 2)
    fixed = publish.MetricStream("own", _Raising(error))
    with pytest.warns(RuntimeWarning, match="'own' failed on 'c'"):
        fixed.add_value("c", 3)
    with pytest.raises(ValueError, match="non-empty str"):  # bad input still is
        publish.put_metric("", 1, metric_group="agent")


@pytest.mark.parametrize("error", [SystemExit(3), GeneratorExit()])
def test_a_handler_raising_systemexit_never_replaces_the_outcome(error):
    """Finding: a handler whose emit raised SystemExit or GeneratorExit made
    put_metric raise it, and a @prof function returning 42 raised it instead:
    its result was lost. (A KeyboardInterrupt still goes on: it may be the
    user's Ctrl-C.)"""
    publish.configure(_Raising(error), group="agent")

    @publish.prof(group="agent")
    def answer():
        return 42

    with pytest.warns(RuntimeWarning, match="'agent' failed on"):
        assert answer() == 42
    with pytest.warns(RuntimeWarning, match="'agent' failed on 'a'"):
        publish.put_metric("a", 1, metric_group="agent")
    publish.configure(_Raising(KeyboardInterrupt()), group="agent")
    with pytest.raises(KeyboardInterrupt):
        publish.put_metric("a", 1, metric_group="agent")


def test_the_console_handler_escapes_control_characters_in_what_it_prints():
    # a name's terminal escape and newline were printed raw
    out = io.StringIO()
    publish.ConsoleMetricHandler(out).emit(
        publish.MetricData(1.5, "g\x1b[2J", "a\x1b[2Jb\nc", "v\x07")
    )
    assert out.getvalue() == "[1.5][g\\x1b[2J]: a\\x1b[2Jb\\x0ac=v\\x07\n"


# ----- MetricStream in torchelastic's form, getStream -------------------------------


def test_metric_stream_in_torchelastics_form_and_getstream():
    from jaxhistory import publish

    got = []

    class Keep(publish.MetricHandler):
        def emit(self, data):
            got.append((data.group_name, data.name, data.value))

    stream = publish.MetricStream("agent", Keep())
    stream.add_value("restarts", 1)
    assert got == [("agent", "restarts", 1)]
    with publish.scoped():
        publish.configure(Keep(), group="io")
        publish.getStream("io").add_value("bytes", 4096)
        publish.MetricStream("io").add_value("files", 2)  # the registry's handler
    assert got[1:] == [("io", "bytes", 4096), ("io", "files", 2)]
    with pytest.raises(TypeError, match="must be a MetricHandler or a sink"):
        publish.MetricStream("agent", object())
    with pytest.raises(ValueError, match="group_name must be a non-empty str"):
        publish.MetricStream("", Keep())
    with pytest.raises(ValueError, match="metric name must be a non-empty str"):
        stream.add_value(3, 1)


def test_metric_data_unpacks_like_torchelastic_s_named_tuple():
    data = publish.MetricData(1.5, "g", "n", 7)
    timestamp, group, name, value = data
    assert (timestamp, group, name, value) == (1.5, "g", "n", 7)
    assert data[2] == "n" and data.value == 7
    with pytest.raises(AttributeError):
        data.value = 8
