"""What every page shares: the sidebar filters (mirrored in the URL, so a view is a link), the
empty and error states, and number formatting."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any

import streamlit as st

from kvtrace.collectors.read import Filters, StoreUnavailable, length_label
from kvtrace.telemetry import semconv

from . import data


def side_by_side(*panels: tuple) -> None:
    """Charts in equal columns, each panel ``(title, figure, key)`` or ``(title, figure, key, caption)``."""
    for column, (title, figure, key, *caption) in zip(st.columns(len(panels)), panels):
        with column:
            st.subheader(title)
            st.plotly_chart(figure, key=key)
            if caption:
                st.caption(caption[0])

WINDOWS = {"all": None, "15m": timedelta(minutes=15), "1h": timedelta(hours=1), "6h": timedelta(hours=6),
           "24h": timedelta(hours=24), "7d": timedelta(days=7)}
WINDOW_LABELS = {"all": "All data", "15m": "Last 15 minutes", "1h": "Last hour", "6h": "Last 6 hours",
                 "24h": "Last 24 hours", "7d": "Last 7 days"}
TTFT_REFERENCES = {r.value: meaning for r, meaning in semconv.TTFT_REFERENCE_MEANINGS.items()}
RENDEZVOUS_SHORT = {semconv.RendezvousOrder.REGISTRATION_FIRST.value: "D first",
                    semconv.RendezvousOrder.KV_FIRST.value: "P first"}
RENDEZVOUS_HELP = {semconv.RendezvousOrder.REGISTRATION_FIRST.value: "registration_first: D's registration was "
                   "waiting when P's KV was ready (the prefill hid the coordination)",
                   semconv.RendezvousOrder.KV_FIRST.value: "kv_first: P's KV waited for D's registration (that "
                   "wait is on the critical path)"}
"""What each TTFT reference measures from and to (the contract's words), for the pages' help."""
_KEYS = {"window": "f_window", "mode": "f_modes", "run": "f_runs", "instance": "f_instances", "len": "f_len"}

EMPTY_HELP = """
**No requests in this store yet.** Send traces to a collector writing it:

```sh
kvtrace collector --db {db}          # OTLP on 127.0.0.1:4317 (gRPC) and :4318 (HTTP)
```

and load kvtrace's connector in each vLLM engine (prefill shown; decode: `"kv_role":"kv_consumer"`):

```sh
--kv-transfer-config '{{"kv_connector":"NixlPushConnector","kv_connector_module_path":"kvtrace.connector",
  "kv_role":"kv_producer","kv_connector_extra_config":{{"kvtrace":{{"endpoint":"http://127.0.0.1:4317"}}}}}}'
```

with `kvtrace router` in front of the pair. Or try it on this machine: `kvtrace demo`.
"""


def store_options() -> dict[str, Any]:
    """What the store holds (modes, runs, instances, lengths, time span); stops the page with a
    clear message when the store cannot be read."""
    try:
        return data.filter_options()
    except StoreUnavailable as exc:
        st.error(f"**The store cannot be read.** {exc}")
        st.stop()
        raise  # not reached: st.stop ends the run


def sidebar_filters(options: dict[str, Any]) -> Filters:
    """The filters in the sidebar, restored from the URL on a new session and written back to it."""
    state = st.session_state
    if not state.get("f_loaded"):
        _load_from_url(options)
        state["f_loaded"] = True
    sidebar = st.sidebar
    sidebar.selectbox("Time window", list(WINDOWS), format_func=WINDOW_LABELS.get, key=_KEYS["window"],
                      help="Relative to the newest request in the store, so a recorded run reads the same later.")
    if len(options["modes"]) > 1:
        sidebar.multiselect("Mode", options["modes"], key=_KEYS["mode"], placeholder="push and pull")
    if options["runs"]:
        sidebar.multiselect("Run", options["runs"], key=_KEYS["run"], placeholder="every run")
    if options["instances"]:
        sidebar.multiselect("Instance (P or D)", options["instances"], key=_KEYS["instance"],
                            placeholder="every instance")
    lengths = options["length_buckets"]
    if len(lengths) > 1:
        # A range slider is one only when created with a range value; set once per session (from
        # the URL), then the widget owns it.
        initial = state.setdefault("f_len_initial", _url_length(lengths))
        if initial[0] not in lengths or initial[1] not in lengths:
            initial = state["f_len_initial"] = (lengths[0], lengths[-1])
        sidebar.select_slider("Prompt length (tokens)", options=lengths, format_func=length_label,
                              value=initial, key=_KEYS["len"])
    _save_to_url(options)
    return current_filters(options)


def current_filters(options: dict[str, Any]) -> Filters:
    """The sidebar's filters as the reader takes them (a relative window ends at the newest data)."""
    state = st.session_state
    window = WINDOWS.get(state.get(_KEYS["window"], "all"))
    since = options["last"] - window if window is not None and options["last"] is not None else None
    lengths = options["length_buckets"]
    length = state.get(_KEYS["len"])
    everything = (lengths[0], lengths[-1]) if lengths else None
    low, high = tuple(length) if length and tuple(length) != everything else (None, None)
    return Filters(since=since, modes=tuple(state.get(_KEYS["mode"]) or ()), runs=tuple(state.get(_KEYS["run"]) or ()),
                   instances=tuple(state.get(_KEYS["instance"]) or ()), min_length_bucket=low, max_length_bucket=high)


def _load_from_url(options: dict[str, Any]) -> None:
    params, state = st.query_params, st.session_state
    window = params.get("window", "all")
    state[_KEYS["window"]] = window if window in WINDOWS else "all"
    for key, allowed in (("mode", options["modes"]), ("run", options["runs"]), ("instance", options["instances"])):
        state[_KEYS[key]] = [v for v in params.get(key, "").split(",") if v in allowed]


def _url_length(lengths: list[int]) -> tuple[int, int]:
    low, _, high = st.query_params.get("len", "").partition("-")
    try:
        chosen = (int(low), int(high))
    except ValueError:
        return lengths[0], lengths[-1]
    return chosen if chosen[0] in lengths and chosen[1] in lengths else (lengths[0], lengths[-1])


def _save_to_url(options: dict[str, Any]) -> None:
    state, params = st.session_state, st.query_params
    wanted: dict[str, str] = {}
    if state.get(_KEYS["window"], "all") != "all":
        wanted["window"] = state[_KEYS["window"]]
    for key in ("mode", "run", "instance"):
        if state.get(_KEYS[key]):
            wanted[key] = ",".join(state[_KEYS[key]])
    lengths = options["length_buckets"]
    chosen = state.get(_KEYS["len"])
    if chosen and len(lengths) > 1 and tuple(chosen) != (lengths[0], lengths[-1]):
        wanted["len"] = f"{chosen[0]}-{chosen[1]}"
    if "trace_id" in params:
        wanted["trace_id"] = params["trace_id"]
    if dict(params) != wanted:
        params.from_dict(wanted)


def page(title: str, question: str) -> tuple[Filters, dict[str, Any]]:
    """A page's header; returns the filters and the store's options. An empty store shows how to
    send data and stops the page."""
    st.title(title)
    st.caption(question)
    options = st.session_state.get("store_options") or store_options()
    if not options["requests"]:
        settings = data.settings()
        st.info(EMPTY_HELP.format(db=settings.db or "kvtrace.duckdb"))
        st.stop()
    return st.session_state["filters"], options


def window_caption(f: Filters, options: dict[str, Any]) -> str:
    since = f.since or options["first"]
    until = f.until or options["last"]
    if since is None or until is None:
        return ""
    return f"{_utc(since)} → {_utc(until)} UTC"


def _utc(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M")


def ms(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f} ms"


def ms_short(value: float | None, approximate: bool = False) -> str:
    """A duration in at most three significant digits and seven characters (a KPI's column is narrow):
    4.21 ms, 87.7 ms, 410 ms, 1.25 s, 12.5 s; two digits where it is a histogram's estimate (±4 %):
    4.2 ms, 88 ms, 410 ms, 1.2 s."""
    if value is None:
        return "–"
    digits = 2 if approximate else 3
    unit, scaled = ("s", value / 1_000) if value >= 1_000 else ("ms", value)
    if scaled >= 1_000:
        return f"{scaled:,.0f} {unit}"
    if scaled < 1:
        return f"{scaled:.2f} {unit}"
    rounded = round(scaled, digits - 1 - math.floor(math.log10(scaled)))
    if unit == "ms" and rounded >= 1_000:  # 999.96 ms rounds up into seconds
        return ms_short(1_000.0, approximate)
    return f"{rounded:.{max(0, digits - 1 - math.floor(math.log10(rounded)))}f} {unit}"


def pct(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value * 100:.{digits}f} %"


def count(value: Any) -> str:
    return "–" if value is None else f"{int(value):,}"
