"""The leg body the router sends and the API-server middleware that stamps its receipt time."""

import asyncio
import json

from kvtrace.connector.receipt import TAIL, RequestReceipt, receipt_from_tracestate, stamp
from kvtrace.router import leg_body
from kvtrace.telemetry.semconv import PARAM_RECEIVED, PARAM_TRACEPARENT


def _run(app, body: bytes, path: str = "/v1/completions", chunk: int = 7) -> bytes:
    """The body an app behind the middleware reads, sent in small chunks."""
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    seen = []

    async def inner(scope, receive, send):
        message = {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            seen.append(message["body"])

    async def receive():
        return messages.pop(0)

    asyncio.run(app(inner)({"type": "http", "method": "POST", "path": path}, receive, None))
    return b"".join(seen)


def test_the_router_ends_each_leg_with_the_placeholder_and_keeps_the_rest():
    body = leg_body({"prompt": f'ends like a body "{PARAM_RECEIVED}": "0"}}}}', "kv_transfer_params": {"x": 1}},
                    {"do_remote_decode": True, PARAM_TRACEPARENT: "00-ab-cd-01", PARAM_RECEIVED: "old"})
    assert body.endswith(TAIL)
    decoded = json.loads(body)
    assert list(decoded)[-1] == "kv_transfer_params" and list(decoded["kv_transfer_params"])[-1] == PARAM_RECEIVED
    assert decoded["kv_transfer_params"][PARAM_TRACEPARENT] == "00-ab-cd-01"


def test_the_middleware_stamps_the_receipt_in_place_whatever_the_chunks():
    body = leg_body({"prompt": "hello", "max_tokens": 1}, {"do_remote_decode": True})
    read = _run(RequestReceipt, body)
    params = json.loads(read)["kv_transfer_params"]
    assert len(read) == len(body) and int(params[PARAM_RECEIVED]) > 1_700_000_000 * 10**9
    assert json.loads(read)["prompt"] == "hello"


def test_other_bodies_and_paths_pass_untouched():
    plain = json.dumps({"prompt": f'"{PARAM_RECEIVED}": "0000000000000000000"}}}} and more'}).encode()
    assert _run(RequestReceipt, plain) == plain  # the placeholder inside a prompt is not the body's end
    body = leg_body({"prompt": "x"}, {})
    assert _run(RequestReceipt, body, path="/v1/embeddings") == body
    assert stamp(b"{}", 5) == b"{}"


def _headers_seen(headers: list[tuple[bytes, bytes]], body: bytes = b'{"prompt": "x"}') -> dict[bytes, bytes]:
    seen = {}

    async def inner(scope, receive, send):
        seen.update(scope["headers"])
        while (await receive()).get("more_body"):
            pass

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    asyncio.run(RequestReceipt(inner)({"type": "http", "method": "POST", "path": "/v1/completions",
                                       "headers": headers}, receive, None))
    return seen


def test_a_traced_request_from_another_router_carries_its_receipt_in_tracestate():
    parent = (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    seen = _headers_seen([parent, (b"tracestate", b"kvtrace=r1, vendor=abc,other=1")])
    entries = seen[b"tracestate"].decode().split(",")
    assert entries[0].startswith("kvtrace=r") and entries[1:] == ["vendor=abc", "other=1"]  # a forged one replaced
    received = receipt_from_tracestate(seen[b"tracestate"].decode())
    assert received > 1_700_000_000 * 10**9 and seen[b"traceparent"] == parent[1]
    assert _headers_seen([(b"content-type", b"application/json")]) == {b"content-type": b"application/json"}
    # kvtrace's router's legs keep the receipt in the body: their headers pass untouched
    assert b"tracestate" not in _headers_seen([parent], leg_body({"prompt": "x"}, {}))


def test_receipt_from_tracestate_reads_only_its_own_entry():
    assert receipt_from_tracestate("a=1,kvtrace=r1790000000000000000") == 1_790_000_000_000_000_000
    for value in (None, "", "kvtrace=1790", "kvtrace=rx", "other=r1"):
        assert receipt_from_tracestate(value) == 0
