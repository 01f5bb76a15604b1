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
    rough = not k["quantiles_exact"]  # a histogram's estimate: shown to the digits its ±3.9 % supports
    # two rows of four: seven KPIs in one row are cut off in a laptop's window
    ui.kpis([*(ui.Kpi(f"TTFT {q}", ui.ms_short(k[f"ttft_{q}_ms"], rough),
                      help=f"{'≈ ' if rough else ''}{ui.ms(k[f'ttft_{q}_ms'])}") for q in ("p50", "p90", "p99")),
             ui.Kpi("Coordination", ui.pct(k["coordination_share"]),
                    help="Coordination's share of all TTFT in the window (complete traces)."),
             ui.Kpi("Requests", ui.count(k["requests"])),
             ui.Kpi("Incomplete", ui.count(k["incomplete"]), help="Traces missing a stage; see Health."),
             ui.Kpi("Failed", ui.count(k["failed"]), help="Traces with a stage that ended in error.")])
    st.caption(f"{ui.window_caption(live, ui.store_options())} · live, every {data.settings().refresh_s:g} s · "
               + ui.percentiles_note(k["quantiles_exact"]))


kpi_strip()

by_mode = data.parts_by_mode(f).to_pylist()
st.subheader("Mean TTFT and its parts, by mode")
# One chart for "how long" and "what share" (each part's share inside its bar): a second chart of the same
# bars in % cost the page's first paint a chart (docs/PERFORMANCE.md).
ui.chart(charts.stacked_parts(by_mode, share_labels=True), key="parts_by_mode")


def cohorts() -> None:
    st.caption("Mean parts of the requests around the median TTFT and of those above the 99th percentile: "
               "what the tail spends its extra time on.")
    ui.chart(charts.stacked_parts(charts.cohort_rows(data.cohorts(f)), label="label"), key="cohorts")


def over_time() -> None:
    ui.chart(charts.ttft_over_time(data.ttft_over_time(f)), key="ttft_time")


ui.lazy_sections("overview_more", {"A typical request against the slowest 1 %": cohorts, "TTFT over time": over_time})
