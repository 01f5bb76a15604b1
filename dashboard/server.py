"""The dashboard's ASGI entry point: ``streamlit run`` finds :data:`app` here (an ``st.App``) and serves
``app.py`` with uvicorn, with one middleware in front: :class:`PinBackendBase`.

Why: a page opened by its own URL (``/health``, a deep link such as ``/trace?trace_id=...``, a reload)
makes Streamlit's front end guess where the server is. It probes ``/health/_stcore/health`` first,
gets a 404, waits its minimum retry period (100 ms) and only then probes ``/_stcore/health``.
Every full load of every page but the first paid those 100 ms before its WebSocket opened
(measured in Chromium: the socket opened ~230 ms into the load on ``/health`` against ~125 ms on
``/``). Only the server knows which part of the URL is a page, so the page it sends says where the
server is, through the front end's own setting for that (``window.__streamlit.BACKEND_BASE_URL``),
and the front end connects at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import streamlit as st
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from streamlit import config

BACKEND_BASE = """function (here, served, base) {
  // here: the browser's path; served: the same request's path as the server saw it; base: the server's
  // own base path ("/" or "/<server.baseUrlPath>/"). A proxy may have removed a prefix on the way:
  // it is what `here` has in front of `served`. Anything else (a rewritten path): null, and
  // Streamlit probes as it would without this.
  if (here.length < served.length || here.slice(here.length - served.length) !== served) return null;
  return here.slice(0, here.length - served.length) + base;
}"""
"""Where the server is, as a URL path, computed in the page (a function so that a test can run it alone)."""


def backend_base_script(served_path: str, base_path: str) -> bytes:
    """The inline script put at the top of Streamlit's HTML page: sets ``BACKEND_BASE_URL`` unless the
    page's host already did (Streamlit's front end reads it once, when its bundle starts)."""
    # json.dumps escapes quotes and backslashes; "<" too, so that no request path can close the script.
    literal = lambda value: json.dumps(value).replace("<", "\\u003c")  # noqa: E731
    return (f"<script>(function () {{ var s = window.__streamlit || {{}}; if (s.BACKEND_BASE_URL) return; "
            f"var base = ({BACKEND_BASE})(location.pathname, {literal(served_path)}, {literal(base_path)}); "
            "if (base !== null) window.__streamlit = Object.assign({}, s, "
            "{BACKEND_BASE_URL: location.origin + base}); })();</script>").encode()


class PinBackendBase:
    """Pure ASGI middleware: adds :func:`backend_base_script` right after ``<head>`` in every HTML page
    the app serves (Streamlit serves one page, ``index.html``, for every page's URL). Everything else,
    WebSockets included, passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or ())
        if scope["type"] != "http" or scope["method"] != "GET" or b"text/html" not in headers.get(b"accept", b""):
            await self.app(scope, receive, send)
            return
        # A page is ~2 kB: ask for it uncompressed rather than unzip and zip it again.
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"accept-encoding"]}
        served = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1").split("?", 1)[0]
        base_url_path = (config.get_option("server.baseUrlPath") or "").strip("/")
        script = backend_base_script(served, f"/{base_url_path}/" if base_url_path else "/")
        start: Message | None = None
        body: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                response = dict(message.get("headers") or ())
                if (message["status"] == 200 and response.get(b"content-type", b"").startswith(b"text/html")
                        and b"content-encoding" not in response):
                    start = message  # held until the whole body is here: its length changes
                    return
            elif message["type"] == "http.response.body" and start is not None:
                body.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                page = b"".join(body)
                page = page.replace(b"<head>", b"<head>" + script, 1)
                start["headers"] = [(k, v) for k, v in start["headers"] if k != b"content-length"] + [
                    (b"content-length", str(len(page)).encode())]
                await send(start)
                await send({"type": "http.response.body", "body": page})
                return
            await send(message)

        await self.app(scope, receive, rewrite)


APP_SCRIPT = Path(__file__).resolve().with_name("app.py")
app = st.App(str(APP_SCRIPT), middleware=[Middleware(PinBackendBase)])
