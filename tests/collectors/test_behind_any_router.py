"""Attribution behind any router: the TTFT reference (router, gateway, engine), a walk that bridges
missing stages, the relay between P and D, tensor-parallel ranks, and traces of an older contract."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace.collectors.attribution import Attributor
from kvtrace.collectors.model import SpanBatch
from tests.collectors.test_attribution import attribute, check_invariants
from tests.collectors.traces import MS, build


def _rows(built, extra=()):
    rows = built.rows()
    for request in extra:
        rows += SpanBatch.of(request).rows
    return rows


def _outside_span(built, name: str, service: str, start_ms: float, end_ms: float, span_id: bytes,
                  parent: bytes = b"", ttft_s: float | None = None) -> ExportTraceServiceRequest:
    """A span from a service outside the contract (the user's gateway, vLLM's own tracing, with its
    ``gen_ai.latency.time_to_first_token`` where given)."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    attribute_ = rs.resource.attributes.add()
    attribute_.key, attribute_.value.string_value = "service.name", service
    span = rs.scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.parent_span_id = bytes.fromhex(built.trace_id), span_id, parent
    span.name = name
    span.start_time_unix_nano = 1_790_000_000_000_000_000 + int(start_ms * MS)
    span.end_time_unix_nano = 1_790_000_000_000_000_000 + int(end_ms * MS)
    if ttft_s is not None:
        ttft = span.attributes.add()
        ttft.key, ttft.value.double_value = "gen_ai.latency.time_to_first_token", ttft_s
    return request


def _root_id(built) -> bytes:
    """The span id every engine span's parent names (the router's pd.request in a full trace)."""
    rows = _rows(built)
    return next(r.parent_span_id for r in rows if r.stage == "p_queue")


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_without_kvtraces_router_ttft_runs_from_p_input_to_the_first_token(mode):
    breakdown = attribute(build(mode, drop={"router"}))
    check_invariants(breakdown)
    assert breakdown.ttft_reference == "engine"
    assert breakdown.complete and breakdown.missing == []  # no router stage is expected
    assert breakdown.ttft_ns == (168 if mode == "push" else 180) * MS - 2 * MS  # from P's input at 2 ms
    assert breakdown.critical_ns[("prefill", "prefill")] == 144 * MS  # P's prefill is on the path
    assert breakdown.parts["unattributed"] == 0  # every ms between P's input and D's first token is named
    if mode == "pull":  # P's prefill ended at 150 ms, D had its leg at 153 ms: the user's router relayed
        assert breakdown.critical_ns[("router", "relay")] == 3 * MS
        assert breakdown.parts["coordination"] == (3 + 1 + 1 + 2) * MS
    else:
        assert ("router", "relay") not in breakdown.timings


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_gateway_span_enclosing_both_legs_is_the_reference(mode):
    built = build(mode, drop={"router"})
    end = 168 if mode == "push" else 180
    gateway = _outside_span(built, "POST /v1/completions", "my-gateway", -0.5, end + 30, _root_id(built))
    breakdown = Attributor().attribute(built.trace_id, _rows(built, [gateway]))
    check_invariants(breakdown)
    assert breakdown.ttft_reference == "gateway" and breakdown.complete
    assert breakdown.ttft_ns == int((end + 0.5) * MS)
    # the gateway's own routing and HTTP to P, until P's API server had it (2 ms): no span of ours splits it
    assert breakdown.critical_ns[("router", "ingress")] == int(2.5 * MS) and breakdown.parts["unattributed"] == 0
    assert breakdown.root_span_id == _root_id(built)  # the forwarded breakdown span goes under it
    # drawn as the request the gateway saw (a thin bar like pd.request), not as a coordination stage
    assert breakdown.timings[("my-gateway", "gateway_request")][2] == "root"
    assert ("my-gateway", "POST /v1/completions") not in breakdown.timings


def test_vllms_own_spans_sit_beside_ours_and_count_for_nothing():
    built = build("push", drop={"router"})
    root = _root_id(built)
    gateway = _outside_span(built, "POST /v1/completions", "my-gateway", -0.5, 200, root)
    llm_p = _outside_span(built, "llm_request", "vllm", 2, 151, b"\x01" * 8, root)
    llm_d = _outside_span(built, "llm_request", "vllm", 2, 190, b"\x02" * 8, root)
    plain = Attributor().attribute(built.trace_id, _rows(built, [gateway]))
    both = Attributor().attribute(built.trace_id, _rows(built, [gateway, llm_p, llm_d]))
    assert both.parts == plain.parts and both.ttft_ns == plain.ttft_ns
    assert both.ttft_reference == "gateway" and both.complete
    assert ("vllm", "llm_request") in both.timings and ("vllm", "llm_request") not in both.critical_ns


