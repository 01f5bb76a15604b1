"""The store's layout in one place: its tables, views and rollups, and the columns of a breakdown.

Everything here is derived from the contract (:mod:`kvtrace.telemetry.semconv`); the store
writes these tables, :mod:`.reader` reads them, and nothing else states them again.

* ``requests`` — one row per trace: TTFT and its parts (:data:`PART_COLUMNS`, ms), the decode
  side as the router saw it (e2e, TPOT, output tokens), transfer details, instances,
  completeness, clock offsets, and each stage of the breakdown as parallel lists
  (``stage_sides``, ``stage_names``, ``stage_categories``, ``stage_start_ns``/``stage_end_ns``
  on the router's clock, ``stage_critical_ns``) — the attribution's own numbers, stored as
  it made them rather than recomputed in SQL. ``flush_id`` is the commit that wrote the row.
* ``stages`` — a view: those lists unnested, one row per (trace, stage).
* ``spans`` — a view: every span as received (``span_rows`` joined with ``origins``, one row
  per sender); ``batches`` says where each export request's original bytes are in the
  write-ahead log.
* Rollups, kept up to date in the transaction that writes the requests, so no page computes
  a percentile over raw rows: ``request_rollup`` (per minute × run × mode × prompt-length
  bucket × P/D instances × completeness × rendezvous order × TTFT bucket: counts and sums),
  ``tpot_rollup`` (… × TPOT bucket) and ``stage_rollup`` (… × stage × duration bucket). The
  buckets are log-spaced (:data:`HIST_PER_OCTAVE` per doubling), so percentiles come from
  summed bucket counts; sums (means, shares, stacked parts) are exact.
* ``clock_rollup`` — per minute and instance, the clock offsets applied.
* ``collector_runs`` (one row per collector start), ``collector_health`` (its counters over
  time), ``store_state`` (how far the write-ahead log is applied, and the data version).

A rollup row whose trace is decided again (late spans) is retracted and added anew; min/max
columns are not retracted.
"""

from __future__ import annotations

import math
from typing import Final

from kvtrace.telemetry import semconv

SCHEMA_VERSION: Final = 5
"""Bump when a table, view or rollup changes: a file with another version is refused."""

PARTS: Final = tuple(c.value for c in semconv.BREAKDOWN_CATEGORIES)
PART_COLUMNS: Final = tuple(f"{part}_ms" for part in PARTS)
"""The request columns holding each part of TTFT, in the contract's order."""

HIST_PER_OCTAVE: Final = 8
"""Histogram buckets per doubling (each ~9 % wide; a percentile is interpolated inside one)."""
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

