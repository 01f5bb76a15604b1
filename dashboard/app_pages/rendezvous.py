"""Rendezvous and early binding (push)."""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Rendezvous and early binding",
                     "Push: D registers while P still prefills. When the registration is there first "
                     "(registration_first) prefill hides the coordination; when P's KV waits for D (kv_first) the "
                     "wait is on the critical path. Binding D early has a price: its blocks are held longer.")

if "push" not in options["modes"]:
    st.info("No push requests in this store: the rendezvous exists in push mode only.")
rendezvous = data.rendezvous(f)
ui.side_by_side(
    ("Which half arrived first, over time", charts.order_over_time(rendezvous["over_time"].to_pylist()), "order_time"),
    ("Per prefill × decode pair", charts.order_by_pair(rendezvous["by_pair"].to_pylist()), "order_pair"))


def kv_hold() -> None:
    ui.chart(charts.kv_hold(data.kv_hold(f).to_pylist()), key="kv_hold")
    st.caption("From D's allocation to the transfer's completion on D: in push D allocates while P prefills, in "
               "pull only after. Block·seconds = blocks allocated × time held.")


ui.lazy_sections("rendezvous_more", {
    "Coordination given the order": lambda: ui.chart(
        charts.coordination_by_order(rendezvous["by_order"].to_pylist()), key="order_coord"),
    "What early binding costs: KV blocks held on D": kv_hold})
