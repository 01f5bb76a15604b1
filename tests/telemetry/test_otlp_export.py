"""Records travel through the real OTLP exporters (gRPC and HTTP) into receivers on 127.0.0.1."""

import threading

import pytest

from kvtrace.collectors.receivers import OtlpGrpcReceiver, OtlpHttpReceiver
from kvtrace.telemetry import Role, Mode, Stage, TelemetryConfig, build_exporter, build_resource, semconv
from kvtrace.telemetry.context import TraceRef, new_span_id, new_trace_id
from kvtrace.telemetry.recorder import Recorder


class Sink:
    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()

    def __call__(self, batch):
        with self.lock:
            self.requests.append(batch.request)

    def spans(self):
        out = []
        for request in self.requests:
            for rs in request.resource_spans:
                resource = {a.key: a.value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out += [(resource, ss.scope.name, span) for span in ss.spans]
        return out


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_arrive_with_ids_times_attributes_and_resource(protocol):
    sink = Sink()
    receiver = (OtlpGrpcReceiver if protocol == "grpc" else OtlpHttpReceiver)(sink, port=0)
    receiver.start()
    try:
        config = TelemetryConfig.load(
            {"endpoint": receiver.endpoint, "protocol": protocol, "headers": {"x-tenant": "kv"}},
            {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"})
        resource = build_resource(config, Role.PRODUCER, Mode.PUSH, engine_id="engine-p")
        recorder = Recorder(build_exporter(config), resource)
        ref = TraceRef(new_trace_id(), new_span_id())
        t = recorder.now()
        recorder.record(ref, Stage.WRITE, t, t + 2_500_000, {semconv.ATTR_TRANSFER_BYTES: 1 << 20,
                                                             semconv.ATTR_BLOCK_COUNT: 8})
        recorder.record(ref, Stage.HANDSHAKE, t, t + 10, {semconv.ATTR_HANDSHAKE_KIND: "full"},
                        error="handshake_failed")
        recorder.shutdown()
        assert recorder.stats().exported_spans == 2 and recorder.stats().export_failures == 0
    finally:
        receiver.shutdown()

    spans = {span.name: (resource, scope, span) for resource, scope, span in sink.spans()}
    resource, scope, write = spans["kv.write"]
    assert scope == "kvtrace"
    assert resource["service.name"].string_value == "vllm-prefill"
    assert resource["kvtrace.role"].string_value == "producer"
    assert resource["kvtrace.mode"].string_value == "push"
    assert resource["kvtrace.engine_id"].string_value == "engine-p"
    assert resource["deployment.environment"].string_value == "test"
    assert write.trace_id == ref.trace_id.to_bytes(16, "big")
    assert write.parent_span_id == ref.span_id.to_bytes(8, "big")
    assert write.start_time_unix_nano == recorder.to_wall_ns(t)
    assert write.end_time_unix_nano - write.start_time_unix_nano == 2_500_000
    attrs = {a.key: a.value for a in write.attributes}
    assert attrs["kvtrace.transfer.bytes"].int_value == 1 << 20
    assert attrs["kvtrace.category"].string_value == "wire"
    _, _, handshake = spans["kv.handshake"]
    assert handshake.status.code == 2  # STATUS_CODE_ERROR
    assert handshake.events[0].name == "kvtrace.failure"
