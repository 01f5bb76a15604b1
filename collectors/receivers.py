"""OTLP trace receivers: gRPC ``TraceService/Export`` and HTTP ``POST /v1/traces``.

Both decode and check the spans (ids, timestamps: :func:`.model.decode`) and hand one
:class:`.model.SpanBatch` at a time to the next stage's ``consume``; OTLP/JSON is parsed
with the official ``opentelemetry-proto`` messages first and kept as protobuf. As in the
Collector's otlpreceiver, an error marked permanent becomes 400 / INVALID_ARGUMENT (do not
retry); anything else becomes 503 / UNAVAILABLE (retry).
They listen on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from concurrent import futures
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.telemetry.clock import GRPC_METHOD as CLOCK_GRPC_METHOD
from kvtrace.telemetry.clock import HTTP_PATH as CLOCK_PATH

from .config import DEFAULT_MAX_BODY_BYTES
from .httpserver import JSON, HttpServer, authorized, reply, reply_error
from .model import PermanentError, SpanBatch
from .threads import name_os_thread

logger = logging.getLogger(__name__)

ExportRequest = trace_service_pb2.ExportTraceServiceRequest
Consumer = Callable[[SpanBatch], None]
ClockExchange = Callable[[bytes, int], bytes]
"""A clock exchange's body and its arrival time in, the answer out (:meth:`.clocks.ClockBook.exchange`)."""

PROTOBUF = "application/x-protobuf"


class RetryLater(Exception):
    """The receiver's consumer cannot take data now (full); the sender should retry."""


def _hex_ids_to_base64(node: Any) -> Any:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping expects base64 for bytes fields."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                try:
                    value = base64.b64encode(bytes.fromhex(value)).decode()
                except ValueError:
                    raise PermanentError(f"{key} is not hex") from None
            out[key] = _hex_ids_to_base64(value)
        return out
    if isinstance(node, list):
        return [_hex_ids_to_base64(v) for v in node]
    return node


