"""10,000+ malformed or hostile payloads; the collector answers each properly and keeps serving."""

import json
import random

import grpc
import requests

from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors.read import open_store
from kvtrace.collectors.receivers import decode_json
from tests.collectors.test_receivers import grpc_target, http_url
from tests.collectors.traces import build
from tests.helpers import wait_until

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def hostile_payloads(rng: random.Random, valid: bytes):
    """(body, content type) pairs: random bytes, flipped bits, truncations, bad JSON, bombs."""
    kinds = []
    for _ in range(4000):  # random bytes, any length
        kinds.append((rng.randbytes(rng.randint(0, 2048)), "application/x-protobuf"))
    for _ in range(3000):  # a valid message with a few bytes flipped or cut
        body = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        if rng.random() < 0.3:
            body = body[: rng.randrange(len(body))]
        kinds.append((bytes(body), "application/x-protobuf"))
    for _ in range(1500):  # hostile JSON
        choice = rng.randrange(6)
        if choice == 0:
            body = b"[" * rng.randint(1, 5000)
        elif choice == 1:
            body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "1"}]}]}]}).encode()
        elif choice == 2:
            body = json.dumps({"resourceSpans": "nope"}).encode()
        elif choice == 3:
            body = rng.randbytes(64)
        elif choice == 4:
            body = json.dumps([1, 2, 3]).encode()
        else:
            body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
                "traceId": "0" * 32, "spanId": "1" * 16, "startTimeUnixNano": "-5"}]}]}]}).encode()
        kinds.append((body, "application/json"))
    for _ in range(500):  # wrong or missing content types: always 415
        kinds.append((valid, rng.choice(["text/plain", "", "application/xml", "multipart/form-data"])))
    rng.shuffle(kinds)
    return kinds


def test_ten_thousand_hostile_payloads_never_disturb_correct_requests(make_collector):
    collector = make_collector(max_body_bytes=256 * 1024)
    rng = random.Random(2026)
    valid_request = build("push").requests[0]
    valid = valid_request.SerializeToString()
    session = requests.Session()
    url = http_url(collector)
    statuses: dict[int, int] = {}
    spans_accepted = 0  # every span of every request answered 200 must be counted, once
    payloads = hostile_payloads(rng, valid)
    valid_spans = len(SpanBatch.decode(valid).rows)
    for i, (body, content_type) in enumerate(payloads):
        response = session.post(url, data=body, headers={"Content-Type": content_type}, timeout=10)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if content_type not in ("application/x-protobuf", "application/json"):
            assert response.status_code == 415, (content_type, response.status_code)
        elif len(body) > 256 * 1024:
            assert response.status_code == 413
        else:
            assert response.status_code in (200, 400), (response.status_code, body[:40])
        if response.status_code == 200:
            batch = SpanBatch.of(decode_json(body)) if content_type == "application/json" else SpanBatch.decode(body)
            spans_accepted += len(batch.rows)
        if i % 100 == 0:  # a correct client in between keeps being served
            ok = session.post(url, data=valid, headers={"Content-Type": "application/x-protobuf"}, timeout=10)
            assert ok.status_code == 200
            spans_accepted += valid_spans

    channel = grpc.insecure_channel(grpc_target(collector))
    raw_export = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
    grpc_codes: dict[str, int] = {}
    for i in range(2000):
        body = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        try:
            raw_export(bytes(body), timeout=10)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        grpc_codes[code] = grpc_codes.get(code, 0) + 1
        assert code in ("OK", "INVALID_ARGUMENT"), code
        if code == "OK":
            spans_accepted += len(SpanBatch.decode(bytes(body)).rows)
        if i % 100 == 0:
            raw_export(valid, timeout=10)
            spans_accepted += valid_spans

    # Most hostile payloads are refused (the mix makes valid ones rare), every accepted span is
    # counted exactly once, and the correct client's trace is stored and attributed.
    assert statuses.get(400, 0) > 5000 and grpc_codes.get("INVALID_ARGUMENT", 0) > 1000
    assert statuses[415] == 500
    assert wait_until(lambda: collector.metrics.counts()["spans_received"] == spans_accepted, 30), \
        (collector.metrics.counts()["spans_received"], spans_accepted)
    trace_id = valid_request.resource_spans[0].scope_spans[0].spans[0].trace_id.hex()
    reader = open_store(collector.config.db_path)
    assert wait_until(lambda: reader.trace(trace_id) is not None, 30)
