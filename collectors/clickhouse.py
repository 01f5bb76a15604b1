"""The fleet's shared store: the same tables as the embedded DuckDB file (:mod:`.schema`), in ClickHouse.

``--store clickhouse://[user[:password]@]host[:8123]/database`` (``clickhouses://`` for TLS) points a collector
(the writer, :class:`ClickHouseStore`) and every reader (:class:`.read.sources.ClickHouseSource`) at one
database, so several collectors write one store and one dashboard reads it. The layout:

* ``otel_traces``: the raw spans, in the OpenTelemetry Collector ClickHouse exporter's layout (``Timestamp
  DateTime64(9)``, ``TraceId``, ``SpanId``, ``ServiceName``, ``ResourceAttributes`` and ``SpanAttributes`` as
  ``Map(LowCardinality(String), String)``, a bloom filter on ``TraceId``, ``PARTITION BY toDate``), so Grafana's
  ClickHouse plugin and that exporter can share the table. A ``ReplacingMergeTree``: a span stored twice (a
  sender's retry, a replay) collapses on its key. The attributes kept are those the collector reads
  (:data:`.model.WANTED_ATTRIBUTES`); ``spans`` is a view of it with the embedded store's columns.
* ``request_versions``: one row per decision, a ``ReplacingMergeTree`` ordered by trace id and versioned by
  :func:`decision_version`, so the embedded store's rule holds across collectors and replays: a trace decided
  again because late spans came (or a replay) replaces the stored row, the latest such decision winning, while a
  first decision never overwrites one already there. ``requests`` is the view of each trace's winning row.
* The rollups (``request_rollup``, ``tpot_rollup``, ``stage_rollup``) are views over ``requests``: grouped at
  read time, so they are exact and need no retraction when a trace is decided again (ClickHouse groups a
  million requests in well under a second); same columns as the embedded store's tables.
* ``stage_keys`` and ``origins`` give each (side, stage) and each sender an id derived from its value
  (:func:`stable_id`), so collectors that never talk to each other give the same thing the same id.
* ``commits``: one row per flush of each writer, with how far its write-ahead log is applied (its replay starts
  there) and the time readers key their caches on.

Unlike DuckDB, ClickHouse has no transaction across tables: a flush writes the spans, then the requests, then
its ``commits`` row. A collector killed half-way replays from its previous commit, and the replay's rows collapse
onto what was written (spans by key, requests by version), so nothing is lost or counted twice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from kvtrace.telemetry import semconv

from . import schema
from .breakdown import Breakdown, category_of
from .clocks import WINDOW, Sample
from .model import Origin, SpanBatch, SpanRow
from .store import BufferedStore, Pending, SchemaMismatch, record_tables, request_table

logger = logging.getLogger(__name__)

SCHEMES = ("clickhouse://", "clickhouses://")
READ_SETTINGS = {"aggregate_functions_null_for_empty": 1, "prefer_column_name_to_alias": 1,
                 "distributed_product_mode": "global"}
"""The reader's questions read as in DuckDB: aggregates over no rows are NULL (ClickHouse's default is 0),
and a name is the column before a SELECT alias of the same name (``sum(ttft_ms) / sum(requests) AS ttft_ms``).
On a cluster, a subquery or join over another Distributed table is computed once and sent to every shard."""


def is_clickhouse(store: str | None) -> bool:
    return bool(store) and store.lower().startswith(SCHEMES)


@dataclass(frozen=True)
class ClickHouseAddress:
    """Where the store is: ``clickhouse://[user[:password]@]host[:port][,host2[:port]...]/database[?cluster=NAME]``.

    With ``cluster``, the tables are sharded over that cluster of the servers' ``remote_servers``
    configuration: each host listed (every shard of the cluster, by its HTTP address) holds ``<table>_local``,
    and ``<table>`` is a ``Distributed`` table over them, sharded by trace id (:data:`SHARDING_KEYS`).
    Collectors and readers talk to the first host."""

    host: str
    port: int
    database: str
    user: str = "default"
    password: str = ""
    secure: bool = False
    cluster: str = ""
    shards: tuple[tuple[str, int], ...] = ()  # every host listed, the first included

    @classmethod
    def parse(cls, url: str) -> "ClickHouseAddress":
        scheme, _, rest = url.partition("://")
        scheme = scheme.lower()
        netloc, _, tail = rest.partition("/")
        path, _, query = tail.partition("?")
        if scheme not in ("clickhouse", "clickhouses") or not netloc.rpartition("@")[2]:
            raise ValueError(f"--store {url}: use clickhouse://host:8123/database")
        userinfo, _, hosts = netloc.rpartition("@")
        user, _, password = userinfo.partition(":")
        database = path.strip("/") or "kvtrace"
        if not database.replace("_", "").isalnum():
            raise ValueError(f"--store {url}: {database!r} is not a database name (letters, digits, _)")
        default_port = 8443 if scheme == "clickhouses" else 8123
        shards = []
        for host in hosts.split(","):
            parts = urllib.parse.urlsplit(f"//{host}")
            try:
                port = parts.port or default_port
            except ValueError:
                raise ValueError(f"--store {url}: {host!r}: not a port") from None
            if not parts.hostname:
                raise ValueError(f"--store {url}: {host!r} is not a host")
            shards.append((parts.hostname, port))
        options = urllib.parse.parse_qs(query)
        unknown = sorted(set(options) - {"cluster"})
        if unknown:
            raise ValueError(f"--store {url}: unknown option {unknown[0]!r} (only cluster=NAME)")
        cluster = options.get("cluster", [""])[-1]
        if cluster and not cluster.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"--store {url}: {cluster!r} is not a cluster name")
        if len(shards) > 1 and not cluster:
            raise ValueError(f"--store {url}: several hosts are the shards of a cluster: add ?cluster=NAME "
                             "(the name in the servers' remote_servers)")
        return cls(shards[0][0], shards[0][1], database, urllib.parse.unquote(user or "default"),
                   urllib.parse.unquote(password), scheme == "clickhouses", cluster, tuple(shards))

    def client(self, *, database: bool = True, shard: tuple[str, int] | None = None, **settings: Any):
        """A client of the first host (or of ``shard``), over HTTP; it holds no session."""
        import clickhouse_connect  # only a fleet's collectors and readers need it

        host, port = shard or (self.host, self.port)
        return clickhouse_connect.get_client(
            host=host, port=port, username=self.user, password=self.password, secure=self.secure,
            database=self.database if database else "default", autogenerate_session_id=False,
            settings=settings, connect_timeout=5, send_receive_timeout=60)

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.shards or ((self.host, self.port),))
        return (f"clickhouse{'s' if self.secure else ''}://{hosts}/{self.database}"
                + (f"?cluster={self.cluster}" if self.cluster else ""))


def stable_id(*parts: str) -> int:
    """An id for a value that every collector derives alike (63 bits of its BLAKE2 hash)."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


