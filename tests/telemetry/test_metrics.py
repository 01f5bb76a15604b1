"""Prometheus: stage histograms, bytes, failures, drops and export failures, with exemplars."""

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest

from kvtrace.telemetry import semconv
from kvtrace.telemetry.context import TraceRef
from kvtrace.telemetry.metrics import KvtraceMetrics
from kvtrace.telemetry.semconv import Stage
from tests.telemetry.test_recorder import _RaisingExporter


def test_recorder_feeds_metrics(make_recorder):
    registry = CollectorRegistry()
    metrics = KvtraceMetrics("push", "producer", registry)
    recorder = make_recorder(_RaisingExporter(), metrics=metrics, max_queue_size=4,
                             max_export_batch_size=4, schedule_delay_ms=60_000)
    ref = TraceRef(0xABC, 0x1)
    recorder.record(ref, Stage.WRITE, 0, 2_000_000, {semconv.ATTR_TRANSFER_BYTES: 4096})
    recorder.record(ref, Stage.WRITE, 0, 1_000, {semconv.ATTR_TRANSFER_BYTES: 1024},
                    error="transfer_failed")
    recorder.record_engine_loop(3_000, "worker")
    recorder.force_flush()

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    stage = {"stage": "write", "mode": "push", "role": "producer"}
    assert value("kvtrace_stage_duration_seconds_count", **stage) == 2
    assert value("kvtrace_stage_duration_seconds_sum", **stage) == 0.002001
    assert value("kvtrace_transfer_bytes_total", op="write", mode="push", role="producer") == 5120
    assert value("kvtrace_transfer_failures_total", cause="transfer_failed", mode="push",
                 role="producer") == 1
    assert value("kvtrace_engine_loop_seconds_count", part="worker", mode="push", role="producer") == 1
    assert value("kvtrace_export_failures_total", mode="push", role="producer") == 1

    with recorder._export_lock:  # hold the exporter thread off: 4 records fit, 2 are dropped
        for _ in range(6):
            recorder.record(ref, Stage.PREFILL, 0, 1)
    recorder.force_flush()
    assert value("kvtrace_dropped_records_total", mode="push", role="producer") == 2

    exposition = generate_latest(registry).decode()
    assert '# {trace_id="00000000000000000000000000000abc"}' in exposition
