"""Other OpenTelemetry collectors, run as real peers for tests and benchmarks.

``Rotel`` runs the ``rotel`` agent (PyPI package ``rotel``: a Rust OTLP collector) on
127.0.0.1 in the foreground of its own process group, with an OTLP or blackhole exporter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .launch import free_port


def rotel_binary() -> str:
    import rotel  # the PyPI wheel carries the agent binary

    path = Path(rotel.__file__).with_name("rotel-agent")
    if not path.exists():
        raise FileNotFoundError(f"rotel agent binary not found at {path}")
    return str(path)


class Rotel:
    def __init__(self, export_to: str | None = None, *, protocol: str = "grpc",
                 batch_timeout: str = "100ms") -> None:
        """``export_to``: an OTLP endpoint URL; None exports to rotel's blackhole."""
        self.grpc_port = free_port()
        self.http_port = free_port()
        self._dir = tempfile.mkdtemp(prefix="kvtrace-rotel-")
        self._command = [
            rotel_binary(), "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--pid-file", os.path.join(self._dir, "rotel.pid"),
            "--log-file", os.path.join(self._dir, "rotel.log"),
            "--batch-timeout", batch_timeout,
        ]
        if export_to is None:
            self._command += ["--exporter", "blackhole"]
        else:
            self._command += ["--exporter", "otlp", "--otlp-exporter-endpoint", export_to,
                              "--otlp-exporter-protocol", protocol]
        self._process: subprocess.Popen | None = None

    @property
    def grpc_endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> "Rotel":
        self._process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL,
                                         stderr=open(os.path.join(self._dir, "stderr.log"), "wb"),
                                         start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.grpc_port), 0.2):
                return self
            if self._process.poll() is not None:
                raise RuntimeError(f"rotel exited with {self._process.returncode}: "
                                   f"{Path(self._dir, 'stderr.log').read_text()[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError("rotel did not start listening")

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(5)
