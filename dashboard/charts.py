"""Plotly figure builders: plain functions from the reader's answers to figures.

One colour per category and per mode on every page (:data:`CATEGORY_COLORS`,
:data:`MODE_COLORS`), units on every axis, and the category order of the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvtrace.collectors.reader import PART_COLUMNS, PARTS, length_label
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
_FONT = dict(family="Inter, Segoe UI, Helvetica, Arial, sans-serif", size=13)


def _layout(fig: go.Figure, *, height: int = 340, legend: bool = True, **kwargs: Any) -> go.Figure:
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=40, b=10), font=_FONT, template="plotly_white",
                      showlegend=legend, legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0, title=None,
                                                     traceorder="normal"),
                      **kwargs)
    return fig


def mode_color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#888888")


def empty(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=14, color="#777"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, height=200, legend=False)


# ------------------------------------------------------------------ parts of TTFT


def stacked_parts(rows: Sequence[dict], label: str = "mode", *, share: bool = False, title: str = "") -> go.Figure:
    """Horizontal stacked bars of the five parts, one bar per row (its ``label`` names it): mean
    ms, or each part's share of the mean TTFT (%)."""
    if not rows:
        return empty("no complete requests")
    names = [str(r[label]) for r in rows]
    fig = go.Figure()
    for part, column in zip(PARTS, PART_COLUMNS):
        values = [(r[column] / r["ttft_ms"] * 100 if r["ttft_ms"] else 0) if share else r[column] for r in rows]
        fig.add_bar(y=names, x=values, name=part, orientation="h", marker_color=CATEGORY_COLORS[part],
                    customdata=[[r[column], r["ttft_ms"], r.get("requests", 0)] for r in rows],
                    hovertemplate=f"<b>%{{y}}</b> {part}: %{{customdata[0]:.1f}} ms of %{{customdata[1]:.1f}} ms"
                                  f" TTFT (%{{customdata[2]}} requests)<extra></extra>")
    fig.update_layout(barmode="stack", title=title)
    fig.update_xaxes(title_text="share of TTFT (%)" if share else "mean time (ms)",
                     range=[0, 100] if share else None, ticksuffix="%" if share else "")
    fig.update_yaxes(title_text=None, autorange="reversed")
    return _layout(fig, height=120 + 45 * len(rows))


def cohort_rows(cohorts: Sequence[dict]) -> list[dict]:
    """Cohort rows labelled for :func:`stacked_parts` ("push · p50", "push · slowest 1 %")."""
    out = []
    for row in cohorts:
        name = "median" if row["cohort"] == "p50" else f"slowest {100 - int(row['cohort'][1:])} %"
        out.append({**row, "label": f"{row['mode']} · {name}"})
    return out


def parts_side_by_side(rows: Sequence[dict]) -> go.Figure:
    """Each part's mean per mode, grouped by part; the hover says the difference."""
    if not rows:
        return empty("no complete requests")
    fig = go.Figure()
    for row in rows:
        fig.add_bar(x=list(PARTS), y=[row[c] for c in PART_COLUMNS], name=row["mode"],
                    marker_color=mode_color(row["mode"]),
                    hovertemplate=f"{row['mode']} %{{x}}: %{{y:.2f}} ms<extra></extra>")
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="mean time per request (ms)")
    fig.update_xaxes(title_text="part of TTFT")
    return _layout(fig)


