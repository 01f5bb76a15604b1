"""The decode side: pull's READ on D's engine loop, push's registration sent from D, the scheduler's
kv.read_wait, and the two engine settings of tuning.py — vLLM's real classes, a fake NIXL agent."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import msgspec
import pytest
from opentelemetry.trace import StatusCode
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    PUSH_REG_NOTIF_PREFIX, NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.v1.outputs import KVConnectorOutput

from kvtrace.connector import tuning
from kvtrace.connector.options import ConnectorOptions
from kvtrace.connector.protocol import WorkerReport
from kvtrace.telemetry.context import TraceRef
from kvtrace.telemetry.semconv import PARAM_TRACEPARENT
from kvtrace.testbed.inproc import stand_in_transfer_topology
from tests.connector.test_scheduler_side import _request, blocks, by_stage, schedule
from tests.connector.test_push_producer import until

TRACE = TraceRef(0x3E1C6B8F2A4D4B5C9E0F1A2B3C4D5E6F, 0x1122334455667788, True)
D_ID = "cmpl-pull1-0-dddddddd"


def fake_read_blocks_for_req(self, req_id, meta):
    """Stands in for vLLM's READ planning (it needs a live remote agent): prepares and posts one
    READ through the agent and keeps the handle as vLLM does."""
    handle = self.nixl_wrapper.make_prepped_xfer("READ", 0, [0, 1], 0, [0, 1],
                                                 notif_msg=f"{meta.remote.request_id}:1".encode())
    self.nixl_wrapper.transfer(handle)
    self._recving_transfers[req_id].append(handle)


def pull_metadata() -> NixlConnectorMetadata:
    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(D_ID, ([3, 4],), {
        "remote_block_ids": [[1, 2]], "remote_engine_id": "p-engine", "remote_request_id": "cmpl-pull1-0-pppppppp",
        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}, awaiting_kvs=True)
    meta.kvtrace_traces = {D_ID: TRACE.traceparent}
    return meta


@pytest.fixture
def pull_consumer(build_connector, monkeypatch):
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", fake_read_blocks_for_req)
    connector = build_connector("NixlPullConnector", "kv_consumer", "worker", "d-engine")
    connector.connector_worker._remote_agents["p-engine"] = {0: "p-agent"}
    stand_in_transfer_topology(connector.connector_worker)
    return connector


def _step(connector, metadata: NixlConnectorMetadata | None = None) -> WorkerReport | None:
    """One engine step on the worker, in the model runner's order."""
    connector.bind_connector_metadata(metadata or NixlConnectorMetadata())
    connector.start_load_kv(SimpleNamespace())
    connector.get_transfer_results(set())
    report = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return report


def test_pull_read_on_the_engine_loop(pull_consumer, spans):
    agent = pull_consumer.connector_worker.nixl_wrapper._agent  # behind kvtrace's proxy
    report = _step(pull_consumer, pull_metadata())  # plans and posts the READ; DONE at the poll
    assert [h.operation for h in agent.posted] == ["READ"]
    stages = by_stage(spans())
    (prep,) = stages["descriptor_prep"]
    assert prep.attributes["kvtrace.on_engine_loop"] is True  # pull prepares on D's engine loop
    (read,) = stages["read"]
    assert read.name == "kv.read" and read.attributes["kvtrace.transfer.bytes"] == 65536
    assert read.attributes["kvtrace.transfer.descriptors"] == 4 and read.status.status_code is StatusCode.UNSET
    assert prep.end_time <= read.start_time <= read.end_time
    for span in (prep, read):
        assert span.context.trace_id == TRACE.trace_id and span.attributes["kvtrace.request_id"] == "cmpl-pull1-0"
        assert span.resource.attributes["kvtrace.tp_rank"] == 0  # each rank's transfer says whose it is
    # the scheduler learns when the READ landed, when the worker began preparing it, and the loop time
    assert report is not None and D_ID in report.ready_ns and D_ID in report.prepped_ns and report.loop_ns[D_ID] > 0
    assert report.prepped_ns[D_ID] <= report.ready_ns[D_ID]


def test_a_failed_read_ends_in_error(pull_consumer, spans):
    pull_consumer.connector_worker.nixl_wrapper._agent.state = "ERR"
    _step(pull_consumer, pull_metadata())
    (read,) = by_stage(spans())["read"]
    assert read.status.status_code is StatusCode.ERROR and read.attributes["error.type"] == "transfer_failed"


def test_the_scheduler_records_how_long_the_read_waited_for_ds_step(build_connector, spans):
    connector = build_connector("NixlPullConnector", "kv_consumer", "scheduler", "d-engine")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "remote_request_id": "cmpl-w1-0",
              "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 69, PARAM_TRACEPARENT: TRACE.traceparent}
    req = _request("cmpl-w1-0-eeeeeeee", params)
    connector.on_new_request(req)
    matched, _ = connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, blocks(9, 10, 11), matched)
    schedule(connector)
    time.sleep(0.01)  # the step runs its forward before the worker reaches the READ
    prepped = connector._kvtrace_recorder.now()
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=WorkerReport(
        prepped_ns={req.request_id: prepped})))
    stages = by_stage(spans())
    (wait,) = stages["read_wait"]
    (allocation,) = stages["allocation"]
    assert wait.name == "kv.read_wait" and wait.start_time == allocation.end_time
    assert wait.end_time - wait.start_time >= 10_000_000
    assert allocation.attributes["kvtrace.block_count"] == 3


