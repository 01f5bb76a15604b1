"""Forwarding into rotel, a real Rust OpenTelemetry collector, and back out of it unchanged."""

import socket
import threading

import pytest

from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors.config import ForwardPolicy
from kvtrace.testbed.peers import Rotel
from kvtrace.collectors.receivers import OtlpGrpcReceiver
from tests.helpers import wait_until
from tests.collectors.traces import build


class Sink:
    def __init__(self):
        self.spans = {}
        self.lock = threading.Lock()

    def __call__(self, batch):
        with self.lock:
            for rs in batch.request.resource_spans:
                resource = {a.key: a.value.SerializeToString() for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans[span.span_id.hex()] = (span.SerializeToString(), resource, ss.scope.name)


def sent_spans(builts):
    out = {}
    for built in builts:
        for request in built.requests:
            for rs in request.resource_spans:
                resource = {a.key: a.value.SerializeToString() for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out[span.span_id.hex()] = (span.SerializeToString(), resource, ss.scope.name)
    return out


@pytest.fixture
def rotel_to_sink():
    sink = Sink()
    receiver = OtlpGrpcReceiver(sink, port=0)
    receiver.start()
    with Rotel(export_to=f"http://127.0.0.1:{receiver.port}") as rotel:
        yield rotel, sink
    receiver.shutdown()


def test_every_span_reaches_rotel_and_comes_back_unchanged(make_collector, rotel_to_sink):
    rotel, sink = rotel_to_sink
    collector = make_collector(forward=[rotel.grpc_endpoint])
    builts = [build(mode, order) for mode, order in
              [("push", "registration_first"), ("push", "kv_first"), ("pull", "")] * 3]
    for built in builts:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    expected = sent_spans(builts)
    assert wait_until(lambda: len(sink.spans) >= len(expected), timeout_s=30)
    assert sink.spans == expected  # byte-for-byte: ids, times, attributes, status, resource, scope
    assert collector.upstreams[0].stats.forwarded_spans == len(expected)


def test_a_dead_upstream_loses_nothing_locally(make_collector):
    collector = make_collector(forward=["grpc://127.0.0.1:9"])  # nothing listens there
    builts = [build("push") for _ in range(30)]
    for built in builts:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 30 or
                      collector.store.flush() or False)
    assert wait_until(lambda: collector.upstreams[0].stats.failures > 0)
    assert collector.store.query("SELECT count(DISTINCT trace_id) FROM spans")[0][0] == 30


def test_a_stuck_upstream_never_blocks_ingestion(make_collector):
    """An upstream that takes the connection and never answers holds its forwarder thread for the
    whole send timeout; ingestion, attribution and the store go on meanwhile."""
    with socket.socket() as stuck:  # accepts (the kernel does), never reads, never answers
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(16)
        collector = make_collector(forward=[f"http://127.0.0.1:{stuck.getsockname()[1]}/v1/traces"])
        upstream = collector.upstreams[0]
        builts = [build("push") for _ in range(30)]
        for built in builts:
            for request in built.requests:
                collector.consume(SpanBatch.of(request))  # each returns: none waits for the upstream
        assert wait_until(lambda: collector.store.flush() or
                          collector.store.query("SELECT count(*) FROM requests")[0][0] == 30)
        # everything is stored while the forwarder is still stuck on its first send
        assert upstream.stats.forwarded_requests == 0 and upstream.stats.failures == 0 and upstream.backlog() > 0


def test_tail_policy_forwards_only_selected_traces(make_collector, rotel_to_sink):
    rotel, sink = rotel_to_sink
    collector = make_collector(forward=[rotel.grpc_endpoint],
                               forward_policies=[ForwardPolicy.parse("errors"), ForwardPolicy.parse("slow:170")])
    slow = build("pull")  # TTFT 181 ms: slow, forwarded
    failed = build("pull", fail="read")  # error: forwarded
    quick = build("push", "registration_first")  # TTFT 169 ms, no error: kept local only
    for built in (slow, failed, quick):
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    wanted = sent_spans([slow, failed])
    assert wait_until(lambda: len(sink.spans) >= len(wanted), timeout_s=30)
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 3
                      or collector.store.flush() or False)
    assert sink.spans == wanted