_VERSION_BASE = 1 << 62


def decision_version(decided_ns: int, replaces: bool) -> int:
    """The ``request_versions`` version of a decision: a replacing decision outranks every first
    decision and the latest of them wins; among first decisions the earliest wins (a stored row is kept)."""
    return _VERSION_BASE + decided_ns if replaces else _VERSION_BASE - decided_ns


# ---------------------------------------------------------------------------------------------- schema

_MINUTE = "fromUnixTimestamp64Micro(intDiv(toUnixTimestamp64Micro(started_at), 60000000) * 60000000, 'UTC')"
_FROM_REQUEST = (f"{_MINUTE} AS minute, run_id, mode, {schema.LENGTH_BUCKET_SQL} AS length_bucket, prefill_instance, "
                 "decode_instance, complete")
_TS = "DateTime64(6, 'UTC')"
_ATTRS = "Map(LowCardinality(String), String)"

TABLES = (
    "CREATE TABLE IF NOT EXISTS schema_version (version UInt32) ENGINE = ReplacingMergeTree ORDER BY version",
    f"""CREATE TABLE IF NOT EXISTS otel_traces (
        Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)), TraceId String CODEC(ZSTD(1)), SpanId String CODEC(ZSTD(1)),
        ParentSpanId String CODEC(ZSTD(1)), TraceState String CODEC(ZSTD(1)), SpanName LowCardinality(String),
        SpanKind LowCardinality(String), ServiceName LowCardinality(String), ResourceAttributes {_ATTRS},
        ScopeName String, ScopeVersion String, SpanAttributes {_ATTRS}, Duration UInt64,
        StatusCode LowCardinality(String), StatusMessage String,
        Events Nested (Timestamp DateTime64(9), Name LowCardinality(String), Attributes {_ATTRS}),
        Links Nested (TraceId String, SpanId String, TraceState String, Attributes {_ATTRS}),
        INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1)
    ENGINE = ReplacingMergeTree PARTITION BY toDate(Timestamp)
    ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), TraceId, SpanId)""",
    f"""CREATE TABLE IF NOT EXISTS request_versions (
        trace_id String, request_id String, run_id LowCardinality(String), mode LowCardinality(String),
        started_at {_TS}, ttft_ms Float64, {", ".join(f"{c} Float64" for c in schema.PART_COLUMNS)},
        e2e_ms Nullable(Float64), tpot_ms Nullable(Float64), output_tokens Int32, prompt_tokens Int32,
        rendezvous_order LowCardinality(String), engine_loop_ms Float64, transfer_bytes Int64,
        transfer_descriptors Int64, transfer_post_us Int64, transfer_xfer_us Int64, block_count Int32,
        kv_hold_ms Float64, prefill_instance LowCardinality(String), decode_instance LowCardinality(String),
        complete Bool, missing String, error Bool, clock_offsets Map(String, Int64), clock_bounds Map(String, Int64),
        clock_suspect Bool, stage_ids Array(Int64), stage_start_ns Array(Int64), stage_end_ns Array(Int64),
        stage_critical_ns Array(Int64), flush_id Int64, updated_at {_TS},
        client_ttft_ms Nullable(Float64), client_tpot_ms Nullable(Float64), client_itl_p50_ms Nullable(Float64),
        client_itl_p99_ms Nullable(Float64), client_output_tokens Nullable(Int32), point_rate Nullable(Float64),
        point_concurrency Nullable(Int32), point_prompt_tokens Nullable(Int32),
        ttft_reference LowCardinality(String), explanation String, version UInt64)
    ENGINE = ReplacingMergeTree(version) ORDER BY trace_id""",
    f"""CREATE TABLE IF NOT EXISTS run_versions (run_id String, recorded_at {_TS}, config String)
    ENGINE = ReplacingMergeTree(recorded_at) ORDER BY run_id""",
    """CREATE TABLE IF NOT EXISTS stage_key_rows (stage_key Int64, side String, stage String, category String)
    ENGINE = ReplacingMergeTree ORDER BY stage_key""",
    """CREATE TABLE IF NOT EXISTS origin_rows (origin_id Int64, service String, instance String, role String,
        mode String, run_id String, vllm_version String, nixl_version String, hardware String)
    ENGINE = ReplacingMergeTree ORDER BY origin_id""",
    # The reader's columns, then the sample exactly (ns) and which collector measured it against its clock,
    # for every other collector of the fleet to read back (.clocks.ClockBook.add_shared).
    f"""CREATE TABLE IF NOT EXISTS clock_samples (instance String, sent_at {_TS}, offset_ms Float64, bound_ms Float64,
        measured_by String, at_ns Int64, offset_ns Int64, delay_ns Int64, recorded_at {_TS} DEFAULT now64(6))
    ENGINE = MergeTree ORDER BY (instance, sent_at)""",
    f"""CREATE TABLE IF NOT EXISTS collector_runs (collector_run_id String, started_at {_TS}, kvtrace_version String,
        config String) ENGINE = MergeTree ORDER BY started_at""",
    f"""CREATE TABLE IF NOT EXISTS collector_health (collector_run_id String, recorded_at {_TS},
        {", ".join(f"{c} {'Float64' if c.endswith(('_ms', '_s')) else 'Int64'}" for c in schema.HEALTH_COLUMNS)})
    ENGINE = MergeTree ORDER BY recorded_at""",
    f"""CREATE TABLE IF NOT EXISTS commits (writer String, collector_run_id String, flush_id UInt64,
        committed_at {_TS}, wal_segment Nullable(Int32), wal_offset Nullable(Int64))
    ENGINE = MergeTree ORDER BY (writer, flush_id)""",
)

