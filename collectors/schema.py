"""The store's layout in one place: its tables, views and rollups, and the columns of a breakdown.

Everything here is derived from the contract (:mod:`kvtrace.telemetry.semconv`); the store
writes these tables, the read side (:mod:`.read`) reads them, and nothing else states them again.

* ``requests`` — one row per trace: TTFT and its parts (:data:`PART_COLUMNS`, ms), the decode
  side as the router saw it (e2e, TPOT, output tokens), transfer details, instances,
  completeness, clock offsets, and each stage of the breakdown as parallel lists
  (``stage_ids`` into ``stage_keys``, ``stage_start_ns``/``stage_end_ns`` on the router's
  clock (the router's; P's behind another router), ``stage_critical_ns``) — the attribution's own numbers, stored as it made them rather
  than recomputed in SQL. ``flush_id`` is the commit that wrote the row. A request a load
  generator sent (``kvtrace bench sweep``) also has its client's measures (``client_*``) and
  its point (``point_rate`` or ``point_concurrency``, ``point_prompt_tokens``); ``run_id``
  groups it with its run. ``ttft_reference`` says what its TTFT runs from
  (:class:`~kvtrace.telemetry.semconv.TtftReference`: ``router``, ``gateway`` or ``engine``);
  ``explanation`` is the request in one sentence (:mod:`.explain`).
* ``runs`` — one row per run record (``kvtrace.run`` span): the run's configuration and the load
  generator's per-point results, as JSON (``config``).
* ``stage_keys`` — one row per (side, stage) ever seen, with its category: the contract's
  stages and any other a sender names, each given a small id on first sight.
* ``stages`` — a view: those lists unnested, one row per (trace, stage).
* ``spans`` — a view: every span as received (``span_rows`` joined with ``origins``, one row
  per sender); ``batches`` says where each export request's original bytes are in the
  write-ahead log. ``span_rows`` holds each id as the number its bytes spell (big-endian; a root's
  parent NULL) and the view writes it in hex, as every other table does: since schema 12, because
  numbers cost the collector's writer less than text to insert and checkpoint (docs/PERFORMANCE.md).
  The view's hex is written per row, so a filter on it reads every span: ``trace_spans('<id>')`` (a
  table macro, the same columns) finds one trace's spans by number.
* Rollups, kept up to date in the transaction that writes the requests, so no page scans raw
  rows for a chart (exact KPI percentiles of small selections do, :mod:`.read.quantiles`): ``request_rollup`` (per minute × run × mode × prompt-length
  bucket × P/D instances × completeness × rendezvous order × TTFT bucket: counts and sums),
  ``tpot_rollup`` (… × TPOT bucket) and ``stage_rollup`` (… × stage × duration bucket). The
  buckets are log-spaced (:data:`HIST_PER_OCTAVE` per doubling), so percentiles come from
  summed bucket counts; sums (means, shares, stacked parts) are exact.
  ``request_rollup`` also sums the clock offsets applied to P's and D's times (and keeps
  their least and greatest).
* ``clock_samples`` — each sender's measured clock offset to the collector (collector minus
  sender) and its error bound, per exchange (:mod:`.clocks`); per request, ``clock_offsets`` are
  what was added to each process's times to put them on the router's clock and
  ``clock_bounds`` their error bounds (measured instances only).
* ``collector_runs`` (one row per collector start), ``collector_health`` (its counters over
  time), ``store_state`` (how far the write-ahead log is applied, and the data version).

A rollup row whose trace is decided again (late spans) is retracted and added anew; min/max
columns are not retracted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

from kvtrace.telemetry import semconv

SCHEMA_VERSION: Final = 12
"""Bump when a table, view or rollup changes: a file with another version is refused, unless
:data:`MIGRATIONS` (below the rollups, which the last one rebuilds) brings it up to this one."""

PARTS: Final = tuple(c.value for c in semconv.BREAKDOWN_CATEGORIES)
PART_COLUMNS: Final = tuple(f"{part}_ms" for part in PARTS)
"""The request columns holding each part of TTFT, in the contract's order."""

