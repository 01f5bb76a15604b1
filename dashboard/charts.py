"""Plotly figure builders: plain functions from the reader's answers to figures.

One colour per category and per mode on every page (:data:`CATEGORY_COLORS`,
:data:`MODE_COLORS`), units on every axis, and the category order of the contract. Figures are
assembled as plain specs and wrapped once (``go.Figure(spec)``): building them call by call
(``add_bar``, ``update_layout``) validates every property and cost ~30 ms a figure, the spec
~4 ms, and a page has several.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timezone
from typing import Any

import plotly.graph_objects as go

from kvtrace.collectors.read import PART_COLUMNS, PARTS, length_label, point_label
from kvtrace.telemetry import semconv

CATEGORY_COLORS = {
    "compute": "#4C78A8",
    "queue": "#F2A541",
    "coordination": "#E45756",
    "wire": "#54A24B",
    "unattributed": "#B8B0AC",
    "root": "#6B6B6B",
}
MODE_COLORS = {"push": "#7B61FF", "pull": "#00A6A6"}
ORDER_COLORS = {semconv.RendezvousOrder.REGISTRATION_FIRST.value: "#54A24B",
                semconv.RendezvousOrder.KV_FIRST.value: "#E45756"}
_FONT = {"size": 13}
"""No family: Streamlit's theme gives the charts the app's own font, already loaded, rather than a list
whose first choice (Inter) the page never loads. One chart's warm first paint beside the bare page:
0.53 s without the family against 0.57 s with it (medians of 6)."""
_GRID = "#E9E9E9"


def _axis(title: str | None, **extra: Any) -> dict:
    axis = {"title": {"text": title}, "gridcolor": _GRID, "zerolinecolor": "#CCCCCC", "automargin": True}
    axis.update(extra)
    return axis


def _figure(data: list[dict], *, x: dict, y: dict, height: int = 340, legend: bool = True, **layout: Any
            ) -> go.Figure:
    spec = {"data": data, "layout": {
        "height": height, "margin": {"l": 10, "r": 10, "t": 40, "b": 10}, "font": _FONT,
        "plot_bgcolor": "white", "paper_bgcolor": "white", "showlegend": legend,
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0, "traceorder": "normal"},
        "xaxis": x, "yaxis": y, **layout}}
    return go.Figure(spec)


def mode_color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#888888")


@dataclasses.dataclass(frozen=True)
class NoData:
    """What a chart function returns when its selection holds nothing to draw: the page says why in a
    line (``ui.chart``) rather than sending the browser an empty Plotly figure, which costs a first paint
    as much as a full one."""
    message: str


def empty(message: str) -> NoData:
    return NoData(message)


# ------------------------------------------------------------------ parts of TTFT


def stacked_parts(rows: Sequence[dict], label: str = "mode", *, share_labels: bool = False) -> go.Figure | NoData:
    """Horizontal stacked bars of the five parts' mean ms, one bar per row (its ``label`` names it).
    ``share_labels``: each part carries its share of the mean TTFT inside it (where it fits), so that one
    chart answers both "how long" and "what share"."""
    if not rows:
        return empty("no complete requests")
    names = [str(r[label]) for r in rows]
    data = []
    for part, column in zip(PARTS, PART_COLUMNS):
        shares = [r[column] / r["ttft_ms"] * 100 if r["ttft_ms"] else 0 for r in rows]
        trace = {"type": "bar", "orientation": "h", "name": part, "y": names, "x": [r[column] for r in rows],
                 "marker": {"color": CATEGORY_COLORS[part]},
                 "customdata": [[r[column], r["ttft_ms"], r.get("requests", 0), s] for r, s in zip(rows, shares)],
                 "hovertemplate": f"<b>%{{y}}</b> {part}: %{{customdata[0]:.1f}} ms of %{{customdata[1]:.1f}} "
                                  f"ms TTFT, %{{customdata[3]:.1f}} % (%{{customdata[2]}} requests)<extra></extra>"}
        if share_labels:
            trace.update(text=[f"{s:.0f} %" for s in shares], textposition="inside", insidetextanchor="middle",
                         textangle=0, insidetextfont={"color": name_color(CATEGORY_COLORS[part])})
        data.append(trace)
    layout = {"uniformtext": {"minsize": 10, "mode": "hide"}} if share_labels else {}  # a label that does not fit: none
    return _figure(data, x=_axis("mean time (ms)"), y=_axis(None, autorange="reversed"), height=120 + 45 * len(rows),
                   barmode="stack", **layout)


def cohort_rows(cohorts: Sequence[dict]) -> list[dict]:
    """Cohort rows labelled for :func:`stacked_parts` ("push · median", "push · slowest 1 %")."""
    out = []
    for row in cohorts:
        name = "median" if row["cohort"] == "p50" else f"slowest {100 - int(row['cohort'][1:])} %"
        out.append({**row, "label": f"{row['mode']} · {name}"})
    return out


def parts_side_by_side(rows: Sequence[dict]) -> go.Figure | NoData:
    """Each part's mean per mode, grouped by part, its value (ms) on each bar."""
    if not rows:
        return empty("no complete requests")
    data = [{"type": "bar", "name": row["mode"], "x": list(PARTS), "y": [row[c] for c in PART_COLUMNS],
             "marker": {"color": mode_color(row["mode"])}, "texttemplate": "%{y:.1f}", "textposition": "outside",
             "cliponaxis": False, "hovertemplate": f"{row['mode']} %{{x}}: %{{y:.2f}} ms<extra></extra>"}
            for row in rows]
    return _figure(data, x=_axis("part of TTFT"), y=_axis("mean time per request (ms)"), barmode="group")


