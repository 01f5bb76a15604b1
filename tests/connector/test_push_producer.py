"""Push, prefill side: vLLM's real writer thread and transfer polling, traced, with a fake NIXL."""

from __future__ import annotations

import functools
import threading
import time

import msgspec
import pytest
from opentelemetry.trace import StatusCode
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    PUSH_REG_NOTIF_PREFIX, NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from kvtrace.telemetry.context import TraceRef
from kvtrace.testbed.inproc import FakeNixlWrapper, stand_in_transfer_topology
from tests.helpers import wait_until

until = functools.partial(wait_until, timeout_s=5.0, interval_s=0.005)  # the writer thread is quick

P_ID = "cmpl-req1-0-aaaaaaaa"
D_ID = "cmpl-req1-0-bbbbbbbb"
TRACE = TraceRef(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True)


def fake_xfer_blocks_for_req(self, req_id, meta):
    """Stands in for vLLM's WRITE planning (which needs a live remote agent): it prepares and
    posts one WRITE through the agent and publishes the handle as vLLM does."""
    handle = self.nixl_wrapper.make_prepped_xfer(
        "WRITE", 0, [0, 1], 0, [0, 1], notif_msg=f"{meta.remote.request_id}:1".encode())
    self.nixl_wrapper.transfer(handle)
    with self._sending_transfers_lock:
        self._sending_transfers[req_id].append(handle)


def registration(d_id: str = D_ID, traceparent: str | None = TRACE.traceparent) -> bytes:
    payload = {"request_id": d_id, "decode_engine_id": "d-engine", "decode_host": "127.0.0.1",
               "decode_port": 1, "decode_tp_size": 1, "local_block_ids": [[7, 8]],
               "remote_engine_id": "p-engine", "remote_host": "127.0.0.1", "remote_port": 2,
               "remote_tp_size": 1, "remote_pp_size": 1}
    if traceparent:
        payload["kvtrace"] = {"traceparent": traceparent, "allocated_ns": 0}
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(payload)


def finished_blocks(expires_in: float = 30.0) -> NixlConnectorMetadata:
    meta = NixlConnectorMetadata()
    meta.reqs_in_batch = {P_ID}
    meta.reqs_to_send = {P_ID: time.perf_counter() + expires_in}
    meta.push_finished_blocks = {P_ID: [[1, 2]]}
    meta.kvtrace_traces = {P_ID: TRACE.traceparent}
    return meta


@pytest.fixture
def producer(build_connector, monkeypatch):
    monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks_for_req", fake_xfer_blocks_for_req)
    connector = build_connector("NixlPushConnector", "kv_producer", "worker", "p-engine")
    worker = connector.connector_worker
    worker._remote_agents["d-engine"] = {(0, 0): "agent-d"}  # already handshaken with D
    worker._engine_last_active["d-engine"] = time.perf_counter()
    stand_in_transfer_topology(worker)
    threading.Thread(target=worker._push_writer_loop, name="nixl-push-writer", daemon=True).start()
    return connector


def fake_nixl(connector):
    """The fake agent behind kvtrace's proxy (attributes set on the proxy would stay there)."""
    agent = connector.connector_worker.nixl_wrapper._agent
    assert isinstance(agent, FakeNixlWrapper)
    return agent


def step(connector, meta=None):
    """One engine step on the worker: metadata in, transfers polled, report out."""
    connector.bind_connector_metadata(meta or NixlConnectorMetadata())
    connector.start_load_kv(None)
    results = connector.get_transfer_results(set())
    report = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return results, report


def deliver_registration(connector, message: bytes = None) -> None:
    fake_nixl(connector).deliver(message or registration())
    connector.connector_worker._push_writer_wake.set()


def by_stage(spans):
    return {s.attributes["kvtrace.stage"]: s for s in spans}


def test_registration_first_then_write_then_release(producer, spans):
    worker = producer.connector_worker
    deliver_registration(producer)
    assert until(lambda: D_ID in worker._pending_d_registrations)
    step(producer, finished_blocks())  # P's blocks reach the writer: rendezvous complete
    assert until(lambda: worker.nixl_wrapper.posted)
    results, report = step(producer)
    assert results.finished_sending == {P_ID}
    assert set(report.ready_ns) == {P_ID}

    stages = by_stage(spans())
    assert {"registration", "rendezvous", "descriptor_prep", "write"} <= set(stages)
    rendezvous = stages["rendezvous"]
    assert rendezvous.attributes["kvtrace.rendezvous.order"] == "registration_first"
    assert rendezvous.start_time == stages["registration"].start_time  # it waited from the arrival
    write = stages["write"]
    assert write.attributes["kvtrace.transfer.bytes"] == 65536
    assert write.attributes["kvtrace.transfer.descriptors"] == 4
    assert write.attributes["kvtrace.transfer.xfer_us"] == 340
    assert write.status.status_code is StatusCode.UNSET
    assert stages["descriptor_prep"].end_time <= write.start_time
    assert stages["descriptor_prep"].attributes["kvtrace.on_engine_loop"] is False
    for span in stages.values():
        assert span.context.trace_id == TRACE.trace_id and span.parent.span_id == TRACE.span_id
        assert span.attributes["kvtrace.request_id"] == "cmpl-req1-0"


