"""What every page shares: the sidebar filters (mirrored in the URL, so a view is a link), the
empty and error states, and number formatting."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import streamlit as st

from kvtrace.collectors.read import ESTIMATE_ERROR_TEXT, PART_COLUMNS, PARTS, Filters, StoreUnavailable, length_label
from kvtrace.telemetry import semconv

from . import charts, data

if TYPE_CHECKING:
    import plotly.graph_objects as go


def chart(figure: go.Figure | charts.NoData, key: str, **options: Any) -> Any:
    """A figure, or the line saying why there is none (:class:`charts.NoData`); returns what
    ``st.plotly_chart`` does (a selection event with ``on_select``), None for no data."""
    if isinstance(figure, charts.NoData):
        st.info(figure.message[:1].upper() + figure.message[1:] + ".", icon=":material/info:")
        return None
    return st.plotly_chart(figure, key=key, **options)


def side_by_side(*panels: tuple) -> None:
    """Charts in equal columns, each panel ``(title, figure, key)`` or ``(title, figure, key, caption)``."""
    for column, (title, figure, key, *caption) in zip(st.columns(len(panels)), panels):
        with column:
            st.subheader(title)
            chart(figure, key)
            if caption:
                st.caption(caption[0])


@dataclass(frozen=True)
class Kpi:
    """One figure of a page's KPI tiles (:func:`kpis`): its label, its value as shown, what hovering its label
    says (``help``) and a line of small print under it (``note``)."""

    label: str
    value: str
    help: str | None = None
    note: str | None = None


KPI_CLASS = "kvtrace-kpi"
"""The tiles' CSS classes: ``kvtrace-kpi`` on each tile, ``-label``, ``-value`` and ``-note`` on its parts."""


def kpis(tiles: Sequence[Kpi], columns: int = 4) -> None:
    """KPI tiles in a grid, ``columns`` to a row, as one HTML element (:func:`kpi_html`).

    One element rather than an ``st.metric`` per figure: each metric is a component of its own (label
    markdown, tooltip, layout), and the Overview's seven cost its warm first chart ~50-90 ms in Chromium,
    one HTML element of the same tiles nothing measurable (docs/PERFORMANCE.md)."""
    st.html(kpi_html(tiles, columns))


def kpi_html(tiles: Sequence[Kpi], columns: int = 4) -> str:
    """The tiles' markup: a label with its help as a tooltip (dotted underline), the value in large type
    (never wider than its column: values are short, :func:`ms_short`), the note in small print. Every
    text is escaped."""
    def tile(kpi: Kpi) -> str:
        hint = (f' title="{html.escape(kpi.help)}" style="cursor:help;text-decoration:underline dotted '
                'rgba(128,128,128,0.6);text-underline-offset:3px"' if kpi.help else "")
        note = (f'<div class="{KPI_CLASS}-note" style="font-size:0.875rem;opacity:0.6">{html.escape(kpi.note)}</div>'
                if kpi.note else "")
        return (f'<div class="{KPI_CLASS}" style="min-width:0">'
                f'<div class="{KPI_CLASS}-label" style="font-size:0.875rem"><span{hint}>{html.escape(kpi.label)}'
                f'</span></div><div class="{KPI_CLASS}-value" style="font-size:2.25rem;line-height:1.25;'
                f'white-space:nowrap;overflow:hidden;text-overflow:ellipsis">{html.escape(kpi.value)}</div>{note}</div>')

    return (f'<div style="display:grid;grid-template-columns:repeat({columns},minmax(0,1fr));gap:0.75rem 1rem">'
            + "".join(tile(kpi) for kpi in tiles) + "</div>")


def lazy_sections(key: str, sections: dict[str, Callable[[], None]]) -> None:
    """A page's secondary views, each in an expander closed on arrival and drawn only while open (its
    queries run, its charts sent), opened and closed per session (:func:`section_key`).

    A page's first chart is drawn in the same browser render as every chart sent with it, and each costs
    that render ~50-60 ms here: what answers the page's question stays in view, the rest waits for a
    click. Tabs did that for all but one view, the open first tab's, which every page still drew on
    arrival (docs/PERFORMANCE.md)."""
    for label, draw in sections.items():
        with st.expander(label, key=section_key(key, label), on_change="rerun") as box:
            if box.open:
                draw()


def section_key(key: str, label: str) -> str:
    """The session-state key holding whether one of :func:`lazy_sections` is open."""
    return f"{key}:{label}"


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


