#!/usr/bin/env python3
"""Dashboard at scale: a 1,000,000-request store built through the collector's own write path,
then per page the server-side time of its first paint and of one re-filter, and the browser's
time to its first chart.

1. Build: synthetic 1P1D traffic (``kvtrace.testbed.synthetic``: contract spans, push and pull
   runs alternating every 10 minutes, ~14 spans a request) is decoded, logged, stored, assembled
   and attributed exactly as a running collector does it (as ``collector_stages.py`` drives it),
   then the rollups are compacted. ``--db PATH --reuse`` keeps and reuses the store.
2. Server side: each page runs in Streamlit's AppTest with its caches cleared — the script's whole
   run (queries, figures) and, inside it, the time spent in store queries — once with the default
   filters (all data: first paint) and once after a re-filter (push only, last 6 hours).
3. Browser: ``kvtrace dashboard --db PATH``, Debian's Chromium through Playwright; per page, the
   time from navigation to the first Plotly chart (as the page saw it: :data:`FIRST_CHART_SCRIPT`), cold (a new browser context: the whole
   Streamlit and Plotly front end loads) and warm (a tab on a Chromium profile on disk, as a user's own
   browser, loading the page's URL again: a new document, its code from the browser's caches, as a
   reload, a deep link or a new tab; :class:`Chromium` says why not a new context's tab); each
   navigation starts with the previous page finished (:data:`SETTLE_MS` after its first chart) and,
   for a warm load, the cold load's context closed :data:`SETTLE_MS` before.
   Then in-app: the warm tab follows the sidebar's link to each page in turn, as a user moves
   between pages once the dashboard is open (no new document; :data:`SWITCH_SCRIPT`; reported,
   no target). Medians of ``--rounds``.

   Beside it, a bare Streamlit page with one Plotly chart served with the same flags: Streamlit's floor on
   this machine. Each page's load is paired with a bare load just before or after it (the order alternating),
   cold with cold and warm with warm, and its ratio is the median of its pairs' ratios: this VM's speed drifts
   within a round by more than the target's margin.
4. With ``--profile``: a warm load of each page per round under Chromium's CPU profiler, and where the
   page's main thread spent its time until the first chart (:func:`main_thread_profile`).

Targets: the server side under 1 s per page (issue 9); in the browser each page within
:data:`TARGET_RATIO` of the bare page, cold and warm (issue 20). Prints what it measured.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIRST_CHART_SCRIPT = """
new MutationObserver((_, observer) => {
  if (document.querySelector('.main-svg')) {
    window.__kvtraceFirstChart = performance.timeOrigin + performance.now();
    observer.disconnect();
  }
}).observe(document, {subtree: true, childList: true});
"""
"""Run in every page before its own scripts: the wall time (ms since the epoch) the first Plotly chart was drawn.
Read from the page because Playwright's waits poll at 0, 20, 50, 100, 100 and then every 500 ms: a chart
drawn at 0.3 s was seen at ~0.8 s, which made every page's time a step of 0.5 s."""
SWITCH_SCRIPT = """
(path) => new Promise((resolve) => {
  const before = new Set(document.querySelectorAll('.main-svg'));
  const link = [...document.querySelectorAll('[data-testid=stSidebarNav] a')]
    .find(a => a.href === location.origin + '/' + path);
  if (!link) { resolve(null); return; }
  const clicked = performance.now();
  const observer = new MutationObserver(() => {
    for (const svg of document.querySelectorAll('.main-svg')) {
      if (!before.has(svg)) { observer.disconnect(); resolve(performance.now() - clicked); return; }
    }
  });
  observer.observe(document, {subtree: true, childList: true});
  setTimeout(() => { observer.disconnect(); resolve(null); }, 30000);
  link.click();
})
"""
"""Run in the page: click the sidebar's link to ``path`` and resolve with the ms until a chart not on the
page before is drawn (null when there is no such link, or no new chart within 30 s)."""
SETTLE_MS = 2_000
"""After each first chart, the page is left this long to finish before the next navigation."""
PROFILE_IDLE_MS = 4_000
"""Before each profiled load, the tab is left idle this much longer, so that (with :data:`SETTLE_MS`) it waits about
as long as before a timed warm load, which follows the page's cold load: a tab's reload is slower after idle time."""
TARGET_RATIO = 1.5
"""Each page's time to first chart, cold and warm, against the bare page's (issue 20)."""
PAGES = ["overview", "push_vs_pull", "stages", "rendezvous", "decode", "slow", "trace", "health"]
URLS = {"overview": "", "push_vs_pull": "push-vs-pull"}


