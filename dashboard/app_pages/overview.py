"""Overview — where does TTFT go?"""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Where does time to first token go?",
                     "Every request's TTFT split along its critical path into compute, queue, coordination, wire "
                     "and unattributed time. The parts of each request add up to its TTFT exactly.")


@st.fragment(run_every=data.settings().refresh_s)
def kpi_strip() -> None:
    live = ui.current_filters(ui.store_options())  # a relative window follows the newest data
    k = data.kpis(live)
    cols = st.columns(7)
    cols[0].metric("Requests", ui.count(k["requests"]))
    cols[1].metric("TTFT p50", ui.ms(k["ttft_p50_ms"]))
    cols[2].metric("TTFT p90", ui.ms(k["ttft_p90_ms"]))
    cols[3].metric("TTFT p99", ui.ms(k["ttft_p99_ms"]))
    cols[4].metric("Coordination share", ui.pct(k["coordination_share"]),
                   help="Coordination's part of all TTFT in the window (complete traces).")
    cols[5].metric("Incomplete traces", ui.count(k["incomplete"]), help="Traces missing a stage; see Health.")
    cols[6].metric("Failed", ui.count(k["failed"]), help="Traces with a stage that ended in error.")
    st.caption(f"{ui.window_caption(live, ui.store_options())} · live, every {data.settings().refresh_s:g} s · "
               "percentiles from log-bucketed histograms (±4 %)")


kpi_strip()

by_mode = data.parts_by_mode(f).to_pylist()
left, right = st.columns(2)
with left:
    st.subheader("Share of TTFT, by mode")
    st.plotly_chart(charts.stacked_parts(by_mode, share=True), key="share_by_mode")
with right:
    st.subheader("Mean TTFT and its parts, by mode")
    st.plotly_chart(charts.stacked_parts(by_mode), key="ms_by_mode")

st.subheader("A typical request against the slowest 1 %")
st.caption("Mean parts of the requests around the median TTFT and of those above the 99th percentile: "
           "what the tail spends its extra time on.")
cohorts = charts.cohort_rows(data.cohorts(f))
st.plotly_chart(charts.stacked_parts(cohorts, label="label"), key="cohorts")

st.subheader("TTFT over time")
st.plotly_chart(charts.ttft_over_time(data.ttft_over_time(f)), key="ttft_time")