def ttft_over_time(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no complete requests in this window")
    fig = go.Figure()
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        x = [r["period"] for r in points]
        fig.add_scatter(x=x, y=[r["p50_ms"] for r in points], name=f"{mode} p50", mode="lines+markers",
                        line=dict(color=mode_color(mode), width=2), marker=dict(size=4))
        fig.add_scatter(x=x, y=[r["p99_ms"] for r in points], name=f"{mode} p99", mode="lines",
                        line=dict(color=mode_color(mode), width=1.5, dash="dot"))
    fig.update_yaxes(title_text="TTFT (ms)", rangemode="tozero")
    fig.update_xaxes(title_text="time (UTC)")
    return _layout(fig)


def ttft_cdf(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no complete requests")
    fig = go.Figure()
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        fig.add_scatter(x=[p["ttft_ms"] for p in points], y=[p["share"] * 100 for p in points], name=mode,
                        mode="lines", line=dict(color=mode_color(mode), width=2.5, shape="hv"),
                        hovertemplate=f"{mode}: %{{y:.1f}}% of requests at or below %{{x:.1f}} ms<extra></extra>")
    fig.update_xaxes(title_text="TTFT (ms, log scale)", type="log")
    fig.update_yaxes(title_text="requests at or below (%)", range=[0, 101], ticksuffix="%")
    return _layout(fig)


def parts_by_length(rows: Sequence[dict]) -> go.Figure:
    """Per mode (side by side), the mean parts per prompt-length bucket."""
    if not rows:
        return empty("no complete requests")
    modes = sorted({r["mode"] for r in rows})
    fig = make_subplots(rows=1, cols=len(modes), shared_yaxes=True, subplot_titles=modes, horizontal_spacing=0.04)
    for col, mode in enumerate(modes, start=1):
        points = [r for r in rows if r["mode"] == mode]
        labels = [length_label(r["length_bucket"]) for r in points]
        for part, column in zip(PARTS, PART_COLUMNS):
            fig.add_bar(x=labels, y=[r[column] for r in points], name=part, marker_color=CATEGORY_COLORS[part],
                        legendgroup=part, showlegend=col == 1,
                        hovertemplate=f"{mode} %{{x}} tokens · {part}: %{{y:.1f}} ms<extra></extra>",
                        row=1, col=col)
        fig.update_xaxes(title_text="prompt tokens", row=1, col=col)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="mean time (ms)", row=1, col=1)
    return _layout(fig, height=380)


def transfer_bars(rows: Sequence[dict]) -> go.Figure:
    """Per mode: NIXL's post time against its transfer time per request (µs)."""
    if not rows:
        return empty("no transfers")
    fig = go.Figure()
    modes = [r["mode"] for r in rows]
    fig.add_bar(x=modes, y=[r["post_us_per_request"] for r in rows], name="NIXL post", marker_color="#9ecae9")
    fig.add_bar(x=modes, y=[r["xfer_us_per_request"] for r in rows], name="NIXL transfer",
                marker_color=CATEGORY_COLORS["wire"])
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="per request (µs)")
    fig.update_xaxes(title_text="mode")
    return _layout(fig)


# ------------------------------------------------------------------ stages


def stage_shares(rows: Sequence[dict]) -> go.Figure:
    """Each stage's share of TTFT (its critical time over all TTFT), per mode."""
    rows = [r for r in rows if r["ttft_share"]]
    if not rows:
        return empty("no stage on the critical path")
    fig = go.Figure()
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        fig.add_bar(y=[f"{r['side']} · {r['stage']}" for r in points], x=[r["ttft_share"] * 100 for r in points],
                    name=mode, orientation="h", marker_color=mode_color(mode),
                    hovertemplate=f"{mode} %{{y}}: %{{x:.1f}}% of TTFT<extra></extra>")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="share of TTFT on the critical path (%)", ticksuffix="%")
    fig.update_yaxes(autorange="reversed", title_text=None)
    return _layout(fig, height=160 + 22 * len(rows))


def stage_heatmap(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no stages in this window")
    keys = sorted({(r["mode"], r["side"], r["stage"]) for r in rows},
                  key=lambda k: (k[0], _stage_rank(k[2]), k[1]))
    times = sorted({r["period"] for r in rows})
    index = {k: i for i, k in enumerate(keys)}
    column = {t: i for i, t in enumerate(times)}
    z: list[list[float | None]] = [[None] * len(times) for _ in keys]
    for r in rows:
        z[index[(r["mode"], r["side"], r["stage"])]][column[r["period"]]] = r["mean_ms"]
    fig = go.Figure(go.Heatmap(x=times, y=[f"{m} · {s} · {st}" for m, s, st in keys], z=z, colorscale="YlOrRd",
                               colorbar=dict(title=dict(text="mean ms")),
                               hovertemplate="%{y}<br>%{x}: %{z:.2f} ms<extra></extra>"))
    fig.update_xaxes(title_text="time (UTC)")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, height=160 + 20 * len(keys), legend=False)


