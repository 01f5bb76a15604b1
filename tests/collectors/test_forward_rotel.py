"""Forwarding into rotel, a real Rust OpenTelemetry collector, and back out of it unchanged."""

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


def test_upstream_down_never_slows_ingestion_or_loses_the_local_copy(make_collector):
    collector = make_collector(forward=["grpc://127.0.0.1:9"])  # nothing listens there
    builts = [build("push") for _ in range(30)]
    for built in builts:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 30 or
                      collector.store.flush() or False)
    assert wait_until(lambda: collector.upstreams[0].stats.failures > 0)
    assert collector.store.query("SELECT count(DISTINCT trace_id) FROM spans")[0][0] == 30


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
