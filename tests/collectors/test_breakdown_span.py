"""The breakdown span the collector adds to each forwarded trace: its encoding, its critical-path
segments, and what happens when late spans decide a trace again."""

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from kvtrace.collectors import breakdown_span, wire
from kvtrace.collectors.attribution import Attributor
from kvtrace.collectors.breakdown_span import BreakdownSpans, breakdown_span_id
from kvtrace.collectors.config import CollectorConfig, ForwardPolicy
from kvtrace.collectors.model import SpanBatch, rebuild_request
from kvtrace.collectors.receivers import OtlpGrpcReceiver
from kvtrace.telemetry import semconv
from tests.collectors.forwarding import Sink, assert_breakdown_matches, attributes, store_breakdowns
from tests.collectors.traces import MS, build
from tests.helpers import wait_until


def decoded(built):
    rows = []
    for request in built.requests:
        rows += SpanBatch.of(request).rows
    return rows


def encode(built, revision=1, segments=False):
    rows = decoded(built)
    breakdown = Attributor().attribute(built.trace_id, rows)
    encoder = BreakdownSpans(segments=segments, version="9.9")
    spans, count = encoder.encode(rows[0].trace_id, breakdown, revision)
    # appended to the trace's own spans, they make one valid export request
    request = ExportTraceServiceRequest.FromString(rebuild_request(rows) + encoder.request([spans]))
    made = request.resource_spans[-1]
    assert len(made.scope_spans[0].spans) == count
    return breakdown, made, rows


@pytest.mark.parametrize("mode,order", [("push", "registration_first"), ("push", "kv_first"), ("pull", "")])
def test_breakdown_span_carries_the_attribution(mode, order):
    built = build(mode, order)
    breakdown, made, rows = encode(built)
    resource = {a.key: a.value.string_value for a in made.resource.attributes}
    assert resource[semconv.RES_SERVICE_NAME] == "kvtrace-collector"
    assert (made.scope_spans[0].scope.name, made.scope_spans[0].scope.version) == ("kvtrace.collector", "9.9")
    (span,) = made.scope_spans[0].spans
    root = next(r for r in rows if r.name == "pd.request")
    assert (span.name, span.trace_id, span.parent_span_id) == ("kvtrace.breakdown", root.trace_id, root.span_id)
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (root.start, root.start + built.ttft_ns)
    attrs = attributes(span)
    assert attrs["kvtrace.breakdown.ttft_ms"] == built.ttft_ns / MS
    for category, ns in built.expected.items():  # the test's own expected split, not the attribution's
        assert attrs[f"kvtrace.breakdown.{category}_ms"] == pytest.approx(ns / MS, abs=1e-9)
        assert attrs[f"kvtrace.breakdown.{category}_share"] == pytest.approx(ns / built.ttft_ns, abs=1e-12)
    assert sum(attrs[f"kvtrace.breakdown.{c}_ms"] for c in built.expected) == pytest.approx(built.ttft_ns / MS)
    assert attrs["kvtrace.breakdown.mode"] == mode
    assert attrs.get("kvtrace.breakdown.rendezvous_order") == (order or None)  # absent in pull
    assert attrs["kvtrace.breakdown.transfer_bytes"] == 2_097_152
    assert attrs["kvtrace.breakdown.prompt_tokens"] == 2000
    assert attrs["kvtrace.breakdown.complete"] is True and attrs["kvtrace.breakdown.error"] is False
    assert "kvtrace.breakdown.missing" not in attrs
    assert attrs["kvtrace.breakdown.request_id"] == "cmpl-x-0"
    assert attrs["kvtrace.breakdown.revision"] == 1 and "kvtrace.breakdown.supersedes" not in attrs
    path = attrs["kvtrace.breakdown.critical_path"].split(">")
    assert path[0] == "router:pd_route" and path[-1] == "router:decode_leg"
    assert ("prefill:prefill" in path) == (order != "kv_first")  # kv_first: prefill is off the path
    assert ("decode:registration" in path) == (order == "kv_first")


