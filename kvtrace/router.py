"""The P/D router: one OpenAI-compatible endpoint in front of a prefill and a decode instance.

It starts (or continues, from the client's ``traceparent``) the request's trace, records
``pd.request``, ``pd.route`` and, in pull mode, the relay of P's parameters to D
(``kv.registration``), and hands the trace to both engines in ``kv_transfer_params`` and
the ``traceparent`` header.

* pull: prefill leg first (``max_tokens=1``), then the decode leg with P's returned
  ``kv_transfer_params``.
* push: D's leg needs only P's static coordinates, so both legs go out at once with one
  ``X-Request-Id`` — D allocates and registers with P while P is still prefilling.

The decode leg is always streamed from D, so the router sees the first token; a client that
asked for a plain response gets the chunks assembled into one. Upstream failures come back
as OpenAI-style errors (502 unreachable, 504 timed out, or the engine's own status).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import uuid
from typing import Any
from urllib.parse import urlparse

import aiohttp
from aiohttp import web
from opentelemetry import trace as otel_trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtrace.http_sent import SentAt, stamping
from kvtrace.telemetry import FailureCause, Mode, Role, Stage, TelemetryConfig, TraceRef, configure, semconv
from kvtrace.telemetry.context import new_span_id, new_trace_id, sdk_sampler
from kvtrace.telemetry.semconv import PARAM_RECEIVED, PARAM_TRACEPARENT, RECEIVED_PLACEHOLDER

logger = logging.getLogger("kvtrace.router")
_PROPAGATOR = TraceContextTextMapPropagator()

ARRIVED = web.RequestKey("kvtrace_arrived_ns", int)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    prefill: str
    decode: str
    mode: Mode
    prefill_engine_id: str | None = None
    prefill_kv_host: str = "127.0.0.1"
    prefill_kv_port: int | None = None
    prefill_tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    timeout_s: float = 300.0
    hash_request_ids: bool = False
    """Export request ids keyed-hashed, as P and D do (the key: KVTRACE_HASH_KEY)."""

    def validate(self) -> None:
        for name in ("prefill", "decode"):
            url = urlparse(getattr(self, name))
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(f"--{name}: {getattr(self, name)!r} is not an http(s) URL")
        if self.mode is Mode.PUSH and (self.prefill_engine_id is None or self.prefill_kv_port is None):
            raise ValueError("push mode needs --prefill-engine-id and --prefill-kv-port: D registers "
                             "with P before P has answered, so it must know P's coordinates up front")
        if self.timeout_s <= 0:
            raise ValueError("--timeout must be positive")


class Arrivals:
    """When each request's bytes reached the router's event loop, for the start of ``pd.request``.

    aiohttp first sees a request in ``RequestHandler.data_received``, about a third of a millisecond
    (here) before the handler runs; TTFT as the client sees it starts even earlier, so every bit
    counts. That method is aiohttp's own, not an API: it is wrapped once, and where it (or its
    request counter) is missing, the router says so and starts ``pd.request`` at the handler."""

    def __init__(self, now: Any) -> None:
        self._now = now
        self._pending: dict[int, collections.deque[int]] = {}  # protocol -> arrival times, in order
        self.active = self._install()

    def _install(self) -> bool:
        from aiohttp import web_protocol

        handler = web_protocol.RequestHandler
        original = getattr(handler, "data_received", None)
        if original is None or "_request_count" not in getattr(handler, "__slots__", ()):
            logger.error("kvtrace router: aiohttp %s has no RequestHandler.data_received/_request_count; "
                         "pd.request starts when the handler runs (TTFT reads ~0.4 ms short)", aiohttp.__version__)
            return False
        pending, now = self._pending, self._now
        lost = handler.connection_lost

        def data_received(protocol, data: bytes) -> None:
            arrived, before = now(), protocol._request_count
            original(protocol, data)
            for _ in range(protocol._request_count - before):
                pending.setdefault(id(protocol), collections.deque()).append(arrived)

        def connection_lost(protocol, exc: BaseException | None) -> None:
            pending.pop(id(protocol), None)  # the id may be reused by the next connection
            lost(protocol, exc)

        handler.data_received = data_received
        handler.connection_lost = connection_lost
        return True

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every request takes its arrival off its connection's queue (health checks too), in order."""
        queue = self._pending.get(id(request.protocol))
        request[ARRIVED] = queue.popleft() if queue else self._now()
        return await handler(request)


