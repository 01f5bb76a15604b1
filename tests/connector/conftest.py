"""vLLM's real NIXL scheduler and worker classes, with a fake NIXL agent in place of UCX
(see :mod:`kvtrace.testbed.inproc`); spans go to memory."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtrace.telemetry import setup as telemetry_setup
from kvtrace.testbed import inproc
from kvtrace.testbed.recipes import build


@pytest.fixture(scope="session")
def model_dir():
    return str(build())


@pytest.fixture
def spans(monkeypatch):
    """Routes this test's spans to memory: the recorder the connector configures exports there."""
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(telemetry_setup, "build_exporter", lambda config: exporter)

    def finished():
        telemetry_setup.get_recorder().force_flush()
        return exporter.get_finished_spans()

    return finished


@pytest.fixture
def build_connector(model_dir, spans):
    """``build(connector, kv_role, role, engine_id, kvtrace_block)`` → a kvtrace connector
    whose NIXL agent is a :class:`FakeNixlWrapper` and whose spans go to ``spans()``."""
    made = []

    def build_one(connector: str, kv_role: str, role: str, engine_id: str, block: dict | None = None):
        instance = inproc.build_connector(model_dir, connector, kv_role, role, engine_id, block)
        made.append(instance)
        return instance

    yield build_one
    for instance in made:
        worker = instance.connector_worker
        if worker is not None and hasattr(worker, "_push_writer_stop"):
            worker._push_writer_stop.set()
            worker._push_writer_wake.set()
