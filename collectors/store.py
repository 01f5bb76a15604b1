"""The embedded store: a DuckDB file with raw spans, one row per request, its stages, and runs.

Rows are buffered and appended in columnar (Arrow) batches on one writer thread, never row
by row. Each commit also records how far the write-ahead log has been applied, in the same
transaction, so a restart replays exactly what is not in the file yet.

Tables:

* ``spans`` — a view: every span as received, with the fields queries need as columns (its
  attributes stay in the original; the request id is in ``requests``). A span a sender
  retried can appear twice here; ``requests`` and ``stages`` are built from de-duplicated
  traces. ``batch_id``/``batch_index`` point at the original. It joins the table
  ``span_rows`` (per span) with ``origins`` (per sender: service, instance, role, mode).
* ``batches`` — each export request: where its original bytes (OTLP protobuf, exactly as
  received) are in the write-ahead log, which doubles as the archive of originals
  (:mod:`.wal`).
* ``requests`` — one row per trace: TTFT and its split into compute / queue / coordination /
  wire / unattributed (ms), rendezvous order, bytes, NIXL times, instances, completeness.
* ``stages`` — a view: per trace and stage (its earliest span), its times on the router's
  clock, duration, category and the part of it on the critical path — computed from
  ``spans`` and each request's ``clock_offsets`` and ``critical_ns`` rather than written
  again row by row.
* ``runs`` — one row per collector start, with its configuration.

A file written by a kvtrace whose tables differ is refused at start with a clear error
(``schema_version``), never half-written.
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from datetime import datetime, timezone
from typing import Any

import duckdb
import pyarrow as pa

from .attribution import STAGE_CATEGORY, Breakdown
from .model import SIDE_OF_ROLE, Origin, SpanBatch, SpanColumns

SCHEMA_VERSION = 4  # bump when a table or view changes
SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER);
CREATE TABLE IF NOT EXISTS span_rows (
    trace_id VARCHAR, span_id VARCHAR, parent_span_id VARCHAR, name VARCHAR, stage VARCHAR,
    origin_id INTEGER, start_ns BIGINT, end_ns BIGINT, status TINYINT, batch_id BIGINT, batch_index INTEGER
);
CREATE TABLE IF NOT EXISTS origins (
    origin_id INTEGER PRIMARY KEY, service VARCHAR, instance VARCHAR, role VARCHAR, mode VARCHAR
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id BIGINT, run_id VARCHAR, wal_segment INTEGER, wal_offset BIGINT, bytes INTEGER, spans INTEGER
);
CREATE TABLE IF NOT EXISTS requests (
    trace_id VARCHAR PRIMARY KEY, request_id VARCHAR, mode VARCHAR, started_at TIMESTAMPTZ,
    ttft_ms DOUBLE, compute_ms DOUBLE, queue_ms DOUBLE, coordination_ms DOUBLE, wire_ms DOUBLE,
    unattributed_ms DOUBLE, prompt_tokens INTEGER, rendezvous_order VARCHAR, engine_loop_ms DOUBLE,
    transfer_bytes BIGINT, transfer_post_us BIGINT, transfer_xfer_us BIGINT,
    prefill_instance VARCHAR, decode_instance VARCHAR, complete BOOLEAN, missing VARCHAR,
    error BOOLEAN, clock_offsets MAP(VARCHAR, BIGINT), critical_ns MAP(VARCHAR, BIGINT), updated_at TIMESTAMPTZ
);
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR, started_at TIMESTAMPTZ, kvtrace_version VARCHAR, config VARCHAR
);
CREATE TABLE IF NOT EXISTS wal_state (id INTEGER PRIMARY KEY, segment INTEGER, "offset" BIGINT);
"""


def _case(column: str, mapping: dict[str, str], default: str) -> str:
    whens = " ".join(f"WHEN '{key}' THEN '{value}'" for key, value in mapping.items())
    return f"CASE {column} {whens} ELSE {default} END"


# Each span with its sender's columns and its duration: written once per sender, not per span
# (per span they cost ~0.9 µs of Arrow and DuckDB work, more than a tenth of the collector).
SPANS_VIEW = """
CREATE OR REPLACE VIEW spans AS
SELECT s.trace_id, s.span_id, s.parent_span_id, s.name, s.stage, o.service, o.instance, o.role, o.mode,
       s.start_ns, s.end_ns, (s.end_ns - s.start_ns) / 1e6 AS duration_ms, s.status, s.batch_id, s.batch_index
FROM span_rows s JOIN origins o USING (origin_id)
"""