class UpstreamError(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class Router:
    def __init__(self, config: RouterConfig, recorder: Any = None, trace_sampler: Any = None) -> None:
        config.validate()
        self.config = config
        telemetry = TelemetryConfig.load({"hash_request_ids": True} if config.hash_request_ids else None)
        self._rec = recorder if recorder is not None else configure(telemetry, Role.ROUTER, config.mode)
        self._sampler = trace_sampler if trace_sampler is not None else sdk_sampler(telemetry.sampler,
                                                                                    telemetry.sampler_arg)
        self._session: aiohttp.ClientSession | None = None
        self._arrivals = Arrivals(self._rec.now)

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024,
                              middlewares=[self._arrivals.middleware] if self._arrivals.active else [])
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=10)
        # a leg leaves as aiohttp writes it: building and sending it is the router's routing
        self._session = aiohttp.ClientSession(timeout=timeout, trace_configs=[stamping(self._rec.now)])

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        self._rec.force_flush()

    @staticmethod
    def _incoming_trace(request: web.Request) -> tuple[TraceRef | None, Any]:
        """The client's trace (W3C ``traceparent``, by the SDK's propagator), as a TraceRef and a Context."""
        context = _PROPAGATOR.extract(request.headers)
        span = otel_trace.get_current_span(context).get_span_context()
        if not span.is_valid:
            return None, context
        return TraceRef(span.trace_id, span.span_id, span.trace_flags.sampled), context

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "mode": self.config.mode.value})

    # ------------------------------------------------------------------ one request

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One completion through P and D: both legs (by mode), the answer (streamed or whole), an
        OpenAI-style error where an engine fails, and the ``pd.request`` span around it all."""
        t_in = request.get(ARRIVED) or self._rec.now()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "invalid_request_error")
        ex = self._exchange(request, body, t_in)
        try:
            legs = self._pull_legs if self.config.mode is Mode.PULL else self._push_legs
            first_chunk, stream = await legs(request.path, body, ex)
            if body.get("stream"):
                return await self._stream_answer(request, ex, first_chunk, stream)
            return await self._whole_answer(ex, first_chunk, stream)
        except UpstreamError as exc:
            ex.status = exc.status
            return error_response(exc.status, exc.message, exc.kind)
        except asyncio.TimeoutError:
            ex.status = 504
            return error_response(504, "an upstream engine did not answer in time", "upstream_timeout")
        except aiohttp.ClientError as exc:
            ex.status = 502
            return error_response(502, f"upstream engine unreachable: {type(exc).__name__}",
                                  "upstream_unavailable")
        finally:
            self._record_request(ex)

    def _exchange(self, request: web.Request, body: dict, t_in: int) -> "Exchange":
        """The request's ids, trace (continuing the caller's, sampled by the configured sampler) and headers."""
        chat = request.path.endswith("/chat/completions")
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        parent, context = self._incoming_trace(request)
        trace = TraceRef(parent.trace_id if parent else new_trace_id(), new_span_id())  # the id of pd.request
        trace = trace._replace(sampled=self._sampler.should_sample(context, trace.trace_id, "pd.request").decision
                               .is_sampled())
        engine_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}" + ("" if chat else "-0")
        headers = {"X-Request-Id": request_id, "traceparent": trace.traceparent, "Content-Type": "application/json"}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        return Exchange(t_in=t_in, routed_ns=self._rec.now(), chat=chat, engine_id=engine_id, trace=trace,
                        root_parent=TraceRef(trace.trace_id, parent.span_id if parent else 0, trace.sampled),
                        attrs={semconv.ATTR_REQUEST_ID: engine_id}, headers=headers)

    async def _pull_legs(self, path: str, body: dict, ex: "Exchange"):
        """Pull: P first, then its KV params relayed to D; D's first chunk and the rest of its stream."""
        p_params = await self._prefill(path, leg_body(*self._prefill_body(body, ex.trace)), ex.headers, ex.trace,
                                       ex.attrs, ex.p_sent)
        t_relay = self._rec.now()
        p_params = {**p_params, PARAM_TRACEPARENT: ex.trace.traceparent}
        stream = self._decode(path, body, p_params, ex.headers, ex.decoded, ex.d_sent)
        first_chunk = await anext(stream)
        self._rec.record(ex.trace, Stage.REGISTRATION, t_relay, ex.d_sent.ns or t_relay, ex.attrs)
        return first_chunk, stream

    async def _push_legs(self, path: str, body: dict, ex: "Exchange"):
        """Push: both legs at once (D registers while P prefills); D's first chunk and the rest of its stream."""
        prefill_body = leg_body(*self._prefill_body(body, ex.trace))
        prefill = asyncio.ensure_future(self._prefill(path, prefill_body, ex.headers, ex.trace, ex.attrs, ex.p_sent))
        stream = self._decode(path, body, self._push_params(ex.engine_id, ex.trace), ex.headers, ex.decoded,
                              ex.d_sent)
        decode_first = asyncio.ensure_future(anext(stream))
        try:
            await asyncio.wait([prefill, decode_first], return_when=asyncio.FIRST_EXCEPTION)
            if prefill.done():
                prefill.result()  # P failed → stop waiting on D, which would wait for a push
            return await decode_first, stream  # (D failed first: its error, whatever P does)
        finally:
            for task in (prefill, decode_first):
                if not task.done():
                    task.cancel()

    async def _stream_answer(self, request: web.Request, ex: "Exchange", first_chunk: bytes,
                             stream) -> web.StreamResponse:
        """TTFT ends as the first token leaves for the client: what it sees."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # (headers go out with the first chunk)
        # Read before the write, which hands the chunk to the client's socket: read after it, a busy
        # host could run others between the two and the router's TTFT would outlast the client's.
        ex.first_token_ns = self._rec.now()
        await response.write(first_chunk)
        self._rec.record(ex.trace, Stage.DECODE_LEG, ex.d_sent.ns or ex.first_token_ns, ex.first_token_ns, ex.attrs)
        async for event in stream:
            await response.write(event)
        await response.write_eof()
        return response

    async def _whole_answer(self, ex: "Exchange", first_chunk: bytes, stream) -> web.Response:
        ex.first_token_ns = self._rec.now()  # a plain response: the first token is in the router's hands
        self._rec.record(ex.trace, Stage.DECODE_LEG, ex.d_sent.ns or ex.first_token_ns, ex.first_token_ns, ex.attrs)
        return web.json_response(assemble([first_chunk] + [event async for event in stream], ex.chat))

    def _record_request(self, ex: "Exchange") -> None:
        """``pd.route`` (to P's leg leaving; the router's own routing and sending) and the root span,
        ``pd.request``: status, the router's TTFT, last token and output tokens."""
        self._rec.record(ex.trace, Stage.PD_ROUTE, ex.t_in, ex.p_sent.ns or ex.routed_ns, ex.attrs)
        root_attrs = {**ex.attrs, semconv.ATTR_HTTP_STATUS: ex.status}
        if ex.first_token_ns:
            root_attrs[semconv.ATTR_ROUTER_TTFT_NS] = ex.first_token_ns - ex.t_in
        if ex.decoded.last_token_ns:
            root_attrs[semconv.ATTR_ROUTER_LAST_TOKEN_NS] = ex.decoded.last_token_ns - ex.t_in
        if ex.decoded.output_tokens:
            root_attrs[semconv.ATTR_OUTPUT_TOKENS] = ex.decoded.output_tokens
        self._rec.record(ex.root_parent, Stage.PD_REQUEST, ex.t_in, self._rec.now(), root_attrs,
                         span_id=ex.trace.span_id, error=None if ex.status < 400 else FailureCause.UPSTREAM_ERROR.value)

    # ------------------------------------------------------------------ legs

    def _prefill_body(self, body: dict, trace: TraceRef) -> dict:
        out = {**body, "max_tokens": 1, "stream": False}
        out.pop("stream_options", None)
        out.pop("max_completion_tokens", None)
        return out, {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None,
                     PARAM_TRACEPARENT: trace.traceparent}

    def _push_params(self, engine_request_id: str, trace: TraceRef) -> dict:
        c = self.config
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": c.prefill_engine_id, "remote_host": c.prefill_kv_host,
                "remote_port": c.prefill_kv_port, "tp_size": c.prefill_tp_size, "pp_size": 1,
                "remote_request_id": engine_request_id, "remote_block_ids": [],
                PARAM_TRACEPARENT: trace.traceparent}

    async def _prefill(self, path: str, body: bytes, headers: dict, trace: TraceRef, attrs: dict,
                       sent: SentAt) -> dict:
        """P's leg: its answer's kv_transfer_params; ``pd.prefill_leg`` spans it (sent -> answered)."""
        assert self._session is not None
        sent.ns = self._rec.now()
        async with self._session.post(self.config.prefill + path, data=body, headers=headers,
                                      trace_request_ctx=sent) as resp:
            payload = await resp.read()
            self._rec.record(trace, Stage.PREFILL_LEG, sent.ns, self._rec.now(), attrs)
            if resp.status != 200:
                raise UpstreamError(resp.status, _upstream_message(payload, "prefill"), "upstream_error")
        params = json.loads(payload).get("kv_transfer_params")
        if not isinstance(params, dict):
            raise UpstreamError(502, "prefill instance returned no kv_transfer_params (is it running "
                                "with a kv_producer NIXL connector?)", "upstream_error")
        return params

    async def _decode(self, path: str, body: dict, params: dict, headers: dict, progress: "DecodeProgress",
                      sent: SentAt):
        """Yield D's SSE events (bytes) as they arrive, noting token progress and when the leg left."""
        assert self._session is not None
        decode_body = leg_body({**body, "stream": True, "stream_options": {"include_usage": True}}, params)
        sent.ns = self._rec.now()
        async with self._session.post(self.config.decode + path, data=decode_body, headers=headers,
                                      trace_request_ctx=sent) as resp:
            if resp.status != 200:
                raise UpstreamError(resp.status, _upstream_message(await resp.read(), "decode"),
                                    "upstream_error")
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if event.strip():
                        progress.saw(event, self._rec.now())
                        yield event + b"\n\n"


