"""Decode smoothness: the connector's time on D's engine loop against time per output token."""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Decode smoothness",
                     "Pull prepares descriptors and posts its READ on the decode engine's loop, between decode "
                     "steps of every running request; push does it on P's writer thread. Does it show in TPOT?")

rows = data.decode_smoothness(f)


def tpot_kpi(row: dict) -> ui.Kpi:
    """One mode's TPOT p50, its exact value on hover, its p90 and the connector's time on D's loop below."""
    exact = row["quantiles_exact"]
    return ui.Kpi(f"{row['mode']} TPOT p50", ui.ms_short(row["tpot_p50_ms"], not exact),
                  help=f"{'' if exact else '≈ '}{ui.ms(row['tpot_p50_ms'], 2)}",
                  note=f"p90 {ui.ms_short(row['tpot_p90_ms'], not exact)} · connector on the loop "
                       f"{ui.ms(row['engine_loop_ms_per_request'], 3)} per request, "
                       f"{row['engine_loop_us_per_token'] or 0:.1f} µs per output token")


ui.kpis([tpot_kpi(row) for row in rows], columns=max(1, len(rows)))
st.subheader("Connector time on the loop against TPOT, per request")
ui.chart(charts.loop_vs_tpot(data.requests_sample(f).to_pylist()), key="loop_tpot")
st.caption("TPOT as the router saw it: (last token − first token) / (output tokens − 1), "
           f"{ui.percentiles_note(all(r['quantiles_exact'] for r in rows))}. Engine-loop time: the "
           "connector's calls on D's loop attributed to the request (pull's descriptor prep and READ post).")
# The modes' TPOT percentiles are the figures above; as bars they wait for a click (each chart in the first
# render costs it ~50-60 ms in Chromium, docs/PERFORMANCE.md).
ui.lazy_sections("decode_more", {"TPOT by mode": lambda: ui.chart(charts.tpot_bars(rows), key="tpot")})
