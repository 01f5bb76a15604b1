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
import hmac
import json
import logging
import ssl
import threading
from collections.abc import Callable
from concurrent import futures
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from .model import PermanentError, SpanBatch

logger = logging.getLogger(__name__)

ExportRequest = trace_service_pb2.ExportTraceServiceRequest
Consumer = Callable[[SpanBatch], None]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


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


def _authorized(expected_token: str | None, header: str | None) -> bool:
    if expected_token is None:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {expected_token}".encode())


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------


class OtlpHttpReceiver:
    """``POST /v1/traces`` with ``application/x-protobuf`` or ``application/json`` bodies."""

    def __init__(self, consume: Consumer, host: str = "127.0.0.1", port: int = 4318, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, bearer_token: str | None = None,
                 tls: tuple[str, str] | None = None) -> None:
        self._consume = consume
        self._max_body = max_body_bytes
        self._token = bearer_token
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._scheme = "http"
        if tls is not None:  # (certificate file, key file)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self._scheme = "https"
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self.port}/v1/traces"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtrace-otlp-http",
                                        daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30  # a client that stops sending mid-body cannot hold a thread forever
            disable_nagle_algorithm = True  # headers and body go out in two writes

            def log_message(self, fmt: str, *args: Any) -> None:  # keep request lines out of logs
                logger.debug(fmt, *args)

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                receiver._handle(self)

        return Handler

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            length = int(h.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if h.path.split("?")[0] != "/v1/traces":
            return self._reply(h, HTTPStatus.NOT_FOUND, "unknown path", content_type, close=True)
        if not _authorized(self._token, h.headers.get("Authorization")):
            return self._reply(h, HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token",
                               content_type, close=True)
        if length < 0:
            return self._reply(h, HTTPStatus.LENGTH_REQUIRED, "Content-Length required", content_type,
                               close=True)
        if length > self._max_body:
            return self._reply(h, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"body over {self._max_body} bytes", content_type, close=True)
        body = h.rfile.read(length)
        if content_type not in (PROTOBUF, JSON):
            return self._reply(h, HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                               f"use {PROTOBUF} or {JSON}", content_type)
        try:
            if content_type == JSON:  # kept as protobuf, like every other request
                self._consume(SpanBatch.of(decode_json(body)))
            else:
                self._consume(SpanBatch.decode(body))
        except PermanentError as exc:
            return self._reply(h, HTTPStatus.BAD_REQUEST, str(exc), content_type)
        except RetryLater as exc:
            return self._reply(h, HTTPStatus.SERVICE_UNAVAILABLE, f"try again: {exc}", content_type)
        except Exception:
            logger.exception("kvtrace receiver: consumer failed")
            return self._reply(h, HTTPStatus.SERVICE_UNAVAILABLE, "try again", content_type)
        self._reply(h, HTTPStatus.OK, None, content_type)

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: HTTPStatus, message: str | None, content_type: str,
               close: bool = False) -> None:
        if status == HTTPStatus.OK:
            payload_type = JSON if content_type == JSON else PROTOBUF
            body = b"{}" if payload_type == JSON else trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        else:  # OTLP/HTTP: failures carry a google.rpc.Status-like message
            payload_type = JSON
            body = json.dumps({"code": int(status), "message": message}).encode()
        h.send_response(status)
        h.send_header("Content-Type", payload_type)
        h.send_header("Content-Length", str(len(body)))
        if close:  # the unread body would be taken for the next request
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        h.wfile.write(body)


# --------------------------------------------------------------------------------------
# gRPC
# --------------------------------------------------------------------------------------


class _TraceService:
    """``TraceService/Export`` taking raw bytes, so a malformed message is our INVALID_ARGUMENT
    rather than grpcio's INTERNAL deserialisation error."""

    def __init__(self, consume: Consumer, bearer_token: str | None) -> None:
        self._consume = consume
        self._token = bearer_token

    def handler(self) -> grpc.GenericRpcHandler:
        export = grpc.unary_unary_rpc_method_handler(
            self.export, request_deserializer=None,
            response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": export})

    def export(self, raw: bytes, context: grpc.ServicerContext):
        metadata = dict(context.invocation_metadata())
        if not _authorized(self._token, metadata.get("authorization")):
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
                 workers: int = 4, tls: tuple[str, str] | None = None) -> None:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtrace-otlp-grpc"),
            options=[("grpc.max_receive_message_length", max_message_bytes)],
        )
        self._server.add_generic_rpc_handlers((_TraceService(consume, bearer_token).handler(),))
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
