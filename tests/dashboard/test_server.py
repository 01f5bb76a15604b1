"""The dashboard's ASGI middleware (dashboard/server.py) on a stand-in app: which responses it rewrites
and how. The page's script itself runs in Chromium (test_browser.py), on the real server too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from streamlit import config
from streamlit.web import cli

from kvtrace.dashboard import launch
from kvtrace.dashboard.server import PinBackendBase, backend_base_script
from kvtrace.testbed.launch import free_port
from tests.helpers import wait_until

PAGE = "<!DOCTYPE html><html><head><title>x</title></head><body><script type=module src=./a.js></script></body></html>"
HTML = {"accept": "text/html,application/xhtml+xml"}


def _client() -> tuple[TestClient, list[dict]]:
    seen: list[dict] = []  # the request headers the app behind the middleware got

    async def page(request):
        seen.append(dict(request.headers))
        return HTMLResponse(PAGE)

    async def api(request):
        seen.append(dict(request.headers))
        return JSONResponse({"ok": True})

    async def not_modified(request):
        return Response(status_code=304, headers={"content-type": "text/html"})

    app = Starlette(routes=[Route("/_stcore/health", api), Route("/cached", not_modified),
                            Route("/{path:path}", page, methods=["GET", "POST"])])
    return TestClient(PinBackendBase(app)), seen


@pytest.mark.parametrize("path", ["/", "/health", "/trace", "/kv/stages/"])
def test_each_page_gets_the_script_right_after_head_with_the_path_the_server_saw(path):
    client, seen = _client()
    response = client.get(f"{path}?trace_id=abc", headers={**HTML, "accept-encoding": "gzip"})
    assert response.status_code == 200
    body = response.text
    script = backend_base_script(path, "/").decode()
    assert body == PAGE.replace("<head>", "<head>" + script, 1)
    assert f"location.pathname, {json.dumps(path)}, \"/\"" in script  # no query string in the path
    assert int(response.headers["content-length"]) == len(response.content)
    assert "accept-encoding" not in seen[0]  # asked uncompressed: the page is rewritten, not unzipped


def test_a_request_path_cannot_close_the_script():
    """Browsers percent-encode "<" in a path, other clients need not: the raw path, straight into the ASGI app."""
    async def page(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": PAGE.encode()})

    hostile = b"/x</script><script>alert(1)</script>"
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": hostile.decode(), "raw_path": hostile,
             "headers": [(b"accept", b"text/html")]}
    asyncio.run(PinBackendBase(page)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert "/x\\u003c/script>\\u003cscript>alert(1)\\u003c/script>" in body  # the path, as a string's text
    assert body.count("</script>") == PAGE.count("</script>") + 1  # only the script's own end


def test_everything_but_a_page_passes_through_untouched():
    client, seen = _client()
    api = client.get("/_stcore/health", headers={"accept-encoding": "gzip"})
    assert api.json() == {"ok": True} and seen[-1]["accept-encoding"] == "gzip"
    assert client.get("/health").text == PAGE  # no text/html in Accept: a script's fetch, not a page
    assert client.post("/health", headers=HTML).text == PAGE
    cached = client.get("/cached", headers=HTML)  # the browser keeps the page it had, rewritten already
    assert cached.status_code == 304 and cached.content == b""


def test_the_servers_base_url_path_is_the_scripts_base(monkeypatch):
    monkeypatch.setattr(config, "get_option", lambda name: "/kv/" if name == "server.baseUrlPath" else None)
    client, _ = _client()
    assert backend_base_script("/kv/health", "/kv/").decode() in client.get("/kv/health", headers=HTML).text


def test_the_dashboard_command_is_one_streamlit_takes_serving_the_middleware_without_post_run_gc():
    """Streamlit's own CLI parses ``kvtrace dashboard``'s command line (an option it does not know fails here)."""
    args = launch.command("127.0.0.1", 8501)[3:]  # after "python -m streamlit"
    assert args[:2] == ["run", str(launch.SERVER)]
    context = cli.main_run.make_context("run", args[1:])
    assert context.params["runner_postScriptGC"] is False
    assert context.params["server_fileWatcherType"] == "none"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_kvtrace_dashboard_stops_its_server_at_once_and_cleanly(tmp_path, sig):
    """A process manager's TERM (or Ctrl-C) to ``kvtrace dashboard``: it and its Streamlit server are gone
    within seconds, exit 0, no traceback. The TERM handler once stopped the server from inside the signal
    handler, while ``process.wait()`` held the child's lock: the server could not be reaped, and it took
    15 s, a SIGKILL, exit 1 and a TimeoutExpired traceback."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kvtrace", "dashboard", "--db", str(tmp_path / "none.duckdb"),
                                "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        def listening() -> list[psutil.Process]:
            """The child serving ``port``. A child gone meanwhile is skipped: the test once died here of
            NoSuchProcess, with nothing said about why the server had gone (now it fails with its output)."""
            found = []
            for child in psutil.Process(process.pid).children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if any(c.laddr.port == port for c in child.net_connections("tcp")):
                        found.append(child)
            return found

        if not wait_until(lambda: listening() or process.poll() is not None, 60) or process.poll() is not None:
            process.kill()
            pytest.fail(f"kvtrace dashboard's server never listened on {port}: {process.communicate()[0]}")
        server = listening()
        stopped = time.monotonic()
        process.send_signal(getattr(signal, sig))
        output, _ = process.communicate(timeout=30)
        assert time.monotonic() - stopped < 5, output
        assert process.returncode == 0 and "Traceback" not in output, output
        assert not psutil.wait_procs(server, timeout=5)[1]  # the server too
    finally:
        if process.poll() is None:
            process.kill()
