"""The collector's data: spans decoded and checked once, at the receiver, with the original kept.

Like the OpenTelemetry Collector's pdata, this is what flows between the collector's parts.
A receiver turns each OTLP export request into a :class:`SpanBatch`: the request's bytes
as they arrived (what the write-ahead log, the archive and the forwarder keep and send on,
unchanged), one :class:`SpanRow` per span with the fields assembly and attribution read, and
the same spans as :class:`SpanColumns`, packed for the store's Arrow tables. Decoding reads
each span once, checks its ids and times on the way, and reads only the attributes the
collector uses (:data:`WANTED_ATTRIBUTES`); the rest stay in the original bytes.

Decoding is native (``_otlp.c``, reading the protobuf wire format straight into rows and
columns, ~7x faster) where the extension is built, and :func:`decode_python` (the official
``opentelemetry-proto`` messages) otherwise; the tests hold the two to the same output.

Where a span was recorded (router, prefill, decode) and which stage it is come from the
resource's ``kvtrace.role`` and the span name, through the contract in
:mod:`kvtrace.telemetry.semconv`; a span outside the contract keeps its ``kvtrace.stage``
attribute, or its name.
"""

from __future__ import annotations

import array
import math
import sys
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NamedTuple

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from kvtrace.telemetry import semconv

from .wire import field
from .wire import native as _otlp  # None without a C compiler (or with KVTRACE_PURE_PYTHON): decode_python

DECODER = "native" if _otlp is not None else "python"
"""Which decoder this process uses (the collector warns at start when it is the Python one)."""

# Timestamps outside [2000-01-01, now + 1 day] are treated as corrupt, not as data
# (_otlp.c has the same lower bound; the tests hold the two decoders to the same answers).
MIN_TIME_NS = 946_684_800 * 10**9
FUTURE_SLACK_NS = 86_400 * 10**9
_NO_TRACE, _NO_SPAN = bytes(16), bytes(8)

# Per side, span name -> stage: the contract's spans. A side outside it has none.
_STAGES_OF_SIDE: dict[str, dict[str, str]] = {}
for (_side, _name), _stage in semconv.STAGE_OF_SPAN.items():
    _STAGES_OF_SIDE.setdefault(_side.value, {})[_name] = semconv.STAGE_LABELS[_stage]
_NO_STAGES: dict[str, str] = {}
# The span attributes the collector reads; the rest stay in the original, unread.
WANTED_ATTRIBUTES = frozenset({semconv.ATTR_STAGE, semconv.ATTR_REQUEST_ID, semconv.ATTR_FAILURE_CAUSE,
                               *semconv.DETAIL_ATTRIBUTES,
                               *semconv.CLIENT_ATTRIBUTES, semconv.RUN_CONFIG, semconv.VLLM_TIME_TO_FIRST_TOKEN})
_RESOURCE_KEYS = frozenset({semconv.RES_SERVICE_NAME, semconv.RES_SERVICE_INSTANCE_ID, semconv.RES_ROLE,
                            semconv.RES_MODE, semconv.RES_RUN_ID, semconv.RES_HOST_NAME,
                            semconv.RES_VLLM_VERSION, semconv.RES_NIXL_VERSION, semconv.RES_HARDWARE,
                            semconv.RES_CONTRACT_VERSION})
_SPAN_KEYS_BYTES = {sys.intern(k).encode(): sys.intern(k) for k in WANTED_ATTRIBUTES}
_RESOURCE_KEYS_BYTES = {sys.intern(k).encode(): sys.intern(k) for k in _RESOURCE_KEYS}


class PermanentError(ValueError):
    """The data is wrong and retrying will not help (Collector: ``consumererror.NewPermanent``)."""


INT32_MAX: Final = 2**31 - 1
INT64_MAX: Final = 2**63 - 1


def whole_number(value: Any, limit: int = INT64_MAX) -> int | None:
    """A count, size or time a sender put in an attribute, as a whole number in [0, ``limit``]; None for
    anything else (a string that is no number, NaN, a negative or too large value, a bool). One sender's bad
    value then costs its trace that detail, not the trace's breakdown, and never the store a column's type
    (a value past a column's range failed every later flush)."""
    if type(value) is int:
        return value if 0 <= value <= limit else None
    if type(value) is float:
        return int(value) if math.isfinite(value) and 0 <= value <= limit else None
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            return None
        return number if 0 <= number <= limit else None
    return None


