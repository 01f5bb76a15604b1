"""Reading a kvtrace store, whether or not a collector is writing it: the dashboard's only way in.

``open_store("kvtrace.duckdb")`` returns a :class:`StoreReader`. Where the file is not held by
a collector it is read directly (read-only, one short-lived connection per query, so a
collector can start on it at any time); where a collector holds it, reads go to that
collector's query endpoint (found through ``<db>.kvtrace-collector.json``, see
:mod:`.query_service`), and the reader switches between the two as the collector starts and
stops. ``open_store(collector="http://host:port")`` reads a collector on another host.

Each query returns a ``pyarrow.Table``. The dashboard's questions are methods here, over the
rollups of :mod:`.schema` where a page would otherwise compute percentiles over raw rows:
percentiles come from log-bucketed histograms (``schema.HIST_PER_OCTAVE`` buckets per doubling,
interpolated inside a bucket), counts, sums, means and shares are exact. :meth:`StoreReader.sql`
takes any one SELECT for users' own analysis (``kvtrace query``).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvtrace.telemetry import semconv

from . import runs, schema
from .breakdown import STAGE_CATEGORY
from .model import rebuild_request, spans_at
from .query_service import QueryRefused, endpoint_file, run_query
from .wal import read_record

PARTS = schema.PARTS
PART_COLUMNS = schema.PART_COLUMNS
point_label = runs.point_label


class StoreUnavailable(RuntimeError):
    """The store cannot be read: no such file, another schema, or a collector that cannot be reached."""


# --------------------------------------------------------------------------------------
# Where the data comes from
# --------------------------------------------------------------------------------------


class StoreHeld(Exception):
    """A collector holds the store file: read through its query endpoint instead."""


class FileSource:
    """A store file no collector holds, read-only. One connection serves every query (a cursor
    each) and is closed after :attr:`IDLE_S` without one, so a collector can open the file for
    writing soon after a reader stops asking (a collector waits for that, see ``Store``)."""

    kind = "file"
    IDLE_S = 2.0

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._users = 0
        self._last_used = 0.0
        self._closer: threading.Timer | None = None

    def query(self, sql: str, params: Sequence = ()) -> pa.Table:
        with self._cursor() as con:
            return run_query(con, sql, list(params))

    def data_version(self) -> str:
        """Changes whenever the file (or DuckDB's log beside it) changes; raises :class:`StoreHeld`
        while a collector advertises that it writes the file."""
        if _live_advert(self.path) is not None:
            raise StoreHeld(str(self.path))
        if not self.path.exists():
            raise StoreUnavailable(f"{self.path}: no such store (start a collector with --db {self.path})")
        parts = []
        for path in (self.path, Path(f"{self.path}.wal")):
            with contextlib.suppress(OSError):
                stat = path.stat()
                parts.append(f"{stat.st_mtime_ns}:{stat.st_size}")
        return "file:" + "/".join(parts)

    def status(self) -> dict:
        with self._cursor():  # proves the file is readable, and of this schema
            pass
        return {"source": "file", "path": str(self.path), "schema_version": schema.SCHEMA_VERSION,
                "data_version": self.data_version()}

    @contextlib.contextmanager
    def _cursor(self):
        with self._lock:
            if self._con is None:
                if _live_advert(self.path) is not None:
                    raise StoreHeld(str(self.path))
                self._con = self._open()
            self._users += 1
            con = self._con
        try:
            cursor = con.cursor()
            try:
                yield cursor
            finally:
                cursor.close()
        finally:
            with self._lock:
                self._users -= 1
                self._last_used = time.monotonic()
                if self._closer is None:
                    self._closer = threading.Timer(self.IDLE_S, self._close_if_idle)
                    self._closer.daemon = True
                    self._closer.start()

    def _close_if_idle(self) -> None:
        with self._lock:
            self._closer = None
            idle = time.monotonic() - self._last_used
            if self._users == 0 and idle >= self.IDLE_S * 0.9 and self._con is not None:
                self._con.close()
                self._con = None
            elif self._con is not None:
                self._closer = threading.Timer(max(0.1, self.IDLE_S - idle), self._close_if_idle)
                self._closer.daemon = True
                self._closer.start()

    def _open(self) -> duckdb.DuckDBPyConnection:
        if not self.path.exists():
            raise StoreUnavailable(f"{self.path}: no such store (start a collector with --db {self.path})")
        try:
            con = duckdb.connect(str(self.path), read_only=True, config={"enable_external_access": False})
        except (duckdb.IOException, duckdb.ConnectionException) as exc:
            # Another process holds the file ("Conflicting lock"), or this one does (a collector
            # embedded here: "same database file with a different configuration").
            if "lock" in str(exc).lower() or "same database file" in str(exc):
                raise StoreHeld(str(exc)) from None
            raise StoreUnavailable(f"{self.path}: {exc}") from None
        try:
            found = con.execute("SELECT max(version) FROM schema_version").fetchall()[0][0]
        except duckdb.CatalogException:
            found = None
        if found != schema.SCHEMA_VERSION:
            con.close()
            raise StoreUnavailable(
                f"{self.path}: written by a kvtrace with store schema {found or 'unknown'}; this kvtrace reads "
                f"schema {schema.SCHEMA_VERSION}. Read it with the kvtrace that wrote it, or collect into a new file.")
        return con

    def trace_originals(self, trace_id: str) -> bytes | None:
        """The trace's spans as received, from the write-ahead log beside the file (if kept)."""
        rows = self.query(schema.ORIGINALS_SQL, [trace_id]).to_pylist()
        wal_dir = self._wal_dir()
        if not rows or wal_dir is None:
            return None
        located = spans_at([tuple(row.values()) for row in rows],
                           lambda segment, offset, length: read_record(wal_dir, segment, offset, length))
        spans = {span.span_id: span for span in located}  # a span sent twice, once
        return rebuild_request(list(spans.values())) if spans else None

    def _wal_dir(self) -> Path | None:
        """The collector's write-ahead log folder: the last collector's --wal-dir, else the default."""
        with contextlib.suppress(duckdb.Error, ValueError, IndexError):
            config = self.query("SELECT config FROM collector_runs ORDER BY started_at DESC LIMIT 1").to_pylist()
            wal_dir = json.loads(config[0]["config"]).get("wal_dir") if config else None
            if wal_dir:
                return Path(wal_dir) if Path(wal_dir).is_dir() else None
        default = Path(f"{self.path}.kvtrace-wal")
        return default if default.is_dir() else None

class CollectorSource:
    """A running collector's query endpoint (:mod:`.query_service`)."""

    kind = "collector"

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._timeout = timeout_s

    def query(self, sql: str, params: Sequence = ()) -> pa.Table:
        body = json.dumps({"sql": sql, "params": list(params)}, default=_json_default).encode()
        payload = self._call("POST", "/v1/query", body)
        with pa.ipc.open_stream(payload) as stream:
            return stream.read_all()

    def status(self) -> dict:
        status = json.loads(self._call("GET", "/v1/status"))
        if status.get("schema_version") != schema.SCHEMA_VERSION:
            raise StoreUnavailable(f"the collector at {self.url} uses store schema {status.get('schema_version')}; "
                                   f"this kvtrace reads schema {schema.SCHEMA_VERSION}")
        return {"source": "collector", "url": self.url, **status}

    def data_version(self) -> str:
        return f"collector:{self.status()['data_version']}"

    def trace_originals(self, trace_id: str) -> bytes | None:
        try:
            return self._call("GET", f"/v1/traces/{trace_id}")
        except QueryRefused:
            return None

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code in (400, 404, 413):
                raise QueryRefused(message) from None
            if exc.code == 401:
                raise StoreUnavailable(f"{self.url}: {message} (pass the collector's --token)") from None
            raise StoreUnavailable(f"{self.url}: HTTP {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise StoreUnavailable(f"the collector at {self.url} cannot be reached: {exc}") from None


class AutoSource:
    """A store file, read directly when no collector holds it and through the collector that
    does otherwise; it looks again on every query, so it follows a collector starting or stopping."""

    def __init__(self, path: str | os.PathLike, token: str | None = None) -> None:
        self.file = FileSource(path)
        self._token = token
        self._lock = threading.Lock()
        self._collector: CollectorSource | None = None

    @property
    def kind(self) -> str:
        return "collector" if self._collector is not None else "file"

    def query(self, sql: str, params: Sequence = ()) -> pa.Table:
        return self._call(lambda source: source.query(sql, params))

    def status(self) -> dict:
        return self._call(lambda source: source.status())

    def data_version(self) -> str:
        return self._call(lambda source: source.data_version())

    def trace_originals(self, trace_id: str) -> bytes | None:
        return self._call(lambda source: source.trace_originals(trace_id))

    def _call(self, fn):
        collector = self._collector
        if collector is not None:
            try:
                return fn(collector)
            except StoreUnavailable:  # the collector stopped: its file may be readable now
                self._collector = None
        try:
            return fn(self.file)
        except StoreHeld as held:
            self._collector = self._advertised(held)
            return fn(self._collector)

    def _advertised(self, held: Exception) -> CollectorSource:
        advert = _live_advert(self.file.path)
        if advert is None:
            raise StoreUnavailable(
                f"{self.file.path} is held by another process and no collector advertises a query endpoint for it "
                f"({endpoint_file(self.file.path)} is missing): {held}") from None
        return CollectorSource(advert["url"], self._token)


def _live_advert(path: Path) -> dict | None:
    """The query endpoint a running collector advertises beside the store, if its process is alive."""
    try:
        advert = json.loads(endpoint_file(path).read_text())
        pid, _ = int(advert["pid"]), advert["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # left behind by a collector that was killed
    except PermissionError:
        pass
    return advert


def open_store(db: str | os.PathLike | None = None, *, collector: str | None = None,
               token: str | None = None) -> "StoreReader":
    """A reader of the store at ``db`` (whoever holds it) or of the collector at ``collector``."""
    if collector:
        return StoreReader(CollectorSource(collector, token))
    if db is None:
        raise ValueError("give the store's path (--db) or a collector's URL (--collector)")
    return StoreReader(AutoSource(db, token))


# --------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Filters:
    """What every page can narrow to. Times are floored to the minute (the rollups' grain), so a
    rollup and a raw-row query of the same filters count the same requests."""

    since: datetime | None = None
    until: datetime | None = None
    modes: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    instances: tuple[str, ...] = ()  # a request matches when its P or its D is one of them
    min_length_bucket: int | None = None  # log2 of prompt tokens (schema.LENGTH_BUCKET_SQL)
    max_length_bucket: int | None = None

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None:
                if value.tzinfo is None:
                    value = value.replace(tzinfo=timezone.utc)
                object.__setattr__(self, name, value.replace(second=0, microsecond=0))

    def where(self, *, rollup: bool, alias: str = "") -> tuple[str, list]:
        """A WHERE clause (with its parameters) for a rollup table or for ``requests``."""
        a = alias
        clauses, params = [], []
        time_column = f"{a}minute" if rollup else f"{a}started_at"
        if self.since is not None:
            clauses.append(f"{time_column} >= ?")
            params.append(self.since)
        if self.until is not None:
            clauses.append(f"{time_column} < ?")
            params.append(self.until)
        for column, values in ((f"{a}mode", self.modes), (f"{a}run_id", self.runs)):
            if values:
                clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
                params += list(values)
        if self.instances:
            marks = ", ".join("?" * len(self.instances))
            clauses.append(f"({a}prefill_instance IN ({marks}) OR {a}decode_instance IN ({marks}))")
            params += list(self.instances) * 2
        length = f"{a}length_bucket" if rollup else f"({schema.LENGTH_BUCKET_SQL.replace('prompt_tokens', a + 'prompt_tokens')})"
        if self.min_length_bucket is not None:
            clauses.append(f"{length} >= ?")
            params.append(self.min_length_bucket)
        if self.max_length_bucket is not None:
            clauses.append(f"{length} <= ?")
            params.append(self.max_length_bucket)
        return " AND ".join(clauses) or "TRUE", params


def length_label(bucket: int) -> str:
    """A prompt-length bucket as people say it (``1k-2k``)."""
    if bucket < 0:
        return "unknown"
    return f"{_tokens(2 ** bucket)}-{_tokens(2 ** (bucket + 1))}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


# --------------------------------------------------------------------------------------
# Histograms
# --------------------------------------------------------------------------------------


def histogram_quantiles(buckets: Iterable[tuple[int, float]], quantiles: Sequence[float]) -> list[float | None]:
    """Quantiles of a log-bucketed histogram ((bucket, count) pairs), interpolated log-linearly
    inside the bucket that holds each (linearly in the lowest, which starts at 0)."""
    pairs = sorted((b, n) for b, n in buckets if n > 0)
    total = sum(n for _, n in pairs)
    if total <= 0:
        return [None] * len(quantiles)
    cumulative, running = [], 0.0
    for _, n in pairs:
        running += n
        cumulative.append(running)
    out: list[float | None] = []
    for q in quantiles:
        rank = q * total
        i = min(bisect.bisect_left(cumulative, rank), len(pairs) - 1)
        bucket, n = pairs[i]
        before = cumulative[i] - n
        fraction = min(1.0, max(0.0, (rank - before) / n))
        low, high = schema.bucket_bounds(bucket)
        out.append(low + (high - low) * fraction if low <= 0 else low * (high / low) ** fraction)
    return out


def _grouped_quantiles(table: pa.Table, keys: Sequence[str], bucket: str, count: str,
                       quantiles: Sequence[float]) -> dict[tuple, list[float | None]]:
    groups: dict[tuple, list[tuple[int, float]]] = {}
    columns = [table.column(k).to_pylist() for k in keys]
    for i, (b, n) in enumerate(zip(table.column(bucket).to_pylist(), table.column(count).to_pylist())):
        groups.setdefault(tuple(c[i] for c in columns), []).append((b, n))
    return {key: histogram_quantiles(pairs, quantiles) for key, pairs in groups.items()}


# --------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------


EXACT_QUANTILES_UP_TO = 200_000
"""Up to this many requests under the filters, the KPI percentiles are exact (``quantile_cont`` over the
rows: 5.5 ms for 200k rows in memory here, median of 7); above it they come from the rollup's histogram (±4 %)."""


class StoreReader:
    """The store's read API. Thread-safe: each query has a connection (or an HTTP call) of its own."""

    def __init__(self, source: Any, *, exact_quantiles_up_to: int | None = None) -> None:
        self.source = source
        self.exact_quantiles_up_to = EXACT_QUANTILES_UP_TO if exact_quantiles_up_to is None else exact_quantiles_up_to

    # ------------------------------------------------------------------ plumbing

    def sql(self, query: str, params: Sequence = ()) -> pa.Table:
        """Any one read-only SELECT over the store's tables (:func:`.schema.describe`)."""
        return self.source.query(query, params)

    def status(self) -> dict:
        return self.source.status()

    # ------------------------------------------------------------------ sweep runs (.runs)

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

    # ------------------------------------------------------------------ what there is

    def filter_options(self) -> dict[str, Any]:
        """Modes, runs, instances, prompt-length buckets and the time span the store holds."""
        # (a trace decided again leaves a retraction row of -1 beside its first row until the minute is
        # compacted: the count sums every row; the lists take only rows that still hold requests)
        held = "FILTER (WHERE requests > 0)"
        row = self._rows(f"""SELECT list(DISTINCT mode) {held} AS modes, list(DISTINCT run_id) {held} AS runs,
                                   list(DISTINCT prefill_instance) {held} AS prefill,
                                   list(DISTINCT decode_instance) {held} AS decode,
                                   list(DISTINCT length_bucket) {held} AS lengths, min(minute) {held} AS first,
                                   max(minute) {held} AS last, sum(requests) AS requests
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
        complete = totals["requests"] - totals["incomplete"]
        exact = complete <= self.exact_quantiles_up_to
        if exact:  # a few rows: the exact percentiles, from the rows themselves
            row_where, row_params = f.where(rollup=False)
            p50, p90, p99 = self._rows(f"""SELECT quantile_cont(ttft_ms, [0.5, 0.9, 0.99]) AS q FROM requests
                                        WHERE {row_where} AND complete""", row_params)[0]["q"] or (None,) * 3
        else:  # many: from the rollup's histogram, within its buckets' ±4 %
            hist = self._table(f"""SELECT ttft_bucket, sum(requests) AS n FROM request_rollup
                                WHERE {where} AND complete GROUP BY 1""", params)
            p50, p90, p99 = histogram_quantiles(zip(hist.column(0).to_pylist(), hist.column(1).to_pylist()),
                                                (0.5, 0.9, 0.99))
        return {**totals, "ttft_p50_ms": p50, "ttft_p90_ms": p90, "ttft_p99_ms": p99, "quantiles_exact": exact}

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
        """Per time step (about ``points`` of them over the filtered span) and mode: requests and TTFT p50/p99."""
        step = self._step_seconds(f, points)
        where, params = f.where(rollup=True)
        table = self._table(f"""SELECT to_timestamp(floor(epoch(minute) / {step}) * {step}) AS period, mode, ttft_bucket,
                                    sum(requests) AS n
                             FROM request_rollup WHERE {where} AND complete GROUP BY 1, 2, 3""", params)
        counts: dict[tuple, float] = {}
        for period, mode, n in zip(*(table.column(c).to_pylist() for c in ("period", "mode", "n"))):
            counts[period, mode] = counts.get((period, mode), 0) + n
        quantiles = _grouped_quantiles(table, ("period", "mode"), "ttft_bucket", "n", (0.5, 0.99))
        return [{"period": period, "mode": mode, "requests": counts[period, mode], "p50_ms": q[0], "p99_ms": q[1]}
                for (period, mode), q in sorted(quantiles.items())]

    def _step_seconds(self, f: Filters, points: int) -> int:
        if f.since is not None and f.until is not None:
            span = (f.until - f.since).total_seconds()
        else:
            where, params = f.where(rollup=True)
            row = self._rows(f"SELECT epoch(max(minute)) - epoch(min(minute)) AS span FROM request_rollup "
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
        critical path, and its share of the mode's TTFT (complete traces)."""
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
        quantiles = _grouped_quantiles(table, ("mode", "side", "stage", "category"), "duration_bucket", "n",
                                       (0.5, 0.99))
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
            out.append({"mode": key[0], "side": key[1], "stage": key[2], "category": key[3], "spans": int(n),
                        "p50_ms": quantiles[key][0], "p99_ms": quantiles[key][1], "mean_ms": duration / n,
                        "critical_per_request_ms": critical / requests if requests else None,
                        "on_path": on_path / requests if requests else None,
                        "ttft_share": critical / mode_total["ttft_ms"] if mode_total.get("ttft_ms") else None})
        return sorted(out, key=lambda r: (r["mode"], semconv.stage_rank(r["stage"]), r["side"]))

    def stage_heatmap(self, f: Filters, points: int = 60) -> pa.Table:
        """Per time step and (mode, side, stage): spans and mean duration (ms)."""
        step = self._step_seconds(f, points)
        where, params = f.where(rollup=True, alias="r.")
        return self._table(f"""SELECT to_timestamp(floor(epoch(r.minute) / {step}) * {step}) AS period, r.mode, k.side,
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
            "over_time": self._table(f"""SELECT to_timestamp(floor(epoch(minute) / {step}) * {step}) AS period, rendezvous_order,
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
        quantiles = _grouped_quantiles(table, ("mode",), "tpot_bucket", "n", (0.5, 0.9))
        sums: dict[str, list[float]] = {}
        for row in table.to_pylist():
            acc = sums.setdefault(row["mode"], [0, 0.0, 0.0, 0])
            acc[0] += row["n"]
            acc[1] += row["tpot_ms"]
            acc[2] += row["engine_loop_ms"]
            acc[3] += row["output_tokens"]
        return [{"mode": mode, "requests": int(n), "tpot_p50_ms": quantiles[(mode,)][0],
                 "tpot_p90_ms": quantiles[(mode,)][1], "tpot_mean_ms": tpot / n if n else None,
                 "engine_loop_ms_per_request": loop / n if n else None,
                 "engine_loop_us_per_token": loop * 1e3 / tokens if tokens else None}
                for mode, (n, tpot, loop, tokens) in sorted(sums.items()) if n > 0]

    # ------------------------------------------------------------------ requests

    def requests_sample(self, f: Filters, *, sample: int = 2_000, top: int = 50,
                        columns: Sequence[str] = ()) -> pa.Table:
        """Requests to plot one by one: a repeatable sample of ``sample`` taken in the database, plus
        the ``top`` slowest always (the tail is what a sample would miss)."""
        where, params = f.where(rollup=False)
        cols = ", ".join(["trace_id", "started_at", "mode", "ttft_ms", *PART_COLUMNS, "tpot_ms", "engine_loop_ms",
                          "prompt_tokens", "rendezvous_order", "complete", "error", *columns])
        return self._table(f"""(SELECT {cols}, false AS top FROM requests WHERE {where}
                              USING SAMPLE reservoir({int(sample)} ROWS) REPEATABLE (7))
                            UNION ALL
                            (SELECT {cols}, true AS top FROM requests WHERE {where} ORDER BY ttft_ms DESC
                             LIMIT {int(top)})""", [*params, *params])

    def compare(self, f: Filters, since: datetime, until: datetime, ttft_min_ms: float,
                ttft_max_ms: float) -> dict[str, Any]:
        """Requests inside a box (start time × TTFT) against the rest under the same filters: counts
        by mode, rendezvous order, instances, prompt-length bucket and error, and mean parts."""
        where, params = f.where(rollup=False)
        box = "(started_at >= ? AND started_at <= ? AND ttft_ms >= ? AND ttft_ms <= ?)"
        box_params = [since, until, ttft_min_ms, ttft_max_ms]
        inside = f"CASE WHEN {box} THEN 'selected' ELSE 'rest' END"
        means = ", ".join(f"avg({c}) AS {c}" for c in PART_COLUMNS)
        out: dict[str, Any] = {"parts": self._table(
            f"""SELECT {inside} AS "group", count(*) AS requests, avg(ttft_ms) AS ttft_ms, {means}
                FROM requests WHERE {where} GROUP BY 1 ORDER BY 1""", [*box_params, *params])}
        for name, expression in (("mode", "mode"), ("rendezvous_order", "rendezvous_order"),
                                 ("prefill_instance", "prefill_instance"), ("decode_instance", "decode_instance"),
                                 ("length_bucket", schema.LENGTH_BUCKET_SQL), ("error", "error"),
                                 ("complete", "complete")):
            out[name] = self._table(f"""SELECT {inside} AS "group", {expression} AS value, count(*) AS requests
                                     FROM requests WHERE {where} GROUP BY 1, 2 ORDER BY 1, 2""", [*box_params, *params])
        return out

    def slowest(self, f: Filters, limit: int = 20) -> pa.Table:
        where, params = f.where(rollup=False)
        return self._table(f"""SELECT trace_id, started_at, mode, ttft_ms, {", ".join(PART_COLUMNS)}, rendezvous_order,
                                   complete, error
                            FROM requests WHERE {where} ORDER BY ttft_ms DESC LIMIT {int(limit)}""", params)

    # ------------------------------------------------------------------ one trace

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One request: its row (without the stage lists) and its stages on the router's clock, in ms
        from arrival, in order of start."""
        if not re.fullmatch(r"[0-9a-f]{32}", trace_id or ""):
            return None
        rows = self._rows("SELECT * FROM requests WHERE trace_id = ?", [trace_id])
        if not rows:
            return None
        row = rows[0]
        origin_ns = _origin_ns(row)
        keys = {r["stage_key"]: r for r in self._rows("SELECT * FROM stage_keys")}
        stages = [{"side": keys[key]["side"], "stage": keys[key]["stage"], "category": keys[key]["category"],
                   "start_ms": (start - origin_ns) / 1e6, "end_ms": (end - origin_ns) / 1e6,
                   "duration_ms": (end - start) / 1e6, "critical_ms": critical / 1e6}
                  for key, start, end, critical in zip(row.pop("stage_ids") or [], row.pop("stage_start_ns") or [],
                                                       row.pop("stage_end_ns") or [], row.pop("stage_critical_ns") or [])]
        row["clock_offsets"] = dict(row["clock_offsets"] or {})
        return {"request": row, "stages": sorted(stages, key=lambda s: (s["start_ms"], s["end_ms"]))}

    def trace_spans(self, trace_id: str) -> list[dict]:
        """The trace's spans as received, with every attribute (from the originals the collector
        archived), or [] if they are no longer kept."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        payload = self.source.trace_originals(trace_id) if re.fullmatch(r"[0-9a-f]{32}", trace_id or "") else None
        if not payload:
            return []
        spans = []
        for rs in ExportTraceServiceRequest.FromString(payload).resource_spans:
            resource = {a.key: _any(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans.append({"name": span.name, "span_id": span.span_id.hex(),
                                  "parent_span_id": span.parent_span_id.hex(), "start_ns": span.start_time_unix_nano,
                                  "end_ns": span.end_time_unix_nano, "status": span.status.code,
                                  "attributes": {a.key: _any(a.value) for a in span.attributes},
                                  "events": [e.name for e in span.events], "resource": resource})
        return sorted(spans, key=lambda s: s["start_ns"])

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
                SELECT to_timestamp(floor(epoch(minute) / {step}) * {step}) AS period, instance,
                       sum(offset_ms) / sum(requests) AS offset_ms, min(min_ms) AS min_ms, max(max_ms) AS max_ms,
                       sum(requests) AS requests
                FROM per_side WHERE instance != '' GROUP BY 1, 2 HAVING sum(requests) > 0 ORDER BY 1, 2""",
                [*params, *params]),
            "measured": self._table(f"""SELECT to_timestamp(floor(epoch(sent_at) / {step}) * {step}) AS period, instance,
                                               avg(offset_ms) AS offset_ms, max(bound_ms) AS bound_ms,
                                               count(*) AS exchanges
                                        FROM clock_samples WHERE {time_where.replace("minute", "sent_at")}
                                        GROUP BY 1, 2 ORDER BY 1, 2""", time_params),
            "suspect": self._table(f"""SELECT sum(clock_suspect) AS suspect, sum(requests) AS requests
                                       FROM request_rollup WHERE {where}""", params),
            "unattributed": self._table(f"""SELECT to_timestamp(floor(epoch(minute) / {step}) * {step}) AS period, mode,
                                                sum(unattributed_ms) / sum(ttft_ms) AS share, sum(requests) AS requests
                                         FROM request_rollup WHERE {where} AND complete GROUP BY 1, 2
                                         HAVING sum(requests) > 0 ORDER BY 1, 2""", params),
            "missing": self._table(f"""SELECT mode, missing, count(*) AS requests FROM requests
                                    WHERE {raw_where} AND NOT complete GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 50""",
                                raw_params),
            "collector": self._table(f"""SELECT collector_run_id, recorded_at, {", ".join(schema.HEALTH_COLUMNS)}
                                      FROM collector_health WHERE {health_where} ORDER BY recorded_at""", time_params),
        }




def _origin_ns(request: dict[str, Any]) -> int:
    """A request row's start on its reference clock, ns (stored to the µs): its stages' zero."""
    return int(request["started_at"].timestamp() * 1e6) * 1000


def rank_stages(spans: list[dict], request: dict[str, Any]) -> list[dict]:
    """Stages that several processes of one side recorded (tensor-parallel ranks: each rank's transfer),
    one entry per process (its ``kvtrace.tp_rank``, else its place in order of start), on the request's
    reference clock in ms from its start, with its bytes and a ``lane`` of its own. ``spans``: :meth:`StoreReader.trace_spans`; ``request``: :meth:`StoreReader.trace`'s."""
    by_stage: dict[tuple[str, str], dict[str, dict]] = {}
    for span in spans:
        side = semconv.SIDE_OF_ROLE.get(span["resource"].get(semconv.RES_ROLE))
        instance = span["resource"].get(semconv.RES_SERVICE_INSTANCE_ID, "")
        if side is None:
            continue
        stage = span["attributes"].get(semconv.ATTR_STAGE, span["name"])
        first = by_stage.setdefault((side, stage), {}).get(instance)
        if first is None or span["start_ns"] < first["start_ns"]:
            by_stage[(side, stage)][instance] = span
    origin_ns = _origin_ns(request)
    offsets = request.get("clock_offsets") or {}
    out = []
    for (side, stage), by_instance in by_stage.items():
        if len(by_instance) < 2:
            continue
        for order, (instance, span) in enumerate(sorted(by_instance.items(), key=lambda item: item[1]["start_ns"])):
            rank = span["resource"].get(semconv.RES_TP_RANK, order)  # the worker's own rank, else its order
            offset = offsets.get(instance, 0)
            start, end = span["start_ns"] + offset - origin_ns, span["end_ns"] + offset - origin_ns
            out.append({"side": side, "stage": stage, "rank": rank, "instance": instance,
                        "lane": f"{side} · {stage} · rank {rank}", "category": STAGE_CATEGORY.get(stage, "coordination"),
                        "start_ms": start / 1e6, "end_ms": end / 1e6, "duration_ms": (end - start) / 1e6,
                        "critical_ms": 0.0, "bytes": span["attributes"].get(semconv.ATTR_TRANSFER_BYTES)})
    return out


def _any(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else None


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot send {type(value).__name__} as a query parameter")


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason or str(exc.code)

