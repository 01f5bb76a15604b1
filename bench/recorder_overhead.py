#!/usr/bin/env python3
"""Cost on the calling thread of recording one stage event: kvtrace's recorder vs an inline span.

Both sides do what a connector would do for one stage: read the clock for the end time and
hand over (trace context, stage, start, end, four attributes). kvtrace appends a tuple to its
buffer; the inline side creates, fills and ends an OpenTelemetry SDK span whose processor is
the SDK's BatchSpanProcessor. Both export to the same do-nothing exporter, so only the
calling-thread cost differs. Rounds alternate between the two, and each side's background
work is flushed outside the timed region so neither pays for the other's export.

Targets (issue 2): <= 2 us per event, and >= 20x cheaper than inline.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry

from kvtrace.telemetry import semconv
from kvtrace.telemetry.context import TraceRef, new_span_id, new_trace_id
from kvtrace.telemetry.metrics import KvtraceMetrics
from kvtrace.telemetry.recorder import Recorder
from kvtrace.telemetry.semconv import Stage

TARGET_NS = 2_000
TARGET_RATIO = 20.0


class DiscardExporter(SpanExporter):
    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans):
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


ATTRIBUTES = {
    semconv.ATTR_TRANSFER_BYTES: 2_097_152,
    semconv.ATTR_TRANSFER_DESCRIPTORS: 32,
    semconv.ATTR_BLOCK_COUNT: 16,
    semconv.ATTR_REQUEST_ID: "cmpl-bench-0",
}


def kvtrace_round(recorder: Recorder, refs: list[TraceRef], attrs: dict) -> int:
    record, now = recorder.record, recorder.now
    start = now()
    t0 = time.perf_counter_ns()
    for ref in refs:
        record(ref, Stage.WRITE, start, now(), attrs)
    return time.perf_counter_ns() - t0


def inline_round(tracer, contexts: list, attrs: dict) -> int:
    start = time.time_ns()
    t0 = time.perf_counter_ns()
    for ctx in contexts:
        span = tracer.start_span(semconv.SPAN_KV_WRITE, context=ctx, start_time=start)
        span.set_attributes(attrs)
        span.end()
    return time.perf_counter_ns() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="events per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds per side (default 15)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = parser.parse_args()
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds must be positive")

    resource = Resource.create({"service.name": "bench"})
    kv_exporter, sdk_exporter = DiscardExporter(), DiscardExporter()
    recorder = Recorder(kv_exporter, resource, metrics=KvtraceMetrics("push", "producer", CollectorRegistry()),
                        max_queue_size=max(65_536, args.events))
    provider = TracerProvider(resource=resource)
    # A queue deep enough for a whole round, so the SDK side never drops either.
    processor = BatchSpanProcessor(sdk_exporter, max_queue_size=max(2048, args.events))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("bench")

    refs = [TraceRef(new_trace_id(), new_span_id()) for _ in range(args.events)]
    contexts = [trace.set_span_in_context(NonRecordingSpan(SpanContext(
        r.trace_id, r.span_id, True, TraceFlags(TraceFlags.SAMPLED)))) for r in refs]
    attrs = ATTRIBUTES

    kv_ns, sdk_ns = [], []
    for i in range(args.rounds + 1):  # round 0 warms both paths up and is not counted
        gc.collect()
        kv = kvtrace_round(recorder, refs, attrs) / args.events
        recorder.force_flush()
        gc.collect()
        sdk = inline_round(tracer, contexts, attrs) / args.events
        processor.force_flush()
        if i:
            kv_ns.append(kv)
            sdk_ns.append(sdk)
        if not args.json:
            print(f"\rround {i}/{args.rounds}", end="", file=sys.stderr, flush=True)
    if not args.json:
        print(file=sys.stderr)

    stats = recorder.stats()
    recorder.shutdown()
    provider.shutdown()
    kv_median, sdk_median = statistics.median(kv_ns), statistics.median(sdk_ns)
    ratio = sdk_median / kv_median
    ok = kv_median <= TARGET_NS and ratio >= TARGET_RATIO and stats.dropped == 0
    result = {
        "events_per_round": args.events, "rounds": args.rounds,
        "kvtrace_ns_median": round(kv_median, 1), "kvtrace_ns_min": round(min(kv_ns), 1),
        "inline_sdk_ns_median": round(sdk_median, 1), "inline_sdk_ns_min": round(min(sdk_ns), 1),
        "ratio": round(ratio, 1), "kvtrace_dropped": stats.dropped,
        "kvtrace_spans_exported": kv_exporter.spans, "sdk_spans_exported": sdk_exporter.spans,
        "targets_met": ok,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'per recorded stage event (calling thread)':<44}{'median':>10}{'min':>10}")
        print(f"{'kvtrace Recorder.record':<44}{kv_median:>8.0f}ns{min(kv_ns):>8.0f}ns")
        print(f"{'inline OTel SDK span + BatchSpanProcessor':<44}{sdk_median:>8.0f}ns{min(sdk_ns):>8.0f}ns")
        print(f"ratio inline/kvtrace: {ratio:.1f}x   "
              f"(targets: <= {TARGET_NS} ns, >= {TARGET_RATIO:.0f}x)   dropped: {stats.dropped}")
        print(f"spans exported: kvtrace {kv_exporter.spans}, sdk {sdk_exporter.spans}   "
              f"{'TARGETS MET' if ok else 'TARGETS MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
