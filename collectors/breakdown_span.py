"""The breakdown as spans an APM can show and query: ``kvtrace.breakdown`` (and, optionally, one
``kvtrace.critical`` span per critical-path segment), encoded straight to OTLP protobuf.

The collector adds these to each trace it forwards, so the user's own APM gets what it cannot
compute: TTFT split into parts on clock-corrected times. Names and units are the contract's
(:mod:`kvtrace.telemetry.semconv`, docs/CONTRACT.md).

Encoding is by hand, like :func:`.model.rebuild_request`: a span is a few dozen bytes of wire
format per attribute, and this runs once per forwarded trace on the pipeline thread, where a
protobuf message per attribute would cost several times more. The attributes are one call of
:func:`.wire.attributes` (native where the extension is built: ~5 µs per trace less than
encoding them one by one in Python).
"""

from __future__ import annotations

import os
import socket
import struct

from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Category

from .breakdown import GAP, Breakdown
from .wire import attributes, field, varint

_MS = 1e6
_KIND_INTERNAL = 1
_STATUS_ERROR = 2
_FIXED64 = struct.Struct("<Q")
_PARTS = tuple((c.value, semconv.BREAKDOWN_PART_MS[c], semconv.BREAKDOWN_PART_SHARE[c])
               for c in semconv.BREAKDOWN_CATEGORIES)
_ERROR_STATUS = field(15, field(2, b"a span of the trace ended in error") + b"\x18" + varint(_STATUS_ERROR))

# The breakdown span's attributes, in the order they are written; BreakdownSpans.encode gives a
# value (None: left out) for each, and wire.attributes encodes them in one call.
_ATTRIBUTE_KEYS = (
    semconv.BREAKDOWN_TTFT_MS, *(key for _, ms, share in _PARTS for key in (ms, share)),
    semconv.BREAKDOWN_REQUEST_ID, semconv.BREAKDOWN_CRITICAL_PATH, semconv.BREAKDOWN_MODE,
    semconv.BREAKDOWN_RUN_ID, semconv.BREAKDOWN_TTFT_REFERENCE, semconv.BREAKDOWN_RENDEZVOUS_ORDER,
    semconv.BREAKDOWN_PREFILL_INSTANCE, semconv.BREAKDOWN_DECODE_INSTANCE, semconv.BREAKDOWN_MISSING,
    semconv.BREAKDOWN_EXPLANATION, semconv.BREAKDOWN_TRANSFER_BYTES, semconv.BREAKDOWN_PROMPT_TOKENS,
    semconv.BREAKDOWN_COMPLETE, semconv.BREAKDOWN_ERROR, semconv.BREAKDOWN_CLOCK_SUSPECT,
    semconv.BREAKDOWN_REVISION, semconv.BREAKDOWN_PREFILL_OFFSET_MS, semconv.BREAKDOWN_PREFILL_BOUND_MS,
    semconv.BREAKDOWN_DECODE_OFFSET_MS, semconv.BREAKDOWN_DECODE_BOUND_MS, semconv.BREAKDOWN_SUPERSEDES,
)
_SEGMENT_KEYS = (semconv.CRITICAL_SIDE, semconv.ATTR_STAGE, semconv.ATTR_CATEGORY)


_NAMES: dict[str, bytes] = {}
_SPAN_TIMES = struct.Struct("<BBBQBQ")  # kind, then start and end as fixed64 fields


def _span(trace_id: bytes, span_id: bytes, parent: bytes, name: str, start: int, end: int,
          attrs: bytes, status: bytes = b"") -> bytes:
    """One ``ScopeSpans.spans`` entry: ids, name, kind INTERNAL, times, attributes, status."""
    name_field = _NAMES.get(name)
    if name_field is None:
        name_field = _NAMES[name] = field(5, name.encode())
    body = b"".join((b"\x0a\x10", trace_id, b"\x12\x08", span_id, b"\x22\x08" + parent if parent else b"",
                     name_field, _SPAN_TIMES.pack(0x30, _KIND_INTERNAL, 0x39, start, 0x41, end),
                     attrs, status))
    return b"\x12" + varint(len(body)) + body


_GOLDEN = 0x9E37_79B9_7F4A_7C15  # spreads small numbers over 64 bits
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
_TWO_HALVES = struct.Struct("<QQ")


