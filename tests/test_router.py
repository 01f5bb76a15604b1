"""The router against scripted upstream engines on 127.0.0.1: legs, trace context, errors."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtrace import router as router_module
from kvtrace.router import Router, RouterConfig
from kvtrace.telemetry import Mode, Role, TelemetryConfig, build_resource
from kvtrace.telemetry.context import parse_traceparent, sdk_sampler
from kvtrace.telemetry.semconv import PARAM_TRACEPARENT
from kvtrace.telemetry.recorder import Recorder


class Engine:
    """A scripted OpenAI-compatible engine: records what it got, answers as told."""

    def __init__(self, role: str, status: int = 200, delay_s: float = 0.0, fail_mid_stream: bool = False) -> None:
        self.role, self.status, self.delay_s = role, status, delay_s
        self.fail_mid_stream = fail_mid_stream
        self.bodies: list[dict] = []
        self.headers: list = []
        self.arrived: list[int] = []  # wall ns, as the handler starts (the body is in)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.arrived.append(time.time_ns())
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())  # case-insensitive
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.role} broke", "code": self.status}},
                                     status=self.status)
        if self.role == "prefill":
            return web.json_response({"id": "p", "choices": [{"text": "x"}],
                                      "kv_transfer_params": {"remote_engine_id": "p-1", "remote_block_ids": [1]}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.fail_mid_stream:  # what vLLM sends when generation fails after the headers
            error = {"error": {"message": "KV transfer failed", "type": "InternalServerError", "code": 500}}
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            return response
        for piece in ("Hel", "lo"):
            chunk = {"id": "d", "created": 1, "model": "tiny", "choices": [{"index": 0, "text": piece}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"id": "d", "created": 1, "model": "tiny", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app


async def run_router(mode: str, prefill: Engine, decode: Engine, body: dict, headers=None, timeout_s=5.0,
                     prefill_url: str | None = None):
    exporter = InMemorySpanExporter()
    recorder = Recorder(exporter, build_resource(TelemetryConfig.load({}, {}), Role.ROUTER, Mode(mode)))
    async with TestServer(prefill.app(), host="127.0.0.1") as p, TestServer(decode.app(), host="127.0.0.1") as d:
        config = RouterConfig(prefill=prefill_url or str(p.make_url("")).rstrip("/"),
                              decode=str(d.make_url("")).rstrip("/"), mode=Mode(mode), prefill_engine_id="p-1",
                              prefill_kv_port=5600, timeout_s=timeout_s)
        router = Router(config, recorder=recorder, trace_sampler=sdk_sampler())
        async with TestClient(TestServer(router.app(), host="127.0.0.1")) as client:
            response = await client.post("/v1/completions", json=body, headers=headers or {})
            payload = await response.read()
    recorder.shutdown()
    return response.status, payload, exporter.get_finished_spans()


def test_pull_relays_p_params_and_one_trace_reaches_both_legs():
    prefill, decode = Engine("prefill"), Engine("decode")
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    status, payload, spans = asyncio.run(run_router(
        "pull", prefill, decode, {"model": "tiny", "prompt": "hi", "max_tokens": 5},
        headers={"traceparent": parent, "X-Request-Id": "abc"}))
    assert status == 200
    result = json.loads(payload)
    assert result["choices"][0]["text"] == "Hello" and result["usage"]["completion_tokens"] == 2
    p_body, d_body = prefill.bodies[0], decode.bodies[0]
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "p-1"  # P's params relayed
    p_ctx = parse_traceparent(p_body["kv_transfer_params"][PARAM_TRACEPARENT])
    d_ctx = parse_traceparent(d_body["kv_transfer_params"][PARAM_TRACEPARENT])
    assert p_ctx == d_ctx and p_ctx.trace_id == 0x0AF7651916CD43DD8448EB211C80319C  # the client's trace
    assert prefill.headers[0]["X-Request-Id"] == decode.headers[0]["X-Request-Id"] == "abc"
    names = {s.name: s for s in spans}
    root = names["pd.request"]
    assert root.context.span_id == p_ctx.span_id and root.parent.span_id == 0xB7AD6B7169203331
    assert root.attributes["kvtrace.router.ttft_ns"] > 0 and root.attributes["kvtrace.request_id"] == "cmpl-abc-0"
    assert {"pd.route", "kv.registration"} <= set(names)


def test_push_sends_both_legs_with_ps_static_coordinates():
    prefill, decode = Engine("prefill", delay_s=0.3), Engine("decode")
    status, _, _ = asyncio.run(run_router("push", prefill, decode,
                                          {"model": "tiny", "prompt": "hi", "stream": True},
                                          headers={"X-Request-Id": "r9"}))
    assert status == 200
    params = decode.bodies[0]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "p-1"
    assert params["remote_port"] == 5600 and params["remote_request_id"] == "cmpl-r9-0"
    assert decode.bodies[0]["stream"] is True


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_router_times_its_own_sending_up_to_the_socket(mode, monkeypatch):
    """Building and sending a leg is the router's work: ``pd.route`` runs until P's leg is written to its
    socket and each leg starts there (pull: the router's registration until D's leg is written), so a
    slow build counts as routing rather than as unattributed delivery to the engine."""
    build_s = 0.05
    build = router_module.leg_body

    def slow_leg_body(body: dict, params: dict) -> bytes:
        time.sleep(build_s)  # blocks the router's loop, as encoding a long prompt on a busy host does
        return build(body, params)

    monkeypatch.setattr(router_module, "leg_body", slow_leg_body)
    prefill, decode = Engine("prefill"), Engine("decode")
    status, _, spans = asyncio.run(run_router(mode, prefill, decode, {"model": "tiny", "prompt": "hi"}))
    assert status == 200
    by_name = {s.name: s for s in spans}
    route, p_leg, d_leg = by_name["pd.route"], by_name["pd.prefill_leg"], by_name["pd.decode_leg"]
    assert route.end_time - route.start_time >= build_s * 1e9
    assert route.end_time == p_leg.start_time <= prefill.arrived[0] + 500_000  # (each clock read once: µs apart)
    assert d_leg.start_time <= decode.arrived[0] + 500_000
    if mode == "pull":
        registration = by_name["kv.registration"]
        assert registration.end_time - registration.start_time >= build_s * 1e9
        assert registration.end_time == d_leg.start_time


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_prefill_failure_is_an_openai_error_not_a_hang(mode):
    prefill, decode = Engine("prefill", status=500), Engine("decode", delay_s=0.1)
    status, payload, spans = asyncio.run(run_router(mode, prefill, decode, {"model": "tiny", "prompt": "hi"}))
    assert status == 500
    error = json.loads(payload)["error"]
    assert "prefill instance: prefill broke" in error["message"] and error["code"] == 500
    (root,) = [s for s in spans if s.name == "pd.request"]
    assert root.status.status_code.name == "ERROR"


def test_unreachable_engine_is_502_and_slow_engine_is_504():
    status, payload, _ = asyncio.run(run_router(
        "pull", Engine("prefill"), Engine("decode"), {"model": "tiny", "prompt": "hi"},
        prefill_url="http://127.0.0.1:9"))
    assert status == 502 and json.loads(payload)["error"]["type"] == "upstream_unavailable"
    status, payload, _ = asyncio.run(run_router(
        "pull", Engine("prefill", delay_s=3), Engine("decode"), {"model": "tiny", "prompt": "hi"}, timeout_s=0.5))
    assert status == 504 and json.loads(payload)["error"]["type"] == "upstream_timeout"


def test_bad_body_is_400():
    status, payload, _ = asyncio.run(run_router("pull", Engine("prefill"), Engine("decode"), ["not", "an", "object"]))
    assert status == 400 and "JSON object" in json.loads(payload)["error"]["message"]


def test_push_without_ps_coordinates_is_a_config_error():
    with pytest.raises(ValueError, match="--prefill-engine-id"):
        RouterConfig(prefill="http://127.0.0.1:1", decode="http://127.0.0.1:2", mode=Mode.PUSH).validate()


def test_decode_failing_mid_stream_is_an_openai_error_for_a_plain_client():
    status, payload, _ = asyncio.run(run_router("pull", Engine("prefill"), Engine("decode", fail_mid_stream=True),
                                                {"model": "tiny", "prompt": "hi"}))
    assert status == 500
    assert json.loads(payload)["error"]["message"] == "decode instance: KV transfer failed"
