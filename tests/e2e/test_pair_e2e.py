"""A real 1P1D pair in push and in pull: one complete, well-ordered trace per request."""

from __future__ import annotations

import statistics

import pytest

from tests.e2e.pair import (
    TOLERANCE_NS, Call, concurrent_sends, expected_kv_bytes, prompt, run_mode, send, trace_of,
)

ROUTER = {"pd.request", "pd.route", "pd.prefill_leg", "pd.decode_leg"}
EXPECTED = {
    "push": {
        "kvtrace-router": ROUTER,
        "vllm-prefill": {"p_input", "p_queue", "prefill", "registration", "rendezvous", "descriptor_prep",
                         "write", "completion"},
        "vllm-decode": {"d_input", "allocation", "registration", "completion", "d_queue", "first_token"},
    },
    "pull": {
        "kvtrace-router": ROUTER | {"registration"},
        "vllm-prefill": {"p_input", "p_queue", "prefill", "completion"},
        "vllm-decode": {"d_input", "allocation", "read_wait", "descriptor_prep", "read", "completion", "d_queue",
                        "first_token"},
    },
}
LEASE_S = 30  # vLLM's default kv_lease_duration


def _reliability(pair) -> dict:
    """30 push requests of mixed lengths: 20 one at a time, then 10 two at a time."""
    sequential = [Call(f"rel-{i}", False, i % 2 == 0, prompt(100 + i, (40, 500, 900)[i % 3]))
                  for i in range(20)]
    for call in sequential:
        send(pair.router_url, call)
    concurrent = [Call(f"rel-{20 + i}", i % 2 == 1, True, prompt(200 + i, (150, 800)[i % 2]))
                  for i in range(10)]
    concurrent_sends(pair.router_url, concurrent, 2)
    return {"reliability": sequential + concurrent}


_RUNS: dict = {}


def _run(mode: str, tmp_path_factory):
    """One traced run per mode for the whole module (push's with its reliability load)."""
    if mode not in _RUNS:
        result = run_mode(mode, tmp_path_factory.mktemp(mode), _reliability if mode == "push" else None)
        result.extra["mode"] = mode
        _RUNS[mode] = result
    return _RUNS[mode]