def finite_number(value: Any) -> float | None:
    """A sender's attribute as a finite float; None for anything else (a word, NaN, infinity)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def value_of(v: Any) -> Any:
    """An OTLP ``AnyValue`` as Python, for the scalar kinds kvtrace reads.

    Reads the fields directly (much cheaper than ``WhichOneof``); an empty string, 0 and
    false all mean "not set" to the collector.
    """
    return v.string_value or v.int_value or v.double_value or v.bool_value or None


@dataclass(frozen=True, slots=True, eq=False)
class Origin:
    """Who recorded a span: read once per resource, shared by its spans."""

    service: str
    instance: str
    role: str
    mode: str
    side: str  # router / prefill / decode, or the service name outside the contract
    stages: dict[str, str]  # span name -> stage, for this side's contract spans
    resource: bytes = b""  # the original Resource message
    run_id: str = ""  # the experiment run it serves (kvtrace.run.id), if any
    host: str = ""  # host.name: processes on one host share one clock
    vllm_version: str = ""  # what the sender runs: run records show the engines'
    nixl_version: str = ""
    hardware: str = ""
    contract: int = 0  # the contract version it records (kvtrace.contract.version); 0: not said

    @classmethod
    def of(cls, attributes: dict[str, Any], resource: bytes = b"") -> "Origin":
        """From the resource's attributes (those in ``_RESOURCE_KEYS``) and its bytes."""
        service = str(attributes.get(semconv.RES_SERVICE_NAME) or "unknown")
        role = str(attributes.get(semconv.RES_ROLE) or "")
        side = semconv.SIDE_OF_ROLE.get(role, service)  # another role: its own side, named by its service
        return cls(service, str(attributes.get(semconv.RES_SERVICE_INSTANCE_ID) or service), role,
                   str(attributes.get(semconv.RES_MODE) or ""), side, _STAGES_OF_SIDE.get(side, _NO_STAGES),
                   resource, str(attributes.get(semconv.RES_RUN_ID) or ""),
                   str(attributes.get(semconv.RES_HOST_NAME) or ""),
                   str(attributes.get(semconv.RES_VLLM_VERSION) or ""),
                   str(attributes.get(semconv.RES_NIXL_VERSION) or ""),
                   str(attributes.get(semconv.RES_HARDWARE) or ""),
                   _int(attributes.get(semconv.RES_CONTRACT_VERSION)))


ORIGINS_KEPT = 4096
"""How many senders' Origins :func:`origin_of` keeps (emptied when full: a fleet's engines fit many times)."""
_origins: dict[bytes, Origin] = {}


def origin_of(attributes: dict[str, Any], resource: bytes) -> Origin:
    """:meth:`Origin.of`, once per distinct ``Resource``: a sender repeats the same resource bytes in
    every export request, and building its Origin costs ~4 µs, which small requests feel (an engine's
    exporter sends a few dozen spans each 500 ms): requests of 28 spans from 3 senders decode 12 %
    faster (``bench/collector_ab.py --batch 28``). Requests of one sender share the Origin object."""
    origin = _origins.get(resource)
    if origin is None:
        if len(_origins) >= ORIGINS_KEPT:
            _origins.clear()
        origin = _origins[resource] = Origin.of(attributes, resource)
    return origin


