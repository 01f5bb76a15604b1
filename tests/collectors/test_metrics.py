"""The collector's Prometheus metrics: decided traces queued on the pipeline thread, folded into the counts
in batches and before every read."""

import random
import threading

from kvtrace.collectors import metrics as metrics_module
from kvtrace.collectors.breakdown import Breakdown
from kvtrace.collectors.metrics import PART_BUCKETS, TTFT_BUCKETS, CollectorMetrics
from kvtrace.telemetry import semconv


def _breakdown(rng, mode: str) -> Breakdown:
    """TTFT and parts on the buckets' bounds, just off them, 0, and anywhere."""
    def ns(bounds):
        bound = rng.choice(bounds)
        return rng.choice([0, round(bound * 1e9), round(bound * 1e9) + 1, round(bound * 1e9) - 1,
                           rng.randint(1, 40 * 10**9)])
    parts = {category: ns(PART_BUCKETS) for category in semconv.CATEGORY_NAMES if rng.random() < 0.8}
    return Breakdown(trace_id="0" * 32, request_id="", mode=mode, start_ns=0, ttft_ns=ns(TTFT_BUCKETS) - (rng.random() < 0.05),
                     parts=parts, timings={}, critical_ns={}, complete=rng.random() < 0.7, missing=[], error=False)


def _expected_buckets(values, bounds):
    return {**{str(le): sum(v <= le for v in values) for le in bounds}, "+Inf": len(values)}


def test_the_folded_histograms_hold_every_trace_as_one_at_a_time_would(monkeypatch):
    monkeypatch.setattr(metrics_module, "FOLD_EVERY", 64)  # several folds, and a remainder only a read folds
    rng = random.Random(7)
    decided = [(_breakdown(rng, rng.choice(["push", "pull"])), rng.random() < 0.1) for _ in range(1000)]
    metrics = CollectorMetrics()
    for breakdown, late in decided:
        metrics.trace(breakdown, late)
    registry = metrics.registry  # a read folds what is still queued
    for mode in ("push", "pull"):
        timed = [b for b, _ in decided if b.mode == mode and b.ttft_ns > 0]
        ttfts = [b.ttft_ns / 1e9 for b in timed]
        assert registry.get_sample_value("kvtrace_ttft_seconds_count", {"mode": mode}) == len(ttfts) > 100
        assert abs(registry.get_sample_value("kvtrace_ttft_seconds_sum", {"mode": mode}) - sum(ttfts)) < 1e-6
        for le, count in _expected_buckets(ttfts, TTFT_BUCKETS).items():
            assert registry.get_sample_value("kvtrace_ttft_seconds_bucket", {"mode": mode, "le": le}) == count, le
        for category in semconv.CATEGORY_NAMES:
            parts = [b.parts.get(category, 0) / 1e9 for b in timed]
            labels = {"mode": mode, "category": category}
            for le, count in _expected_buckets(parts, PART_BUCKETS).items():
                assert registry.get_sample_value("kvtrace_ttft_part_seconds_bucket", {**labels, "le": le}) == count
            assert abs(registry.get_sample_value("kvtrace_ttft_part_seconds_sum", labels) - sum(parts)) < 1e-6
        for complete in (True, False):
            assert registry.get_sample_value("kvtrace_collector_traces_total", {
                "mode": mode, "complete": str(complete).lower()}) == \
                sum(b.mode == mode and b.complete == complete for b, _ in decided)
    assert registry.get_sample_value("kvtrace_collector_traces_late_total") == sum(late for _, late in decided)
    assert metrics.counts()["traces_incomplete"] == sum(not b.complete for b, _ in decided)

    metrics.trace(decided[0][0], late=True)  # a scrape naming the series it wants folds too
    restricted = metrics.registry.restricted_registry(["kvtrace_collector_traces_late_total"])
    samples = {sample.name: sample.value for family in restricted.collect() for sample in family.samples}
    assert samples["kvtrace_collector_traces_late_total"] == sum(late for _, late in decided) + 1


def test_a_trace_queued_while_another_thread_reads_is_counted_once(monkeypatch):
    """The pipeline thread queues while scrapes fold on theirs: every trace is counted, none twice."""
    monkeypatch.setattr(metrics_module, "FOLD_EVERY", 7)
    rng = random.Random(3)
    decided = [_breakdown(rng, "push") for _ in range(20_000)]
    metrics = CollectorMetrics()
    done = threading.Event()

    def scrape():
        while not done.is_set():
            metrics.registry.get_sample_value("kvtrace_collector_traces_total", {"mode": "push", "complete": "true"})
            metrics.counts()

    scrapers = [threading.Thread(target=scrape) for _ in range(2)]
    for thread in scrapers:
        thread.start()
    try:
        for breakdown in decided:
            metrics.trace(breakdown, late=True)
    finally:
        done.set()
        for thread in scrapers:
            thread.join()
    registry = metrics.registry
    assert registry.get_sample_value("kvtrace_collector_traces_late_total") == len(decided)
    assert registry.get_sample_value("kvtrace_ttft_seconds_count", {"mode": "push"}) == \
        sum(b.ttft_ns > 0 for b in decided)
    assert sum(registry.get_sample_value("kvtrace_collector_traces_total", {"mode": "push", "complete": c}) or 0
               for c in ("true", "false")) == len(decided)