VIEWS = (
    "CREATE OR REPLACE VIEW requests AS SELECT * EXCEPT (version) FROM request_versions FINAL",
    "CREATE OR REPLACE VIEW runs AS SELECT * FROM run_versions FINAL",
    "CREATE OR REPLACE VIEW stage_keys AS SELECT * FROM stage_key_rows FINAL",
    "CREATE OR REPLACE VIEW origins AS SELECT * FROM origin_rows FINAL",
    f"""CREATE OR REPLACE VIEW spans AS SELECT lower(TraceId) AS trace_id, lower(SpanId) AS span_id,
        lower(ParentSpanId) AS parent_span_id, SpanName AS name, SpanAttributes['{semconv.ATTR_STAGE}'] AS stage,
        ServiceName AS service, ResourceAttributes['{semconv.RES_SERVICE_INSTANCE_ID}'] AS instance,
        ResourceAttributes['{semconv.RES_ROLE}'] AS role, ResourceAttributes['{semconv.RES_MODE}'] AS mode,
        ResourceAttributes['{semconv.RES_RUN_ID}'] AS run_id, toUnixTimestamp64Nano(Timestamp) AS start_ns,
        toUnixTimestamp64Nano(Timestamp) + Duration AS end_ns, Duration / 1e6 AS duration_ms,
        toInt8(multiIf(StatusCode = 'Error', 2, StatusCode = 'Ok', 1, 0)) AS status
    FROM otel_traces FINAL""",
    """CREATE OR REPLACE VIEW stages AS SELECT trace_id, k.side AS side, k.stage AS stage, k.category AS category,
        start_ns, end_ns, (end_ns - start_ns) / 1e6 AS duration_ms, critical_ns / 1e6 AS critical_ms
    FROM (SELECT trace_id, stage_key, start_ns, end_ns, critical_ns FROM requests
          ARRAY JOIN stage_ids AS stage_key, stage_start_ns AS start_ns, stage_end_ns AS end_ns,
                     stage_critical_ns AS critical_ns) AS s
    JOIN stage_keys AS k USING (stage_key)""",
    # Each view groups a subquery that derives every bucket and product first: ClickHouse resolves a
    # name to the SELECT's own alias (sum(ttft_ms) AS ttft_ms) before the column.
    f"""CREATE OR REPLACE VIEW request_rollup AS
    SELECT minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, error, rendezvous_order,
           ttft_bucket, count() AS requests, sum(ttft_ms) AS ttft_ms,
           {", ".join(f"sum({c}) AS {c}" for c in schema.PART_COLUMNS)}, sum(e2e_ms) AS e2e_ms,
           sum(output_tokens) AS output_tokens, sum(engine_loop_ms) AS engine_loop_ms,
           sum(transfer_bytes) AS transfer_bytes, sum(transfer_descriptors) AS transfer_descriptors,
           sum(transfer_post_us) AS transfer_post_us, sum(transfer_xfer_us) AS transfer_xfer_us,
           sum(kv_hold_ms) AS kv_hold_ms, sum(kv_block) AS kv_block_ms,
           sum(prefill_offset) AS prefill_offset_ms, sum(decode_offset) AS decode_offset_ms,
           countIf(clock_suspect) AS clock_suspect, min(prefill_offset) AS prefill_offset_min_ms,
           min(decode_offset) AS decode_offset_min_ms, max(prefill_offset) AS prefill_offset_max_ms,
           max(decode_offset) AS decode_offset_max_ms
    FROM (SELECT *, {_FROM_REQUEST}, {schema.bucket_sql('ttft_ms')} AS ttft_bucket, block_count * kv_hold_ms AS kv_block,
                 clock_offsets[prefill_instance] / 1e6 AS prefill_offset,
                 clock_offsets[decode_instance] / 1e6 AS decode_offset FROM requests)
    GROUP BY ALL""",
    f"""CREATE OR REPLACE VIEW tpot_rollup AS
    SELECT minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, tpot_bucket,
           count() AS requests, sum(tpot_ms) AS tpot_ms, sum(output_tokens) AS output_tokens,
           sum(engine_loop_ms) AS engine_loop_ms
    FROM (SELECT *, {_FROM_REQUEST}, {schema.bucket_sql('tpot_ms')} AS tpot_bucket FROM requests WHERE tpot_ms > 0)
    GROUP BY ALL""",
    f"""CREATE OR REPLACE VIEW stage_rollup AS
    SELECT minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, stage_key,
           duration_bucket, count() AS spans, countIf(critical > 0) AS on_path, sum(duration) AS duration_ms,
           sum(critical) AS critical_ms
    FROM (SELECT *, {schema.bucket_sql('duration')} AS duration_bucket
          FROM (SELECT {_FROM_REQUEST}, stage_key, (end_ns - start_ns) / 1e6 AS duration, critical_ns / 1e6 AS critical
                FROM requests ARRAY JOIN stage_ids AS stage_key, stage_start_ns AS start_ns, stage_end_ns AS end_ns,
                                         stage_critical_ns AS critical_ns))
    GROUP BY ALL""",
)