def test_clock_offsets_applied_are_carried():
    """D's clock ran 30 ms ahead; no clock was measured, so the offset is inferred and has no bound."""
    breakdown, made, _ = encode(build("push", skew_ms={"decode": 30}))
    attrs = attributes(made.scope_spans[0].spans[0])
    assert attrs["kvtrace.breakdown.decode_clock_offset_ms"] == breakdown.offsets_ns["decode-0"] / MS
    assert -31 < attrs["kvtrace.breakdown.decode_clock_offset_ms"] < -29
    assert attrs["kvtrace.breakdown.prefill_clock_offset_ms"] == 0
    assert "kvtrace.breakdown.decode_clock_bound_ms" not in attrs and "kvtrace.breakdown.prefill_clock_bound_ms" not in attrs


def test_a_failed_trace_has_an_error_status_and_names_what_is_missing():
    breakdown, made, _ = encode(build("pull", fail="read", drop={"decode:completion"}))
    (span,) = made.scope_spans[0].spans
    attrs = attributes(span)
    assert span.status.code == 2 and attrs["kvtrace.breakdown.error"] is True
    assert attrs["kvtrace.breakdown.complete"] is False
    assert attrs["kvtrace.breakdown.missing"] == "decode:completion"


def test_critical_path_segments_tile_the_ttft_on_the_router_clock():
    built = build("push", "kv_first", skew_ms={"prefill": -4, "decode": 6})
    breakdown, made, _ = encode(built, segments=True)
    top, *segments = made.scope_spans[0].spans
    assert top.name == "kvtrace.breakdown" and len(segments) >= 8
    assert all(s.parent_span_id == top.span_id for s in segments)
    assert len({s.span_id for s in [top, *segments]}) == len(segments) + 1
    # contiguous, first to last, from the request's arrival to the first token at the router
    assert segments[0].start_time_unix_nano == top.start_time_unix_nano
    assert segments[-1].end_time_unix_nano == top.end_time_unix_nano
    for before, after in zip(segments, segments[1:]):
        assert before.end_time_unix_nano == after.start_time_unix_nano
    per_category = {}
    for segment in segments:
        attrs = attributes(segment)
        label = segment.name.removeprefix("kvtrace.critical ")
        assert label in (f"{attrs['kvtrace.critical.side']}.{attrs['kvtrace.stage']}", "unattributed")
        per_category[attrs["kvtrace.category"]] = per_category.get(attrs["kvtrace.category"], 0) + (
            segment.end_time_unix_nano - segment.start_time_unix_nano)
    assert per_category == {k: v for k, v in built.expected.items() if v}
    named = [s.name.removeprefix("kvtrace.critical ").replace(".", ":") for s in segments
             if s.name != "kvtrace.critical unattributed"]
    assert ">".join(named) == attributes(top)["kvtrace.breakdown.critical_path"]


def test_revisions_have_distinct_ids_and_name_the_one_they_supersede():
    built = build("push")
    _, first, rows = encode(built, revision=1)
    _, second, _ = encode(built, revision=2)
    (one,), (two,) = first.scope_spans[0].spans, second.scope_spans[0].spans
    assert one.span_id != two.span_id and one.span_id == breakdown_span_id(rows[0].trace_id, 1)
    assert attributes(two)["kvtrace.breakdown.supersedes"] == one.span_id.hex()
    assert attributes(two)["kvtrace.breakdown.revision"] == 2
    assert all(span.span_id != one.span_id for span in rows)


needs_native = pytest.mark.skipif(wire.native is None, reason="native module not built")


