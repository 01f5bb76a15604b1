"""Collector configuration: one dataclass, named defaults, ``validate()`` naming the bad flag, and the
``kvtrace collector`` flags that fill it (:func:`add_arguments`, :meth:`CollectorConfig.from_arguments`)."""

from __future__ import annotations

import argparse
import dataclasses
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from .clickhouse import ClickHouseAddress, is_clickhouse
from .wal import ARCHIVE_BYTES as DEFAULT_ARCHIVE_BYTES

if TYPE_CHECKING:
    from .breakdown import Breakdown

DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_QUEUE_REQUESTS = 2_000
DEFAULT_DECISION_WAIT_S = 2.0
DEFAULT_MAX_AGE_S = 30.0
DEFAULT_MAX_TRACES = 20_000
DEFAULT_KAFKA_TOPIC = "otlp_spans"  # the OpenTelemetry Collector kafka exporter's default topic
DEFAULT_KAFKA_GROUP = "kvtrace"


@dataclasses.dataclass
class ForwardPolicy:
    """Which traces go upstream: ``all`` (tee at ingestion), ``slow:MS``, ``errors``, ``ratio:R``."""

    kind: str
    value: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "ForwardPolicy":
        kind, _, raw = text.partition(":")
        kind = kind.strip().lower()
        if kind in ("all", "errors") and not raw:
            return cls(kind)
        if kind in ("slow", "ratio") and raw:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"--forward-policy {text!r}: {raw!r} is not a number") from None
            if kind == "ratio" and not 0 <= value <= 1:
                raise ValueError(f"--forward-policy {text!r}: ratio must be in [0, 1]")
            if kind == "slow" and value < 0:
                raise ValueError(f"--forward-policy {text!r}: threshold must be >= 0 ms")
            return cls(kind, value)
        raise ValueError(f"--forward-policy {text!r}: use all, errors, slow:MS or ratio:R")

    def selects(self, breakdown: "Breakdown") -> bool:
        """Whether a decided trace goes upstream under this policy (``all`` tees at ingestion instead)."""
        if self.kind == "errors":
            return bool(breakdown.error)
        if self.kind == "slow":
            return breakdown.ttft_ns >= self.value * 1e6
        if self.kind == "ratio":  # by trace id, so every collector keeps the same traces
            return zlib.crc32(breakdown.trace_id.encode()) / 2**32 < self.value
        return False