SHARDING_KEYS = {
    "otel_traces": "cityHash64(TraceId)", "request_versions": "cityHash64(trace_id)",
    "run_versions": "cityHash64(run_id)", "stage_key_rows": "stage_key", "origin_rows": "origin_id",
    "clock_samples": "cityHash64(instance)", "collector_runs": "cityHash64(collector_run_id)",
    "collector_health": "cityHash64(collector_run_id)", "commits": "cityHash64(writer)",
}
"""On a cluster, the shard of each table's row. A trace's spans and its request versions are on one shard, so
``FINAL`` collapses them there; each replacing table is sharded by what it collapses on."""


MIGRATIONS: dict[int, tuple[tuple[str, str], ...]] = {
    # 9 -> 10: breakdowns the store could not take and dropped, in the health rows (schema.MIGRATIONS)
    9: (("collector_health", "ADD COLUMN IF NOT EXISTS dropped_decisions Int64 DEFAULT 0"),),
    # 10 -> 11: finer histogram buckets (schema.HIST_PER_OCTAVE); the rollups are views, created anew on open
    10: (),
    # 11 -> 12: the embedded store's span ids as numbers (schema.MIGRATIONS); a ClickHouse store's are as they were
    11: (),
}
"""From a schema version to the next: ``(table, ALTER clause)`` pairs, idempotent (``IF NOT EXISTS``) so that
a migration cut short is run again whole."""


