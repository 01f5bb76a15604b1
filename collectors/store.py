"""The embedded store: a DuckDB file with raw spans, one row per request, its stages, and runs.

Rows are buffered and appended in columnar (Arrow) batches on one writer thread, never row
by row. Each commit also records how far the write-ahead log has been applied, in the same
transaction, so a restart replays exactly what is not in the file yet.

Tables:

* ``spans`` — every span as received, with the fields queries need as columns. A span a
  sender retried can appear twice here; ``requests`` and ``stages`` are built from
  de-duplicated traces. ``batch_id``/``batch_index`` point at the original.
* ``batches`` — each export request exactly as received (OTLP protobuf), once; the original
  of every span, resource and scope.
* ``requests`` — one row per trace: TTFT and its split into compute / queue / coordination /
  wire / unattributed (ms), rendezvous order, bytes, NIXL times, instances, completeness.
* ``stages`` — per trace and stage: duration and the part of it on the critical path.
* ``runs`` — one row per collector start, with its configuration.
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

from .attribution import Breakdown
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from .model import SpanRow, decode

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id VARCHAR, span_id VARCHAR, parent_span_id VARCHAR, name VARCHAR, stage VARCHAR,
    service VARCHAR, instance VARCHAR, role VARCHAR, mode VARCHAR,
    start_ns BIGINT, end_ns BIGINT, duration_ms DOUBLE, status TINYINT, request_id VARCHAR,
    batch_id VARCHAR, batch_index INTEGER
);
CREATE TABLE IF NOT EXISTS batches (batch_id VARCHAR, run_id VARCHAR, payload BLOB);
CREATE TABLE IF NOT EXISTS requests (
    trace_id VARCHAR PRIMARY KEY, request_id VARCHAR, mode VARCHAR, started_at TIMESTAMPTZ,
    ttft_ms DOUBLE, compute_ms DOUBLE, queue_ms DOUBLE, coordination_ms DOUBLE, wire_ms DOUBLE,
    unattributed_ms DOUBLE, prompt_tokens INTEGER, rendezvous_order VARCHAR, engine_loop_ms DOUBLE,
    transfer_bytes BIGINT, transfer_post_us BIGINT, transfer_xfer_us BIGINT,
    prefill_instance VARCHAR, decode_instance VARCHAR, complete BOOLEAN, missing VARCHAR,
    error BOOLEAN, clock_offsets VARCHAR, updated_at TIMESTAMPTZ
);
CREATE TABLE IF NOT EXISTS stages (
    trace_id VARCHAR, side VARCHAR, stage VARCHAR, category VARCHAR,
    start_ns BIGINT, end_ns BIGINT, duration_ms DOUBLE, critical_ms DOUBLE
);
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR, started_at TIMESTAMPTZ, kvtrace_version VARCHAR, config VARCHAR
);
CREATE TABLE IF NOT EXISTS wal_state (id INTEGER PRIMARY KEY, segment INTEGER, "offset" BIGINT);
"""

_SPAN_COLUMNS = ("trace_id", "span_id", "parent_span_id", "name", "stage", "service", "instance", "role",
                 "mode", "start_ns", "end_ns", "duration_ms", "status", "request_id", "batch_id", "batch_index")


