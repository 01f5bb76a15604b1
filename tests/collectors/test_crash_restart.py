"""kill -9 in the middle of ingestion, then restart: every acknowledged span is in the store."""

import os
import signal
import subprocess
import sys
import threading

import duckdb
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from kvtrace.testbed.launch import free_port
from tests.helpers import wait_until
from tests.collectors.traces import build


def start_collector(db, port, metrics_port):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "collector", "--db", str(db), "--grpc-port", str(port),
         "--http-port", "-1", "--metrics-port", str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    return process, trace_service_pb2_grpc.TraceServiceStub(channel)


def test_kill_9_loses_nothing_acknowledged(tmp_path):
    db = tmp_path / "store.duckdb"
    port, metrics_port = free_port(), free_port()
    process, stub = start_collector(db, port, metrics_port)
    acknowledged: set[str] = set()
    stop = threading.Event()

    def send():
        while not stop.is_set():
            built = build("push")
            for request in built.requests:
                try:
                    stub.Export(request, timeout=5)
                except grpc.RpcError:
                    return  # the collector is gone: this request was never acknowledged
                acknowledged.update(span.span_id.hex() for rs in request.resource_spans
                                    for ss in rs.scope_spans for span in ss.spans)

    sender = threading.Thread(target=send)
    sender.start()
    assert wait_until(lambda: len(acknowledged) > 2000, timeout_s=60)
    os.killpg(process.pid, signal.SIGKILL)  # no shutdown, no flush
    process.wait(10)
    stop.set()
    sender.join(10)
    count_at_kill = len(acknowledged)

    process, stub = start_collector(db, port, metrics_port)  # replays the write-ahead log
    try:
        stub.Export(build("pull").requests[0], timeout=5)  # and serves again
    finally:
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=30)
    # What DuckDB had not committed at the kill came back from the write-ahead log.
    assert b"replayed" in log, log[-2000:]
    con = duckdb.connect(str(db), read_only=True)
    stored = {row[0] for row in con.execute("SELECT span_id FROM spans").fetchall()}
    con.close()
    assert count_at_kill > 2000
    missing = acknowledged - stored
    assert not missing, f"{len(missing)} of {count_at_kill} acknowledged spans lost"
