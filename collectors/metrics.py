"""Prometheus metrics of the collector: what the attribution found, and how the collector fares.

Attribution: ``kvtrace_ttft_seconds{mode}`` and ``kvtrace_ttft_part_seconds{mode,category}``
(each request's TTFT and its split on the critical path). The collector itself: spans and
export requests in (their ratio says how well senders batch), requests refused (busy, bad data),
traces decided / incomplete / late, and per upstream the spans forwarded, failed attempts,
batches dropped and backlog — the last group read from the forwarders' own counters when
scraped, so forwarding costs nothing extra per span.

The attribution histograms take six values a trace; they are plain bucket counts rendered at
scrape time (:class:`_Histogram`), because ``prometheus_client.Histogram.observe`` (a lock and a
walk over every bucket per value) cost more per trace than attributing it. The pipeline thread
only queues each decided trace (:meth:`CollectorMetrics.trace`); the queue is folded into the
counts :data:`FOLD_EVERY` traces at a time, a sorted batch per series, and before every read
(a scrape, the health rows), so what is read is always whole: 3.0 -> ~1 µs a trace.
"""

from __future__ import annotations

import bisect
import collections
import threading
from operator import attrgetter, methodcaller
from typing import Any

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvtrace.telemetry import semconv

from .breakdown import Breakdown

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PART_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FOLD_EVERY = 1024
"""Decided traces queued before the pipeline thread folds them into the counts (a read folds the rest)."""
_MODE_AND_COMPLETE = attrgetter("mode", "complete")
_PART_OF = {category: methodcaller("get", category, 0) for category in semconv.CATEGORY_NAMES}


class _FoldingRegistry(CollectorRegistry):
    """A registry that folds the queued traces into the counts before each collection."""

    def __init__(self, fold) -> None:
        super().__init__()
        self._fold = fold

    def collect(self):
        self._fold()
        yield from super().collect()

    def restricted_registry(self, names):  # a scrape that names the series it wants (``?name[]=...``)
        self._fold()
        return super().restricted_registry(names)


class CollectorMetrics:
    def __init__(self) -> None:
        self.registry = _FoldingRegistry(self.fold)
        r = self.registry
        self._spans = Counter("kvtrace_collector_spans_received_total", "Spans accepted.", registry=r)
        self._requests = Counter(
            "kvtrace_collector_export_requests_total",
            "Export requests accepted (OTLP calls; in fleet mode, Kafka messages). Spans per request is "
            "spans_received_total over this: each request costs the receiver a fixed share of CPU.", registry=r)
        self._rejected = Counter("kvtrace_collector_requests_rejected_total",
                                 "Export requests refused or failed, by reason.", ("reason",), registry=r)
        self._traces = Counter("kvtrace_collector_traces_total", "Traces decided, by mode and completeness.",
                               ("mode", "complete"), registry=r)
        self._late = Counter("kvtrace_collector_traces_late_total",
                             "Traces decided again because spans arrived after the decision.", registry=r)
        self._ttft = _Histogram("kvtrace_ttft_seconds", "Time to first token seen by the router.", ("mode",),
                                TTFT_BUCKETS)
        self._parts = _Histogram("kvtrace_ttft_part_seconds", "Each category's share of one request's TTFT.",
                                 ("mode", "category"), PART_BUCKETS)
        r.register(self._ttft)
        r.register(self._parts)
        self._counts = {"spans_received": 0, "requests_rejected": 0, "traces_incomplete": 0}
        self._trace_counters: dict[tuple[str, bool], Any] = {}  # (mode, complete) -> its child of _traces
        # (breakdown, late) of each decided trace not yet counted. Appended on the pipeline thread and taken off
        # by whichever thread folds (a deque's append and popleft are atomic: none is lost).
        self._decided: collections.deque[tuple[Breakdown, bool]] = collections.deque()
        self._folding = threading.Lock()  # one fold at a time: counts are read-modify-written

    def watch(self, collector: Any) -> None:
        """Expose the forwarders' and assembler's own counters at scrape time."""
        self.registry.register(_Live(collector))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def counts(self) -> dict[str, int]:
        """Spans received, requests rejected and incomplete traces so far (for the store's health rows)."""
        self.fold()
        return dict(self._counts)

    def received(self, spans: int) -> None:
        """One export request of ``spans`` spans accepted."""
        self._requests.inc()
        self._spans.inc(spans)
        self._counts["spans_received"] += spans

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()
        self._counts["requests_rejected"] += 1

    def trace(self, breakdown: Breakdown, late: bool) -> None:
        """One decided trace, queued (on the pipeline thread: this is all it costs there but every
        :data:`FOLD_EVERY`-th trace's fold)."""
        self._decided.append((breakdown, late))
        if len(self._decided) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """The queued traces into the counters and histograms."""
        with self._folding:
            queued = self._decided
            taken = [queued.popleft() for _ in range(len(queued))]
            if not taken:
                return
            decided = [breakdown for breakdown, _ in taken]
            late = sum(late for _, late in taken)
            if late:
                self._late.inc(late)
            by_key = collections.Counter(map(_MODE_AND_COMPLETE, decided))
            by_mode: dict[str, list[Breakdown]] = {}
            for (mode, complete), n in by_key.items():
                counter = self._trace_counters.get((mode, complete))
                if counter is None:  # labels() takes a lock and builds the series' key: once per series
                    counter = self._trace_counters[(mode, complete)] = self._traces.labels(mode, str(complete).lower())
                counter.inc(n)
                if not complete:
                    self._counts["traces_incomplete"] += n
                by_mode[mode] = []
            for b in decided:
                if b.ttft_ns > 0:
                    by_mode[b.mode].append(b)
            for mode, observed in by_mode.items():
                if not observed:
                    continue
                self._ttft.observe_all((mode,), [b.ttft_ns / 1e9 for b in observed])
                parts = [b.parts for b in observed]
                for category, part_of in _PART_OF.items():
                    self._parts.observe_all((mode, category), [ns / 1e9 for ns in map(part_of, parts)])