def build(db: str, requests: int) -> None:
    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.model import SpanBatch
    from kvtrace.collectors.service import Collector
    from kvtrace.testbed.synthetic import Generator, Workload

    rate = 12.0  # requests per second: a million is about a day of traffic
    collector = Collector(CollectorConfig(db_path=db, grpc_port=0, http_port=None, decision_wait_s=0.0,
                                          query_port=None, archive_bytes=0))
    store, wal, assembler = collector.store, collector.wal, collector.assembler
    start = time.time_ns() - int(requests / rate * 1e9) - 600 * 10**9
    began, spans = time.monotonic(), 0
    for i, payload in enumerate(Generator(Workload(rate_per_s=rate, run_every_s=600)).requests(requests, start)):
        batch = SpanBatch.decode(payload)
        store.add_spans(batch, wal.append(payload))
        assembler.add(batch.rows)
        assembler.poll(flush_all=True)
        spans += len(batch.rows)
        if store._rows >= store._flush_rows:
            store.flush()
            wal.release(store.committed_position)
        if i % 20 == 0:
            done = assembler.stats.traces_decided  # requests (an export request holds several)
            rate_now = done / max(time.monotonic() - began, 1e-9)
            print(f"\r  building: {done:>9,.0f}/{requests:,} requests  {rate_now:,.0f}/s  "
                  f"eta {(requests - done) / max(rate_now, 1):,.0f} s   ", end="", file=sys.stderr, flush=True)
    store.flush()
    store.compact(until=datetime.now(timezone.utc))
    stored = store.query("SELECT count(*) FROM requests")[0][0]
    store.shutdown()
    wal.close()
    print(f"\n  built {stored:,} requests ({spans:,} spans) in {time.monotonic() - began:,.0f} s", file=sys.stderr)