def _stage_rank(stage: str) -> int:
    return next((int(s) for s, label in semconv.STAGE_LABELS.items() if label == stage), 99)


# ------------------------------------------------------------------ rendezvous


def order_over_time(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no push requests")
    fig = go.Figure()
    for order in sorted({r["rendezvous_order"] for r in rows}):
        points = [r for r in rows if r["rendezvous_order"] == order]
        fig.add_scatter(x=[p["period"] for p in points], y=[p["requests"] for p in points], name=order,
                        stackgroup="order", mode="lines", line=dict(color=ORDER_COLORS.get(order, "#888")))
    fig.update_yaxes(title_text="requests per interval")
    fig.update_xaxes(title_text="time (UTC)")
    return _layout(fig)


def order_by_pair(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no push requests")
    pairs = sorted({(r["prefill_instance"], r["decode_instance"]) for r in rows})
    labels = [f"P {_short(p)} → D {_short(d)}" for p, d in pairs]
    fig = go.Figure()
    for order in sorted({r["rendezvous_order"] for r in rows}):
        counts = {(r["prefill_instance"], r["decode_instance"]): r["requests"] for r in rows
                  if r["rendezvous_order"] == order}
        fig.add_bar(y=labels, x=[counts.get(pair, 0) for pair in pairs], name=order, orientation="h",
                    marker_color=ORDER_COLORS.get(order, "#888"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="requests")
    return _layout(fig, height=140 + 40 * len(pairs))


def coordination_by_order(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no complete push requests")
    fig = go.Figure()
    orders = [r["rendezvous_order"] for r in rows]
    fig.add_bar(x=orders, y=[r["coordination_ms"] for r in rows], name="coordination",
                marker_color=CATEGORY_COLORS["coordination"])
    fig.add_bar(x=orders, y=[r["ttft_ms"] for r in rows], name="TTFT", marker_color="#cccccc")
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="mean per request (ms)")
    fig.update_xaxes(title_text="rendezvous order")
    return _layout(fig)


def kv_hold(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no complete requests")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("held per request (ms)", "block·seconds per request"))
    modes = [r["mode"] for r in rows]
    colors = [mode_color(m) for m in modes]
    fig.add_bar(x=modes, y=[r["hold_ms"] for r in rows], marker_color=colors, row=1, col=1,
                hovertemplate="%{x}: %{y:.1f} ms<extra></extra>")
    fig.add_bar(x=modes, y=[r["block_seconds_per_request"] for r in rows], marker_color=colors, row=1, col=2,
                hovertemplate="%{x}: %{y:.3f} block·s<extra></extra>")
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="block·s", row=1, col=2)
    return _layout(fig, legend=False)


# ------------------------------------------------------------------ decode


def tpot_bars(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no request with two or more output tokens")
    fig = go.Figure()
    modes = [r["mode"] for r in rows]
    fig.add_bar(x=modes, y=[r["tpot_p50_ms"] for r in rows], name="TPOT p50", marker_color=[mode_color(m) for m in modes])
    fig.add_bar(x=modes, y=[r["tpot_p90_ms"] for r in rows], name="TPOT p90",
                marker=dict(color=[mode_color(m) for m in modes], opacity=0.45))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="time per output token (ms)")
    fig.update_xaxes(title_text="mode")
    return _layout(fig)


def loop_vs_tpot(sample: Sequence[dict]) -> go.Figure:
    points = [r for r in sample if r.get("tpot_ms")]
    if not points:
        return empty("no request with two or more output tokens")
    fig = go.Figure()
    for mode in sorted({r["mode"] for r in points}):
        rows = [r for r in points if r["mode"] == mode]
        fig.add_scattergl(x=[r["engine_loop_ms"] for r in rows], y=[r["tpot_ms"] for r in rows], name=mode,
                          mode="markers", marker=dict(color=mode_color(mode), size=6, opacity=0.6),
                          hovertemplate=f"{mode}: connector %{{x:.3f}} ms on the loop, TPOT %{{y:.2f}} ms"
                                        f"<extra></extra>")
    fig.update_xaxes(title_text="connector time on D's engine loop per request (ms)")
    fig.update_yaxes(title_text="TPOT (ms)")
    return _layout(fig)


# ------------------------------------------------------------------ requests


def slow_scatter(sample: Sequence[dict]) -> go.Figure:
    if not sample:
        return empty("no requests")
    fig = go.Figure()
    for mode in sorted({r["mode"] for r in sample}):
        rows = [r for r in sample if r["mode"] == mode and not r["top"]]
        top = [r for r in sample if r["mode"] == mode and r["top"]]
        for points, name, marker in ((rows, f"{mode} (sample)", dict(color=mode_color(mode), size=6, opacity=0.55)),
                                     (top, f"{mode} slowest", dict(color=mode_color(mode), size=9, symbol="diamond",
                                                                   line=dict(color="#222", width=1)))):
            if points:
                fig.add_scattergl(x=[r["started_at"] for r in points], y=[r["ttft_ms"] for r in points], name=name,
                                  mode="markers", marker=marker, customdata=[[r["trace_id"]] for r in points],
                                  hovertemplate="%{x}<br>TTFT %{y:.1f} ms<br>trace %{customdata[0]}<extra></extra>")
    fig.update_xaxes(title_text="request start (UTC)")
    fig.update_yaxes(title_text="TTFT (ms)", rangemode="tozero")
    fig.update_layout(dragmode="select")
    return _layout(fig, height=400)


def compare_parts(rows: Sequence[dict]) -> go.Figure:
    return stacked_parts([{**r, "label": r["group"]} for r in rows], label="label")


# ------------------------------------------------------------------ one trace


def lane(side: str, stage: str) -> str:
    """Which process and thread a stage is drawn on (the contract's RECORDED_ON)."""
    try:
        thread = semconv.RECORDED_ON[(semconv.Side(side), next(s for s, l in semconv.STAGE_LABELS.items() if l == stage))]
    except (ValueError, StopIteration, KeyError):
        thread = "other"
    process = {"router": "router", "prefill": "P", "decode": "D"}.get(side, side)
    return f"{process} · {thread}"


def waterfall(stages: Sequence[dict], ttft_ms: float) -> go.Figure:
    """One bar per stage on its process's lane, coloured by category, on the router's clock (ms from
    arrival); the critical path is drawn as a dark band over each stage's critical part."""
    if not stages:
        return empty("no stages recorded")
    lanes = []
    for s in stages:
        name = lane(s["side"], s["stage"])
        if name not in lanes:
            lanes.append(name)
    fig = go.Figure()
    root = [s for s in stages if s["category"] == "root"]
    if root:  # the whole request, client in to last byte out: a thin bar behind its lane
        fig.add_bar(y=[lane(s["side"], s["stage"]) for s in root], x=[s["duration_ms"] for s in root],
                    base=[s["start_ms"] for s in root], orientation="h", name="request", width=0.12,
                    marker=dict(color=CATEGORY_COLORS["root"]),
                    hovertemplate="request: %{base:.2f} → %{x:.2f} ms long (to the last byte)<extra></extra>")
    for category in PARTS:
        members = [s for s in stages if s["category"] == category]
        if not members:
            continue
        fig.add_bar(y=[lane(s["side"], s["stage"]) for s in members], x=[max(s["duration_ms"], 0.02) for s in members],
                    base=[s["start_ms"] for s in members], orientation="h", name=category,
                    marker=dict(color=CATEGORY_COLORS[category], line=dict(color="white", width=1)),
                    text=[s["stage"] for s in members], textposition="inside", insidetextanchor="start",
                    customdata=[[s["stage"], s["start_ms"], s["end_ms"], s["duration_ms"], s["critical_ms"],
                                 s.get("hover", "")] for s in members],
                    hovertemplate="<b>%{customdata[0]}</b> (%{y})<br>%{customdata[1]:.2f} → %{customdata[2]:.2f} ms"
                                  "<br>duration %{customdata[3]:.2f} ms, on the critical path "
                                  "%{customdata[4]:.2f} ms%{customdata[5]}<extra></extra>")
    critical = [s for s in stages if s["critical_ms"] > 0]
    if critical:
        ends = [min(s["end_ms"], ttft_ms) for s in critical]
        fig.add_bar(y=[lane(s["side"], s["stage"]) for s in critical], x=[s["critical_ms"] for s in critical],
                    base=[end - s["critical_ms"] for s, end in zip(critical, ends)], orientation="h",
                    name="critical path", width=0.18, marker=dict(color="#111111"),
                    hovertemplate="critical path: %{x:.2f} ms<extra></extra>")
    fig.add_vline(x=ttft_ms, line=dict(color="#111", dash="dash", width=1),
                  annotation_text=f"first token at the router: {ttft_ms:.1f} ms", annotation_position="bottom right",
                  annotation_font=dict(size=11, color="#333"))
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title_text="ms since the router received the request (router's clock)", rangemode="tozero")
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), title_text=None)
    return _layout(fig, height=160 + 48 * len(lanes))