def leg_body(body: dict, params: dict) -> bytes:
    """A leg's JSON body: ``kv_transfer_params`` last, ending with the receipt-time placeholder that
    kvtrace's middleware in the engine's API server overwrites (.connector.receipt)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    out["kv_transfer_params"] = {**{k: v for k, v in params.items() if k != PARAM_RECEIVED},
                                 PARAM_RECEIVED: RECEIVED_PLACEHOLDER}
    return json.dumps(out).encode()


@dataclasses.dataclass(slots=True)
class Exchange:
    """One request's way through the router: what its legs and its root span share."""

    t_in: int
    routed_ns: int  # P and D chosen; pd.route ends here should P's leg never leave
    chat: bool
    engine_id: str  # the id vLLM gives the request on both engines
    trace: TraceRef  # pd.request's own span: the legs' parent
    root_parent: TraceRef  # the caller's span, if it sent one
    attrs: dict[str, Any]
    headers: dict[str, str]  # to both engines
    status: int = 200
    first_token_ns: int = 0
    decoded: "DecodeProgress" = dataclasses.field(default_factory=lambda: DecodeProgress())
    p_sent: SentAt = dataclasses.field(default_factory=SentAt)  # when P's leg left (.http_sent)
    d_sent: SentAt = dataclasses.field(default_factory=SentAt)  # when D's leg left


