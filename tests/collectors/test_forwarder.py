"""The forwarder's calls: what queues up behind a slow upstream goes out together, every span once."""

from __future__ import annotations

import threading

from kvtrace.collectors.forwarder import MAX_CALL_BYTES, Upstream
from kvtrace.collectors.receivers import OtlpGrpcReceiver
from tests.collectors.traces import build
from tests.helpers import wait_until


def test_requests_queued_behind_a_slow_upstream_go_out_in_one_call_every_span_once():
    released = threading.Event()
    calls: list[list[bytes]] = []  # span ids per call the upstream received

    def upstream(batch) -> None:
        calls.append([row.span_id for row in batch.rows])
        released.wait(30)  # the first call holds the forwarder while the others queue

    receiver = OtlpGrpcReceiver(upstream, port=0)
    receiver.start()
    forwarder = Upstream(f"grpc://127.0.0.1:{receiver.port}")
    forwarder.start()
    try:
        payloads = [request.SerializeToString() for i in range(12)
                    for request in build(request_id=f"cmpl-f{i}-0").requests]
        span_ids = [[row.span_id for row in _rows(p)] for p in payloads]
        forwarder.consume(payloads[0], len(span_ids[0]))
        assert wait_until(lambda: len(calls) == 1, 10)
        for payload, ids in zip(payloads[1:], span_ids[1:]):
            forwarder.consume(payload, len(ids))
        released.set()
        assert wait_until(lambda: forwarder.backlog() == 0, 10)
        assert len(calls) == 2  # the first alone, then all that had queued behind it
        assert calls[1] == [i for ids in span_ids[1:] for i in ids]  # as queued, every span once
        assert forwarder.stats.forwarded_requests == len(payloads) and forwarder.stats.calls == 2
        assert forwarder.stats.forwarded_spans == sum(map(len, span_ids)) and forwarder.stats.dropped == 0
        assert sum(map(len, payloads)) < MAX_CALL_BYTES
    finally:
        released.set()
        forwarder.shutdown()
        receiver.shutdown()


def test_a_call_carries_at_most_max_call_bytes_unless_one_request_is_larger():
    released = threading.Event()
    sizes: list[int] = []

    def upstream(batch) -> None:
        sizes.append(len(batch.payload))
        released.wait(30)

    receiver = OtlpGrpcReceiver(upstream, port=0, max_message_bytes=8 * MAX_CALL_BYTES)
    receiver.start()
    forwarder = Upstream(f"grpc://127.0.0.1:{receiver.port}")
    forwarder.start()
    try:
        payload = b"".join(r.SerializeToString() for i in range(40) for r in build(request_id=f"cmpl-g{i}-0").requests)
        big = payload * (MAX_CALL_BYTES // len(payload) + 1)  # one request over the limit
        small = payload * int(0.4 * MAX_CALL_BYTES / len(payload))
        forwarder.consume(payload, 1)
        assert wait_until(lambda: len(sizes) == 1, 10)
        for _ in range(3):  # 40 % of the limit each: two fit in one call, the third goes alone
            forwarder.consume(small, 1)
        forwarder.consume(big, 1)  # over the limit: alone
        released.set()
        assert wait_until(lambda: forwarder.backlog() == 0 and len(sizes) == 4, 10), sizes
        assert sizes[1:] == [2 * len(small), len(small), len(big)], sizes
        assert all(size <= MAX_CALL_BYTES for size in sizes[:-1]) and sizes[-1] > MAX_CALL_BYTES
        assert forwarder.stats.forwarded_requests == 5 and forwarder.stats.dropped == 0
    finally:
        released.set()
        forwarder.shutdown()
        receiver.shutdown()


def _rows(payload: bytes):
    from kvtrace.collectors.model import SpanBatch

    return SpanBatch.decode(payload).rows
