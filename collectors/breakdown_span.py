"""The breakdown as spans an APM can show and query: ``kvtrace.breakdown`` (and, optionally, one
``kvtrace.critical`` span per critical-path segment), encoded straight to OTLP protobuf.

The collector adds these to each trace it forwards, so the user's own APM gets what it cannot
compute: TTFT split into parts on clock-corrected times. Names and units are the contract's
(:mod:`kvtrace.telemetry.semconv`, docs/CONTRACT.md).

Encoding is by hand, like :func:`.model.rebuild_request`: a span is a few dozen bytes of wire
format per attribute, and this runs once per forwarded trace on the pipeline thread, where a
protobuf message per attribute would cost several times more.
"""

from __future__ import annotations

import os
import socket
import struct

from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Category

from .breakdown import GAP, Breakdown
from .wire import field, varint

_MS = 1e6
_KIND_INTERNAL = 1
_STATUS_ERROR = 2
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_PARTS = tuple((c.value, semconv.BREAKDOWN_PART_MS[c], semconv.BREAKDOWN_PART_SHARE[c])
               for c in semconv.BREAKDOWN_CATEGORIES)
_ERROR_STATUS = field(15, field(2, b"a span of the trace ended in error") + b"\x18" + varint(_STATUS_ERROR))
_PREFIXES: dict[tuple[str, int], bytes] = {}
_KEY_FIELDS: dict[str, bytes] = {}


def _key_field(key: str) -> bytes:
    """``KeyValue.key``, encoded once per key."""
    encoded = _KEY_FIELDS.get(key)
    if encoded is None:
        encoded = _KEY_FIELDS[key] = field(1, key.encode())
    return encoded


def _prefix(key: str, value_bytes: int) -> bytes:
    """The bytes of a ``Span.attributes`` entry before a value of a fixed size, once per key:
    the entry's tag and length, ``KeyValue.key``, and ``KeyValue.value``'s tag and length."""
    prefix = _PREFIXES.get((key, value_bytes))
    if prefix is None:
        key_field = _key_field(key)
        entry_length = len(key_field) + 2 + value_bytes  # + value's tag and length (< 128)
        prefix = _PREFIXES[key, value_bytes] = (b"\x4a" + varint(entry_length) + key_field + b"\x12"
                                                + varint(value_bytes))
    return prefix


def _double(key: str, value: float) -> bytes:
    return _prefix(key, 9) + b"\x21" + _DOUBLE.pack(value)


def _bool(key: str, value: bool) -> bytes:
    return _prefix(key, 2) + (b"\x10\x01" if value else b"\x10\x00")


def _int(key: str, value: int) -> bytes:
    encoded = varint(value & 0xFFFF_FFFF_FFFF_FFFF)  # int64, two's complement
    return _prefix(key, 1 + len(encoded)) + b"\x18" + encoded


def _cached_string(key: str, value: str) -> bytes:
    """:func:`_string` for the attributes with few distinct values (mode, instances, paths)."""
    entry = _STRINGS.get((key, value))
    if entry is None:
        if len(_STRINGS) >= 4096:  # a value that keeps changing: stop the cache from growing
            _STRINGS.clear()
        entry = _STRINGS[key, value] = _string(key, value)
    return entry


_STRINGS: dict[tuple[str, str], bytes] = {}


def _string(key: str, value: str) -> bytes:
    encoded = value.encode()
    any_value = b"\x0a" + varint(len(encoded)) + encoded
    body = _key_field(key) + b"\x12" + varint(len(any_value)) + any_value
    return b"\x4a" + varint(len(body)) + body


# TTFT and its parts (ms and share) are always the first eleven attributes: one pack for all.
_HEAD_KEYS = (semconv.BREAKDOWN_TTFT_MS, *(key for _, ms, share in _PARTS for key in (ms, share)))
_HEAD = struct.Struct("<" + "".join(f"{len(_prefix(key, 9)) + 1}sd" for key in _HEAD_KEYS))
_HEAD_PREFIXES = tuple(_prefix(key, 9) + b"\x21" for key in _HEAD_KEYS)


_NAMES: dict[str, bytes] = {}
_SPAN_TIMES = struct.Struct("<BBBQBQ")  # kind, then start and end as fixed64 fields


def _span(trace_id: bytes, span_id: bytes, parent: bytes, name: str, start: int, end: int,
          attributes: bytes, status: bytes = b"") -> bytes:
    """One ``ScopeSpans.spans`` entry: ids, name, kind INTERNAL, times, attributes, status."""
    name_field = _NAMES.get(name)
    if name_field is None:
        name_field = _NAMES[name] = field(5, name.encode())
    body = b"".join((b"\x0a\x10", trace_id, b"\x12\x08", span_id, b"\x22\x08" + parent if parent else b"",
                     name_field, _SPAN_TIMES.pack(0x30, _KIND_INTERNAL, 0x39, start, 0x41, end),
                     attributes, status))
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


