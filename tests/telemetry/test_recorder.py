"""The recorder: records become the right spans; full buffers, dead exporters and forks are safe."""

import gc
import multiprocessing
import threading
import weakref

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

from kvtrace.telemetry import semconv
from kvtrace.telemetry.context import TraceRef, new_span_id, new_trace_id
from kvtrace.telemetry.recorder import NoOpRecorder
from kvtrace.telemetry.semconv import Category, FailureCause, Stage


def _ref(sampled=True):
    return TraceRef(new_trace_id(), new_span_id(), sampled)


def test_records_become_spans_with_names_parents_times_and_attributes(make_recorder, memory_exporter):
    recorder = make_recorder(memory_exporter)
    router = _ref()  # the router's incoming context: pd.request's parent
    root_id = new_span_id()
    t0 = recorder.now()
    recorder.record(router, Stage.WRITE, t0 + 1_000, t0 + 5_000,
                    {semconv.ATTR_TRANSFER_BYTES: 2048, semconv.ATTR_BLOCK_COUNT: 2},
                    )
    recorder.record(TraceRef(router.trace_id, root_id), Stage.RENDEZVOUS, t0 + 10, t0 + 900,
                    {semconv.ATTR_RENDEZVOUS_ORDER: semconv.RendezvousOrder.KV_FIRST.value})
    recorder.record(router, Stage.PD_REQUEST, t0, t0 + 9_000, span_id=root_id)
    assert recorder.force_flush()

    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    assert set(spans) == {"kv.write", "kv.rendezvous", "pd.request"}
    root, write, rendezvous = spans["pd.request"], spans["kv.write"], spans["kv.rendezvous"]

    # One trace; pd.request has the id we fixed, the rendezvous hangs under it.
    assert {s.context.trace_id for s in spans.values()} == {router.trace_id}
    assert root.context.span_id == root_id
    assert root.parent.span_id == router.span_id
    assert rendezvous.parent.span_id == root_id
    assert write.parent.span_id == router.span_id
    assert root.kind is SpanKind.SERVER and write.kind is SpanKind.INTERNAL

    # Explicit timestamps: monotonic + one per-process offset, so differences are exact.
    assert root.start_time == recorder.to_wall_ns(t0)
    assert write.start_time - root.start_time == 1_000
    assert write.end_time - write.start_time == 4_000
    assert rendezvous.end_time - rendezvous.start_time == 890

    assert write.attributes[semconv.ATTR_CATEGORY] == Category.WIRE.value
    assert write.attributes[semconv.ATTR_STAGE] == "write"
    assert write.attributes[semconv.ATTR_TRANSFER_BYTES] == 2048
    assert rendezvous.attributes[semconv.ATTR_RENDEZVOUS_ORDER] == "kv_first"
    assert rendezvous.attributes[semconv.ATTR_CATEGORY] == "coordination"
    assert root.resource.attributes["service.name"] == "test"
    assert write.status.status_code is StatusCode.UNSET
    assert recorder.stats().exported_spans == 3


def test_engine_queue_spans_are_told_apart_by_stage_attribute(make_recorder, memory_exporter):
    recorder = make_recorder(memory_exporter)
    ref, t = _ref(), recorder.now()
    recorder.record(ref, Stage.P_QUEUE, t, t + 1)
    recorder.record(ref, Stage.D_QUEUE, t, t + 1)
    recorder.force_flush()
    spans = memory_exporter.get_finished_spans()
    assert [s.name for s in spans] == ["engine.queue", "engine.queue"]
    assert sorted(s.attributes[semconv.ATTR_STAGE] for s in spans) == ["d_queue", "p_queue"]


def test_failure_sets_error_status_and_event(make_recorder, memory_exporter):
    recorder = make_recorder(memory_exporter)
    t = recorder.now()
    recorder.record(_ref(), Stage.READ, t, t + 10, error=FailureCause.TRANSFER_FAILED.value)
    recorder.force_flush()
    (span,) = memory_exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "transfer_failed"
    assert span.attributes["error.type"] == "transfer_failed"
    (event,) = span.events
    assert event.name == semconv.FAILURE_EVENT
    assert event.attributes["error.type"] == "transfer_failed"
    assert event.timestamp == span.end_time


def test_unsampled_and_contextless_records_export_no_span(make_recorder, memory_exporter):
    recorder = make_recorder(memory_exporter)
    t = recorder.now()
    recorder.record(_ref(sampled=False), Stage.PREFILL, t, t + 5)
    recorder.record(None, Stage.PREFILL, t, t + 5)
    recorder.record_engine_loop(1_500)
    recorder.force_flush()
    assert memory_exporter.get_finished_spans() == ()
    assert recorder.stats().dropped == 0


