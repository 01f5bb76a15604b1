"""The write-ahead log as the archive of originals, the store's schema check, and the
attribution histograms on /metrics."""

import duckdb
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace.collectors.config import CollectorConfig
from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors.service import Collector
from kvtrace.collectors.store import SchemaMismatch, Store
from kvtrace.collectors.wal import WriteAheadLog
from tests.collectors.traces import build
from tests.helpers import wait_until

CATEGORIES = ("compute", "queue", "coordination", "wire", "unattributed")


def test_log_keeps_originals_until_over_its_archive_size(tmp_path):
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=100, archive_bytes=250)
    records = [bytes([i]) * 60 for i in range(8)]
    positions = [wal.append(r) for r in records]  # 68 bytes each: two per 100-byte segment
    assert wal.segments() == [1, 2, 3, 4]
    assert [wal.read(seg, end, len(r)) for (seg, end), r in zip(positions, records)] == records
    assert wal.release((3, 0)) == 2  # only applied segments (1, 2) may go; 4 x 136 > 250
    assert wal.segments() == [3, 4]
    assert wal.read(*positions[0], 60) is None and wal.read(*positions[4], 60) == records[4]
    assert wal.release((9, 0)) == 1  # 2 x 136 > 250 still; the open segment always stays
    assert wal.segments() == [4]
    wal.close()


def test_a_trace_split_by_a_restart_is_made_whole_from_the_archived_originals(tmp_path):
    """P's half is stored before a crash; D's half is only in the log. After the restart the
    replayed half is joined with P's, decoded again from its original bytes in the log."""
    built = build("push")
    by_side = {SpanBatch.of(request).rows[0].side: request for request in built.requests}
    config = CollectorConfig(db_path=str(tmp_path / "kv.duckdb"), grpc_port=0, http_port=None,
                             decision_wait_s=0.1)
    first = Collector(config)
    first.start()
    first.consume(SpanBatch.of(by_side["prefill"]))
    first.consume(SpanBatch.of(by_side["router"]))
    assert wait_until(lambda: first.store.flush() or first.store.query("SELECT count(*) FROM requests")[0][0])
    first.wal.append(by_side["decode"].SerializeToString())  # acknowledged, then the crash
    first.shutdown()
    assert len(list(first.wal.replay(first.store.committed_position))) == 1  # D's half: logged, not stored

    second = Collector(config)
    second.start()  # replays D's half
    try:
        (complete, missing, ttft, *parts), = second.store.query(
            "SELECT complete, missing, ttft_ms, compute_ms, queue_ms, coordination_ms, wire_ms, unattributed_ms "
            "FROM requests WHERE trace_id = ?", [built.trace_id])
        assert complete and missing == ""
        assert sum(parts) == pytest.approx(ttft, abs=1e-6)
        assert second.store.query("SELECT count(*) FROM stages WHERE trace_id = ?", [built.trace_id])[0][0] >= 12
    finally:
        second.shutdown()


