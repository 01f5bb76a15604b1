"""Where a store's data comes from, behind one small interface every reader question is written against.

A :class:`StoreSource` answers SQL with Arrow tables, says when its data changed, and hands back a
trace's original spans; its :class:`Dialect` gives the few SQL fragments that differ between
engines, so a second backend implements the same questions by implementing these: the fleet's
shared ClickHouse store is :class:`ClickHouseSource`. Three DuckDB sources exist: :class:`FileSource` (a file no collector holds,
read-only), :class:`CollectorSource` (a running collector's query endpoint, :mod:`..query_service`)
and :class:`AutoSource` (a file, read whichever way works now: it follows a collector starting
or stopping).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema
from ..clickhouse import READ_SETTINGS, ClickHouseAddress
from ..clickhouse import bind as clickhouse_bind
from ..clickhouse import stored_spans as clickhouse_spans
from ..model import SpanRow, decode, spans_at
from ..query_service import QueryRefused, endpoint_file, run_query
from ..wal import read_record


class StoreUnavailable(RuntimeError):
    """The store cannot be read: no such file, another schema, or a collector that cannot be reached."""


class Dialect:
    """DuckDB's spelling of the SQL fragments the reader's questions need beyond plain SELECTs."""

    def time_bucket(self, column: str, step_s: int) -> str:
        """``column`` (a timestamp) floored to a multiple of ``step_s`` seconds, as a timestamp."""
        return f"to_timestamp(floor(epoch({column}) / {int(step_s)}) * {int(step_s)})"

    def seconds_between(self, first: str, last: str) -> str:
        return f"(epoch({last}) - epoch({first}))"

    def quantiles(self, column: str, qs: Sequence[float]) -> str:
        """The exact quantiles (linear interpolation between closest ranks, :mod:`.quantiles`) as a list."""
        return f"quantile_cont({column}, [{', '.join(repr(float(q)) for q in qs)}])"

    def distinct_list(self, column: str, where: str) -> str:
        return f"list(DISTINCT {column}) FILTER (WHERE {where})"

    def sample(self, rows: int, seed: int) -> str:
        """A repeatable sample of ``rows`` rows of the FROM clause it follows."""
        return f"USING SAMPLE reservoir({int(rows)} ROWS) REPEATABLE ({int(seed)})"

    def json_string(self, column: str, path: str) -> str:
        return f"json_extract_string({column}, '$.{path}')"

    def stage_durations(self, where: str) -> str:
        """A FROM clause: one row (``mode``, ``stage_key``, ``duration_ms``) per stage of each request matching
        ``where``, the requests filtered before their stage lists are unnested (the ``stages`` view unnests every
        request first: 2.48 against 0.13 s for the Stages page at 129k of a million requests)."""
        return f"""(SELECT mode, unnest(stage_ids) AS stage_key,
                           (unnest(stage_end_ns) - unnest(stage_start_ns)) / 1e6 AS duration_ms
                    FROM requests WHERE {where})"""


DUCKDB = Dialect()


class StoreSource(Protocol):
    """What the reader needs of a store."""

    kind: str
    dialect: Dialect

    def query(self, sql: str, params: Sequence = ()) -> pa.Table: ...

    def data_version(self) -> str:
        """Changes whenever new data was committed (readers key their caches on it)."""

    def status(self) -> dict: ...

    def trace_spans(self, trace_id: str) -> list[SpanRow]:
        """The trace's spans as received (each once), or [] where their originals are gone."""


class StoreHeld(Exception):
    """A collector holds the store file: read through its query endpoint instead."""


class FileSource:
    """A store file no collector holds, read-only. One connection serves every query (a cursor
    each) and is closed after :attr:`IDLE_S` without one, so a collector can open the file for
    writing soon after a reader stops asking (a collector waits for that, see ``Store``)."""

    kind = "file"
    dialect = DUCKDB
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

    def trace_spans(self, trace_id: str) -> list[SpanRow]:
        """The trace's spans as received, from the write-ahead log beside the file (if kept)."""
        rows = self.query(schema.ORIGINALS_SQL, [trace_id]).to_pylist()
        wal_dir = self._wal_dir()
        if not rows or wal_dir is None:
            return []
        located = spans_at([tuple(row.values()) for row in rows],
                           lambda segment, offset, length: read_record(wal_dir, segment, offset, length))
        return list({span.span_id: span for span in located}.values())  # a span sent twice, once

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
    dialect = DUCKDB

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

    def trace_spans(self, trace_id: str) -> list[SpanRow]:
        try:
            payload = self._call("GET", f"/v1/traces/{trace_id}")
        except QueryRefused:
            return []
        return decode(payload)[0] if payload else []

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

    dialect = DUCKDB

    @property
    def kind(self) -> str:
        return "collector" if self._collector is not None else "file"

    def query(self, sql: str, params: Sequence = ()) -> pa.Table:
        return self._call(lambda source: source.query(sql, params))

    def status(self) -> dict:
        return self._call(lambda source: source.status())

    def data_version(self) -> str:
        return self._call(lambda source: source.data_version())

    def trace_spans(self, trace_id: str) -> list[SpanRow]:
        return self._call(lambda source: source.trace_spans(trace_id))

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


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot send {type(value).__name__} as a query parameter")


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason or str(exc.code)



