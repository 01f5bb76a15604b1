"""The collector's view of a span: a few typed fields decoded once from OTLP, plus the original.

Decoding reads only what assembly, attribution and the store need; the original protobuf
span (and its resource and scope) is kept untouched so it can be stored and forwarded
exactly as it arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace.telemetry import semconv

# Attributes the collector reads; everything else stays in the stored original.
_WANTED = frozenset({
    semconv.ATTR_STAGE, semconv.ATTR_REQUEST_ID, semconv.ATTR_RENDEZVOUS_ORDER,
    semconv.ATTR_ENGINE_LOOP_NS, semconv.ATTR_TRANSFER_BYTES, semconv.ATTR_TRANSFER_POST_US,
    semconv.ATTR_TRANSFER_XFER_US, semconv.ATTR_INPUT_TOKENS, semconv.ATTR_FAILURE_CAUSE,
    "kvtrace.router.ttft_ns",
})
_RESOURCE_WANTED = frozenset({semconv.RES_SERVICE_NAME, semconv.RES_SERVICE_INSTANCE_ID, semconv.RES_ROLE,
                              semconv.RES_MODE})


@dataclass(slots=True)
class SpanRow:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start: int
    end: int
    status: int  # OTLP status code: 0 unset, 1 ok, 2 error
    attrs: dict[str, Any]
    service: str
    instance: str
    role: str
    mode: str
    proto: Any = field(default=None, repr=False)  # the original Span message
    resource: Any = field(default=None, repr=False)  # the original Resource message
    scope: Any = field(default=None, repr=False)  # the original InstrumentationScope

    @property
    def stage(self) -> str:
        return self.attrs.get(semconv.ATTR_STAGE) or self.name

    @property
    def duration(self) -> int:
        return self.end - self.start


def _value(v: Any) -> Any:
    # The wanted attributes are strings or integers: read those fields directly (much cheaper
    # than WhichOneof); an empty string and 0 both mean "not set" to the collector.
    return v.string_value or v.int_value or v.double_value or v.bool_value or None


def row_of(span: Any, service: str, instance: str, role: str, mode: str, resource: Any = None,
           scope: Any = None) -> SpanRow:
    attrs = {a.key: _value(a.value) for a in span.attributes if a.key in _WANTED}
    return SpanRow(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name,
                   span.start_time_unix_nano, span.end_time_unix_nano, span.status.code, attrs,
                   service, instance, role, mode, span, resource, scope)


def decode(request: ExportTraceServiceRequest) -> list[SpanRow]:
    rows: list[SpanRow] = []
    for resource_spans in request.resource_spans:
        resource = resource_spans.resource
        res = {a.key: _value(a.value) for a in resource.attributes if a.key in _RESOURCE_WANTED}
        service = str(res.get(semconv.RES_SERVICE_NAME) or "unknown")
        instance = str(res.get(semconv.RES_SERVICE_INSTANCE_ID) or service)
        role = str(res.get(semconv.RES_ROLE) or "")
        mode = str(res.get(semconv.RES_MODE) or "")
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            for span in scope_spans.spans:
                rows.append(row_of(span, service, instance, role, mode, resource, scope))
    return rows
