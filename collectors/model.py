"""The collector's data: spans decoded and checked once, at the receiver, with the original kept.

Like the OpenTelemetry Collector's pdata, this is what flows between the collector's parts.
A receiver turns each OTLP export request into a :class:`SpanBatch`: the request's bytes
as they arrived (what the write-ahead log, the store and the forwarder keep and send on,
unchanged) and one :class:`SpanRow` per span with the fields assembly, attribution and the
store read. Decoding reads a span's fields exactly once and checks them on the way; a
span's attributes are read only when something asks for them (attribution needs them on a
few stages of each trace, not on every span).

Where a span was recorded (router, prefill, decode) and which stage it is come from the
resource's ``kvtrace.role`` and the span name, through the contract in
:mod:`kvtrace.telemetry.semconv`; a span outside the contract keeps its ``kvtrace.stage``
attribute, or its name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace.telemetry import semconv

# Timestamps outside [2000-01-01, now + 1 day] are treated as corrupt, not as data.
MIN_TIME_NS = 946_684_800 * 10**9
FUTURE_SLACK_NS = 86_400 * 10**9
_NO_TRACE, _NO_SPAN = bytes(16), bytes(8)

_STAGE_OF = {(side.value, name): semconv.STAGE_LABELS[stage]
             for (side, name), stage in semconv.STAGE_OF_SPAN.items()}
SIDE_OF_ROLE = {role.value: side.value for role, side in semconv.ROLE_SIDES.items()}
"""``kvtrace.role`` -> side; an instance with another role is its own side, named by its service."""
# The span attributes the collector reads; the rest stay in the original, unread.
WANTED_ATTRIBUTES = frozenset({semconv.ATTR_STAGE, semconv.ATTR_REQUEST_ID, *semconv.DETAIL_ATTRIBUTES})
_RESOURCE_KEYS = frozenset({semconv.RES_SERVICE_NAME, semconv.RES_SERVICE_INSTANCE_ID, semconv.RES_ROLE,
                            semconv.RES_MODE})


class PermanentError(ValueError):
    """The data is wrong and retrying will not help (Collector: ``consumererror.NewPermanent``)."""


def value_of(v: Any) -> Any:
    """An OTLP ``AnyValue`` as Python, for the scalar kinds kvtrace reads.

    Reads the fields directly (much cheaper than ``WhichOneof``); an empty string, 0 and
    false all mean "not set" to the collector.
    """
    return v.string_value or v.int_value or v.double_value or v.bool_value or None


@dataclass(frozen=True, slots=True)
class Origin:
    """Who recorded a span: read once per resource, shared by its spans."""

    service: str
    instance: str
    role: str
    mode: str
    side: str  # router / prefill / decode, or the service name outside the contract
    resource: Any = None  # the original Resource message

    @classmethod
    def of(cls, resource: Any) -> "Origin":
        res = {a.key: value_of(a.value) for a in resource.attributes if a.key in _RESOURCE_KEYS}
        service = str(res.get(semconv.RES_SERVICE_NAME) or "unknown")
        role = str(res.get(semconv.RES_ROLE) or "")
        return cls(service, str(res.get(semconv.RES_SERVICE_INSTANCE_ID) or service), role,
                   str(res.get(semconv.RES_MODE) or ""), SIDE_OF_ROLE.get(role, service), resource)


class SpanRow:
    """One span: ids as hex, times in ns on its sender's clock, OTLP status code (0 unset,
    1 ok, 2 error), its :class:`Origin`, and the original ``Span`` and ``InstrumentationScope``."""

    __slots__ = ("trace_id", "span_id", "parent_span_id", "name", "start", "end", "status", "origin",
                 "stage", "proto", "scope", "_attrs")

    def __init__(self, trace_id: str, span_id: str, parent_span_id: str, name: str, start: int, end: int,
                 status: int, origin: Origin, proto: Any = None, scope: Any = None,
                 attrs: dict[str, Any] | None = None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.name = name
        self.start = start
        self.end = end
        self.status = status
        self.origin = origin
        self.proto = proto
        self.scope = scope
        self._attrs = attrs
        # Contract spans: from (side, name). Others: their kvtrace.stage, or their name.
        self.stage = _STAGE_OF.get((origin.side, name)) or self.attrs.get(semconv.ATTR_STAGE) or name

    @property
    def attrs(self) -> dict[str, Any]:
        """The span's attributes in :data:`WANTED_ATTRIBUTES`, read from the original on first use."""
        if self._attrs is None:
            self._attrs = {} if self.proto is None else \
                {a.key: value_of(a.value) for a in self.proto.attributes if a.key in WANTED_ATTRIBUTES}
        return self._attrs

    @property
    def side(self) -> str:
        return self.origin.side

    @property
    def instance(self) -> str:
        return self.origin.instance

    @property
    def mode(self) -> str:
        return self.origin.mode

    @property
    def duration(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"SpanRow({self.side}:{self.stage} {self.trace_id}/{self.span_id} {self.start}..{self.end})"


@dataclass(slots=True)
class SpanBatch:
    """One export request: its decoded spans, the parsed message and the bytes as received."""

    rows: list[SpanRow]
    request: ExportTraceServiceRequest
    payload: bytes

    @classmethod
    def of(cls, request: ExportTraceServiceRequest, payload: bytes | None = None) -> "SpanBatch":
        """Decode and check ``request``; raises :class:`PermanentError` naming the first bad span."""
        return cls(decode(request), request, request.SerializeToString() if payload is None else payload)


def decode(request: ExportTraceServiceRequest) -> list[SpanRow]:
    """Every span of ``request``, in order; raises :class:`PermanentError` on a bad id or time."""
    latest = time.time_ns() + FUTURE_SLACK_NS
    rows: list[SpanRow] = []
    append = rows.append
    for resource_spans in request.resource_spans:
        origin = Origin.of(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            for span in scope_spans.spans:
                trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                if (len(trace_id) != 16 or trace_id == _NO_TRACE or len(span_id) != 8 or span_id == _NO_SPAN
                        or (parent and len(parent) != 8) or not MIN_TIME_NS <= start <= end <= latest):
                    raise PermanentError(_problem(span, latest))
                append(SpanRow(trace_id.hex(), span_id.hex(), parent.hex(), span.name, start, end,
                               span.status.code, origin, span, scope))
    return rows


def _problem(span: Any, latest: int) -> str:
    """What is wrong with a span that failed the check in :func:`decode`."""
    if len(span.trace_id) != 16 or span.trace_id == _NO_TRACE:
        return f"span {span.name!r}: trace_id must be 16 non-zero bytes"
    if len(span.span_id) != 8 or span.span_id == _NO_SPAN:
        return f"span {span.name!r}: span_id must be 8 non-zero bytes"
    if span.parent_span_id and len(span.parent_span_id) != 8:
        return f"span {span.name!r}: parent_span_id must be 8 bytes"
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if not (MIN_TIME_NS <= start <= latest and MIN_TIME_NS <= end <= latest):
        return f"span {span.name!r}: timestamp out of range"
    return f"span {span.name!r}: ends before it starts"