class ClickHouseDialect(Dialect):
    """ClickHouse's spelling of the same fragments (the same answers: :mod:`.quantiles`' definition is
    ``quantilesExactInclusive``, time steps are counted from the epoch as DuckDB's are)."""

    def time_bucket(self, column: str, step_s: int) -> str:
        step_us = int(step_s) * 1_000_000
        return f"fromUnixTimestamp64Micro(intDiv(toUnixTimestamp64Micro({column}), {step_us}) * {step_us}, 'UTC')"

    def seconds_between(self, first: str, last: str) -> str:
        return f"((toUnixTimestamp64Micro({last}) - toUnixTimestamp64Micro({first})) / 1e6)"

    def quantiles(self, column: str, qs: Sequence[float]) -> str:
        return f"quantilesExactInclusive({', '.join(repr(float(q)) for q in qs)})({column})"

    def distinct_list(self, column: str, where: str) -> str:
        return f"groupUniqArrayIf({column}, {where})"

    def sample(self, rows: int, seed: int) -> str:
        return f"ORDER BY sipHash64(trace_id, {int(seed)}) LIMIT {int(rows)}"

    def json_string(self, column: str, path: str) -> str:
        return f"JSONExtractString({column}, '{path}')"

    def stage_durations(self, where: str) -> str:
        return f"""(SELECT mode, stage_key, (end_ns - start_ns) / 1e6 AS duration_ms FROM requests
                    ARRAY JOIN stage_ids AS stage_key, stage_start_ns AS start_ns, stage_end_ns AS end_ns
                    WHERE {where})"""


CLICKHOUSE = ClickHouseDialect()


class ClickHouseSource:
    """A shared ClickHouse store (``clickhouse://host:8123/database``, :mod:`..clickhouse`), the fleet's:
    every collector writes it, every reader reads it directly."""

    kind = "clickhouse"
    dialect = CLICKHOUSE

    def __init__(self, url: str) -> None:
        self.address = ClickHouseAddress.parse(url)
        self._client = None
        self._lock = threading.Lock()

    def query(self, sql: str, params: Sequence = ()) -> pa.Table:
        try:
            table = self._connected().query_arrow(*clickhouse_bind(sql, list(params)))
        except StoreUnavailable:
            raise
        except Exception as exc:  # the driver's errors carry the server's message
            if _is_refusal(exc):
                raise QueryRefused(_first_line(exc)) from None
            raise StoreUnavailable(f"{self.address}: {_first_line(exc)}") from None
        return _like_duckdb(table)

    def data_version(self) -> str:
        row = self.query("SELECT count() AS commits, max(committed_at) AS last FROM commits").to_pylist()[0]
        return f"clickhouse:{row['commits']}:{row['last']}"

    def status(self) -> dict:
        found = self.query("SELECT max(version) AS v FROM schema_version").to_pylist()[0]["v"]
        if found != schema.SCHEMA_VERSION:
            raise StoreUnavailable(f"{self.address}: written by a kvtrace with store schema {found or 'unknown'}; "
                                   f"this kvtrace reads schema {schema.SCHEMA_VERSION}")
        return {"source": "clickhouse", "url": str(self.address), "schema_version": found,
                "data_version": self.data_version()}

    def trace_spans(self, trace_id: str) -> list[SpanRow]:
        return clickhouse_spans(self._connected(), trace_id)

    def _connected(self):
        with self._lock:
            if self._client is None:
                try:
                    self._client = self.address.client(**READ_SETTINGS)
                except Exception as exc:
                    raise StoreUnavailable(f"the ClickHouse store at {self.address} cannot be reached: "
                                           f"{_first_line(exc)}") from None
            return self._client


def _like_duckdb(table: pa.Table) -> pa.Table:
    """ClickHouse's answer in DuckDB's terms: unsigned integers as int64, and NULL where a division by
    zero gave inf or nan (DuckDB gives NULL)."""
    for i, field in enumerate(table.schema):
        column = table.column(i)
        if pa.types.is_unsigned_integer(field.type):
            table = table.set_column(i, field.name, column.cast(pa.int64()))
        elif pa.types.is_floating(field.type) and column.null_count < len(column):
            finite = pc.is_finite(column)
            if not pc.all(pc.fill_null(finite, True)).as_py():
                table = table.set_column(i, field.name, pc.if_else(finite, column, None))
    return table


def _is_refusal(exc: Exception) -> bool:
    """The server refused the query itself (a syntax error, an unknown column), not the connection."""
    return getattr(exc, "code", None) is not None or "Code:" in str(exc)


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
