"""With request-id hashing on, the real pair exports no raw request id: not in any span, resource,
event or kvtrace log line of the router, P or D — and one request's spans still join on the hash."""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest

from kvtrace.testbed.launch import LocalPair, PairConfig
from tests.e2e.pair import Call, SpanSink, prompt, send

KEY = "test-only-key-7f3a"


def keyed(engine_request_id: str) -> str:
    return hmac.new(KEY.encode(), engine_request_id.encode(), hashlib.sha256).hexdigest()[:16]


@pytest.fixture(scope="module")
def hashed_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("privacy")
    sink = SpanSink()
    sink.receiver.start()
    calls = [Call("privq7-0", False, False, prompt(0, 20)), Call("privq7-1", True, True, prompt(1, 800)),
             Call("privq7-2", False, True, prompt(2, 300))]
    try:
        with LocalPair(PairConfig(mode="push", otlp_endpoint=sink.receiver.endpoint, log_dir=log_dir,
                                  hash_key=KEY)) as pair:
            for call in calls:
                send(pair.router_url, call)
            expected = {keyed(f"{'chatcmpl' if c.chat else 'cmpl'}-{c.request_id}" + ("" if c.chat else "-0"))
                        for c in calls}
            sink.wait_for(lambda s: expected <= {sp["attrs"].get("kvtrace.request_id")
                                                for spans in s.traces().values() for sp in spans
                                                if sp["name"] == "engine.first_token"})
            time.sleep(1.5)  # P's release spans come last
        logs = "\n".join(p.read_text(errors="replace") for p in log_dir.rglob("*.log"))
        yield calls, expected, sink.traces(), logs
    finally:
        sink.receiver.shutdown()


def test_every_request_succeeds(hashed_run):
    calls, *_ = hashed_run
    assert [c.status for c in calls] == [200] * len(calls)


def test_no_raw_request_id_in_any_span_resource_or_event(hashed_run):
    calls, _, traces, _ = hashed_run
    blob = []
    for spans in traces.values():
        for span in spans:
            blob.append(span["name"])
            blob += [f"{k}={v}" for k, v in {**span["attrs"], **span["resource"]}.items()]
            blob += [f"{name} {attrs}" for name, attrs in span["events"]]
    text = "\n".join(blob)
    assert len(traces) >= len(calls)
    for call in calls:
        assert call.request_id not in text


def test_one_requests_spans_join_on_the_keyed_hash(hashed_run):
    calls, expected, traces, _ = hashed_run
    for hashed in expected:
        (trace,) = [spans for spans in traces.values()
                    if any(s["name"] == "pd.request" and s["attrs"].get("kvtrace.request_id") == hashed
                           for s in spans)]
        ids = {s["attrs"]["kvtrace.request_id"] for s in trace if "kvtrace.request_id" in s["attrs"]}
        services = {s["resource"]["service.name"] for s in trace if "kvtrace.request_id" in s["attrs"]}
        assert ids == {hashed}
        assert services == {"kvtrace-router", "vllm-prefill", "vllm-decode"}
        # the workers' spans (WRITE on P, registration on D) carry it too, not only the schedulers'
        assert {"kv.write", "kv.registration"} <= {s["name"] for s in trace if "kvtrace.request_id" in s["attrs"]}


def test_no_raw_request_id_in_kvtrace_log_lines(hashed_run):
    calls, _, _, logs = hashed_run
    kvtrace_lines = [line for line in logs.splitlines() if "kvtrace" in line]
    assert kvtrace_lines  # the processes did log (start-up lines), so the check reads something
    for call in calls:
        assert not [line for line in kvtrace_lines if call.request_id in line]
