import pytest

from kvtrace.telemetry import setup as telemetry_setup
from kvtrace.telemetry.recorder import NoOpRecorder


@pytest.fixture(autouse=True)
def _reset_process_recorder():
    """Each test starts with no process-global recorder configured."""
    yield
    recorder = telemetry_setup.get_recorder()
    recorder.shutdown(timeout_millis=5_000)
    telemetry_setup._recorder = NoOpRecorder()
    telemetry_setup._configured = False


# A skipped test is a test that did not run: the suite fails if any is skipped, so none can be
# skipped on every run unnoticed (KVTRACE_ALLOW_SKIPS=1 for a local run that means to skip).
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    import os

    if _SKIPPED and exitstatus == 0 and not os.environ.get("KVTRACE_ALLOW_SKIPS"):
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"kvtrace: {len(_SKIPPED)} test(s) skipped, which the suite does not allow: {_SKIPPED[:5]}", red=True)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def clickhouse_server(tmp_path_factory):
    """One real ClickHouse server (chdb-core) on 127.0.0.1 for the session; each test uses its own database."""
    from kvtrace.testbed.peers import ClickHouseServer

    with ClickHouseServer(str(tmp_path_factory.mktemp("clickhouse"))) as server:
        yield server


@pytest.fixture(scope="session")
def clickhouse_cluster():
    """Two more ClickHouse servers, the two shards of one cluster (a store sharded behind Distributed tables)."""
    from kvtrace.testbed.peers import ClickHouseCluster

    with ClickHouseCluster(shards=2) as cluster:
        yield cluster
