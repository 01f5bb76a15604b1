"""The Grafana dashboard's every query, evaluated by Debian's Prometheus server scraping a real traced
pair (P's and D's vLLM /metrics) and the collector, all on 127.0.0.1: each returns data."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from kvtrace.testbed.launch import LocalPair, PairConfig, free_port
from tests.e2e.pair import Call, prompt, send
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "dashboard" / "grafana" / "kvtrace.json"
PROMETHEUS = "/usr/bin/prometheus"
sys.path.insert(0, str(BOARD.parent))
import build as grafana_board  # noqa: E402  (dashboard/grafana/build.py: the panels' one definition)


def prom_query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_the_committed_json_is_what_build_py_writes():
    assert json.loads(BOARD.read_text()) == grafana_board.dashboard()


@pytest.fixture(scope="module")
def prometheus_over_a_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grafana")
    db, otlp_port, metrics_port, prom_port = str(tmp / "c.duckdb"), free_port(), free_port(), free_port()
    started: list[subprocess.Popen] = []

    def spawn(command: list[str], name: str) -> subprocess.Popen:
        log = open(tmp / f"{name}.log", "wb")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        started.append(proc)
        return proc

    try:
        spawn([sys.executable, "-m", "kvtrace", "collector", "--db", db, "--grpc-port", "-1", "--http-port",
               str(otlp_port), "--metrics-port", str(metrics_port), "--decision-wait", "1.0"], "collector")
        assert wait_until(lambda: Path(f"{db}.kvtrace-collector.json").exists(), 30)
        with LocalPair(PairConfig(mode="push", otlp_endpoint=f"http://127.0.0.1:{otlp_port}/v1/traces",
                                  log_dir=tmp / "pair")) as pair:
            targets = [urllib.parse.urlparse(u).netloc for u in (pair.prefill_url, pair.decode_url)]
            (tmp / "prometheus.yml").write_text(
                "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                "scrape_configs:\n"
                f"  - job_name: vllm\n    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
                f"  - job_name: kvtrace-collector\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
            spawn([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                   f"--web.listen-address=127.0.0.1:{prom_port}"], "prometheus")
            base = f"http://127.0.0.1:{prom_port}"
            assert wait_until(lambda: len([t for t in _targets(base) if t["health"] == "up"]) == 3, 60), _targets(base)
            for i in range(8):  # bounded: 8 requests, then one to carry the last stats
                send(pair.router_url, Call(f"graf-{i}", i % 2 == 1, i % 3 == 0, prompt(i, (30, 400, 900)[i % 3])))
                time.sleep(0.5)
            send(pair.router_url, Call("graf-carrier", False, False, prompt(99, 20)))
            time.sleep(12)  # the collector decides traces; Prometheus scrapes a few times
            yield base
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)


def _targets(base: str) -> list[dict]:
    try:
        with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=5) as resp:
            return json.load(resp)["data"]["activeTargets"]
    except OSError:
        return []


@pytest.mark.parametrize("title,expr", grafana_board.queries(grafana_board.dashboard()))
def test_every_panel_query_returns_data(prometheus_over_a_pair, title, expr):
    # Grafana fills $__rate_interval in; over 1 s scrapes a minute covers the whole run
    result = prom_query(prometheus_over_a_pair, expr.replace("$__rate_interval", "1m"))
    assert result, f"{title}: no data for {expr}"
    values = [float(series["value"][1]) for series in result]
    if not expr.endswith("or vector(0)"):  # a measured panel: at least one real number
        assert any(math.isfinite(v) and v >= 0 for v in values), (title, expr, result)
