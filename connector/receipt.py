"""When a leg reached vLLM's API server: an ASGI middleware for it, loaded with vLLM's own option
``--middleware kvtrace.connector.RequestReceipt``.

vLLM stamps a request's ``arrival_time`` only once its HTTP body has been read, parsed and
validated; on a busy host that is milliseconds after the request arrived, and without this
middleware that time is unattributed. kvtrace's router ends each leg's body with
``"kvtrace_received_ns": "0000000000000000000"}}`` (the last key of ``kv_transfer_params``, the
body's last key); this middleware, first to see the request, overwrites those 19 digits with
the wall time it arrived. The body keeps its length, nothing is parsed, and only the body's
last bytes are looked at, so no prompt can forge it; a body that does not end that way (another
client) passes untouched, and the engine falls back to vLLM's ``arrival_time``.

Behind another router, a request that carries a W3C ``traceparent`` gets the receipt time in its
``tracestate`` header instead (a ``kvtrace=r<ns>`` entry, leftmost, replacing any the client sent):
vLLM hands ``traceparent`` and ``tracestate`` to the engine as ``trace_headers`` when its own tracing
is on — exactly when such a request's trace reaches the engine — so a gateway's trace times P's input
from the same instant as kvtrace's router's does.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from kvtrace.telemetry.semconv import PARAM_RECEIVED, RECEIVED_PLACEHOLDER

TAIL = f'"{PARAM_RECEIVED}": "{RECEIVED_PLACEHOLDER}"}}}}'.encode()
"""How kvtrace's router ends a leg's body (json.dumps' separators)."""
_DIGITS = len(RECEIVED_PLACEHOLDER)
TRACESTATE_KEY = "kvtrace"
"""The ``tracestate`` entry carrying the receipt time: ``kvtrace=r<wall ns>``."""


def with_receipt_in_tracestate(headers: list[tuple[bytes, bytes]], received_ns: int) -> list[tuple[bytes, bytes]]:
    """ASGI headers with ``kvtrace=r<ns>`` leftmost in ``tracestate``, where a ``traceparent`` is present."""
    if not any(name == b"traceparent" for name, _ in headers):
        return headers
    entries = [f"{TRACESTATE_KEY}=r{received_ns}".encode()]
    out = []
    for name, value in headers:
        if name == b"tracestate":  # keep the others' entries, in order, after ours (W3C: at most 32)
            entries += [e.strip() for e in value.split(b",")
                        if e.strip() and not e.strip().startswith(TRACESTATE_KEY.encode() + b"=")]
        else:
            out.append((name, value))
    out.append((b"tracestate", b",".join(entries[:32])))
    return out


def receipt_from_tracestate(tracestate: str | None) -> int:
    """The receipt time the middleware put in ``tracestate``; 0 if none."""
    for entry in (tracestate or "").split(","):
        key, _, value = entry.strip().partition("=")
        if key == TRACESTATE_KEY and value.startswith("r") and value[1:].isdigit():
            return int(value[1:])
    return 0


def stamp(body: bytes, received_ns: int) -> bytes:
    """The body with the receipt time in the placeholder, if it ends with it; else unchanged."""
    if not body.endswith(TAIL):
        return body
    at = len(body) - 3 - _DIGITS  # the digits sit before '"}}'
    return body[:at] + b"%019d" % received_ns + body[at + _DIGITS:]


class RequestReceipt:
    """ASGI middleware: stamps completions requests from kvtrace's router with their arrival time."""

    def __init__(self, app: Callable[..., Awaitable[Any]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or \
                not scope.get("path", "").endswith("completions"):
            return await self.app(scope, receive, send)
        received = time.time_ns()
        chunks, message = [], {"more_body": True}
        while message.get("more_body"):  # the endpoint reads the whole body before parsing it anyway
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        stamped = stamp(body, received)
        if stamped is body:  # not kvtrace's router's leg: a traced request carries it in tracestate
            scope = {**scope, "headers": with_receipt_in_tracestate(list(scope.get("headers") or ()), received)}
        await self.app(scope, _replay([{"type": "http.request", "body": stamped, "more_body": False}], receive), send)


def _replay(messages: list[dict], receive: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()
    return replayed
