"""The dashboard's one way to the store: a :class:`~kvtrace.collectors.read.StoreReader`, and one
function per question the pages ask, its answer cached per (question, arguments, data version).

Every page run asks the store for its data version once (a file stat or one small HTTP call),
so a refresh that finds nothing new costs that check and cache hits; new data makes every
question be asked again.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pyarrow as pa
import streamlit as st

from kvtrace.collectors.read import Filters, StoreReader, StoreUnavailable, open_store

from .settings import Settings

CACHE_TTL_S = 600


@st.cache_resource(show_spinner=False)
def _reader(db: str | None, collector: str | None, token: str | None) -> StoreReader:
    return open_store(db, collector=collector, token=token)


def settings() -> Settings:
    return Settings.from_env()


def reader() -> StoreReader:
    s = settings()
    return _reader(s.db, s.collector, s.token)


def version() -> str:
    """The store's data version now (raises StoreUnavailable when it cannot be read)."""
    return reader().data_version()


@st.cache_data(ttl=CACHE_TTL_S, max_entries=512, show_spinner=False)
def _answer(_ask: Callable[[StoreReader], Any], key: tuple, data_version: str) -> Any:
    """``_ask(reader)``, cached per (question and its arguments, store, data version); the callable
    itself is not hashed (its leading underscore), ``key`` says what it asks."""
    return _ask(reader())


def _cached(question: str, ask: Callable[[StoreReader], Any], *args: Any) -> Any:
    s = settings()
    return _answer(ask, (question, s.db, s.collector, *args), version())


# One function per question the pages ask, each the reader's method of the same name (findable, typed).

def filter_options() -> dict[str, Any]:
    return _cached("filter_options", lambda r: r.filter_options())


def kpis(f: Filters) -> dict[str, Any]:
    return _cached("kpis", lambda r: r.kpis(f), f)


def parts_by_mode(f: Filters) -> pa.Table:
    return _cached("parts_by_mode", lambda r: r.parts_by_mode(f), f)


def cohorts(f: Filters) -> dict[str, Any]:
    return _cached("cohorts", lambda r: r.cohorts(f), f)


def ttft_over_time(f: Filters) -> list[dict]:
    return _cached("ttft_over_time", lambda r: r.ttft_over_time(f), f)


def ttft_cdf(f: Filters) -> list[dict]:
    return _cached("ttft_cdf", lambda r: r.ttft_cdf(f), f)


def parts_by_length(f: Filters) -> pa.Table:
    return _cached("parts_by_length", lambda r: r.parts_by_length(f), f)


def transfers(f: Filters) -> pa.Table:
    return _cached("transfers", lambda r: r.transfers(f), f)


def stage_table(f: Filters) -> list[dict]:
    return _cached("stage_table", lambda r: r.stage_table(f), f)


def stage_heatmap(f: Filters) -> pa.Table:
    return _cached("stage_heatmap", lambda r: r.stage_heatmap(f), f)


def rendezvous(f: Filters) -> dict[str, pa.Table]:
    return _cached("rendezvous", lambda r: r.rendezvous(f), f)


def kv_hold(f: Filters) -> pa.Table:
    return _cached("kv_hold", lambda r: r.kv_hold(f), f)


def decode_smoothness(f: Filters) -> list[dict]:
    return _cached("decode_smoothness", lambda r: r.decode_smoothness(f), f)


SAMPLE_POINTS = 300
"""Requests a page's scatter draws beside the 50 slowest: where the bulk falls, not every request (a box
selection is answered in the database). Every point costs the first paint: the Slow requests and Decode
pages' first chart came ~0.13 s sooner warm with 300 than with 1,000 (docs/PERFORMANCE.md)."""


def requests_sample(f: Filters) -> pa.Table:
    return _cached("requests_sample", lambda r: r.requests_sample(f, sample=SAMPLE_POINTS), f)


def compare(f: Filters, since: datetime, until: datetime, ttft_min_ms: float, ttft_max_ms: float) -> dict[str, Any]:
    return _cached("compare", lambda r: r.compare(f, since, until, ttft_min_ms, ttft_max_ms),
                   f, since, until, ttft_min_ms, ttft_max_ms)


def slowest(f: Filters, limit: int = 20) -> pa.Table:
    return _cached("slowest", lambda r: r.slowest(f, limit), f, limit)


def trace_view(trace_id: str) -> dict[str, Any] | None:
    return _cached("trace_view", lambda r: r.trace_view(trace_id), trace_id)


def health(f: Filters) -> dict[str, Any]:
    return _cached("health", lambda r: r.health(f), f)


def runs() -> list[dict]:
    return _cached("runs", lambda r: r.runs())


def default_runs() -> tuple[str, str] | None:
    return _cached("default_runs", lambda r: r.default_runs())


def compare_runs(run_a: str, run_b: str) -> dict:
    return _cached("compare_runs", lambda r: r.compare_runs(run_a, run_b), run_a, run_b)


def whatif(run_id: str, against: str | None = None) -> dict:
    return _cached("whatif", lambda r: r.whatif(run_id, against), run_id, against)


__all__ = ["Filters", "StoreUnavailable", "reader", "settings", "version"]