TABLES: Final = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER);
CREATE TABLE IF NOT EXISTS span_rows (
    trace_id VARCHAR, span_id VARCHAR, parent_span_id VARCHAR, name VARCHAR, stage VARCHAR,
    origin_id INTEGER, start_ns BIGINT, end_ns BIGINT, status TINYINT, batch_id BIGINT, batch_index INTEGER
);
CREATE TABLE IF NOT EXISTS origins (
    origin_id INTEGER PRIMARY KEY, service VARCHAR, instance VARCHAR, role VARCHAR, mode VARCHAR, run_id VARCHAR
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
    clock_offsets MAP(VARCHAR, BIGINT),
    stage_sides VARCHAR[], stage_names VARCHAR[], stage_categories VARCHAR[], stage_start_ns BIGINT[],
    stage_end_ns BIGINT[], stage_critical_ns BIGINT[],
    flush_id BIGINT, updated_at TIMESTAMPTZ
);
CREATE TABLE IF NOT EXISTS request_rollup (
    minute TIMESTAMPTZ, run_id VARCHAR, mode VARCHAR, length_bucket SMALLINT, prefill_instance VARCHAR,
    decode_instance VARCHAR, complete BOOLEAN, error BOOLEAN, rendezvous_order VARCHAR, ttft_bucket SMALLINT,
    requests BIGINT, ttft_ms DOUBLE, compute_ms DOUBLE, queue_ms DOUBLE, coordination_ms DOUBLE, wire_ms DOUBLE,
    unattributed_ms DOUBLE, e2e_ms DOUBLE, output_tokens BIGINT, engine_loop_ms DOUBLE, transfer_bytes BIGINT,
    transfer_descriptors BIGINT, transfer_post_us BIGINT, transfer_xfer_us BIGINT, kv_hold_ms DOUBLE,
    kv_block_ms DOUBLE,
    PRIMARY KEY (minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, error,
                 rendezvous_order, ttft_bucket)
);
CREATE TABLE IF NOT EXISTS tpot_rollup (
    minute TIMESTAMPTZ, run_id VARCHAR, mode VARCHAR, length_bucket SMALLINT, prefill_instance VARCHAR,
    decode_instance VARCHAR, complete BOOLEAN, tpot_bucket SMALLINT,
    requests BIGINT, tpot_ms DOUBLE, output_tokens BIGINT, engine_loop_ms DOUBLE,
    PRIMARY KEY (minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, tpot_bucket)
);
CREATE TABLE IF NOT EXISTS stage_rollup (
    minute TIMESTAMPTZ, run_id VARCHAR, mode VARCHAR, length_bucket SMALLINT, prefill_instance VARCHAR,
    decode_instance VARCHAR, complete BOOLEAN, side VARCHAR, stage VARCHAR, category VARCHAR,
    duration_bucket SMALLINT,
    spans BIGINT, on_path BIGINT, duration_ms DOUBLE, critical_ms DOUBLE,
    PRIMARY KEY (minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, side, stage,
                 category, duration_bucket)
);
CREATE TABLE IF NOT EXISTS clock_rollup (
    minute TIMESTAMPTZ, instance VARCHAR, requests BIGINT, offset_sum_ms DOUBLE, offset_min_ms DOUBLE,
    offset_max_ms DOUBLE,
    PRIMARY KEY (minute, instance)
);
CREATE TABLE IF NOT EXISTS collector_runs (
    collector_run_id VARCHAR, started_at TIMESTAMPTZ, kvtrace_version VARCHAR, config VARCHAR
);
CREATE TABLE IF NOT EXISTS collector_health (
    collector_run_id VARCHAR, recorded_at TIMESTAMPTZ, spans_received BIGINT, requests_rejected BIGINT,
    traces_decided BIGINT, traces_incomplete BIGINT, traces_late BIGINT, traces_evicted BIGINT,
    duplicate_spans BIGINT, forwarded_spans BIGINT, forward_failures BIGINT, forward_dropped BIGINT,
    pending_traces BIGINT, queued_requests BIGINT, lag_ms DOUBLE
);
CREATE TABLE IF NOT EXISTS store_state (
    id INTEGER PRIMARY KEY, wal_segment INTEGER, wal_offset BIGINT, flush_id BIGINT, committed_at TIMESTAMPTZ
);
"""

HEALTH_COLUMNS: Final = ("spans_received", "requests_rejected", "traces_decided", "traces_incomplete",
                         "traces_late", "traces_evicted", "duplicate_spans", "forwarded_spans",
                         "forward_failures", "forward_dropped", "pending_traces", "queued_requests", "lag_ms")
"""What the collector reports about itself in ``collector_health`` (besides run and time)."""

VIEWS: Final = """
CREATE OR REPLACE VIEW spans AS
SELECT s.trace_id, s.span_id, s.parent_span_id, s.name, s.stage, o.service, o.instance, o.role, o.mode,
       o.run_id, s.start_ns, s.end_ns, (s.end_ns - s.start_ns) / 1e6 AS duration_ms, s.status, s.batch_id,
       s.batch_index
FROM span_rows s JOIN origins o USING (origin_id);
CREATE OR REPLACE VIEW stages AS
SELECT trace_id, side, stage, category, start_ns, end_ns, (end_ns - start_ns) / 1e6 AS duration_ms,
       critical_ns / 1e6 AS critical_ms
FROM (SELECT trace_id, unnest(stage_sides) AS side, unnest(stage_names) AS stage,
             unnest(stage_categories) AS category, unnest(stage_start_ns) AS start_ns,
             unnest(stage_end_ns) AS end_ns, unnest(stage_critical_ns) AS critical_ns FROM requests);