class _Histogram:
    """A labelled Prometheus histogram kept as per-bucket counts; a registry collector.

    Observed by one fold at a time (:meth:`CollectorMetrics.fold`); a scrape reads a copy of the counts, so its
    ``_count`` always equals its ``+Inf`` bucket.
    """

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]):
        self._name = name
        self._documentation = documentation
        self._labelnames = list(labelnames)
        self._bounds = list(buckets)
        self._series: dict[tuple[str, ...], list] = {}  # labels -> [counts per bucket, +Inf last; sum]

    def observe_all(self, labels: tuple[str, ...], values: list[float]) -> None:
        """Each of ``values`` into its bucket (the first whose le >= it), sorted first: one bisection per bucket
        rather than one per value."""
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [[0] * (len(self._bounds) + 1), 0.0]
        counts = series[0]
        series[1] += sum(values)
        values.sort()
        below = 0  # values in the buckets so far
        for i, bound in enumerate(self._bounds):
            upto = bisect.bisect_right(values, bound, below)
            counts[i] += upto - below
            below = upto
        counts[-1] += len(values) - below

    def collect(self):
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for labels, (counts, total) in list(self._series.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*map(floatToGoString, self._bounds), "+Inf"], list(counts)):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(labels), buckets, total)
        yield family


class _Live:
    def __init__(self, collector: Any) -> None:
        self._collector = collector

    def collect(self):
        forwarded = CounterMetricFamily("kvtrace_collector_forwarded_spans", "Spans sent upstream.",
                                        labels=["upstream"])
        failures = CounterMetricFamily("kvtrace_collector_forward_failures", "Failed forward attempts.",
                                       labels=["upstream"])
        dropped = CounterMetricFamily("kvtrace_collector_forward_dropped", "Batches given up on.",
                                      labels=["upstream"])
        backlog = GaugeMetricFamily("kvtrace_collector_forward_backlog", "Batches waiting.", labels=["upstream"])
        for upstream in self._collector.upstreams:
            forwarded.add_metric([upstream.url], upstream.stats.forwarded_spans)
            failures.add_metric([upstream.url], upstream.stats.failures)
            dropped.add_metric([upstream.url], upstream.stats.dropped)
            backlog.add_metric([upstream.url], upstream.backlog())
        stats = self._collector.assembler.stats
        pending = GaugeMetricFamily("kvtrace_collector_traces_pending", "Traces waiting for their decision.",
                                    value=self._collector.assembler.pending())
        evicted = CounterMetricFamily("kvtrace_collector_traces_evicted", "Traces decided early (memory bound).",
                                      value=stats.traces_evicted)
        duplicates = CounterMetricFamily("kvtrace_collector_duplicate_spans", "Spans received twice.",
                                         value=stats.duplicate_spans)
        lost = CounterMetricFamily("kvtrace_collector_decisions_dropped",
                                   "Breakdowns the store could not take, dropped (their spans are stored).",
                                   value=self._collector.store.dropped_decisions)
        yield from (forwarded, failures, dropped, backlog, pending, evicted, duplicates, lost)