_CHOSEN = "filters_chosen"
"""Session state: the filters' values (window, mode, run, instance, len). Kept apart from the widgets'
own keys, which Streamlit drops while the widgets are not drawn (the expander closed)."""
_OPEN = "f_open"
"""Session state: whether the sidebar's filter expander is open (it persists across pages)."""


def sidebar_filters(options: dict[str, Any]) -> Filters:
    """The filters in the sidebar, restored from the URL on a new session and written back to it.

    Their widgets are drawn only while the "Filters" expander is open; closed, the sidebar shows
    what is chosen in one line. The widgets are what a page's first paint waits for longest after
    its charts: closed, a page's first chart comes ~0.1 s sooner warm and ~0.35 s cold (docs/PERFORMANCE.md)."""
    state = st.session_state
    if _CHOSEN not in state:
        state[_CHOSEN] = _from_url(options)
    chosen = state[_CHOSEN]
    sidebar = st.sidebar
    with sidebar.expander("Filters", icon=":material/filter_alt:", key=_OPEN, on_change="rerun") as box:
        if box.open:
            _filter_widgets(chosen, options)
    sidebar.caption(filters_summary(chosen, options))
    _save_to_url(chosen, options)
    return current_filters(options)


def _filter_widgets(chosen: dict[str, Any], options: dict[str, Any]) -> None:
    """Draw the filter widgets (inside the open expander), each starting from and writing to ``chosen``.
    A widget that already exists keeps its own value: a changed default does not reset it."""
    chosen["window"] = st.selectbox(
        "Time window", list(WINDOWS), index=list(WINDOWS).index(chosen["window"]), format_func=WINDOW_LABELS.get,
        key=_KEYS["window"], help="Relative to the newest request in the store, so a recorded run reads the same later.")
    for name, label, placeholder, shown in (("mode", "Mode", "push and pull", len(options["modes"]) > 1),
                                            ("run", "Run", "every run", bool(options["runs"])),
                                            ("instance", "Instance (P or D)", "every instance",
                                             bool(options["instances"]))):
        if shown:
            allowed = options[f"{name}s"]
            chosen[name] = st.multiselect(label, allowed, default=[v for v in chosen[name] if v in allowed],
                                          key=_KEYS[name], placeholder=placeholder)
    lengths = options["length_buckets"]
    if len(lengths) > 1:
        low, high = chosen["len"] or (lengths[0], lengths[-1])
        if low not in lengths or high not in lengths:
            low, high = lengths[0], lengths[-1]
        # A range slider is one only when created with a range value.
        chosen["len"] = tuple(st.select_slider("Prompt length (tokens)", options=lengths, format_func=length_label,
                                               value=(low, high), key=_KEYS["len"]))


def filters_summary(chosen: dict[str, Any], options: dict[str, Any]) -> str:
    """What the filters select, in one line: the window and the modes always, the rest only where
    chosen ("Last 6 hours · push · run sweep-a · 2 instances")."""
    def listed(name: str) -> str | None:
        values = [v for v in chosen[name] if v in options[f"{name}s"]]
        if not values:
            return None
        return f"{name} {', '.join(values)}" if len(values) <= 2 else f"{len(values)} {name}s"

    modes = [m for m in chosen["mode"] if m in options["modes"]] or options["modes"]
    parts = [WINDOW_LABELS[chosen["window"]], " and ".join(modes) or "every mode"]
    parts += [text for text in (listed("run"), listed("instance")) if text]
    low, high = _length_range(chosen, options)
    if low is not None:
        parts.append(f"prompts {length_label(low).split('-')[0]}-{length_label(high).split('-')[-1]} tokens")
    return " · ".join(parts)


def _length_range(chosen: dict[str, Any], options: dict[str, Any]) -> tuple[int | None, int | None]:
    """The chosen prompt-length buckets, or (None, None) when every length is selected."""
    lengths = options["length_buckets"]
    length = chosen.get("len")
    if not length or not lengths or tuple(length) == (lengths[0], lengths[-1]):
        return None, None
    if length[0] not in lengths or length[1] not in lengths:
        return None, None
    return length[0], length[1]


def current_filters(options: dict[str, Any]) -> Filters:
    """The sidebar's filters as the reader takes them (a relative window ends at the newest data)."""
    chosen = st.session_state.get(_CHOSEN) or _from_url(options)
    window = WINDOWS.get(chosen["window"])
    since = options["last"] - window if window is not None and options["last"] is not None else None
    low, high = _length_range(chosen, options)
    return Filters(since=since, modes=tuple(chosen["mode"]), runs=tuple(chosen["run"]),
                   instances=tuple(chosen["instance"]), min_length_bucket=low, max_length_bucket=high)


