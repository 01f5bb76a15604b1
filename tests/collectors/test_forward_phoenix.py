"""Forwarding into Arize Phoenix, an OTLP trace backend, and reading the spans back from its API:
the engines' spans as sent, and each trace's breakdown span equal to the store's row.

Phoenix's gRPC port binds every interface, so it runs only inside a private network
namespace (``unshare --net`` with loopback up) together with the collector under test; the
round trip is ``phoenix_roundtrip.py``. Phoenix lives in its own virtual environment (its
dependencies do not mix with vLLM's): ``make test`` builds ``.venv-phoenix``;
``KVTRACE_PHOENIX_PYTHON`` can point elsewhere.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.collectors.forwarding import assert_breakdown_matches

ROOT = Path(__file__).resolve().parents[2]
PHOENIX_PYTHON = os.environ.get("KVTRACE_PHOENIX_PYTHON", str(ROOT / ".venv-phoenix" / "bin" / "python"))


def test_spans_read_back_from_phoenix_equal_what_was_sent(tmp_path):
    assert Path(PHOENIX_PYTHON).exists(), (
        f"{PHOENIX_PYTHON} not found: run `make test` (it builds .venv-phoenix) or set KVTRACE_PHOENIX_PYTHON")
    script = ROOT / "tests" / "collectors" / "phoenix_roundtrip.py"
    result = subprocess.run(
        ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, str(script),
         PHOENIX_PYTHON, str(tmp_path)],
        capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    sent, received, store = data["sent"], data["received"], data["store"]
    assert len(sent) == 18 + 18 + 17  # two push traces and a pull one
    assert data["forwarded"] == len(sent) + 3  # and one breakdown span each
    breakdowns = {span_id: span for span_id, span in received.items() if span["name"] == "kvtrace.breakdown"}
    assert set(received) == set(sent) | set(breakdowns)
    # Phoenix reads back one breakdown span per trace, under its pd.request, equal to the store's row
    assert sorted(span["trace_id"] for span in breakdowns.values()) == sorted(store)
    roots = {want["trace_id"]: span_id for span_id, want in sent.items() if want["name"] == "pd.request"}
    for span in breakdowns.values():
        assert span["parent"] == roots[span["trace_id"]]
        assert_breakdown_matches(span["attributes"], store[span["trace_id"]])
    for span_id, want in sent.items():
        got = received[span_id]
        assert (got["trace_id"], got["name"], got["parent"]) == (want["trace_id"], want["name"], want["parent"])
        # Phoenix keeps microseconds: the nanoseconds below are lost there, not on the way.
        assert abs(got["start"] - want["start"]) < 1000 and abs(got["end"] - want["end"]) < 1000
        for key, value in want["attributes"].items():
            assert got["attributes"].get(key) == value, (span_id, key)
