"""What an upstream APM receives from a forwarding collector, and the store's rows to hold it to.

``Sink`` is the consumer of an OTLP receiver standing in for (or behind) the APM: the spans as
received by span id, and the collector's own breakdown and critical-path spans apart.
``store_breakdowns`` reads the store's ``requests`` rows as the breakdown attributes they must
equal; ``assert_breakdown_matches`` compares one span's attributes with one row.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from kvtrace.telemetry import semconv

S = semconv
STRING_COLUMNS = {S.BREAKDOWN_MODE: "mode", S.BREAKDOWN_RUN_ID: "run_id", S.BREAKDOWN_REQUEST_ID: "request_id",
                  S.BREAKDOWN_RENDEZVOUS_ORDER: "rendezvous_order", S.BREAKDOWN_MISSING: "missing",
                  S.BREAKDOWN_PREFILL_INSTANCE: "prefill_instance", S.BREAKDOWN_DECODE_INSTANCE: "decode_instance"}
EXACT_COLUMNS = {S.BREAKDOWN_TTFT_MS: "ttft_ms", **{S.BREAKDOWN_PART_MS[c]: f"{c.value}_ms" for c in S.BREAKDOWN_CATEGORIES},
                 S.BREAKDOWN_TRANSFER_BYTES: "transfer_bytes", S.BREAKDOWN_PROMPT_TOKENS: "prompt_tokens",
                 S.BREAKDOWN_COMPLETE: "complete", S.BREAKDOWN_ERROR: "error",
                 S.BREAKDOWN_CLOCK_SUSPECT: "clock_suspect",
                 # absent where the trace has no span from that side
                 S.BREAKDOWN_PREFILL_OFFSET_MS: "CASE WHEN prefill_instance <> '' THEN "
                                                "coalesce(clock_offsets[prefill_instance], 0) / 1e6 END",
                 S.BREAKDOWN_DECODE_OFFSET_MS: "CASE WHEN decode_instance <> '' THEN "
                                               "coalesce(clock_offsets[decode_instance], 0) / 1e6 END",
                 S.BREAKDOWN_PREFILL_BOUND_MS: "clock_bounds[prefill_instance] / 1e6",
                 S.BREAKDOWN_DECODE_BOUND_MS: "clock_bounds[decode_instance] / 1e6"}
CRITICAL_STAGES = ("(SELECT list(side || ':' || stage ORDER BY side, stage) FROM stages s "
                   "WHERE s.trace_id = r.trace_id AND s.critical_ms > 0)")


def store_breakdowns(query: Callable[[str], list[tuple]]) -> dict[str, dict[str, Any]]:
    """Per trace id (hex), the store's row as breakdown attributes (None: the attribute is absent),
    with ``critical stages``: the stages the store gives critical time to, sorted."""
    keys = [*STRING_COLUMNS, *EXACT_COLUMNS]
    columns = [f"nullif({c}, '')" for c in STRING_COLUMNS.values()] + list(EXACT_COLUMNS.values())
    rows = query(f"SELECT trace_id, {', '.join(columns)}, {CRITICAL_STAGES} FROM requests r")
    out = {}
    for trace_id, *values, critical in rows:
        out[trace_id] = {**dict(zip(keys, values)), "critical stages": list(critical or [])}
    return out


def attributes(span: Any) -> dict[str, Any]:
    """An OTLP span's attributes as Python values."""
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def assert_breakdown_matches(attrs: dict[str, Any], row: dict[str, Any]) -> None:
    """Every attribute the store has a column for equals that column; shares are the parts over
    TTFT; the critical path names the stages the store gives critical time to."""
    for key in [*STRING_COLUMNS, *EXACT_COLUMNS]:
        assert attrs.get(key) == row[key], (key, attrs.get(key), row[key])
    for category in S.BREAKDOWN_CATEGORIES:
        share = row[S.BREAKDOWN_PART_MS[category]] / row[S.BREAKDOWN_TTFT_MS] if row[S.BREAKDOWN_TTFT_MS] else 0
        assert math.isclose(attrs[S.BREAKDOWN_PART_SHARE[category]], share, rel_tol=1e-12, abs_tol=1e-15)
    assert sorted(attrs[S.BREAKDOWN_CRITICAL_PATH].split(">")) == row["critical stages"]


class Sink:
    """An OTLP receiver's consumer: spans by span id (bytes, resource, scope name), the
    collector's breakdown spans and critical-path segments apart."""

    def __init__(self) -> None:
        self.spans: dict[str, tuple] = {}
        self.breakdowns: list[Any] = []
        self.segments: list[Any] = []
        self.lock = threading.Lock()

    def __call__(self, batch: Any) -> None:
        with self.lock:
            for span, resource, scope in _spans_of([batch.request]):
                if span.name == S.SPAN_BREAKDOWN:
                    self.breakdowns.append(span)
                elif span.name.startswith(S.SPAN_CRITICAL_SEGMENT + " "):
                    self.segments.append(span)
                else:
                    self.spans[span.span_id.hex()] = (span.SerializeToString(), resource, scope)

    def breakdowns_by_trace(self) -> dict[str, list[Any]]:
        with self.lock:
            out: dict[str, list[Any]] = {}
            for span in self.breakdowns:
                out.setdefault(span.trace_id.hex(), []).append(span)
            return out


def sent_spans(builts: list) -> dict[str, tuple]:
    """The spans of built traces as :class:`Sink` keeps them."""
    requests = [request for built in builts for request in built.requests]
    return {span.span_id.hex(): (span.SerializeToString(), resource, scope)
            for span, resource, scope in _spans_of(requests)}


def _spans_of(requests: list) -> Any:
    """Each span of these export requests, with its resource's attributes (as bytes) and scope name."""
    for request in requests:
        for rs in request.resource_spans:
            resource = {a.key: a.value.SerializeToString() for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    yield span, resource, ss.scope.name
