"""The collector pipeline: receivers (decode, check) → write-ahead log → store + assembler →
attribution, with a tee to upstream APMs: the spans as received, and each decided trace's
breakdown as one more span in it.

``consume`` (called by a receiver thread with a decoded :class:`SpanBatch`) only reserves
queue space, appends the request's bytes to the write-ahead log and enqueues the batch;
the sender is acknowledged after that, and a full queue answers "try again" (503 /
UNAVAILABLE) before anything is written. One pipeline thread does the rest, so ingestion
is decoupled from the store, the attribution and every upstream (the tee sends the bytes
as received). Start order is downstream first; shutdown is upstream first, flushing each stage.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import queue
import threading
import time
import zlib
from typing import Any

from kvtrace.telemetry import semconv
from kvtrace.telemetry.versions import installed_version

from .assembler import Assembler
from .attribution import Attributor
from .breakdown import Breakdown
from .breakdown_span import BreakdownSpans
from .clocks import ClockBook
from .config import CollectorConfig
from .forwarder import Upstream
from .metrics import CollectorMetrics
from .model import DECODER, PermanentError, SpanBatch, SpanRow, rebuild_request, spans_at
from .query_service import QueryService
from .receivers import OtlpGrpcReceiver, OtlpHttpReceiver, RetryLater
from .store import Store
from .wal import WriteAheadLog

logger = logging.getLogger(__name__)


HEALTH_INTERVAL_S = 5.0
BREAKDOWN_BATCH_SPANS = 512  # breakdown spans per export request (tee-all mode) ...
BREAKDOWN_BATCH_WAIT_S = 0.2  # ... or fewer, once the first has waited this long
MAX_REVISIONS_KEPT = 100_000
_RUN_SPAN = semconv.SPAN_RUN  # forwarded traces whose breakdown revision is remembered


class Busy(RetryLater):
    """The pipeline is full: the receiver answers 503 / UNAVAILABLE, and the sender retries."""


class PortInUse(ValueError):
    """A listener could not bind its port; the message names the flag, the address and what to do."""


@contextlib.contextmanager
def _listening(flag: str, host: str, port: int):
    """Turn a failed bind (the socket's OSError, or grpcio's RuntimeError) into :class:`PortInUse`."""
    try:
        yield
        return
    except OSError as exc:
        why = exc.strerror or str(exc)
    except RuntimeError as exc:
        if "Failed to bind" not in str(exc):
            raise
        why = "in use, or not allowed"
    raise PortInUse(f"--{flag} {port}: cannot listen on {host}:{port} ({why}); another process may hold it: "
                    f"pick another port, or -1 to turn it off")


class Collector:
    def __init__(self, config: CollectorConfig) -> None:
        config.validate()
        self.config = config
        self.store = Store(config.db_path)
        self.wal = WriteAheadLog(config.wal_path, fsync=config.fsync, archive_bytes=config.archive_bytes)
        self._next_release = 0.0
        self.metrics = CollectorMetrics()
        self.clocks = ClockBook(on_sample=self.store.add_clock_sample)
        self.attributor = Attributor(self.clocks)
        self.assembler = Assembler(self._on_trace, decision_wait_s=config.decision_wait_s,
                                   max_age_s=config.max_age_s, max_traces=config.max_traces,
                                   decided_cache=min(config.max_traces, 2_000))
        self.upstreams = [Upstream(url) for url in config.forward]
        self._tee_all = any(p.kind == "all" for p in config.forward_policies)
        self._breakdown_spans = BreakdownSpans(segments=config.forward_critical_path,
                                               version=installed_version("kvtrace") or "") \
            if self.upstreams and config.forward_breakdown else None
        # Per forwarded trace, the revision of the last breakdown sent (bounded: the oldest go first).
        self._revisions: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        # Tee-all mode: breakdown spans waiting to go out together as one export request.
        self._outgoing: list[bytes] = []
        self._outgoing_spans = 0
        self._outgoing_since = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.BoundedSemaphore(config.queue_requests)
        self._stop = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvtrace-pipeline", daemon=True)
        self.receivers: list[Any] = []
        self.query_service: QueryService | None = None
        self._replaying = False
        self._next_health = 0.0
        self.metrics.watch(self)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        c = self.config
        # The pipeline allocates many short-lived objects per span; the default gen-0
        # threshold (700) makes the cyclic GC scan the growing heap far too often.
        gc.set_threshold(50_000, 20, 20)
        if DECODER != "native":
            logger.warning("kvtrace collector: the native OTLP decoder is not built (no C compiler at install?); "
                           "decoding in Python, several times slower")
        self.store.start(installed_version("kvtrace") or "unknown",
                         {k: v for k, v in vars(c).items() if k != "bearer_token"})
        for upstream in self.upstreams:
            upstream.start()
        self._replay()
        self._thread.start()
        if c.metrics_port is not None:
            with _listening("metrics-port", c.host, c.metrics_port):
                self.metrics.serve(c.metrics_port, c.host)
        if c.grpc_port is not None:
            with _listening("grpc-port", c.host, c.grpc_port):
                self.receivers.append(OtlpGrpcReceiver(self.consume, c.host, c.grpc_port, bearer_token=c.bearer_token,
                                                       max_message_bytes=c.max_body_bytes, tls=self._tls(),
                                                       clock=self.clocks.exchange))
        if c.http_port is not None:
            with _listening("http-port", c.host, c.http_port):
                self.receivers.append(OtlpHttpReceiver(self.consume, c.host, c.http_port, bearer_token=c.bearer_token,
                                                       max_body_bytes=c.max_body_bytes, tls=self._tls(),
                                                       clock=self.clocks.exchange))
        for receiver in self.receivers:
            receiver.start()
        if c.query_port is not None:
            with _listening("query-port", c.host, c.query_port):
                self.query_service = QueryService(self.store, self.status, self.trace_originals, host=c.host,
                                                  port=c.query_port, bearer_token=c.bearer_token, tls=self._tls())
            self.query_service.start()

    def _tls(self) -> tuple[str, str] | None:
        return (self.config.tls_cert, self.config.tls_key) if self.config.tls_cert else None

    def shutdown(self) -> None:
        """Upstream first, each stage flushed; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for receiver in self.receivers:
            receiver.shutdown()
        if self.query_service is not None:
            self.query_service.shutdown()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.assembler.poll(flush_all=True)
        self._send_breakdowns()
        for upstream in self.upstreams:
            upstream.shutdown()
        self.store.add_health(self.status())  # the final counts, forwarding included
        self.store.shutdown()
        self.wal.close()

    # ------------------------------------------------------------------ ingestion (receiver threads)

    def consume(self, batch: SpanBatch) -> None:
        if not self._slots.acquire(blocking=False):
            self.metrics.rejected("busy")
            raise Busy("pipeline full")
        try:
            position = self.wal.append(batch.payload)
        except Exception:
            self._slots.release()
            raise
        self._queue.put((position, batch))

    # ------------------------------------------------------------------ pipeline thread

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                position, batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                self.assembler.poll()
                self._send_breakdowns(due_only=True)
                continue
            try:
                self._process(batch, position)
            except Exception:
                logger.exception("kvtrace collector: could not process a request")
                self.metrics.rejected("processing_error")
            finally:
                self._slots.release()
            self.assembler.poll()  # cheap: it looks only at traces that are ready
            self._send_breakdowns(due_only=True)
            self._release_log()
            self._record_health()

    def _record_health(self) -> None:
        """Every few seconds: the collector's counters into the store (the dashboard's Health page)."""
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + HEALTH_INTERVAL_S
            self.store.add_health(self.status())

    def status(self) -> dict[str, float]:
        """What the collector knows of itself now: counters, backlog and how far behind the store is."""
        stats = self.assembler.stats
        committed = self.store.committed_at
        return {
            **self.metrics.counts(),
            "traces_decided": stats.traces_decided, "traces_late": stats.traces_late,
            "traces_evicted": stats.traces_evicted, "duplicate_spans": stats.duplicate_spans,
            "forwarded_spans": sum(u.stats.forwarded_spans for u in self.upstreams),
            "forward_failures": sum(u.stats.failures for u in self.upstreams),
            "forward_dropped": sum(u.stats.dropped for u in self.upstreams),
            "pending_traces": self.assembler.pending(), "queued_requests": self._queue.qsize(),
            "lag_ms": (time.time() - committed) * 1e3 if committed else 0.0,
        }

    def _release_log(self) -> None:
        """Every 10 s: let the log drop applied segments beyond its archive size."""
        now = time.monotonic()
        if now >= self._next_release and self.store.committed_position is not None:
            self._next_release = now + 10.0
            self.wal.release(self.store.committed_position)

    def _process(self, batch: SpanBatch, position: tuple[int, int] | None) -> None:
        self.metrics.spans_received(len(batch.rows))
        self.store.add_spans(batch, position)
        self.assembler.add(batch.rows)
        if self._tee_all and not self._replaying:
            for upstream in self.upstreams:
                upstream.consume(batch.payload, len(batch.rows))

    def _on_trace(self, trace_id: bytes, spans: list[SpanRow], late: bool) -> None:
        if spans[0].name == _RUN_SPAN:  # a run record, in a trace of its own: no request to attribute
            for span in spans:
                if span.name == _RUN_SPAN and span.origin.run_id:
                    self.store.add_run(span.origin.run_id, str(span.attrs.get(semconv.RUN_CONFIG) or "{}"), span.end)
            return
        trace_hex = trace_id.hex()
        if self._replaying:
            spans = self._with_stored(trace_hex, spans)
        try:
            breakdown = self.attributor.attribute(trace_hex, spans)
        except Exception:  # one odd trace must not stop the others (its spans are stored)
            logger.exception("kvtrace collector: could not attribute trace %s", trace_hex)
            self.metrics.rejected("attribution_error")
            return
        if breakdown is None:  # no kvtrace span (vLLM's own tracing alone): its spans are kept, no request row
            return
        self.store.add_breakdown(breakdown, replaces=late or self._replaying)
        self.metrics.trace(breakdown, late)
        if self.upstreams and not self._replaying:
            self._forward_decided(trace_id, spans, breakdown, late)

    # ------------------------------------------------------------------ forwarding what was decided

    def _forward_decided(self, trace_id: bytes, spans: list[SpanRow], breakdown: Breakdown, late: bool) -> None:
        """Tee-all: the spans went out as received; add the trace's breakdown span. Tail policies:
        the trace's spans as received, with its breakdown span, if a policy selects it.

        A trace decided again (late spans) whose breakdown went out gets the next revision, which
        names the one it supersedes; one decided again without the assembler remembering it
        (``late`` false) keeps its first breakdown, as the store does."""
        revision = self._revisions.get(trace_id, 0)
        if revision and not late:
            return
        if not (self._tee_all or revision or self._selected(breakdown)):
            return
        encoded, count = b"", 0
        if self._breakdown_spans is not None:
            revision += 1
            self._revisions[trace_id] = revision
            self._revisions.move_to_end(trace_id)
            if len(self._revisions) > MAX_REVISIONS_KEPT:
                self._revisions.popitem(last=False)
            encoded, count = self._breakdown_spans.encode(trace_id, breakdown, revision)
        if self._tee_all:
            if count:
                if not self._outgoing:
                    self._outgoing_since = time.monotonic()
                self._outgoing.append(encoded)
                self._outgoing_spans += count
                if self._outgoing_spans >= BREAKDOWN_BATCH_SPANS:
                    self._send_breakdowns()
            return
        payload = rebuild_request(spans) + (self._breakdown_spans.request(encoded) if count else b"")
        for upstream in self.upstreams:
            upstream.consume(payload, len(spans) + count)

    def _send_breakdowns(self, due_only: bool = False) -> None:
        """Tee-all: the waiting breakdown spans as one export request to every upstream (with
        ``due_only``, only once the batch is full or its first span has waited long enough)."""
        if not self._outgoing or (due_only and time.monotonic() - self._outgoing_since < BREAKDOWN_BATCH_WAIT_S):
            return
        payload = self._breakdown_spans.request(b"".join(self._outgoing))
        count, self._outgoing, self._outgoing_spans = self._outgoing_spans, [], 0
        for upstream in self.upstreams:
            upstream.consume(payload, count)

    def _selected(self, breakdown: Breakdown) -> bool:
        for policy in self.config.forward_policies:
            if policy.kind == "errors" and breakdown.error:
                return True
            if policy.kind == "slow" and breakdown.ttft_ns >= policy.value * 1e6:
                return True
            if policy.kind == "ratio" and (zlib.crc32(breakdown.trace_id.encode()) / 2**32) < policy.value:
                return True
        return False

    # ------------------------------------------------------------------ restart

    def _replay(self) -> None:
        """Apply what the log holds beyond the store's last commit (after a crash or kill)."""
        after = self.store.wal_position()
        self._replaying = True
        replayed = 0
        try:
            for position, payload in self.wal.replay(after):
                try:
                    batch = SpanBatch.decode(payload)
                except PermanentError as exc:  # accepted by another version's decoder: skip, never crash-loop
                    logger.error("kvtrace collector: a logged request no longer decodes (%s); skipped", exc)
                    self.metrics.rejected("replay_undecodable")
                    continue
                self._process(batch, position)
                replayed += 1
            self.assembler.poll(flush_all=True)
            self.store.flush()
        finally:
            self._replaying = False
        if replayed:
            logger.info("kvtrace collector: replayed %d requests from the write-ahead log", replayed)
        self.wal.release(self.store.wal_position())

    def _with_stored(self, trace_id: str, spans: list[SpanRow]) -> list[SpanRow]:
        """Spans of this trace committed before the restart (decoded again from their originals
        in the log), so its breakdown is whole."""
        known = {s.span_id for s in spans}
        for row in self._stored_rows(trace_id):
            if row.span_id not in known:
                known.add(row.span_id)
                spans.append(row)
        return spans

    def _stored_rows(self, trace_id: str) -> list[SpanRow]:
        """The trace's committed spans, decoded again from their originals in the log."""
        def gone(segment: int) -> None:
            logger.warning("kvtrace collector: trace %s: originals in log segment %d are gone "
                           "(--archive-gib); only the spans that remain are used", trace_id, segment)
        return spans_at(self.store.stored_originals(trace_id), self.wal.read, gone)

    def trace_originals(self, trace_id: str) -> bytes | None:
        """One OTLP export request with the trace's stored spans as received; None if none are left."""
        rows = list({row.span_id: row for row in self._stored_rows(trace_id)}.values())  # retried spans once
        return rebuild_request(rows) if rows else None