def test_push_decode_registration_is_timed_from_allocation_to_sent(build_connector, spans):
    connector = build_connector("NixlPushConnector", "kv_consumer", "worker", "d-engine")
    worker = connector.connector_worker
    worker._remote_agents["p-engine"] = {0: "p-agent"}
    allocated = connector._kvtrace_recorder.now()
    reg = {"request_id": "cmpl-r9-0-dddddddd", "remote_engine_id": "p-engine", "local_block_ids": [[1]],
           "kvtrace": {"traceparent": TRACE.traceparent, "allocated_ns": allocated}}
    worker._do_send_reg_notif("cmpl-r9-0-dddddddd", reg)
    ((agent_name, notif),) = worker.nixl_wrapper._agent.sent
    assert agent_name == "p-agent" and notif.startswith(PUSH_REG_NOTIF_PREFIX)
    assert msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])["kvtrace"]["traceparent"] == TRACE.traceparent
    (registration,) = by_stage(spans())["registration"]
    assert registration.context.trace_id == TRACE.trace_id
    assert registration.start_time == connector._kvtrace_recorder.to_wall_ns(allocated) <= registration.end_time


# --------------------------------------------------------------------------------------
# tuning.py: the two settings vLLM cannot reach
# --------------------------------------------------------------------------------------


class _Bindings:
    """A stand-in for NIXL's pybind module: records the config each agent is built with."""

    def __init__(self) -> None:
        self.built: list[tuple[str, object]] = []

    def nixlAgent(self, name, config):  # noqa: N802 (NIXL's name)
        self.built.append((name, config))
        return SimpleNamespace(name=name)


def test_the_progress_delay_applies_only_while_the_worker_is_built(monkeypatch):
    bindings = _Bindings()
    monkeypatch.setattr(tuning, "_nixl_bindings", lambda: bindings)
    with tuning.nixl_progress_delay(1000):
        bindings.nixlAgent("inside", SimpleNamespace(pthrDelay=0))
    bindings.nixlAgent("after", SimpleNamespace(pthrDelay=0))
    assert [(name, config.pthrDelay) for name, config in bindings.built] == [("inside", 1000), ("after", 0)]
    assert bindings.nixlAgent.__func__ is _Bindings.nixlAgent  # NIXL's own constructor is back


def test_without_nixl_bindings_the_delay_is_named_and_skipped(monkeypatch, caplog):
    monkeypatch.setattr(tuning, "_nixl_bindings", lambda: None)
    with caplog.at_level("ERROR"), tuning.nixl_progress_delay(500):
        pass
    assert "nixl_progress_delay_us ignored" in caplog.text
    with tuning.nixl_progress_delay(None):  # unset: nothing looked up
        pass


def test_keep_affinity_restores_what_the_worker_changed():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.fail("this test needs two cores to re-pin between (the CI machine has two)")
    with tuning.worker_construction(ConnectorOptions(keep_cpu_affinity=True)):
        os.sched_setaffinity(0, {max(before)})  # what vLLM's CPU NIXL worker does
    assert os.sched_getaffinity(0) == before
    try:
        with tuning.worker_construction(ConnectorOptions()):
            os.sched_setaffinity(0, {max(before)})
        assert os.sched_getaffinity(0) == {max(before)}  # off: the change stays, as vLLM made it
    finally:
        os.sched_setaffinity(0, before)


# --------------------------------------------------------------------------------------
# A prefill engine that slept and woke registers its KV cache again (vLLM 0.33: the
# `remote_registration_generation` it sends grows, and D's `_read_blocks_for_req` drops the old
# connection with `_cleanup_remote_engine`, then handshakes again). That second handshake is one
# more `kv.handshake` span, on the request that caused it.
# --------------------------------------------------------------------------------------


def test_pull_handshakes_again_after_the_prefill_engine_re_registers(build_connector, spans, monkeypatch):
    handshakes = []

    def fake_nixl_handshake(host, port, tp_size, engine_id, *args):
        handshakes.append(engine_id)
        return {(0, 0): "p-agent"}, 0.0

    def read_or_connect(self, req_id, meta):
        # vLLM's own first check (the READ planning after it needs a live peer)
        if meta.remote.engine_id not in self._remote_agents:
            return self._background_nixl_handshake(req_id, meta.remote.engine_id, meta)
        return fake_read_blocks_for_req(self, req_id, meta)

    # kvtrace wraps the worker's methods when it is built: patch vLLM's class first
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", read_or_connect)
    pull_consumer = build_connector("NixlPullConnector", "kv_consumer", "worker", "d-engine")
    worker = pull_consumer.connector_worker
    stand_in_transfer_topology(worker)
    monkeypatch.setattr(worker, "_nixl_handshake", fake_nixl_handshake)

    def serve() -> None:
        _step(pull_consumer, pull_metadata())
        assert until(lambda: "p-engine" in worker._remote_agents)
        _step(pull_consumer)  # the handshake's callback queued the request: READ it now

    serve()
    worker._cleanup_remote_engine("p-engine", log_eviction=False)  # P re-registered (slept, woke)
    serve()
    assert handshakes == ["p-engine", "p-engine"]
    stages = by_stage(spans())
    assert len(stages["handshake"]) == 2 and len(stages["read"]) == 2
    assert all(h.attributes["kvtrace.handshake.kind"] == "full" for h in stages["handshake"])
    assert all(h.context.trace_id == TRACE.trace_id for h in stages["handshake"])