def migration_statements(address: ClickHouseAddress, version: int) -> list[str]:
    """One host's ALTERs from ``version`` to the next: on a cluster, the shard's local table and then the
    ``Distributed`` one over it (which does not follow its local table's columns by itself)."""
    statements = []
    for table, clause in MIGRATIONS[version]:
        names = [f"{table}_local", table] if address.cluster and table in SHARDING_KEYS else [table]
        statements += [f"ALTER TABLE {name} {clause}" for name in names]
    return statements


def schema_statements(address: ClickHouseAddress) -> list[str]:
    """The DDL of one host: the tables, or on a cluster each as ``<name>_local`` and a ``Distributed``
    ``<name>`` over the cluster; then the views, over the names either way. ``schema_version`` stays local."""
    if not address.cluster:
        return [*TABLES, *VIEWS]
    statements, distributed = [], []
    for statement in TABLES:
        name = statement.split("EXISTS ", 1)[1].split(None, 1)[0]
        if name not in SHARDING_KEYS:
            statements.append(statement)
            continue
        statements.append(statement.replace(f"EXISTS {name} ", f"EXISTS {name}_local ", 1))
        distributed.append(f"CREATE TABLE IF NOT EXISTS {name} AS {name}_local ENGINE = Distributed("
                           f"'{address.cluster}', '{address.database}', '{name}_local', {SHARDING_KEYS[name]})")
    return [*statements, *distributed, *VIEWS]


def create_schema(address: ClickHouseAddress) -> None:
    """Create the database and its tables where missing, on every host listed; refuse, before writing, one of
    another schema."""
    for shard in address.shards or ((address.host, address.port),):
        address.client(database=False, shard=shard).command(f"CREATE DATABASE IF NOT EXISTS {address.database}")
        client = address.client(shard=shard)
        if address.cluster:
            known = [row[0] for row in client.query("SELECT DISTINCT cluster FROM system.clusters").result_rows]
            if address.cluster not in known:
                raise ValueError(f"--store {address}: {shard[0]}:{shard[1]} has no cluster {address.cluster!r} in "
                                 f"its remote_servers (it has: {', '.join(known) or 'none'})")
        found = client.query("SELECT max(version) FROM schema_version").result_rows[0][0] \
            if client.command("EXISTS TABLE schema_version") else None
        while found in MIGRATIONS:  # an older database this kvtrace knows how to bring up to date
            for statement in migration_statements(address, found):
                client.command(statement)
            found += 1
            client.command(f"INSERT INTO schema_version VALUES ({found})")
            logger.info("kvtrace: %s: store schema %d brought up to %d", address, found - 1, found)
        if found and found != schema.SCHEMA_VERSION:
            raise SchemaMismatch(f"--store {address}: written by a kvtrace with store schema {found}, this one uses "
                                 f"{schema.SCHEMA_VERSION}; use a new database")
        for statement in schema_statements(address):
            client.command(statement)
        if not found:
            client.command(f"INSERT INTO schema_version VALUES ({schema.SCHEMA_VERSION})")


