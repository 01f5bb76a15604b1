"""The native OTLP decoder (collectors/_otlp.c) against the reference, decode_python: same
rows, same columns, same errors; and hostile bytes only ever end in PermanentError."""

import gc
import os
import random
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from kvtrace.collectors import compiled, model
from kvtrace.collectors.model import PermanentError, SpanRow
from tests.collectors.traces import BASE_NS, build

native = pytest.mark.skipif(model._otlp is None, reason="native decoder not built")


def test_the_native_decoder_is_built():
    # Installed from this repository with a C compiler, the collector must not fall back silently.
    if os.environ.get(compiled.PURE_ENV):
        pytest.skip("the Python decoder was asked for")
    assert model.DECODER == "native"


def both(payload: bytes):
    """(native result or its PermanentError, Python result or its PermanentError)."""
    latest = time.time_ns() + model.FUTURE_SLACK_NS
    out = []
    for decode in (lambda: model.decode(payload), lambda: model.decode_python(payload, latest)):
        try:
            out.append(decode())
        except PermanentError as exc:
            out.append(exc)
    return out


def comparable(result):
    """A decode result with the originals (span, scope, resource) as messages: the native
    decoder keeps their bytes as received, the Python one serialises them again."""
    if isinstance(result, Exception):
        return ("error", str(result))
    rows, columns = result
    origin = lambda o: (o.service, o.instance, o.role, o.mode, o.side, o.stages,  # noqa: E731
                        Resource.FromString(o.resource))
    message = {"origin": origin, "scope": InstrumentationScope.FromString, "raw": Span.FromString}
    return ([tuple(message[f](v) if f in message else v for f, v in zip(SpanRow._fields, row)) for row in rows],
            [getattr(columns, f) for f in columns.__slots__ if f != "origins"], [origin(o) for o in columns.origins])


def odd_request() -> ExportTraceServiceRequest:
    """Outside the contract: unknown roles, kvtrace.stage on its own, every AnyValue kind, events,
    links, two scopes, a resource with no attributes, non-ASCII names."""
    request = ExportTraceServiceRequest()
    for r, role in enumerate(["batch-worker", "", "producer"]):
        resource_spans = request.resource_spans.add()
        if role:
            resource_spans.resource.attributes.add(key="kvtrace.role", value=AnyValue(string_value=role))
            resource_spans.resource.attributes.add(key="service.name", value=AnyValue(string_value=f"svc-{r}"))
        for s in range(2):
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.name = f"scope-{s}"
            for i in range(3):
                span = scope_spans.spans.add(trace_id=bytes([r + 1] * 16), span_id=bytes([s + 1, i + 1] * 4),
                                             name=["kv.write", "étape ✓", "engine.prefill"][i],
                                             start_time_unix_nano=BASE_NS + i, end_time_unix_nano=BASE_NS + 10 + i)
                if i:
                    span.parent_span_id = bytes([9] * 8)
                span.status.code = i
                span.attributes.extend([
                    KeyValue(key="kvtrace.stage", value=AnyValue(string_value=f"custom-{i}" if i != 2 else "")),
                    KeyValue(key="kvtrace.transfer.bytes", value=AnyValue(int_value=-5 if i else 7)),
                    KeyValue(key="kvtrace.transfer.post_us", value=AnyValue(double_value=1.5)),
                    KeyValue(key="kvtrace.rendezvous.order", value=AnyValue(bool_value=True)),
                    KeyValue(key="kvtrace.input_tokens", value=AnyValue(array_value=ArrayValue())),
                    KeyValue(key="unread", value=AnyValue(string_value="x" * 300)),
                ])
                span.events.add(name="e", time_unix_nano=BASE_NS)
                span.links.add(trace_id=bytes(16), span_id=bytes(8))
    return request


@native
@pytest.mark.parametrize("case", ["push", "kv_first", "pull", "failed read", "skewed", "odd"])
def test_native_and_python_decode_the_same(case):
    if case == "odd":
        requests = [odd_request()]
    else:
        built = {"push": lambda: build("push"), "kv_first": lambda: build("push", "kv_first"),
                 "pull": lambda: build("pull"), "failed read": lambda: build("pull", fail="read"),
                 "skewed": lambda: build("push", skew_ms={"decode": 50})}[case]()
        requests = built.requests
    for request in requests:
        native_result, python_result = both(request.SerializeToString())
        assert not isinstance(native_result, Exception), native_result
        assert comparable(native_result) == comparable(python_result)
        assert not any(gc.is_tracked(row) for row in native_result[0])  # the cyclic GC never walks them