def decode_json(body: bytes) -> ExportRequest:
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nesting bombs recurse
        raise PermanentError(f"malformed JSON: {type(exc).__name__}") from None
    if not isinstance(document, dict):
        raise PermanentError("JSON body must be an object")
    request = ExportRequest()
    try:
        json_format.ParseDict(_hex_ids_to_base64(document), request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise PermanentError(f"JSON is not an ExportTraceServiceRequest: {exc}") from None
    return request


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------


class OtlpHttpReceiver:
    """``POST /v1/traces`` with ``application/x-protobuf`` or ``application/json`` bodies."""

    def __init__(self, consume: Consumer, host: str = "127.0.0.1", port: int = 4318, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, bearer_token: str | None = None,
                 tls: tuple[str, str] | None = None, clock: ClockExchange | None = None) -> None:
        self._consume = consume
        self._max_body = max_body_bytes
        self._token = bearer_token
        self._clock = clock
        self._server = HttpServer(self._handle, host, port, name="kvtrace-otlp-http", tls=tls)

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def endpoint(self) -> str:
        return f"{self._server.base_url}/v1/traces"

    def start(self) -> None:
        self._server.start()

    def shutdown(self) -> None:
        self._server.shutdown()

    def _handle(self, method: str, h: BaseHTTPRequestHandler) -> None:
        arrived = time.time_ns()  # a clock exchange's t2: as soon as the request is read
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            length = int(h.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        path = h.path.split("?")[0]
        if method == "POST" and path == CLOCK_PATH and self._clock is not None:
            return self._exchange_clock(h, length, arrived)
        if method != "POST" or path != "/v1/traces":
            return reply_error(h, HTTPStatus.NOT_FOUND, "unknown path", close=True)
        if not authorized(self._token, h.headers.get("Authorization")):
            return reply_error(h, HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token", close=True)
        if length < 0:
            return reply_error(h, HTTPStatus.LENGTH_REQUIRED, "Content-Length required", close=True)
        if length > self._max_body:
            return reply_error(h, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {self._max_body} bytes",
                               close=True)
        body = h.rfile.read(length)
        if content_type not in (PROTOBUF, JSON):
            return reply_error(h, HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"use {PROTOBUF} or {JSON}")
        try:
            if content_type == JSON:  # kept as protobuf, like every other request
                self._consume(SpanBatch.of(decode_json(body)))
            else:
                self._consume(SpanBatch.decode(body))
        except PermanentError as exc:
            return reply_error(h, HTTPStatus.BAD_REQUEST, str(exc))
        except RetryLater as exc:
            return reply_error(h, HTTPStatus.SERVICE_UNAVAILABLE, f"try again: {exc}")
        except Exception:
            logger.exception("kvtrace receiver: consumer failed")
            return reply_error(h, HTTPStatus.SERVICE_UNAVAILABLE, "try again")
        if content_type == JSON:
            return reply(h, HTTPStatus.OK, b"{}", JSON)
        reply(h, HTTPStatus.OK, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(), PROTOBUF)

    def _exchange_clock(self, h: BaseHTTPRequestHandler, length: int, arrived: int) -> None:
        if not authorized(self._token, h.headers.get("Authorization")):
            return reply_error(h, HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token", close=True)
        if not 0 <= length <= 4096:
            return reply_error(h, HTTPStatus.BAD_REQUEST, "a clock exchange is a small JSON object", close=True)
        try:
            answer = self._clock(h.rfile.read(length), arrived)
        except ValueError as exc:
            return reply_error(h, HTTPStatus.BAD_REQUEST, str(exc))
        reply(h, HTTPStatus.OK, answer, JSON)


# --------------------------------------------------------------------------------------
# gRPC
# --------------------------------------------------------------------------------------


class _TraceService:
    """``TraceService/Export`` taking raw bytes, so a malformed message is our INVALID_ARGUMENT
    rather than grpcio's INTERNAL deserialisation error."""

    def __init__(self, consume: Consumer, bearer_token: str | None, clock: ClockExchange | None = None) -> None:
        self._consume = consume
        self._token = bearer_token
        self._clock = clock

    def handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        export = grpc.unary_unary_rpc_method_handler(
            self.export, request_deserializer=None,
            response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)
        handlers = [grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": export})]
        if self._clock is not None:
            service, method = CLOCK_GRPC_METHOD.strip("/").split("/")
            handlers.append(grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(
                self.exchange_clock, request_deserializer=None, response_serializer=None)}))
        return tuple(handlers)

    def exchange_clock(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        arrived = time.time_ns()
        if not authorized(self._token, dict(context.invocation_metadata()).get("authorization")):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            return self._clock(raw, arrived)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def export(self, raw: bytes, context: grpc.ServicerContext):
        metadata = dict(context.invocation_metadata())
        if not authorized(self._token, metadata.get("authorization")):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            self._consume(SpanBatch.decode(raw))
        except PermanentError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RetryLater as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"try again: {exc}")
        except Exception:
            logger.exception("kvtrace receiver: consumer failed")
            context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpGrpcReceiver:
    """``opentelemetry.proto.collector.trace.v1.TraceService/Export``.

    Messages over ``max_message_bytes`` are refused by gRPC itself with RESOURCE_EXHAUSTED.
    """

    def __init__(self, consume: Consumer, host: str = "127.0.0.1", port: int = 4317, *,
                 max_message_bytes: int = DEFAULT_MAX_BODY_BYTES, bearer_token: str | None = None,
                 workers: int = 4, tls: tuple[str, str] | None = None, clock: ClockExchange | None = None) -> None:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtrace-otlp-grpc",
                                       initializer=name_os_thread),
            options=[("grpc.max_receive_message_length", max_message_bytes)],
        )
        self._server.add_generic_rpc_handlers(_TraceService(consume, bearer_token, clock).handlers())
        if tls is not None:  # (certificate file, key file)
            cert, key = (open(path, "rb").read() for path in tls)
            credentials = grpc.ssl_server_credentials([(key, cert)])
            self._port = self._server.add_secure_port(f"{host}:{port}", credentials)
        else:
            self._port = self._server.add_insecure_port(f"{host}:{port}")
        if self._port == 0:
            raise OSError(f"could not bind the OTLP/gRPC receiver to {host}:{port}")

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        self._server.start()

    def shutdown(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()