class Store:
    def __init__(self, path: str, *, flush_interval_s: float = 0.5, flush_rows: int = 20_000) -> None:
        self.path = path
        self._con = duckdb.connect(path)
        self._con.execute(SCHEMA)
        self._lock = threading.Lock()  # guards the buffers; the connection is used by one thread
        self._db_lock = threading.Lock()
        self._columns: dict[str, list] = {c: [] for c in _SPAN_COLUMNS}
        self._batches: dict[str, list] = {"batch_id": [], "run_id": [], "payload": []}
        self._batch_ids = itertools.count()
        self._breakdowns: dict[str, Breakdown] = {}
        self._replaced: set[str] = set()
        self._position: tuple[int, int] | None = None
        self._flush_interval = flush_interval_s
        self._flush_rows = flush_rows
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.run_id = uuid.uuid4().hex[:12]

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

    def add_spans(self, rows: list[SpanRow], position: tuple[int, int] | None, payload: bytes) -> None:
        """``rows`` decoded, in order, from ``payload`` (one export request as received)."""
        batch_id = f"{self.run_id}-{next(self._batch_ids)}"
        with self._lock:
            self._batches["batch_id"].append(batch_id)
            self._batches["run_id"].append(self.run_id)
            self._batches["payload"].append(payload)
            c = self._columns
            c["batch_id"].extend([batch_id] * len(rows))
            c["batch_index"].extend(range(len(rows)))
            for r in rows:
                c["trace_id"].append(r.trace_id)
                c["span_id"].append(r.span_id)
                c["parent_span_id"].append(r.parent_span_id)
                c["name"].append(r.name)
                c["stage"].append(r.stage)
                c["service"].append(r.service)
                c["instance"].append(r.instance)
                c["role"].append(r.role)
                c["mode"].append(r.mode)
                c["start_ns"].append(r.start)
                c["end_ns"].append(r.end)
                c["duration_ms"].append((r.end - r.start) / 1e6)
                c["status"].append(r.status)
                c["request_id"].append(r.attrs.get("kvtrace.request_id"))
            if position is not None:
                self._position = position
            full = len(c["trace_id"]) >= self._flush_rows
        if full:
            self._wake.set()

    def add_breakdown(self, breakdown: Breakdown, replaces: bool = False) -> None:
        """``replaces``: the trace was decided before (late spans); its old stage rows go."""
        with self._lock:
            self._breakdowns[breakdown.trace_id] = breakdown
            if replaces:
                self._replaced.add(breakdown.trace_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        with self._lock:
            columns, self._columns = self._columns, {c: [] for c in _SPAN_COLUMNS}
            batches, self._batches = self._batches, {"batch_id": [], "run_id": [], "payload": []}
            breakdowns, self._breakdowns = self._breakdowns, {}
            replaced, self._replaced = self._replaced, set()
            position = self._position
        n = len(columns["trace_id"])
        if not n and not breakdowns and position is None:
            return
        with self._db_lock:
            con = self._con
            con.execute("BEGIN")
            try:
                if n:
                    con.register("span_batch", pa.table(columns))
                    con.execute("INSERT INTO spans SELECT * FROM span_batch")
                    con.unregister("span_batch")
                if batches["batch_id"]:
                    con.register("raw_batch", pa.table({**batches, "payload": pa.array(batches["payload"], pa.binary())}))
                    con.execute("INSERT INTO batches SELECT * FROM raw_batch")
                    con.unregister("raw_batch")
                if breakdowns:
                    self._write_breakdowns(con, list(breakdowns.values()), replaced)
                if position is not None:
                    con.execute('INSERT OR REPLACE INTO wal_state VALUES (0, ?, ?)', list(position))
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise

    @staticmethod
    def _write_breakdowns(con: Any, breakdowns: list[Breakdown], replaced: set[str]) -> None:
        now = datetime.now(timezone.utc)
        ms = 1e6
        requests = pa.table({
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
            "clock_offsets": [json.dumps(b.offsets_ns) for b in breakdowns],
            "updated_at": pa.array([now] * len(breakdowns), pa.timestamp("us", tz="UTC")),
        })
        stage_rows = [(b.trace_id, s) for b in breakdowns for s in b.stages]
        stages = pa.table({
            "trace_id": [t for t, _ in stage_rows], "side": [s.side for _, s in stage_rows],
            "stage": [s.stage for _, s in stage_rows], "category": [s.category for _, s in stage_rows],
            "start_ns": [s.start for _, s in stage_rows], "end_ns": [s.end for _, s in stage_rows],
            "duration_ms": [s.duration / ms for _, s in stage_rows],
            "critical_ms": [s.critical_ns / ms for _, s in stage_rows],
        })
        con.register("request_batch", requests)
        con.register("stage_batch", stages)
        if replaced:  # a trace decided again (late spans) replaces its earlier stage rows
            con.execute("DELETE FROM stages WHERE list_contains(?, trace_id)", [sorted(replaced)])
        con.execute("INSERT OR REPLACE INTO requests SELECT * FROM request_batch")
        con.execute("INSERT INTO stages SELECT * FROM stage_batch")
        con.unregister("request_batch")
        con.unregister("stage_batch")

    # ------------------------------------------------------------------ reads

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self._db_lock:
            return self._con.execute(sql, params or []).fetchall()

    def stored_rows(self, trace_id: str) -> list[SpanRow]:
        """The trace's committed spans, decoded again from their stored original requests."""
        rows = []
        wanted = self.query("SELECT DISTINCT s.batch_id, s.batch_index, b.payload FROM spans s "
                            "JOIN batches b USING (batch_id) WHERE s.trace_id = ? ORDER BY 1, 2", [trace_id])
        decoded: dict[str, list[SpanRow]] = {}
        for batch_id, index, payload in wanted:
            if batch_id not in decoded:
                request = ExportTraceServiceRequest()
                request.ParseFromString(payload)
                decoded[batch_id] = decode(request)
            rows.append(decoded[batch_id][index])
        return rows