@native
def test_names_and_trace_ids_are_shared_not_mixed_up():
    """The native decoder hands out one object per distinct name (up to 32 a request, then new ones)
    and reuses the previous span's trace id: with 40 names and traces interleaved, every row still
    gets its own name and trace id."""
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for i in range(120):
        spans.add(trace_id=bytes([1 + (i // 2) % 3] * 16), span_id=(i + 1).to_bytes(8, "big"),
                  name=f"step-{i % 40}" + ("é" if i % 7 == 0 else ""), start_time_unix_nano=BASE_NS,
                  end_time_unix_nano=BASE_NS + 1)
    native_result, python_result = both(request.SerializeToString())
    assert comparable(native_result) == comparable(python_result)
    rows = native_result[0]
    assert [r.name for r in rows] == [s.name for s in spans]
    assert [r.trace_id for r in rows] == [s.trace_id for s in spans]
    assert rows[0].trace_id is rows[1].trace_id and rows[1].name is rows[41].name  # shared, not copied


def test_a_sender_keeps_one_origin_across_requests(monkeypatch):
    """Each sender's Origin is built once per distinct resource (model.origin_of) and shared by its
    requests, by both decoders; another resource gets its own, and a full cache starts again."""
    monkeypatch.setattr(model, "_origins", {})
    built = build("push")  # one request per service: router, P, D
    latest = time.time_ns() + model.FUTURE_SLACK_NS
    for decode in (model.decode, lambda payload: model.decode_python(payload, latest)):
        first = [decode(r.SerializeToString())[0] for r in built.requests]
        again = [decode(r.SerializeToString())[0] for r in built.requests]
        for rows_first, rows_again in zip(first, again):
            assert rows_again[0].origin is rows_first[0].origin
        services = [rows[0].origin.service for rows in first]
        assert len(set(services)) == len(services) == len({id(rows[0].origin) for rows in first})
    monkeypatch.setattr(model, "ORIGINS_KEPT", 2)
    model._origins.clear()
    for request in built.requests:
        model.decode(request.SerializeToString())
    assert 1 <= len(model._origins) <= 2


@native
@pytest.mark.parametrize("bad, message", [
    (dict(trace_id=bytes(16)), "trace_id must be 16 non-zero bytes"),
    (dict(trace_id=b"\x01" * 15), "trace_id must be 16 non-zero bytes"),
    (dict(span_id=bytes(8)), "span_id must be 8 non-zero bytes"),
    (dict(parent_span_id=b"\x01" * 3), "parent_span_id must be 8 bytes"),
    (dict(start_time_unix_nano=5, end_time_unix_nano=6), "timestamp out of range"),
    (dict(end_time_unix_nano=BASE_NS - 1), "ends before it starts"),
    (dict(end_time_unix_nano=2**63), "timestamp out of range"),
])
def test_bad_spans_are_refused_with_the_same_reason(bad, message):
    request = ExportTraceServiceRequest()
    fields = dict(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="kv.write", start_time_unix_nano=BASE_NS,
                  end_time_unix_nano=BASE_NS + 1)
    fields.update(bad)
    request.resource_spans.add().scope_spans.add().spans.add(**fields)
    native_result, python_result = both(request.SerializeToString())
    assert isinstance(native_result, PermanentError) and message in str(native_result)
    assert str(native_result) == str(python_result)


@native
def test_hostile_bytes_end_in_permanent_error_or_agree():
    """Valid requests with bytes flipped or cut, and random bytes: the native decoder returns or
    raises PermanentError, never anything else; where both decoders accept, they agree."""
    rng = random.Random(11)
    valid = [r.SerializeToString() for r in build("push").requests + [odd_request()]]
    accepted = agreed = 0
    for n in range(4000):
        if n % 4 == 0:
            body = rng.randbytes(rng.randint(0, 600))
        else:
            body = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 6)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            if rng.random() < 0.3:
                body = body[: rng.randrange(len(body))]
            body = bytes(body)
        native_result, python_result = both(body)  # anything but PermanentError propagates here
        if not isinstance(native_result, Exception) and not isinstance(python_result, Exception):
            accepted += 1
            agreed += comparable(native_result) == comparable(python_result)
    assert accepted > 100  # the mutations leave many requests valid
    assert agreed == accepted
