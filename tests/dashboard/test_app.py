"""Every page of the dashboard, run by Streamlit's AppTest on stores the collector builds from
contract traces: what the page shows must be what the store holds."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import duckdb
import pytest

from streamlit.testing.v1 import AppTest

from kvtrace.collectors.read import PART_COLUMNS, Filters, open_store
from kvtrace.dashboard.launch import APP as APP_PATH
from kvtrace.dashboard.ui import KPI_CLASS, Kpi, kpi_html, markdown_text, ms, ms_short, section_key
from kvtrace.dashboard.settings import ENV_APM_URL, ENV_DB
from tests.collectors.traces import MS, build, store_of

APP = str(APP_PATH)  # the installed app, by absolute path
PAGES = ["overview", "push_vs_pull", "stages", "rendezvous", "decode", "slow", "trace", "health"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    mixed = ([build("push") for _ in range(4)] + [build("push", "kv_first")] + [build("pull") for _ in range(3)]
             + [build("pull", fail="read"), build("push", drop={"decode:completion"})])
    behind = [build("pull", drop={"router"}), build("push", late_rank_ms=6)]  # another router; TP 2 on P
    older = [build("push", contract=1), build("push", "kv_first", contract=1), build("pull", contract=1)]
    return {"empty": store_of(root / "empty.duckdb", []),
            "push": store_of(root / "push.duckdb", [build("push") for _ in range(3)]),
            "mixed": store_of(root / "mixed.duckdb", mixed), "mixed_traces": mixed,
            "behind": store_of(root / "behind.duckdb", behind), "behind_traces": behind,
            "older": store_of(root / "older.duckdb", older)}


def _app(monkeypatch, db: str, page: str = "overview", **query) -> AppTest:
    monkeypatch.setenv(ENV_DB, db)
    at = AppTest.from_file(APP, default_timeout=60)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    if page != "overview":
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def _sections(at: AppTest) -> list[str]:
    """The labels of the page's secondary views (``ui.lazy_sections``: expanders in the main area)."""
    return [box.label for box in at.main.expander]


def _open_section(at: AppTest, page: str, label: str, open_: bool = True) -> AppTest:
    """Open (or close) one of a page's secondary views (``ui.lazy_sections``, keyed ``<page>_more``)."""
    at.session_state[section_key(f"{page}_more", label)] = open_
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _every_section(at: AppTest, page: str) -> list[dict]:
    """The page's figures with each of its secondary views opened in turn: what is drawn on arrival, then
    each view's."""
    seen = {json.dumps(figure, sort_keys=True): figure for figure in _figures(at)}
    for label in _sections(at):
        seen.update({json.dumps(figure, sort_keys=True): figure for figure in _figures(_open_section(at, page, label))})
    return list(seen.values())


