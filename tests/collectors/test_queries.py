"""The dashboard's queries on a store filled with contract traces."""

import pytest

from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors import queries
from tests.helpers import wait_until
from tests.collectors.traces import MS, build


@pytest.fixture
def filled(make_collector):
    collector = make_collector()
    builts = [build("push") for _ in range(4)] + [build("pull") for _ in range(3)]
    for built in builts:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: collector.store.flush() or
                      collector.store.query("SELECT count(*) FROM requests")[0][0] == len(builts))
    return collector, builts


def test_percentiles_by_mode_length_and_window(filled):
    collector, builts = filled
    by_mode = queries.percentiles(collector.store._con, "mode").to_pylist()
    assert [(r["group"], r["requests"]) for r in by_mode] == [("pull", 3), ("push", 4)]
    push = by_mode[1]
    assert push["ttft_p50_ms"] == pytest.approx(builts[0].ttft_ns / MS)
    assert push["compute_p50_ms"] == pytest.approx(builts[0].expected["compute"] / MS)
    by_length = queries.percentiles(collector.store._con, "length").to_pylist()
    assert [(r["group"], r["requests"]) for r in by_length] == [("512-2k", 7)]  # 2000 prompt tokens
    by_window = queries.percentiles(collector.store._con, "window", window="1 minute").to_pylist()
    assert sum(r["requests"] for r in by_window) == 7
    with pytest.raises(ValueError):
        queries.percentiles(collector.store._con, "window", window="1; DROP TABLE requests")
    with pytest.raises(ValueError):
        queries.percentiles(collector.store._con, "colour")


def test_stage_summary_and_waterfall(filled):
    collector, builts = filled
    summary = {(r["side"], r["stage"]): r for r in queries.stage_summary(collector.store._con, "push").to_pylist()}
    assert summary[("prefill", "prefill")]["duration_p50_ms"] == pytest.approx(144)
    assert summary[("prefill", "rendezvous")]["critical_p50_ms"] == pytest.approx(2)
    rows = queries.waterfall(collector.store._con, builts[0].trace_id).to_pylist()
    assert rows[0]["stage"] == "pd_route" and rows[0]["start_ms"] == pytest.approx(0)
    assert [r["start_ms"] for r in rows] == sorted(r["start_ms"] for r in rows)
    recent = queries.recent_requests(collector.store._con, limit=5)
    assert recent.num_rows == 5