# ------------------------------------------------------------------ health


def clock_offsets(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no clock offsets recorded")
    fig = go.Figure()
    for instance in sorted({r["instance"] for r in rows}):
        points = [r for r in rows if r["instance"] == instance]
        fig.add_scatter(x=[p["period"] for p in points], y=[p["offset_ms"] for p in points], name=_short(instance),
                        mode="lines+markers", marker=dict(size=4),
                        error_y=dict(type="data", symmetric=False,
                                     array=[p["max_ms"] - p["offset_ms"] for p in points],
                                     arrayminus=[p["offset_ms"] - p["min_ms"] for p in points], thickness=1))
    fig.update_yaxes(title_text="offset applied (ms; bars: min to max)")
    fig.update_xaxes(title_text="time (UTC)")
    return _layout(fig)


def unattributed_share(rows: Sequence[dict]) -> go.Figure:
    if not rows:
        return empty("no complete requests")
    fig = go.Figure()
    for mode in sorted({r["mode"] for r in rows}):
        points = [r for r in rows if r["mode"] == mode]
        fig.add_scatter(x=[p["period"] for p in points], y=[p["share"] * 100 for p in points], name=mode,
                        mode="lines+markers", line=dict(color=mode_color(mode)), marker=dict(size=4))
    fig.update_yaxes(title_text="unattributed share of TTFT (%)", ticksuffix="%", rangemode="tozero")
    fig.update_xaxes(title_text="time (UTC)")
    return _layout(fig)


def collector_counters(rows: Sequence[dict], columns: Sequence[str], title: str) -> go.Figure:
    if not rows:
        return empty("no collector health recorded in this window")
    fig = go.Figure()
    for column in columns:
        fig.add_scatter(x=[r["recorded_at"] for r in rows], y=[r[column] for r in rows], name=column.replace("_", " "),
                        mode="lines")
    fig.update_yaxes(title_text=title, rangemode="tozero")
    fig.update_xaxes(title_text="time (UTC)")
    return _layout(fig)


def _short(instance: str) -> str:
    """An instance id as a label: host:pid:random -> host:pid."""
    parts = instance.split(":")
    return ":".join(parts[:2]) if len(parts) >= 3 else instance
