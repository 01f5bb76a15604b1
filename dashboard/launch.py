"""``kvtrace dashboard``: run the Streamlit app on 127.0.0.1 until Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .settings import Settings

APP = Path(__file__).resolve().parent / "app.py"
"""The Streamlit script: what AppTest runs."""
SERVER = Path(__file__).resolve().parent / "server.py"
"""What ``kvtrace dashboard`` serves: :data:`APP` behind one middleware (see server.py)."""


def command(host: str, port: int) -> list[str]:
    """The Streamlit command line: no browser, no usage statistics, no developer menu, and no full
    garbage collection after each script run (``runner.postScriptGC``): over this process's heap
    (DuckDB, Arrow, Plotly, the cached answers) that collection took ~100 ms of CPU after every page
    load, while the browser was drawing the page on the same machine. Memory without it: RSS 282 ->
    287 MB over 240 page loads (with it, +3.8 MB in 60), the cyclic collector still runs on its own."""
    return [sys.executable, "-m", "streamlit", "run", str(SERVER), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "viewer", "--server.fileWatcherType", "none", "--theme.base", "light",
            "--runner.postScriptGC", "false"]


def start(settings: Settings, host: str = "127.0.0.1", port: int = 8501, *,
          log: int | None = None) -> subprocess.Popen:
    """Start the dashboard as a child process (its own process group, so one signal stops it)."""
    try:
        import plotly  # noqa: F401
        import streamlit  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"the dashboard needs streamlit and plotly: pip install 'kvtrace[dashboard]' ({exc})") \
            from None
    return subprocess.Popen(command(host, port), env={**os.environ, **settings.environ()},
                            stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def serve(*, db: str | None, collector: str | None, token: str | None, host: str, port: int,
          apm_url: str | None, refresh_s: float) -> int:
    settings = Settings(db=db, collector=collector, token=token, apm_url=apm_url, refresh_s=refresh_s)
    try:
        process = start(settings, host, port)
    except RuntimeError as exc:
        print(f"kvtrace dashboard: {exc}", file=sys.stderr)
        return 2
    print(f"kvtrace dashboard: http://{host}:{port}  (reading {db or collector}; Ctrl-C stops it)", file=sys.stderr)
    # A TERM to us ends it too. The handler only leaves process.wait() below: stopping the dashboard from
    # inside it could never reap the child, whose lock that interrupted wait() holds (15 s, then SIGKILL).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        stop(process)  # after Ctrl-C or a TERM; nothing to do when the dashboard exited by itself


def stop(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the dashboard's process group, then SIGKILL whatever is left."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
