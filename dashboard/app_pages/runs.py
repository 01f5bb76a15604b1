"""Runs: two recorded sweep runs side by side, per point, and what the other mode would have given."""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

ui.page("Runs", "One workload, two configurations (kvtrace bench sweep): who wins at each point, and which part "
                "of TTFT made the difference?")

runs = data.runs()
if len(runs) < 2:
    st.info("This page compares two runs recorded by the load generator, for instance:\n\n"
            "`kvtrace bench sweep --local --mode push --mode pull --prompt-tokens 128,1024 --rate 1,2 "
            "--requests 12 --db PATH`\n\n"
            f"The store has {len(runs)} run{'s' if len(runs) != 1 else ''}.")
    st.stop()
labels = {r["run_id"]: f"{r['mode']} · {r['run_id']} · {r['requests']} requests · {r['status']}" for r in runs}
ids = [r["run_id"] for r in runs]
first, second = data.default_runs()
left, right = st.columns(2)
run_a = left.selectbox("Run A", ids, index=ids.index(first), format_func=labels.get, key="run_a")
run_b = right.selectbox("Run B", ids, index=ids.index(second), format_func=labels.get, key="run_b")
if run_a == run_b:
    st.warning("Pick two different runs.")
    st.stop()

result = data.compare_runs(run_a, run_b)
for column, run in ((left, run_a), (right, run_b)):
    record = result["records"][run]
    engines = ", ".join(f"{e['role']}: vLLM {e['vllm_version']} · NIXL {e['nixl_version']} · {e['hardware']}"
                        for e in record.get("engines", []))
    column.caption(f"**{record.get('mode')}** ({record.get('connector')}) · model "
                   f"{record.get('model', record.get('served_model'))}"
                   + (f" · {record['kv_bytes_per_token']:,} B of KV per token" if record.get("kv_bytes_per_token") else "")
                   + f" · {record.get('output_tokens')} output tokens · {engines or 'engines unknown'}")

ui.chart(charts.run_ttft(result, run_a, run_b), key="run_ttft")
ui.chart(charts.run_breakdown(result, run_a, run_b), key="run_breakdown")

st.subheader("Per point")
rows = []
for point in result["points"]:
    for tag, run in (("A", run_a), ("B", run_b)):
        s = result["stats"][run].get(point)
        if s is None:
            continue
        rows.append({"point": s.label, "run": f"{tag} · {result['records'][run].get('mode')}", "requests": s.requests,
                     "TTFT p50": s.client_ttft[0], "TTFT p90": s.client_ttft[1], "TTFT p99": s.client_ttft[2],
                     "trace TTFT p50": s.trace_ttft[0], "client − trace p50": s.ttft_gap_p50,
                     "TPOT p50": s.client_tpot[0], "ITL p99": s.itl_p99,
                     **{f"{part} (mean)": value for part, value in s.parts.items()}})
st.dataframe(rows, hide_index=True, column_config={
    key: st.column_config.NumberColumn(format="%.1f ms") for key in rows[0] if key not in ("point", "run", "requests")}
    if rows else None)
st.caption("TTFT, TPOT and ITL as the load generator measured them; trace TTFT is the collector's (the router's). "
           "Parts are means per request and sum to the mean trace TTFT.")

modes = {result["records"][run].get("mode") for run in (run_a, run_b)}
if modes == {"push", "pull"}:
    st.subheader("What if: each mode estimated from the other's traces")
    table = []
    for run, other in ((run_a, run_b), (run_b, run_a)):
        estimate = data.whatif(run, other)
        for e in estimate["points"]:
            table.append({"from": f"{estimate['mode']} traces", "point": charts.point_label(*e["point"]),
                          "estimated p50": e["estimated"][0.5], "measured p50": e["other_measured"][0.5],
                          "error p50": e["error"][0.5], "estimated p90": e["estimated"][0.9],
                          "measured p90": e["other_measured"][0.9], "error p90": e["error"][0.9]})
    st.dataframe(table, hide_index=True, column_config={
        **{k: st.column_config.NumberColumn(format="%.1f ms") for k in ("estimated p50", "measured p50",
                                                                          "estimated p90", "measured p90")},
        **{k: st.column_config.NumberColumn(format="percent") for k in ("error p50", "error p90")}})
    st.caption("The other mode's TTFT for the same requests: the stages both modes share kept as measured, the "
               "part between routing and the transfer rearranged (push: P and D side by side; pull: one after "
               "the other). The README lists what the model assumes.")
