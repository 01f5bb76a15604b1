"""kvtrace's stats on vLLM's seam: every object vLLM aggregates must accept the others' keys."""

from types import SimpleNamespace

import pytest

from kvtrace.connector import traced
from kvtrace.connector.stats import KvtraceConnectorStats
from kvtrace.telemetry.metrics import PendingStats


@pytest.fixture
def pending(monkeypatch):
    stats = PendingStats("pull", "consumer")
    monkeypatch.setattr(traced, "_pending", stats)
    return stats


def _nixl_transfer(connector) -> None:
    """What NIXL's worker records for one finished READ (its own stats object)."""
    connector.connector_worker.xfer_stats.record_transfer(
        SimpleNamespace(xferDuration=1500, postDuration=20, totalBytes=65536, descCount=4))


def test_worker_nixl_stats_and_scheduler_kvtrace_stats_aggregate_as_vllm_does(build_connector, pending):
    worker = build_connector("NixlPullConnector", "kv_consumer", "worker", "d-engine")
    scheduler = build_connector("NixlPullConnector", "kv_consumer", "scheduler", "d-engine")
    _nixl_transfer(worker)  # the worker has NIXL's numbers and, this step, none of kvtrace's
    from_worker = worker.get_kv_connector_stats()
    pending.observe_stage("allocation", 0.002, None)
    from_scheduler = scheduler.get_kv_connector_stats()
    # vLLM's scheduler: worker stats first, the scheduler's aggregated into them
    merged = from_worker.aggregate(from_scheduler)
    data = merged.to_dict()
    assert data["bytes_transferred"] == [65536] and data["kvtrace_stage"] == [["allocation", "pull", "consumer", 0.002]]
    # and the other way round (a step where only the scheduler had stats first)
    pending.observe_engine_loop(0.00001, "scheduler")
    again = scheduler.get_kv_connector_stats()
    _nixl_transfer(worker)
    again.aggregate(worker.get_kv_connector_stats())
    assert again.to_dict()["bytes_transferred"] == [65536] and len(again.to_dict()["kvtrace_engine_loop"]) == 1
    # what the API server rebuilds from the payload
    rebuilt = type(worker).build_kv_connector_stats(data)
    assert isinstance(rebuilt, KvtraceConnectorStats) and not rebuilt.is_empty()
    assert rebuilt.reduce()["kvtrace stage records"] == 1


def test_nothing_to_report_is_none(build_connector, pending):
    scheduler = build_connector("NixlPullConnector", "kv_consumer", "scheduler", "d-engine")
    assert scheduler.get_kv_connector_stats() is None
