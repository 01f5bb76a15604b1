"""One trace per request behind any router: which context each engine's spans join, in the order the
deployment gives one — the caller's W3C context, kvtrace's field in kv_transfer_params, else the
base request id both legs share. vLLM's real push scheduler connectors, P and D, no propagation."""

from __future__ import annotations

import collections
import uuid

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvtrace.telemetry.context import TraceRef, request_trace
from kvtrace.telemetry.semconv import PARAM_TRACEPARENT
from tests.connector.test_scheduler_side import PROMPT, blocks, schedule

CALLER = TraceRef(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True)
KVTRACE = TraceRef(0x5B8EFFF798038103D269B633813FC60C, 0xEEE19B7EC3C1B174, True)


def _request(request_id: str, params: dict, trace_headers: dict | None = None) -> Request:
    return Request(request_id, PROMPT, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                   None, trace_headers=trace_headers)


def _push_params(x_request_id: str) -> tuple[dict, dict]:
    """What a push proxy of vLLM's toy shape sends: P's params, and D's rebuilt from P's fixed
    coordinates — no traceparent anywhere."""
    p = {"do_remote_decode": True, "do_remote_prefill": False}
    d = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
         "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "pp_size": 1,
         "remote_request_id": f"cmpl-{x_request_id}-0", "remote_block_ids": []}
    return p, d


def _traces_by_request(spans) -> dict[str, set[int]]:
    out: dict[str, set[int]] = collections.defaultdict(set)
    for span in spans:
        out[span.attributes["kvtrace.request_id"]].add(span.context.trace_id)
    return out


def test_a_thousand_requests_without_trace_headers_join_by_request_id(build_connector, spans):
    """Both engines derive each request's trace from the id they share: 0 split, 0 merged."""
    p = build_connector("NixlPushConnector", "kv_producer", "scheduler", "p-engine")
    d = build_connector("NixlPushConnector", "kv_consumer", "scheduler", "d-engine")
    ids = [uuid.uuid4().hex for _ in range(1000)]
    for n, x_request_id in enumerate(ids):
        p_params, d_params = _push_params(x_request_id)
        # vLLM appends its own random suffix to each engine's id, differently on P and D
        p_req = _request(f"cmpl-{x_request_id}-0-{n:08x}", p_params)
        d_req = _request(f"cmpl-{x_request_id}-0-{n + 1:08x}", d_params)
        p.on_new_request(p_req)
        p.update_state_after_alloc(p_req, blocks(1), 0)  # P: engine.queue
        d.on_new_request(d_req)
        matched, _ = d.get_num_new_matched_tokens(d_req, 0)
        d.update_state_after_alloc(d_req, blocks(2, 3, 4), matched)  # D: kv.allocation
    schedule(p)
    schedule(d)
    recorded = spans()
    stages = collections.Counter(span.attributes["kvtrace.stage"] for span in recorded)
    assert stages["p_queue"] == 1000 and stages["allocation"] == 1000
    traces = _traces_by_request(recorded)
    assert len(traces) == 1000
    split = [rid for rid, found in traces.items() if len(found) != 1]
    assert split == []  # every request's P and D spans are one trace
    owners = collections.Counter(next(iter(found)) for found in traces.values())
    assert max(owners.values()) == 1  # no two requests share a trace
    for x_request_id in ids[:5]:  # the trace is the one derived from the base id
        trace_id, parent = request_trace(f"cmpl-{x_request_id}-0")
        assert traces[f"cmpl-{x_request_id}-0"] == {trace_id}
        assert all(s.parent.span_id == parent for s in recorded
                   if s.attributes["kvtrace.request_id"] == f"cmpl-{x_request_id}-0")


def test_the_callers_context_wins_then_kvtraces_field_then_the_request_id(build_connector, spans):
    p = build_connector("NixlPushConnector", "kv_producer", "scheduler", "p-engine")
    both = _request("cmpl-both-0-aaaaaaaa", {"do_remote_decode": True, PARAM_TRACEPARENT: KVTRACE.traceparent},
                    {"traceparent": CALLER.traceparent})
    param_only = _request("cmpl-param-0-aaaaaaaa", {"do_remote_decode": True, PARAM_TRACEPARENT: KVTRACE.traceparent})
    bad_header = _request("cmpl-bad-0-aaaaaaaa", {"do_remote_decode": True}, {"traceparent": "00-zz-yy-01"})
    for req in (both, param_only, bad_header):
        p.on_new_request(req)
        p.update_state_after_alloc(req, blocks(1), 0)
    schedule(p)
    by_request = {s.attributes["kvtrace.request_id"]: s for s in spans()}
    caller = by_request["cmpl-both-0"]
    assert (caller.context.trace_id, caller.parent.span_id) == (CALLER.trace_id, CALLER.span_id)  # under its span
    param = by_request["cmpl-param-0"]
    assert (param.context.trace_id, param.parent.span_id) == (KVTRACE.trace_id, KVTRACE.span_id)
    derived = by_request["cmpl-bad-0"]
    assert (derived.context.trace_id, derived.parent.span_id) == request_trace("cmpl-bad-0")


def test_the_derived_trace_is_keyed_where_request_ids_are_hashed(build_connector, spans, monkeypatch):
    monkeypatch.setenv("KVTRACE_HASH_KEY", "a-shared-secret")
    p = build_connector("NixlPushConnector", "kv_producer", "scheduler", "p-engine", {"hash_request_ids": True})
    req = _request("cmpl-keyed-0-aaaaaaaa", {"do_remote_decode": True})
    p.on_new_request(req)
    p.update_state_after_alloc(req, blocks(1), 0)
    schedule(p)
    (span,) = [s for s in spans() if s.attributes["kvtrace.stage"] == "p_queue"]
    assert span.context.trace_id == request_trace("cmpl-keyed-0", b"a-shared-secret")[0]
    assert span.context.trace_id != request_trace("cmpl-keyed-0")[0]  # unkeyed, anyone could recompute it