def _int(value: Any) -> int:
    """A resource attribute's integer (string or int); 0 when absent or not a number."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


class SpanRow(NamedTuple):
    """One span: ids as raw bytes, times in ns on its sender's clock, OTLP status code (0
    unset, 1 ok, 2 error), its :class:`Origin`, its stage, the attributes in
    :data:`WANTED_ATTRIBUTES` it has, and the original ``InstrumentationScope`` and ``Span``
    bytes. A tuple, so that the native decoder makes one without running Python code."""

    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes  # b"" for a root
    name: str
    start: int
    end: int
    status: int
    origin: Origin
    stage: str
    attrs: dict[str, Any]
    scope: bytes = b""
    raw: bytes = b""

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
        return f"SpanRow({self.side}:{self.stage} {self.trace_id.hex()}/{self.span_id.hex()} {self.start}..{self.end})"


def stage_of(origin: Origin, name: str, attrs: dict[str, Any]) -> str:
    """Contract spans: from (side, name). Others: their ``kvtrace.stage``, or their name."""
    return origin.stages.get(name) or attrs.get(semconv.ATTR_STAGE) or name


@dataclass(slots=True)
class SpanColumns:
    """A batch's spans as packed columns, in row order, for the store's Arrow tables."""

    trace_ids: bytes  # 16 bytes per span
    span_ids: bytes  # 8 bytes per span
    parent_ids: bytes  # 8 bytes per span; zeros for a root
    starts: bytes  # int64, native byte order
    ends: bytes  # int64
    statuses: bytes  # int8
    origin_index: bytes  # int32: each span's Origin in ``origins``
    names: list[str]
    stages: list[str]
    origins: list[Origin]

    def __len__(self) -> int:
        return len(self.names)


@dataclass(slots=True)
class SpanBatch:
    """One export request: its decoded spans, as rows and as columns, and the bytes as received."""

    rows: list[SpanRow]
    columns: SpanColumns
    payload: bytes

    @classmethod
    def decode(cls, payload: bytes) -> "SpanBatch":
        """Decode and check an OTLP/protobuf request; raises :class:`PermanentError` naming the
        first bad span, or saying the protobuf is malformed."""
        rows, columns = decode(payload)
        return cls(rows, columns, payload)

    @classmethod
    def of(cls, request: ExportTraceServiceRequest) -> "SpanBatch":
        """A batch from a parsed request (OTLP/JSON, tests), kept as its protobuf bytes."""
        return cls.decode(request.SerializeToString())

    @property
    def request(self) -> ExportTraceServiceRequest:
        """The original parsed with the official messages (for tests and tools; the pipeline never does)."""
        return ExportTraceServiceRequest.FromString(self.payload)


def decode(payload: bytes) -> tuple[list[SpanRow], SpanColumns]:
    """Every span of an OTLP/protobuf export request, in order, as rows and columns; raises
    :class:`PermanentError` on malformed protobuf or a bad id or time."""
    latest = time.time_ns() + FUTURE_SLACK_NS
    if _otlp is None:
        return decode_python(payload, latest)
    try:
        rows, origins, columns = _otlp.decode(payload, latest, SpanRow, origin_of, _SPAN_KEYS_BYTES,
                                              _RESOURCE_KEYS_BYTES, semconv.ATTR_STAGE)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PermanentError(f"malformed protobuf: {exc}") from None
    if rows is None:  # ``origins`` holds the bytes of the first span that failed the checks
        try:
            bad = Span.FromString(origins)
        except DecodeError as exc:  # e.g. bad UTF-8 in a field the native decoder skips
            raise PermanentError(f"malformed protobuf: {exc}") from None
        raise PermanentError(_problem(bad, latest))
    return rows, SpanColumns(*columns, origins)


def decode_python(payload: bytes, latest: int) -> tuple[list[SpanRow], SpanColumns]:
    """:func:`decode` with the official protobuf messages: the reference for the native decoder."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(payload)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise PermanentError(f"malformed protobuf: {exc}") from None
    rows: list[SpanRow] = []
    origins: list[Origin] = []
    trace_ids, span_ids, parent_ids = bytearray(), bytearray(), bytearray()
    starts, ends, statuses, origin_index = array.array("q"), array.array("q"), array.array("b"), array.array("i")
    for resource_spans in request.resource_spans:
        resource = resource_spans.resource
        origin = origin_of({a.key: value_of(a.value) for a in resource.attributes if a.key in _RESOURCE_KEYS},
                           resource.SerializeToString())
        origins.append(origin)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.SerializeToString()
            for span in scope_spans.spans:
                trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                if (len(trace_id) != 16 or trace_id == _NO_TRACE or len(span_id) != 8 or span_id == _NO_SPAN
                        or (parent and len(parent) != 8) or not MIN_TIME_NS <= start <= end <= latest):
                    raise PermanentError(_problem(span, latest))
                attrs = {a.key: value_of(a.value) for a in span.attributes if a.key in WANTED_ATTRIBUTES}
                rows.append(SpanRow(trace_id, span_id, parent, span.name, start, end, span.status.code, origin,
                                    stage_of(origin, span.name, attrs), attrs, scope, span.SerializeToString()))
                trace_ids += trace_id
                span_ids += span_id
                parent_ids += parent or _NO_SPAN
                starts.append(start)
                ends.append(end)
                statuses.append(span.status.code)
                origin_index.append(len(origins) - 1)
    columns = SpanColumns(bytes(trace_ids), bytes(span_ids), bytes(parent_ids), starts.tobytes(), ends.tobytes(),
                          statuses.tobytes(), origin_index.tobytes(), [r.name for r in rows],
                          [r.stage for r in rows], origins)
    return rows, columns


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


def spans_at(locations: Iterable[Sequence[int]], read: Callable[[int, int, int], bytes | None],
             on_missing: Callable[[int], None] | None = None) -> list[SpanRow]:
    """The spans at these places in the write-ahead log (:data:`.schema.ORIGINALS_SQL`'s rows: segment,
    end offset, bytes, index in the request), each request read and decoded once; ``read(segment, offset,
    length)`` returns a request's bytes, or None where the log no longer has it (then ``on_missing``)."""
    decoded: dict[tuple[int, int], list[SpanRow]] = {}
    found = []
    for segment, offset, length, index in locations:
        rows = decoded.get((segment, offset))
        if rows is None:
            payload = read(segment, offset, length)
            if payload is None and on_missing is not None:
                on_missing(segment)
            rows = decoded[segment, offset] = decode(payload)[0] if payload is not None else []
        if index < len(rows):
            found.append(rows[index])
    return found


def rebuild_request(spans: list[SpanRow]) -> bytes:
    """One OTLP export request (protobuf bytes) holding the trace's spans exactly as received,
    each under its original resource and scope."""
    resources: dict[int, tuple[bytes, dict[int, tuple[bytes, list[bytes]]]]] = {}
    for row in spans:
        _, scopes = resources.setdefault(id(row.origin), (row.origin.resource, {}))
        scopes.setdefault(id(row.scope), (row.scope, []))[1].append(row.raw)
    return b"".join(
        field(1, field(1, resource) + b"".join(field(2, field(1, scope) + b"".join(field(2, raw) for raw in raws))
                                                 for scope, raws in scopes.values()))
        for resource, scopes in resources.values())
