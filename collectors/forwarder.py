"""Tee to the APM people already run: every span, unchanged, to one or more OTLP endpoints
(and, queued by the pipeline, the ``kvtrace.breakdown`` span of each decided trace:
:mod:`.breakdown_span`).

Each upstream has its own bounded queue and daemon thread, so an upstream that is down or
slow only fills its own queue (oldest dropped first, counted) and never slows ingestion or
the local store. Retryable failures (gRPC UNAVAILABLE and friends, HTTP 429/502/503/504,
connection errors) back off exponentially up to ``max_retry_s``; others are dropped at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import grpc
import requests as http

logger = logging.getLogger(__name__)

_RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
_RETRYABLE_HTTP = {429, 502, 503, 504}
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class PermanentForwardError(Exception):
    pass


@dataclass
class ForwarderStats:
    forwarded_requests: int = 0
    forwarded_spans: int = 0
    failures: int = 0  # attempts that failed
    dropped: int = 0  # requests given up on (permanent error, retries exhausted, queue full)


class Upstream:
    """One OTLP endpoint: ``grpc://host:port`` / ``http://host:port`` (gRPC unless the path or
    ``protocol`` says HTTP: ``http://host:4318/v1/traces``)."""

    def __init__(self, url: str, *, protocol: str | None = None, headers: dict[str, str] | None = None,
                 timeout_s: float = 10.0, queue_size: int = 10_000, max_retry_s: float = 60.0) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https", "grpc") or not parsed.hostname:
            raise ValueError(f"--forward {url!r}: expected grpc://host:port or http(s)://host:port[/v1/traces]")
        self.url = url
        self.protocol = protocol or ("http" if parsed.path.rstrip("/").endswith("/v1/traces") else "grpc")
        self._headers = headers or {}
        self._timeout = timeout_s
        self._max_retry_s = max_retry_s
        self._queue: collections.deque = collections.deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._stop = False
        self.stats = ForwarderStats()
        if self.protocol == "grpc":
            target = f"{parsed.hostname}:{parsed.port or 4317}"
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials()) if parsed.scheme == "https" \
                else grpc.insecure_channel(target)
            self._channel = channel
            # The bytes as received go out as they are: no parse, no re-serialization.
            self._export = channel.unary_unary(_EXPORT_METHOD, request_serializer=None,
                                               response_deserializer=None)
        else:
            self._channel = None
            self._session = http.Session()
            self._http_url = url if parsed.path and parsed.path != "/" else url.rstrip("/") + "/v1/traces"
        self._thread = threading.Thread(target=self._run, name=f"kvtrace-forward-{parsed.hostname}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop after trying what is queued, for at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
        if self._channel is not None:
            self._channel.close()

    def consume(self, payload: bytes, spans: int) -> None:
        """Queue one serialized ``ExportTraceServiceRequest`` holding ``spans`` spans."""
        with self._cond:
            if len(self._queue) >= self._queue_size:
                self._queue.popleft()
                self.stats.dropped += 1
            self._queue.append((payload, spans, time.monotonic()))
            self._cond.notify()

    def backlog(self) -> int:
        return len(self._queue)

    def _run(self) -> None:
        backoff = 0.1
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                if self._stop:  # shutting down: one last try each, no waiting
                    backoff = 0.0
                payload, spans, queued_at = self._queue[0]
            try:
                self._send(payload)
            except PermanentForwardError as exc:
                logger.warning("kvtrace forwarder %s: dropped a batch: %s", self.url, exc)
                self._finish(dropped=True)
                continue
            except Exception as exc:  # retryable
                self.stats.failures += 1
                if time.monotonic() - queued_at > self._max_retry_s or self._stop:
                    logger.warning("kvtrace forwarder %s: giving up on a batch: %s", self.url, exc)
                    self._finish(dropped=True)
                    continue
                with self._cond:
                    self._cond.wait(backoff)
                backoff = min(max(backoff, 0.1) * 2, 5.0)
                continue
            backoff = 0.1
            self.stats.forwarded_requests += 1
            self.stats.forwarded_spans += spans
            self._finish(dropped=False)

    def _finish(self, dropped: bool) -> None:
        with self._cond:
            if self._queue:
                self._queue.popleft()
            if dropped:
                self.stats.dropped += 1
            self._cond.notify_all()

    def _send(self, payload: bytes) -> None:
        if self.protocol == "grpc":
            try:
                self._export(payload, timeout=self._timeout, metadata=list(self._headers.items()))
            except grpc.RpcError as exc:
                if exc.code() in _RETRYABLE_GRPC:
                    raise
                raise PermanentForwardError(f"{exc.code().name}: {exc.details()}") from None
            return
        response = self._session.post(self._http_url, data=payload, timeout=self._timeout,
                                      headers={"Content-Type": "application/x-protobuf", **self._headers})
        if response.status_code in _RETRYABLE_HTTP:
            raise ConnectionError(f"HTTP {response.status_code}")
        if response.status_code >= 300:
            raise PermanentForwardError(f"HTTP {response.status_code}: {response.text[:200]}")