def server_side(db: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per page: script run time and store-query time, first paint and re-filter (seconds)."""
    os.environ["KVTRACE_DB"] = db
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from kvtrace.collectors.read import reader as reader_module
    from kvtrace.dashboard.launch import APP

    spent = [0.0]
    original = reader_module.StoreReader.sql

    def timed(self, query, params=()):
        t = time.perf_counter()
        try:
            return original(self, query, params)
        finally:
            spent[0] += time.perf_counter() - t

    reader_module.StoreReader.sql = timed
    # st.cache_data.clear() from this thread, outside any script run, logs two warnings a call (no script run
    # context, no runtime) and clears the caches all the same: hundreds of lines that hid the figures. A filter,
    # not a level: Streamlit sets its loggers' levels again when a script run reads its config.
    for name in ("streamlit.runtime.scriptrunner_utils.script_run_context", "streamlit.runtime.caching.cache_data_api"):
        logging.getLogger(name).addFilter(lambda record: record.levelno > logging.WARNING)
    results: dict[str, dict[str, list[float]]] = {p: {k: [] for k in ("paint", "paint_q", "refilter", "refilter_q")}
                                                  for p in PAGES}
    warm = AppTest.from_file(str(APP), default_timeout=300)
    warm.run()  # imports and the first session's set-up are the server's, once: not a page's
    for _ in range(rounds):
        for page in PAGES:
            at = AppTest.from_file(str(APP), default_timeout=300)
            st.cache_data.clear()
            at.run()
            if page != "overview":
                at.switch_page(f"app_pages/{page}.py")
            st.cache_data.clear()
            spent[0] = 0.0
            t = time.perf_counter()
            at.run()
            results[page]["paint"].append(time.perf_counter() - t)
            results[page]["paint_q"].append(spent[0])
            assert not at.exception, (page, [e.value for e in at.exception])
            at.session_state["f_open"] = True  # the sidebar's "Filters" opened: the widgets are drawn
            at.run()
            at.selectbox(key="f_window").set_value("6h")
            at.multiselect(key="f_modes").set_value(["push"])
            spent[0] = 0.0
            t = time.perf_counter()
            at.run()
            results[page]["refilter"].append(time.perf_counter() - t)
            results[page]["refilter_q"].append(spent[0])
            assert not at.exception, (page, [e.value for e in at.exception])
    reader_module.StoreReader.sql = original
    return results


BARE_APP = """import plotly.graph_objects as go
import streamlit as st

st.set_page_config(layout="wide")
st.plotly_chart(go.Figure(go.Bar(x=["compute", "queue", "coordination", "wire"], y=[154, 2, 8, 5])))
"""
"""Streamlit's floor: one page with one Plotly chart, served with the dashboard's own flags."""


def first_chart(page, url: str) -> float:
    """Seconds from navigating ``page`` to ``url`` to its first chart (:data:`FIRST_CHART_SCRIPT`'s mark)."""
    asked = time.time()  # the browser's clock is this machine's: the page's mark compares with it
    page.goto(url)
    page.wait_for_selector(".main-svg", timeout=120_000)
    took = page.evaluate("window.__kvtraceFirstChart") / 1000 - asked
    # Let the page finish (the rest of its script run, its other charts) before the next
    # navigation, as a user reads a page before moving on: otherwise the next measure
    # shares the server with this page's unfinished run.
    page.wait_for_timeout(SETTLE_MS)
    return took


def main_thread_profile(page, url: str) -> tuple[float, collections.Counter]:
    """A warm load of ``url`` in ``page`` under the DevTools CPU profiler: (seconds to the first chart, the
    renderer's main-thread ms up to it by where they went). Self time, grouped: ``idle``, ``gc``, ``outside
    JS`` (V8's "(program)": the browser's own work on that thread — parsing, style, layout, paint), ``DOM
    calls`` (native functions JS called: getBoundingClientRect's forced layouts, appendChild, insertRule…),
    else the script chunk the function is in (``PlotlyChart``, ``react-dom``…: a chunk's name without its hash)."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("Profiler.enable")
    cdp.send("Profiler.setSamplingInterval", {"interval": 200})  # µs
    cdp.send("Profiler.start")
    took = first_chart(page, url)  # the samples after it (its settling time) are left out below
    profile = cdp.send("Profiler.stop")["profile"]
    cdp.detach()
    frames = {node["id"]: node["callFrame"] for node in profile["nodes"]}
    spent: collections.Counter = collections.Counter()
    at, until = profile["startTime"], profile["startTime"] + took * 1e6  # µs, from when the profiler started
    for node, delta in zip(profile["samples"], profile["timeDeltas"]):
        at += delta
        if at > until:
            break
        frame = frames[node]
        name, script = frame["functionName"], frame["url"]
        group = ({"(idle)": "idle", "(garbage collector)": "gc", "(program)": "outside JS"}.get(name)
                 or (script.rsplit("/", 1)[-1].split(".")[0] if script else "DOM calls"))
        spent[group] += delta / 1000
    return took, spent


def serve(command: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a Streamlit server (its own process group) and wait until it answers on ``port``."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
            return process
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"nothing answered on 127.0.0.1:{port} within 60 s: {command}")


def streamlit_command(script: str | Path, port: int) -> list[str]:
    """Streamlit serving ``script`` on 127.0.0.1 with the flags ``kvtrace dashboard`` uses for its own."""
    from kvtrace.dashboard import launch

    return [str(script) if part == str(launch.SERVER) else part for part in launch.command("127.0.0.1", port)]


CHROMIUM = "/usr/bin/chromium"  # Debian's, never a downloaded one
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1500, "height": 1100}


@dataclasses.dataclass
class Chromium:
    """Debian's Chromium, twice: ``browser`` for cold loads, each in a new context (an empty cache, as a first
    visit: :func:`new_tab`), and ``profile``, one context on a profile on disk, for the warm tabs
    (:func:`warm_tab`), as a user's own browser reloads a page.

    Why warm tabs do not live in a new context: such a context keeps V8's code cache in memory and loses it.
    A warm tab there serialized the 4.7 MB Plotly chunk's code again and again: Chromium's trace showed
    ``v8.produceModuleCache`` (190-360 ms of the main thread, traced) before the first chart on 11 of the
    dashboard's 24 warm loads in one run, and on 1 of the bare page's 24 (its first); which page paid it moved
    from run to run. On a profile on disk, each tab paid it on its first warm load and on none of the other 46
    (docs/PERFORMANCE.md)."""

    browser: Any
    profile: Any


@contextlib.contextmanager
def chromium_beside(servers: list[tuple[list[str], int, dict[str, str] | None]], scratch: str | Path):
    """Each server ``(command, port, env)`` started and answering (:func:`serve`), then Debian's Chromium
    (never a downloaded one; no GPU, no background traffic) yielded as a :class:`Chromium`, its profile in
    ``scratch``. On the way out, Chromium closed, the servers' process groups stopped (SIGTERM, by PID) and
    ``scratch`` (the caller's temporary folder) removed."""
    from playwright.sync_api import sync_playwright

    processes = []
    # A stop by signal (``timeout``, kill) leaves through the finally below too, rather than orphaning the servers.
    previous = signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    try:
        for command, port, env in servers:
            processes.append(serve(command, port, env))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                profile = pw.chromium.launch_persistent_context(
                    Path(scratch) / "chromium-profile", executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                    viewport=VIEWPORT)
                try:
                    yield Chromium(browser, profile)
                finally:
                    profile.close()
            finally:
                browser.close()
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def new_tab(chromium: Chromium):
    """A tab in a new browser context (its own cache: a cold load), marking its first chart."""
    return _marking_first_chart(chromium.browser.new_context(viewport=VIEWPORT).new_page())


def warm_tab(chromium: Chromium):
    """A tab in the profile on disk (:class:`Chromium`), marking its first chart."""
    return _marking_first_chart(chromium.profile.new_page())


def _marking_first_chart(page):
    """``page``, recording when each document it loads draws its first chart (:data:`FIRST_CHART_SCRIPT`)."""
    page.add_init_script(FIRST_CHART_SCRIPT)
    return page


def browser(db: str, rounds: int, port: int, profile: bool = False) -> dict[str, dict[str, list]]:
    """Per page (and the bare one-chart page, ``bare``), navigation to the first Plotly chart: cold and
    warm, each page paired with a bare load next to it in every round so that both see the same machine, and
    each pair's ratio (``cold_ratio``, ``warm_ratio``; ``bare`` holds every pair's bare loads). With
    ``profile``, then ``rounds`` more warm loads of each under the CPU profiler (``profile``: one
    :func:`main_thread_profile` each)."""
    bare_dir = tempfile.mkdtemp(prefix="kvtrace-bare-")
    bare_app = os.path.join(bare_dir, "bare.py")
    Path(bare_app).write_text(BARE_APP)
    bare_port = port + 1
    servers = [([sys.executable, "-m", "kvtrace", "dashboard", "--db", db, "--port", str(port)], port, None),
               (streamlit_command(bare_app, bare_port), bare_port, None)]
    results: dict[str, dict[str, list]] = {
        p: {"cold": [], "warm": [], "cold_ratio": [], "warm_ratio": [], "switch": [], "profile": []}
        for p in ["bare", *PAGES]}
    with chromium_beside(servers, bare_dir) as chromium:
        def url_of(name: str) -> str:
            return (f"http://127.0.0.1:{bare_port}/" if name == "bare"
                    else f"http://127.0.0.1:{port}/{URLS.get(name, name)}")

        warm = {"kvtrace": warm_tab(chromium), "bare": warm_tab(chromium)}
        first_chart(warm["kvtrace"], f"http://127.0.0.1:{port}/")  # each server's first session, the HTTP cache
        first_chart(warm["bare"], f"http://127.0.0.1:{bare_port}/")
        for number in range(rounds):
            for index, name in enumerate(PAGES):
                # Each page beside a bare load of its own, one just before or just after it (alternating), so
                # that a pair shares the machine: loads a minute apart differed by more than the target's margin
                # (one page's warm loads 0.58-1.83 s in one run; docs/PERFORMANCE.md).
                pair = ["bare", name] if (number + index) % 2 == 0 else [name, "bare"]
                for member in pair:
                    cold_page = new_tab(chromium)
                    results[member]["cold"].append(first_chart(cold_page, url_of(member)))
                    cold_page.context.close()
                for member in pair:
                    tab = warm["bare" if member == "bare" else "kvtrace"]
                    # The closed context's session is torn down on the server, and its renderer in Chromium: a
                    # warm load at once shared the machine with that (Trace 0.977 against 0.790 s after 2 s;
                    # the bare page 0.573 against 0.575; docs/PERFORMANCE.md), as no reload in a user's tab does.
                    tab.wait_for_timeout(SETTLE_MS)
                    results[member]["warm"].append(first_chart(tab, url_of(member)))
                for kind in ("cold", "warm"):
                    results[name][f"{kind}_ratio"].append(results[name][kind][-1] / results["bare"][kind][-1])
            # In-app: the same tab moving page to page by the sidebar's links, as users do once the
            # dashboard is open (no new document: only the page's script run and its elements).
            for name in PAGES:
                took = warm["kvtrace"].evaluate(SWITCH_SCRIPT, URLS.get(name, name))
                if took is None:
                    raise RuntimeError(f"no new chart within 30 s of clicking the link to {name}")
                results[name]["switch"].append(took / 1000)
                warm["kvtrace"].wait_for_timeout(SETTLE_MS)
            print(f"  browser: round {number + 1}/{rounds} done", file=sys.stderr)
        for number in range(rounds if profile else 0):  # after the timed rounds: the profiler slows the page
            for name in ["bare", *PAGES]:
                tab = warm["bare" if name == "bare" else "kvtrace"]
                tab.wait_for_timeout(PROFILE_IDLE_MS)
                results[name]["profile"].append(main_thread_profile(tab, url_of(name)))
            print(f"  browser: profiled round {number + 1}/{rounds} done", file=sys.stderr)
    return results


def print_profiles(seen: dict[str, dict[str, list]], rounds: int) -> None:
    """Per page, the profiled warm loads' medians: the time to the first chart, and the main thread's ms up to it
    by where they went (:func:`main_thread_profile`), the four costliest script chunks by name."""
    print(f"\nbrowser main thread until the first chart, warm, under the CPU profiler (slower than the timed loads), "
          f"median of {rounds} (ms): 'outside JS' is the browser's own work (parsing, style, layout, paint); "
          "'DOM calls' the native functions scripts called (forced layouts among them)")
    fixed = ("idle", "gc", "outside JS", "DOM calls")
    print(f"  {'page':<14}{'first':>7}{'busy':>7}" + "".join(f"{k:>12}" for k in fixed) + "   scripts (costliest chunks)")
    for page, r in seen.items():
        loads = r["profile"]
        if not loads:
            continue
        median = {k: statistics.median(spent.get(k, 0.0) for _, spent in loads)
                  for k in set().union(*(spent for _, spent in loads))}
        scripts = sorted(((ms, k) for k, ms in median.items() if k not in fixed), reverse=True)
        busy = sum(ms for k, ms in median.items() if k != "idle")
        print(f"  {page:<14}{statistics.median(t for t, _ in loads) * 1000:>7.0f}{busy:>7.0f}"
              + "".join(f"{median.get(k, 0.0):>12.0f}" for k in fixed)
              + "   " + ", ".join(f"{k} {ms:.0f}" for ms, k in scripts[:4]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--db", help="store path (default: a temporary file, removed at the end)")
    parser.add_argument("--reuse", action="store_true", help="use --db as it is if it exists")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8593)
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="then profile a warm load of each page per round: where the browser's main thread "
                             "spends its time until the first chart")
    args = parser.parse_args()
    tmp = None
    db = args.db
    if db is None:
        tmp = tempfile.mkdtemp(prefix="kvtrace-scale-")
        db = os.path.join(tmp, "scale.duckdb")
    try:
        if not (args.reuse and Path(db).exists()):
            for leftover in (db, f"{db}.wal"):
                Path(leftover).unlink(missing_ok=True)
            shutil.rmtree(f"{db}.kvtrace-wal", ignore_errors=True)
            build(db, args.requests)
        from kvtrace.collectors.read import open_store

        count = open_store(db).sql("SELECT count(*) AS n FROM requests").to_pylist()[0]["n"]
        rollups = open_store(db).sql("SELECT (SELECT count(*) FROM request_rollup) AS r, "
                                     "(SELECT count(*) FROM stage_rollup) AS s").to_pylist()[0]
        print(f"store: {count:,} requests; rollup rows: {rollups['r']:,} request, {rollups['s']:,} stage")
        server = server_side(db, args.rounds)
        print(f"\nserver side, median of {args.rounds} (s): the page's whole script run, and the part spent in "
              "store queries")
        print(f"  {'page':<14}{'first paint':>12}{'queries':>10}{'re-filter':>12}{'queries':>10}")
        for page, r in server.items():
            print(f"  {page:<14}{statistics.median(r['paint']):>12.3f}{statistics.median(r['paint_q']):>10.3f}"
                  f"{statistics.median(r['refilter']):>12.3f}{statistics.median(r['refilter_q']):>10.3f}")
        if not args.no_browser:
            seen = browser(db, args.rounds, args.port, args.profile)
            bare = {k: statistics.median(seen["bare"][k]) for k in ("cold", "warm")}
            print(f"\nbrowser (Chromium), median of {args.rounds} (s): navigation to the first Plotly chart; ratio: "
                  f"the median over the rounds of the page's time over the bare one-chart Streamlit page's loaded "
                  f"next to it (the bare page's median cold {bare['cold']:.2f}, warm {bare['warm']:.2f}); target: "
                  f"each ratio <= {TARGET_RATIO}")
            print(f"  {'page':<14}{'cold':>8}{'range':>12}{'ratio':>7}{'pairs':>7}{'warm':>8}{'range':>12}{'ratio':>7}"
                  f"{'pairs':>7}{'in-app':>8}{'range':>12}   (pairs: how many of its pairs were within the target)")
            missed = []
            for page, r in seen.items():
                cold, warm = statistics.median(r["cold"]), statistics.median(r["warm"])
                ratios = (1.0, 1.0) if page == "bare" else (statistics.median(r["cold_ratio"]),
                                                            statistics.median(r["warm_ratio"]))
                within = {k: "" if page == "bare" else
                          f"{sum(x <= TARGET_RATIO for x in r[f'{k}_ratio'])}/{len(r[f'{k}_ratio'])}"
                          for k in ("cold", "warm")}
                spread = {k: f"{min(r[k]):.2f}-{max(r[k]):.2f}"  # this VM's noise, per page
                          for k in ("cold", "warm", "switch") if r[k]}
                switch = f"{statistics.median(r['switch']):>8.2f}{spread['switch']:>12}" if r["switch"] else ""
                print(f"  {page:<14}{cold:>8.2f}{spread['cold']:>12}{ratios[0]:>7.2f}{within['cold']:>7}{warm:>8.2f}"
                      f"{spread['warm']:>12}{ratios[1]:>7.2f}{within['warm']:>7}{switch}")
                if page == "bare":
                    continue
                missed += [f"{page} {kind}" for kind, ratio in zip(("cold", "warm"), ratios) if ratio > TARGET_RATIO]
            print("every page within the target" if not missed else f"missed: {', '.join(missed)}")
            if args.profile:
                print_profiles(seen, args.rounds)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