def ttft_over_time(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no complete requests in this window")
    data = []
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        x = [r["period"] for r in points]
        data.append({"type": "scatter", "mode": "lines+markers", "name": f"{mode} p50", "x": x,
                     "y": [r["p50_ms"] for r in points], "line": {"color": mode_color(mode), "width": 2},
                     "marker": {"size": 4}})
        data.append({"type": "scatter", "mode": "lines", "name": f"{mode} p99", "x": x,
                     "y": [r["p99_ms"] for r in points],
                     "line": {"color": mode_color(mode), "width": 1.5, "dash": "dot"}})
    return _figure(data, x=_axis("time (UTC)"), y=_axis("TTFT (ms)", rangemode="tozero"))


def ttft_cdf(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no complete requests")
    data = []
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        data.append({"type": "scatter", "mode": "lines", "name": mode, "x": [p["ttft_ms"] for p in points],
                     "y": [p["share"] * 100 for p in points], "line": {"color": mode_color(mode), "width": 2.5,
                                                                     "shape": "hv"},
                     "hovertemplate": f"{mode}: %{{y:.1f}}% of requests at or below %{{x:.1f}} ms<extra></extra>"})
    return _figure(data, x=_axis("TTFT (ms, log scale)", type="log"),
                   y=_axis("requests at or below (%)", range=[0, 101], ticksuffix="%"))


def parts_by_length(rows: Sequence[dict]) -> go.Figure | NoData:
    """Per mode (side by side), the mean parts per prompt-length bucket."""
    if not rows:
        return empty("no complete requests")
    modes = sorted({r["mode"] for r in rows})
    width = 1 / len(modes)
    data, layout, annotations = [], {}, []
    for i, mode in enumerate(modes):
        suffix = "" if i == 0 else str(i + 1)
        points = [r for r in rows if r["mode"] == mode]
        labels = [length_label(r["length_bucket"]) for r in points]
        for part, column in zip(PARTS, PART_COLUMNS):
            data.append({"type": "bar", "name": part, "x": labels, "y": [r[column] for r in points],
                         "xaxis": f"x{suffix}", "yaxis": "y", "legendgroup": part, "showlegend": i == 0,
                         "marker": {"color": CATEGORY_COLORS[part]},
                         "hovertemplate": f"{mode} %{{x}} tokens · {part}: %{{y:.1f}} ms<extra></extra>"})
        layout[f"xaxis{suffix}"] = _axis("prompt tokens", domain=[i * width + (0.03 if i else 0),
                                                                  (i + 1) * width - (0.03 if i < len(modes) - 1
                                                                                     else 0)], anchor="y")
        annotations.append({"text": f"<b>{mode}</b>", "showarrow": False, "xref": "paper", "yref": "paper",
                            "x": (i + 0.5) * width, "y": 1.0, "yanchor": "bottom"})
    first = layout.pop("xaxis")
    return _figure(data, x=first, y=_axis("mean time (ms)"), height=380, barmode="stack", annotations=annotations,
                   **layout)


def transfer_bars(rows: Sequence[dict]) -> go.Figure | NoData:
    """Per mode: NIXL's post time against its transfer time per request (µs)."""
    if not rows:
        return empty("no transfers")
    modes = [r["mode"] for r in rows]
    data = [{"type": "bar", "name": "NIXL post", "x": modes, "y": [r["post_us_per_request"] for r in rows],
             "marker": {"color": "#9ECAE9"}},
            {"type": "bar", "name": "NIXL transfer", "x": modes, "y": [r["xfer_us_per_request"] for r in rows],
             "marker": {"color": CATEGORY_COLORS["wire"]}}]
    return _figure(data, x=_axis("mode"), y=_axis("per request (µs)"), barmode="group")


# ------------------------------------------------------------------ stages


def stage_shares(rows: Sequence[dict], exact: bool = True) -> go.Figure | NoData:
    """Each stage's share of TTFT (its critical time over all TTFT), per mode; its hover holds the rest of
    the stage's row (``stage_table``): its duration p50/p99 (to two significant digits unless ``exact``),
    critical ms per request and how often it is on the path."""
    rows = [r for r in rows if r["ttft_share"]]
    if not rows:
        return empty("no stage on the critical path")
    duration = ".2f" if exact else ",.2r"  # a histogram's estimate to what its ±3.9 % supports
    data = []
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        data.append({"type": "bar", "orientation": "h", "name": mode, "marker": {"color": mode_color(mode)},
                     "y": [f"{r['side']} · {r['stage']}" for r in points], "x": [r["ttft_share"] * 100 for r in points],
                     "customdata": [[r["p50_ms"], r["p99_ms"], r["critical_per_request_ms"], (r["on_path"] or 0) * 100]
                                    for r in points],
                     "hovertemplate": f"{mode} %{{y}}: %{{x:.1f}}% of TTFT<br>"
                                      f"duration p50 %{{customdata[0]:{duration}}} ms, p99 %{{customdata[1]:{duration}}} ms"
                                      "<br>on the critical path %{customdata[2]:.2f} ms per request, "
                                      "in %{customdata[3]:.0f}% of requests<extra></extra>"})
    return _figure(data, x=_axis("share of TTFT on the critical path (%)", ticksuffix="%"),
                   y=_axis(None, autorange="reversed"), height=160 + 22 * len(rows), barmode="group")


def stage_heatmap(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no stages in this window")
    keys = sorted({(r["mode"], r["side"], r["stage"]) for r in rows}, key=lambda k: (k[0], semconv.stage_rank(k[2]), k[1]))
    times = sorted({r["period"] for r in rows})
    index = {k: i for i, k in enumerate(keys)}
    column = {t: i for i, t in enumerate(times)}
    z: list[list[float | None]] = [[None] * len(times) for _ in keys]
    for r in rows:
        z[index[(r["mode"], r["side"], r["stage"])]][column[r["period"]]] = r["mean_ms"]
    data = [{"type": "heatmap", "x": times, "y": [f"{m} · {s} · {st}" for m, s, st in keys], "z": z,
             "colorscale": "YlOrRd", "colorbar": {"title": {"text": "mean ms"}},
             "hovertemplate": "%{y}<br>%{x}: %{z:.2f} ms<extra></extra>"}]
    return _figure(data, x=_axis("time (UTC)"), y=_axis(None, autorange="reversed"), height=160 + 20 * len(keys),
                   legend=False)


# ------------------------------------------------------------------ rendezvous


def order_over_time(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no push requests")
    data = []
    for order in sorted({r["rendezvous_order"] for r in rows}):
        points = [r for r in rows if r["rendezvous_order"] == order]
        data.append({"type": "scatter", "mode": "lines", "name": order, "stackgroup": "order",
                     "x": [p["period"] for p in points], "y": [p["requests"] for p in points],
                     "line": {"color": ORDER_COLORS.get(order, "#888")}})
    return _figure(data, x=_axis("time (UTC)"), y=_axis("requests per interval"))


def order_by_pair(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no push requests")
    pairs = sorted({(r["prefill_instance"], r["decode_instance"]) for r in rows})
    labels = [f"P {short_instance(p)} → D {short_instance(d)}" for p, d in pairs]
    data = []
    for order in sorted({r["rendezvous_order"] for r in rows}):
        counts = {(r["prefill_instance"], r["decode_instance"]): r["requests"] for r in rows
                  if r["rendezvous_order"] == order}
        data.append({"type": "bar", "orientation": "h", "name": order, "y": labels,
                     "x": [counts.get(pair, 0) for pair in pairs], "marker": {"color": ORDER_COLORS.get(order, "#888")}})
    return _figure(data, x=_axis("requests"), y=_axis(None), height=140 + 40 * len(pairs), barmode="stack")


def coordination_by_order(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no complete push requests")
    orders = [r["rendezvous_order"] for r in rows]
    data = [{"type": "bar", "name": "coordination", "x": orders, "y": [r["coordination_ms"] for r in rows],
             "marker": {"color": CATEGORY_COLORS["coordination"]}},
            {"type": "bar", "name": "TTFT", "x": orders, "y": [r["ttft_ms"] for r in rows],
             "marker": {"color": "#CCCCCC"}}]
    return _figure(data, x=_axis("rendezvous order"), y=_axis("mean per request (ms)"), barmode="group")


def kv_hold(rows: Sequence[dict]) -> go.Figure | NoData:
    """Per mode: how long D held the blocks (ms) and what that is in block·seconds, side by side."""
    if not rows:
        return empty("no complete requests")
    modes = [r["mode"] for r in rows]
    colors = [mode_color(m) for m in modes]
    data = [{"type": "bar", "x": modes, "y": [r["hold_ms"] for r in rows], "marker": {"color": colors},
             "hovertemplate": "%{x}: %{y:.1f} ms<extra></extra>"},
            {"type": "bar", "x": modes, "y": [r["block_seconds_per_request"] for r in rows], "xaxis": "x2",
             "yaxis": "y2", "marker": {"color": colors}, "hovertemplate": "%{x}: %{y:.3f} block·s<extra></extra>"}]
    return _figure(data, x=_axis("mode", domain=[0, 0.45]), y=_axis("held per request (ms)"), legend=False,
                   xaxis2=_axis("mode", domain=[0.55, 1], anchor="y2"),
                   yaxis2=_axis("block·seconds per request", anchor="x2"))


# ------------------------------------------------------------------ decode


def tpot_bars(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no request with two or more output tokens")
    modes = [r["mode"] for r in rows]
    colors = [mode_color(m) for m in modes]
    data = [{"type": "bar", "name": "TPOT p50", "x": modes, "y": [r["tpot_p50_ms"] for r in rows],
             "marker": {"color": colors}},
            {"type": "bar", "name": "TPOT p90", "x": modes, "y": [r["tpot_p90_ms"] for r in rows],
             "marker": {"color": colors, "opacity": 0.45}}]
    return _figure(data, x=_axis("mode"), y=_axis("time per output token (ms)"), barmode="group")


SAMPLE_SCATTER = "scatter"
"""Sampled requests are drawn as SVG, not WebGL (``scattergl``): a sample holds at most ~350 points
(``data.SAMPLE_POINTS`` and the 50 slowest), which SVG draws before a WebGL context is even up. The Slow requests
page's first chart came 0.15–0.2 s sooner in Chromium (bench/dashboard_scale.py's store of 100k requests).
Each point costs the browser ~0.13-0.19 ms to draw warm, so the sample is no larger than a scatter needs to
show where requests fall (docs/PERFORMANCE.md)."""


def loop_vs_tpot(sample: Sequence[dict]) -> go.Figure | NoData:
    points = [r for r in sample if r.get("tpot_ms")]
    if not points:
        return empty("no request with two or more output tokens")
    data = []
    for mode in sorted({r["mode"] for r in points}):
        rows = [r for r in points if r["mode"] == mode]
        data.append({"type": SAMPLE_SCATTER, "mode": "markers", "name": mode, "x": [r["engine_loop_ms"] for r in rows],
                     "y": [r["tpot_ms"] for r in rows], "marker": {"color": mode_color(mode), "size": 6, "opacity": 0.6},
                     "hovertemplate": f"{mode}: connector %{{x:.3f}} ms on the loop, TPOT %{{y:.2f}} ms<extra></extra>"})
    return _figure(data, x=_axis("connector time on D's engine loop per request (ms)"), y=_axis("TPOT (ms)"))


# ------------------------------------------------------------------ requests


def _epoch_ms(moment) -> float:
    """A start time (UTC when naive) as Plotly's native date value: ISO strings cost the browser a parse
    per point."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp() * 1000


def slow_scatter(sample: Sequence[dict]) -> go.Figure | NoData:
    """Requests by start time and TTFT. Only the slowest carry their trace id (in the hover): they are the
    ones a user looks up, and ids on all 2,050 points of the former sample cost its first paint ~0.07 s warm."""
    if not sample:
        return empty("no requests")
    data = []
    for mode in sorted({r["mode"] for r in sample}):
        for top in (False, True):
            points = [r for r in sample if r["mode"] == mode and r["top"] == top]
            if not points:
                continue
            trace = {"marker": {"color": mode_color(mode), "size": 9, "symbol": "diamond",
                                "line": {"color": "#222", "width": 1}},
                     "customdata": [r["trace_id"] for r in points],
                     "hovertemplate": "%{x}<br>TTFT %{y:.1f} ms<br>trace %{customdata}<extra></extra>"} if top else {
                "marker": {"color": mode_color(mode), "size": 6, "opacity": 0.55},
                "hovertemplate": "%{x}<br>TTFT %{y:.1f} ms<extra></extra>"}
            data.append({"type": SAMPLE_SCATTER, "mode": "markers", "name": f"{mode} slowest" if top else f"{mode} (sample)",
                         "x": [_epoch_ms(r["started_at"]) for r in points], "y": [r["ttft_ms"] for r in points],
                         **trace})
    return _figure(data, x=_axis("request start (UTC)", type="date"), y=_axis("TTFT (ms)", rangemode="tozero"),
                   height=400, dragmode="select")


def compare_parts(rows: Sequence[dict]) -> go.Figure | NoData:
    return stacked_parts([{**r, "label": r["group"]} for r in rows], label="label")


# ------------------------------------------------------------------ one trace


_STAGE_OF_LABEL = {label: stage for stage, label in semconv.STAGE_LABELS.items()}
_PROCESS = {"router": "router", "prefill": "P", "decode": "D"}


def lane(side: str, stage: str) -> str:
    """Which process and thread a stage is drawn on (the contract's ``RECORDED_ON``; the stages the
    collector names between spans on a lane of their own)."""
    try:
        thread = semconv.RECORDED_ON[(semconv.Side(side), _STAGE_OF_LABEL[stage])]
    except (ValueError, KeyError):
        thread = "between spans" if stage in semconv.DERIVED_STAGE_LABELS else "other"
    return f"{_PROCESS.get(side, side)} · {thread}"


_TTFT_ENDS = {"router": ("the router received the request (router's clock)", "first token at the router"),
              "gateway": ("the gateway received the request (P's clock)", "D's first token"),
              "engine": ("P's API server had the request (P's clock)", "D's first token")}


def waterfall(stages: Sequence[dict], ttft_ms: float, reference: str = "router") -> go.Figure | NoData:
    """One bar per stage on its process's lane (a stage's own ``lane`` where it names one, e.g. a TP
    rank's), coloured by category, on the reference's clock (ms from arrival); the critical path is
    drawn as a dark band along the lower edge of each stage's critical part, the whole request as a thin
    bar along the top edge of its lane: neither runs through a stage's name."""
    if not stages:
        return empty("no stages recorded")
    lanes: list[str] = []
    for s in stages:
        if _lane(s) not in lanes:
            lanes.append(_lane(s))
    data = []
    across = 0.8  # a stage's bar across its lane (Plotly's own default, named: the bands below sit on its edges)
    request_band = 0.12  # the whole request's bar across its lane
    root = [s for s in stages if s["category"] == "root"]
    if root:  # the whole request, client in to last byte out: a thin bar along its lane's top edge (through the
        # middle it struck through the router's stage names, the bars being translucent off the critical path)
        data.append({"type": "bar", "orientation": "h", "name": "request", "width": request_band,
                     "offset": across / 2 - request_band,
                     "y": [_lane(s) for s in root], "x": [s["duration_ms"] for s in root],
                     "base": [s["start_ms"] for s in root], "marker": {"color": CATEGORY_COLORS["root"]},
                     "hovertemplate": "request: %{x:.2f} ms long (to the last byte)<extra></extra>"})
    for category in PARTS:
        members = [s for s in stages if s["category"] == category]
        if members:
            alphas = [_on_path(s) for s in members]
            data.append({
                "type": "bar", "orientation": "h", "name": category, "width": across,
                "y": [_lane(s) for s in members],
                "x": [max(s["duration_ms"], 0.02) for s in members], "base": [s["start_ms"] for s in members],
                # faded in its colour's alpha, from which name_color works out the names' colour too
                "marker": {"color": [_faded(CATEGORY_COLORS[category], alpha) for alpha in alphas],
                           "line": {"color": "white", "width": 1}},
                "text": [s["stage"] for s in members], "textposition": "inside", "insidetextanchor": "start",
                "insidetextfont": {"color": [name_color(CATEGORY_COLORS[category], alpha) for alpha in alphas]},
                "textangle": 0,  # level, never turned on its side: a name too long for its bar is hidden (below)
                "customdata": [[s["stage"], s["start_ms"], s["end_ms"], s["duration_ms"], s["critical_ms"],
                                s.get("hover", "")] for s in members],
                "hovertemplate": "<b>%{customdata[0]}</b> (%{y})<br>%{customdata[1]:.2f} → %{customdata[2]:.2f} ms"
                                 "<br>duration %{customdata[3]:.2f} ms, on the critical path %{customdata[4]:.2f} ms"
                                 "%{customdata[5]}<extra></extra>"})
    critical = [s for s in stages if s["critical_ms"] > 0]
    if critical:  # the critical part of a stage ends where the stage does (or at the first token)
        ends = [min(s["end_ms"], ttft_ms) for s in critical]
        # along each bar's lower edge, as an underline: through its middle it hid the stage's name
        data.append({"type": "bar", "orientation": "h", "name": "critical path", "width": 0.18, "offset": -across / 2,
                     "y": [_lane(s) for s in critical], "x": [s["critical_ms"] for s in critical],
                     "base": [end - s["critical_ms"] for s, end in zip(critical, ends)],
                     "marker": {"color": "#111111"}, "hovertemplate": "critical path: %{x:.2f} ms<extra></extra>"})
    since, end = _TTFT_ENDS.get(reference, _TTFT_ENDS["router"])
    return _figure(
        data, x=_axis(f"ms since {since}", rangemode="tozero"),
        y=_axis(None, categoryorder="array", categoryarray=list(reversed(lanes))), height=160 + 48 * len(lanes),
        barmode="overlay", uniformtext={"minsize": 9, "mode": "hide"},  # a stage's name that does not fit: none
        shapes=[{"type": "line", "x0": ttft_ms, "x1": ttft_ms, "y0": 0, "y1": 1, "yref": "paper",
                 "line": {"color": "#111", "dash": "dash", "width": 1}}],
        annotations=[{"x": ttft_ms, "y": 0, "yref": "paper", "xanchor": "left", "yanchor": "bottom", "showarrow": False,
                      "text": f"{end}: {ttft_ms:.1f} ms", "font": {"size": 11, "color": "#333"}}])


def _on_path(stage: dict) -> float:
    """A stage's opacity: full where all of it is on the critical path, faded as less of it is — a router
    leg that waits the whole TTFT for its engine, with 2 ms of its own on the path, must not read as
    coordination at a glance."""
    duration = stage["duration_ms"]
    share = min(1.0, stage["critical_ms"] / duration) if duration > 0 else 1.0
    return round(0.3 + 0.7 * share, 3)


def _faded(color: str, alpha: float) -> str:
    """``#RRGGBB`` at ``alpha`` as ``rgba()``."""
    red, green, blue = _rgb(color)
    return f"rgba({red}, {green}, {blue}, {alpha})"


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def _luminance(rgb: Sequence[float]) -> float:
    """WCAG's relative luminance of an sRGB colour (0-255 channels)."""
    linear = [c / 255 / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def name_color(color: str, alpha: float = 1.0) -> str:
    """White or black, whichever contrasts more with ``color`` (``#RRGGBB``) drawn at ``alpha`` over the white
    plot: a name written inside a bar. Plotly's own choice ignores a marker's opacity and puts white on mid
    tones (the parts' green and red) at a contrast of ~3; this one is never under WCAG's 4.5 for text."""
    luminance = _luminance([alpha * c + (1 - alpha) * 255 for c in _rgb(color)])
    return "#FFFFFF" if 1.05 / (luminance + 0.05) >= (luminance + 0.05) / 0.05 else "#000000"


def _lane(stage: dict) -> str:
    return stage.get("lane") or lane(stage["side"], stage["stage"])


# ------------------------------------------------------------------ health


MAX_INSTANCE_LINES = 8
"""A per-instance chart draws this many instances, those whose clocks stray farthest from zero; the
others are one grey band (their least to greatest), so a fleet's hundreds of processes stay
readable, and cheap to draw: one line per instance made the Health page 2-3x slower to paint."""


def _instance_lines(rows: Sequence[dict], reach, low, high) -> tuple[list[tuple[str, list[dict]]], list[dict]]:
    """(the instances to draw, each as its label and points, by name; the band of all the others, as traces).
    ``reach(point)`` ranks instances (their farthest point counts); ``low``/``high`` bound the band."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["instance"], []).append(row)
    ranked = sorted(groups, key=lambda i: max(map(reach, groups[i])), reverse=True)
    drawn = sorted(ranked[:MAX_INSTANCE_LINES])
    shorts = [short_instance(i) for i in drawn]
    labels = {i: short if shorts.count(short) == 1 else i for i, short in zip(drawn, shorts)}  # unique in the legend
    lines = [(labels[i], groups[i]) for i in drawn]
    rest = [p for instance in ranked[MAX_INSTANCE_LINES:] for p in groups[instance]]
    if not rest:
        return lines, []
    lows: dict[Any, float] = {}
    highs: dict[Any, float] = {}
    for point in rest:
        period = point["period"]
        lows[period] = min(lows.get(period, low(point)), low(point))
        highs[period] = max(highs.get(period, high(point)), high(point))
    periods = sorted(lows)
    name = f"{len(ranked) - len(drawn)} other instances (least to greatest)"
    band = [{"type": "scatter", "mode": "lines", "x": periods, "y": [lows[p] for p in periods],
             "line": {"width": 0}, "showlegend": False, "legendgroup": "others", "hoverinfo": "skip"},
            {"type": "scatter", "mode": "lines", "x": periods, "y": [highs[p] for p in periods], "name": name,
             "fill": "tonexty", "fillcolor": "rgba(150, 150, 150, 0.3)", "line": {"width": 0},
             "legendgroup": "others", "hovertemplate": f"%{{x}}<br>{name}: up to %{{y:.3f}} ms<extra></extra>"}]
    return lines, band


def _with_legend_rows(entries: int) -> int:
    """A figure's height that keeps its plot full size above a legend of ``entries`` instances: in half
    a page's width each long instance name takes a row of the legend, which Plotly otherwise takes from the plot."""
    return 340 + 20 * max(0, entries - 2)


def clock_offsets(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no clock offsets recorded")
    lines, band = _instance_lines(rows, lambda p: max(abs(p["min_ms"]), abs(p["max_ms"])),
                                  lambda p: p["min_ms"], lambda p: p["max_ms"])
    data = band
    for label, points in lines:
        data.append({"type": "scatter", "mode": "lines+markers", "name": label, "marker": {"size": 4},
                     "x": [p["period"] for p in points], "y": [p["offset_ms"] for p in points],
                     "error_y": {"type": "data", "symmetric": False, "thickness": 1,
                                 "array": [p["max_ms"] - p["offset_ms"] for p in points],
                                 "arrayminus": [p["offset_ms"] - p["min_ms"] for p in points]}})
    return _figure(data, x=_axis("time (UTC)"), y=_axis("offset applied (ms; bars: min to max)"),
                   height=_with_legend_rows(len(lines) + bool(band)))


def measured_clocks(rows: Sequence[dict]) -> go.Figure | NoData:
    """Each process's clock offset to the collector as measured by the clock exchange, with its bound."""
    if not rows:
        return empty("no clock exchanges recorded (senders behind another collector, or older kvtrace)")
    lines, band = _instance_lines(rows, lambda p: abs(p["offset_ms"]) + p["bound_ms"],
                                  lambda p: p["offset_ms"] - p["bound_ms"], lambda p: p["offset_ms"] + p["bound_ms"])
    data = band
    for label, points in lines:
        data.append({"type": "scatter", "mode": "lines+markers", "name": label, "marker": {"size": 4},
                     "x": [p["period"] for p in points], "y": [p["offset_ms"] for p in points],
                     "error_y": {"type": "data", "array": [p["bound_ms"] for p in points], "thickness": 1},
                     "hovertemplate": "%{x}<br>collector − process: %{y:.3f} ms ± %{error_y.array:.3f}<extra></extra>"})
    return _figure(data, x=_axis("time (UTC)"), y=_axis("collector clock − process clock (ms; bars: error bound)"),
                   height=_with_legend_rows(len(lines) + bool(band)))


def unattributed_share(rows: Sequence[dict]) -> go.Figure | NoData:
    if not rows:
        return empty("no complete requests")
    data = []
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        data.append({"type": "scatter", "mode": "lines+markers", "name": mode, "marker": {"size": 4},
                     "line": {"color": mode_color(mode)}, "x": [p["period"] for p in points],
                     "y": [p["share"] * 100 for p in points]})
    return _figure(data, x=_axis("time (UTC)"), y=_axis("unattributed share of TTFT (%)", ticksuffix="%",
                                                        rangemode="tozero"))


def collector_counters(rows: Sequence[dict], columns: Sequence[str], title: str) -> go.Figure | NoData:
    if not rows:
        return empty("no collector health recorded in this window")
    data = [{"type": "scatter", "mode": "lines", "name": column.replace("_", " "),
             "x": [r["recorded_at"] for r in rows], "y": [r[column] for r in rows]} for column in columns]
    return _figure(data, x=_axis("time (UTC)"), y=_axis(title, rangemode="tozero"))


def per_collector(rows: Sequence[dict], column: str, title: str) -> go.Figure:
    """One line per collector (``collector_run_id``) of one of its health counters over time."""
    runs: dict[str, list[dict]] = {}
    for r in rows:
        runs.setdefault(r["collector_run_id"], []).append(r)
    data = [{"type": "scatter", "mode": "lines", "line": {"shape": "hv"}, "name": run,
             "x": [r["recorded_at"] for r in runs_rows], "y": [r[column] for r in runs_rows]}
            for run, runs_rows in runs.items()]
    return _figure(data, x=_axis("time (UTC)"), y=_axis(title, rangemode="tozero"))


def short_instance(instance: str) -> str:
    """An instance id as a label: host:pid:random -> host:pid."""
    parts = instance.split(":")
    return ":".join(parts[:2]) if len(parts) >= 3 else instance


# --------------------------------------------------------------------------------------
# Sweep runs (reader.compare_runs): the Runs page and `kvtrace compare --out`
# --------------------------------------------------------------------------------------


def _run_name(result: dict, run: str) -> str:
    return f"{result['records'][run].get('mode', '?')} · {run}"


def run_ttft(result: dict, run_a: str, run_b: str) -> go.Figure:
    """Client TTFT p50 and p90 per point for both runs, with the trace-derived p50 beside them."""
    labels = [point_label(*p) for p in result["points"]]
    data = []
    for run, dash in ((run_a, "solid"), (run_b, "dot")):
        stats, color = result["stats"][run], mode_color(result["records"][run].get("mode", ""))
        for index, q in ((0, "p50"), (1, "p90")):
            data.append({"type": "scatter", "mode": "lines+markers", "x": labels, "name": f"{_run_name(result, run)} client {q}",
                         "y": [stats[p].client_ttft[index] if p in stats else None for p in result["points"]],
                         "line": {"color": color, "dash": dash, "width": 3 if index == 0 else 1.5}})
        data.append({"type": "scatter", "mode": "markers", "x": labels, "name": f"{_run_name(result, run)} trace p50",
                     "y": [stats[p].trace_ttft[0] if p in stats else None for p in result["points"]],
                     "marker": {"color": color, "symbol": "x", "size": 10}})
    return _figure(data, x=_axis("point (prompt tokens @ arrival rate)"), y=_axis("TTFT (ms)", rangemode="tozero"),
                   height=460, title={"text": "TTFT per point: client p50 / p90 and trace p50", "y": 0.97},
                   margin=_TITLED)


def run_breakdown(result: dict, run_a: str, run_b: str) -> go.Figure:
    """The mean breakdown per point, the two runs' bars side by side (A left, B right of each point)."""
    x = [[point_label(*p) for p in result["points"] for _ in (0, 1)],
         [result["records"][run].get("mode", run) for _ in result["points"] for run in (run_a, run_b)]]
    data = []
    for part in PARTS:
        y = [result["stats"][run][p].parts[part] if p in result["stats"][run] else None
             for p in result["points"] for run in (run_a, run_b)]
        data.append({"type": "bar", "x": x, "y": y, "name": part, "marker": {"color": CATEGORY_COLORS[part]}})
    return _figure(data, x=_axis(None), y=_axis("mean per request (ms)"), height=460, barmode="stack",
                   title={"text": "Where TTFT went, per point and mode (mean per request)", "y": 0.97}, margin=_TITLED)


_TITLED = {"l": 10, "r": 10, "t": 110, "b": 10}  # room for a title above a legend of many entries