def test_kv_first_rendezvous_waits_for_the_registration(producer, spans):
    worker = producer.connector_worker
    step(producer, finished_blocks())
    assert until(lambda: P_ID in worker._push_finished_blocks)
    time.sleep(0.02)  # P's blocks wait: this wait is on the critical path
    deliver_registration(producer)
    assert until(lambda: worker.nixl_wrapper.posted)
    stages = by_stage(spans())
    rendezvous = stages["rendezvous"]
    assert rendezvous.attributes["kvtrace.rendezvous.order"] == "kv_first"
    assert rendezvous.end_time - rendezvous.start_time >= 20_000_000
    assert stages["registration"].start_time >= rendezvous.start_time


def test_handshake_pending_defers_the_write_and_is_traced(producer, spans, monkeypatch):
    worker = producer.connector_worker
    del worker._remote_agents["d-engine"]  # D not yet known: P must handshake first
    release = threading.Event()

    def slow_handshake(*args, **kwargs):
        release.wait(5)
        return {(0, 0): "agent-d"}, 0.0

    monkeypatch.setattr(worker, "_nixl_handshake", slow_handshake)
    deliver_registration(producer)
    step(producer, finished_blocks())
    assert until(lambda: "d-engine" in worker._handshake_futures)
    time.sleep(0.02)
    assert worker.nixl_wrapper.posted == []  # no WRITE while the handshake is pending
    release.set()
    assert until(lambda: worker.nixl_wrapper.posted)
    step(producer)  # the engine loop sees the WRITE done

    stages = by_stage(spans())
    handshake = stages["handshake"]
    assert handshake.attributes["kvtrace.handshake.kind"] == "full"
    assert handshake.end_time - handshake.start_time >= 20_000_000
    assert handshake.context.trace_id == TRACE.trace_id  # charged to the request that waited
    assert stages["write"].start_time >= handshake.end_time


def test_failed_handshake_is_an_error_span(producer, spans, monkeypatch):
    worker = producer.connector_worker
    del worker._remote_agents["d-engine"]

    def broken_handshake(*args, **kwargs):
        raise ConnectionRefusedError("side channel closed")

    monkeypatch.setattr(worker, "_nixl_handshake", broken_handshake)
    deliver_registration(producer)
    step(producer, finished_blocks())
    assert until(lambda: any(s.attributes["kvtrace.stage"] == "handshake" for s in spans()))
    handshake = by_stage(spans())["handshake"]
    assert handshake.status.status_code is StatusCode.ERROR
    assert handshake.attributes["error.type"] == "handshake_failed"
    assert worker.nixl_wrapper.posted == []


def test_failed_transfer_is_an_error_span(producer, spans):
    worker = producer.connector_worker
    fake_nixl(producer).state = "ERR"
    deliver_registration(producer)
    step(producer, finished_blocks())
    assert until(lambda: worker.nixl_wrapper.posted)
    step(producer)
    assert len(worker.nixl_wrapper.released) == 1  # vLLM released the failed handle itself
    write = by_stage(spans())["write"]
    assert write.status.status_code is StatusCode.ERROR
    assert write.attributes["error.type"] == "transfer_failed"
    assert [e.name for e in write.events] == ["kvtrace.failure"]


def test_expired_lease_is_reported_to_the_scheduler(producer, spans):
    # No registration ever arrives and the lease is already over when the step polls.
    results, report = step(producer, finished_blocks(expires_in=-1.0))
    assert P_ID in results.finished_sending
    assert report.expired == {P_ID}


def test_instrumentation_error_never_reaches_vllm(producer, spans, monkeypatch):
    worker = producer.connector_worker

    def broken(*args, **kwargs):
        raise RuntimeError("bug in kvtrace")

    tracing = producer._kvtrace_worker
    monkeypatch.setattr(tracing, "on_released", broken)
    monkeypatch.setattr(tracing, "on_prepped", broken)
    deliver_registration(producer)
    step(producer, finished_blocks())
    assert until(lambda: worker.nixl_wrapper.posted)
    results, _ = step(producer)
    assert results.finished_sending == {P_ID}  # the WRITE completed as vLLM sees it
    assert len(worker.nixl_wrapper.released) == 1
    assert producer.kvtrace_guard.errors == 2
