"""The HTTP plumbing the collector's servers share: a threaded server on 127.0.0.1 unless told
otherwise, optional TLS, an optional bearer token, and JSON error bodies.

Used by the OTLP/HTTP receiver (:mod:`.receivers`) and the read-only query endpoint
(:mod:`.query_service`), so both take the same ``--token`` and ``--tls-cert/--tls-key``.
"""

from __future__ import annotations

import hmac
import json
import logging
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from .threads import name_os_thread

logger = logging.getLogger(__name__)

JSON = "application/json"


def authorized(expected_token: str | None, header: str | None) -> bool:
    """Whether an ``Authorization`` header carries the expected bearer token (constant time)."""
    if expected_token is None:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {expected_token}".encode())


class HttpServer:
    """``handle(method, handler)`` is called on a server thread for every request."""

    def __init__(self, handle: Callable[[str, BaseHTTPRequestHandler], None], host: str, port: int, *,
                 name: str, tls: tuple[str, str] | None = None) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler_class(handle))
        self._server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:  # (certificate file, key file)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._name = name
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        host = self._server.server_address[0]
        return f"{self.scheme}://{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        name_os_thread()
        self._server.serve_forever()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def _handler_class(handle: Callable[[str, BaseHTTPRequestHandler], None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30  # a client that stops sending mid-body cannot hold a thread forever
        disable_nagle_algorithm = True  # headers and body go out in two writes

        def log_message(self, fmt: str, *args: Any) -> None:  # keep request lines out of logs
            logger.debug(fmt, *args)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            handle("GET", self)

        def do_POST(self) -> None:  # noqa: N802
            handle("POST", self)

    return Handler


def reply(h: BaseHTTPRequestHandler, status: HTTPStatus, body: bytes, content_type: str, *,
          close: bool = False, headers: dict[str, str] | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(body)))
    for key, value in (headers or {}).items():
        h.send_header(key, value)
    if close:  # an unread body would be taken for the next request
        h.send_header("Connection", "close")
        h.close_connection = True
    h.end_headers()
    h.wfile.write(body)


def reply_error(h: BaseHTTPRequestHandler, status: HTTPStatus, message: str, *, close: bool = False) -> None:
    """A failure as OTLP/HTTP writes it: a google.rpc.Status-like JSON body."""
    reply(h, status, json.dumps({"code": int(status), "message": message}).encode(), JSON, close=close)
