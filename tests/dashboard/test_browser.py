"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against
``kvtrace dashboard --db PATH`` while a ``kvtrace collector`` writes PATH and is being fed.

Every page must render its charts (Plotly's SVG, the expected legend entries) with no Streamlit
exception, a request sent after the page loaded must appear on the Overview within the
refresh interval, and the browser must reach nothing but 127.0.0.1. Screenshots go to
``.artifacts/screenshots/`` (the README's come from here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright import sync_api as playwright

from kvtrace.dashboard.server import BACKEND_BASE
from kvtrace.dashboard.ui import KPI_CLASS, ms_short
from kvtrace.collectors.read import Filters, open_store
from kvtrace.testbed.launch import free_port
from kvtrace.testbed.synthetic import Generator, Workload
from tests.collectors.traces import build
from tests.helpers import wait_until

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / ".artifacts" / "screenshots"
REFRESH_S = 2.0
PAGES = {  # url path -> legend entries its charts must show on arrival
    "": {"compute", "queue", "coordination", "wire", "unattributed"},
    "push-vs-pull": {"push", "pull"},
    "stages": {"push", "pull"},
    "rendezvous": {"registration_first", "kv_first"},
    "decode": {"push", "pull"},
    "slow": {"push (sample)", "push slowest", "pull (sample)"},
    "trace": {"compute", "wire", "critical path", "request"},
    "health": set(),  # its charts on arrival are per process: their names vary with the run
}
SECTIONS = {  # url path -> a secondary view drawn only once opened (ui.lazy_sections), and the legend entries it brings
    "": ("TTFT over time", {"push p50", "pull p99"}),
    "push-vs-pull": ("The transfer itself", {"NIXL post", "NIXL transfer"}),
    "rendezvous": ("Coordination given the order", {"coordination", "TTFT"}),
    "decode": ("TPOT by mode", {"TPOT p50", "TPOT p90"}),
    "health": ("Unattributed time and incomplete traces", {"push", "pull"}),
}


def _post(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@pytest.fixture(scope="module", params=["duckdb", "clickhouse"])
def live(request, tmp_path_factory):
    """A collector process being fed synthetic traffic and a dashboard process reading its store: the
    embedded DuckDB file, and a fleet's shared ClickHouse database."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium package")
    tmp = tmp_path_factory.mktemp("live")
    http_port, ui_port = free_port(), free_port()
    shared = request.param == "clickhouse"
    db = request.getfixturevalue("clickhouse_server").store_url("live") if shared else str(tmp / "live.duckdb")
    logs = [open(tmp / "collector.log", "wb"), open(tmp / "dashboard.log", "wb")]
    collector = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "collector", "--db", db, "--grpc-port", "-1", "--http-port", str(http_port),
         "--decision-wait", "0.3", "--wal-dir", str(tmp / "wal")], stdout=logs[0], stderr=subprocess.STDOUT,
        start_new_session=True)
    dashboard = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "dashboard", "--db", db, "--port", str(ui_port), "--refresh",
         str(REFRESH_S), "--apm-url", "http://127.0.0.1:16686/trace/{trace_id}"],
        stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True)
    otlp = f"http://127.0.0.1:{http_port}/v1/traces"
    try:
        ready = (lambda: _listening(http_port)) if shared else (lambda: Path(f"{db}.kvtrace-collector.json").exists())
        assert wait_until(ready, 30), (tmp / "collector.log").read_text()
        start = time.time_ns() - 20 * 60 * 10**9  # twenty minutes of traffic, both modes, a few failures
        for payload in Generator(Workload(rate_per_s=2, run_every_s=300, failure_rate=0.02,
                                          incomplete_rate=0.02)).requests(2_000, start):
            _post(otlp, payload)
        for built in (build("push"), build("pull")):  # and contract traces whose parts are known exactly
            for request in built.requests:
                _post(otlp, request.SerializeToString())
        reader = open_store(db)
        assert wait_until(lambda: reader.kpis(Filters())["requests"] == 2_002, 60)
        ui = f"http://127.0.0.1:{ui_port}"
        assert wait_until(lambda: _healthy(ui), 60), (tmp / "dashboard.log").read_text()
        yield {"ui": ui, "otlp": otlp, "db": db, "reader": reader, "collector": collector}
    finally:
        _stop(dashboard)
        _stop(collector)
        for log in logs:
            log.close()


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False


def _healthy(ui: str) -> bool:
    try:
        with urllib.request.urlopen(f"{ui}/_stcore/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    page = context.new_page()
    page.outside = []  # every request the page makes to anything but this machine's loopback
    page.asked = []  # every URL it asks for
    page.on("request", lambda r: page.asked.append(r.url) if r.url.startswith(
        ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")) else page.outside.append(r.url))
    yield page
    context.close()


def _legend(page) -> set[str]:
    return {text.strip() for text in page.locator(".legendtext").all_text_contents()}  # SVG: no inner text


@pytest.mark.parametrize("path", list(PAGES))
def test_every_page_renders_its_charts_in_chromium(live, page, path):
    started = time.monotonic()
    page.goto(f"{live['ui']}/{path}")
    page.wait_for_selector(".main-svg", timeout=60_000)
    first_chart_s = time.monotonic() - started
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(1_000)  # the rest of the page's charts
    assert page.locator("[data-testid='stException']").count() == 0, page.locator(
        "[data-testid='stException']").first.inner_text()
    assert page.locator(".main-svg").count() >= 1
    missing = PAGES[path] - _legend(page)
    assert not missing, f"/{path}: legend lacks {missing}; has {_legend(page)}"
    SHOTS.mkdir(parents=True, exist_ok=True)  # the page as it arrives, before a section is opened (it scrolls)
    suffix = "" if "clickhouse://" not in live["db"] else "-clickhouse"
    page.screenshot(path=str(SHOTS / f"{path or 'overview'}{suffix}.png"), full_page=True)
    if path in SECTIONS:
        label, legend = SECTIONS[path]
        assert not legend & _legend(page), f"/{path}: {label!r} drawn before it was opened"
        page.locator("[data-testid='stExpander'] summary").filter(has_text=label).click()
        page.wait_for_function("names => names.every(n => [...document.querySelectorAll('.legendtext')]"
                               ".some(e => e.textContent.trim() === n))", arg=sorted(legend), timeout=30_000)
    store = "the shared ClickHouse store" if "clickhouse://" in live["db"] else "a running collector"
    assert page.get_by_text(f"reading {store}").count() == 1
    assert not page.outside, page.outside
    # The page said where the server is (server.PinBackendBase): the front end never probed for it under the
    # page's own path, which cost each deep link a 404 and Streamlit's 100 ms retry before its socket opened.
    assert page.evaluate("window.__streamlit.BACKEND_BASE_URL") == f"{live['ui']}/"
    probes = [url for url in page.asked if url.endswith("/_stcore/health")]
    assert probes == [f"{live['ui']}/_stcore/health"], probes
    print(f"\n/{path}: first chart after {first_chart_s:.2f} s")
    page.set_viewport_size({"width": 1280, "height": 900})  # a laptop's browser window
    page.wait_for_timeout(1_000)
    assert not _cut_kpis(page), f"/{path}: KPI values cut off at 1280 px: {_cut_kpis(page)}"


@pytest.mark.parametrize("here, served, base, expected", [
    ("/", "/", "/", "/"),
    ("/health", "/health", "/", "/"),
    ("/trace/", "/trace/", "/", "/"),
    ("/kv/trace", "/trace", "/", "/kv/"),  # a proxy removed /kv on the way
    ("/kv", "/", "/", None),  # ... and the browser's path does not end with the server's: Streamlit probes
    ("/kv/", "/", "/", "/kv/"),
    ("/dash/health", "/dash/health", "/dash/", "/dash/"),  # server.baseUrlPath = dash
    ("/edge/dash/stages", "/dash/stages", "/dash/", "/edge/dash/"),  # both
    ("/elsewhere", "/health", "/", None),  # a rewritten path
])
def test_the_page_computes_where_the_server_is(browser, here, served, base, expected):
    page = browser.new_page()
    try:
        assert page.evaluate(f"({BACKEND_BASE})({json.dumps(here)}, {json.dumps(served)}, {json.dumps(base)})") == expected
    finally:
        page.close()


def _cut_kpis(page) -> list[str]:
    """KPI values wider than their column (cut off with an ellipsis)."""
    return page.eval_on_selector_all(f".{KPI_CLASS}-value",
                                     "elements => elements.filter(e => e.scrollWidth > e.clientWidth + 1)"
                                     ".map(e => e.innerText)")


def test_a_request_sent_after_the_page_loaded_appears_within_the_refresh(live, page):
    page.goto(live["ui"])
    requests = page.locator(f".{KPI_CLASS}").filter(has_text="Requests").locator(f".{KPI_CLASS}-value")
    requests.wait_for(timeout=60_000)
    before = int(requests.inner_text().replace(",", ""))
    built = build("push")
    for request in built.requests:
        _post(live["otlp"], request.SerializeToString())
    sent = time.monotonic()
    # stored once the collector decides it (0.3 s after its last span) and flushes (0.5 s)...
    assert wait_until(lambda: live["reader"].trace(built.trace_id) is not None, 10)
    stored = time.monotonic()
    # ... and on the page at the strip's next refresh
    assert wait_until(lambda: int(requests.inner_text().replace(",", "")) == before + 1, REFRESH_S + 3, 0.1)
    shown = time.monotonic()
    print(f"\nstored {stored - sent:.2f} s after sending, on the page {shown - stored:.2f} s later "
          f"(refresh every {REFRESH_S:g} s)")
    assert shown - stored <= REFRESH_S + 1.5
    assert not page.outside, page.outside


def test_trace_page_deep_link_and_apm_link(live, page):
    trace_id = live["reader"].slowest(Filters(), 1).to_pylist()[0]["trace_id"]
    page.goto(f"{live['ui']}/trace?trace_id={trace_id}")
    page.wait_for_selector(".main-svg", timeout=60_000)
    page.set_viewport_size({"width": 1280, "height": 900})
    page.wait_for_timeout(1_000)
    assert not _cut_kpis(page), f"KPI values cut off at 1280 px: {_cut_kpis(page)}"
    ttft = page.locator(f".{KPI_CLASS}").filter(has_text="TTFT (from router)").locator(
        f".{KPI_CLASS}-value").inner_text()
    request = live["reader"].trace(trace_id)["request"]
    assert ttft == ms_short(request["ttft_ms"])  # the deep link's trace
    assert request["explanation"]  # the collector's sentence, shown above everything else
    page.get_by_text(request["explanation"], exact=True).wait_for(timeout=10_000)
    assert f"trace_id={trace_id}" in page.url
    labels = _bar_labels(page)
    assert any(label["text"] == "prefill" for label in labels), labels  # a wide bar keeps its name
    unreadable = [label for label in labels if label["angle"] or not label["inside"] or label["covered"]
                  or label["contrast"] < MIN_LABEL_CONTRAST]
    assert not unreadable, f"stage names turned, cut, covered or faint on their bars: {unreadable}"
    link = page.get_by_role("link", name="Open in your APM")
    assert link.get_attribute("href") == f"http://127.0.0.1:16686/trace/{trace_id}"
    assert not page.outside, page.outside


BAR_LABELS_SCRIPT = """() => {
  const overlaps = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const rgb = color => color.match(/[0-9.]+/g).slice(0, 3).map(Number);
  const luminance = channels => channels.map(c => c / 255)
    .map(c => c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4).reduce((sum, c, i) => sum + c * [0.2126, 0.7152, 0.0722][i], 0);
  const contrast = (a, b) => (Math.max(luminance(a), luminance(b)) + 0.05) / (Math.min(luminance(a), luminance(b)) + 0.05);
  const drawn = path => {  // the bar's colour as seen: its fill, faded by its opacities, over the white plot
    const style = getComputedStyle(path), alpha = Number(style.opacity) * Number(style.fillOpacity);
    return rgb(style.fill).map(c => alpha * c + (1 - alpha) * 255);
  };
  const bands = [...document.querySelectorAll('g.point path')]  // the critical path's (#111111) and the request's (#6B6B6B)
    .filter(path => ['rgb(17, 17, 17)', 'rgb(107, 107, 107)'].includes(getComputedStyle(path).fill))
    .map(path => path.getBoundingClientRect());
  return [...document.querySelectorAll('g.point')]
  .filter(p => p.querySelector('text.bartext') && getComputedStyle(p.querySelector('text.bartext')).display !== 'none')
  .map(point => {
    const label = point.querySelector('text.bartext'), text = label.getBoundingClientRect();
    const bar = point.querySelector('path').getBoundingClientRect();
    const turned = /rotate\\((-?[0-9.]+)/.exec(label.getAttribute('transform') || '');
    return {text: label.textContent, angle: turned ? Number(turned[1]) : 0,
            inside: text.left >= bar.left - 1 && text.right <= bar.right + 1 && text.top >= bar.top - 1
                    && text.bottom <= bar.bottom + 1,
            covered: bands.some(band => overlaps(text, band)),
            contrast: Math.round(100 * contrast(rgb(getComputedStyle(label).fill), drawn(point.querySelector('path')))) / 100};
  });
}"""
"""Every bar's label the page draws (Plotly hides one that does not fit with ``display: none``): its text, the
angle it is turned by, whether it lies within its bar, whether a thin band runs across it (the critical
path's, or the whole request's behind the router's lane), and the WCAG contrast ratio of its colour against
the bar's as drawn (a bar off the critical path is faded)."""
MIN_LABEL_CONTRAST = 4.5
"""WCAG's least contrast for text (AA)."""


def _bar_labels(page) -> list[dict]:
    return page.evaluate(BAR_LABELS_SCRIPT)


def test_the_overviews_share_labels_are_legible_on_their_parts(live, page):
    page.goto(f"{live['ui']}/overview")
    page.wait_for_selector("text.bartext", timeout=60_000)
    labels = _bar_labels(page)
    assert any(label["text"].endswith(" %") for label in labels), labels
    faint = [label for label in labels if label["contrast"] < MIN_LABEL_CONTRAST]
    assert not faint, f"share labels faint on their bars: {faint}"
    assert not page.outside, page.outside


def test_trace_picker_opens_from_its_popover_and_shows_the_trace_picked(live, page):
    first = live["reader"].slowest(Filters(), 1).to_pylist()[0]["trace_id"]
    page.goto(f"{live['ui']}/trace?trace_id={first}")
    page.wait_for_selector(".main-svg", timeout=60_000)
    page.get_by_role("button", name=re.compile(first)).click()  # the popover, named by the trace shown
    page.get_by_test_id("stPopoverBody").get_by_test_id("stSelectbox").click()  # its list: the slowest
    option = page.get_by_role("option").filter(has_not_text=first).first
    other = option.inner_text().split(" · ")[0]
    option.click()
    page.wait_for_url(re.compile(f"trace_id={other}"), timeout=30_000)
    page.get_by_role("button", name=re.compile(other)).wait_for(timeout=30_000)
    ttft = page.locator(f".{KPI_CLASS}").filter(has_text="TTFT (from router)").locator(f".{KPI_CLASS}-value")
    expected = ms_short(live["reader"].trace(other)["request"]["ttft_ms"])
    assert wait_until(lambda: ttft.inner_text() == expected, 30), (ttft.inner_text(), expected)
    assert not page.outside, page.outside


def test_the_overviews_own_path_opens_the_overview(live, page):
    page.goto(f"{live['ui']}/overview")
    page.locator(f".{KPI_CLASS}").filter(has_text="TTFT p50").wait_for(timeout=60_000)
    assert page.get_by_text("Page not found").count() == 0
    assert page.locator("[data-testid='stException']").count() == 0


def test_a_box_dragged_on_the_slow_requests_chart_compares_the_selection(live, page):
    """The Slow page's box selection, as a user drags it: the selected requests come back compared."""
    page.goto(f"{live['ui']}/slow")
    plot = page.locator(".nsewdrag").first  # Plotly's drag layer over the plot area
    plot.wait_for(timeout=60_000)
    page.wait_for_timeout(500)
    box = plot.bounding_box()
    page.mouse.move(box["x"] + 2, box["y"] + 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] - 2, steps=12)
    page.mouse.up()
    heading = page.get_by_text(re.compile(r"^[\d,]+ selected requests against the rest$"))
    heading.wait_for(timeout=30_000)
    assert int(heading.inner_text().split()[0].replace(",", "")) > 0
    assert page.locator("[data-testid='stException']").count() == 0
    assert not page.outside, page.outside
