import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtrace.telemetry.recorder import Recorder

RESOURCE = Resource.create({"service.name": "test", "kvtrace.role": "producer"})


@pytest.fixture
def make_recorder():
    """Build recorders that are shut down at the end of the test, whatever happens."""
    made = []

    def make(exporter=None, **kwargs):
        recorder = Recorder(exporter, RESOURCE, **kwargs)
        made.append(recorder)
        return recorder

    yield make
    for recorder in made:
        recorder.shutdown(timeout_millis=5_000)


@pytest.fixture
def memory_exporter():
    return InMemorySpanExporter()