def breakdown_span_id(trace_id: bytes, revision: int, segment: int = -1) -> bytes:
    """The span id of a trace's breakdown span of one revision (or of one of its segments):
    derived, so a later revision can name the span it supersedes without remembering it. The
    trace id's random bits make it as unlikely to meet another span's id as a random one."""
    low, high = _TWO_HALVES.unpack(trace_id)
    value = (low ^ high ^ (revision * _GOLDEN) ^ ((segment + 2) * _GOLDEN >> 7)) & _MASK64
    return _FIXED64.pack(value or 1)


_PATHS: dict[tuple, str] = {}


def _critical_path(b: Breakdown) -> str:
    """``b.critical_path``, built once per sequence of stages (a few dozen exist)."""
    stages = tuple(b.critical_ns)
    path = _PATHS.get(stages)
    if path is None:
        if len(_PATHS) >= 4096:
            _PATHS.clear()
        path = _PATHS[stages] = b.critical_path
    return path


class BreakdownSpans:
    """Encodes the breakdown spans of decided traces, under the collector's own resource."""

    def __init__(self, *, segments: bool = False, version: str = "") -> None:
        self.segments = segments
        instance = f"{socket.gethostname()}-{os.getpid()}-kvtrace-collector"
        self._resource = field(1, b"".join(  # ResourceSpans.resource: its attributes are field 1
            field(1, field(1, key.encode()) + field(2, field(1, value.encode())))
            for key, value in ((semconv.RES_SERVICE_NAME, "kvtrace-collector"),
                               (semconv.RES_SERVICE_INSTANCE_ID, instance))))
        scope = field(1, b"kvtrace.collector") + (field(2, version.encode()) if version else b"")
        self._scope = field(1, scope)

    def encode(self, trace_id: bytes, b: Breakdown, revision: int) -> tuple[bytes, int]:
        """(the trace's breakdown span and, with ``segments``, its critical-path spans, as
        ``ScopeSpans.spans`` entries; how many spans)."""
        span_id = breakdown_span_id(trace_id, revision)
        ttft = b.ttft_ns
        values: list = [ttft / _MS]
        parts = b.parts
        for part, _, _ in _PARTS:
            value = parts.get(part, 0)
            values.append(value / _MS)
            values.append(value / ttft if ttft > 0 else 0.0)
        values += (b.request_id or None, _critical_path(b),  # an empty value is left out, not sent as ""
                   b.mode or None, b.run_id or None, b.ttft_reference or None, b.rendezvous_order or None,
                   b.prefill_instance or None, b.decode_instance or None,
                   ",".join(b.missing) if b.missing else None, b.explanation or None,
                   b.transfer_bytes, b.prompt_tokens, b.complete, b.error, b.clock_suspect, revision)
        for instance in (b.prefill_instance, b.decode_instance):
            if instance:
                bound = b.clock_bounds_ns.get(instance)
                values += (b.offsets_ns.get(instance, 0) / _MS, bound / _MS if bound is not None else None)
            else:
                values += (None, None)
        values.append(breakdown_span_id(trace_id, revision - 1).hex() if revision > 1 else None)
        out = [_span(trace_id, span_id, b.root_span_id, semconv.SPAN_BREAKDOWN, b.start_ns, b.start_ns + ttft,
                     attributes(_ATTRIBUTE_KEYS, values), _ERROR_STATUS if b.error else b"")]
        if self.segments:
            for index, ((side, stage), start, end) in enumerate(b.segments):
                category = Category.UNATTRIBUTED.value if (side, stage) == GAP else b.timings[side, stage][2]
                label = category if (side, stage) == GAP else f"{side}.{stage}"
                out.append(_span(trace_id, breakdown_span_id(trace_id, revision, index), span_id,
                                 f"{semconv.SPAN_CRITICAL_SEGMENT} {label}", start, end,
                                 attributes(_SEGMENT_KEYS, (side, stage, category))))
        return b"".join(out), len(out)

    def request(self, spans: list[bytes]) -> bytes:
        """The encoded spans (each what :meth:`encode` gave) as one ``ExportTraceServiceRequest.resource_spans``
        entry: appended to an export request's bytes, they join it (a repeated field's entries just follow
        each other). Written in one join: a batch is ~0.75 MB, and each ``field()`` around it copied it once
        more into fresh memory (1.85 against 0.08 µs a breakdown span, 512 a batch)."""
        size = len(self._scope) + sum(map(len, spans))
        scope_spans = b"\x12" + varint(size)  # ResourceSpans.scope_spans (field 2): its tag and length
        return b"".join((b"\x0a", varint(len(self._resource) + len(scope_spans) + size),  # resource_spans (1)
                         self._resource, scope_spans, self._scope, *spans))