def _from_url(options: dict[str, Any]) -> dict[str, Any]:
    """The filters a link carries (``?window=6h&mode=push&len=7-12``); what the store does not hold is dropped."""
    params = st.query_params
    window = params.get("window", "all")
    chosen: dict[str, Any] = {"window": window if window in WINDOWS else "all"}
    for key, allowed in (("mode", options["modes"]), ("run", options["runs"]), ("instance", options["instances"])):
        chosen[key] = [v for v in params.get(key, "").split(",") if v in allowed]
    low, _, high = params.get("len", "").partition("-")
    try:
        chosen["len"] = (int(low), int(high))
    except ValueError:
        chosen["len"] = None
    return chosen


def _save_to_url(chosen: dict[str, Any], options: dict[str, Any]) -> None:
    params = st.query_params
    wanted: dict[str, str] = {}
    if chosen["window"] != "all":
        wanted["window"] = chosen["window"]
    for key in ("mode", "run", "instance"):
        if chosen[key]:
            wanted[key] = ",".join(chosen[key])
    low, high = _length_range(chosen, options)
    if low is not None:
        wanted["len"] = f"{low}-{high}"
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


def difference_line(push: dict[str, Any], pull: dict[str, Any]) -> str:
    """Pull's mean TTFT minus push's and each part's difference, largest first, in one Markdown line:
    "**Pull − push: TTFT +26.30 ms** (pull 126.30 ms, push 100.00 ms); by part: coordination +25.00 ms · …"."""
    def signed(value: float) -> str:
        return f"{value:+,.2f} ms".replace("-", "\u2212")

    parts = sorted(((pull[c] - push[c], part) for part, c in zip(PARTS, PART_COLUMNS)), key=lambda d: -abs(d[0]))
    return (f"**Pull \u2212 push: TTFT {signed(pull['ttft_ms'] - push['ttft_ms'])}** (pull {ms(pull['ttft_ms'], 2)}, "
            f"push {ms(push['ttft_ms'], 2)}); by part: "
            + " · ".join(f"{part} {signed(difference)}" for difference, part in parts))


ESTIMATE_DIGITS = 2
"""Significant digits a histogram's estimate is shown to: what its ±3.9 % supports."""


def significant(value: float, digits: int) -> float:
    """``value`` rounded to ``digits`` significant digits (not 0)."""
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def ms_short(value: float | None, approximate: bool = False) -> str:
    """A duration in at most three significant digits and seven characters (a KPI's column is narrow):
    4.21 ms, 87.7 ms, 410 ms, 1.25 s, 12.5 s; two digits where it is a histogram's estimate (±3.9 %):
    4.2 ms, 88 ms, 410 ms, 1.2 s."""
    if value is None:
        return "–"
    digits = ESTIMATE_DIGITS if approximate else 3
    unit, scaled = ("s", value / 1_000) if value >= 1_000 else ("ms", value)
    if scaled >= 1_000:
        return f"{scaled:,.0f} {unit}"
    if scaled < 1:
        return f"{scaled:.2f} {unit}"
    rounded = significant(scaled, digits)
    if unit == "ms" and rounded >= 1_000:  # 999.96 ms rounds up into seconds
        return ms_short(1_000.0, approximate)
    return f"{rounded:.{max(0, digits - 1 - math.floor(math.log10(rounded)))}f} {unit}"


def percentiles_note(exact: bool) -> str:
    """What a page's percentiles are, for its caption: exact (from the rows), or the histograms' estimate."""
    if exact:
        return "percentiles exact"
    return (f"percentiles from log-bucketed histograms ({ESTIMATE_ERROR_TEXT}: over "
            f"{count(data.reader().exact_quantiles_up_to)} requests), to two digits")


def rough(value: float | None, exact: bool) -> float | None:
    """A percentile as a table shows it: as measured, or a histogram's estimate to :data:`ESTIMATE_DIGITS`
    (43.34 -> 43, 0.2234 -> 0.22, 1,234 -> 1,200)."""
    if exact or not value:
        return value
    return significant(value, ESTIMATE_DIGITS)


_MARKDOWN_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]()<>#$:~|"})


def markdown_text(text: str) -> str:
    """``text`` as itself inside ``st.markdown``: ``transfer_failed`` not italic, no link, math or shortcode."""
    return text.translate(_MARKDOWN_SPECIAL)


def pct(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value * 100:.{digits}f} %"


def count(value: Any) -> str:
    return "–" if value is None else f"{int(value):,}"
