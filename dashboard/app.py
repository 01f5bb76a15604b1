"""kvtrace dashboard — the entrypoint: page setup, navigation, and the sidebar every page shares.

Run with ``kvtrace dashboard --db PATH``; each page in ``app_pages/`` answers one question.
"""

from pathlib import Path

import streamlit as st

from kvtrace.dashboard import data, ui

st.set_page_config(page_title="kvtrace — where TTFT goes", page_icon=str(Path(__file__).with_name("icon.png")), layout="wide",
                   initial_sidebar_state="expanded")
st.set_option("client.toolbarMode", "viewer")  # a product, not a notebook: no deploy or rerun menu

OVERVIEW = st.Page("app_pages/overview.py", title="Overview", icon=":material/donut_large:", url_path="home",
                   default=True)


def _to_overview() -> None:
    st.switch_page(OVERVIEW)


PAGES = [
    OVERVIEW,
    # The default page is served at "/" (its url_path only reserved): a link to /overview lands on it,
    # not on "Page not found".
    st.Page(_to_overview, title="Overview", url_path="overview", visibility="hidden"),
    st.Page("app_pages/push_vs_pull.py", title="Push vs pull", icon=":material/compare_arrows:",
            url_path="push-vs-pull"),
    st.Page("app_pages/stages.py", title="Stages", icon=":material/view_timeline:", url_path="stages"),
    st.Page("app_pages/rendezvous.py", title="Rendezvous", icon=":material/handshake:", url_path="rendezvous"),
    st.Page("app_pages/decode.py", title="Decode smoothness", icon=":material/speed:", url_path="decode"),
    st.Page("app_pages/slow.py", title="Slow requests", icon=":material/hourglass_bottom:", url_path="slow"),
    st.Page("app_pages/trace.py", title="Trace", icon=":material/waterfall_chart:", url_path="trace"),
    st.Page("app_pages/runs.py", title="Runs", icon=":material/science:", url_path="runs"),
    st.Page("app_pages/health.py", title="Health", icon=":material/monitor_heart:", url_path="health"),
]

ICON = str(Path(__file__).with_name("icon.png"))
st.logo(ICON, size="large")
page = st.navigation(PAGES)
options = ui.store_options()
st.session_state["store_options"] = options
st.session_state["filters"] = ui.sidebar_filters(options)
source = data.reader().source
READING = {"collector": "a running collector", "file": "the store file", "clickhouse": "the shared ClickHouse store"}
st.sidebar.caption(f"{options['requests']:,} requests · reading {READING.get(source.kind, source.kind)}")
page.run()