def test_vllms_time_to_first_token_on_d_ends_the_ttft_where_d_sent_the_token():
    """With vLLM's own tracing, TTFT ends where D's API server had the first token (arrival + vLLM's
    time to first token on D's llm_request), as kvtrace's router's decode leg would; the way there
    from the sampled token is coordination (``decode:output``). P's llm_request (its one token at the
    prefill's end) is the earlier: D's counts."""
    built = build("push", drop={"router"})
    root = _root_id(built)
    gateway = _outside_span(built, "POST /v1/completions", "my-gateway", -0.5, 200, root)
    llm_p = _outside_span(built, "llm_request", "vllm", 2, 151, b"\x01" * 8, root, ttft_s=0.1485)
    llm_d = _outside_span(built, "llm_request", "vllm", 2, 190, b"\x02" * 8, root, ttft_s=0.1675)  # out at 169.5 ms
    plain = Attributor().attribute(built.trace_id, _rows(built, [gateway]))
    breakdown = Attributor().attribute(built.trace_id, _rows(built, [gateway, llm_p, llm_d]))
    check_invariants(breakdown)
    assert breakdown.ttft_ns == plain.ttft_ns + int(1.5 * MS)  # the first token was sampled at 168 ms
    assert breakdown.critical_ns[("decode", "output")] == int(1.5 * MS)
    assert breakdown.parts["coordination"] == plain.parts["coordination"] + int(1.5 * MS)
    assert breakdown.complete and ("decode", "output") not in breakdown.missing


def test_without_any_gateway_span_vllms_own_spans_are_not_the_reference():
    built = build("push", drop={"router"})
    llm_d = _outside_span(built, "llm_request", "vllm", 2, 190, b"\x02" * 8)  # its parent was never exported
    breakdown = Attributor().attribute(built.trace_id, _rows(built, [llm_d]))
    assert breakdown.ttft_reference == "engine"


def test_a_trace_of_vllms_spans_alone_is_no_request():
    built = build("push", drop={"router", "prefill", "decode"})
    llm = _outside_span(built, "llm_request", "vllm", 2, 190, b"\x02" * 8)
    assert Attributor().attribute(built.trace_id, SpanBatch.of(llm).rows) is None


@pytest.mark.parametrize("drop", ["router:prefill_leg", "router:registration", "router:pd_route",
                                  "router:decode_leg", "prefill:p_input", "decode:d_input", "decode:read_wait"])
def test_the_walk_bridges_a_missing_stage_and_keeps_the_prefill_on_the_path(drop):
    full = attribute(build("pull"))
    breakdown = attribute(build("pull", drop={drop}))
    check_invariants(breakdown)
    assert not breakdown.complete and breakdown.missing == [drop]
    assert breakdown.critical_ns[("prefill", "prefill")] == 144 * MS
    # only the missing stage's own critical time (at most) becomes unattributed
    side, stage = drop.split(":")
    assert breakdown.parts["unattributed"] - full.parts["unattributed"] <= full.critical_ns.get((side, stage), 0)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_wire_ends_when_the_last_tp_rank_is_done(mode):
    built = build(mode, late_rank_ms=6)
    breakdown = attribute(built)
    check_invariants(breakdown)
    assert breakdown.complete and breakdown.parts == built.expected  # exact, through the late rank
    stage = ("prefill", "write") if mode == "push" else ("decode", "read")
    start, end, _ = breakdown.timings[stage]
    first_rank = attribute(build(mode)).timings[stage]
    assert start == first_rank[0] and end == first_rank[1] + 6 * MS  # the first rank's start, the last one's end
    assert breakdown.transfer_bytes == 2 * 2_097_152  # both ranks' bytes


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_an_older_contract_is_complete_for_what_it_carries(mode):
    breakdown = attribute(build(mode, contract=1))
    check_invariants(breakdown)
    assert breakdown.complete and breakdown.ttft_reference == "router"
    # what the first contract's walk left unattributed: HTTP to P (1 -> 5 ms, no P input span), and
    # the first token's way back to the router (no decode leg); pull also P's answer back (150 -> 152 ms,
    # no prefill leg) and D's input (152.5 -> 160 ms)
    expected = (4 + 1) if mode == "push" else (4 + 2 + 7.5 + 1)
    assert breakdown.parts["unattributed"] == int(expected * MS)


def test_a_current_sender_that_lost_its_input_span_is_incomplete():
    breakdown = attribute(build("push", drop={"prefill:p_input"}))
    assert not breakdown.complete and breakdown.missing == ["prefill:p_input"]


def test_ps_notification_may_beat_ds_own_view_of_the_read_without_moving_ds_clock():
    """NIXL hands P the READ's notification as the transfer completes, before D's worker polls it done:
    behind another router (P the clock reference) that order must not be read as D's clock running ahead."""
    built = build("pull", drop={"router"})
    rows = _rows(built)
    released = next(r for r in rows if r.side == "prefill" and r.stage == "completion")
    notified_early = released._replace(start=released.start - int(3 * MS), end=released.end - int(3 * MS))
    rows = [notified_early if r is released else r for r in rows]  # P saw it 0.5 ms before D's read ended
    attributor = Attributor()
    for _ in range(20):  # as many traces as the estimator would see
        breakdown = attributor.attribute(built.trace_id, rows)
    assert breakdown.offsets_ns == {"prefill-0": 0, "decode-0": 0}
    check_invariants(breakdown)
