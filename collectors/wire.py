"""The protobuf wire format, the little of it kvtrace writes by hand: length-delimited fields, varints
and OTLP ``KeyValue`` entries — for rebuilding an export request from received spans (:mod:`.model`),
the collector's breakdown span (:mod:`.breakdown_span`) and the synthetic load (``kvtrace.testbed``).
Hand-written because these run per span or per trace, where building messages would cost far more.
"""

from __future__ import annotations

_BYTE = [bytes([value]) for value in range(0x80)]


def varint(value: int) -> bytes:
    """An unsigned varint (a negative int64 must be passed as its two's complement, ``& 2**64 - 1``)."""
    if value < 0x80:
        return _BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a message, string or bytes): ResourceSpans.resource, ScopeSpans.spans, ..."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def key_value(key: str, value: str | int | bool) -> bytes:
    """An OTLP ``KeyValue``'s body: the key and an ``AnyValue`` holding a string, an int64 or a bool."""
    if isinstance(value, bool):
        any_value = varint(2 << 3) + varint(int(value))
    elif isinstance(value, int):
        any_value = varint(3 << 3) + varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        any_value = field(1, value.encode())
    return field(1, key.encode()) + field(2, any_value)
