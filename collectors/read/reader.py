"""The store's read API: every question the dashboard, ``kvtrace query``/``compare``/``whatif`` and the
demo ask, answered from a :class:`.sources.StoreSource` as Arrow tables or plain rows.

Over the rollups of :mod:`..schema` where a page would otherwise scan raw rows: counts, sums,
means and shares are exact; percentiles follow :mod:`.quantiles` (exact up to
:data:`.quantiles.EXACT_QUANTILES_UP_TO` requests where a question reads rows, the histograms'
±3.9 % estimate otherwise, and each answer says which). :meth:`StoreReader.sql` takes any one SELECT
for users' own analysis (``kvtrace query``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa

from kvtrace.telemetry import semconv

from .. import schema
from . import runs
from .filters import Filters
from .quantiles import EXACT_QUANTILES_UP_TO, grouped_histogram_quantiles, histogram_quantiles
from ..clickhouse import is_clickhouse
from .sources import AutoSource, ClickHouseSource, CollectorSource, StoreSource
from .traces import origin_ns, rank_stages, span_records, with_span_details

PART_COLUMNS = schema.PART_COLUMNS
GROUPS = ("selected", "rest")
COMPARED = {"mode": "mode", "rendezvous_order": "rendezvous_order", "length_bucket": schema.LENGTH_BUCKET_SQL,
            "error": "error", "prefill_instance": "prefill_instance", "decode_instance": "decode_instance",
            "complete": "complete"}
"""What :meth:`StoreReader.compare` splits the selected requests and the rest by (name: SQL)."""
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def is_trace_id(value: str | None) -> bool:
    """A W3C trace id as the store keeps it: 32 lower-case hex digits."""
    return bool(_TRACE_ID.fullmatch(value or ""))


def open_store(db: str | os.PathLike | None = None, *, collector: str | None = None,
               token: str | None = None) -> "StoreReader":
    """A reader of the store at ``db`` (a DuckDB file, whoever holds it, or a shared store's
    ``clickhouse://`` URL) or of the collector at ``collector``."""
    if collector:
        return StoreReader(CollectorSource(collector, token))
    if db is None:
        raise ValueError("give the store's path (--db) or a collector's URL (--collector)")
    if is_clickhouse(str(db)):
        return StoreReader(ClickHouseSource(str(db)))
    return StoreReader(AutoSource(db, token))


class StoreReader:
    """The store's read API. Thread-safe: each query has a connection (or an HTTP call) of its own."""

    def __init__(self, source: StoreSource, *, exact_quantiles_up_to: int | None = None) -> None:
        self.source = source
        self.dialect = source.dialect
        self.exact_quantiles_up_to = EXACT_QUANTILES_UP_TO if exact_quantiles_up_to is None else exact_quantiles_up_to

    # ------------------------------------------------------------------ plumbing

    def sql(self, query: str, params: Sequence = ()) -> pa.Table:
        """Any one read-only SELECT over the store's tables (:func:`.schema.describe`)."""
        return self.source.query(query, params)

    def status(self) -> dict:
        return self.source.status()

    # ------------------------------------------------------------------ sweep runs (.runs)

    def default_runs(self) -> tuple[str, str] | None:
        """The two runs the Runs page opens on: the newest push and the newest pull run, else the
        two newest; None with fewer than two runs."""
        return runs.default_pair(self.runs())

    def runs(self) -> list[dict]:
        """The recorded sweep runs, newest first."""
        return runs.list_runs(self)

    def compare_runs(self, run_a: str, run_b: str) -> dict:
        """Two runs' records and per-point statistics (:func:`.runs.compare`)."""
        return runs.compare(self, run_a, run_b)

    def whatif(self, run_id: str, against: str | None = None) -> dict:
        """The other mode's TTFT estimated from a run's traces (:func:`.runs.whatif`)."""
        return runs.whatif(self, run_id, against)

    def data_version(self) -> str:
        """Changes whenever new data was committed: key caches on it."""
        return self.source.data_version()

    def _table(self, query: str, params: Sequence = ()) -> pa.Table:
        """The reader's own queries: sums of integers (DuckDB's HUGEINT, Arrow decimals) as int64."""
        table = self.sql(query, params)
        for i, field in enumerate(table.schema):
            if pa.types.is_decimal(field.type):
                kind = pa.int64() if field.type.scale == 0 else pa.float64()
                table = table.set_column(i, field.name, table.column(i).cast(kind))
        return table

    def _rows(self, query: str, params: Sequence = ()) -> list[dict]:
        return self._table(query, params).to_pylist()

    def _bucket(self, column: str, step_s: int) -> str:
        return self.dialect.time_bucket(column, step_s)

    # ------------------------------------------------------------------ what there is

    def filter_options(self) -> dict[str, Any]:
        """Modes, runs, instances, prompt-length buckets and the time span the store holds."""
        # (a trace decided again leaves a retraction row of -1 beside its first row until the minute is
        # compacted: the count sums every row; the lists take only rows that still hold requests)
        listed = lambda column: self.dialect.distinct_list(column, "requests > 0")  # noqa: E731
        row = self._rows(f"""SELECT {listed('mode')} AS modes, {listed('run_id')} AS runs,
                                   {listed('prefill_instance')} AS prefill, {listed('decode_instance')} AS decode,
                                   {listed('length_bucket')} AS lengths, min(minute) FILTER (WHERE requests > 0) AS first,
                                   max(minute) FILTER (WHERE requests > 0) AS last, sum(requests) AS requests
                            FROM request_rollup""")[0]
        clean = lambda values: sorted(v for v in values or () if v not in (None, ""))  # noqa: E731
        return {"modes": clean(row["modes"]), "runs": clean(row["runs"]),
                "instances": clean((row["prefill"] or []) + (row["decode"] or [])),
                "length_buckets": sorted(v for v in row["lengths"] or () if v is not None),
                "first": row["first"], "last": (row["last"] + timedelta(minutes=1)) if row["last"] else None,
                "requests": int(row["requests"] or 0)}

    # ------------------------------------------------------------------ overview

    def kpis(self, f: Filters) -> dict[str, Any]:
        """Requests, incomplete and failed traces, TTFT p50/p90/p99 and coordination's share of TTFT
        (over complete traces); the percentiles exact (``quantiles_exact``) up to
        :data:`EXACT_QUANTILES_UP_TO` complete requests, from the histogram above."""
        where, params = f.where(rollup=True)
        totals = self._rows(f"""SELECT coalesce(sum(requests), 0) AS requests,
                   coalesce(sum(requests) FILTER (WHERE NOT complete), 0) AS incomplete,
                   coalesce(sum(requests) FILTER (WHERE error), 0) AS failed,
                   sum(coordination_ms) FILTER (WHERE complete) / sum(ttft_ms) FILTER (WHERE complete)
                       AS coordination_share
            FROM request_rollup WHERE {where}""", params)[0]
        exact = self._few(f, complete=totals["requests"] - totals["incomplete"])
        if exact:  # a few rows: the exact percentiles, from the rows themselves
            row_where, row_params = f.where(rollup=False)
            p50, p90, p99 = self._rows(f"""SELECT {self.dialect.quantiles('ttft_ms', (0.5, 0.9, 0.99))} AS q FROM requests
                                        WHERE {row_where} AND complete""", row_params)[0]["q"] or (None,) * 3
        else:  # many: from the rollup's histogram (within ESTIMATE_ERROR)
            hist = self._table(f"""SELECT ttft_bucket, sum(requests) AS n FROM request_rollup
                                WHERE {where} AND complete GROUP BY 1""", params)
            p50, p90, p99 = histogram_quantiles(zip(hist.column(0).to_pylist(), hist.column(1).to_pylist()),
                                                (0.5, 0.9, 0.99))
        return {**totals, "ttft_p50_ms": p50, "ttft_p90_ms": p90, "ttft_p99_ms": p99, "quantiles_exact": exact}

    def _few(self, f: Filters, complete: int | None = None) -> bool:
        """Whether the filters select at most :attr:`exact_quantiles_up_to` complete requests (``complete``:
        their count, where the caller has it already): their percentiles are then read from the rows, exactly
        (:mod:`.quantiles`)."""
        if complete is None:
            where, params = f.where(rollup=True)
            complete = self._rows(f"SELECT coalesce(sum(requests), 0) AS n FROM request_rollup "
                                  f"WHERE {where} AND complete", params)[0]["n"]
        return complete <= self.exact_quantiles_up_to

    def unattributed_shares(self, f: Filters) -> dict[str, dict[str, float]]:
        """Per mode, the exact p50 and p90 of the share of each complete request's TTFT no span covers."""
        where, params = f.where(rollup=False)
        rows = self._rows(f"""SELECT mode, {self.dialect.quantiles('unattributed_ms / ttft_ms', (0.5, 0.9))} AS q
                             FROM requests WHERE {where} AND complete AND ttft_ms > 0 GROUP BY mode""", params)
        return {r["mode"]: {"p50": r["q"][0], "p90": r["q"][1]} for r in rows}

    def parts_by_mode(self, f: Filters) -> pa.Table:
        """Per mode: complete requests, mean TTFT and the mean of each part (they add up to it)."""
        where, params = f.where(rollup=True)
        means = ", ".join(f"sum({c}) / sum(requests) AS {c}" for c in PART_COLUMNS)
        return self._table(f"""SELECT mode, sum(requests) AS requests, sum(ttft_ms) / sum(requests) AS ttft_ms, {means}
                            FROM request_rollup WHERE {where} AND complete GROUP BY mode HAVING sum(requests) > 0
                            ORDER BY mode""", params)

    def cohorts(self, f: Filters, *, median_band: tuple[float, float] = (0.45, 0.55),
                tail: float = 0.99) -> list[dict]:
        """Per mode, the mean parts of two cohorts: requests near the median TTFT (the TTFT
        buckets holding the ``median_band`` quantiles) and the slowest ones (the buckets at and
        above the ``tail`` quantile) — what the tail spends its time on, next to a typical request."""
        where, params = f.where(rollup=True)
        sums = ", ".join(f"sum({c}) AS {c}" for c in PART_COLUMNS)
        table = self._table(f"""SELECT mode, ttft_bucket, sum(requests) AS requests, sum(ttft_ms) AS ttft_ms, {sums}
                             FROM request_rollup WHERE {where} AND complete GROUP BY 1, 2 ORDER BY 1, 2""", params)
        by_mode: dict[str, list[dict]] = {}
        for row in table.to_pylist():
            by_mode.setdefault(row["mode"], []).append(row)
        out = []
        for mode, rows in sorted(by_mode.items()):
            total = sum(r["requests"] for r in rows)
            cumulative, bands = 0, {"p50": [], f"p{round(tail * 100)}": []}
            for r in rows:
                low, high = cumulative / total, (cumulative + r["requests"]) / total
                cumulative += r["requests"]
                if high >= median_band[0] and low <= median_band[1]:
                    bands["p50"].append(r)
                if high > tail:
                    bands[f"p{round(tail * 100)}"].append(r)
            for cohort, members in bands.items():
                n = sum(r["requests"] for r in members)
                if n:
                    out.append({"mode": mode, "cohort": cohort, "requests": n,
                                "ttft_ms": sum(r["ttft_ms"] for r in members) / n,
                                **{c: sum(r[c] for r in members) / n for c in PART_COLUMNS}})
        return out

    def ttft_over_time(self, f: Filters, points: int = 120) -> list[dict]:
        """Per time step (about ``points`` of them over the filtered span) and mode: requests and TTFT p50/p99,
        exact (``quantiles_exact``) up to :data:`EXACT_QUANTILES_UP_TO` complete requests as :meth:`kpis`'."""
        step = self._step_seconds(f, points)
        if self._few(f):  # each step's own requests (a step holds whole minutes: the rollup's periods)
            row_where, row_params = f.where(rollup=False)
            return [{"period": r["period"], "mode": r["mode"], "requests": r["n"], "p50_ms": r["q"][0],
                     "p99_ms": r["q"][1], "quantiles_exact": True} for r in self._rows(
                f"""SELECT {self._bucket('started_at', step)} AS period, mode, count(*) AS n,
                           {self.dialect.quantiles('ttft_ms', (0.5, 0.99))} AS q
                    FROM requests WHERE {row_where} AND complete GROUP BY 1, 2 ORDER BY 1, 2""", row_params)]
        where, params = f.where(rollup=True)
        table = self._table(f"""SELECT {self._bucket('minute', step)} AS period, mode, ttft_bucket,
                                    sum(requests) AS n
                             FROM request_rollup WHERE {where} AND complete GROUP BY 1, 2, 3""", params)
        counts: dict[tuple, float] = {}
        for period, mode, n in zip(*(table.column(c).to_pylist() for c in ("period", "mode", "n"))):
            counts[period, mode] = counts.get((period, mode), 0) + n
        quantiles = grouped_histogram_quantiles(table, ("period", "mode"), "ttft_bucket", "n", (0.5, 0.99))
        return [{"period": period, "mode": mode, "requests": counts[period, mode], "p50_ms": q[0], "p99_ms": q[1],
                 "quantiles_exact": False} for (period, mode), q in sorted(quantiles.items())]

    def _step_seconds(self, f: Filters, points: int) -> int:
        if f.since is not None and f.until is not None:
            span = (f.until - f.since).total_seconds()
        else:
            where, params = f.where(rollup=True)
            row = self._rows(f"SELECT {self.dialect.seconds_between('min(minute)', 'max(minute)')} AS span FROM request_rollup "
                             f"WHERE {where}", params)[0]
            span = row["span"] or 60
        return max(60, int(span / points) // 60 * 60)

    # ------------------------------------------------------------------ push vs pull

    def ttft_cdf(self, f: Filters) -> list[dict]:
        """Per mode, the cumulative share of requests at or below each TTFT bucket's upper edge."""
        where, params = f.where(rollup=True)
        rows = self._rows(f"""SELECT mode, ttft_bucket, sum(requests) AS n FROM request_rollup
                              WHERE {where} AND complete GROUP BY 1, 2 ORDER BY 1, 2""", params)
        totals: dict[str, float] = {}
        for r in rows:
            totals[r["mode"]] = totals.get(r["mode"], 0) + r["n"]
        out, running = [], {}
        for r in rows:
            running[r["mode"]] = running.get(r["mode"], 0) + r["n"]
            out.append({"mode": r["mode"], "ttft_ms": schema.bucket_bounds(r["ttft_bucket"])[1],
                        "share": running[r["mode"]] / totals[r["mode"]]})
        return out

    def parts_by_length(self, f: Filters) -> pa.Table:
        """Per mode and prompt-length bucket (log2 tokens): requests, mean TTFT and mean parts."""
        where, params = f.where(rollup=True)
        means = ", ".join(f"sum({c}) / sum(requests) AS {c}" for c in PART_COLUMNS)
        return self._table(f"""SELECT mode, length_bucket, sum(requests) AS requests, sum(ttft_ms) / sum(requests) AS ttft_ms,
                                   {means}
                            FROM request_rollup WHERE {where} AND complete GROUP BY 1, 2 HAVING sum(requests) > 0
                            ORDER BY 1, 2""", params)

    def transfers(self, f: Filters) -> pa.Table:
        """Per mode: MB/s of the WRITE/READ (bytes over NIXL's own transfer time), and per request
        the mean MB, descriptors, NIXL post µs and transfer µs."""
        where, params = f.where(rollup=True)
        return self._table(f"""SELECT mode, sum(requests) AS requests,
                                   sum(transfer_bytes) / nullif(sum(transfer_xfer_us), 0) AS mb_per_s,
                                   sum(transfer_bytes) / sum(requests) / 1e6 AS mb_per_request,
                                   sum(transfer_descriptors) / sum(requests) AS descriptors_per_request,
                                   sum(transfer_post_us) / sum(requests) AS post_us_per_request,
                                   sum(transfer_xfer_us) / sum(requests) AS xfer_us_per_request
                            FROM request_rollup WHERE {where} AND complete GROUP BY mode HAVING sum(requests) > 0
                            ORDER BY mode""", params)

    # ------------------------------------------------------------------ stages

    def stage_table(self, f: Filters) -> list[dict]:
        """Per mode and stage: spans, p50/p99 duration, mean critical part, how often it is on the
        critical path, and its share of the mode's TTFT (complete traces). The percentiles are exact
        (``quantiles_exact``) up to :data:`EXACT_QUANTILES_UP_TO` complete requests, from the rollup's
        histograms above, as :meth:`kpis`' (each stage of each request read: 0.13 s for 199k of a million here)."""
        where, params = f.where(rollup=True, alias="r.")
        table = self._table(f"""SELECT r.mode, k.side, k.stage, k.category, r.duration_bucket, sum(r.spans) AS n,
                                    sum(r.on_path) AS on_path, sum(r.duration_ms) AS duration_ms,
                                    sum(r.critical_ms) AS critical_ms
                             FROM stage_rollup r JOIN stage_keys k USING (stage_key)
                             WHERE {where} AND r.complete AND k.category != 'root' GROUP BY 1, 2, 3, 4, 5""", params)
        where, params = f.where(rollup=True)
        ttft = {r["mode"]: r for r in self._rows(
            f"SELECT mode, sum(ttft_ms) AS ttft_ms, sum(requests) AS requests FROM request_rollup "
            f"WHERE {where} AND complete GROUP BY mode", params)}
        exact = self._few(f, complete=sum(mode_total["requests"] or 0 for mode_total in ttft.values()))
        if exact:  # a few requests: the percentiles of their stages' own durations
            row_where, row_params = f.where(rollup=False)
            quantiles = {(r["mode"], r["side"], r["stage"], r["category"]): r["q"] for r in self._rows(
                f"""SELECT d.mode, k.side, k.stage, k.category, {self.dialect.quantiles('d.duration_ms', (0.5, 0.99))} AS q
                    FROM {self.dialect.stage_durations(f"{row_where} AND complete")} AS d
                    JOIN stage_keys AS k USING (stage_key)
                    WHERE k.category != 'root' GROUP BY 1, 2, 3, 4""", row_params)}
        else:  # many: from the rollup's histograms (within ESTIMATE_ERROR)
            quantiles = grouped_histogram_quantiles(table, ("mode", "side", "stage", "category"), "duration_bucket",
                                                    "n", (0.5, 0.99))
        sums: dict[tuple, list[float]] = {}
        for row in table.to_pylist():
            key = (row["mode"], row["side"], row["stage"], row["category"])
            acc = sums.setdefault(key, [0, 0, 0.0, 0.0])
            acc[0] += row["n"]
            acc[1] += row["on_path"]
            acc[2] += row["duration_ms"]
            acc[3] += row["critical_ms"]
        out = []
        for key, (n, on_path, duration, critical) in sums.items():
            if n <= 0:
                continue
            mode_total = ttft.get(key[0], {})
            requests = mode_total.get("requests") or 0
            p50, p99 = quantiles.get(key, (None, None))
            out.append({"mode": key[0], "side": key[1], "stage": key[2], "category": key[3], "spans": int(n),
                        "p50_ms": p50, "p99_ms": p99, "quantiles_exact": exact, "mean_ms": duration / n,
                        "critical_per_request_ms": critical / requests if requests else None,
                        "on_path": on_path / requests if requests else None,
                        "ttft_share": critical / mode_total["ttft_ms"] if mode_total.get("ttft_ms") else None})
        return sorted(out, key=lambda r: (r["mode"], semconv.stage_rank(r["stage"]), r["side"]))

    def stage_heatmap(self, f: Filters, points: int = 60) -> pa.Table:
        """Per time step and (mode, side, stage): spans and mean duration (ms)."""
        step = self._step_seconds(f, points)
        where, params = f.where(rollup=True, alias="r.")
        return self._table(f"""SELECT {self._bucket('r.minute', step)} AS period, r.mode, k.side,
                                   k.stage, sum(r.spans) AS spans, sum(r.duration_ms) / sum(r.spans) AS mean_ms
                            FROM stage_rollup r JOIN stage_keys k USING (stage_key)
                            WHERE {where} AND k.category != 'root' GROUP BY ALL HAVING sum(r.spans) > 0 ORDER BY 1""",
                           params)

    # ------------------------------------------------------------------ rendezvous

    def rendezvous(self, f: Filters, points: int = 60) -> dict[str, pa.Table]:
        """Push: the rendezvous order over time and per P×D pair, and coordination given each order."""
        step = self._step_seconds(f, points)
        where, params = f.where(rollup=True)
        push = f"{where} AND mode = 'push' AND rendezvous_order != ''"
        return {
            "over_time": self._table(f"""SELECT {self._bucket('minute', step)} AS period, rendezvous_order,
                                             sum(requests) AS requests
                                      FROM request_rollup WHERE {push} GROUP BY 1, 2 ORDER BY 1, 2""", params),
            "by_pair": self._table(f"""SELECT prefill_instance, decode_instance, rendezvous_order, sum(requests) AS requests
                                    FROM request_rollup WHERE {push} GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""", params),
            "by_order": self._table(f"""SELECT rendezvous_order, sum(requests) AS requests,
                                            sum(ttft_ms) / sum(requests) AS ttft_ms,
                                            sum(coordination_ms) / sum(requests) AS coordination_ms
                                     FROM request_rollup WHERE {push} AND complete GROUP BY 1 ORDER BY 1""", params),
        }

    def kv_hold(self, f: Filters) -> pa.Table:
        """Per mode: how long D held a request's KV blocks before its data landed (allocation to
        transfer done), per request, and the same in block·seconds — what binding decode early costs."""
        where, params = f.where(rollup=True)
        return self._table(f"""SELECT mode, sum(requests) AS requests, sum(kv_hold_ms) / sum(requests) AS hold_ms,
                                   sum(kv_block_ms) / 1e3 / sum(requests) AS block_seconds_per_request,
                                   sum(kv_block_ms) / 1e3 AS block_seconds
                            FROM request_rollup WHERE {where} AND complete GROUP BY mode HAVING sum(requests) > 0
                            ORDER BY mode""", params)

    # ------------------------------------------------------------------ decode

    def decode_smoothness(self, f: Filters) -> list[dict]:
        """Per mode: TPOT p50/p90 (router's view), the connector's engine-loop ms per request and
        per output token."""
        where, params = f.where(rollup=True)
        table = self._table(f"""SELECT mode, tpot_bucket, sum(requests) AS n, sum(tpot_ms) AS tpot_ms,
                                    sum(engine_loop_ms) AS engine_loop_ms, sum(output_tokens) AS output_tokens
                             FROM tpot_rollup WHERE {where} AND complete GROUP BY 1, 2""", params)
        exact = self._few(f)
        if exact:  # a few requests: their own TPOTs (the rollup's: those with one, over 0)
            row_where, row_params = f.where(rollup=False)
            quantiles = {(r["mode"],): r["q"] for r in self._rows(
                f"""SELECT mode, {self.dialect.quantiles('tpot_ms', (0.5, 0.9))} AS q FROM requests
                    WHERE {row_where} AND complete AND tpot_ms > 0 GROUP BY mode""", row_params)}
        else:
            quantiles = grouped_histogram_quantiles(table, ("mode",), "tpot_bucket", "n", (0.5, 0.9))
        sums: dict[str, list[float]] = {}
        for row in table.to_pylist():
            acc = sums.setdefault(row["mode"], [0, 0.0, 0.0, 0])
            acc[0] += row["n"]
            acc[1] += row["tpot_ms"]
            acc[2] += row["engine_loop_ms"]
            acc[3] += row["output_tokens"]
        rows = []
        for mode, (n, tpot, loop, tokens) in sorted(sums.items()):
            if n <= 0:
                continue
            p50, p90 = quantiles.get((mode,), (None, None))
            rows.append({"mode": mode, "requests": int(n), "tpot_p50_ms": p50, "tpot_p90_ms": p90,
                         "quantiles_exact": exact, "tpot_mean_ms": tpot / n,
                         "engine_loop_ms_per_request": loop / n,
                         "engine_loop_us_per_token": loop * 1e3 / tokens if tokens else None})
        return rows

    # ------------------------------------------------------------------ requests

    def requests_sample(self, f: Filters, *, sample: int = 1_000, top: int = 50,
                        columns: Sequence[str] = ()) -> pa.Table:
        """Requests to plot one by one: a repeatable sample of ``sample`` taken in the database, plus
        the ``top`` slowest always (the tail is what a sample would miss)."""
        where, params = f.where(rollup=False)
        cols = ", ".join(["trace_id", "started_at", "mode", "ttft_ms", *PART_COLUMNS, "tpot_ms", "engine_loop_ms",
                          "prompt_tokens", "rendezvous_order", "complete", "error", *columns])
        return self._table(f"""(SELECT {cols}, false AS top FROM requests WHERE {where}
                              {self.dialect.sample(sample, seed=7)})
                            UNION ALL
                            (SELECT {cols}, true AS top FROM requests WHERE {where} ORDER BY ttft_ms DESC
                             LIMIT {int(top)})""", [*params, *params])

    def compare(self, f: Filters, since: datetime, until: datetime, ttft_min_ms: float,
                ttft_max_ms: float) -> dict[str, Any]:
        """Requests inside a box (start time × TTFT) against the rest under the same filters: per group,
        requests, mean TTFT and mean parts (``parts``), and for each of :data:`COMPARED` each value's
        share (%) of the group's requests (``shares``: value, selected, rest)."""
        where, params = f.where(rollup=False)
        box = "(started_at >= ? AND started_at <= ? AND ttft_ms >= ? AND ttft_ms <= ?)"
        box_params = [since, until, ttft_min_ms, ttft_max_ms]
        inside = f"CASE WHEN {box} THEN 'selected' ELSE 'rest' END"
        means = ", ".join(f"avg({c}) AS {c}" for c in PART_COLUMNS)
        parts = self._rows(f"""SELECT {inside} AS "group", count(*) AS requests, avg(ttft_ms) AS ttft_ms, {means}
                              FROM requests WHERE {where} GROUP BY 1 ORDER BY 1""", [*box_params, *params])
        shares = {}
        for name, expression in COMPARED.items():
            rows = self._rows(f"""SELECT {inside} AS "group", {expression} AS value, count(*) AS requests
                                 FROM requests WHERE {where} GROUP BY 1, 2""", [*box_params, *params])
            totals = {g: sum(r["requests"] for r in rows if r["group"] == g) for g in GROUPS}
            counts = {(r["group"], r["value"]): r["requests"] for r in rows}
            shares[name] = [{"value": value, **{g: 100 * counts.get((g, value), 0) / totals[g] if totals[g] else 0.0
                                                for g in GROUPS}}
                            for value in sorted({r["value"] for r in rows}, key=str)]
        return {"parts": parts, "selected": next((r["requests"] for r in parts if r["group"] == "selected"), 0),
                "shares": shares}

    def slowest(self, f: Filters, limit: int = 20) -> pa.Table:
        where, params = f.where(rollup=False)
        return self._table(f"""SELECT trace_id, started_at, mode, ttft_ms, {", ".join(PART_COLUMNS)}, rendezvous_order,
                                   complete, error, explanation
                            FROM requests WHERE {where} ORDER BY ttft_ms DESC LIMIT {int(limit)}""", params)

    # ------------------------------------------------------------------ one trace

    def explanation(self, trace_id: str) -> str | None:
        """The trace's one sentence (:mod:`kvtrace.collectors.explain`); None for a trace not in the store,
        "" for one decided before explanations were stored."""
        if not is_trace_id(trace_id):
            return None
        rows = self._rows("SELECT explanation FROM requests WHERE trace_id = ?", [trace_id])
        return (rows[0]["explanation"] or "") if rows else None

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One request: its row (without the stage lists) and its stages on the router's clock, in ms
        from arrival, in order of start."""
        if not is_trace_id(trace_id):
            return None
        rows = self._rows("SELECT * FROM requests WHERE trace_id = ?", [trace_id])
        if not rows:
            return None
        row = rows[0]
        zero = origin_ns(row)
        keys = {r["stage_key"]: r for r in self._rows("SELECT * FROM stage_keys")}
        stages = [{"side": keys[key]["side"], "stage": keys[key]["stage"], "category": keys[key]["category"],
                   "start_ms": (start - zero) / 1e6, "end_ms": (end - zero) / 1e6,
                   "duration_ms": (end - start) / 1e6, "critical_ms": critical / 1e6}
                  for key, start, end, critical in zip(row.pop("stage_ids") or [], row.pop("stage_start_ns") or [],
                                                       row.pop("stage_end_ns") or [], row.pop("stage_critical_ns") or [])]
        row["clock_offsets"] = dict(row["clock_offsets"] or {})
        return {"request": row, "stages": sorted(stages, key=lambda s: (s["start_ms"], s["end_ms"]))}

    def trace_spans(self, trace_id: str) -> list[dict]:
        """The trace's spans as received, with every attribute (from the originals the collector
        archived), or [] if they are no longer kept (:func:`.traces.span_records`)."""
        if not is_trace_id(trace_id):
            return []
        return span_records(self.source.trace_spans(trace_id))

    def trace_view(self, trace_id: str) -> dict[str, Any] | None:
        """What the Trace page draws: :meth:`trace`, its stages with their spans' attributes
        (``hover``), the spans, and the per-rank stages of tensor-parallel sides (``ranks``)."""
        found = self.trace(trace_id)
        if found is None:
            return None
        spans = self.trace_spans(trace_id)
        return {**found, "stages": with_span_details(found["stages"], spans), "spans": spans,
                "ranks": rank_stages(spans, found["request"])}

    # ------------------------------------------------------------------ health

    def health(self, f: Filters, points: int = 60) -> dict[str, Any]:
        """Each process's measured clock offset to the collector (and its bound) over time, the offsets
        applied to put processes on their routers' clocks, traces whose span order contradicts a
        measured offset, incomplete traces and what they miss, the unattributed share over time, and
        the collector's own counters over time."""
        step = self._step_seconds(f, points)
        where, params = f.where(rollup=True)
        time_where, time_params = Filters(since=f.since, until=f.until).where(rollup=True)
        health_where = time_where.replace("minute", "recorded_at")
        raw_where, raw_params = f.where(rollup=False)
        return {
            "clocks": self._table(f"""
                WITH per_side AS (
                    SELECT minute, prefill_instance AS instance, requests, prefill_offset_ms AS offset_ms,
                           prefill_offset_min_ms AS min_ms, prefill_offset_max_ms AS max_ms
                    FROM request_rollup WHERE {where}
                    UNION ALL
                    SELECT minute, decode_instance, requests, decode_offset_ms, decode_offset_min_ms,
                           decode_offset_max_ms
                    FROM request_rollup WHERE {where})
                SELECT {self._bucket('minute', step)} AS period, instance,
                       sum(offset_ms) / sum(requests) AS offset_ms, min(min_ms) AS min_ms, max(max_ms) AS max_ms,
                       sum(requests) AS requests
                FROM per_side WHERE instance != '' GROUP BY 1, 2 HAVING sum(requests) > 0 ORDER BY 1, 2""",
                [*params, *params]),
            "measured": self._table(f"""SELECT {self._bucket('sent_at', step)} AS period, instance,
                                               avg(offset_ms) AS offset_ms, max(bound_ms) AS bound_ms,
                                               count(*) AS exchanges
                                        FROM clock_samples WHERE {time_where.replace("minute", "sent_at")}
                                        GROUP BY 1, 2 ORDER BY 1, 2""", time_params),
            "suspect": self._table(f"""SELECT sum(clock_suspect) AS suspect, sum(requests) AS requests
                                       FROM request_rollup WHERE {where}""", params),
            "unattributed": self._table(f"""SELECT {self._bucket('minute', step)} AS period, mode,
                                                sum(unattributed_ms) / sum(ttft_ms) AS share, sum(requests) AS requests
                                         FROM request_rollup WHERE {where} AND complete GROUP BY 1, 2
                                         HAVING sum(requests) > 0 ORDER BY 1, 2""", params),
            "missing": self._table(f"""SELECT mode, missing, count(*) AS requests FROM requests
                                    WHERE {raw_where} AND NOT complete GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 50""",
                                raw_params),
            "collector": self._table(f"""SELECT collector_run_id, recorded_at, {", ".join(schema.HEALTH_COLUMNS)}
                                      FROM collector_health WHERE {health_where} ORDER BY recorded_at""", time_params),
        }