@needs_native
def test_native_attributes_are_the_reference_bytes():
    keys = ("s", "empty", "unicode", "t", "f", "zero", "big", "negative", "int64 min", "wrapped", "x", "nan", "gone")
    values = ["a value", "", "µs → ✓", True, False, 0, 2**63 - 1, -1, -2**63, 2**64 + 5, -0.25, float("nan"), None]
    encoded = wire.native.attributes(keys, values)
    assert encoded == wire.attributes_python(keys, values)
    decoded = {kv.key: kv.value for kv in Span.FromString(encoded).attributes}
    assert "gone" not in decoded and len(decoded) == len(keys) - 1  # None: left out
    assert (decoded["s"].string_value, decoded["empty"].string_value, decoded["unicode"].string_value) == \
        ("a value", "", "µs → ✓")
    assert (decoded["t"].bool_value, decoded["f"].bool_value, decoded["f"].WhichOneof("value")) == (True, False, "bool_value")
    assert [decoded[k].int_value for k in ("zero", "big", "negative", "int64 min", "wrapped")] == [0, 2**63 - 1, -1, -2**63, 5]
    assert decoded["x"].double_value == -0.25 and decoded["nan"].double_value != decoded["nan"].double_value
    long_key, long_text = "k" * 300, "v" * 20_000  # lengths of several varint bytes
    assert wire.native.attributes((long_key,), [long_text]) == wire.attributes_python((long_key,), [long_text])
    for encode in (wire.native.attributes, wire.attributes_python):
        with pytest.raises(TypeError, match="'k'"):
            encode(("k",), [[1]])
        with pytest.raises(ValueError, match="2 keys, 1 values"):
            encode(("a", "b"), [1])


