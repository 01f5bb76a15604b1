"""Receivers with real senders (the OpenTelemetry SDK's exporters) and with bad input."""

import json
import subprocess

import grpc
import pytest
import requests
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.helpers import wait_until
from tests.collectors.traces import build


def http_url(collector):
    (receiver,) = [r for r in collector.receivers if "Http" in type(r).__name__]
    return receiver.endpoint


def grpc_target(collector):
    (receiver,) = [r for r in collector.receivers if "Grpc" in type(r).__name__]
    return f"127.0.0.1:{receiver.port}"


def stored_span_ids(collector):
    collector.store.flush()
    return {row[0] for row in collector.store.query("SELECT span_id FROM spans")}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_exporters_deliver_into_the_store(make_collector, protocol):
    collector = make_collector()
    exporter = (GrpcExporter(endpoint=f"http://{grpc_target(collector)}", insecure=True) if protocol == "grpc"
                else HttpExporter(endpoint=http_url(collector)))
    provider = TracerProvider(resource=Resource.create({"service.name": "sdk-sender"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    ids = set()
    for i in range(5):
        with tracer.start_as_current_span(f"op-{i}") as span:
            span.set_attribute("kvtrace.request_id", f"r{i}")
            ids.add(f"{span.get_span_context().span_id:016x}")
    provider.shutdown()
    assert wait_until(lambda: ids <= stored_span_ids(collector))
    assert collector.store.query("SELECT DISTINCT service FROM spans") == [("sdk-sender",)]
    # Each span is its own trace, decided and kept; none has a kvtrace span (router, P or D), so none is a
    # request to attribute: no row in requests (vLLM's own tracing sends traces like these).
    assert wait_until(lambda: collector.assembler.stats.traces_decided == 5)
    collector.store.flush()
    assert collector.store.query("SELECT count(*) FROM requests") == [(0,)]


def valid_payload() -> bytes:
    return build("push").requests[0].SerializeToString()


def post(collector, body, content_type="application/x-protobuf", headers=None):
    return requests.post(http_url(collector), data=body, timeout=10,
                         headers={"Content-Type": content_type, **(headers or {})})


def test_http_answers_each_kind_of_bad_input_properly(make_collector):
    collector = make_collector(max_body_bytes=64 * 1024)
    assert post(collector, valid_payload()).status_code == 200
    assert post(collector, b"\xff\x00garbage").status_code == 400
    assert post(collector, valid_payload(), content_type="text/plain").status_code == 415
    assert post(collector, b"x" * (65 * 1024)).status_code == 413
    assert post(collector, b"{not json", content_type="application/json").status_code == 400
    response = requests.get(http_url(collector), timeout=5)
    assert response.status_code in (404, 405, 501)

    bad_ids = ExportTraceServiceRequest()
    bad_ids.CopyFrom(build("push").requests[0])
    bad_ids.resource_spans[0].scope_spans[0].spans[0].trace_id = b"\x00" * 16
    response = post(collector, bad_ids.SerializeToString())
    assert response.status_code == 400 and "trace_id" in response.json()["message"]

    absurd = ExportTraceServiceRequest()
    absurd.CopyFrom(build("push").requests[0])
    absurd.resource_spans[0].scope_spans[0].spans[0].start_time_unix_nano = 5
    assert post(collector, absurd.SerializeToString()).status_code == 400
    assert collector.metrics.registry.get_sample_value("kvtrace_collector_spans_received_total") > 0


def test_export_requests_and_spans_are_counted_per_accepted_request(make_collector):
    """Spans per export request (spans_received_total over export_requests_total) is what says whether senders
    batch well: refused requests count in neither."""
    collector = make_collector()
    sample = collector.metrics.registry.get_sample_value
    stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(grpc_target(collector)))
    sent = [build(mode).requests[i] for mode in ("push", "pull") for i in range(2)]
    for request in sent[:2]:
        assert post(collector, request.SerializeToString()).status_code == 200
    for request in sent[2:]:
        stub.Export(request, timeout=5)
    assert post(collector, b"\xff\x00garbage").status_code == 400
    spans = sum(len(ss.spans) for request in sent for rs in request.resource_spans for ss in rs.scope_spans)
    assert spans > len(sent)  # requests of several spans: the two counters differ
    assert wait_until(lambda: sample("kvtrace_collector_spans_received_total") == spans)
    assert sample("kvtrace_collector_export_requests_total") == len(sent)


def test_http_json_with_hex_ids_is_accepted(make_collector):
    collector = make_collector()
    body = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "json-sender"}}]},
        "scopeSpans": [{"spans": [{"traceId": "5b8efff798038103d269b633813fc60c",
                                   "spanId": "eee19b7ec3c1b174", "name": "json-span",
                                   "startTimeUnixNano": "1790000000000000000",
                                   "endTimeUnixNano": "1790000000000001000"}]}]}]}
    response = post(collector, json.dumps(body).encode(), content_type="application/json")
    assert response.status_code == 200
    assert wait_until(lambda: "eee19b7ec3c1b174" in stored_span_ids(collector))


def test_grpc_status_codes(make_collector):
    collector = make_collector(max_body_bytes=64 * 1024)
    stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(grpc_target(collector)))
    stub.Export(build("pull").requests[0], timeout=5)
    bad = ExportTraceServiceRequest()
    bad.CopyFrom(build("pull").requests[0])
    bad.resource_spans[0].scope_spans[0].spans[0].span_id = b"\x01\x02"
    with pytest.raises(grpc.RpcError) as raised:
        stub.Export(bad, timeout=5)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    huge = ExportTraceServiceRequest()
    huge.CopyFrom(build("pull").requests[0])
    huge.resource_spans[0].scope_spans[0].spans[0].name = "n" * (70 * 1024)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Export(huge, timeout=5)
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bearer_token_is_required_when_configured(make_collector):
    collector = make_collector(bearer_token="s3cret")
    assert post(collector, valid_payload()).status_code == 401
    assert post(collector, valid_payload(), headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert post(collector, valid_payload(), headers={"Authorization": "Bearer s3cret"}).status_code == 200
    stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(grpc_target(collector)))
    with pytest.raises(grpc.RpcError) as raised:
        stub.Export(build("pull").requests[0], timeout=5)
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    stub.Export(build("pull").requests[0], timeout=5, metadata=[("authorization", "Bearer s3cret")])


def test_tls(make_collector, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    collector = make_collector(tls_cert=str(cert), tls_key=str(key))
    url = http_url(collector)
    assert url.startswith("https://")
    response = requests.post(url, data=valid_payload(), verify=str(cert), timeout=10,
                             headers={"Content-Type": "application/x-protobuf"})
    assert response.status_code == 200
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    stub = trace_service_pb2_grpc.TraceServiceStub(grpc.secure_channel(grpc_target(collector), credentials))
    stub.Export(build("pull").requests[0], timeout=5)


def test_full_pipeline_answers_retry_later(make_collector):
    collector = make_collector(queue_requests=1)
    collector.intake._slots.acquire()  # the one slot is taken: as if the pipeline were busy
    try:
        assert post(collector, valid_payload()).status_code == 503
    finally:
        collector.intake._slots.release()
    assert post(collector, valid_payload()).status_code == 200
    assert collector.metrics.registry.get_sample_value(
        "kvtrace_collector_requests_rejected_total", {"reason": "busy"}) == 1
