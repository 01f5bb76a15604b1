"""The leg body the router sends and the API-server middleware that stamps its receipt time."""

import asyncio
import json

from kvtrace.connector.receipt import TAIL, RequestReceipt, stamp
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
