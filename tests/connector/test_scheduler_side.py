"""Scheduler side: vLLM's real push/pull scheduler connectors, driven as vLLM's scheduler would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.trace import StatusCode
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvtrace.connector.protocol import WorkerReport
from kvtrace.telemetry.semconv import PARAM_TRACEPARENT
from kvtrace.telemetry.context import TraceRef

TRACE = TraceRef(0x5B8EFFF798038103D269B633813FC60C, 0xEEE19B7EC3C1B174, True)
PROMPT = list(range(1, 70))  # 69 tokens: 3 blocks of 32


def _request(request_id: str, params: dict) -> Request:
    req = Request(request_id, PROMPT, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}), None)
    assert req.kv_transfer_params == params
    return req


def blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def schedule(connector, *scheduled: str, preempted: tuple = ()):
    return connector.build_connector_meta(SimpleNamespace(num_scheduled_tokens={r: 1 for r in scheduled},
                                                          preempted_req_ids=set(preempted)))


def by_stage(spans):
    out = {}
    for span in spans:
        out.setdefault(span.attributes["kvtrace.stage"], []).append(span)
    return out


@pytest.mark.parametrize("connector_name", ["NixlPushConnector", "NixlPullConnector"])
def test_producer_queue_prefill_and_release(build_connector, spans, connector_name):
    connector = build_connector(connector_name, "kv_producer", "scheduler", "p-engine")
    req = _request("cmpl-r1-0-aaaaaaaa", {"do_remote_decode": True, PARAM_TRACEPARENT: TRACE.traceparent})
    connector.on_new_request(req)
    connector.update_state_after_alloc(req, blocks(1, 2, 3), 0)  # scheduled for prefill
    meta = schedule(connector, req.request_id)
    assert meta.kvtrace_traces == {req.request_id: TRACE.traceparent}  # the workers learn the trace
    req.num_computed_tokens = len(PROMPT)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = connector.request_finished_all_groups(req, ([1, 2, 3],))
    assert delay is True
    assert params[PARAM_TRACEPARENT] == TRACE.traceparent  # carried on to D (pull) via the router
    assert params["remote_request_id"] == req.request_id  # vLLM's own fields are untouched
    report = WorkerReport(ready_ns={req.request_id: connector._kvtrace_recorder.now()})
    connector.update_connector_output(KVConnectorOutput(finished_sending={req.request_id},
                                                        kv_connector_worker_meta=report))
    stages = by_stage(spans())
    assert set(stages) == {"p_input", "p_queue", "prefill", "completion"}
    # P's input: from vLLM's arrival time (the API server, before tokenising) to admission
    (p_input,) = stages["p_input"]
    assert p_input.name == "engine.input" and p_input.end_time == stages["p_queue"][0].start_time
    # exactly the arrival on the wall clock: read back through the recorder's offset, not as an age measured
    # later, which a wait between two clock reads (another thread holding the GIL) would move earlier
    assert p_input.start_time == int(req.arrival_time * 1e9)
    prefill = stages["prefill"][0]
    assert prefill.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert stages["p_queue"][0].end_time <= prefill.start_time
    assert prefill.end_time <= stages["completion"][0].end_time
    for (span,) in stages.values():
        assert span.context.trace_id == TRACE.trace_id and span.parent.span_id == TRACE.span_id
        assert span.resource.attributes["kvtrace.role"] == "producer"


def test_expired_lease_marks_the_release_as_error(build_connector, spans):
    connector = build_connector("NixlPushConnector", "kv_producer", "scheduler", "p-engine")
    req = _request("cmpl-r2-0-aaaaaaaa", {"do_remote_decode": True, PARAM_TRACEPARENT: TRACE.traceparent})
    connector.on_new_request(req)
    connector.update_state_after_alloc(req, blocks(4, 5, 6), 0)
    req.num_computed_tokens = len(PROMPT)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    connector.request_finished_all_groups(req, ([4, 5, 6],))
    connector.update_connector_output(KVConnectorOutput(
        finished_sending={req.request_id}, kv_connector_worker_meta=WorkerReport(expired={req.request_id})))
    (completion,) = by_stage(spans())["completion"]
    assert completion.status.status_code is StatusCode.ERROR
    assert completion.attributes["error.type"] == "lease_expired"


def test_push_consumer_allocation_registration_completion_queue_first_token(build_connector, spans):
    connector = build_connector("NixlPushConnector", "kv_consumer", "scheduler", "d-engine")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "pp_size": 1,
              "remote_request_id": "cmpl-r3-0", "remote_block_ids": [], PARAM_TRACEPARENT: TRACE.traceparent}
    req = _request("cmpl-r3-0-bbbbbbbb", params)
    connector.on_new_request(req)
    matched, load_async = connector.get_num_new_matched_tokens(req, 0)
    assert matched > 0 and load_async
    connector.update_state_after_alloc(req, blocks(9, 10, 11), matched)
    meta = schedule(connector)
    registration = meta.push_registrations[req.request_id]
    assert registration["kvtrace"]["traceparent"] == TRACE.traceparent  # rides PUSH_REG to P
    assert registration["remote_engine_id"] == "p-engine"  # vLLM's fields are unchanged

    recorder = connector._kvtrace_recorder
    report = WorkerReport(ready_ns={req.request_id: recorder.now()})
    connector.update_connector_output(KVConnectorOutput(finished_recving={req.request_id},
                                                        kv_connector_worker_meta=report))
    schedule(connector, req.request_id)  # scheduled for decode
    req.append_output_token_ids(42)  # the first token was sampled
    connector.update_connector_output(KVConnectorOutput())

    stages = by_stage(spans())
    assert set(stages) == {"d_input", "allocation", "completion", "d_queue", "first_token"}
    order = [stages[s][0] for s in ("allocation", "completion", "d_queue", "first_token")]
    for earlier, later in zip(order, order[1:]):
        assert earlier.end_time <= later.start_time
    assert all(s.resource.attributes["kvtrace.role"] == "consumer" for s in order)


def test_registration_watchdog_timeout_is_an_error(build_connector, spans):
    connector = build_connector("NixlPushConnector", "kv_consumer", "scheduler", "d-engine",
                                {"sampler": "always_on"})
    connector.connector_scheduler._push_registration_timeout = -1.0  # already overdue
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
              "remote_request_id": "cmpl-r4-0", PARAM_TRACEPARENT: TRACE.traceparent}
    req = _request("cmpl-r4-0-bbbbbbbb", params)
    connector.on_new_request(req)
    matched, _ = connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, blocks(12, 13, 14), matched)
    meta = schedule(connector)
    assert req.request_id not in meta.push_registrations  # vLLM's watchdog dropped it
    (registration,) = by_stage(spans())["registration"]
    assert registration.attributes["error.type"] == "registration_timeout"


def test_disabled_telemetry_leaves_vllm_untouched(build_connector, spans):
    connector = build_connector("NixlPushConnector", "kv_producer", "worker", "p-engine", {"enabled": False})
    assert connector._kvtrace_worker is None
    assert type(connector.connector_worker.nixl_wrapper).__name__ == "FakeNixlWrapper"  # no proxy
    scheduler = build_connector("NixlPullConnector", "kv_producer", "scheduler", "p-engine", {"enabled": False})
    req = _request("cmpl-r5-0-aaaaaaaa", {"do_remote_decode": True, PARAM_TRACEPARENT: TRACE.traceparent})
    scheduler.on_new_request(req)
    meta = schedule(scheduler)
    assert not hasattr(meta, "kvtrace_traces")
    assert spans() == ()


def test_bad_kvtrace_option_fails_start_up_naming_the_key(build_connector):
    from kvtrace.telemetry import ConfigError

    with pytest.raises(ConfigError, match="kvtrace.nixl_progress_delay_us"):
        build_connector("NixlPushConnector", "kv_producer", "worker", "p-engine",
                        {"nixl_progress_delay_us": -5})
    with pytest.raises(ConfigError, match="kvtrace.sampler_arg"):
        build_connector("NixlPullConnector", "kv_consumer", "scheduler", "d-engine", {"sampler_arg": 2})


def test_preempted_prefill_is_an_error_and_queues_again(build_connector, spans):
    connector = build_connector("NixlPushConnector", "kv_producer", "scheduler", "p-engine")
    req = _request("cmpl-r6-0-aaaaaaaa", {"do_remote_decode": True, PARAM_TRACEPARENT: TRACE.traceparent})
    connector.on_new_request(req)
    connector.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    schedule(connector, preempted=(req.request_id,))  # vLLM preempted it mid-prefill
    connector.update_state_after_alloc(req, blocks(4, 5, 6), 0)  # rescheduled
    req.num_computed_tokens = len(PROMPT)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    connector.request_finished_all_groups(req, ([4, 5, 6],))
    stages = by_stage(spans())
    preempted, finished = sorted(stages["prefill"], key=lambda s: s.start_time)
    assert preempted.status.status_code is StatusCode.ERROR
    assert preempted.attributes["error.type"] == "preempted"
    assert finished.status.status_code is StatusCode.UNSET
    assert len(stages["p_queue"]) == 2  # queued, then queued again after the preemption
    assert preempted.end_time <= stages["p_queue"][1].start_time
