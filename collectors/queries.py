"""Queries the dashboard (and anyone with the DuckDB file) asks of the store.

Each takes a DuckDB connection (the collector's, or ``duckdb.connect(path, read_only=True)``
when the collector is stopped) and returns a ``pyarrow.Table``.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

CATEGORY_COLUMNS = ("compute_ms", "queue_ms", "coordination_ms", "wire_ms", "unattributed_ms")

# Prompt-length buckets (tokens): short chat turns, typical prompts, long documents, very long.
LENGTH_BUCKET_SQL = """CASE WHEN prompt_tokens < 512 THEN '<512'
    WHEN prompt_tokens < 2048 THEN '512-2k' WHEN prompt_tokens < 8192 THEN '2k-8k' ELSE '8k+' END"""

_GROUPS = {
    "mode": "mode",
    "length": LENGTH_BUCKET_SQL,
    "window": "time_bucket(INTERVAL '{window}', started_at)",
}


def percentiles(con: Any, by: str = "mode", *, window: str = "1 minute", mode: str | None = None,
                complete_only: bool = True) -> pa.Table:
    """TTFT p50/p90/p99 and each category's median, per mode, prompt-length bucket or time window."""
    if by not in _GROUPS:
        raise ValueError(f"by must be one of {sorted(_GROUPS)}, got {by!r}")
    if by == "window" and not _is_interval(window):
        raise ValueError(f"window {window!r} is not like '30 seconds' or '5 minutes'")
    group = _GROUPS[by].format(window=window)
    where, params = _filters(mode, complete_only)
    medians = ", ".join(f"median({c}) AS {c.removesuffix('_ms')}_p50_ms" for c in CATEGORY_COLUMNS)
    sql = f"""
        SELECT {group} AS "group", count(*) AS requests,
               quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.9) AS ttft_p90_ms,
               quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms, {medians}
        FROM requests {where} GROUP BY 1 ORDER BY 1"""
    return con.sql(sql, params=params).to_arrow_table()


def stage_summary(con: Any, mode: str | None = None) -> pa.Table:
    """Per (side, stage): how long it takes and how much of it is on the critical path (medians)."""
    where, params = _filters(mode, complete_only=False, alias="r.")
    where = f"{where} AND s.category != 'root'" if where else "WHERE s.category != 'root'"
    sql = f"""
        SELECT s.side, s.stage, any_value(s.category) AS category, count(*) AS spans,
               median(s.duration_ms) AS duration_p50_ms, quantile_cont(s.duration_ms, 0.9) AS duration_p90_ms,
               median(s.critical_ms) AS critical_p50_ms
        FROM stages s JOIN requests r USING (trace_id) {where}
        GROUP BY 1, 2 ORDER BY min(s.start_ns - epoch_ns(r.started_at))"""
    return con.sql(sql, params=params).to_arrow_table()


def waterfall(con: Any, trace_id: str) -> pa.Table:
    """One request's stages on the router's clock, in ms from its arrival."""
    sql = """
        SELECT s.side, s.stage, s.category, (s.start_ns - epoch_ns(r.started_at)) / 1e6 AS start_ms,
               (s.end_ns - epoch_ns(r.started_at)) / 1e6 AS end_ms, s.duration_ms, s.critical_ms
        FROM stages s JOIN requests r USING (trace_id) WHERE s.trace_id = ? ORDER BY s.start_ns"""
    return con.sql(sql, params=[trace_id]).to_arrow_table()


def recent_requests(con: Any, limit: int = 100, mode: str | None = None) -> pa.Table:
    where, params = _filters(mode, complete_only=False)
    sql = f"""SELECT trace_id, request_id, mode, started_at, ttft_ms, {", ".join(CATEGORY_COLUMNS)},
                     rendezvous_order, prompt_tokens, complete, error
              FROM requests {where} ORDER BY started_at DESC LIMIT ?"""
    return con.sql(sql, params=[*params, limit]).to_arrow_table()


def _filters(mode: str | None, complete_only: bool, alias: str = "") -> tuple[str, list]:
    clauses, params = [], []
    if mode is not None:
        clauses.append(f"{alias}mode = ?")
        params.append(mode)
    if complete_only:
        clauses.append(f"{alias}complete")
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", params


def _is_interval(text: str) -> bool:
    number, _, unit = text.strip().partition(" ")
    return number.isdigit() and unit.rstrip("s") in ("second", "minute", "hour", "day")
