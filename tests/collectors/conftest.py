import pytest

from kvtrace.collectors.config import CollectorConfig
from kvtrace.collectors.service import Collector


@pytest.fixture
def make_collector(tmp_path):
    """Collectors on free 127.0.0.1 ports with a DuckDB file in tmp_path; shut down after the test."""
    made = []

    def make(**overrides):
        config = CollectorConfig(db_path=str(tmp_path / "kvtrace.duckdb"), grpc_port=0, http_port=0,
                                 decision_wait_s=0.2, **overrides)
        collector = Collector(config)
        collector.start()
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.shutdown()

