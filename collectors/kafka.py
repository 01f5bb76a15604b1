"""The fleet's receiver: OTLP export requests from a Kafka topic, read by a group of collectors.

The OpenTelemetry Collector's ``kafka`` exporter with ``encoding: otlp_proto`` and
``partition_traces_by_id: true`` writes each trace's spans (one message per resource and trace) keyed by
the trace id as 32 hex characters, so all of a trace's messages land on one partition and one member of
the consumer group assembles it whole. Each message is handed to the pipeline exactly as an OTLP/HTTP
request would be.

At-least-once, without loss: a partition's offset is committed only up to the first message of its
oldest trace not yet durable, a trace being durable once the store has committed a flush made after its
decision. A restarted or newly assigned member reads from there again; the store is idempotent (spans
collapse on their ids, a request row is versioned by decision), so what is read twice is stored once.
On a rebalance a revoked partition's undecided traces are dropped here and its new owner replays them.

A message whose key is not the trace id of its spans (rotel's kafka exporter sends none) is counted and
warned about once: such a topic can split a trace across collectors.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .model import PermanentError, SpanBatch
from .receivers import RetryLater
from .threads import name_os_thread

logger = logging.getLogger(__name__)

COMMIT_INTERVAL_S = 1.0
BUSY_RETRY_S = 0.05


@dataclass
class KafkaStats:
    messages: int = 0
    undecodable: int = 0
    unkeyed: int = 0  # messages whose key is not the trace id of their spans
    rebalances: int = 0
    commits: int = 0
    partitions: list[int] = field(default_factory=list)
    last_commit_at: float = 0.0
    lag: int = 0  # messages on the owned partitions not yet read (at the last commit)


class KafkaReceiver:
    """One consumer-group member feeding ``consume`` (the collector's intake) from ``topic``.

    ``store_flushes``: how many flushes the store's writer has completed (:attr:`.store.BufferedStore.flushes`);
    a trace decided at ``n`` is durable once it reads ``n + 2`` (the flush under way at its decision may
    have taken its buffers before the decision landed in them)."""

    def __init__(self, consume: Callable[[SpanBatch], None], *, brokers: str, topic: str, group: str,
                 store_flushes: Callable[[], int], flush_store: Callable[[], None],
                 forget: Callable[[set[bytes]], None], drain: Callable[[float], bool],
                 options: dict[str, Any] | None = None) -> None:
        self._consume, self.topic, self.group = consume, topic, group
        self._store_flushes, self._flush_store, self._forget, self._drain = store_flushes, flush_store, forget, drain
        self._config = {"bootstrap.servers": brokers, "group.id": group, "enable.auto.commit": False,
                        "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
                        "heartbeat.interval.ms": 1000, **(options or {})}
        self._lock = threading.Lock()
        self._first_offset: dict[bytes, tuple[int, int]] = {}  # undecided trace -> (partition, first offset)
        self._awaiting: collections.deque[tuple[int, bytes, int, int]] = collections.deque()  # decided, not durable
        self._next_offset: dict[int, int] = {}  # partition -> offset after the last message read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer = None
        self.stats = KafkaStats()
        self._warned_unkeyed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        from confluent_kafka import Consumer  # only a fleet's collectors need it

        self._consumer = Consumer(self._config, logger=logging.getLogger("kvtrace.kafka.librdkafka"))
        self._consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_revoke)
        self._thread = threading.Thread(target=self._run, name="kvtrace-kafka", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop reading, commit what is durable (the collector flushes its store first) and leave the group."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ the pipeline's side

    def decided(self, trace_id: bytes) -> None:
        """The pipeline decided a trace (any trace; those read here are tracked)."""
        with self._lock:
            found = self._first_offset.pop(trace_id, None)
            if found is not None:
                self._awaiting.append((self._store_flushes(), trace_id, *found))

    def health(self) -> dict[str, float]:
        """The consumer's state for the collector's health rows (:data:`.schema.KAFKA_HEALTH_COLUMNS`)."""
        s = self.stats
        return {"kafka_partitions": len(s.partitions), "kafka_lag": s.lag, "kafka_pending_traces": self.pending_traces(),
                "kafka_rebalances": s.rebalances, "kafka_commits": s.commits,
                "kafka_commit_age_s": time.time() - s.last_commit_at if s.last_commit_at else 0.0,
                "kafka_unkeyed": s.unkeyed, "kafka_undecodable": s.undecodable}

    def pending_traces(self) -> int:
        with self._lock:
            return len(self._first_offset) + len(self._awaiting)

    # ------------------------------------------------------------------ the consumer thread

    def _run(self) -> None:
        name_os_thread()
        consumer = self._consumer
        next_commit = time.monotonic() + COMMIT_INTERVAL_S
        try:
            while not self._stop.is_set():
                for message in consumer.consume(num_messages=500, timeout=0.1):
                    self._handle(message)
                if time.monotonic() >= next_commit:
                    next_commit = time.monotonic() + COMMIT_INTERVAL_S
                    self._commit()
        except Exception:
            logger.exception("kvtrace collector: the Kafka receiver stopped")
            raise
        finally:
            try:
                self._drain(10.0)
                self._flush_store()
                self._commit(synchronous=True)
            finally:
                consumer.close()

    def _handle(self, message) -> None:
        error = message.error()
        if error is not None:
            from confluent_kafka import KafkaError

            if error.code() != KafkaError._PARTITION_EOF:
                logger.warning("kvtrace collector: Kafka: %s", error)
            return
        partition, offset = message.partition(), message.offset()
        self.stats.messages += 1
        try:
            batch = SpanBatch.decode(message.value() or b"")
        except PermanentError as exc:  # never retried: counted, and the offset moves past it
            self.stats.undecodable += 1
            logger.error("kvtrace collector: Kafka %s[%d]@%d: %s; skipped", self.topic, partition, offset, exc)
            with self._lock:
                self._next_offset[partition] = offset + 1
            return
        ids = batch.columns.trace_ids
        traces = {ids[i:i + 16] for i in range(0, len(ids), 16)}
        self._check_key(message.key(), traces)
        with self._lock:
            for trace_id in traces:
                self._first_offset.setdefault(trace_id, (partition, offset))
            self._next_offset[partition] = offset + 1
        while True:  # the pipeline is full: wait for it (Kafka holds the rest)
            try:
                self._consume(batch)
                return
            except RetryLater:
                if self._stop.is_set():
                    raise
                time.sleep(BUSY_RETRY_S)

    def _check_key(self, key: bytes | None, traces: set[bytes]) -> None:
        if len(traces) == 1 and key is not None and key.lower() in (next(iter(traces)).hex().encode(),
                                                                    next(iter(traces))):
            return
        self.stats.unkeyed += 1
        if not self._warned_unkeyed:
            self._warned_unkeyed = True
            logger.warning(
                "kvtrace collector: Kafka topic %s holds messages not keyed by their trace id (key %r, %d traces in "
                "one message): a trace's spans can land on several partitions and be split across collectors. "
                "Set `partition_traces_by_id: true` on the OpenTelemetry Collector's kafka exporter "
                "(encoding: otlp_proto). Counted in the collector's health (kafka_unkeyed, the Health page).", self.topic,
                key[:40] if key else key, len(traces))

    def _safe_offsets(self) -> dict[int, int]:
        """Per partition read here, the offset to commit: the first message of its oldest trace not yet
        durable, or past the last message read."""
        durable = self._store_flushes()
        with self._lock:
            while self._awaiting and durable >= self._awaiting[0][0] + 2:
                self._awaiting.popleft()
            safe = dict(self._next_offset)
            for partition, offset in (*self._first_offset.values(), *((p, o) for _, _, p, o in self._awaiting)):
                if offset < safe.get(partition, offset + 1):
                    safe[partition] = offset
        return safe

    def _commit(self, synchronous: bool = False, partitions: set[int] | None = None) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        safe = self._safe_offsets()
        offsets = [TopicPartition(self.topic, p, o) for p, o in safe.items() if partitions is None or p in partitions]
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=not synchronous)
        except KafkaException as exc:  # e.g. no longer a member: the next owner reads from the last commit
            logger.warning("kvtrace collector: Kafka commit failed: %s", exc)
            return
        self.stats.commits += 1
        self.stats.last_commit_at = time.time()
        lag = 0
        for partition, offset in self._next_offset.items():
            _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, partition), cached=True)
            lag += max(0, high - offset) if high >= 0 else 0
        self.stats.lag = lag

    def _on_assign(self, consumer, partitions) -> None:
        self.stats.rebalances += 1
        with self._lock:
            self.stats.partitions = sorted({*self.stats.partitions, *(p.partition for p in partitions)})
        logger.info("kvtrace collector: Kafka %s: assigned partitions %s", self.topic,
                    [p.partition for p in partitions])

    def _on_revoke(self, consumer, partitions) -> None:
        """Commit what is durable of the revoked partitions, then forget their undecided traces: their new
        owner reads them again from that commit."""
        revoked = {p.partition for p in partitions}
        self.stats.rebalances += 1
        self._drain(10.0)  # what was handed to the pipeline is processed first
        self._flush_store()
        self._commit(synchronous=True, partitions=revoked)
        with self._lock:
            dropped = {t for t, (p, _) in self._first_offset.items() if p in revoked}
            for trace_id in dropped:
                del self._first_offset[trace_id]
            self._awaiting = collections.deque(a for a in self._awaiting if a[2] not in revoked)
            for partition in revoked:
                self._next_offset.pop(partition, None)
            self.stats.partitions = [p for p in self.stats.partitions if p not in revoked]
        self._forget(dropped)
        logger.info("kvtrace collector: Kafka %s: partitions %s revoked; %d undecided traces left to their new "
                    "owner", self.topic, sorted(revoked), len(dropped))