@pytest.fixture(scope="module", params=["push", "pull"])
def run(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def push_run(tmp_path_factory):
    """The push run alone, for what exists in push only (no test is skipped in pull)."""
    return _run("push", tmp_path_factory)


def _by_stage(spans):
    out = {}
    for span in spans:
        key = (span["resource"]["service.name"], span["attrs"].get("kvtrace.stage") or span["name"])
        out.setdefault(key, []).append(span)
    return out


def test_every_request_succeeds(run):
    assert [c.status for c in run.calls] == [200] * len(run.calls)
    assert all(c.prompt_tokens > 0 and c.output for c in run.calls)


def test_one_trace_per_request_with_every_stage_on_both_sides(run):
    mode = run.extra["mode"]
    for call in run.calls:
        spans = trace_of(run.traces, call.request_id)
        seen: dict[str, set] = {}
        for span in spans:
            stage = span["attrs"]["kvtrace.stage"]
            seen.setdefault(span["resource"]["service.name"], set()).add(
                span["name"] if span["name"].startswith("pd.") else stage)
        for service, stages in EXPECTED[mode].items():
            missing = stages - seen.get(service, set())
            assert not missing, f"{call.request_id}: {service} lacks {missing}"
        assert {s["resource"]["kvtrace.mode"] for s in spans} == {mode}


def test_parentage_and_time_order(run):
    mode = run.extra["mode"]
    for call in run.calls:
        spans = trace_of(run.traces, call.request_id)
        (root,) = [s for s in spans if s["name"] == "pd.request"]
        assert root["parent"] == ""  # the client sent no traceparent: pd.request is the root
        for span in spans:
            assert span["end"] >= span["start"], span["name"]
            if span is not root:
                assert span["parent"] == root["span_id"], (call.request_id, span["name"])
                assert span["start"] >= root["start"] - TOLERANCE_NS, span["name"]
                assert span["end"] <= root["end"] + TOLERANCE_NS, span["name"]
        stage = {k: v[0] for k, v in _by_stage(spans).items()}
        def before(a, b):  # span a ends before span b starts
            assert stage[a]["end"] <= stage[b]["start"] + TOLERANCE_NS, (call.request_id, a, b)

        before(("vllm-prefill", "p_input"), ("vllm-prefill", "p_queue"))
        before(("vllm-prefill", "p_queue"), ("vllm-prefill", "prefill"))
        before(("vllm-decode", "d_input"), ("vllm-decode", "allocation"))
        if mode == "push":
            # The rendezvous completes only once P's KV is ready, whoever came first.
            assert stage[("vllm-prefill", "prefill")]["end"] <= \
                stage[("vllm-prefill", "rendezvous")]["end"] + TOLERANCE_NS
            before(("vllm-decode", "allocation"), ("vllm-decode", "registration"))
            chain = [("vllm-prefill", "rendezvous"), ("vllm-prefill", "descriptor_prep"),
                     ("vllm-prefill", "write")]
        else:
            chain = [("vllm-prefill", "prefill"), ("kvtrace-router", "registration"), ("vllm-decode", "d_input"),
                     ("vllm-decode", "allocation"), ("vllm-decode", "read_wait"), ("vllm-decode", "descriptor_prep"),
                     ("vllm-decode", "read")]
        for earlier, later in zip(chain, chain[1:]):
            before(earlier, later)
        transfer = stage[chain[-1]]
        assert transfer["start"] <= stage[("vllm-decode", "completion")]["end"]
        before(("vllm-decode", "completion"), ("vllm-decode", "d_queue"))
        before(("vllm-decode", "d_queue"), ("vllm-decode", "first_token"))
        # the router's legs: D's first token (and, in pull, P's prefill) end inside them
        assert stage[("vllm-decode", "first_token")]["end"] <= stage[("kvtrace-router", "decode_leg")]["end"] + TOLERANCE_NS
        assert stage[("vllm-prefill", "prefill")]["end"] <= stage[("kvtrace-router", "prefill_leg")]["end"] + TOLERANCE_NS


def test_transfer_bytes_equal_the_prompts_kv_blocks(run):
    op = "write" if run.extra["mode"] == "push" else "read"
    for call in run.calls:
        (transfer,) = [s for s in trace_of(run.traces, call.request_id) if s["attrs"]["kvtrace.stage"] == op]
        assert transfer["attrs"]["kvtrace.transfer.bytes"] == expected_kv_bytes(call.prompt_tokens), call.request_id
        assert transfer["attrs"]["kvtrace.transfer.descriptors"] > 0
        assert transfer["status"] == 0


def test_greedy_output_is_identical_with_tracing_off(run):
    assert [c.output for c in run.calls] == run.untraced_outputs


def test_no_prompt_or_completion_text_in_any_exported_attribute(run):
    values = []
    for spans in run.traces.values():
        for span in spans:
            values += [str(v) for v in span["attrs"].values()] + [str(v) for v in span["resource"].values()]
            values += [str(v) for _, attrs in span["events"] for v in attrs.values()]
    blob = "\n".join(values)
    for call in run.calls:
        assert call.text.split()[0] not in blob  # the prompt's unique marker
        assert call.text[:40] not in blob
        if len(call.output.strip()) >= 6:
            assert call.output.strip() not in blob


def test_push_rendezvous_order_is_what_happened_and_long_prompts_mostly_register_first(push_run):
    """P records the rendezvous from whichever half reached its writer first: D's registration
    (then the rendezvous starts at the registration's arrival) or its own finished blocks (then it
    ends as the registration arrives). A long prompt's prefill usually outlasts D's way to a
    registration; on two busy cores D's tokenising and scheduling can lose that race, so most, not
    all, long prompts rendezvous registration-first."""
    run = push_run
    orders = {}
    for call in run.calls:
        stage = {k: v[0] for k, v in _by_stage(trace_of(run.traces, call.request_id)).items()}
        rendezvous, received = stage[("vllm-prefill", "rendezvous")], stage[("vllm-prefill", "registration")]
        order = orders[call.request_id] = rendezvous["attrs"]["kvtrace.rendezvous.order"]
        if order == "registration_first":
            assert rendezvous["start"] == received["start"], call.request_id
        else:
            assert order == "kv_first", call.request_id
            assert rendezvous["start"] <= received["start"] <= rendezvous["end"], call.request_id
    long_orders = [orders[c.request_id] for c in run.calls if c.prompt_tokens > 1000]
    print(f"\npush rendezvous: long prompts {long_orders}, all {sorted(orders.values())}")
    assert len(long_orders) >= 3
    assert long_orders.count("registration_first") * 2 > len(long_orders), long_orders


def test_push_reliability_thirty_requests(push_run):
    run = push_run
    calls = run.extra["reliability"]
    assert len(calls) == 30
    assert [c.status for c in calls] == [200] * 30, [c.output for c in calls if c.status != 200]
    ttfts = []
    for call in calls:
        spans = trace_of(run.traces, call.request_id)
        stage = {k: v[0] for k, v in _by_stage(spans).items()}
        # P held the blocks from KV ready until its release: far from the 30 s lease.
        held_ns = stage[("vllm-prefill", "completion")]["end"] - stage[("vllm-prefill", "prefill")]["end"]
        assert held_ns < LEASE_S * 1e9 / 10, (call.request_id, held_ns / 1e9)
        assert all(s["status"] == 0 for s in spans), call.request_id
        (root,) = [s for s in spans if s["name"] == "pd.request"]
        ttfts.append(root["attrs"]["kvtrace.router.ttft_ns"] / 1e6)
    ttfts.sort()
    print(f"\npush reliability: 30/30 ok; TTFT ms min {ttfts[0]:.0f} p50 {statistics.median(ttfts):.0f} "
          f"p90 {ttfts[26]:.0f} max {ttfts[-1]:.0f}")


def test_idle_cpu_with_progress_delay_is_low(run):
    # With NIXL's progress thread sleeping 1000 µs between polls, an idle pair costs little.
    assert run.idle_cpu_percent < 50, run.idle_cpu_percent


def test_the_collector_reads_real_spans_as_the_contract_says(run):
    """The collector takes a span's stage from its role and name, and reads each breakdown
    attribute only on the stages the contract lists: real spans must agree."""
    from kvtrace.telemetry import semconv

    for call in run.calls:
        for span in trace_of(run.traces, call.request_id):
            side = semconv.ROLE_SIDES[semconv.Role(span["resource"]["kvtrace.role"])]
            stage = semconv.STAGE_OF_SPAN[(side, span["name"])]
            assert semconv.STAGE_LABELS[stage] == span["attrs"]["kvtrace.stage"], (call.request_id, span["name"])
            for key in span["attrs"].keys() & semconv.DETAIL_ATTRIBUTES.keys():
                assert stage in semconv.DETAIL_ATTRIBUTES[key], (call.request_id, span["name"], key)
