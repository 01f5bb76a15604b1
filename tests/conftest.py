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
