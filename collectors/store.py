"""The embedded store: a DuckDB file with raw spans, one row per request, rollups, and the
collector's own health. The layout is :mod:`.schema`'s; readers go through the read side, :mod:`.read`.

Rows are buffered and appended in columnar (Arrow) batches on one writer thread, never row
by row. Each commit also records how far the write-ahead log has been applied and bumps the
data version (``store_state.flush_id``), in the same transaction as the rows and their
rollups, so a restart replays exactly what is not in the file yet and a reader's cache knows
when to look again.

A file written by a kvtrace whose tables differ is refused at start with a clear error
(``schema_version``), never half-written.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import itertools
import json
import logging
import operator
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.telemetry import semconv

from . import schema
from .breakdown import Breakdown, category_of
from .model import INT32_MAX, Origin, SpanBatch, SpanColumns, finite_number, whole_number
from .threads import name_os_thread
from .wire import native

logger = logging.getLogger(__name__)

# Ids arrive as the numbers their bytes spell (:func:`_id_words`): the trace id's two halves become one
# UHUGEINT per vector in DuckDB, not per span in Python; a root's parent (all zeros) is NULL.
_INSERT_SPANS = """INSERT INTO span_rows SELECT (trace_high::UHUGEINT << 64) | trace_low, span_id,
    nullif(parent_span_id, 0), name, stage, origin_id, start_ns, end_ns, status, batch_id, batch_index FROM incoming"""
COMPACT_EVERY_S = 60.0
CHECKPOINT_THRESHOLD = "256MB"
"""DuckDB folds its WAL into the file once the WAL is this big (its default, 16 MB, checkpoints every ~150k spans).
Each checkpoint rewrites the tables' last row groups and the requests' key index, so it costs more as the
store grows: at 256 MB the flushes and checkpoints of 1 M spans cost ~0.8 µs less per span
(bench/collector_stages.py). The price is a bigger WAL for DuckDB to replay when the collector was
killed; a clean stop checkpoints."""
ISOLATE_AFTER = 3
"""Flushes failed in a row before the writer looks for a decided trace the store cannot take
(:meth:`BufferedStore._isolate`)."""
_ADD_ROLLUPS = schema.rollup_statements("flush_id = ?", 1)
_RETRACT_ROLLUPS = schema.rollup_statements("trace_id IN (SELECT unnest(?))", -1)




class SchemaMismatch(ValueError):
    """The store (a DuckDB file, a ClickHouse database) was written by a kvtrace with different tables."""


@dataclasses.dataclass
class Pending:
    """What a store holds for its next flush (:meth:`BufferedStore.take`)."""

    batches: list  # one entry per export request, in the store's own form (:meth:`BufferedStore._entry`)
    decided: list[tuple[Breakdown, bool, int]]  # (breakdown, replaces, decided at ns)
    health: list[tuple]
    samples: list[Any]  # .clocks.Sample
    runs: list[tuple]
    position: tuple[int, int] | None  # where the write-ahead log is once this flush commits

    def empty(self) -> bool:
        return not (self.batches or self.decided or self.health or self.samples or self.runs) and self.position is None


class BufferedStore:
    """What both stores share (the embedded :class:`Store`, the fleet's ``ClickHouseStore``): the pipeline
    adds rows to buffers, and one writer thread flushes them every ``flush_interval_s``, or sooner once
    ``flush_rows`` spans wait. A subclass writes a flush (:meth:`flush`) and says what it keeps of a request."""

    def __init__(self, path: str, *, flush_interval_s: float, flush_rows: int) -> None:
        self.path = path
        self._lock = threading.Lock()  # guards the buffers
        self._batches: list = []
        self._rows = 0
        self._breakdowns: dict[str, tuple[Breakdown, bool, int]] = {}  # trace id -> (breakdown, replaces, at)
        self._health: list[tuple] = []
        self._clock_samples: list[Any] = []  # .clocks.Sample
        self._runs: dict[str, tuple] = {}
        self._position: tuple[int, int] | None = None
        self.committed_position: tuple[int, int] | None = None  # the log position of the last commit
        self.committed_at = 0.0  # wall time of this process's last commit
        self.dropped_decisions = 0  # breakdowns the store could not take, dropped by _isolate
        self._flushing = threading.Lock()  # one flush at a time (the writer's, its isolation's, a test's, a Kafka rebalance's)
        self.flushes = 0
        """Flushes completed, those that found nothing to write included: whatever is buffered when this
        reads n is committed once it reads n + 2 (a flush under way at n may have taken the buffers just
        before). The Kafka receiver's offsets wait on it."""
        self._flush_interval = flush_interval_s
        self._flush_rows = flush_rows
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.collector_run_id = uuid.uuid4().hex[:12]
        """This collector start's id (``collector_runs``)."""

    def _entry(self, batch: SpanBatch, position: tuple[int, int] | None) -> Any:
        """What the store keeps of one export request until its flush (called under the buffers' lock)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Commit everything buffered (the writer thread calls this; so may a test). If the commit fails,
        nothing of it counts and the rows go back for the next flush."""
        with self._flushing:
            pending = self.take()
            if not pending.empty():  # nothing new: no commit, and the data version stays
                with self.putting_back(pending):
                    self._write(pending)
            self.flushes += 1

    def _write(self, pending: Pending) -> None:
        """One commit of ``pending``; raises if it fails."""
        raise NotImplementedError

    def _close(self) -> None:
        """After the last flush."""

    def _between_flushes(self) -> None:
        """The writer thread's other work, after each flush."""

    # ------------------------------------------------------------------ lifecycle

    def _start_writer(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtrace-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread()
        failures = 0  # flushes failed in a row
        while not self._stop.is_set():
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            try:
                self.flush()
                failures = 0
            except Exception:  # the rows went back to the buffers (putting_back): the next flush retries
                failures += 1
                logger.exception("kvtrace store: a flush into %s failed; retrying", self.path)
                if failures >= ISOLATE_AFTER:
                    failures = 0
                    with self._flushing:  # its commits are flushes too: none may interleave with them
                        self._isolate()
                else:
                    time.sleep(1.0)
            self._between_flushes()

    def _isolate(self) -> None:
        """After :data:`ISOLATE_AFTER` failed flushes in a row: commit all but the decided traces, then those
        in halves, so that a breakdown the store cannot take (tried alone twice) is dropped, with an error
        naming its trace, and every other row is kept (before, one such row failed every later flush).
        Where all but the decided traces fails too (even nothing at all: the commit's own record), the fault
        is not in a row (the disk, the server): everything goes back, as after any failed flush."""
        pending = self.take()
        try:
            with self.putting_back(pending):
                self._write(dataclasses.replace(pending, decided=[]))
        except Exception:
            logger.exception("kvtrace store: %s fails without the decided traces too; retrying", self.path)
            time.sleep(1.0)
            return
        failed = [decision for decision, _ in self._unstorable(pending.decided)]
        for (breakdown, _, _), error in self._unstorable(failed):  # once more: a failure that passed is not the row's
            self.dropped_decisions += 1
            logger.error("kvtrace store: dropped the breakdown of trace %s, which %s cannot store (its spans are "
                         "stored): %s", breakdown.trace_id, self.path, error)

    def _unstorable(self, decided: list) -> list[tuple[tuple, Exception]]:
        """Each of ``decided`` that fails alone, with its error; the others are committed, halves at a
        time (with one bad among n, ~2 log2 n commits)."""
        if not decided:
            return []
        try:
            self._write(Pending([], decided, [], [], [], None))
            return []
        except Exception as exc:
            if len(decided) == 1:
                return [(decided[0], exc)]
        half = len(decided) // 2
        return self._unstorable(decided[:half]) + self._unstorable(decided[half:])

    def shutdown(self) -> None:
        """Flush and close; safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()
        self._close()

    # ------------------------------------------------------------------ writes

    def add_spans(self, batch: SpanBatch, position: tuple[int, int] | None) -> None:
        """One export request; ``position``: where the write-ahead log is once it is stored."""
        with self._lock:
            self._batches.append(self._entry(batch, position))
            self._rows += len(batch.rows)
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
            self._breakdowns[breakdown.trace_id] = (breakdown, replaces or (earlier is not None and earlier[1]),
                                                    time.time_ns())

    def add_run(self, run_id: str, config: str, at_ns: int) -> None:
        """A run record (``kvtrace.run``): its configuration and results as JSON, written with the
        next commit; a run recorded again replaces its row."""
        with self._lock:
            self._runs[run_id] = (run_id, datetime.fromtimestamp(at_ns / 1e9, timezone.utc), config)

    def add_clock_sample(self, sample: Any) -> None:
        """One measured offset of a sender (:class:`.clocks.Sample`), written with the next commit."""
        with self._lock:
            self._clock_samples.append(sample)

    def add_health(self, counters: dict[str, float]) -> None:
        """The collector's counters now (:data:`.schema.HEALTH_COLUMNS`), written with the next commit."""
        row = (self.collector_run_id, datetime.now(timezone.utc), *(counters.get(c, 0) for c in schema.HEALTH_COLUMNS))
        with self._lock:
            self._health.append(row)

    def take(self) -> Pending:
        """Everything buffered, for one flush (the buffers start again empty)."""
        with self._lock:
            pending = Pending(self._batches, list(self._breakdowns.values()), self._health, self._clock_samples,
                              list(self._runs.values()), self._position)
            self._batches, self._rows, self._breakdowns = [], 0, {}
            self._health, self._clock_samples, self._runs = [], [], {}
            # Taken with the flush that records it: left here, it made every later flush a commit with
            # nothing new (~6 ms of CPU every 0.5 s, and a new data version that emptied readers' caches).
            self._position = None
        return pending

    @contextlib.contextmanager
    def putting_back(self, pending: Pending):
        """Around a flush's writes: if they fail, its rows go back before what came since (the next
        flush writes them) and the error goes on."""
        try:
            yield
        except Exception:
            self._put_back(pending)
            raise

    def _put_back(self, pending: Pending) -> None:
        with self._lock:  # (the span count, which only hastens a flush, is left as it is)
            self._batches[:0] = pending.batches
            self._breakdowns = {**{b.trace_id: (b, r, at) for b, r, at in pending.decided}, **self._breakdowns}
            self._health[:0] = pending.health
            self._clock_samples[:0] = pending.samples
            self._runs = {**{run[0]: run for run in pending.runs}, **self._runs}
            if self._position is None:  # a later request's position, where one came since, covers this one's
                self._position = pending.position


class Store(BufferedStore):
    """The embedded store: one DuckDB file, each flush one transaction."""

    def __init__(self, path: str, *, flush_interval_s: float = 0.5, flush_rows: int = 65_536) -> None:
        super().__init__(path, flush_interval_s=flush_interval_s, flush_rows=flush_rows)
        # One writer thread appends large batches: DuckDB's own thread pool only adds
        # hand-offs (it measured 2.6x slower inserts on a collector pinned to one core).
        # No file access from SQL: readers of a running collector send queries here
        # (.query_service), and those must see the store's tables and nothing else.
        self._con = _connect(path)
        try:
            self._create_schema()
        except Exception:
            self._con.close()
            raise
        self._db_lock = threading.Lock()  # the connection is used by one thread at a time
        # Batch ids count on from the file's last; each sender (service, instance, role, mode,
        # run) is a row of ``origins``, its id given on first sight and kept across runs.
        self._batch_ids = itertools.count(self._con.execute("SELECT coalesce(max(batch_id), 0) + 1 FROM batches")
                                          .fetchone()[0])
        self._origin_ids: dict[tuple[str, ...], int] = {
            tuple(row[1:]): row[0] for row in self._con.execute("SELECT * FROM origins").fetchall()}
        # Each (side, stage) is a small id in ``stage_keys``, given on first sight, like a sender.
        self._stage_ids: dict[tuple[str, str], int] = {
            (side, stage): key for key, side, stage, _ in self._con.execute("SELECT * FROM stage_keys").fetchall()}
        state = self._con.execute("SELECT flush_id FROM store_state WHERE id = 0").fetchone()
        self.data_version = int(state[0]) if state else 0
        """Commits so far, in this file's life: a reader re-reads when it changes."""
        self._next_compaction = time.monotonic() + COMPACT_EVERY_S

    def _create_schema(self) -> None:
        """Create the tables in a new file; refuse, before writing anything, a file from another schema."""
        con = self._con
        tables = {row[0] for row in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()}
        if tables:
            found = con.execute("SELECT max(version) FROM schema_version").fetchone()[0] \
                if "schema_version" in tables else None
            while found in schema.MIGRATIONS:  # an older file this kvtrace knows how to bring up to date
                logger.info("kvtrace collector: %s: bringing store schema %d up to %d (a large file takes a while)",
                            self.path, found, found + 1)
                con.execute("BEGIN TRANSACTION")
                con.execute(schema.MIGRATIONS[found])
                con.execute("COMMIT")
                logger.info("kvtrace collector: %s: store schema %d brought up to %d", self.path, found, found + 1)
                found += 1
            if found != schema.SCHEMA_VERSION:
                raise SchemaMismatch(f"--db {self.path}: written by a kvtrace with store schema {found or 1}, "
                                     f"this one uses {schema.SCHEMA_VERSION}; use a new file")
        con.execute(schema.TABLES)
        con.execute(schema.VIEWS)
        if not tables:
            con.execute("INSERT INTO schema_version VALUES (?)", [schema.SCHEMA_VERSION])

    # ------------------------------------------------------------------ lifecycle

    def start(self, version: str, config: dict[str, Any]) -> None:
        with self._db_lock:
            self._con.execute("INSERT INTO collector_runs VALUES (?, ?, ?, ?)",
                              [self.collector_run_id, datetime.now(timezone.utc), version, json.dumps(config, default=str)])
        self._start_writer()

    def _close(self) -> None:
        with self._db_lock:
            self._con.close()

    def wal_position(self) -> tuple[int, int]:
        with self._db_lock:
            row = self._con.execute("SELECT wal_segment, wal_offset FROM store_state WHERE id = 0").fetchone()
        return (int(row[0]), int(row[1])) if row and row[0] is not None else (0, 0)

    # ------------------------------------------------------------------ writes

    def _entry(self, batch: SpanBatch, position: tuple[int, int] | None) -> tuple[int, SpanColumns, int, tuple | None]:
        # (batch id, its columns, bytes of its original, log position): only what the tables need,
        # so a batch's rows and original are freed once the assembler is done with them
        return next(self._batch_ids), batch.columns, len(batch.payload), position

    def _between_flushes(self) -> None:
        if time.monotonic() >= self._next_compaction:
            self._next_compaction = time.monotonic() + COMPACT_EVERY_S
            try:
                self.compact()
            except duckdb.Error:  # the rollups stay correct uncompacted: try again next time
                logger.exception("kvtrace store: rollup compaction failed")

    def compact(self, until: datetime | None = None) -> None:
        """Merge the rollups' partial rows into one per key and minute, for the minutes since the last
        compaction up to ``until`` (default: two minutes ago, past which few requests still start)."""
        if until is None:
            until = datetime.now(timezone.utc) - timedelta(minutes=2)
        until = until.replace(second=0, microsecond=0)
        with self._db_lock:
            con = self._con
            row = con.execute("SELECT compacted_until FROM store_state WHERE id = 0").fetchall()
            since = row[0][0] if row and row[0][0] is not None else datetime(1970, 1, 1, tzinfo=timezone.utc)
            if since >= until:
                return
            con.execute("BEGIN")
            try:
                for rollup in schema.ROLLUPS:
                    for statement in rollup.compaction():
                        con.execute(statement, [since, until] if "$1" in statement else [])
                con.execute("INSERT INTO store_state (id, compacted_until) VALUES (0, ?) ON CONFLICT DO UPDATE SET "
                            "compacted_until = excluded.compacted_until", [until])
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise

    def _write(self, pending: Pending) -> None:
        """``pending`` as one transaction."""
        batches, decided, position = pending.batches, [(b, replaces) for b, replaces, _ in pending.decided], pending.position
        with self._db_lock:  # the origin and stage registries are the writer's too
            flush_id = self.data_version + 1
            new_origins: dict[tuple[str, ...], int] = {}
            new_stages: dict[tuple[str, str], int] = {}
            tables = {  # built once, outside the transaction (and its retry); an empty buffer makes no table
                **self._span_tables(batches, new_origins),
                **({"requests": request_table([b for b, _ in decided], flush_id, self._stage_ids,
                                               lambda key: self._stage_id(key, new_stages))} if decided else {}),
                **_registry_tables(new_origins, new_stages),
                **record_tables(pending.samples, pending.runs, pending.health),
            }
            replaced = [b.trace_id for b, replaces in decided if replaces]
            try:
                self._commit(tables, replaced, position, flush_id, on_conflict="")
            except duckdb.ConstraintException:
                # A trace decided again after the assembler had forgotten it (a span far too
                # late): keep the stored row. Rare, so first decisions are a plain insert
                # (INSERT OR IGNORE costs ~4 µs more per row, OR REPLACE 5-35 µs).
                self._commit(tables, replaced, position, flush_id, on_conflict="OR IGNORE")
            self._origin_ids.update(new_origins)
            self._stage_ids.update(new_stages)
            self.data_version = flush_id
            self.committed_at = time.time()
        if position is not None:
            self.committed_position = position

    def _span_tables(self, batches: list[tuple[int, SpanColumns, int, tuple | None]],
                     new_origins: dict[tuple[str, ...], int]) -> dict[str, pa.Table]:
        """``spans`` and ``batches`` for the buffered export requests (their senders' ids given on the way)."""
        if not batches:
            return {}
        known: dict[Origin, int] = {}  # by object: a sender's requests share one Origin (model.origin_of)

        def origin_id(origin: Origin) -> int:
            found = known.get(origin)
            if found is None:
                found = known[origin] = self._origin_id(origin, new_origins)
            return found

        origin_ids = [[origin_id(o) for o in columns.origins] for _, columns, _, _ in batches]
        return {"spans": _span_table(batches, origin_ids), "batches": pa.table({
            "batch_id": pa.array([batch_id for batch_id, _, _, _ in batches], pa.int64()),
            "collector_run_id": [self.collector_run_id] * len(batches),
            "wal_segment": pa.array([p[0] if p else None for _, _, _, p in batches], pa.int32()),
            "wal_offset": pa.array([p[1] if p else None for _, _, _, p in batches], pa.int64()),
            "bytes": pa.array([size for _, _, size, _ in batches], pa.int32()),
            "spans": pa.array([len(columns) for _, columns, _, _ in batches], pa.int32())})}

    def _origin_id(self, origin: Origin, new: dict[tuple[str, ...], int]) -> int:
        """The sender's id in ``origins``; one seen for the first time gets the next id, in
        ``new`` until the flush that writes it commits."""
        key = (origin.service, origin.instance, origin.role, origin.mode, origin.run_id, origin.vllm_version,
               origin.nixl_version, origin.hardware)
        found = self._origin_ids.get(key, new.get(key))
        if found is None:
            found = new[key] = len(self._origin_ids) + len(new) + 1
        return found

    def _stage_id(self, key: tuple[str, str], new: dict[tuple[str, str], int]) -> int:
        """A (side, stage)'s id in ``stage_keys``, given on first sight (written by this flush)."""
        found = self._stage_ids.get(key)
        if found is None:
            found = new.get(key)
            if found is None:
                found = new[key] = len(self._stage_ids) + len(new) + 1
        return found

    def _commit(self, tables: dict[str, pa.Table], replaced: list[str], position: tuple[int, int] | None,
                flush_id: int, on_conflict: str) -> None:
        """One transaction: spans, batches, new origins, requests (the ``replaced`` traces' rows
        retracted from the rollups and deleted first), the new requests' rollups, health, and
        how far the write-ahead log is applied."""
        con = self._con
        con.execute("BEGIN")
        try:
            if replaced:
                for statement in _RETRACT_ROLLUPS:
                    con.execute(statement, [replaced])
                con.execute("DELETE FROM requests WHERE trace_id IN (SELECT unnest(?))", [replaced])
            for name, table in tables.items():
                con.register("incoming", table)
                conflict = on_conflict if name == "requests" else "OR REPLACE" if name == "runs" else ""
                con.execute(_INSERT_SPANS if name == "spans" else f"INSERT {conflict} INTO {name} BY NAME SELECT * FROM incoming")
                con.unregister("incoming")
            if "requests" in tables:
                for statement in _ADD_ROLLUPS:  # only rows this commit wrote carry its flush id
                    con.execute(statement, [flush_id])
            wal = list(position) if position is not None else [None, None]
            con.execute("INSERT INTO store_state VALUES (0, ?, ?, ?, now(), NULL) ON CONFLICT DO UPDATE SET "
                        "wal_segment = coalesce(excluded.wal_segment, store_state.wal_segment), "
                        "wal_offset = coalesce(excluded.wal_offset, store_state.wal_offset), "
                        "flush_id = excluded.flush_id, committed_at = excluded.committed_at", [*wal, flush_id])
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ reads

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of its own to this store, for one reader thread (DuckDB isolates it from
        the writer: it sees committed data only)."""
        return self._con.cursor()

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self._db_lock:
            return self._con.execute(sql, params or []).fetchall()

    def stored_originals(self, trace_id: str) -> list[tuple[int, int, int, int]]:
        """Where the trace's committed spans came from: (log segment, end offset, bytes, index
        of the span in its request), for each request that holds one."""
        return self.query(schema.ORIGINALS_SQL, [trace_id])


def _connect(path: str, wait_s: float = 10.0) -> duckdb.DuckDBPyConnection:
    """Open the store for writing, waiting up to ``wait_s`` for a reader to let go of it (a reader
    of a stopped store holds it read-only for a moment after each query: .reader)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return duckdb.connect(path, config={"threads": 1, "enable_external_access": False,
                                                "checkpoint_threshold": CHECKPOINT_THRESHOLD})
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            logger.info("kvtrace store: %s is open in a reader; waiting for it to let go", path)
            time.sleep(0.25)


def _registry_tables(new_origins: dict[tuple[str, ...], int], new_stages: dict[tuple[str, str], int]) -> dict[str, pa.Table]:
    """The senders and (side, stage) keys seen for the first time in this flush."""
    tables = {}
    if new_origins:
        tables["origins"] = pa.table({
            "origin_id": pa.array(list(new_origins.values()), pa.int32()),
            **{column: [key[i] for key in new_origins] for i, column in enumerate(_ORIGIN_COLUMNS)}})
    if new_stages:
        tables["stage_keys"] = pa.table({
            "stage_key": pa.array(list(new_stages.values()), pa.int16()),
            "side": [side for side, _ in new_stages], "stage": [stage for _, stage in new_stages],
            "category": [category_of(stage) for _, stage in new_stages]})
    return tables


def record_tables(samples: list[Any], runs: list[tuple], health: list[tuple]) -> dict[str, pa.Table]:
    """Clock samples (:class:`.clocks.Sample`), sweep-run records and the collector's health rows buffered
    since the last flush."""
    tables = {}
    if samples:
        tables["clock_samples"] = pa.table({
            "instance": [s.instance for s in samples],
            "sent_at": pa.array([s.at // 1000 for s in samples], pa.timestamp("us", tz="UTC")),
            "offset_ms": [s.offset / 1e6 for s in samples], "bound_ms": [s.bound / 1e6 for s in samples]})
    if runs:
        run_ids, recorded, configs = zip(*runs)
        tables["runs"] = pa.table({"run_id": run_ids, "recorded_at": pa.array(
            recorded, pa.timestamp("us", tz="UTC")), "config": configs})
    if health:
        tables["collector_health"] = pa.table(list(zip(*health)),
                                              names=["collector_run_id", "recorded_at", *schema.HEALTH_COLUMNS])
    return tables


def request_table(breakdowns: list[Breakdown], flush_id: int, known: dict[tuple[str, str], int],
                   assign: Callable[[tuple[str, str]], int], stage_id_type: pa.DataType = pa.int16()) -> pa.Table:
    """One row per trace with its breakdown: the ``requests`` table's columns (inserted by name);
    ``stage_ids`` of ``stage_id_type`` (the embedded store's small ids, a shared store's hashed ones)."""
    now = datetime.now(timezone.utc)
    stage_ids, starts, ends, critical, offsets = stage_columns(breakdowns, known, assign)
    instances: list[str] = []  # the clock maps: flat keys and values, one offset per row
    instance_offsets: list[int] = []
    clock_offsets = [0]
    bounded: list[str] = []
    bounds: list[int] = []
    clock_bounds = [0]
    for b in breakdowns:
        instances.extend(b.offsets_ns)
        instance_offsets.extend(b.offsets_ns.values())
        clock_offsets.append(len(instances))
        bounded.extend(b.clock_bounds_ns)
        bounds.extend(b.clock_bounds_ns.values())
        clock_bounds.append(len(bounded))

    clients = [b.client for b in breakdowns]
    any_client = any(clients)  # only the load generator's requests have a client span

    def lists(values: pa.Array) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, values)

    return pa.table({
        "trace_id": [b.trace_id for b in breakdowns],
        "request_id": [b.request_id for b in breakdowns],
        "run_id": [b.run_id for b in breakdowns],
        "mode": [b.mode for b in breakdowns],
        **number_columns(breakdowns),  # NUMBER_COLUMNS: times, the parts, tokens, the transfer
        "rendezvous_order": [b.rendezvous_order for b in breakdowns],
        "prefill_instance": [b.prefill_instance for b in breakdowns],
        "decode_instance": [b.decode_instance for b in breakdowns],
        "complete": [b.complete for b in breakdowns],
        "missing": [",".join(b.missing) for b in breakdowns],
        "error": [b.error for b in breakdowns],
        "clock_offsets": pa.MapArray.from_arrays(pa.array(clock_offsets, pa.int32()), pa.array(instances, pa.string()),
                                                 pa.array(instance_offsets, pa.int64())),
        "clock_bounds": pa.MapArray.from_arrays(pa.array(clock_bounds, pa.int32()), pa.array(bounded, pa.string()),
                                                pa.array(bounds, pa.int64())),
        "clock_suspect": [b.clock_suspect for b in breakdowns],
        "stage_ids": lists(stage_ids.cast(stage_id_type)),
        "stage_start_ns": lists(starts),
        "stage_end_ns": lists(ends),
        "stage_critical_ns": lists(critical),
        "flush_id": pa.array([flush_id] * len(breakdowns), pa.int64()),
        "updated_at": pa.array([now] * len(breakdowns), pa.timestamp("us", tz="UTC")),
        **{column: pa.array([_client_value(client, key, scale, kind) for client in clients], kind)
           if any_client else pa.nulls(len(breakdowns), kind) for column, key, scale, kind in _CLIENT_COLUMNS},
        "ttft_reference": [b.ttft_reference for b in breakdowns],
        "explanation": [b.explanation for b in breakdowns],
    })


# How a numeric column of ``requests`` is read off a breakdown (``_otlp.number_columns`` has them in this order):
# ns as ms (float64), an int64, an int32 (a count), ns as a µs timestamp.
MS, INT64, INT32, MICROSECONDS = range(4)
_NUMBER_TYPES = {MS: pa.float64(), INT64: pa.int64(), INT32: pa.int32(), MICROSECONDS: pa.timestamp("us", tz="UTC")}
NUMBER_COLUMNS: tuple[tuple[str, str, str | None, int], ...] = (
    # (requests column, Breakdown field, the key in its parts where it is one, kind)
    ("started_at", "start_ns", None, MICROSECONDS),
    ("ttft_ms", "ttft_ns", None, MS),
    *((column, "parts", part, MS) for part, column in zip(schema.PARTS, schema.PART_COLUMNS)),
    ("e2e_ms", "e2e_ns", None, MS),
    ("tpot_ms", "tpot_ns", None, MS),
    ("output_tokens", "output_tokens", None, INT32),
    ("prompt_tokens", "prompt_tokens", None, INT32),
    ("engine_loop_ms", "engine_loop_ns", None, MS),
    ("transfer_bytes", "transfer_bytes", None, INT64),
    ("transfer_descriptors", "transfer_descriptors", None, INT64),
    ("transfer_post_us", "transfer_post_us", None, INT64),
    ("transfer_xfer_us", "transfer_xfer_us", None, INT64),
    ("block_count", "block_count", None, INT32),
    ("kv_hold_ms", "kv_hold_ns", None, MS),
)
NULL_WHERE_ZERO = frozenset({"e2e_ms", "tpot_ms"})
"""Null where the breakdown has 0: a request the router did not see end (e2e), or with one token (TPOT)."""
_NUMBER_SPEC = tuple((field, part, kind) for _, field, part, kind in NUMBER_COLUMNS)


def number_columns_python(breakdowns: list[Breakdown]) -> dict[str, pa.Array]:
    """The requests' numeric columns (:data:`NUMBER_COLUMNS`); the reference of the native ``_otlp.number_columns``."""
    columns = {}
    for column, field, part, kind in NUMBER_COLUMNS:
        values = [b.parts.get(part, 0) for b in breakdowns] if part is not None else \
            [getattr(b, field) for b in breakdowns]
        if kind == MS:
            values = [v / 1e6 if v or column not in NULL_WHERE_ZERO else None for v in values]
        elif kind == MICROSECONDS:
            values = [v // 1000 for v in values]
        columns[column] = pa.array(values, _NUMBER_TYPES[kind])
    return columns


def number_columns(breakdowns: list[Breakdown]) -> dict[str, pa.Array]:
    """:func:`number_columns_python`, natively where the extension is built (a field that is no int, or one past
    its column's type, goes the Python way: the same columns, or the same error)."""
    if native is None:
        return number_columns_python(breakdowns)
    try:
        packed = native.number_columns(breakdowns, _NUMBER_SPEC)
    except (TypeError, OverflowError):
        return number_columns_python(breakdowns)
    columns = {}
    for (column, _, _, kind), data in zip(NUMBER_COLUMNS, packed):
        values = _packed(_NUMBER_TYPES[kind], len(breakdowns), data)
        if column in NULL_WHERE_ZERO:
            values = pc.if_else(pc.equal(values, 0.0), pa.scalar(None, pa.float64()), values)
        columns[column] = values
    return columns


def stage_columns(breakdowns: list[Breakdown], known: dict[tuple[str, str], int],
                  assign: Callable[[tuple[str, str]], int]) -> tuple[pa.Array, ...]:
    """The requests' per-stage list columns, flat: (stage ids, starts, ends, time on the critical path,
    all int64, and one int32 offset per row plus one). A (side, stage) not in ``known`` gets its id
    from ``assign``, which must give the same id when asked again. Native where the extension is built
    (~4 µs a trace less); this loop is the reference."""
    if native is not None:
        ids, starts, ends, critical, offsets, unknown = native.stage_columns(breakdowns, known)
        if unknown:  # stages not seen before (the first flushes): give them ids, then once more
            known = {**known, **{key: assign(key) for key in unknown}}
            ids, starts, ends, critical, offsets, _ = native.stage_columns(breakdowns, known)
        n = len(starts) // 8
        return (_packed(pa.int64(), n, ids), _packed(pa.int64(), n, starts), _packed(pa.int64(), n, ends),
                _packed(pa.int64(), n, critical), _packed(pa.int32(), len(breakdowns) + 1, offsets))
    keys: list[tuple[str, str]] = []
    columns: tuple[list[int], list[int], list[int]] = ([], [], [])  # starts, ends, critical
    row_offsets = [0]
    for b in breakdowns:  # C-level map/extend: this loop runs for every stage of every trace
        timings = b.timings
        values = timings.values()
        keys.extend(timings)
        columns[0].extend(map(_FIRST, values))
        columns[1].extend(map(_SECOND, values))
        columns[2].extend(map(b.critical_ns.get, timings, _ZEROS))
        row_offsets.append(len(keys))
    ids = list(map(known.get, keys))
    if None in ids:  # a (side, stage) not seen before
        ids = [found if found is not None else assign(key) for found, key in zip(ids, keys)]
    return (pa.array(ids, pa.int64()), *(pa.array(column, pa.int64()) for column in columns),
            pa.array(row_offsets, pa.int32()))


_CLIENT_COLUMNS = (  # requests column, client span attribute, divisor, type
    ("client_ttft_ms", semconv.CLIENT_TTFT_NS, 1e6, pa.float64()),
    ("client_tpot_ms", semconv.CLIENT_TPOT_NS, 1e6, pa.float64()),
    ("client_itl_p50_ms", semconv.CLIENT_ITL_P50_NS, 1e6, pa.float64()),
    ("client_itl_p99_ms", semconv.CLIENT_ITL_P99_NS, 1e6, pa.float64()),
    ("client_output_tokens", semconv.CLIENT_OUTPUT_TOKENS, None, pa.int32()),
    ("point_rate", semconv.BENCH_RATE, None, pa.float64()),
    ("point_concurrency", semconv.BENCH_CONCURRENCY, None, pa.int32()),
    ("point_prompt_tokens", semconv.BENCH_PROMPT_TOKENS, None, pa.int32()),
)


def _client_value(client: dict[str, float], key: str, scale: float | None, kind: pa.DataType) -> float | None:
    """A client-span measure for its column: None where the request had no client span, lacks it, or holds
    no number the column can take (a value past an int32 column's range failed every later flush)."""
    value = client.get(key) if client else None
    if value is None:
        return None
    if kind == pa.int32():
        return whole_number(value, INT32_MAX)
    number = finite_number(value)
    return number / scale if scale and number is not None else number


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_ZEROS = itertools.repeat(0)
_ORIGIN_COLUMNS = ("service", "instance", "role", "mode", "run_id", "vllm_version", "nixl_version", "hardware")


def _span_table(batches: list[tuple[int, SpanColumns, int, Any]], origin_ids: list[list[int]]) -> pa.Table:
    """The spans of ``batches`` as Arrow columns, from each batch's packed columns without a
    Python step per span (ids as numbers: :func:`_id_words`)."""
    columns = [batch_columns for _, batch_columns, _, _ in batches]
    n = sum(len(c) for c in columns)

    def joined(name: str) -> bytes:  # one packed column of every batch, end to end
        return b"".join(getattr(c, name) for c in columns)

    def packed(kind: pa.DataType, name: str) -> pa.Array:
        return _packed(kind, n, joined(name))

    def per_batch(kind: pa.DataType, typecode: str, values: list[int]) -> pa.Array:  # a batch's value per span
        return _packed(kind, n, b"".join(array.array(typecode, (value,)).tobytes() * len(c)
                                         for value, c in zip(values, columns)))

    trace_words = _id_words(joined("trace_ids"))  # two per trace id, high first
    # Whole-flush arithmetic rather than Arrow calls per batch (each ~5 µs: most of a small request's share):
    # each span's index in its batch is a prefix of one range; its origin's index, shifted past the batches
    # before it, picks the file's origin id out of every batch's ids laid end to end.
    positions = array.array("i", range(max(map(len, columns))))
    shift = list(itertools.accumulate((len(ids) for ids in origin_ids[:-1]), initial=0))
    origin_index = pc.add(packed(pa.int32(), "origin_index"), per_batch(pa.int32(), "i", shift))
    return pa.table({
        "trace_high": _uint64s(trace_words[0::2]),
        "trace_low": _uint64s(trace_words[1::2]),
        "span_id": _uint64s(_id_words(joined("span_ids"))),
        "parent_span_id": _uint64s(_id_words(joined("parent_ids"))),
        "name": pa.array([name for c in columns for name in c.names], pa.string()),
        "stage": pa.array([stage for c in columns for stage in c.stages], pa.string()),
        "origin_id": pa.array([i for ids in origin_ids for i in ids], pa.int32()).take(origin_index),
        "start_ns": packed(pa.int64(), "starts"),
        "end_ns": packed(pa.int64(), "ends"),
        "status": packed(pa.int8(), "statuses"),
        "batch_id": per_batch(pa.int64(), "q", [batch_id for batch_id, _, _, _ in batches]),
        "batch_index": _packed(pa.int32(), n, b"".join(positions[:len(c)] for c in columns)),
    })


def _id_words(packed: bytes) -> array.array:
    """Ids packed end to end (8 bytes each, a trace id two) as the unsigned 64-bit numbers their bytes spell,
    most significant byte first: the number's hex is the id's (``span_rows``; the ``spans`` view writes it)."""
    words = array.array("Q", packed)
    if sys.byteorder == "little":
        words.byteswap()
    return words


def _uint64s(words: array.array) -> pa.Array:
    return _packed(pa.uint64(), len(words), words)


def _packed(kind: pa.DataType, length: int, data: Any) -> pa.Array:
    """``length`` values of ``kind`` (fixed width, no nulls) from their bytes packed end to end, without a copy."""
    return pa.Array.from_buffers(kind, length, [None, pa.py_buffer(data)])