def test_originals_in_the_log_are_the_bytes_received(make_collector):
    collector = make_collector()
    built = build("pull")
    for request in built.requests:
        collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: collector.store.flush() or
                      collector.store.query("SELECT count(*) FROM batches")[0][0] == len(built.requests))
    stored = collector.store.query("SELECT wal_segment, wal_offset, bytes, spans FROM batches")
    originals = sorted(collector.wal.read(seg, off, length) for seg, off, length, _ in stored)
    assert originals == sorted(r.SerializeToString() for r in built.requests)
    for (seg, off, length, spans) in stored:
        request = ExportTraceServiceRequest.FromString(collector.wal.read(seg, off, length))
        assert spans == sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def test_a_store_from_another_schema_is_refused_not_written(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE spans (trace_id VARCHAR, request_id VARCHAR)")  # kvtrace 0.1's layout
    con.close()
    with pytest.raises(SchemaMismatch, match="old.duckdb.*use a new file"):
        Store(str(path))
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'requests'").fetchone() \
        == (0,)
    con.close()


def test_attribution_histograms_hold_every_request_breakdown(make_collector):
    collector = make_collector()
    cases = [build("push"), build("push", "kv_first"), build("pull")]
    for built in cases:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    query = "SELECT mode, ttft_ms, compute_ms, queue_ms, coordination_ms, wire_ms, unattributed_ms FROM requests"
    assert wait_until(lambda: collector.store.flush() or len(collector.store.query(query)) == len(cases))
    registry = collector.metrics.registry
    for mode in ("push", "pull"):
        rows = [r for r in collector.store.query(query) if r[0] == mode]
        assert registry.get_sample_value("kvtrace_ttft_seconds_count", {"mode": mode}) == len(rows)
        assert registry.get_sample_value("kvtrace_ttft_seconds_sum", {"mode": mode}) == \
            pytest.approx(sum(r[1] for r in rows) / 1e3)
        for le in (0.05, 0.1, 0.25, 0.5, 1.0):  # cumulative buckets: requests with TTFT <= le
            assert registry.get_sample_value("kvtrace_ttft_seconds_bucket", {"mode": mode, "le": str(le)}) == \
                sum(r[1] / 1e3 <= le for r in rows)
        for i, category in enumerate(CATEGORIES, start=2):
            labels = {"mode": mode, "category": category}
            assert registry.get_sample_value("kvtrace_ttft_part_seconds_sum", labels) == \
                pytest.approx(sum(r[i] for r in rows) / 1e3, abs=1e-9)
            assert registry.get_sample_value("kvtrace_ttft_part_seconds_bucket", {**labels, "le": "+Inf"}) == len(rows)


def test_stages_view_matches_the_attribution(make_collector):
    """``stages`` is computed from spans, clock offsets and critical parts: for skewed traces
    it equals, stage by stage, what the attribution produced."""
    collector = make_collector()
    seen = []
    add = collector.store.add_breakdown
    collector.store.add_breakdown = lambda breakdown, **kw: (seen.append(breakdown), add(breakdown, **kw))
    cases = [build("push", skew_ms={"decode": 50}, hosts="fast"), build("pull", skew_ms={"decode": -50}, hosts="slow")]
    for built in cases:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: len(seen) == len(cases))
    collector.store.flush()
    for breakdown in seen:
        assert breakdown.offsets_ns  # the skew was estimated and corrected
        view = collector.store.query("SELECT side, stage, category, start_ns, end_ns, duration_ms, critical_ms "
                                     "FROM stages WHERE trace_id = ? ORDER BY start_ns, side, stage",
                                     [breakdown.trace_id])
        expected = sorted((s.side, s.stage, s.category, s.start, s.end, s.duration / 1e6, s.critical_ns / 1e6)
                          for s in breakdown.stages)
        assert sorted(view) == expected
        assert sum(row[6] for row in view) <= breakdown.ttft_ns / 1e6


def test_senders_and_batches_keep_their_ids_across_runs(tmp_path):
    path = str(tmp_path / "kv.duckdb")
    first, second = build("push"), build("pull")
    for built in (first, second):  # two runs on one file, the same three senders' names
        store = Store(path)
        for request in built.requests:
            store.add_spans(SpanBatch.of(request), None)
        store.flush()
        store.shutdown()
    con = duckdb.connect(path, read_only=True)
    senders = con.execute("SELECT service, instance, role, mode FROM origins ORDER BY origin_id").fetchall()
    assert len(senders) == len(set(senders)) == 6  # router, P, D in push mode, then in pull mode
    assert con.execute("SELECT count(*), count(DISTINCT batch_id) FROM batches").fetchone() == (6, 6)
    by_trace = dict(con.execute("SELECT trace_id, list(DISTINCT mode) FROM spans GROUP BY 1").fetchall())
    assert by_trace == {first.trace_id: ["push"], second.trace_id: ["pull"]}
    total = sum(len(ss.spans) for b in (first, second) for r in b.requests for rs in r.resource_spans
                for ss in rs.scope_spans)
    assert con.execute("SELECT count(*) FROM spans WHERE duration_ms >= 0 AND service LIKE '%'").fetchone()[0] == total
    con.close()


def test_a_logged_request_that_no_longer_decodes_is_skipped_at_restart(tmp_path):
    config = CollectorConfig(db_path=str(tmp_path / "kv.duckdb"), grpc_port=0, http_port=None, decision_wait_s=0.1)
    built = build("push")
    first = Collector(config)
    first.start()
    first.wal.append(b"\x0a\xff\xff")  # logged, never applied: truncated protobuf
    for request in built.requests:
        first.wal.append(request.SerializeToString())
    first.shutdown()
    second = Collector(config)
    second.start()  # must not crash-loop on the bad record
    try:
        assert second.metrics._rejected.labels("replay_undecodable")._value.get() == 1
        assert second.store.query("SELECT trace_id, complete FROM requests") == [(built.trace_id, True)]
    finally:
        second.shutdown()