def test_a_batch_of_breakdown_spans_is_one_resource_with_each_span_whole():
    """The tee's batches: many encoded breakdown spans in one ``resource_spans`` entry under the collector's
    resource and scope, each span as encoded alone (the entry is written in one join, not field by field)."""
    encoder = BreakdownSpans(version="9.9")
    encoded = []
    for built in (build("push", "registration_first"), build("push", "kv_first"), build("pull")):
        rows = decoded(built)
        encoded.append(encoder.encode(rows[0].trace_id, Attributor().attribute(built.trace_id, rows), 1)[0])
    payload = encoder.request(encoded)
    assert payload == wire.field(1, encoder._resource + wire.field(2, encoder._scope + b"".join(encoded)))
    (resource_spans,) = ExportTraceServiceRequest.FromString(payload).resource_spans
    assert {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"] == "kvtrace-collector"
    (scope_spans,) = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("kvtrace.collector", "9.9")
    alone = [ExportTraceServiceRequest.FromString(encoder.request([one])).resource_spans[0].scope_spans[0].spans[0]
             for one in encoded]
    assert list(scope_spans.spans) == alone and len({span.trace_id for span in alone}) == 3


@needs_native
@pytest.mark.parametrize("shape", ["registration_first", "kv_first", "pull", "failed", "skewed"])
def test_the_breakdown_span_is_the_same_bytes_native_or_python(shape, monkeypatch):
    built = {"registration_first": lambda: build("push", "registration_first"),
             "kv_first": lambda: build("push", "kv_first"), "pull": lambda: build("pull"),
             "failed": lambda: build("pull", fail="read", drop={"decode:completion"}),
             "skewed": lambda: build("push", skew_ms={"prefill": -4, "decode": 6})}[shape]()
    rows = decoded(built)
    breakdown = Attributor().attribute(built.trace_id, rows)
    encoder = BreakdownSpans(segments=True)
    native = [encoder.encode(rows[0].trace_id, breakdown, revision) for revision in (1, 2)]
    monkeypatch.setattr(breakdown_span, "attributes", wire.attributes_python)
    assert [encoder.encode(rows[0].trace_id, breakdown, revision) for revision in (1, 2)] == native


@pytest.fixture
def upstream():
    sink = Sink()
    receiver = OtlpGrpcReceiver(sink, port=0)
    receiver.start()
    yield f"grpc://127.0.0.1:{receiver.port}", sink
    receiver.shutdown()


def by_service(built):
    return {next(a.value.string_value for a in r.resource_spans[0].resource.attributes if a.key == "service.name"): r
            for r in built.requests}


@pytest.mark.parametrize("policy", ["all", "slow:0"])
def test_late_spans_send_a_second_revision_that_supersedes_the_first(make_collector, upstream, policy):
    url, sink = upstream
    collector = make_collector(forward=[url], forward_policies=[ForwardPolicy.parse(policy)])
    built = build("push", "kv_first")
    requests = by_service(built)
    for service in ("vllm-prefill", "vllm-decode"):
        collector.consume(SpanBatch.of(requests[service]))
    assert wait_until(lambda: len(sink.breakdowns) == 1, timeout_s=20)  # decided without the router's spans
    first = attributes(sink.breakdowns[0])
    # without any router span, the engines are the TTFT reference (a router-less trace is complete)
    assert first["kvtrace.breakdown.ttft_reference"] == "engine" and sink.breakdowns[0].parent_span_id == b""
    collector.consume(SpanBatch.of(requests["kvtrace-router"]))  # late: the trace is decided again
    assert wait_until(lambda: len(sink.breakdowns) == 2, timeout_s=20)
    collector.store.flush()
    one, two = sorted(sink.breakdowns, key=lambda s: attributes(s)["kvtrace.breakdown.revision"])
    final = attributes(two)
    assert final["kvtrace.breakdown.revision"] == 2 and final["kvtrace.breakdown.supersedes"] == one.span_id.hex()
    assert final["kvtrace.breakdown.complete"] is True and two.parent_span_id != b""
    assert final["kvtrace.breakdown.ttft_reference"] == "router"
    assert_breakdown_matches(final, store_breakdowns(collector.store.query)[built.trace_id])  # the final one


def test_a_trace_the_assembler_forgot_keeps_its_first_breakdown(tmp_path, upstream):
    """Past the assembler's memory of decided traces, a late span is not merged (the store keeps
    the trace's row): no second breakdown contradicts the first."""
    url, sink = upstream
    from kvtrace.collectors.service import Collector
    collector = Collector(CollectorConfig(db_path=str(tmp_path / "kv.duckdb"), grpc_port=0, http_port=None,
                                          query_port=None, decision_wait_s=0.1, max_traces=1, forward=[url]))
    collector.start()
    try:
        forgotten, other = build("push"), build("pull")
        parts = by_service(forgotten)
        collector.consume(SpanBatch.of(parts["kvtrace-router"]))
        collector.consume(SpanBatch.of(parts["vllm-prefill"]))
        assert wait_until(lambda: len(sink.breakdowns) == 1, timeout_s=20)
        for request in other.requests:  # decided after it: the assembler's one remembered trace
            collector.consume(SpanBatch.of(request))
        assert wait_until(lambda: len(sink.breakdowns) == 2, timeout_s=20)
        collector.consume(SpanBatch.of(parts["vllm-decode"]))
        assert wait_until(lambda: collector.assembler.stats.traces_decided == 3, timeout_s=20)
        collector.store.flush()
        assert wait_until(lambda: collector.upstreams[0].backlog() == 0)
        assert sorted(s.trace_id.hex() for s in sink.breakdowns) == sorted([forgotten.trace_id, other.trace_id])
        rows = store_breakdowns(collector.store.query)
        for span in sink.breakdowns:
            assert_breakdown_matches(attributes(span), rows[span.trace_id.hex()])
    finally:
        collector.shutdown()


def test_no_breakdown_when_switched_off(make_collector, upstream):
    url, sink = upstream
    collector = make_collector(forward=[url], forward_breakdown=False)
    built = build("pull")
    for request in built.requests:
        collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: collector.assembler.stats.traces_decided == 1 and collector.upstreams[0].backlog() == 0
                      and len(sink.spans) == 17, timeout_s=20)
    assert sink.breakdowns == [] and collector.upstreams[0].stats.forwarded_spans == 17


def test_critical_path_needs_the_breakdown():
    with pytest.raises(ValueError, match="--forward-critical-path"):
        CollectorConfig(forward_breakdown=False, forward_critical_path=True).validate()
