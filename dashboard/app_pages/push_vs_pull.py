"""Push vs pull: who wins, and which part of TTFT makes the difference."""

import dataclasses

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Push vs pull",
                     "Push binds decode early and writes the KV cache from prefill; pull reads it after prefill. "
                     "Same workload, two answers: which part of TTFT differs?")

by_mode = data.parts_by_mode(f).to_pylist()
st.subheader("Parts of TTFT, side by side")
ui.chart(charts.parts_side_by_side(by_mode), key="side_by_side")
modes = {row["mode"]: row for row in by_mode}
if {"push", "pull"} <= modes.keys():
    # The page's answer in one line, largest difference first, rather than a table of the same numbers to
    # read through; each mode's values are on the bars above.
    st.markdown(ui.difference_line(modes["push"], modes["pull"]))
else:
    st.caption("Only one mode in this selection: run the other one (or widen the filters) to compare.")
# Each mode's percentiles as text; their whole distribution (a CDF) waits under an expander: a second chart
# in view cost this page's first paint ~0.19 s warm (bench/dashboard_ab.py, docs/PERFORMANCE.md).
answers = {mode: data.kpis(dataclasses.replace(f, modes=(mode,))) for mode in sorted(modes)}
exact = all(k["quantiles_exact"] for k in answers.values())
if answers:
    st.caption("TTFT p50 / p90 / p99: " + " · ".join(
        f"{mode} " + " / ".join(ui.ms_short(k[f"ttft_{q}_ms"], not exact) for q in ("p50", "p90", "p99"))
        for mode, k in answers.items()) + f" ({ui.percentiles_note(exact)}).")


def distribution() -> None:
    ui.chart(charts.ttft_cdf(data.ttft_cdf(f)), key="cdf")


def by_length() -> None:
    ui.chart(charts.parts_by_length(data.parts_by_length(f).to_pylist()), key="by_length")


def transfer() -> None:
    transfers = data.transfers(f).to_pylist()
    left, right = st.columns([2, 3])
    with left:
        st.dataframe([{"mode": t["mode"], "requests": t["requests"], "MB/s (NIXL)": t["mb_per_s"],
                       "MB per request": t["mb_per_request"], "descriptors": t["descriptors_per_request"],
                       "post µs": t["post_us_per_request"], "transfer µs": t["xfer_us_per_request"]} for t in transfers],
                     hide_index=True, column_config={k: st.column_config.NumberColumn(format="%.1f") for k in (
                         "MB/s (NIXL)", "MB per request", "descriptors", "post µs", "transfer µs")})
        st.caption("MB/s is bytes over NIXL's own transfer time; post is NIXL's time to hand the request over. "
                   "Per request: means over the selection.")
    with right:
        ui.chart(charts.transfer_bars(transfers), key="transfers")


ui.lazy_sections("push_vs_pull_more", {"TTFT distribution": distribution, "By prompt length": by_length,
                                       "The transfer itself": transfer})