class _Tiles(HTMLParser):
    """The KPI tiles in ``ui.kpi_html``'s markup, read back as a browser would: each tile's label, value,
    note (its texts) and help (its label's tooltip)."""

    def __init__(self) -> None:
        super().__init__()
        self.tiles: list[Kpi] = []
        self._tile: dict[str, str | None] = {}
        self._part: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        part = attributes.get("class") or ""
        if part == KPI_CLASS:
            self._tile = {"label": "", "value": "", "note": None, "help": None}
            self.tiles.append(self._tile)  # its parts fill it as they are read
        elif part in (f"{KPI_CLASS}-label", f"{KPI_CLASS}-value", f"{KPI_CLASS}-note"):
            self._part = part.removeprefix(f"{KPI_CLASS}-")
            self._tile[self._part] = ""
        elif self._part == "label" and attributes.get("title"):
            self._tile["help"] = attributes["title"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "div":
            self._part = None

    def handle_data(self, text: str) -> None:
        if self._part:
            self._tile[self._part] += text


def _kpis(at: AppTest) -> list[Kpi]:
    parser = _Tiles()
    for element in at.get("html"):
        parser.feed(element.proto.body)
    return [Kpi(**tile) for tile in parser.tiles]


def _metrics(at: AppTest) -> dict[str, str]:
    """The page's KPI tiles, label -> value as shown."""
    return {kpi.label: kpi.value for kpi in _kpis(at)}


def test_kpi_tiles_show_their_texts_escaped():
    tiles = [Kpi("TTFT <p50>", "1.2 s", help='he said "slow" & left', note="p90 <b>2 s</b>"),
             Kpi("Requests", "1,000")]
    parser = _Tiles()
    parser.feed(kpi_html(tiles, columns=3))
    assert [Kpi(**tile) for tile in parser.tiles] == tiles  # every text back as given: escaped, not markup
    assert "<b>" not in kpi_html(tiles) and "repeat(3," in kpi_html(tiles, columns=3)


@pytest.mark.parametrize("page", PAGES)
def test_an_empty_store_shows_how_to_send_data(monkeypatch, stores, page):
    at = _app(monkeypatch, stores["empty"], page)
    assert "kvtrace collector --db" in at.info[0].value and "kv_connector_module_path" in at.info[0].value
    assert not at.get("plotly_chart")


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_its_charts(monkeypatch, stores, page):
    for store in ("push", "mixed"):
        at = _app(monkeypatch, stores[store], page)
        if page == "decode":  # the test traces have no TPOT (one output token): each chart says so in a line;
            # the browser test's traffic draws them (test_browser.PAGES)
            assert [line.value for line in at.info] == ["No request with two or more output tokens."]
            _open_section(at, page, "TPOT by mode")
            assert [line.value for line in at.info] == ["No request with two or more output tokens."] * 2
            continue
        assert at.get("plotly_chart"), f"{page} on {store}: no chart"
        for figure in _every_section(at, page):
            for axis in ("xaxis", "yaxis"):  # units on every axis that is shown
                layout = figure["layout"].get(axis, {})
                if layout.get("visible", True) and figure["data"] and figure["data"][0].get("type") != "heatmap":
                    title = (layout.get("title") or {}).get("text")
                    assert title or axis == "yaxis" and figure["data"][0].get("orientation") == "h", (page, axis)


def test_a_pages_secondary_views_are_drawn_only_while_open(monkeypatch, stores):
    def x_titles(at):
        return [(f["layout"]["xaxis"].get("title") or {}).get("text") for f in _figures(at)]

    at = _app(monkeypatch, stores["mixed"])
    assert _sections(at) == ["A typical request against the slowest 1 %", "TTFT over time"]
    assert len(_figures(at)) == 1  # the parts by mode: no secondary view is drawn on arrival
    _open_section(at, "overview", "TTFT over time")
    assert len(_figures(at)) == 2 and "time (UTC)" in x_titles(at)
    _open_section(at, "overview", "A typical request against the slowest 1 %")
    assert len(_figures(at)) == 3  # both open
    _open_section(at, "overview", "TTFT over time", open_=False)
    assert len(_figures(at)) == 2 and "time (UTC)" not in x_titles(at)  # closed: no longer drawn
    at.switch_page("app_pages/push_vs_pull.py").run()
    assert len(_figures(at)) == 1  # the parts side by side (the CDF waits too)
    assert not at.dataframe  # not the transfer's table
    _open_section(at, "push_vs_pull", "The transfer itself")
    assert len(at.dataframe) == 1 and "MB/s (NIXL)" in at.dataframe[0].value.columns
    at.switch_page("app_pages/stages.py").run()
    assert len(_figures(at)) == 1 and not at.dataframe  # the shares; the table waits for a click
    _open_section(at, "stages", "Every stage: durations and time on the path")
    assert len(at.dataframe) == 1 and "on the critical path (ms/request)" in at.dataframe[0].value.columns
    at.switch_page("app_pages/decode.py").run()
    assert len(at.get("plotly_chart")) + len(at.info) == 1  # the scatter (or its line): not the TPOT bars too


def test_overview_numbers_are_the_stores(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"])
    k = open_store(stores["mixed"]).kpis(Filters())
    metrics = _metrics(at)
    assert metrics["Requests"] == f"{k['requests']:,}" == "10"
    assert metrics["TTFT p50"] == f"{k['ttft_p50_ms']:.3g} ms"  # three significant digits: the column is narrow
    assert metrics["Incomplete"] == "1" and metrics["Failed"] == "1"
    p50 = next(kpi for kpi in _kpis(at) if kpi.label == "TTFT p50")
    assert p50.help == ms(k["ttft_p50_ms"])  # to 0.1 ms on hover
    by_mode = {r["mode"]: r for r in open_store(stores["mixed"]).parts_by_mode(Filters()).to_pylist()}
    parts = _figures(at)[0]  # mean ms by mode, each part's share inside its bar
    for trace in parts["data"]:
        for mode, value, share in zip(trace["y"], trace["x"], trace["text"]):
            row = by_mode[mode]
            assert value == pytest.approx(row[f"{trace['name']}_ms"])
            assert share == f"{row[trace['name'] + '_ms'] / row['ttft_ms'] * 100:.0f} %"
    for mode, row in by_mode.items():  # the bars add up to TTFT
        total = sum(t["x"][t["y"].index(mode)] for t in parts["data"])
        assert total == pytest.approx(row["ttft_ms"])


def _summary(at: AppTest) -> str:
    """The sidebar's one line saying what the filters select."""
    return next(c.value for c in at.sidebar.caption if " · " in c.value and "requests" not in c.value)


def test_filters_come_from_the_url_and_narrow_the_numbers(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"], mode="pull")
    assert _summary(at) == "All data · pull"
    assert _metrics(at)["Requests"] == "4"  # the pull traces (one of them failed)
    assert at.query_params["mode"] == "pull"  # kept in the URL: the view is a link
    at.session_state["f_open"] = True  # the user opens the sidebar's "Filters"
    at.run()
    assert at.multiselect(key="f_modes").value == ["pull"]  # the widget starts from the link's filter
    at.multiselect(key="f_modes").set_value(["push"]).run()
    assert _metrics(at)["Requests"] == "6" and at.query_params["mode"] == "push"
    assert _summary(at) == "All data · push"
    assert not at.exception


def test_filter_widgets_are_drawn_only_while_opened_and_their_choice_outlives_them(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"])
    assert not at.sidebar.selectbox and not at.sidebar.multiselect  # closed: the first paint draws no widget
    assert _summary(at) == "All data · pull and push"
    at.session_state["f_open"] = True
    at.run()
    at.selectbox(key="f_window").set_value("24h")
    at.multiselect(key="f_modes").set_value(["pull"]).run()
    assert _metrics(at)["Requests"] == "4"
    at.session_state["f_open"] = False  # closed again: the widgets go, the choice stays
    at.run()
    assert not at.sidebar.multiselect
    assert _metrics(at)["Requests"] == "4" and _summary(at) == "Last 24 hours · pull"
    assert dict(at.query_params) == {"window": "24h", "mode": "pull"}
    at.switch_page("app_pages/push_vs_pull.py").run()  # and every page reads it
    assert any("Only one mode" in c.value for c in at.caption)
    at.session_state["f_open"] = True  # reopened, the widgets start from it
    at.run()
    assert at.multiselect(key="f_modes").value == ["pull"] and at.selectbox(key="f_window").value == "24h"
    assert not at.exception


def test_push_vs_pull_shows_both_and_their_difference(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"], "push_vs_pull")
    by_mode = {r["mode"]: r for r in open_store(stores["mixed"]).parts_by_mode(Filters()).to_pylist()}
    push, pull = by_mode["push"], by_mode["pull"]
    line = next(m.value for m in at.markdown if m.value.startswith("**Pull"))
    ttft = pull["ttft_ms"] - push["ttft_ms"]
    assert f"TTFT {ttft:+,.2f} ms".replace("-", "\u2212") in line
    assert f"(pull {pull['ttft_ms']:,.2f} ms, push {push['ttft_ms']:,.2f} ms)" in line
    named = re.findall(r"(compute|queue|coordination|wire|unattributed) ([+\u2212][\d,.]+) ms", line)
    differences = {part: float(value.replace("\u2212", "-").replace(",", "")) for part, value in named}
    assert len(named) == 5  # every part, the largest difference first
    assert list(differences) == sorted(differences, key=lambda p: -abs(pull[f"{p}_ms"] - push[f"{p}_ms"]))
    for part, value in differences.items():
        assert value == pytest.approx(pull[f"{part}_ms"] - push[f"{part}_ms"], abs=0.005)
    assert sum(differences.values()) == pytest.approx(ttft, abs=0.03)  # the parts add up to TTFT, per mode
    bars = next(f for f in _figures(at) if f["data"][0].get("texttemplate"))  # each mode's values on its bars
    assert {t["name"] for t in bars["data"]} == {"push", "pull"}
    # each mode's TTFT percentiles in a line, exact over these few rows (DuckDB's quantile_cont on the rows)
    exact = {mode: open_store(stores["mixed"]).sql(
        "SELECT quantile_cont(ttft_ms, [0.5, 0.9, 0.99]) AS q FROM requests WHERE complete AND mode = ?",
        [mode]).to_pylist()[0]["q"] for mode in ("pull", "push")}
    percentiles = next(c.value for c in at.caption if c.value.startswith("TTFT p50 / p90 / p99: "))
    assert percentiles == ("TTFT p50 / p90 / p99: " + " · ".join(
        f"{mode} " + " / ".join(ms_short(q) for q in exact[mode]) for mode in ("pull", "push"))
        + " (percentiles exact).")
    assert len(_figures(at)) == 1  # the parts; the distribution (CDF) waits under its expander
    cdf = _figures(_open_section(at, "push_vs_pull", "TTFT distribution"))
    assert any(f["layout"]["xaxis"]["title"]["text"] == "TTFT (ms, log scale)" for f in cdf)
    at = _app(monkeypatch, stores["push"], "push_vs_pull")
    assert any("Only one mode" in c.value for c in at.caption)


def test_a_trace_deep_link_shows_its_waterfall_and_breakdown(monkeypatch, stores):
    built = stores["mixed_traces"][4]  # push, kv_first: its path runs through D's registration
    at = _app(monkeypatch, stores["mixed"], "trace", trace_id=built.trace_id)
    assert at.selectbox[0].value == built.trace_id
    assert _metrics(at)["TTFT (from router)"] == f"{built.ttft_ns / MS:.3g} ms"
    assert _metrics(at)["Rendezvous"] == "P first"  # kv_first: P's KV waited for D's registration
    assert at.info[0].value == ("89 % coordination: D's registration took 161 ms to reach P, whose finished blocks "
                                "waited 18 ms for it at the rendezvous.")  # the collector's sentence, on top
    assert not at.dataframe  # the breakdown's table waits under its expander
    breakdown = _open_section(at, "trace", "Breakdown").dataframe[0].value.set_index("part")["ms"]
    assert breakdown["TTFT (sum)"] == pytest.approx(built.ttft_ns / MS)
    for part, ns in built.expected.items():
        assert breakdown[part] == pytest.approx(ns / MS)
    waterfall = _figures(at)[0]
    critical = next(t for t in waterfall["data"] if t["name"] == "critical path")
    assert sum(critical["x"]) + built.expected["unattributed"] / MS == pytest.approx(built.ttft_ns / MS)
    lanes = {y for t in waterfall["data"] for y in t["y"]}
    assert {"router · event loop", "P · engine loop", "P · writer thread", "D · engine loop",
            "D · writer thread"} <= lanes


def test_the_trace_picker_waits_in_a_popover_named_by_the_trace_it_shows(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"], "trace")  # no trace in the URL: the slowest, and the URL names it
    slowest = open_store(stores["mixed"]).slowest(Filters(), 20).to_pylist()
    first, other = slowest[0], slowest[-1]
    assert at.query_params["trace_id"] == first["trace_id"]
    (popover,) = at.main.get("popover")
    assert popover.proto.popover.label.startswith(first["trace_id"])  # its button names the trace shown
    (picker,) = popover.selectbox  # the select box is inside it, on the trace shown
    assert picker.value == first["trace_id"] and len(picker.options) == len(slowest)
    picker.set_value(other["trace_id"]).run()  # picked: the URL, the button and the tiles follow
    assert not at.exception, [e.value for e in at.exception]
    assert at.query_params["trace_id"] == other["trace_id"]
    assert at.main.get("popover")[0].proto.popover.label.startswith(other["trace_id"])
    assert at.main.get("popover")[0].selectbox[0].value == other["trace_id"]
    assert _metrics(at)["TTFT (from router)"] == ms_short(other["ttft_ms"])


def test_an_unknown_trace_says_so(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"], "trace", trace_id="0" * 32)
    assert "No request with trace id" in at.warning[0].value


def test_the_apm_link_is_built_from_the_template(monkeypatch, stores):
    built = stores["mixed_traces"][0]
    monkeypatch.setenv(ENV_APM_URL, "http://jaeger.example:16686/trace/{trace_id}")
    at = _app(monkeypatch, stores["mixed"], "trace", trace_id=built.trace_id)
    (button,) = at.get("link_button")
    assert button.proto.url == f"http://jaeger.example:16686/trace/{built.trace_id}"


def test_health_lists_incomplete_traces(monkeypatch, stores):
    at = _open_section(_app(monkeypatch, stores["mixed"], "health"), "health", "Unattributed time and incomplete traces")
    missing = at.dataframe[0].value.to_dict("records")
    assert missing == [{"mode": "push", "missing stages": "decode:completion", "requests": 1}]


def test_a_fleets_clocks_draw_the_farthest_instances_and_one_band_for_the_rest(monkeypatch, tmp_path):
    """Twelve processes, D's clocks skewed 0-5 ms: the Health page draws the eight that stray farthest
    (every skewed D among them) and folds the other four into one band that covers them."""
    from kvtrace.dashboard.charts import MAX_INSTANCE_LINES

    fleet = [build("push", hosts=str(i), skew_ms={"decode": float(i)}) for i in range(6)]
    db = store_of(tmp_path / "fleet.duckdb", fleet)
    at = _app(monkeypatch, db, "health")
    offsets = next(f for f in _figures(at)
                   if "offset applied" in f["layout"]["yaxis"].get("title", {}).get("text", ""))
    lines = [t for t in offsets["data"] if t.get("mode") == "lines+markers"]
    band = [t for t in offsets["data"] if t.get("legendgroup") == "others"]
    assert len(lines) == MAX_INSTANCE_LINES
    assert {f"decode-{i}" for i in range(1, 6)} <= {t["name"] for t in lines}
    assert band[1]["name"] == "4 other instances (least to greatest)"
    drawn = {t["name"] for t in lines}
    rest = [r for r in open_store(db).health(Filters())["clocks"].to_pylist() if r["instance"] not in drawn]
    assert rest and min(band[0]["y"]) <= min(r["min_ms"] for r in rest)
    assert max(band[1]["y"]) >= max(r["max_ms"] for r in rest)


def test_a_store_from_another_schema_gets_a_clear_message(monkeypatch, tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (4)")
    con.close()
    monkeypatch.setenv(ENV_DB, str(path))
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert "store schema 4" in at.error[0].value and "cannot be read" in at.error[0].value


def test_parts_per_request_add_up_on_the_slow_page(monkeypatch, stores):
    at = _app(monkeypatch, stores["mixed"], "slow")
    assert not at.dataframe  # the table waits under its expander; the slowest request is named above it
    named = next(m.value for m in at.markdown if m.value.startswith("**The slowest:**"))
    slowest = _open_section(at, "slow", "The slowest requests, each in one sentence").dataframe[0].value.to_dict(
        "records")
    assert slowest[0]["trace"] in named and ms(slowest[0]["TTFT (ms)"]) in named
    assert markdown_text(slowest[0]["why"]) in named
    assert len(slowest) == 10
    for row in slowest:
        parts = sum(row[f"{c.removesuffix('_ms')} (ms)"] for c in PART_COLUMNS)
        assert parts == pytest.approx(row["TTFT (ms)"])
    sentences = {row["why"] for row in slowest}  # each request's own sentence
    assert "Failed: D's read ended in error (transfer_failed) 170 ms in." in sentences
    assert any(s.startswith("Incomplete: decode:completion never arrived") for s in sentences)


def test_runs_page_without_runs_says_how_to_record_them(monkeypatch, stores):
    at = _app(monkeypatch, stores["push"], "runs")
    assert "kvtrace bench sweep" in at.info[0].value and "has 0 runs" in at.info[0].value
    assert not at.get("plotly_chart")


def test_the_trace_page_names_the_ttft_reference_and_draws_each_tp_rank(monkeypatch, stores):
    no_router, tp2 = stores["behind_traces"]
    at = _app(monkeypatch, stores["behind"], "trace", trace_id=no_router.trace_id)
    assert "TTFT (from engine)" in _metrics(at)
    assert _sections(at) == ["Breakdown", "Stages"]  # no TP: no ranks' view
    stages = _open_section(at, "trace", "Stages").dataframe[0].value
    assert "relay" in set(stages["stage"])  # P's answer to D's leg, through the other router
    at = _app(monkeypatch, stores["behind"], "trace", trace_id=tp2.trace_id)
    assert "TTFT (from router)" in _metrics(at)
    ranks = _open_section(at, "trace", "Ranks").dataframe[0].value
    assert list(ranks["rank"]) == [0, 1] and set(ranks["stage"]) == {"prefill:write"}
    assert list(ranks["duration (ms)"]) == pytest.approx([5.0, 11.0]) and list(ranks["bytes"]) == [2_097_152] * 2
    lanes = {y for figure in _figures(at) for trace in figure["data"] for y in trace.get("y", [])}
    assert {"prefill · write · rank 0", "prefill · write · rank 1"} <= lanes


@pytest.mark.parametrize("page", PAGES)
def test_traces_of_an_older_contract_appear_on_every_page(monkeypatch, stores, page):
    """Senders from before engine.input (contract 1): their traces are complete for what they carry, so
    the pages that count only complete requests show them."""
    assert open_store(stores["older"]).kpis(Filters())["incomplete"] == 0
    at = _app(monkeypatch, stores["older"], page)
    said = [line.value.lower() for line in at.info]  # a chart with no data is a line saying why
    assert _figures(at) or said, page
    assert not any("no complete requests" in line for line in said), page


def test_health_counts_traces_against_measured_clocks_only_where_clocks_were_measured(monkeypatch, tmp_path, stores):
    """With no clock exchange in the store no offset was measured, so no trace was checked against one:
    "0 of 10 traces contradict a measured offset" would claim a check that never ran."""
    def clock_caption(at: AppTest) -> str:
        return next(c.value for c in at.caption if c.value.startswith("From the clock exchange"))

    assert "contradicts" not in clock_caption(_app(monkeypatch, stores["mixed"], "health"))
    db = store_of(tmp_path / "measured.duckdb", [build("push") for _ in range(3)])
    con = duckdb.connect(db)
    con.execute("INSERT INTO clock_samples SELECT 'decode-0', now(), 0.25, 0.05")
    con.close()
    assert "0 of 3 traces had span order that contradicts a measured offset" in clock_caption(
        _app(monkeypatch, db, "health"))


def test_a_chart_with_nothing_to_draw_is_a_line_saying_why_not_an_empty_figure(monkeypatch, stores):
    """The issue's "no chart whose data is empty": an empty Plotly figure costs the browser a first
    paint as much as a full one. The test stores carry no clock exchanges."""
    at = _app(monkeypatch, stores["mixed"], "health")
    assert [line.value for line in at.info] == [
        "No clock exchanges recorded (senders behind another collector, or older kvtrace)."]
    assert len(_figures(at)) == 1  # the offsets applied; the unattributed share waits under its expander
    assert "Each process's clock, measured" in [h.value for h in at.subheader]  # the panel keeps its title
    figures = _figures(_open_section(at, "health", "Unattributed time and incomplete traces"))
    assert len(figures) == 2 and all(figure["data"] for figure in figures)


def test_a_sentence_in_markdown_reads_as_itself():
    """An explanation inside st.markdown: no italics from snake_case, no link, no math, no shortcode."""
    sentence = "Failed: D's read ended in error (transfer_failed) 170 ms in; [x](y) *z* $1 :material/x: a|b"
    escaped = markdown_text(sentence)
    assert "transfer\\_failed" in escaped
    assert re.sub(r"\\(.)", r"\1", escaped) == sentence  # every escape is one backslash before the character
    assert not re.search(r"(?<!\\)[_*\[\]()$:|`<>#~]", escaped)  # and no special character is left bare


def test_kpi_durations_keep_three_digits_and_fit_a_narrow_column():
    from kvtrace.dashboard.ui import ms_short

    cases = {None: "–", 0.4213: "0.42 ms", 4.213: "4.21 ms", 87.74: "87.7 ms", 99.96: "100 ms", 410.3: "410 ms",
             999.96: "1.00 s", 1249.3: "1.25 s", 12_500.0: "12.5 s", 2_000_000.0: "2,000 s"}
    assert {value: ms_short(value) for value in cases} == cases
    assert max(len(text) for text in cases.values()) <= 7
    rough = {4.213: "4.2 ms", 87.74: "88 ms", 410.3: "410 ms", 1249.3: "1.2 s"}  # a histogram's ±4 %
    assert {value: ms_short(value, approximate=True) for value in rough} == rough


def test_the_waterfall_fades_what_is_off_the_critical_path(monkeypatch, stores):
    """The router's decode leg spans the whole TTFT but only its last ms are on the path: drawn faded,
    where P's prefill (all on the path) is drawn solid."""
    built = stores["mixed_traces"][0]  # push, registration_first
    at = _app(monkeypatch, stores["mixed"], "trace", trace_id=built.trace_id)
    waterfall = _figures(at)[0]
    opacity = {name: float(color.rsplit(",", 1)[1].rstrip(")")) for trace in waterfall["data"] if trace.get("text")
               for name, color in zip(trace["text"], trace["marker"]["color"])}  # each bar's rgba() alpha
    assert opacity["prefill"] == 1.0
    assert opacity["decode_leg"] < 0.4 and opacity["prefill_leg"] == 0.3  # 1 of ~170 ms; none on the path


def test_the_overview_says_when_its_percentiles_are_estimates(monkeypatch, tmp_path):
    from kvtrace.collectors.read import reader as reader_module

    db = store_of(tmp_path / "many.duckdb", [build("push", late_rank_ms=float(i)) for i in range(6)])
    at = _app(monkeypatch, db)
    k = open_store(db).kpis(Filters())
    assert k["quantiles_exact"] and _metrics(at)["TTFT p50"] == f"{k['ttft_p50_ms']:.3g} ms"
    assert any("percentiles exact" in c.value for c in at.caption)
    monkeypatch.setattr(reader_module, "EXACT_QUANTILES_UP_TO", 3)  # 6 requests: above the bound
    db = store_of(tmp_path / "more.duckdb", [build("push", late_rank_ms=float(i)) for i in range(6)])
    at = _app(monkeypatch, db)
    assert any("log-bucketed histograms (±3.9 %: over 3 requests), to two digits" in c.value for c in at.caption)
    estimate = open_store(db).kpis(Filters())["ttft_p50_ms"]
    assert _metrics(at)["TTFT p50"] == ms_short(estimate, approximate=True)  # two digits: what ±3.9 % supports


def test_stages_and_decode_say_when_their_percentiles_are_estimates(monkeypatch, tmp_path):
    """The stage table's durations and the Decode page's TPOT follow the Overview's rule: exact from the rows
    for a few requests; above the bound the histograms' estimate, said so, to the two digits it supports."""
    from kvtrace.collectors.read import reader as reader_module

    builts = [build(mode, late_rank_ms=float(i), d_queue_ms=1.3 * i, output_tokens=3 + i)
              for i, mode in enumerate(["push", "pull"] * 3)]
    db = store_of(tmp_path / "few.duckdb", builts)
    exact = {(r["mode"], r["stage"]): r["p50_ms"] for r in open_store(db).stage_table(Filters())}
    at = _open_section(_app(monkeypatch, db, "stages"), "stages", "Every stage: durations and time on the path")
    table = at.dataframe[0].value
    assert {(r["mode"], r["stage"]): r["p50 (ms)"] for r in table.to_dict("records")} == exact
    assert any("Durations: percentiles exact" in c.value for c in at.caption)
    at = _app(monkeypatch, db, "decode")
    assert any("percentiles exact" in c.value for c in at.caption)
    smoothness = {r["mode"]: r for r in open_store(db).decode_smoothness(Filters())}
    push = next(kpi for kpi in _kpis(at) if kpi.label == "push TPOT p50")
    assert push.value == ms_short(smoothness["push"]["tpot_p50_ms"])
    assert push.note.startswith(f"p90 {ms_short(smoothness['push']['tpot_p90_ms'])} · connector on the loop ")

    monkeypatch.setattr(reader_module, "EXACT_QUANTILES_UP_TO", 3)  # 6 requests: above the bound
    db = store_of(tmp_path / "many.duckdb", builts)
    estimates = {(r["mode"], r["stage"]): r["p50_ms"] for r in open_store(db).stage_table(Filters())}
    at = _open_section(_app(monkeypatch, db, "stages"), "stages", "Every stage: durations and time on the path")
    shown = {(r["mode"], r["stage"]): r["p50 (ms)"] for r in at.dataframe[0].value.to_dict("records")}
    assert any("Durations: percentiles from log-bucketed histograms (±3.9 %: over 3 requests), to two digits" in c.value
               for c in at.caption)
    prefill = ("push", "prefill")  # ~146 ms in the histogram: 150 to two digits
    assert shown[prefill] == float(f"{estimates[prefill]:.2g}") and shown[prefill] != estimates[prefill]
    at = _app(monkeypatch, db, "decode")
    assert any("percentiles from log-bucketed histograms" in c.value for c in at.caption)
    tpot = {r["mode"]: r["tpot_p50_ms"] for r in open_store(db).decode_smoothness(Filters())}
    assert _metrics(at)["push TPOT p50"] == ms_short(tpot["push"], approximate=True)


def test_health_shows_each_fleet_collector_and_warns_of_unkeyed_messages(monkeypatch, tmp_path):
    """Two collectors of a consumer group recorded their Kafka consumer: one row each with its partitions,
    lag and last commit, a lag and a rebalance line each, and the unkeyed-message warning."""
    from datetime import datetime, timedelta, timezone

    from kvtrace.collectors import schema

    db = store_of(tmp_path / "fleet.duckdb", [build("push")])
    now = datetime.now(timezone.utc)
    con = duckdb.connect(db)
    for i, (run, partitions, lag, unkeyed) in enumerate((("c-a", 3, 120, 0), ("c-b", 3, 7, 5), ("c-a", 3, 40, 0))):
        values = {c: 0 for c in schema.HEALTH_COLUMNS} | {
            "kafka_partitions": partitions, "kafka_lag": lag, "kafka_commits": 4 + i, "kafka_rebalances": 2,
            "kafka_commit_age_s": 0.4, "kafka_unkeyed": unkeyed, "kafka_pending_traces": 11}
        con.execute(f"INSERT INTO collector_health (collector_run_id, recorded_at, {', '.join(values)}) VALUES "
                    f"(?, ?, {', '.join('?' * len(values))})", [run, now + timedelta(seconds=i), *values.values()])
    con.close()
    at = _open_section(_app(monkeypatch, db, "health"), "health", "Fleet: the collectors reading Kafka")
    table = next(d.value for d in at.dataframe if "partitions owned" in d.value.columns).to_dict("records")
    assert [(r["collector"], r["partitions owned"], r["consumer lag (messages)"]) for r in table] == \
           [("c-a", 3, 40), ("c-b", 3, 7)]
    lag = next(f for f in _figures(at) if f["layout"]["yaxis"].get("title", {}).get("text") == "messages behind")
    assert {t["name"]: t["y"] for t in lag["data"]} == {"c-a": [120, 40], "c-b": [7]}
    assert any("partition_traces_by_id: true" in w.value for w in at.warning)
