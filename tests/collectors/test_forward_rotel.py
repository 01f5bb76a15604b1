"""Forwarding into rotel, a real Rust OpenTelemetry collector, and back out of it: the spans
unchanged, plus one ``kvtrace.breakdown`` span per decided trace."""

import socket

import pytest

from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors.config import ForwardPolicy
from kvtrace.testbed.peers import Rotel
from kvtrace.collectors.receivers import OtlpGrpcReceiver
from tests.helpers import wait_until
from tests.collectors.forwarding import Sink, assert_breakdown_matches, attributes, sent_spans, store_breakdowns
from tests.collectors.traces import build


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
    assert wait_until(lambda: len(sink.spans) >= len(expected) and len(sink.breakdowns) >= len(builts), timeout_s=30)
    assert sink.spans == expected  # byte-for-byte: ids, times, attributes, status, resource, scope
    # exactly one breakdown span per decided trace, under its pd.request, equal to the store's row
    by_trace = sink.breakdowns_by_trace()
    assert sorted(by_trace) == sorted(b.trace_id for b in builts) and all(len(s) == 1 for s in by_trace.values())
    collector.store.flush()
    rows = store_breakdowns(collector.store.query)
    for built in builts:
        (span,) = by_trace[built.trace_id]
        root = next(s for r in built.requests for rs in r.resource_spans for ss in rs.scope_spans
                    for s in ss.spans if s.name == "pd.request")
        assert span.parent_span_id == root.span_id and span.start_time_unix_nano == root.start_time_unix_nano
        assert span.end_time_unix_nano - span.start_time_unix_nano == built.ttft_ns
        attrs = attributes(span)
        assert attrs["kvtrace.breakdown.revision"] == 1
        assert_breakdown_matches(attrs, rows[built.trace_id])
    assert collector.upstreams[0].stats.forwarded_spans == len(expected) + len(builts)


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
    assert wait_until(lambda: len(sink.spans) >= len(wanted) and len(sink.breakdowns) >= 2, timeout_s=30)
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 3
                      or collector.store.flush() or False)
    assert sink.spans == wanted
    # each forwarded trace carries its breakdown; the failed one's says so, in its status too
    by_trace = sink.breakdowns_by_trace()
    assert sorted(by_trace) == sorted([slow.trace_id, failed.trace_id])
    assert [attributes(s)["kvtrace.breakdown.error"] for s in by_trace[failed.trace_id]] == [True]
    assert by_trace[failed.trace_id][0].status.code == 2
    assert attributes(by_trace[slow.trace_id][0])["kvtrace.breakdown.ttft_ms"] >= 170