_PATHS: dict[tuple, bytes] = {}


def _critical_path(stages: tuple, path: str) -> bytes:
    """The critical-path attribute, once per sequence of stages (a few dozen exist)."""
    if len(_PATHS) >= 4096:
        _PATHS.clear()
    entry = _PATHS[stages] = _string(semconv.BREAKDOWN_CRITICAL_PATH, path)
    return entry


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
        values = [ttft / _MS]
        parts = b.parts
        for part, _, _ in _PARTS:
            value = parts.get(part, 0)
            values.append(value / _MS)
            values.append(value / ttft if ttft > 0 else 0.0)
        attrs = [_HEAD.pack(*[item for pair in zip(_HEAD_PREFIXES, values) for item in pair])]
        if b.request_id:
            attrs.append(_string(semconv.BREAKDOWN_REQUEST_ID, b.request_id))
        path = tuple(b.critical_ns)
        attrs.append(_PATHS.get(path) or _critical_path(path, b.critical_path))
        for key, value in ((semconv.BREAKDOWN_MODE, b.mode), (semconv.BREAKDOWN_RUN_ID, b.run_id),
                           (semconv.BREAKDOWN_TTFT_REFERENCE, b.ttft_reference),
                           (semconv.BREAKDOWN_RENDEZVOUS_ORDER, b.rendezvous_order),
                           (semconv.BREAKDOWN_PREFILL_INSTANCE, b.prefill_instance),
                           (semconv.BREAKDOWN_DECODE_INSTANCE, b.decode_instance)):
            if value:  # an empty value is left out, not sent as ""
                attrs.append(_cached_string(key, value))
        if b.missing:
            attrs.append(_cached_string(semconv.BREAKDOWN_MISSING, ",".join(b.missing)))
        if b.explanation:
            attrs.append(_string(semconv.BREAKDOWN_EXPLANATION, b.explanation))
        attrs += [_int(semconv.BREAKDOWN_TRANSFER_BYTES, b.transfer_bytes),
                  _int(semconv.BREAKDOWN_PROMPT_TOKENS, b.prompt_tokens),
                  _bool(semconv.BREAKDOWN_COMPLETE, b.complete),
                  _bool(semconv.BREAKDOWN_ERROR, b.error),
                  _bool(semconv.BREAKDOWN_CLOCK_SUSPECT, b.clock_suspect),
                  _int(semconv.BREAKDOWN_REVISION, revision)]
        for instance, offset_key, bound_key in (
                (b.prefill_instance, semconv.BREAKDOWN_PREFILL_OFFSET_MS, semconv.BREAKDOWN_PREFILL_BOUND_MS),
                (b.decode_instance, semconv.BREAKDOWN_DECODE_OFFSET_MS, semconv.BREAKDOWN_DECODE_BOUND_MS)):
            if instance:
                attrs.append(_double(offset_key, b.offsets_ns.get(instance, 0) / _MS))
                bound = b.clock_bounds_ns.get(instance)
                if bound is not None:
                    attrs.append(_double(bound_key, bound / _MS))
        if revision > 1:
            attrs.append(_string(semconv.BREAKDOWN_SUPERSEDES, breakdown_span_id(trace_id, revision - 1).hex()))
        out = [_span(trace_id, span_id, b.root_span_id, semconv.SPAN_BREAKDOWN, b.start_ns, b.start_ns + ttft,
                     b"".join(attrs), _ERROR_STATUS if b.error else b"")]
        if self.segments:
            for index, ((side, stage), start, end) in enumerate(b.segments):
                category = Category.UNATTRIBUTED.value if (side, stage) == GAP else b.timings[side, stage][2]
                label = category if (side, stage) == GAP else f"{side}.{stage}"
                out.append(_span(trace_id, breakdown_span_id(trace_id, revision, index), span_id,
                                 f"{semconv.SPAN_CRITICAL_SEGMENT} {label}", start, end,
                                 _string(semconv.CRITICAL_SIDE, side) + _string(semconv.ATTR_STAGE, stage)
                                 + _string(semconv.ATTR_CATEGORY, category)))
        return b"".join(out), len(out)

    def request(self, spans: bytes) -> bytes:
        """The encoded spans as one ``ExportTraceServiceRequest.resource_spans`` entry: appended to
        an export request's bytes, they join it (a repeated field's entries just follow each other)."""
        return field(1, self._resource + field(2, self._scope + spans))
