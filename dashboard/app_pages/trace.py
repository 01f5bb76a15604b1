"""Trace: one request's waterfall, critical path and breakdown."""

import streamlit as st

from kvtrace.collectors.read import PART_COLUMNS, PARTS
from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Trace", "One request on the router's clock (P's, behind another router): each stage on the lane "
                     "of the process and thread "
                     "that timed it, the critical path underlined in black, and its TTFT split into parts that add up.")

slowest = data.slowest(f, 20).to_pylist()
choices = [r["trace_id"] for r in slowest]
labels = {r["trace_id"]: f"{r['trace_id']} · {r['mode']} · TTFT {r['ttft_ms']:.1f} ms" for r in slowest}
linked = st.query_params.get("trace_id", "")
trace_id = linked or (choices[0] if choices else "")
if trace_id and linked != trace_id:
    st.query_params["trace_id"] = trace_id  # the page's URL names the trace it shows
if trace_id and trace_id not in choices:
    choices.insert(0, trace_id)


def summary(t: str) -> str:
    return labels.get(t, t)


def show(key: str) -> None:
    st.query_params["trace_id"] = st.session_state[key]


# The picker waits in a popover: a select box drawn with the page delayed its warm first chart in Chromium
# (5-80 ms in four side-by-side runs, docs/PERFORMANCE.md); the popover's button names the trace.
# One widget key per trace shown, so that a deep link's trace is the one the opened list starts on.
if choices:
    with st.popover(summary(trace_id), icon=":material/swap_vert:"):
        picker = f"trace_pick:{trace_id}"
        st.selectbox("Trace (the slowest under the filters, or ?trace_id= in the URL)", choices,
                     index=choices.index(trace_id), format_func=summary, key=picker, on_change=show, args=(picker,))

found = data.trace_view(trace_id) if trace_id else None
if found is None:
    st.warning(f"No request with trace id `{trace_id}` in this store." if trace_id else "No trace selected.")
    st.stop()

request, stages, spans, ranks = found["request"], found["stages"], found["spans"], found["ranks"]
if request.get("explanation"):  # the collector's one sentence (older stores have none)
    say = st.error if request["error"] else st.warning if not request["complete"] else st.info
    say(request["explanation"], icon=":material/lightbulb:")

reference = request.get("ttft_reference") or "router"
ui.kpis([ui.Kpi(f"TTFT (from {reference})", ui.ms_short(request["ttft_ms"]),
                help=f"{ui.ms(request['ttft_ms'], 3)}: {ui.TTFT_REFERENCES.get(reference)}"),
         ui.Kpi("Mode", request["mode"]),
         ui.Kpi("Prompt tokens", ui.count(request["prompt_tokens"])),
         ui.Kpi("Rendezvous", ui.RENDEZVOUS_SHORT.get(request["rendezvous_order"], "–"),
                help=request["rendezvous_order"] and ui.RENDEZVOUS_HELP.get(request["rendezvous_order"])),
         ui.Kpi("Complete", "yes" if request["complete"] else "no", help=request["missing"] or None)], columns=5)
settings = data.settings()
if settings.apm_url:
    st.link_button("Open in your APM", settings.apm_url.replace("{trace_id}", trace_id), icon=":material/open_in_new:")

ui.chart(charts.waterfall(stages + ranks, request["ttft_ms"], reference), key="waterfall")
offsets = request["clock_offsets"]
st.caption(f"Clock offsets applied to put every process on {'the router' if reference == 'router' else 'P'}'s clock: " + (
    ", ".join(f"{charts.short_instance(instance)} {offset / 1e6:+.3f} ms" for instance, offset in sorted(offsets.items()))
    or "none") + ".")



def breakdown() -> None:
    table = [{"part": part, "ms": request[column], "share": request[column] / request["ttft_ms"] * 100
              if request["ttft_ms"] else 0.0} for part, column in zip(PARTS, PART_COLUMNS)]
    table.append({"part": "TTFT (sum)", "ms": sum(request[c] for c in PART_COLUMNS), "share": 100.0})
    st.dataframe(table, hide_index=True, column_config={"ms": st.column_config.NumberColumn(format="%.3f"),
                                                         "share": st.column_config.NumberColumn("share (%)",
                                                                                                format="%.1f")})


def stage_table() -> None:
    st.dataframe([{"lane": charts.lane(s["side"], s["stage"]), "stage": s["stage"], "category": s["category"],
                   "start (ms)": s["start_ms"], "duration (ms)": s["duration_ms"], "critical (ms)": s["critical_ms"]}
                  for s in stages], hide_index=True, column_config={
        c: st.column_config.NumberColumn(format="%.3f") for c in ("start (ms)", "duration (ms)", "critical (ms)")})


def rank_table() -> None:
    st.caption("Stages recorded by several processes of one side (tensor-parallel ranks) span from the first "
               "rank's start to the last one's end: the KV cache has landed when the last rank's transfer has.")
    st.dataframe([{"stage": f"{r['side']}:{r['stage']}", "rank": r["rank"], "instance": charts.short_instance(r["instance"]),
                   "start (ms)": r["start_ms"], "duration (ms)": r["duration_ms"], "bytes": r["bytes"]}
                  for r in ranks], hide_index=True, column_config={
        c: st.column_config.NumberColumn(format="%.3f") for c in ("start (ms)", "duration (ms)")})


ui.lazy_sections("trace_more", {"Breakdown": breakdown, "Stages": stage_table, **({"Ranks": rank_table} if ranks else {})})
if not spans:
    st.caption("The original spans (every attribute) are no longer in the collector's archive; the stages above "
               "are the stored breakdown.")
