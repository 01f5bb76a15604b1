"""The collector's threads carry their names into the OS, where a process's CPU is read per thread
(``collectors/threads.py``; ``bench/collector_ingest.py`` splits the collector's CPU by them)."""

import os
import sys

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from kvtrace.collectors.forwarder import Upstream
from kvtrace.collectors.threads import os_name
from tests.collectors.test_receivers import grpc_target, post, valid_payload
from tests.collectors.traces import build
from tests.helpers import wait_until

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="thread names in the OS: Linux's prctl")


def os_thread_names() -> set[str]:
    names = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.add(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names


def test_names_fit_what_linux_keeps():
    assert os_name("kvtrace-pipeline") == "kv-pipeline"  # 16 bytes as it is: Linux keeps 15
    assert os_name("kvtrace-otlp-grpc_3") == "kv-otlp-grpc_3"
    assert os_name("kvtrace-forward-apm.example.com") == "kv-forward-apm."
    assert os_name("other") == "other"


@linux_only
def test_a_running_collectors_threads_are_named_in_the_os(make_collector):
    collector = make_collector()
    stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(grpc_target(collector)))
    stub.Export(build("push").requests[0], timeout=5)  # starts a gRPC worker
    assert post(collector, valid_payload()).status_code == 200
    expected = {"kv-pipeline", "kv-store", "kv-otlp-grpc_0", "kv-otlp-http"}
    assert wait_until(lambda: expected <= os_thread_names()), sorted(os_thread_names())


@linux_only
def test_a_forwarders_thread_is_named_after_its_upstream():
    upstream = Upstream("grpc://127.0.0.1:9")  # nothing queued: nothing is sent
    upstream.start()
    try:
        assert wait_until(lambda: "kv-forward-127." in os_thread_names()), sorted(os_thread_names())
    finally:
        upstream.shutdown()
