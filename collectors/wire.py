"""The protobuf wire format, the little of it kvtrace writes by hand: length-delimited fields, varints
and OTLP ``KeyValue`` entries — for rebuilding an export request from received spans (:mod:`.model`),
the collector's breakdown span (:mod:`.breakdown_span`) and the synthetic load (``kvtrace.testbed``).
Hand-written because these run per span or per trace, where building messages would cost far more.
:func:`attributes`, which encodes the breakdown span's ~30 attributes for every forwarded trace, is
native (``_otlp.c``) where the extension is built; :func:`attributes_python` is its reference.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from .compiled import PURE_ENV

# The native module (_otlp.c), None where it is not built: then the Python halves work alone (here,
# model.decode_python, store.stage_columns). KVTRACE_PURE_PYTHON turns every native half off (and runs
# the compiled modules as Python: .compiled), to compare them or to rule them out.
try:
    from . import _otlp as native
except ImportError:  # installed without a C compiler
    native = None
if os.environ.get(PURE_ENV):
    native = None

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


_DOUBLE = struct.Struct("<d")


def key_value(key: str, value: str | int | bool | float) -> bytes:
    """An OTLP ``KeyValue``'s body: the key and an ``AnyValue`` holding a string, an int64, a bool
    or a double."""
    if isinstance(value, bool):
        any_value = varint(2 << 3) + varint(int(value))
    elif isinstance(value, int):
        any_value = varint(3 << 3) + varint(value & 0xFFFF_FFFF_FFFF_FFFF)  # int64, two's complement
    elif isinstance(value, float):
        any_value = varint(4 << 3 | 1) + _DOUBLE.pack(value)
    elif isinstance(value, str):
        any_value = field(1, value.encode())
    else:
        raise TypeError(f"attribute {key!r}: a str, bool, int or float, not {type(value).__name__}")
    return field(1, key.encode()) + field(2, any_value)


def attributes_python(keys: tuple[str, ...], values: Sequence) -> bytes:
    """``Span.attributes`` entries for each key whose value is not None, in order (the reference
    for ``_otlp.attributes``, which the collector uses where it is built)."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys, {len(values)} values")
    return b"".join(field(9, key_value(key, value)) for key, value in zip(keys, values) if value is not None)


attributes = native.attributes if native is not None else attributes_python