# ---------------------------------------------------------------------------------------------- writer


class ClickHouseStore(BufferedStore):
    """The collector's writer into a shared ClickHouse store: the embedded store's buffers and writer
    thread (:class:`.store.BufferedStore`), each flush a few inserts."""

    def __init__(self, url: str, *, wal_dir: str, flush_interval_s: float = 0.5, flush_rows: int = 65_536) -> None:
        self.address = ClickHouseAddress.parse(url)
        super().__init__(str(self.address), flush_interval_s=flush_interval_s, flush_rows=flush_rows)
        try:
            create_schema(self.address)
        except ValueError:  # another schema, no such cluster: the user's to fix, said as it is
            raise
        except Exception as exc:  # the driver's own errors: say which store, in one line
            raise ConnectionError(f"--store {self.address}: {str(exc).strip().splitlines()[0][:300]}") from None
        # Through a Distributed table, an insert returns once every shard holds its rows (not queued on this
        # host): a commit row is only written after its flush's rows are stored.
        self._client = self.address.client(**({"distributed_foreground_insert": 1} if self.address.cluster else {}))
        self._read_client = self.address.client(**READ_SETTINGS)
        self._clock_client = self.address.client(**READ_SETTINGS)  # read from the shared-clocks thread
        # This writer's write-ahead log is this host's folder: its commits say how far that log is applied.
        self.writer = f"{socket.gethostname()}:{Path(wal_dir).resolve()}"
        self._db_lock = threading.Lock()
        self._stage_ids: dict[tuple[str, str], int] = {}
        self._origin_ids: set[int] = set()
        self._flush_ids = itertools.count(self._last_flush_id() + 1)
        self.data_version = 0

    def _last_flush_id(self) -> int:
        rows = self._client.query("SELECT max(flush_id) FROM commits WHERE writer = {w:String}",
                                  parameters={"w": self.writer}).result_rows
        return int(rows[0][0] or 0) if rows else 0

    # ------------------------------------------------------------------ lifecycle

    def start(self, version: str, config: dict[str, Any]) -> None:
        self._client.insert("collector_runs", [[self.collector_run_id, datetime.now(timezone.utc), version,
                                                json.dumps(config, default=str)]],
                            column_names=["collector_run_id", "started_at", "kvtrace_version", "config"])
        self._start_writer()

    def _close(self) -> None:
        self._client.close()
        self._read_client.close()
        self._clock_client.close()

    def wal_position(self) -> tuple[int, int]:
        rows = self._client.query("SELECT wal_segment, wal_offset FROM commits WHERE writer = {w:String} AND "
                                  "wal_segment IS NOT NULL ORDER BY flush_id DESC LIMIT 1",
                                  parameters={"w": self.writer}).result_rows
        return (int(row[0]), int(row[1])) if (row := rows[0] if rows else None) else (0, 0)

    # ------------------------------------------------------------------ writes

    def _entry(self, batch: SpanBatch, position: tuple[int, int] | None) -> list[SpanRow]:
        return batch.rows  # the otel_traces rows are built from them at the flush, on the writer thread

    def compact(self, until: datetime | None = None) -> None:
        """Nothing to do: the rollups are views, and ClickHouse merges parts itself."""

    def _write(self, pending: Pending) -> None:
        """Spans, then requests and the rest, then this flush's commit row. Rows a failed write had already
        written collapse when they are written again."""
        with self._db_lock:
            flush_id = next(self._flush_ids)
            self._write_tables(pending, flush_id)
            self.data_version = flush_id
            self.committed_at = time.time()
        if pending.position is not None:
            self.committed_position = pending.position

    def _write_tables(self, pending: Pending, flush_id: int) -> None:
        client, decided, position = self._client, pending.decided, pending.position
        spans = [row for rows in pending.batches for row in rows]
        if spans:
            self._insert_origins({id(row.origin): row.origin for row in spans}.values())
            client.insert_arrow("otel_traces", _otel_table(spans))
        if decided:
            new_stages: dict[tuple[str, str], int] = {}

            def assign(key: tuple[str, str]) -> int:
                found = new_stages[key] = stable_id(*key)
                return found

            table = request_table([b for b, _, _ in decided], flush_id, self._stage_ids, assign, pa.int64())
            table = table.append_column("version", pa.array(
                [decision_version(at, replaces) for _, replaces, at in decided], pa.uint64()))
            if new_stages:
                client.insert_arrow("stage_key_rows", pa.table({
                    "stage_key": pa.array(list(new_stages.values()), pa.int64()),
                    "side": [s for s, _ in new_stages], "stage": [s for _, s in new_stages],
                    "category": [category_of(s) for _, s in new_stages]}))
            client.insert_arrow("request_versions", table)
            self._stage_ids.update(new_stages)
        records = record_tables(pending.samples, pending.runs, pending.health)
        if pending.samples:
            records["clock_samples"] = _with_exact_samples(records["clock_samples"], pending.samples)
        for name, table in records.items():
            client.insert_arrow("run_versions" if name == "runs" else name, table)
        client.insert("commits", [[self.writer, self.collector_run_id, flush_id, datetime.now(timezone.utc),
                                   *(position if position is not None else (None, None))]],
                      column_names=["writer", "collector_run_id", "flush_id", "committed_at", "wal_segment",
                                    "wal_offset"])

    def _insert_origins(self, origins) -> None:
        """The senders not written yet by this collector (another's rows for the same sender collapse)."""
        rows = []
        for origin in origins:
            values = (origin.service, origin.instance, origin.role, origin.mode, origin.run_id, origin.vllm_version,
                      origin.nixl_version, origin.hardware)
            origin_id = stable_id(*values)
            if origin_id not in self._origin_ids:
                rows.append((origin_id, *values))
        if rows:
            self._client.insert("origin_rows", rows, column_names=[
                "origin_id", "service", "instance", "role", "mode", "run_id", "vllm_version", "nixl_version",
                "hardware"])
            self._origin_ids.update(row[0] for row in rows)

    # ------------------------------------------------------------------ reads

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        """Rows of one SELECT (``?`` parameters), for the collector's own checks and tests."""
        return self._read_client.query(*bind(sql, params)).result_rows

    def clock_samples_since(self, recorded_after: datetime | None) -> tuple[list[Any], datetime | None]:
        """Clock samples the fleet's other collectors wrote after ``recorded_after`` (on the first call: each
        (sender, collector)'s last window), oldest first, and where to read on from. Reads 10 s back, as a sample may be recorded after one that was read: the book skips those it has."""
        where = "measured_by != {me:String}"
        if recorded_after is not None:
            where += " AND recorded_at > {after:DateTime64(6, 'UTC')} - INTERVAL 10 SECOND"
        rows = self._clock_client.query(
            f"SELECT instance, at_ns, offset_ns, delay_ns, measured_by, recorded_at FROM clock_samples "
            f"WHERE {where} ORDER BY at_ns DESC LIMIT {WINDOW} BY instance, measured_by",
            parameters={"me": self.collector_run_id, "after": recorded_after}).result_rows
        rows.reverse()
        latest = max((row[5] for row in rows), default=recorded_after)
        return [Sample(instance, at, offset, delay, by) for instance, at, offset, delay, by, _ in rows], latest

    def stored_spans(self, trace_id: str) -> list[SpanRow]:
        """The trace's stored spans, each once, with the attributes the collector reads."""
        return stored_spans(self._read_client, trace_id)