class _BlockingExporter(SpanExporter):
    """Holds the exporter thread inside export() until released."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.entered.set()
        self.release.wait(10)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


def test_full_buffer_drops_and_counts_without_blocking(make_recorder):
    exporter = _BlockingExporter()
    recorder = make_recorder(exporter, max_queue_size=10, max_export_batch_size=10,
                             schedule_delay_ms=60_000)
    ref, t = _ref(), recorder.now()
    for _ in range(10):  # the 10th wakes the exporter, which takes all 10 and blocks
        recorder.record(ref, Stage.PREFILL, t, t + 1)
    assert exporter.entered.wait(5)

    done = threading.Event()

    def flood():
        for _ in range(25):
            recorder.record(ref, Stage.PREFILL, t, t + 1)
        done.set()

    threading.Thread(target=flood).start()
    # The recording thread finishes while the exporter is still stuck: it never waited.
    assert done.wait(5)
    assert not exporter.release.is_set()
    assert recorder.stats().dropped == 15  # 10 fit in the buffer, the other 15 are counted

    exporter.release.set()
    recorder.force_flush()
    assert exporter.exported == 20


class _RaisingExporter(SpanExporter):
    def export(self, spans):
        raise ConnectionError("collector is down")

    def shutdown(self):
        pass


def test_raising_exporter_is_counted_and_never_reaches_the_caller(make_recorder):
    recorder = make_recorder(_RaisingExporter())
    t = recorder.now()
    for _ in range(3):
        recorder.record(_ref(), Stage.WRITE, t, t + 1)
    recorder.force_flush()
    stats = recorder.stats()
    assert stats.export_failures == 1 and stats.failed_spans == 3 and stats.exported_spans == 0


def test_otlp_endpoint_down_is_counted(make_recorder):
    """A real OTLP/gRPC exporter pointed at a port nobody listens on."""
    import socket

    from kvtrace.telemetry import TelemetryConfig, build_exporter

    with socket.socket() as probe:  # find a free port, then leave it closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = TelemetryConfig.load({"endpoint": f"http://127.0.0.1:{port}", "timeout_ms": 500}, {})
    recorder = make_recorder(build_exporter(config))
    t = recorder.now()
    recorder.record(_ref(), Stage.WRITE, t, t + 1)
    recorder.force_flush()
    assert recorder.stats().export_failures == 1
    assert recorder.stats().failed_spans == 1


def test_shutdown_flushes_and_is_idempotent(make_recorder, memory_exporter):
    recorder = make_recorder(memory_exporter, schedule_delay_ms=60_000)
    t = recorder.now()
    recorder.record(_ref(), Stage.ALLOCATION, t, t + 1)
    recorder.shutdown()
    recorder.shutdown()
    assert [s.name for s in memory_exporter.get_finished_spans()] == ["kv.allocation"]


def test_recorder_is_garbage_collected_after_shutdown(make_recorder, memory_exporter):
    # The fork and atexit hooks hold only weak references.
    from kvtrace.telemetry.recorder import Recorder
    from tests.telemetry.conftest import RESOURCE

    recorder = Recorder(memory_exporter, RESOURCE)
    recorder.shutdown()
    ref = weakref.ref(recorder)
    del recorder
    gc.collect()
    assert ref() is None


def _child(recorder, exporter, conn):
    t = recorder.now()
    recorder.record(TraceRef(7, 9), Stage.HANDSHAKE, t, t + 3)
    recorder.force_flush()
    conn.send(sorted(s.context.trace_id for s in exporter.get_finished_spans()))
    conn.close()


def test_fork_child_starts_clean_and_exports_its_own_records(make_recorder, memory_exporter):
    recorder = make_recorder(memory_exporter, schedule_delay_ms=60_000)
    t = recorder.now()
    recorder.record(TraceRef(5, 9), Stage.HANDSHAKE, t, t + 1)  # still buffered at fork time

    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child, args=(recorder, memory_exporter, child_conn))
    child.start()
    child_trace_ids = parent_conn.recv()
    child.join(10)
    assert child.exitcode == 0
    # The child's worker thread runs, and the parent's buffered record stayed with the parent.
    assert child_trace_ids == [7]
    recorder.force_flush()
    assert [s.context.trace_id for s in memory_exporter.get_finished_spans()] == [5]


def test_noop_recorder_accepts_every_call():
    recorder = NoOpRecorder()
    assert recorder.enabled is False
    recorder.record(_ref(), Stage.WRITE, 0, 1, {"a": 1})
    recorder.record_engine_loop(5)
    assert recorder.force_flush()
    assert recorder.stats().exported_spans == 0
    recorder.shutdown()


def test_a_stepped_system_clock_is_followed_and_a_steady_one_left_alone(make_recorder, memory_exporter,
                                                                         monkeypatch):
    from kvtrace.telemetry import recorder as recorder_module

    rec = make_recorder(memory_exporter, schedule_delay_ms=60_000)
    base = rec._offset_ns
    monkeypatch.setattr(recorder_module, "wall_clock_offset_ns", lambda: base + 50_000)  # a re-read's noise, and more
    rec._follow_clock_steps()
    assert rec._offset_ns == base  # two records of one instant keep exporting one time
    monkeypatch.setattr(recorder_module, "wall_clock_offset_ns", lambda: base + 25_000_000)  # stepped 25 ms
    rec._follow_clock_steps()
    assert rec._offset_ns == base + 25_000_000
    now = rec.now()
    assert rec.to_wall_ns(now) == now + base + 25_000_000
    assert rec.from_wall_ns(rec.to_wall_ns(now)) == now  # another process's wall stamp, onto the stepped clock