# A span's side and a stage's category, as the attribution reads them (the contract's tables).
_SIDE_SQL = _case("role", SIDE_OF_ROLE, "service")  # as Origin.of names a side
_CATEGORY_SQL = _case("f.stage", STAGE_CATEGORY, "'coordination'")
STAGES_VIEW = f"""
CREATE OR REPLACE VIEW stages AS
WITH firsts AS (
    SELECT trace_id, {_SIDE_SQL} AS side, stage, arg_min(instance, start_ns) AS instance,
           min(start_ns) AS start_ns, arg_min(end_ns, start_ns) AS end_ns
    FROM spans GROUP BY ALL)
SELECT f.trace_id, f.side, f.stage, {_CATEGORY_SQL} AS category,
       f.start_ns + coalesce(r.clock_offsets[f.instance], 0) AS start_ns,
       f.end_ns + coalesce(r.clock_offsets[f.instance], 0) AS end_ns,
       (f.end_ns - f.start_ns) / 1e6 AS duration_ms,
       coalesce(r.critical_ns[f.side || ':' || f.stage], 0) / 1e6 AS critical_ms
FROM firsts f JOIN requests r USING (trace_id)
"""

# Ids arrive as binary and are written as lower-case hex (a root's all-zero parent as ''):
# DuckDB does it per vector, not Python per span.
_INSERT_SPANS = """INSERT INTO span_rows SELECT lower(hex(trace_id)), lower(hex(span_id)),
    CASE WHEN parent_span_id = unhex('0000000000000000') THEN '' ELSE lower(hex(parent_span_id)) END,
    name, stage, origin_id, start_ns, end_ns, status, batch_id, batch_index FROM incoming"""


_MAP = pa.map_(pa.string(), pa.int64())


class SchemaMismatch(ValueError):
    """The DuckDB file was written by a kvtrace with different tables."""