# ---------------------------------------------------------------------------------------------- rows


_STATUS = ("Unset", "Ok", "Error")
_RESOURCE_OF_ORIGIN = ((semconv.RES_SERVICE_INSTANCE_ID, "instance"), (semconv.RES_ROLE, "role"),
                       (semconv.RES_MODE, "mode"), (semconv.RES_RUN_ID, "run_id"), (semconv.RES_HOST_NAME, "host"),
                       (semconv.RES_VLLM_VERSION, "vllm_version"), (semconv.RES_NIXL_VERSION, "nixl_version"),
                       (semconv.RES_HARDWARE, "hardware"))


def _with_exact_samples(table: pa.Table, samples: list[Sample]) -> pa.Table:
    """The reader's ``clock_samples`` columns and each sample as measured, for the fleet's other collectors."""
    exact = {"measured_by": pa.array([s.measured_by for s in samples], pa.string()),
             "at_ns": pa.array([s.at for s in samples], pa.int64()),
             "offset_ns": pa.array([s.offset for s in samples], pa.int64()),
             "delay_ns": pa.array([s.delay for s in samples], pa.int64())}
    return pa.table({**{name: table[name] for name in table.column_names}, **exact})


def _resource_attributes(origin: Origin) -> dict[str, str]:
    found = {key: getattr(origin, name) for key, name in _RESOURCE_OF_ORIGIN if getattr(origin, name)}
    if origin.contract:
        found[semconv.RES_CONTRACT_VERSION] = str(origin.contract)
    return found