HIST_PER_OCTAVE: Final = 9
"""Histogram buckets per doubling: each 2^(1/9), ~8 % wide, so that a percentile read from one is within 3.9 %
(:data:`.read.quantiles.ESTIMATE_ERROR`; 8 per doubling, before schema 11, gave 4.3 %)."""
HIST_FLOOR: Final = -10 * HIST_PER_OCTAVE
"""The lowest bucket: everything at or below 2^-10 ms (~1 µs), zero included."""


def bucket_sql(ms: str) -> str:
    """SQL: the histogram bucket of a value in ms."""
    return (f"CASE WHEN {ms} > 0 THEN greatest({HIST_FLOOR}, floor(log2({ms}) * {HIST_PER_OCTAVE}))::SMALLINT "
            f"ELSE {HIST_FLOOR}::SMALLINT END")


def bucket_bounds(bucket: int) -> tuple[float, float]:
    """The [low, high) ms a histogram bucket covers (the floor bucket starts at 0)."""
    low = 0.0 if bucket <= HIST_FLOOR else 2 ** (bucket / HIST_PER_OCTAVE)
    return low, 2 ** ((bucket + 1) / HIST_PER_OCTAVE)


def bucket_of(ms: float) -> int:
    """The bucket of a value (Python's twin of :func:`bucket_sql`)."""
    return max(HIST_FLOOR, math.floor(math.log2(ms) * HIST_PER_OCTAVE)) if ms > 0 else HIST_FLOOR


LENGTH_BUCKET_SQL: Final = ("CASE WHEN prompt_tokens > 0 THEN floor(log2(prompt_tokens))::SMALLINT "
                            "ELSE -1::SMALLINT END")
"""Prompt-length bucket: log2 of prompt tokens (10 holds 1024-2047 tokens); -1 when unknown."""

MINUTE_SQL: Final = "to_timestamp(floor(epoch(started_at) / 60) * 60)"
"""The minute a request started in (UTC, independent of the session's time zone)."""

ORIGINALS_SQL: Final = ("SELECT DISTINCT b.wal_segment, b.wal_offset, b.bytes, s.batch_index FROM trace_spans(?) s "
                        "JOIN batches b USING (batch_id) WHERE b.wal_segment IS NOT NULL ORDER BY 1, 2, 4")
"""Where a trace's stored spans came from: (log segment, end offset, bytes, index of the span in its
export request), for each request that holds one (:func:`.model.spans_at` reads them back)."""

