"""Reading a running collector's store from other processes while it keeps ingesting: a user's own
Python + DuckDB session, ``kvtrace query``, and the dashboard's data layer — nothing lost, and
every request counted once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors.read import Filters, open_store
from kvtrace.testbed.launch import free_port
from kvtrace.testbed.synthetic import Generator, Workload
from tests.helpers import wait_until

TRACES = 3_000

# A user's own session: the store's path, the reader, and DuckDB over what it returns.
USER_SESSION = textwrap.dedent("""
    import json, sys, time
    import duckdb
    from kvtrace.collectors.read import open_store
    store, total, deadline = open_store(sys.argv[1]), int(sys.argv[2]), time.monotonic() + 120
    while time.monotonic() < deadline:
        requests = store.sql("SELECT mode, ttft_ms FROM requests").to_pandas()
        seen = duckdb.sql("SELECT count(*) FROM requests").fetchall()[0][0]  # DuckDB over the pandas frame
        print(json.dumps({"seen": seen, "source": store.source.kind}), flush=True)
        if seen >= total:
            break
        time.sleep(0.2)
""")


def _post(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_other_processes_read_a_running_collector_while_it_ingests(tmp_path):
    db, port = str(tmp_path / "live.duckdb"), free_port()
    log = open(tmp_path / "collector.log", "wb")
    collector = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "collector", "--db", db, "--grpc-port", "-1", "--http-port", str(port),
         "--decision-wait", "0.3"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    user = None
    try:
        assert wait_until(lambda: Path(f"{db}.kvtrace-collector.json").exists(), 30), \
            (tmp_path / "collector.log").read_text()
        user = subprocess.Popen([sys.executable, "-c", USER_SESSION, db, str(TRACES)], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        requests = list(Generator(Workload(rate_per_s=50)).requests(TRACES, time.time_ns() - 120 * 10**9,
                                                                    per_request=200))
        spans = 0
        dashboard = open_store(db)
        queried = []
        for i, payload in enumerate(requests):  # ingest while the others read
            _post(f"http://127.0.0.1:{port}/v1/traces", payload)
            spans += len(SpanBatch.decode(payload).rows)
            if i % 10 == 0:
                queried.append(dashboard.kpis(Filters())["requests"])
                cli = subprocess.run([sys.executable, "-m", "kvtrace", "query", "--db", db,
                                      "SELECT count(*) AS n FROM requests"], capture_output=True, text=True)
                assert cli.returncode == 0, cli.stderr
                queried.append(int(cli.stdout.split()[1]))
        out, _ = user.communicate(timeout=150)
        seen = [json.loads(line) for line in out.splitlines()]
        assert seen and seen[-1]["seen"] == TRACES, seen[-3:]
        assert {s["source"] for s in seen} == {"collector"}  # the collector held the file throughout
        assert all(a["seen"] <= b["seen"] for a, b in zip(seen, seen[1:]))  # committed data only, never less
        # each reader saw the count grow, never shrink: the dashboard's (even) and kvtrace query's (odd)
        assert queried[::2] == sorted(queried[::2]) and queried[1::2] == sorted(queried[1::2])
        assert wait_until(lambda: dashboard.kpis(Filters())["requests"] == TRACES, 30)
        status = dashboard.status()
        assert status["spans_received"] == spans and status["requests_rejected"] == 0
        stored = dashboard.sql("SELECT count(*) AS n, count(DISTINCT trace_id) AS traces FROM spans").to_pylist()[0]
        assert (stored["n"], stored["traces"]) == (spans, TRACES)
    finally:
        if user is not None and user.poll() is None:
            os.killpg(user.pid, signal.SIGTERM)
        if collector.poll() is None:
            os.killpg(collector.pid, signal.SIGTERM)
            collector.wait(30)
        log.close()
    # Once it has stopped, the same readers read the file itself: the same answer.
    assert open_store(db).kpis(Filters())["requests"] == TRACES
    assert not Path(f"{db}.kvtrace-collector.json").exists()
