"""The dashboard's one way to the store: a :class:`~kvtrace.collectors.reader.StoreReader`, and its
answers cached per (question, filters, data version).

Every page run asks the store for its data version once (a file stat or one small HTTP call),
so a refresh that finds nothing new costs that check and cache hits; new data makes every
question be asked again.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from kvtrace.collectors.reader import Filters, StoreReader, StoreUnavailable, open_store

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
def _ask(_reader: StoreReader, source: tuple, question: str, filters: Filters | None, data_version: str,
         args: tuple) -> Any:
    method = getattr(_reader, question)
    return method(filters, *args) if filters is not None else method(*args)


def ask(question: str, filters: Filters | None = None, *args: Any, data_version: str | None = None) -> Any:
    """``reader.<question>(filters, *args)``, cached until the data version changes."""
    s = settings()
    return _ask(reader(), (s.db, s.collector), question, filters,
                data_version if data_version is not None else version(), args)


__all__ = ["Filters", "StoreUnavailable", "ask", "reader", "settings", "version"]