class DecodeProgress:
    """When the router saw D's last token and how many D produced (from the usage chunk D sends
    last, as the decode leg asks it to). Reads only counts, never text."""

    __slots__ = ("last_token_ns", "output_tokens")

    def __init__(self) -> None:
        self.last_token_ns = 0
        self.output_tokens = 0

    def saw(self, event: bytes, now_ns: int) -> None:
        if b'"usage"' in event and b'"completion_tokens"' in event:
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and b'"usage"' in line:
                    try:
                        usage = json.loads(line[6:]).get("usage") or {}
                    except ValueError:
                        continue
                    self.output_tokens = int(usage.get("completion_tokens") or self.output_tokens)
        if b'"choices"' in event and b'"choices":[]' not in event:  # a token (the usage chunk has none)
            self.last_token_ns = now_ns


def _upstream_message(payload: bytes, leg: str) -> str:
    try:
        message = json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = payload[:200].decode(errors="replace")
    return f"{leg} instance: {message}"


def assemble(events: list[bytes], chat: bool) -> dict:
    """Turn streamed chunks back into the one response a non-streaming client expects."""
    chunks = []
    for event in events:
        for line in event.decode().splitlines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                chunks.append(json.loads(line[6:]))
    if not chunks:
        raise UpstreamError(502, "decode instance sent no chunks", "upstream_error")
    for chunk in chunks:  # an engine that fails mid-stream sends an error event
        if isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            code = error.get("code") if isinstance(error.get("code"), int) else 502
            raise UpstreamError(code if 400 <= code < 600 else 502,
                                f"decode instance: {error.get('message', 'error')}", "upstream_error")
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            slot = choices.setdefault(choice["index"], {"index": choice["index"], "text": "",
                                                        "finish_reason": None})
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            slot["text"] += piece or ""
            slot["finish_reason"] = choice.get("finish_reason") or slot["finish_reason"]
    head = chunks[0]
    result = {"id": head.get("id"), "object": "chat.completion" if chat else "text_completion",
              "created": head.get("created"), "model": head.get("model"), "usage": usage}
    if chat:
        result["choices"] = [{"index": c["index"], "finish_reason": c["finish_reason"],
                              "message": {"role": "assistant", "content": c["text"]}}
                             for c in sorted(choices.values(), key=lambda c: c["index"])]
    else:
        result["choices"] = [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                              "logprobs": None} for c in sorted(choices.values(), key=lambda c: c["index"])]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, help="prefill instance base URL (http://127.0.0.1:8100)")
    parser.add_argument("--decode", required=True, help="decode instance base URL")
    parser.add_argument("--mode", choices=[m.value for m in Mode], required=True)
    parser.add_argument("--prefill-engine-id", help="push: P's engine_id (set it in P's kv-transfer-config)")
    parser.add_argument("--prefill-kv-host", default="127.0.0.1", help="push: P's NIXL side-channel host")
    parser.add_argument("--prefill-kv-port", type=int, help="push: P's NIXL side-channel port")
    parser.add_argument("--prefill-tp-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=300.0, help="per-leg timeout, seconds")
    parser.add_argument("--hash-request-ids", action="store_true",
                        help="export request ids as a keyed hash (key from KVTRACE_HASH_KEY, the same as P's and D's)")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(prefill=args.prefill.rstrip("/"), decode=args.decode.rstrip("/"),
                        mode=Mode(args.mode), prefill_engine_id=args.prefill_engine_id,
                        prefill_kv_host=args.prefill_kv_host, prefill_kv_port=args.prefill_kv_port,
                        prefill_tp_size=args.prefill_tp_size, host=args.host, port=args.port,
                        timeout_s=args.timeout, hash_request_ids=args.hash_request_ids)


def serve(config: RouterConfig) -> None:
    router = Router(config)
    logger.info("kvtrace router (%s) on http://%s:%d → P %s, D %s", config.mode.value, config.host,
                config.port, config.prefill, config.decode)
    web.run_app(router.app(), host=config.host, port=config.port, print=None)
