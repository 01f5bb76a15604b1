"""Collector configuration: one dataclass, named defaults, ``validate()`` naming the bad flag."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .wal import ARCHIVE_BYTES as DEFAULT_ARCHIVE_BYTES

DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_QUEUE_REQUESTS = 2_000
DEFAULT_DECISION_WAIT_S = 2.0
DEFAULT_MAX_AGE_S = 30.0
DEFAULT_MAX_TRACES = 20_000


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

    @property
    def wal_path(self) -> str:
        return self.wal_dir or f"{self.db_path}.kvtrace-wal"  # DuckDB owns <db>.wal

    def validate(self) -> None:
        for flag, port in (("--grpc-port", self.grpc_port), ("--http-port", self.http_port),
                           ("--metrics-port", self.metrics_port), ("--query-port", self.query_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{flag} {port}: not a port")
        if self.grpc_port is None and self.http_port is None:
            raise ValueError("at least one of --grpc-port and --http-port is needed")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if not Path(self.db_path).resolve().parent.is_dir():
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

