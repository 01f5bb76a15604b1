"""Stages: how long each takes, and how much of it is on the critical path."""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Stages",
                     "Each stage's duration and the part of it on the critical path. A long stage off the path "
                     "costs nothing; a short one on it costs every request.")

rows = data.stage_table(f)
st.dataframe(
    [{"mode": r["mode"], "side": r["side"], "stage": r["stage"], "category": r["category"], "spans": r["spans"],
      "p50 (ms)": r["p50_ms"], "p99 (ms)": r["p99_ms"], "on the critical path (ms/request)": r["critical_per_request_ms"],
      "on the path (% of requests)": (r["on_path"] or 0) * 100, "share of TTFT (%)": (r["ttft_share"] or 0) * 100}
     for r in rows],
    hide_index=True, height=min(700, 38 + 35 * len(rows)),
    column_config={
        "p50 (ms)": st.column_config.NumberColumn(format="%.2f"),
        "p99 (ms)": st.column_config.NumberColumn(format="%.2f"),
        "on the critical path (ms/request)": st.column_config.NumberColumn(format="%.2f"),
        "on the path (% of requests)": st.column_config.ProgressColumn(format="%.0f%%", min_value=0, max_value=100),
        "share of TTFT (%)": st.column_config.ProgressColumn(format="%.1f%%", min_value=0, max_value=100),
    })
st.caption("Durations are percentiles from log-bucketed histograms (±4 %); critical time and shares are exact sums.")

st.subheader("Share of TTFT per stage")
ui.chart(charts.stage_shares(rows), key="shares")

ui.lazy_sections("stages_more", {
    "Stage × time": lambda: ui.chart(charts.stage_heatmap(data.stage_heatmap(f).to_pylist()), key="heatmap")})
