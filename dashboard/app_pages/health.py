"""Health: can the breakdown be trusted, and is the collector keeping up?"""

import streamlit as st

from kvtrace.dashboard import charts, data, ui

f, options = ui.page("Health", "Clock offsets between processes, incomplete traces, the time no span covers, and "
                     "the collector's own counters.")

health = data.health(f)
measured = health["measured"].to_pylist()
suspect = health["suspect"].to_pylist()[0]
# How many traces contradict a measured offset means something only where an offset was measured.
checked = suspect["requests"] and (measured or suspect["suspect"])
ui.side_by_side(
    ("Each process's clock, measured", charts.measured_clocks(measured), "measured",
     "From the clock exchange every process runs with the collector: the offset and its error bound (half the "
     "exchange's round trip). " + (f"{ui.count(suspect['suspect'])} of {ui.count(suspect['requests'])} traces had "
                                   "span order that contradicts a measured offset (clock_suspect)."
                                   if checked else "")),
    ("Offsets applied, per instance", charts.clock_offsets(health["clocks"].to_pylist()), "clocks",
     "What was added to each process's times to put them on its router's clock (mean per interval)."))
collector = health["collector"].to_pylist()
fleet = [r for r in collector if r.get("kafka_commits") or r.get("kafka_partitions")]  # kvtrace collector --kafka


def traces() -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("Unattributed share of TTFT")
        ui.chart(charts.unattributed_share(health["unattributed"].to_pylist()), key="unattributed")
        st.caption("Time no span covers. A rising share means a stage stopped reporting, or clocks drifted.")
    with right:
        st.subheader("Incomplete traces and what they miss")
        missing = health["missing"].to_pylist()
        if missing:
            st.dataframe([{"mode": r["mode"], "missing stages": r["missing"], "requests": r["requests"]} for r in missing],
                         hide_index=True)
        else:
            st.success("Every trace in this selection is complete.", icon=":material/check_circle:")


def collector_counters() -> None:
    ui.side_by_side(
        ("Collector: refused, dropped, forwarded", charts.collector_counters(
            collector, ["requests_rejected", "forward_dropped", "forward_failures", "forwarded_spans"], "count since start"),
         "counters"),
        ("Collector: lag and backlog", charts.collector_counters(
            collector, ["lag_ms", "pending_traces", "queued_requests"], "ms / traces / requests"), "lag"))
    if collector:
        last = collector[-1]
        st.caption(f"Latest: {ui.count(last['spans_received'])} spans received, {ui.count(last['traces_decided'])} "
                   f"traces decided ({ui.count(last['traces_incomplete'])} incomplete, {ui.count(last['traces_late'])} "
                   f"decided again after late spans), {ui.count(last['duplicate_spans'])} duplicate spans, "
                   f"{ui.count(last['dropped_decisions'])} breakdowns the store could not take (dropped; their "
                   "spans are stored).")


def fleet_view() -> None:
    latest = {r["collector_run_id"]: r for r in fleet}  # rows come in time order: each collector's newest
    st.dataframe([{"collector": run, "partitions owned": r["kafka_partitions"], "consumer lag (messages)": r["kafka_lag"],
                   "traces pending": r["kafka_pending_traces"], "last commit (s ago)": round(r["kafka_commit_age_s"], 1),
                   "rebalances": r["kafka_rebalances"], "messages not keyed by trace id": r["kafka_unkeyed"],
                   "as of": r["recorded_at"]} for run, r in latest.items()], hide_index=True, key="fleet")
    if any(r["kafka_unkeyed"] for r in latest.values()):
        st.warning("Some messages were not keyed by their trace id, so a trace's spans may be split across "
                   "collectors: set `partition_traces_by_id: true` on the OpenTelemetry Collector's kafka exporter.",
                   icon=":material/call_split:")
    ui.side_by_side(
        ("Consumer lag per collector", charts.per_collector(fleet, "kafka_lag", "messages behind"), "kafka-lag",
         "Messages on each collector's partitions not yet read, at its last commit."),
        ("Rebalances per collector", charts.per_collector(fleet, "kafka_rebalances", "rebalances since start"),
         "rebalances", "Each step is a partition assignment or revocation (a collector joined, left or died)."))


ui.lazy_sections("health_more", {"Unattributed time and incomplete traces": traces, "The collector": collector_counters,
                                 **({"Fleet: the collectors reading Kafka": fleet_view} if fleet else {})})
