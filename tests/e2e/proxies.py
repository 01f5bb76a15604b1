"""P/D proxies of the shapes users run instead of kvtrace's router, written apart from it (they share
no code with ``kvtrace router``), for the end-to-end tests of tracing behind any router.

* :class:`ToyPullProxy` — vLLM's toy disaggregated proxy: its own ``X-Request-Id`` on both legs, P first
  with ``max_tokens=1``, P's returned ``kv_transfer_params`` passed through to D unchanged, no trace headers.
* :class:`ToyPushProxy` — a toy push proxy: both legs at once with one ``X-Request-Id``, D's params built
  from P's fixed coordinates (a fixed list of fields: nothing else P or a router might add survives).
* either with ``gateway=True`` — a gateway in front that starts its own root span (OpenTelemetry SDK,
  exported to the same collector) and forwards its ``traceparent`` on both legs.
* :class:`GatewayInFront` — that gateway in front of another router (kvtrace's): one request, seen by both.

Each runs an aiohttp server on 127.0.0.1 in a thread of its own and answers with D's response as D sent
it, plus the request id it minted in ``X-Proxy-Request-Id`` (so a test can find the request's trace).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import aiohttp
from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from kvtrace.testbed.launch import free_port


class _Proxy:
    def __init__(self, prefill_url: str, decode_url: str, *, gateway: bool = False,
                 otlp_endpoint: str | None = None) -> None:
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.port = free_port()
        self._tracer = self._provider = None
        if gateway:
            self._provider = TracerProvider(resource=Resource.create({"service.name": "test-gateway"}))
            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint),
                                                                 schedule_delay_millis=200))
            self._tracer = self._provider.get_tracer("test-gateway")
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=type(self).__name__, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "_Proxy":
        self._thread.start()
        assert self._ready.wait(20), "proxy did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
        if self._provider is not None:
            self._provider.shutdown()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as self.session:
            self._ready.set()
            await self._stop.wait()
        await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        request_id = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        if self._tracer is None:
            return await self._route(request, await request.json(), headers, request_id)
        # a server span from the request's arrival, before its body is read (as HTTP instrumentations start it)
        with self._tracer.start_as_current_span("gateway " + request.path, kind=SpanKind.SERVER):
            inject(headers)  # W3C traceparent of the gateway's span, on both legs
            return await self._route(request, await request.json(), headers, request_id)

    async def _answer(self, request: web.Request, resp: aiohttp.ClientResponse, request_id: str) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers={
            "Content-Type": resp.headers.get("Content-Type", "application/json"), "X-Proxy-Request-Id": request_id})
        await out.prepare(request)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out

    def _prefill_body(self, body: dict) -> dict:
        return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}}

    async def _route(self, request, body, headers, request_id):
        raise NotImplementedError


class ToyPullProxy(_Proxy):
    async def _route(self, request, body, headers, request_id):
        async with self.session.post(self.prefill_url + request.path, json=self._prefill_body(body),
                                     headers=headers) as resp:
            answer = json.loads(await resp.read())
        decode_body = {**body, "kv_transfer_params": answer["kv_transfer_params"]}  # passed through as P sent them
        async with self.session.post(self.decode_url + request.path, json=decode_body, headers=headers) as resp:
            return await self._answer(request, resp, request_id)


class ToyPushProxy(_Proxy):
    def __init__(self, prefill_url: str, decode_url: str, *, engine_id: str, kv_port: int, **kwargs) -> None:
        super().__init__(prefill_url, decode_url, **kwargs)
        self.engine_id, self.kv_port = engine_id, kv_port

    async def _route(self, request, body, headers, request_id):
        engine_request_id = f"cmpl-{request_id}-0" if request.path.endswith("/completions") and \
            not request.path.endswith("chat/completions") else f"chatcmpl-{request_id}"
        decode_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                         "remote_host": "127.0.0.1", "remote_port": self.kv_port, "tp_size": 1, "pp_size": 1,
                         "remote_request_id": engine_request_id, "remote_block_ids": []}
        prefill = asyncio.ensure_future(self._prefill(request.path, body, headers))
        try:
            async with self.session.post(self.decode_url + request.path,
                                         json={**body, "kv_transfer_params": decode_params}, headers=headers) as resp:
                return await self._answer(request, resp, request_id)
        finally:
            await prefill

    async def _prefill(self, path: str, body: dict, headers: dict) -> None:
        async with self.session.post(self.prefill_url + path, json=self._prefill_body(body), headers=headers) as resp:
            await resp.read()


class GatewayInFront(_Proxy):
    """The gateway alone in front of another P/D router (kvtrace's, in the tests): the whole request
    passed on, with the gateway span's ``traceparent``."""

    def __init__(self, upstream_url: str, *, otlp_endpoint: str) -> None:
        super().__init__(upstream_url, upstream_url, gateway=True, otlp_endpoint=otlp_endpoint)

    async def _route(self, request, body, headers, request_id):
        async with self.session.post(self.prefill_url + request.path, json=body, headers=headers) as resp:
            return await self._answer(request, resp, request_id)
