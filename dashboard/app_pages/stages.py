"""Stages: how long each takes, and how much of it is on the critical path."""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Stages",
                     "Each stage's duration and the part of it on the critical path. A long stage off the path "
                     "costs nothing; a short one on it costs every request.")

rows = data.stage_table(f)
exact = all(r["quantiles_exact"] for r in rows)
st.subheader("Share of TTFT per stage")
ui.chart(charts.stage_shares(rows, exact), key="shares")
st.caption(f"A bar's hover holds its stage's duration and time on the path; every stage, on the path or not, is in "
           f"the table below. Durations: {ui.percentiles_note(exact)}; critical time and shares are exact sums.")


def table() -> None:
    # Behind an expander: a table's grid is the costliest element of a first paint (~0.15 s warm in
    # Chromium beside the bare page, docs/PERFORMANCE.md); the chart answers the page's question.
    st.dataframe(
        [{"mode": r["mode"], "side": r["side"], "stage": r["stage"], "category": r["category"], "spans": r["spans"],
          "p50 (ms)": ui.rough(r["p50_ms"], exact), "p99 (ms)": ui.rough(r["p99_ms"], exact),
          "on the critical path (ms/request)": r["critical_per_request_ms"],
          "on the path (% of requests)": (r["on_path"] or 0) * 100, "share of TTFT (%)": (r["ttft_share"] or 0) * 100}
         for r in rows],
        hide_index=True, height=min(700, 38 + 35 * len(rows)),
        column_config={
            # an estimate's two digits as they are (43, 0.22, 1,200), not padded to look measured
            "p50 (ms)": st.column_config.NumberColumn(format="%.2f" if exact else "localized"),
            "p99 (ms)": st.column_config.NumberColumn(format="%.2f" if exact else "localized"),
            "on the critical path (ms/request)": st.column_config.NumberColumn(format="%.2f"),
            "on the path (% of requests)": st.column_config.ProgressColumn(format="%.0f%%", min_value=0,
                                                                           max_value=100),
            "share of TTFT (%)": st.column_config.ProgressColumn(format="%.1f%%", min_value=0, max_value=100),
        })


ui.lazy_sections("stages_more", {
    "Every stage: durations and time on the path": table,
    "Stage × time": lambda: ui.chart(charts.stage_heatmap(data.stage_heatmap(f).to_pylist()), key="heatmap")})