_TABLES = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER);
CREATE TABLE IF NOT EXISTS span_rows (
    trace_id UHUGEINT, span_id UBIGINT, parent_span_id UBIGINT, name VARCHAR, stage VARCHAR,
    origin_id INTEGER, start_ns BIGINT, end_ns BIGINT, status TINYINT, batch_id BIGINT, batch_index INTEGER
);
CREATE TABLE IF NOT EXISTS origins (
    origin_id INTEGER PRIMARY KEY, service VARCHAR, instance VARCHAR, role VARCHAR, mode VARCHAR, run_id VARCHAR,
    vllm_version VARCHAR, nixl_version VARCHAR, hardware VARCHAR
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id BIGINT, collector_run_id VARCHAR, wal_segment INTEGER, wal_offset BIGINT, bytes INTEGER,
    spans INTEGER
);
CREATE TABLE IF NOT EXISTS requests (
    trace_id VARCHAR PRIMARY KEY, request_id VARCHAR, run_id VARCHAR, mode VARCHAR, started_at TIMESTAMPTZ,
    ttft_ms DOUBLE, compute_ms DOUBLE, queue_ms DOUBLE, coordination_ms DOUBLE, wire_ms DOUBLE,
    unattributed_ms DOUBLE, e2e_ms DOUBLE, tpot_ms DOUBLE, output_tokens INTEGER, prompt_tokens INTEGER,
    rendezvous_order VARCHAR, engine_loop_ms DOUBLE, transfer_bytes BIGINT, transfer_descriptors BIGINT,
    transfer_post_us BIGINT, transfer_xfer_us BIGINT, block_count INTEGER, kv_hold_ms DOUBLE,
    prefill_instance VARCHAR, decode_instance VARCHAR, complete BOOLEAN, missing VARCHAR, error BOOLEAN,
    clock_offsets MAP(VARCHAR, BIGINT), clock_bounds MAP(VARCHAR, BIGINT), clock_suspect BOOLEAN,
    stage_ids SMALLINT[], stage_start_ns BIGINT[], stage_end_ns BIGINT[], stage_critical_ns BIGINT[],
    flush_id BIGINT, updated_at TIMESTAMPTZ,
    client_ttft_ms DOUBLE, client_tpot_ms DOUBLE, client_itl_p50_ms DOUBLE, client_itl_p99_ms DOUBLE,
    client_output_tokens INTEGER, point_rate DOUBLE, point_concurrency INTEGER, point_prompt_tokens INTEGER,
    ttft_reference VARCHAR, explanation VARCHAR
);
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, recorded_at TIMESTAMPTZ, config VARCHAR
);
CREATE TABLE IF NOT EXISTS stage_keys (
    stage_key SMALLINT PRIMARY KEY, side VARCHAR, stage VARCHAR, category VARCHAR
);
CREATE TABLE IF NOT EXISTS clock_samples (
    instance VARCHAR, sent_at TIMESTAMPTZ, offset_ms DOUBLE, bound_ms DOUBLE
);
CREATE TABLE IF NOT EXISTS collector_runs (
    collector_run_id VARCHAR, started_at TIMESTAMPTZ, kvtrace_version VARCHAR, config VARCHAR
);
CREATE TABLE IF NOT EXISTS collector_health (
    collector_run_id VARCHAR, recorded_at TIMESTAMPTZ, spans_received BIGINT, requests_rejected BIGINT,
    traces_decided BIGINT, traces_incomplete BIGINT, traces_late BIGINT, traces_evicted BIGINT,
    duplicate_spans BIGINT, forwarded_spans BIGINT, forward_failures BIGINT, forward_dropped BIGINT,
    pending_traces BIGINT, queued_requests BIGINT, lag_ms DOUBLE, kafka_partitions BIGINT, kafka_lag BIGINT,
    kafka_pending_traces BIGINT, kafka_rebalances BIGINT, kafka_commits BIGINT, kafka_commit_age_s DOUBLE,
    kafka_unkeyed BIGINT, kafka_undecodable BIGINT, dropped_decisions BIGINT
);
CREATE TABLE IF NOT EXISTS store_state (
    id INTEGER PRIMARY KEY, wal_segment INTEGER, wal_offset BIGINT, flush_id BIGINT, committed_at TIMESTAMPTZ,
    compacted_until TIMESTAMPTZ
);
"""

KAFKA_HEALTH_COLUMNS: Final = ("kafka_partitions", "kafka_lag", "kafka_pending_traces", "kafka_rebalances",
                               "kafka_commits", "kafka_commit_age_s", "kafka_unkeyed", "kafka_undecodable")
"""A fleet collector's consumer (:mod:`.kafka`): partitions owned, messages behind, traces read and not yet
durable, rebalances and commits so far, seconds since its last commit, messages not keyed by trace id, and
undecodable ones."""
HEALTH_COLUMNS: Final = ("spans_received", "requests_rejected", "traces_decided", "traces_incomplete",
                         "traces_late", "traces_evicted", "duplicate_spans", "forwarded_spans",
                         "forward_failures", "forward_dropped", "pending_traces", "queued_requests", "lag_ms",
                         *KAFKA_HEALTH_COLUMNS, "dropped_decisions")
"""What the collector reports about itself in ``collector_health`` (besides run and time). Columns added by a
migration come last, where ``ALTER TABLE ... ADD COLUMN`` puts them in a migrated file."""

_SPANS = """SELECT lpad(lower(hex(s.trace_id)), 32, '0') AS trace_id, lpad(lower(hex(s.span_id)), 16, '0') AS span_id,
       coalesce(lpad(lower(hex(s.parent_span_id)), 16, '0'), '') AS parent_span_id, s.name, s.stage, o.service,
       o.instance, o.role, o.mode, o.run_id, s.start_ns, s.end_ns, (s.end_ns - s.start_ns) / 1e6 AS duration_ms,
       s.status, s.batch_id, s.batch_index
