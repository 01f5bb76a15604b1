"""A traced real pair as production runs it (one API server per engine).

- With request-id hashing on, it exports no raw request id: not in any span, resource, event or
  kvtrace log line of the router, P or D — and one request's spans still join on the hash.
- kvtrace's metrics appear on each engine's own vLLM ``/metrics``, next to ``vllm:*``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtrace.testbed.launch import LocalPair, PairConfig
from tests.e2e.pair import Call, SpanSink, prompt, send

KEY = "test-only-key-7f3a"
METRICS_WAIT_S = 6.0


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    """One engine's /metrics as {(sample name, labels): value}."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def series(metrics: dict, name: str, **labels: str) -> float:
    """The sum of a sample over every series with these labels."""
    return sum(value for (sample, sample_labels), value in metrics.items()
               if sample == name and set(labels.items()) <= sample_labels)


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
            # kvtrace's observations ride on the next engine step's stats (an idle engine steps
            # no more): one more request carries the workload's to the API servers
            send(pair.router_url, Call("privq7-carrier", False, False, prompt(9, 20)))
            time.sleep(METRICS_WAIT_S)  # vLLM's API server takes engine stats at its logging interval
            metrics = {role: scrape(url) for role, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url))}
        logs = "\n".join(p.read_text(errors="replace") for p in log_dir.rglob("*.log"))
        yield calls, expected, sink.traces(), logs, metrics
    finally:
        sink.receiver.shutdown()


def test_every_request_succeeds(hashed_run):
    calls, *_ = hashed_run
    assert [c.status for c in calls] == [200] * len(calls)


def test_no_raw_request_id_in_any_span_resource_or_event(hashed_run):
    calls, _, traces, *_ = hashed_run
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
    calls, expected, traces, *_ = hashed_run
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
    calls, _, _, logs, _ = hashed_run
    kvtrace_lines = [line for line in logs.splitlines() if "kvtrace" in line]
    assert kvtrace_lines  # the processes did log (start-up lines), so the check reads something
    for call in calls:
        assert not [line for line in kvtrace_lines if call.request_id in line]


def test_kvtrace_metrics_on_each_engines_own_metrics_endpoint(hashed_run):
    calls, _, _, _, metrics = hashed_run
    p, d = metrics["prefill"], metrics["decode"]
    assert series(p, "vllm:num_requests_running") is not None  # vLLM's own, on the same endpoint
    # per-stage histograms, labelled by stage, mode and role, with vLLM's model/engine labels
    for stage in ("prefill", "rendezvous", "write", "completion"):
        assert series(p, "kvtrace_stage_duration_seconds_count", stage=stage, mode="push", role="producer") >= 1, stage
    for stage in ("allocation", "registration", "first_token"):
        assert series(d, "kvtrace_stage_duration_seconds_count", stage=stage, mode="push", role="consumer") >= 1, stage
    assert {labels for (name, labels) in p if name == "kvtrace_stage_duration_seconds_count"} and all(
        dict(labels).get("model_name") for (name, labels) in p if name == "kvtrace_stage_duration_seconds_count")
    # every workload request's prefill observed (the carrier's own may not have arrived yet)
    assert len(calls) <= series(p, "kvtrace_stage_duration_seconds_count", stage="prefill") <= len(calls) + 1
    assert series(p, "kvtrace_transfer_bytes_total", op="write") > 0
    # engine-loop time per step, from the scheduler and the worker
    assert series(p, "kvtrace_engine_loop_seconds_count", part="scheduler") > 0
    assert series(d, "kvtrace_engine_loop_seconds_count", part="worker") > 0
    # NIXL's own metrics still arrive through the same seam
    assert series(p, "vllm:nixl_xfer_time_seconds_count") >= 1


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_stopping_the_pair_right_after_a_request_loses_no_spans(tmp_path, mode):
    """The engines run in multiprocessing children, which exit without atexit handlers: the
    recorder flushes in multiprocessing's exit finalizers (given vLLM's grace period to run them),
    so a request answered just before the pair stops still has every span of its trace."""
    sink = SpanSink()
    sink.receiver.start()
    try:
        config = PairConfig(mode=mode, otlp_endpoint=f"http://127.0.0.1:{sink.receiver.port}/v1/traces",
                            log_dir=tmp_path)
        with LocalPair(config) as pair:
            call = send(pair.router_url, Call("stopped-at-once", chat=False, stream=False, text=prompt(7, 30)))
            assert call.status == 200, call.output
        # the pair is stopped within the exporters' 0.5 s delay of the answer
        # every process's spans: P's and D's engine cores, API servers and workers, and the router's
        wanted = {"engine.first_token", "kv.allocation", "kv.completion", "engine.prefill", "engine.input",
                  "pd.request", "pd.decode_leg", "kv.write" if mode == "push" else "kv.read"}

        def complete(s: SpanSink) -> bool:
            spans = [x for spans in s.traces().values() for x in spans
                     if any(y["name"] == "pd.request" and y["attrs"].get("kvtrace.request_id") ==
                            "cmpl-stopped-at-once-0" for y in spans)]
            return wanted <= {x["name"] for x in spans}

        assert sink.wait_for(complete, timeout=10), (
            f"missing {sorted(wanted - {x['name'] for x in sink.spans})}; from "
            f"{sorted({(x['resource'].get('kvtrace.role'), x['name']) for x in sink.spans})}")
    finally:
        sink.receiver.shutdown()
