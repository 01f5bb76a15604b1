"""The running collector's read-only query endpoint: how anything else reads a store being written.

DuckDB lets no other process open a file while the collector writes it (not even read-only),
so the collector answers reads itself, over HTTP on 127.0.0.1 (same ``--token`` and TLS as
the receivers):

* ``GET /v1/status`` — JSON: schema version, data version (commits so far), last commit time,
  pending traces, queued requests, lag.
* ``POST /v1/query`` — JSON ``{"sql": "SELECT ...", "params": [...]}``; one read-only SELECT,
  answered as an Arrow IPC stream (``application/vnd.apache.arrow.stream``). It runs on a
  DuckDB connection of its own (it sees committed data only, and never blocks the writer);
  the store's database has file access off, so a query reads the store's tables and nothing
  else.
* ``GET /v1/traces/<trace id>`` — the trace's spans exactly as received (OTLP protobuf,
  rebuilt from the originals in the write-ahead log).

While it serves, the collector advertises the endpoint in ``<db>.kvtrace-collector.json``
beside the store, so the read side (:mod:`.read.sources`) finds it from the file's path alone; the file is removed
at shutdown. Nothing here costs the pipeline anything per span: a query costs what it reads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable

import duckdb
import pyarrow as pa

from . import schema
from .httpserver import JSON, HttpServer, authorized, reply, reply_error

logger = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"
PROTOBUF = "application/x-protobuf"
MAX_QUERY_BYTES = 1024 * 1024
MAX_ROWS = 5_000_000
QUERY_TIMEOUT_S = 60.0
_TRACE_PATH = re.compile(r"^/v1/traces/([0-9a-f]{32})$")


def endpoint_file(db_path: str | os.PathLike) -> Path:
    """Where a collector writing ``db_path`` advertises its query endpoint."""
    return Path(f"{db_path}.kvtrace-collector.json")


class QueryRefused(ValueError):
    """The query is not one read-only SELECT (or is malformed): the client's to fix."""


def check_select(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Accept exactly one SELECT statement; anything else raises :class:`QueryRefused`."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryRefused(f"not valid SQL: {exc}") from None
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        raise QueryRefused("one read-only SELECT statement, please")


def run_query(con: duckdb.DuckDBPyConnection, sql: str, params: list, *, max_rows: int = MAX_ROWS,
              timeout_s: float = QUERY_TIMEOUT_S) -> pa.Table:
    """Run one checked SELECT on ``con``, interrupted after ``timeout_s``; at most ``max_rows`` rows."""
    check_select(con, sql)
    timer = threading.Timer(timeout_s, con.interrupt)
    timer.start()
    try:
        reader = con.sql(sql, params=params).to_arrow_reader(65_536)
        batches, rows = [], 0
        for batch in reader:
            rows += batch.num_rows
            if rows > max_rows:
                raise QueryRefused(f"more than {max_rows:,} rows: aggregate, filter or LIMIT")
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=reader.schema)
    except duckdb.InterruptException:
        raise QueryRefused(f"stopped after {timeout_s:.0f} s") from None
    except (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
            duckdb.PermissionException, duckdb.InvalidInputException, duckdb.ConversionException) as exc:
        raise QueryRefused(str(exc)) from None
    finally:
        timer.cancel()


def arrow_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class QueryService:
    """Serves reads of a live store. ``status`` returns the collector's live counters;
    ``trace_originals`` the OTLP bytes of one trace's stored spans (or None)."""

    def __init__(self, store: Any, status: Callable[[], dict], trace_originals: Callable[[str], bytes | None], *,
                 host: str = "127.0.0.1", port: int = 0, bearer_token: str | None = None,
                 tls: tuple[str, str] | None = None) -> None:
        self._store = store
        self._status = status
        self._trace_originals = trace_originals
        self._token = bearer_token
        self._server = HttpServer(self._handle, host, port, name="kvtrace-query", tls=tls)
        self._advertised: Path | None = None

    @property
    def url(self) -> str:
        return self._server.base_url

    @property
    def port(self) -> int:
        return self._server.port

    def start(self) -> None:
        self._server.start()
        self._advertised = endpoint_file(self._store.path)
        tmp = self._advertised.with_name(self._advertised.name + ".tmp")
        tmp.write_text(json.dumps({"url": self.url, "pid": os.getpid(), "token": self._token is not None}))
        os.replace(tmp, self._advertised)  # readers never see a half-written file

    def shutdown(self) -> None:
        if self._advertised is not None:
            try:
                if json.loads(self._advertised.read_text()).get("pid") == os.getpid():
                    self._advertised.unlink()
            except (OSError, ValueError):
                pass
            self._advertised = None
        self._server.shutdown()

    # ------------------------------------------------------------------ requests

    def _handle(self, method: str, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        if not authorized(self._token, h.headers.get("Authorization")):
            return reply_error(h, HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token", close=True)
        if method == "GET" and path == "/v1/status":
            return reply(h, HTTPStatus.OK, json.dumps(self.status()).encode(), JSON)
        if method == "POST" and path == "/v1/query":
            return self._query(h)
        match = _TRACE_PATH.match(path)
        if method == "GET" and match:
            payload = self._trace_originals(match.group(1))
            if payload is None:
                return reply_error(h, HTTPStatus.NOT_FOUND, "no stored spans for that trace")
            return reply(h, HTTPStatus.OK, payload, PROTOBUF)
        reply_error(h, HTTPStatus.NOT_FOUND, "unknown path (GET /v1/status, POST /v1/query, GET /v1/traces/<id>)",
                    close=True)

    def status(self) -> dict:
        return {"schema_version": schema.SCHEMA_VERSION, "data_version": self._store.data_version,
                "time": time.time(), **self._status()}

    def _query(self, h: BaseHTTPRequestHandler) -> None:
        try:
            length = int(h.headers.get("Content-Length", ""))
        except ValueError:
            return reply_error(h, HTTPStatus.LENGTH_REQUIRED, "Content-Length required", close=True)
        if length > MAX_QUERY_BYTES:
            return reply_error(h, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "query too large", close=True)
        try:
            request = json.loads(h.rfile.read(length))
            sql, params = request["sql"], request.get("params") or []
            if not isinstance(sql, str) or not isinstance(params, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return reply_error(h, HTTPStatus.BAD_REQUEST, 'body must be {"sql": "...", "params": [...]}')
        cursor = self._store.cursor()
        try:
            table = run_query(cursor, sql, params)
        except QueryRefused as exc:
            return reply_error(h, HTTPStatus.BAD_REQUEST, str(exc))
        except duckdb.Error as exc:
            logger.warning("kvtrace query endpoint: %s", exc)
            return reply_error(h, HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            cursor.close()
        reply(h, HTTPStatus.OK, arrow_bytes(table), ARROW_STREAM,
              headers={"X-Kvtrace-Data-Version": str(self._store.data_version)})