class Store:
    def __init__(self, path: str, *, flush_interval_s: float = 0.5, flush_rows: int = 65_536) -> None:
        self.path = path
        # One writer thread appends large batches: DuckDB's own thread pool only adds
        # hand-offs (it measured 2.6x slower inserts on a collector pinned to one core).
        self._con = duckdb.connect(path, config={"threads": 1})
        try:
            self._create_schema()
        except Exception:
            self._con.close()
            raise
        self._lock = threading.Lock()  # guards the buffers; the connection is used by one thread
        self._db_lock = threading.Lock()
        # (batch id, its columns, bytes of its original, log position): only what the tables
        # need, so a batch's rows and original are freed once the assembler is done with them
        self._batches: list[tuple[int, SpanColumns, int, tuple | None]] = []
        self._rows = 0
        # Batch ids count on from the file's last; each sender (service, instance, role, mode)
        # is a row of ``origins``, its id given on first sight and kept across runs.
        self._batch_ids = itertools.count(self._con.execute("SELECT coalesce(max(batch_id), 0) + 1 FROM batches")
                                          .fetchone()[0])
        self._origin_ids: dict[tuple[str, str, str, str], int] = {
            tuple(row[1:]): row[0] for row in self._con.execute("SELECT * FROM origins").fetchall()}
        self._breakdowns: dict[str, tuple[Breakdown, bool]] = {}  # trace id -> (breakdown, replaces)
        self._position: tuple[int, int] | None = None
        self.committed_position: tuple[int, int] | None = None  # the log position of the last commit
        self._flush_interval = flush_interval_s
        self._flush_rows = flush_rows
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.run_id = uuid.uuid4().hex[:12]

    def _create_schema(self) -> None:
        """Create the tables in a new file; refuse, before writing anything, a file from another schema."""
        con = self._con
        tables = {row[0] for row in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()}
        if tables:
            found = con.execute("SELECT max(version) FROM schema_version").fetchone()[0] \
                if "schema_version" in tables else None
            if found != SCHEMA_VERSION:
                raise SchemaMismatch(f"--db {self.path}: written by a kvtrace with store schema {found or 1}, "
                                     f"this one uses {SCHEMA_VERSION}; use a new file")
        con.execute(SCHEMA)
        con.execute(SPANS_VIEW)
        con.execute(STAGES_VIEW)
        if not tables:
            con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])

    # ------------------------------------------------------------------ lifecycle

    def start(self, version: str, config: dict[str, Any]) -> None:
        with self._db_lock:
            self._con.execute("INSERT INTO runs VALUES (?, ?, ?, ?)",
                              [self.run_id, datetime.now(timezone.utc), version, json.dumps(config, default=str)])
        self._thread = threading.Thread(target=self._run, name="kvtrace-store", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()
        with self._db_lock:
            self._con.close()

    def wal_position(self) -> tuple[int, int]:
        with self._db_lock:
            row = self._con.execute('SELECT segment, "offset" FROM wal_state WHERE id = 0').fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    # ------------------------------------------------------------------ writes

    def add_spans(self, batch: SpanBatch, position: tuple[int, int] | None) -> None:
        """One export request; ``position``: where the write-ahead log is once it is stored."""
        with self._lock:
            batch_id = next(self._batch_ids)
            self._batches.append((batch_id, batch.columns, len(batch.payload), position))
            self._rows += len(batch.columns)
            if position is not None:
                self._position = position
            full = self._rows >= self._flush_rows
        if full:
            self._wake.set()

    def add_breakdown(self, breakdown: Breakdown, replaces: bool = False) -> None:
        """The trace's breakdown. ``replaces``: the trace was decided again (late spans, a
        restart) and this row replaces the stored one; otherwise a stored row is kept (a
        span so late that the assembler forgot its trace must not overwrite the whole trace)."""
        with self._lock:
            earlier = self._breakdowns.get(breakdown.trace_id)
            self._breakdowns[breakdown.trace_id] = (breakdown, replaces or (earlier is not None and earlier[1]))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batches, self._batches, self._rows = self._batches, [], 0
            decided, self._breakdowns = list(self._breakdowns.values()), {}
            position = self._position
        if not batches and not decided and position is None:
            return
        with self._db_lock:  # the origin registry is the writer's too
            tables = {}  # built once, outside the transaction (and its retry)
            new_origins: dict[tuple[str, str, str, str], int] = {}
            if batches:
                origin_ids = [[self._origin_id(o, new_origins) for o in columns.origins]
                              for _, columns, _, _ in batches]
                tables["spans"] = _span_table(batches, origin_ids)
                tables["batches"] = pa.table({
                    "batch_id": pa.array([batch_id for batch_id, _, _, _ in batches], pa.int64()),
                    "run_id": [self.run_id] * len(batches),
                    "wal_segment": pa.array([p[0] if p else None for _, _, _, p in batches], pa.int32()),
                    "wal_offset": pa.array([p[1] if p else None for _, _, _, p in batches], pa.int64()),
                    "bytes": pa.array([size for _, _, size, _ in batches], pa.int32()),
                    "spans": pa.array([len(columns) for _, columns, _, _ in batches], pa.int32())})
            if new_origins:
                tables["origins"] = pa.table({
                    "origin_id": pa.array(list(new_origins.values()), pa.int32()),
                    **{column: [key[i] for key in new_origins] for i, column in enumerate(_ORIGIN_COLUMNS)}})
            if decided:
                tables["requests"] = _request_table([b for b, _ in decided])
            replaced = [b.trace_id for b, replaces in decided if replaces]
            try:
                self._commit(tables, replaced, position, on_conflict="")
            except duckdb.ConstraintException:
                # A trace decided again after the assembler had forgotten it (a span far too
                # late): keep the stored row. Rare, so first decisions are a plain insert
                # (INSERT OR IGNORE costs ~4 µs more per row, OR REPLACE 5-35 µs).
                self._commit(tables, replaced, position, on_conflict="OR IGNORE")
            self._origin_ids.update(new_origins)
        if position is not None:
            self.committed_position = position

    def _origin_id(self, origin: Origin, new: dict[tuple[str, str, str, str], int]) -> int:
        """The sender's id in ``origins``; one seen for the first time gets the next id, in
        ``new`` until the flush that writes it commits."""
        key = (origin.service, origin.instance, origin.role, origin.mode)
        found = self._origin_ids.get(key, new.get(key))
        if found is None:
            found = new[key] = len(self._origin_ids) + len(new) + 1
        return found

    def _commit(self, tables: dict[str, pa.Table], replaced: list[str], position: tuple[int, int] | None,
                on_conflict: str) -> None:
        """One transaction: spans, batches, new origins, requests (the ``replaced`` traces' rows
        deleted first) and how far the write-ahead log is applied."""
        con = self._con
        con.execute("BEGIN")
        try:
            if replaced:
                con.execute("DELETE FROM requests WHERE trace_id IN (SELECT unnest(?))", [replaced])
            for name, table in tables.items():
                con.register("incoming", table)
                con.execute(_INSERT_SPANS if name == "spans" else
                            f"INSERT {on_conflict if name == 'requests' else ''} INTO {name} SELECT * FROM incoming")
                con.unregister("incoming")
            if position is not None:
                con.execute('INSERT OR REPLACE INTO wal_state VALUES (0, ?, ?)', list(position))
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ reads

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self._db_lock:
            return self._con.execute(sql, params or []).fetchall()

    def stored_originals(self, trace_id: str) -> list[tuple[int, int, int, int]]:
        """Where the trace's committed spans came from: (log segment, end offset, bytes, index
        of the span in its request), for each request that holds one."""
        return self.query("SELECT DISTINCT b.wal_segment, b.wal_offset, b.bytes, s.batch_index FROM spans s "
                          "JOIN batches b USING (batch_id) WHERE s.trace_id = ? AND b.wal_segment IS NOT NULL "
                          "ORDER BY 1, 2, 4", [trace_id])

def _request_table(breakdowns: list[Breakdown]) -> pa.Table:
    """One row per trace with its breakdown: the ``requests`` table's columns, in order."""
    now = datetime.now(timezone.utc)
    ms = 1e6
    return pa.table({
        "trace_id": [b.trace_id for b in breakdowns],
        "request_id": [b.request_id for b in breakdowns],
        "mode": [b.mode for b in breakdowns],
        "started_at": pa.array([b.start_ns // 1000 for b in breakdowns], pa.timestamp("us", tz="UTC")),
        "ttft_ms": [b.ttft_ns / ms for b in breakdowns],
        **{f"{c}_ms": [b.parts.get(c, 0) / ms for b in breakdowns]
           for c in ("compute", "queue", "coordination", "wire", "unattributed")},
        "prompt_tokens": [b.prompt_tokens for b in breakdowns],
        "rendezvous_order": [b.rendezvous_order for b in breakdowns],
        "engine_loop_ms": [b.engine_loop_ns / ms for b in breakdowns],
        "transfer_bytes": [b.transfer_bytes for b in breakdowns],
        "transfer_post_us": [b.transfer_post_us for b in breakdowns],
        "transfer_xfer_us": [b.transfer_xfer_us for b in breakdowns],
        "prefill_instance": [b.prefill_instance for b in breakdowns],
        "decode_instance": [b.decode_instance for b in breakdowns],
        "complete": [b.complete for b in breakdowns],
        "missing": [",".join(b.missing) for b in breakdowns],
        "error": [b.error for b in breakdowns],
        "clock_offsets": pa.array([list(b.offsets_ns.items()) for b in breakdowns], _MAP),
        "critical_ns": pa.array([[(f"{side}:{stage}", ns) for (side, stage), ns in b.critical_ns.items()]
                                 for b in breakdowns], _MAP),
        "updated_at": pa.array([now] * len(breakdowns), pa.timestamp("us", tz="UTC")),
    })


_ORIGIN_COLUMNS = ("service", "instance", "role", "mode")


def _span_table(batches: list[tuple[int, SpanColumns, int, Any]], origin_ids: list[list[int]]) -> pa.Table:
    """The spans of ``batches`` as Arrow columns, from each batch's packed columns without a
    Python step per span (ids stay binary here: the insert writes them as hex)."""
    columns = [batch_columns for _, batch_columns, _, _ in batches]
    n = sum(len(c) for c in columns)

    def packed(kind: pa.DataType, name: str) -> pa.Array:
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(b"".join(getattr(c, name) for c in columns))])

    return pa.table({
        "trace_id": packed(pa.binary(16), "trace_ids"),
        "span_id": packed(pa.binary(8), "span_ids"),
        "parent_span_id": packed(pa.binary(8), "parent_ids"),
        "name": pa.array([name for c in columns for name in c.names], pa.string()),
        "stage": pa.array([stage for c in columns for stage in c.stages], pa.string()),
        # each batch's origin index (into its own origins) mapped to the file's origin ids
        "origin_id": pa.concat_arrays([
            pa.array(ids, pa.int32()).take(
                pa.Array.from_buffers(pa.int32(), len(c), [None, pa.py_buffer(c.origin_index)]))
            for c, ids in zip(columns, origin_ids)]),
        "start_ns": packed(pa.int64(), "starts"),
        "end_ns": packed(pa.int64(), "ends"),
        "status": packed(pa.int8(), "statuses"),
        "batch_id": pa.concat_arrays([pa.repeat(batch_id, len(c)).cast(pa.int64()) for batch_id, c, _, _ in batches]),
        "batch_index": pa.concat_arrays([pa.array(range(len(c)), pa.int32()) for c in columns]),
    })
