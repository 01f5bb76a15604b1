"""W3C trace context as kvtrace carries it: a small immutable reference, cheap to pass around.

The router starts (or continues) a trace and hands a ``traceparent`` to both engines through
``kv_transfer_params``; engines pass it on to their workers and threads. Behind a router that
propagates nothing, both engines derive one trace from the request id they share
(:func:`request_trace`). Everything on the
hot path holds a :class:`TraceRef`, never an OpenTelemetry ``Context``: it is a tuple, so
creating, storing and pickling it costs next to nothing.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from typing import NamedTuple

# The OpenTelemetry SDK's own pattern (TraceContextTextMapPropagator): lower-case hex only; a future
# version may carry more fields, version 00 may not. tests/telemetry/test_context.py holds the two
# to the same answers.
_TRACEPARENT_RE = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")
_SAMPLED_FLAG = 0x01

# One generator per process, reseeded after fork so parent and child never share ids.
_ids = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(16)))


class TraceRef(NamedTuple):
    """Where a span belongs: its trace, its parent span, and whether the trace is sampled."""

    trace_id: int
    span_id: int
    sampled: bool = True

    @property
    def traceparent(self) -> str:
        return format_traceparent(self)

    def child(self, span_id: int | None = None) -> "TraceRef":
        """A reference to a new span under this one (used to parent further spans)."""
        return TraceRef(self.trace_id, span_id or new_span_id(), self.sampled)


def new_trace_id() -> int:
    return _ids.getrandbits(128) or 1


def new_span_id() -> int:
    return _ids.getrandbits(64) or 1


def parse_traceparent(value: str | None) -> TraceRef | None:
    """Parse a W3C ``traceparent`` header as the OpenTelemetry SDK's propagator does; ``None`` for a
    missing or invalid one. Hand-written because it runs on the engine loop, per request: a
    ``TraceRef`` is a tuple, the SDK's extract builds a Context and a span."""
    if not value:
        return None
    match = _TRACEPARENT_RE.match(value)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceRef(trace_id, span_id, bool(int(flags_hex, 16) & _SAMPLED_FLAG))


def request_trace(base_request_id: str, key: bytes = b"") -> tuple[int, int]:
    """(trace id, parent span id) of a request that reached an engine with no trace context.

    Every P/D router sends P and D the same request id (vLLM's push matches a registration to P's
    blocks by it), so both engines — and every process of each — derive the same trace from it and
    the request is one trace with no propagation at all, while two requests never share one (ids
    are unique per request; 128 bits of a keyed BLAKE2b collide with probability ~n²/2¹²⁹). The
    parent is no span anyone exports: it marks the spans of one request as siblings. ``key`` is the
    request-id hash key where one is set, so a trace id reveals nothing about a guessable request id.
    """
    digest = hashlib.blake2b(base_request_id.encode(), digest_size=24, key=key[:64],
                             person=b"kvtrace.request").digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:], "big") or 1


def format_traceparent(ref: TraceRef) -> str:
    flags = _SAMPLED_FLAG if ref.sampled else 0
    return f"00-{ref.trace_id:032x}-{ref.span_id:016x}-{flags:02x}"


class Sampler:
    """Head sampling as ``OTEL_TRACES_SAMPLER`` names it, decided once where a trace starts: the
    SDK's samplers' decisions without their Context and attribute objects (the engine loop decides
    for requests that reach it with no trace). The router uses the SDK's own (:func:`sdk_sampler`);
    tests/telemetry/test_context.py holds the two to the same decisions.

    Ratio decisions use the low 64 bits of the trace id, like the SDK's ``TraceIdRatioBased``,
    so every process that sees the same trace id with no parent decides the same way.
    """

    __slots__ = ("name", "ratio", "_parent_based", "_bound")

    def __init__(self, name: str = "parentbased_always_on", ratio: float = 1.0) -> None:
        self.name = name
        self.ratio = ratio
        self._parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        self._bound = {
            "always_on": 1 << 64,
            "always_off": 0,
            "traceidratio": round(ratio * (1 << 64)),
        }[root]

    def should_sample(self, trace_id: int, parent: TraceRef | None = None) -> bool:
        if parent is not None and self._parent_based:
            return parent.sampled
        return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < self._bound


def sdk_sampler(name: str = "parentbased_always_on", ratio: float = 1.0):
    """The OpenTelemetry SDK's sampler for an ``OTEL_TRACES_SAMPLER`` name (the router's)."""
    from opentelemetry.sdk.trace import sampling

    root = name.removeprefix("parentbased_")
    sampler = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
               "traceidratio": sampling.TraceIdRatioBased(ratio)}[root]
    return sampling.ParentBased(sampler) if name.startswith("parentbased_") else sampler