"""

# The dimensions every rollup shares, as computed from a request row.
_DIMENSIONS = (f"{MINUTE_SQL} AS minute, run_id, mode, {LENGTH_BUCKET_SQL} AS length_bucket, prefill_instance, "
               "decode_instance, complete")


def _upsert(table: str, select: str, summed: tuple[str, ...], extra_set: str = "") -> str:
    updates = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in summed)
    return f"INSERT INTO {table} {select} ON CONFLICT DO UPDATE SET {updates}{extra_set}"


_REQUEST_SUMS = ("requests", "ttft_ms", *PART_COLUMNS, "e2e_ms", "output_tokens", "engine_loop_ms",
                 "transfer_bytes", "transfer_descriptors", "transfer_post_us", "transfer_xfer_us", "kv_hold_ms",
                 "kv_block_ms")
_TPOT_SUMS = ("requests", "tpot_ms", "output_tokens", "engine_loop_ms")
_STAGE_SUMS = ("spans", "on_path", "duration_ms", "critical_ms")


def rollup_statements(where: str, sign: int) -> list[str]:
    """SQL that adds (``sign`` 1) or retracts (-1) the requests matching ``where`` (one ``?``
    parameter) in every rollup."""
    s = "" if sign == 1 else "-"
    request = _upsert("request_rollup", f"""
        SELECT {_DIMENSIONS}, error, rendezvous_order, {bucket_sql('ttft_ms')} AS ttft_bucket,
               {s}count(*), {s}sum(ttft_ms), {", ".join(f"{s}sum({c})" for c in PART_COLUMNS)}, {s}sum(e2e_ms),
               {s}sum(output_tokens), {s}sum(engine_loop_ms), {s}sum(transfer_bytes), {s}sum(transfer_descriptors),
               {s}sum(transfer_post_us), {s}sum(transfer_xfer_us), {s}sum(kv_hold_ms),
               {s}sum(block_count * kv_hold_ms)
        FROM requests WHERE {where} GROUP BY ALL""", _REQUEST_SUMS)
    tpot = _upsert("tpot_rollup", f"""
        SELECT {_DIMENSIONS}, {bucket_sql('tpot_ms')} AS tpot_bucket, {s}count(*), {s}sum(tpot_ms),
               {s}sum(output_tokens), {s}sum(engine_loop_ms)
        FROM requests WHERE ({where}) AND tpot_ms > 0 GROUP BY ALL""", _TPOT_SUMS)
    stage = _upsert("stage_rollup", f"""
        SELECT minute, run_id, mode, length_bucket, prefill_instance, decode_instance, complete, side, stage,
               category, {bucket_sql('duration_ms')} AS duration_bucket, {s}count(*),
               {s}count(*) FILTER (WHERE critical_ms > 0), {s}sum(duration_ms), {s}sum(critical_ms)
        FROM (SELECT {_DIMENSIONS}, unnest(stage_sides) AS side, unnest(stage_names) AS stage,
                     unnest(stage_categories) AS category,
                     (unnest(stage_end_ns) - unnest(stage_start_ns)) / 1e6 AS duration_ms,
                     unnest(stage_critical_ns) / 1e6 AS critical_ms
              FROM requests WHERE {where})
        WHERE category != '{semconv.Category.ROOT.value}' GROUP BY ALL""", _STAGE_SUMS)
    clock = _upsert("clock_rollup", f"""
        SELECT minute, instance, {s}count(*), {s}sum(offset_ms), min(offset_ms), max(offset_ms)
        FROM (SELECT {MINUTE_SQL} AS minute, unnest(map_keys(clock_offsets)) AS instance,
                     unnest(map_values(clock_offsets)) / 1e6 AS offset_ms
              FROM requests WHERE {where})
        GROUP BY ALL""", ("requests", "offset_sum_ms"),
        extra_set=", offset_min_ms = least(clock_rollup.offset_min_ms, excluded.offset_min_ms), "
                  "offset_max_ms = greatest(clock_rollup.offset_max_ms, excluded.offset_max_ms)")
    return [request, tpot, stage, clock]


def describe() -> str:
    """The tables a user can query, for ``kvtrace query --help`` and the README."""
    return ("requests (one row per trace), stages (view), spans (view), request_rollup, tpot_rollup, "
            "stage_rollup, clock_rollup, collector_runs, collector_health, batches")
