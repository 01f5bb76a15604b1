"""Slow requests: select the slow ones and see what sets them apart."""

from datetime import datetime, timezone

import streamlit as st

from kvtrace.collectors.read import length_label
from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Slow requests",
                     "Draw a box around the requests you care about (the slowest are always plotted, the rest are a "
                     "sample taken in the database) and compare them with everything else under the same filters.")

sample = data.requests_sample(f).to_pylist()
event = ui.chart(charts.slow_scatter(sample), key="slow_scatter", on_select="rerun", selection_mode=("box",))
boxes = (event.selection.get("box") or []) if event and event.selection else []


def _time(value) -> datetime:
    if isinstance(value, (int, float)):  # Plotly sends epoch ms for a date axis in some versions
        return datetime.fromtimestamp(value / 1000, tz=timezone.utc)
    parsed = datetime.fromisoformat(str(value).replace(" ", "T"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


if boxes:
    box = boxes[0]
    (x0, x1), (y0, y1) = sorted(box["x"]), sorted(box["y"])
    result = data.compare(f, _time(x0), _time(x1), float(y0), float(y1))
    st.subheader(f"{result['selected']:,} selected requests against the rest")
    ui.chart(charts.compare_parts(result["parts"]), key="compare_parts")
    columns = st.columns(4)
    for column, (name, title) in zip(columns * 2, [("mode", "mode"), ("rendezvous_order", "rendezvous order"),
                                                   ("length_bucket", "prompt tokens"), ("error", "failed"),
                                                   ("prefill_instance", "prefill instance"),
                                                   ("decode_instance", "decode instance"), ("complete", "complete")]):
        table = [{title: length_label(r["value"]) if name == "length_bucket" else
                  (r["value"] if r["value"] not in ("", None) else "–"),
                  "selected (%)": r["selected"], "rest (%)": r["rest"]} for r in result["shares"][name]]
        column.dataframe(table, hide_index=True, column_config={
            f"{g} (%)": st.column_config.NumberColumn(format="%.0f%%") for g in ("selected", "rest")})
else:
    st.info("Drag a box on the chart to select requests.", icon=":material/select:")

slowest = data.slowest(f).to_pylist()
if slowest:
    worst = slowest[0]
    st.markdown(f"**The slowest:** [{ui.ms(worst['ttft_ms'])}, trace {worst['trace_id'][:12]}…]"
                f"(trace?trace_id={worst['trace_id']}) — {ui.markdown_text(worst['explanation'] or 'not explained')}")


def slowest_table() -> None:
    # Behind an expander: a table's grid is the costliest element of a first paint (~0.15 s warm in
    # Chromium beside the bare page, docs/PERFORMANCE.md); the slowest one is named above.
    st.dataframe([{"trace": f"trace?trace_id={r['trace_id']}", "started (UTC)": r["started_at"], "mode": r["mode"],
                   "TTFT (ms)": r["ttft_ms"], "why": r["explanation"], **{k.removesuffix("_ms") + " (ms)": r[k] for k in (
                       "compute_ms", "queue_ms", "coordination_ms", "wire_ms", "unattributed_ms")},
                   "order": r["rendezvous_order"], "complete": r["complete"], "error": r["error"]} for r in slowest],
                 hide_index=True, column_config={
                     "trace": st.column_config.LinkColumn("trace", display_text=r"trace_id=(.{12})"),
                     "why": st.column_config.TextColumn("why", width="large",
                                                        help="the request in one sentence, from its critical path"),
                     **{c: st.column_config.NumberColumn(format="%.1f") for c in (
                         "TTFT (ms)", "compute (ms)", "queue (ms)", "coordination (ms)", "wire (ms)",
                         "unattributed (ms)")}})


ui.lazy_sections("slow_more", {"The slowest requests, each in one sentence": slowest_table})