def _otel_table(spans: list[SpanRow]) -> pa.Table:
    """Spans as ``otel_traces`` rows (the exporter's columns; events, links and the rest empty)."""
    resources = {id(row.origin): _resource_attributes(row.origin) for row in spans}
    attributes = [{**{k: str(v) for k, v in row.attrs.items()}, semconv.ATTR_STAGE: row.stage} for row in spans]
    n = len(spans)

    def attribute_map(maps: list[dict[str, str]]) -> pa.MapArray:
        offsets = list(itertools.accumulate((len(m) for m in maps), initial=0))
        return pa.MapArray.from_arrays(pa.array(offsets, pa.int32()), pa.array([k for m in maps for k in m]),
                                       pa.array([v for m in maps for v in m.values()]))

    return pa.table({
        "Timestamp": pa.array([row.start for row in spans], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        "TraceId": [row.trace_id.hex() for row in spans],
        "SpanId": [row.span_id.hex() for row in spans],
        "ParentSpanId": [row.parent_span_id.hex() if row.parent_span_id.strip(b"\0") else "" for row in spans],
        "SpanName": [row.name for row in spans],
        "SpanKind": ["Unspecified"] * n,
        "ServiceName": [row.origin.service for row in spans],
        "ResourceAttributes": attribute_map([resources[id(row.origin)] for row in spans]),
        "SpanAttributes": attribute_map(attributes),
        "Duration": pa.array([row.end - row.start for row in spans], pa.uint64()),
        "StatusCode": [_STATUS[row.status] if 0 <= row.status < 3 else "Unset" for row in spans],
    })


def stored_spans(client, trace_id: str) -> list[SpanRow]:
    """A trace's spans from ``otel_traces`` as :class:`.model.SpanRow`, each span once, with protobuf
    originals rebuilt from the stored columns (so the read side and the forwarder treat them as received
    ones): the attributes the collector keeps, numbers as numbers."""
    result = client.query(
        "SELECT TraceId, SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp), Duration, StatusCode, "
        "ServiceName, ResourceAttributes, SpanAttributes FROM otel_traces FINAL WHERE TraceId = {t:String} "
        "ORDER BY Timestamp, SpanId", parameters={"t": trace_id.lower()})
    origins: dict[tuple, Origin] = {}
    rows: dict[str, SpanRow] = {}
    for trace, span_id, parent, name, start, duration, status, service, resource, attrs in result.result_rows:
        key = (service, tuple(sorted(resource.items())))
        origin = origins.get(key)
        if origin is None:
            attributes = {semconv.RES_SERVICE_NAME: service, **resource}
            message = Resource(attributes=[_key_value(k, v) for k, v in attributes.items()])
            origin = origins[key] = Origin.of(attributes, message.SerializeToString())
        values = {k: v if k in _TEXT_ATTRIBUTES else _typed(v) for k, v in attrs.items()}
        stage = str(values.get(semconv.ATTR_STAGE) or name)
        code = _STATUS.index(status) if status in _STATUS else 0
        span = Span(trace_id=bytes.fromhex(trace), span_id=bytes.fromhex(span_id),
                    parent_span_id=bytes.fromhex(parent) if parent else b"", name=name, start_time_unix_nano=start,
                    end_time_unix_nano=start + duration, attributes=[_key_value(k, v) for k, v in values.items()],
                    status=Status(code=code))
        rows.setdefault(span_id, SpanRow(span.trace_id, span.span_id, span.parent_span_id, name, start,
                                         start + duration, code, origin, stage, values, b"", span.SerializeToString()))
    return list(rows.values())


def _key_value(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


_TEXT_ATTRIBUTES = frozenset({semconv.ATTR_STAGE, semconv.ATTR_REQUEST_ID, semconv.ATTR_FAILURE_CAUSE, semconv.RUN_CONFIG})


def _typed(value: str) -> Any:
    """An attribute stored as text, as the number it was where it reads as one."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def bind(sql: str, params: list | tuple | None) -> tuple[str, Any]:
    """DuckDB-style ``?`` parameters as clickhouse-connect's client-side ``%s`` binding; times in UTC."""
    if not params:
        return sql, None
    values = tuple(_param(p) for p in params)
    return sql.replace("%", "%%").replace("?", "%s"), values


def _param(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    return value