@dataclasses.dataclass
class CollectorConfig:
    db_path: str = "kvtrace.duckdb"
    wal_dir: str | None = None  # default: <db_path>.kvtrace-wal
    host: str = "127.0.0.1"
    grpc_port: int | None = DEFAULT_GRPC_PORT  # None: no gRPC receiver
    http_port: int | None = DEFAULT_HTTP_PORT  # None: no HTTP receiver
    bearer_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    forward: list[str] = dataclasses.field(default_factory=list)
    forward_policies: list[ForwardPolicy] = dataclasses.field(default_factory=lambda: [ForwardPolicy("all")])
    forward_breakdown: bool = True  # add a kvtrace.breakdown span to each forwarded trace
    forward_critical_path: bool = False  # ... and one span per critical-path segment under it
    queue_requests: int = DEFAULT_QUEUE_REQUESTS
    decision_wait_s: float = DEFAULT_DECISION_WAIT_S
    max_age_s: float = DEFAULT_MAX_AGE_S
    max_traces: int = DEFAULT_MAX_TRACES
    fsync: bool = False
    archive_bytes: int = DEFAULT_ARCHIVE_BYTES  # originals kept in the write-ahead log beyond what it needs
    metrics_port: int | None = None
    query_port: int | None = 0  # the read-only query endpoint; 0: any free port; None: off
    kafka_brokers: str | None = None  # read OTLP export requests from Kafka too (.kafka)
    kafka_topic: str = DEFAULT_KAFKA_TOPIC
    kafka_group: str = DEFAULT_KAFKA_GROUP
    kafka_options: dict[str, str] = dataclasses.field(default_factory=dict)  # librdkafka properties

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> "CollectorConfig":
        """From :func:`add_arguments`' flags (-1 turns a port off); raises ValueError naming a bad one."""
        return cls(
            db_path=args.db, wal_dir=args.wal_dir, host=args.host,
            grpc_port=None if args.grpc_port < 0 else args.grpc_port,
            http_port=None if args.http_port < 0 else args.http_port,
            forward=args.forward,
            forward_policies=[ForwardPolicy.parse(p) for p in args.forward_policy] or [ForwardPolicy("all")],
            forward_breakdown=args.forward_breakdown, forward_critical_path=args.forward_critical_path,
            bearer_token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key,
            metrics_port=args.metrics_port, query_port=None if args.query_port < 0 else args.query_port,
            decision_wait_s=args.decision_wait, max_age_s=args.max_age, max_traces=args.max_traces,
            queue_requests=args.queue_requests, max_body_bytes=args.max_body_bytes, fsync=args.fsync,
            archive_bytes=int(args.archive_gib * 1024**3),
            kafka_brokers=args.kafka, kafka_topic=args.topic, kafka_group=args.group,
            kafka_options=_properties(args.kafka_option))

    @property
    def shared_store(self) -> bool:
        """The store is a fleet's shared ClickHouse database (``--store clickhouse://...``), not a DuckDB file."""
        return is_clickhouse(self.db_path)

    @property
    def wal_path(self) -> str:
        if self.wal_dir:
            return self.wal_dir
        return "kvtrace-wal" if self.shared_store else f"{self.db_path}.kvtrace-wal"  # DuckDB owns <db>.wal

    def validate(self) -> None:
        for flag, port in (("--grpc-port", self.grpc_port), ("--http-port", self.http_port),
                           ("--metrics-port", self.metrics_port), ("--query-port", self.query_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{flag} {port}: not a port")
        if self.grpc_port is None and self.http_port is None and not self.kafka_brokers:
            raise ValueError("at least one of --grpc-port, --http-port and --kafka is needed")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.shared_store:
            ClickHouseAddress.parse(self.db_path)  # raises naming --store
        elif not Path(self.db_path).resolve().parent.is_dir():
            raise ValueError(f"--db {self.db_path}: its folder does not exist")
        for flag, value in (("--queue-requests", self.queue_requests), ("--max-traces", self.max_traces),
                            ("--max-body-bytes", self.max_body_bytes)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be >= 1")
        if self.archive_bytes < 0:
            raise ValueError(f"--archive-gib {self.archive_bytes / 1024**3:g}: must be >= 0")
        if self.forward_critical_path and not self.forward_breakdown:
            raise ValueError("--forward-critical-path needs the breakdown span (drop --no-forward-breakdown)")
        if self.decision_wait_s < 0:
            raise ValueError(f"--decision-wait {self.decision_wait_s:g}: must be >= 0")
        if self.max_age_s <= 0:
            raise ValueError(f"--max-age {self.max_age_s:g}: must be > 0")


def _properties(pairs: list[str]) -> dict[str, str]:
    """``--kafka-option key=value`` flags as librdkafka properties."""
    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--kafka-option {pair!r}: use key=value (a librdkafka property)")
        found[key.strip()] = value.strip()
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvtrace collector``'s flags (:meth:`CollectorConfig.from_arguments` reads them back)."""
    parser.add_argument("--db", "--store", dest="db", default="kvtrace.duckdb", metavar="PATH|URL",
                        help="the store: a DuckDB file (default kvtrace.duckdb), or a fleet's shared ClickHouse "
                             "database, clickhouse://host:8123/database (sharded: "
                             "clickhouse://host1,host2/database?cluster=NAME)")
    parser.add_argument("--wal-dir", help="write-ahead log folder (default <db>.kvtrace-wal; with a ClickHouse "
                                          "store, ./kvtrace-wal)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="OTLP/gRPC port; -1: off")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="OTLP/HTTP port; -1: off")
    parser.add_argument("--forward", action="append", default=[], metavar="URL",
                        help="upstream OTLP endpoint, repeatable: grpc://host:4317 or http://host:4318/v1/traces")
    parser.add_argument("--forward-policy", action="append", default=[], metavar="POLICY",
                        help="all (default), errors, slow:MS, ratio:R; repeatable (any match forwards)")
    parser.add_argument("--no-forward-breakdown", dest="forward_breakdown", action="store_false",
                        help="forward the spans as received only, without a kvtrace.breakdown span per trace")
    parser.add_argument("--forward-critical-path", action="store_true",
                        help="also forward one span per critical-path segment (clock-corrected) under the "
                             "breakdown span, so any APM's waterfall shows the critical path")
    parser.add_argument("--token", help="require this bearer token from senders")
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="... and this key (PEM)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--query-port", type=int, default=0,
                        help="read-only query endpoint for dashboards and `kvtrace query` while running "
                             "(default 0: any free port, advertised beside the store; -1: off)")
    parser.add_argument("--decision-wait", type=float, default=DEFAULT_DECISION_WAIT_S,
                        help="seconds to wait after a trace's last span before attributing it")
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                        help="decide a trace at the latest this many seconds after its first span")
    parser.add_argument("--max-traces", type=int, default=DEFAULT_MAX_TRACES,
                        help="traces held while waiting for their decision (beyond: decided early, counted)")
    parser.add_argument("--queue-requests", type=int, default=DEFAULT_QUEUE_REQUESTS,
                        help="export requests waiting for the pipeline before senders are told to retry (503)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest export request accepted (413 / RESOURCE_EXHAUSTED beyond)")
    parser.add_argument("--kafka", metavar="BROKERS",
                        help="also read OTLP export requests (otlp_proto, keyed by trace id) from Kafka: "
                             "host:port[,host:port...]; collectors with the same --group share the topic's partitions")
    parser.add_argument("--topic", default=DEFAULT_KAFKA_TOPIC, help=f"with --kafka: the topic (default {DEFAULT_KAFKA_TOPIC})")
    parser.add_argument("--group", default=DEFAULT_KAFKA_GROUP, help=f"with --kafka: the consumer group (default {DEFAULT_KAFKA_GROUP})")
    parser.add_argument("--kafka-option", action="append", default=[], metavar="KEY=VALUE",
                        help="with --kafka: a librdkafka property, repeatable (e.g. security.protocol=SSL)")
    parser.add_argument("--fsync", action="store_true", help="fsync the write-ahead log on every request")
    parser.add_argument("--archive-gib", type=float, default=DEFAULT_ARCHIVE_BYTES / 1024**3,
                        help="keep the original requests in the write-ahead log up to this size "
                             f"(default {DEFAULT_ARCHIVE_BYTES // 1024**3} GiB; 0: only until stored)")
