"""Tee to the APM people already run: every span, unchanged, to one or more OTLP endpoints
(:class:`Upstream`), and what goes out once a trace is decided — its ``kvtrace.breakdown`` span
(:mod:`.breakdown_span`), or the whole trace where a tail policy selects it
(:class:`DecidedTraceForwarder`).

Each upstream has its own bounded queue and daemon thread, so an upstream that is down or
slow only fills its own queue (oldest dropped first, counted) and never slows ingestion or
the local store. Whatever has queued up goes out in one call, up to :data:`MAX_CALL_BYTES`:
serialized ``ExportTraceServiceRequest`` messages concatenated are one message holding all
their ``resource_spans`` (protobuf merges repeated fields), so no byte is parsed or re-encoded;
at OTLP's usual request sizes a gRPC call's fixed cost outweighs its bytes, so fewer, larger
calls cost the collector less CPU per span.
Retryable failures (gRPC UNAVAILABLE and friends, HTTP 429/502/503/504, connection errors)
back off exponentially up to ``max_retry_s``; others are dropped at once.
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

from .breakdown import Breakdown
from .breakdown_span import BreakdownSpans
from .model import SpanRow, rebuild_request
from .threads import name_os_thread

logger = logging.getLogger(__name__)

_RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
_RETRYABLE_HTTP = {429, 502, 503, 504}
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MAX_CALL_BYTES = 1 << 20
"""The most one call carries when several export requests wait (one larger request goes alone):
well under the 4 MiB that OTLP receivers accept by default."""


class PermanentForwardError(Exception):
    pass


@dataclass
class ForwarderStats:
    forwarded_requests: int = 0
    forwarded_spans: int = 0
    failures: int = 0  # attempts that failed
    dropped: int = 0  # requests given up on (permanent error, retries exhausted, queue full)
    calls: int = 0  # calls that delivered (each carrying one or more requests)


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
        self._in_flight = 0  # requests taken off the queue by the call under way
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
            while (self._queue or self._in_flight) and time.monotonic() < deadline:
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
        return len(self._queue) + self._in_flight

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:  # stopping, nothing left
                    return
                batch = [self._queue.popleft()]
                size = len(batch[0][0])
                while self._queue and size + len(self._queue[0][0]) <= MAX_CALL_BYTES:
                    size += len(self._queue[0][0])
                    batch.append(self._queue.popleft())
                self._in_flight = len(batch)
            try:
                self._deliver(batch)
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()

    def _deliver(self, batch: list[tuple[bytes, int, float]]) -> None:
        """One call for the batch, retried while retryable and younger than ``max_retry_s``
        (counted from its oldest request); stopping, one try only."""
        payload = batch[0][0] if len(batch) == 1 else b"".join(item[0] for item in batch)
        queued_at = batch[0][2]
        backoff = 0.1
        while True:
            try:
                self._send(payload)
            except PermanentForwardError as exc:
                logger.warning("kvtrace forwarder %s: dropped %d request(s): %s", self.url, len(batch), exc)
                self.stats.dropped += len(batch)
                return
            except Exception as exc:  # retryable
                self.stats.failures += 1
                if time.monotonic() - queued_at > self._max_retry_s or self._stop:
                    logger.warning("kvtrace forwarder %s: giving up on %d request(s): %s", self.url, len(batch), exc)
                    self.stats.dropped += len(batch)
                    return
                with self._cond:
                    self._cond.wait_for(lambda: self._stop, backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self.stats.calls += 1
            self.stats.forwarded_requests += len(batch)
            self.stats.forwarded_spans += sum(item[1] for item in batch)
            return

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


BREAKDOWN_BATCH_SPANS = 512  # breakdown spans per export request (tee-all mode) ...
BREAKDOWN_BATCH_WAIT_S = 0.2  # ... or fewer, once the first has waited this long
MAX_REVISIONS_KEPT = 100_000


class DecidedTraceForwarder:
    """The pipeline's last stage: what goes upstream once a trace is decided.

    Tee-all (``all`` among the policies): the spans went out as received at ingestion
    (:meth:`consume_batch`); each decided trace adds its ``kvtrace.breakdown`` span, batched into
    export requests of :data:`BREAKDOWN_BATCH_SPANS`. Tail policies (errors, slow, ratio): a trace a
    policy selects goes out whole, as received, with its breakdown span.

    A trace decided again (late spans) whose breakdown went out gets the next revision, which names
    the one it supersedes; one decided again without the assembler remembering it (``late`` false)
    keeps its first breakdown, as the store does.
    """

    def __init__(self, upstreams: list[Upstream], policies: list, breakdown_spans: BreakdownSpans | None) -> None:
        self.upstreams = upstreams
        self.tee_all = any(p.kind == "all" for p in policies)
        self._tail_policies = [p for p in policies if p.kind != "all"]
        self._breakdown_spans = breakdown_spans
        # Per forwarded trace, the revision of the last breakdown sent (bounded: the oldest go first).
        self._revisions: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._outgoing: list[bytes] = []  # tee-all: breakdown spans waiting to go out together
        self._outgoing_spans = 0
        self._outgoing_since = 0.0

    def consume_batch(self, payload: bytes, spans: int) -> None:
        """Ingestion (tee-all): the export request as received, to every upstream."""
        if self.tee_all:
            for upstream in self.upstreams:
                upstream.consume(payload, spans)

    def consume(self, trace_id: bytes, spans: list[SpanRow], breakdown: Breakdown, late: bool) -> None:
        revision = self._revisions.get(trace_id, 0)
        if revision and not late:
            return
        if not (self.tee_all or revision or any(p.selects(breakdown) for p in self._tail_policies)):
            return
        encoded, count = b"", 0
        if self._breakdown_spans is not None:
            revision += 1
            self._revisions[trace_id] = revision
            self._revisions.move_to_end(trace_id)
            if len(self._revisions) > MAX_REVISIONS_KEPT:
                self._revisions.popitem(last=False)
            encoded, count = self._breakdown_spans.encode(trace_id, breakdown, revision)
        if self.tee_all:
            if count:
                if not self._outgoing:
                    self._outgoing_since = time.monotonic()
                self._outgoing.append(encoded)
                self._outgoing_spans += count
                if self._outgoing_spans >= BREAKDOWN_BATCH_SPANS:
                    self.flush()
            return
        payload = rebuild_request(spans) + (self._breakdown_spans.request([encoded]) if count else b"")
        for upstream in self.upstreams:
            upstream.consume(payload, len(spans) + count)

    def flush(self, due_only: bool = False) -> None:
        """Tee-all: the waiting breakdown spans as one export request to every upstream (with
        ``due_only``, only once the batch is full or its first span has waited long enough)."""
        if not self._outgoing or (due_only and time.monotonic() - self._outgoing_since < BREAKDOWN_BATCH_WAIT_S):
            return
        payload = self._breakdown_spans.request(self._outgoing)
        count, self._outgoing, self._outgoing_spans = self._outgoing_spans, [], 0
        for upstream in self.upstreams:
            upstream.consume(payload, count)
