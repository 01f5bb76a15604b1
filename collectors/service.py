"""The collector: its pipeline as a chain, each stage handed the next (the OpenTelemetry Collector's
``consume`` shape), and the lifecycle that starts it downstream first and stops it upstream first.

    receivers ─SpanBatch─▶ Intake (write-ahead log, bounded queue; the sender is acknowledged here)
      ─(batch, log position)─▶ SpanStage (store the spans, tee them as received, assemble)
      ─assembled trace─▶ Decider (attribution) ─Breakdown─▶ store writer and DecidedTraceForwarder

A full queue answers "try again" (503 / UNAVAILABLE) before anything is written. One pipeline
thread runs every stage after the intake, so ingestion is decoupled from the store, the
attribution and every upstream. After a crash the log's unapplied tail is replayed through
the same stages (the tee and the forwarder off: those spans went out before).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtrace.telemetry import semconv
from kvtrace.telemetry.versions import installed_version

from .assembler import Assembler
from .attribution import Attributor
from .breakdown import Breakdown
from .breakdown_span import BreakdownSpans
from .clocks import ClockBook, SharedSamples
from .compiled import running_as_python
from .config import CollectorConfig
from .forwarder import DecidedTraceForwarder, Upstream
from .metrics import CollectorMetrics
from .model import DECODER, PermanentError, SpanBatch, SpanRow, rebuild_request, spans_at
from .query_service import QueryService
from .receivers import OtlpGrpcReceiver, OtlpHttpReceiver, RetryLater
from .clickhouse import ClickHouseStore
from .kafka import KafkaReceiver
from .store import Store
from .threads import name_os_thread
from .wal import WriteAheadLog

logger = logging.getLogger(__name__)


HEALTH_INTERVAL_S = 5.0
GC_YOUNG_THRESHOLD = 500_000
"""Allocations between the cyclic GC's young collections (Python's default is 700): Collector.start says why."""


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


class Intake:
    """Receiver threads' entry: reserve queue space, append the request's bytes to the write-ahead
    log, enqueue; a full queue raises :class:`Busy` before anything is written."""

    def __init__(self, wal: WriteAheadLog, metrics: CollectorMetrics, queue_requests: int) -> None:
        self._wal = wal
        self._metrics = metrics
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.BoundedSemaphore(queue_requests)
        self._in_flight = 0  # consumed and not yet done
        self._idle = threading.Condition()

    def consume(self, batch: SpanBatch) -> None:
        if not self._slots.acquire(blocking=False):
            self._metrics.rejected("busy")
            raise Busy("pipeline full")
        try:
            position = self._wal.append(batch.payload)
        except Exception:
            self._slots.release()
            raise
        with self._idle:
            self._in_flight += 1
        self._queue.put((position, batch))

    def next(self, timeout_s: float) -> tuple[tuple[int, int], SpanBatch] | None:
        """The oldest logged request (the pipeline thread's), or None after ``timeout_s``; :meth:`done` after it."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def done(self) -> None:
        self._slots.release()
        with self._idle:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every request consumed so far went through the pipeline; False after ``timeout_s``."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout_s)

    def queued(self) -> int:
        return self._queue.qsize()


class SpanStage:
    """Each logged request's spans: counted, buffered for the store, teed upstream as received
    (tee-all, not on replay), and handed to the assembler."""

    def __init__(self, metrics: CollectorMetrics, store: Store, forwarder: DecidedTraceForwarder | None,
                 assembler: Assembler, replaying: Callable[[], bool]) -> None:
        self._metrics, self._store, self._forwarder, self._assembler = metrics, store, forwarder, assembler
        self._replaying = replaying

    def consume(self, batch: SpanBatch, position: tuple[int, int] | None) -> None:
        self._metrics.received(len(batch.rows))
        self._store.add_spans(batch, position)
        self._assembler.add(batch.rows)
        if self._forwarder is not None and not self._replaying():
            self._forwarder.consume_batch(batch.payload, len(batch.rows))


class Decider:
    """The assembler's consumer: a run record is stored as a run; a request trace is attributed and
    its breakdown stored, counted and forwarded (not on replay). On replay a trace's spans committed
    before the restart join it (``stored_rows``), so its breakdown is whole."""

    def __init__(self, attributor: Attributor, store: Store, metrics: CollectorMetrics,
                 forwarder: DecidedTraceForwarder | None, replaying: Callable[[], bool],
                 stored_rows: Callable[[str], list[SpanRow]]) -> None:
        self.attributor, self._store, self._metrics, self._forwarder = attributor, store, metrics, forwarder
        self._replaying, self._stored_rows = replaying, stored_rows
        self.on_decided: Callable[[bytes], None] | None = None
        """Told each trace once its decision is in the store's buffers (the Kafka receiver's commits)."""

    def consume(self, trace_id: bytes, spans: list[SpanRow], late: bool) -> None:
        try:
            self._decide(trace_id, spans, late)
        finally:
            if self.on_decided is not None:
                self.on_decided(trace_id)

    def _decide(self, trace_id: bytes, spans: list[SpanRow], late: bool) -> None:
        if spans[0].name == semconv.SPAN_RUN:  # a run record, in a trace of its own: no request to attribute
            for span in spans:
                if span.name == semconv.SPAN_RUN and span.origin.run_id:
                    self._store.add_run(span.origin.run_id, str(span.attrs.get(semconv.RUN_CONFIG) or "{}"), span.end)
            return
        trace_hex = trace_id.hex()
        replaying = self._replaying()
        if replaying:
            spans = _joined(spans, self._stored_rows(trace_hex))
        try:
            breakdown = self.attributor.attribute(trace_hex, spans)
        except Exception:  # one odd trace must not stop the others (its spans are stored)
            logger.exception("kvtrace collector: could not attribute trace %s", trace_hex)
            self._metrics.rejected("attribution_error")
            return
        if breakdown is None:  # no kvtrace span (vLLM's own tracing alone): its spans are kept, no request row
            return
        self._store.add_breakdown(breakdown, replaces=late or replaying)
        self._metrics.trace(breakdown, late)
        if self._forwarder is not None and not replaying:
            self._forwarder.consume(trace_id, spans, breakdown, late)


def _joined(spans: list[SpanRow], stored: list[SpanRow]) -> list[SpanRow]:
    """``spans`` and those of ``stored`` not among them (each span id once)."""
    known = {s.span_id for s in spans}
    extra: dict[bytes, SpanRow] = {}
    for row in stored:  # a span the sender retried is stored twice: its first copy counts
        if row.span_id not in known:
            extra.setdefault(row.span_id, row)
    return spans + list(extra.values())


class Collector:
    """The pipeline's stages wired in order, its thread, its listeners and its health record."""

    def __init__(self, config: CollectorConfig) -> None:
        config.validate()
        self.config = config
        self.store = ClickHouseStore(config.db_path, wal_dir=config.wal_path) if config.shared_store \
            else Store(config.db_path)
        self.wal = WriteAheadLog(config.wal_path, fsync=config.fsync, archive_bytes=config.archive_bytes)
        self.metrics = CollectorMetrics()
        self.clocks = ClockBook(on_sample=self.store.add_clock_sample, measured_by=self.store.collector_run_id)
        # In a fleet, each collector measures the senders whose exchanges reach it; every one reads the rest.
        self.shared_clocks = SharedSamples(self.clocks, self.store.clock_samples_since) if config.shared_store \
            else None
        self.upstreams = [Upstream(url) for url in config.forward]
        # The chain, last stage first: each is handed the next.
        breakdown_spans = BreakdownSpans(segments=config.forward_critical_path,
                                         version=installed_version("kvtrace") or "") \
            if self.upstreams and config.forward_breakdown else None
        self.forwarder = DecidedTraceForwarder(self.upstreams, config.forward_policies, breakdown_spans) \
            if self.upstreams else None
        self._replaying = False
        replaying = lambda: self._replaying  # noqa: E731
        self.decider = Decider(Attributor(self.clocks), self.store, self.metrics, self.forwarder, replaying,
                               self._stored_rows)
        self.assembler = Assembler(self.decider.consume, decision_wait_s=config.decision_wait_s,
                                   max_age_s=config.max_age_s, max_traces=config.max_traces,
                                   decided_cache=min(config.max_traces, 2_000))
        self.spans = SpanStage(self.metrics, self.store, self.forwarder, self.assembler, replaying)
        self.intake = Intake(self.wal, self.metrics, config.queue_requests)
        self._stop = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvtrace-pipeline", daemon=True)
        self.receivers: list[Any] = []
        self.kafka: KafkaReceiver | None = None
        self.query_service: QueryService | None = None
        self._next_release = 0.0
        self._next_health = 0.0
        self.metrics.watch(self)

    @property
    def attributor(self) -> Attributor:
        return self.decider.attributor

    def consume(self, batch: SpanBatch) -> None:
        """What receivers call with each decoded export request (:class:`Intake`)."""
        self.intake.consume(batch)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        c = self.config
        # The pipeline allocates many short-lived objects per span, and holds those of up to a store
        # flush's worth of spans until the flush: a young generation smaller than
        # that is scanned while they all still live. At 50,000 the young collections cost 0.56 µs a span
        # (7 % of the pipeline), at 500,000 none: the pipeline makes no reference cycles (0 found after
        # 210,000 spans), so refcounting frees everything and the young count never reaches it. Garbage in
        # cycles elsewhere waits for 500,000 objects at most.
        gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
        if DECODER != "native":
            logger.warning("kvtrace collector: the native OTLP decoder is not built (no C compiler at install?); "
                           "decoding in Python, several times slower")
        as_python = running_as_python()
        if as_python:
            logger.warning("kvtrace collector: per-trace modules running as Python, not compiled (~1.35x the CPU "
                           "a trace): %s", "; ".join(f"{name}: {why}" for name, why in as_python.items()))
        self.store.start(installed_version("kvtrace") or "unknown",
                         {k: v for k, v in vars(c).items() if k != "bearer_token"})
        for upstream in self.upstreams:
            upstream.start()
        if not c.kafka_brokers:  # from Kafka, the topic is the log: a restart reads on from the last commit
            self._replay()
        if self.shared_clocks is not None:
            self.shared_clocks.start()
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
        if c.kafka_brokers:
            self.kafka = KafkaReceiver(self.consume, brokers=c.kafka_brokers, topic=c.kafka_topic, group=c.kafka_group,
                                       options=c.kafka_options, store_flushes=lambda: self.store.flushes,
                                       flush_store=self.store.flush, forget=self.assembler.forget,
                                       drain=self.intake.drain)
            self.decider.on_decided = self.kafka.decided
            self.receivers.append(self.kafka)
        for receiver in self.receivers:
            receiver.start()
        if c.query_port is not None and not c.shared_store:  # a shared store's readers query it directly
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
        if self.shared_clocks is not None:
            self.shared_clocks.shutdown()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.assembler.poll(flush_all=True)
        if self.forwarder is not None:
            self.forwarder.flush()
        for upstream in self.upstreams:
            upstream.shutdown()
        self.store.add_health(self.status())  # the final counts, forwarding included
        self.store.shutdown()
        self.wal.close()

    # ------------------------------------------------------------------ pipeline thread

    def _run(self) -> None:
        name_os_thread()
        while not (self._stop.is_set() and self.intake.queued() == 0):
            logged = self.intake.next(timeout_s=0.1)
            if logged is not None:
                position, batch = logged
                try:
                    self.spans.consume(batch, position)
                except Exception:
                    logger.exception("kvtrace collector: could not process a request")
                    self.metrics.rejected("processing_error")
                finally:
                    self.intake.done()
            self.assembler.poll()  # cheap: it looks only at traces that are ready
            if self.forwarder is not None:
                self.forwarder.flush(due_only=True)
            if logged is not None:
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
            "pending_traces": self.assembler.pending(), "queued_requests": self.intake.queued(),
            "dropped_decisions": self.store.dropped_decisions,
            "lag_ms": (time.time() - committed) * 1e3 if committed else 0.0,
            **(self.kafka.health() if self.kafka is not None else {}),
        }

    def _release_log(self) -> None:
        """Every 10 s: let the log drop applied segments beyond its archive size."""
        now = time.monotonic()
        if now >= self._next_release and self.store.committed_position is not None:
            self._next_release = now + 10.0
            self.wal.release(self.store.committed_position)

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
                self.spans.consume(batch, position)
                replayed += 1
            self.assembler.poll(flush_all=True)
            self.store.flush()
        finally:
            self._replaying = False
        if replayed:
            logger.info("kvtrace collector: replayed %d requests from the write-ahead log", replayed)
        self.wal.release(self.store.wal_position())

    def _stored_rows(self, trace_id: str) -> list[SpanRow]:
        """The trace's committed spans, decoded again from their originals in the log (a shared
        store keeps them itself)."""
        if self.config.shared_store:
            return self.store.stored_spans(trace_id)

        def gone(segment: int) -> None:
            logger.warning("kvtrace collector: trace %s: originals in log segment %d are gone "
                           "(--archive-gib); only the spans that remain are used", trace_id, segment)
        return spans_at(self.store.stored_originals(trace_id), self.wal.read, gone)

    def trace_originals(self, trace_id: str) -> bytes | None:
        """One OTLP export request with the trace's stored spans as received; None if none are left."""
        rows = list({row.span_id: row for row in self._stored_rows(trace_id)}.values())  # retried spans once
        return rebuild_request(rows) if rows else None