FROM span_rows s JOIN origins o USING (origin_id)"""

VIEWS: Final = f"""
CREATE OR REPLACE VIEW spans AS
{_SPANS};
CREATE OR REPLACE MACRO trace_spans(id) AS TABLE
{_SPANS} WHERE s.trace_id = TRY_CAST('0x' || id AS UHUGEINT) AND length(id) = 32;
CREATE OR REPLACE VIEW stages AS
SELECT trace_id, k.side, k.stage, k.category, start_ns, end_ns, (end_ns - start_ns) / 1e6 AS duration_ms,
       critical_ns / 1e6 AS critical_ms
FROM (SELECT trace_id, unnest(stage_ids) AS stage_key, unnest(stage_start_ns) AS start_ns,
             unnest(stage_end_ns) AS end_ns, unnest(stage_critical_ns) AS critical_ns FROM requests)
JOIN stage_keys k USING (stage_key);
"""

@dataclasses.dataclass(frozen=True)
class Rollup:
    """One rollup table: its dimensions, what it sums, keeps the least or greatest of, and the
    SELECT over ``requests`` (filtered by ``{where}``) that yields those columns in that order
    (``{s}`` is the sign: '' to add, '-' to retract)."""

    name: str
    dimensions: tuple[tuple[str, str], ...]
    sums: tuple[tuple[str, str], ...]
    select: str
    least: tuple[str, ...] = ()
    greatest: tuple[str, ...] = ()

    def ddl(self) -> str:
        columns = [*self.dimensions, *self.sums, *((c, "DOUBLE") for c in (*self.least, *self.greatest))]
        return f"CREATE TABLE IF NOT EXISTS {self.name} ({', '.join(f'{c} {t}' for c, t in columns)});"

    def append(self, where: str, sign: int) -> str:
        return f"INSERT INTO {self.name} " + self.select.format(where=where, s="" if sign == 1 else "-")

    def compaction(self) -> list[str]:
        """Merge the rows of minutes in [?, ?) into one per key (appends leave one per flush)."""
        dims = ", ".join(c for c, _ in self.dimensions)
        values = ", ".join([*(f"sum({c})" for c, _ in self.sums), *(f"min({c})" for c in self.least),
                            *(f"max({c})" for c in self.greatest)])
        return [f"CREATE TEMP TABLE merged AS SELECT {dims}, {values} FROM {self.name} "
                f"WHERE minute >= $1 AND minute < $2 GROUP BY ALL",
                f"DELETE FROM {self.name} WHERE minute >= $1 AND minute < $2",
                f"INSERT INTO {self.name} SELECT * FROM merged",
                "DROP TABLE merged"]


# The dimensions every rollup shares, as computed from a request row.
_DIMENSIONS = (("minute", "TIMESTAMPTZ"), ("run_id", "VARCHAR"), ("mode", "VARCHAR"), ("length_bucket", "SMALLINT"),
               ("prefill_instance", "VARCHAR"), ("decode_instance", "VARCHAR"), ("complete", "BOOLEAN"))
_FROM_REQUEST = (f"{MINUTE_SQL} AS minute, run_id, mode, {LENGTH_BUCKET_SQL} AS length_bucket, prefill_instance, "
                 "decode_instance, complete")

ROLLUPS: Final = (
    Rollup(
        "request_rollup",
        (*_DIMENSIONS, ("error", "BOOLEAN"), ("rendezvous_order", "VARCHAR"), ("ttft_bucket", "SMALLINT")),
        (("requests", "BIGINT"), ("ttft_ms", "DOUBLE"), *((c, "DOUBLE") for c in PART_COLUMNS), ("e2e_ms", "DOUBLE"),
         ("output_tokens", "BIGINT"), ("engine_loop_ms", "DOUBLE"), ("transfer_bytes", "BIGINT"),
         ("transfer_descriptors", "BIGINT"), ("transfer_post_us", "BIGINT"), ("transfer_xfer_us", "BIGINT"),
         ("kv_hold_ms", "DOUBLE"), ("kv_block_ms", "DOUBLE"), ("prefill_offset_ms", "DOUBLE"),
         ("decode_offset_ms", "DOUBLE"), ("clock_suspect", "BIGINT")),
        f"""SELECT {_FROM_REQUEST}, error, rendezvous_order, {bucket_sql('ttft_ms')},
                   {{s}}count(*), {{s}}sum(ttft_ms), {", ".join(f"{{s}}sum({c})" for c in PART_COLUMNS)},
                   {{s}}sum(e2e_ms), {{s}}sum(output_tokens), {{s}}sum(engine_loop_ms), {{s}}sum(transfer_bytes),
                   {{s}}sum(transfer_descriptors), {{s}}sum(transfer_post_us), {{s}}sum(transfer_xfer_us),
                   {{s}}sum(kv_hold_ms), {{s}}sum(block_count * kv_hold_ms), {{s}}sum(prefill_offset),
                   {{s}}sum(decode_offset), {{s}}count(*) FILTER (WHERE clock_suspect), min(prefill_offset),
                   min(decode_offset), max(prefill_offset), max(decode_offset)
            FROM (SELECT *, coalesce(clock_offsets[prefill_instance], 0) / 1e6 AS prefill_offset,
                            coalesce(clock_offsets[decode_instance], 0) / 1e6 AS decode_offset
                  FROM requests WHERE {{where}}) GROUP BY ALL""",
        least=("prefill_offset_min_ms", "decode_offset_min_ms"),
        greatest=("prefill_offset_max_ms", "decode_offset_max_ms")),
    Rollup(
        "tpot_rollup",
        (*_DIMENSIONS, ("tpot_bucket", "SMALLINT")),
        (("requests", "BIGINT"), ("tpot_ms", "DOUBLE"), ("output_tokens", "BIGINT"), ("engine_loop_ms", "DOUBLE")),
        f"""SELECT {_FROM_REQUEST}, {bucket_sql('tpot_ms')}, {{s}}count(*), {{s}}sum(tpot_ms),
                   {{s}}sum(output_tokens), {{s}}sum(engine_loop_ms)
            FROM requests WHERE ({{where}}) AND tpot_ms > 0 GROUP BY ALL"""),
    Rollup(
        "stage_rollup",
        (*_DIMENSIONS, ("stage_key", "SMALLINT"), ("duration_bucket", "SMALLINT")),
        (("spans", "BIGINT"), ("on_path", "BIGINT"), ("duration_ms", "DOUBLE"), ("critical_ms", "DOUBLE")),
        f"""SELECT minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, stage_key,
                   {bucket_sql('duration_ms')}, {{s}}count(*), {{s}}count(*) FILTER (WHERE critical_ms > 0),
                   {{s}}sum(duration_ms), {{s}}sum(critical_ms)
            FROM (SELECT {_FROM_REQUEST}, unnest(stage_ids) AS stage_key,
                         (unnest(stage_end_ns) - unnest(stage_start_ns)) / 1e6 AS duration_ms,
                         unnest(stage_critical_ns) / 1e6 AS critical_ms
                  FROM requests WHERE {{where}})
            GROUP BY ALL"""),
)
"""Each rollup is appended to by every commit that writes requests (partial sums, one row per key
per commit: appending costs ~40 % of an upsert into a keyed table) and compacted to one row
per key and minute once the minute is over (:meth:`Rollup.compaction`); readers always sum."""


TABLES: Final = _TABLES + "\n".join(rollup.ddl() for rollup in ROLLUPS)
"""Every table, rollups included."""


def rollup_statements(where: str, sign: int) -> list[str]:
    """SQL that adds (``sign`` 1) or retracts (-1) the requests matching ``where`` (one ``?``
    parameter) in every rollup."""
    return [rollup.append(where, sign) for rollup in ROLLUPS]


MIGRATIONS: Final[dict[int, str]] = {
    # 6 -> 7: the TTFT reference per request; every request before it was served by kvtrace's router
    6: "ALTER TABLE requests ADD COLUMN ttft_reference VARCHAR DEFAULT 'router'; "
       "UPDATE schema_version SET version = 7",
    # 7 -> 8: each request's explanation (.explain); requests decided before it have none
    7: "ALTER TABLE requests ADD COLUMN explanation VARCHAR DEFAULT ''; UPDATE schema_version SET version = 8",
    # 8 -> 9: a fleet collector's Kafka consumer in its health rows (0 for a collector without --kafka)
    8: "; ".join(f"ALTER TABLE collector_health ADD COLUMN {c} {'DOUBLE' if c.endswith('_s') else 'BIGINT'} DEFAULT 0"
                 for c in ("kafka_partitions", "kafka_lag", "kafka_pending_traces", "kafka_rebalances",
                           "kafka_commits", "kafka_commit_age_s", "kafka_unkeyed", "kafka_undecodable"))
       + "; UPDATE schema_version SET version = 9",
    # 9 -> 10: breakdowns the store could not take and dropped, in the health rows (0 before it counted them)
    9: "ALTER TABLE collector_health ADD COLUMN dropped_decisions BIGINT DEFAULT 0; UPDATE schema_version SET version = 10",
    # 10 -> 11: HIST_PER_OCTAVE 8 -> 9; the rollups are sums over the requests, so they are rebuilt from them
    10: "; ".join([*(f"DELETE FROM {rollup.name}" for rollup in ROLLUPS), *rollup_statements("true", 1),
                   "UPDATE schema_version SET version = 11"]),
    # 11 -> 12: span_rows' ids as the numbers their bytes spell, not as hex text (``spans`` above)
    11: "CREATE TABLE span_rows_12 AS SELECT TRY_CAST('0x' || trace_id AS UHUGEINT) AS trace_id, "
        "TRY_CAST('0x' || span_id AS UBIGINT) AS span_id, TRY_CAST('0x' || nullif(parent_span_id, '') AS UBIGINT) "
        "AS parent_span_id, * EXCLUDE (trace_id, span_id, parent_span_id) FROM span_rows; "
        "DROP VIEW IF EXISTS spans; DROP TABLE span_rows; ALTER TABLE span_rows_12 RENAME TO span_rows; "
        "UPDATE schema_version SET version = 12",
}
"""From a schema version to the next, in one transaction: what the collector runs on opening an older file."""


def describe() -> str:
    """The tables a user can query, for ``kvtrace query --help`` and the README."""
    return ("requests (one row per trace), runs (one per sweep run), stages (view), spans (view), "
            "trace_spans('<trace id>') (the embedded store's: one trace's spans, a lookup where filtering spans by "
            "trace_id reads every span), request_rollup, tpot_rollup, stage_rollup, stage_keys, collector_runs, collector_health, batches")
