#!/usr/bin/env python3
"""Writes ``kvtrace.json``, the Grafana dashboard over kvtrace's Prometheus metrics, from the panel
list below (the one place its queries live; the Prometheus test evaluates each of them).

    python dashboard/grafana/build.py      # after editing PANELS
"""

from __future__ import annotations

import json
from pathlib import Path

RATE = "$__rate_interval"
NOTE = (
    "Prometheus pools requests into histograms: these panels show distributions, never one request's "
    "story, and a percentile of a stage is not the stage of the request at that percentile. For per-request "
    "exactness — where each millisecond of one request's TTFT went, and which stage was on its critical "
    "path — open the kvtrace dashboard's Trace view (`kvtrace dashboard --db PATH`), or follow a `trace_id` "
    "exemplar (metrics_port endpoints) into your trace backend."
)


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legend": legend}


def quantiles(metric: str, by: str) -> list[dict]:
    return [q(f"histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))",
              f"p{int(p * 100)} " + " ".join("{{%s}}" % label.strip() for label in by.split(",")))
            for p in (0.5, 0.9, 0.99)]


# (title, unit, queries). Counters that exist only after their first event end in `or vector(0)`,
# so a healthy deployment shows 0 rather than "no data".
PANELS: list[tuple[str, str, list[dict]]] = [
    ("Stage latency by mode and role (p50, p90, p99)", "s",
     quantiles("kvtrace_stage_duration_seconds", "stage, mode, role")),
    ("Collector: TTFT parts by mode (p50, p90)", "s",
     [q(f"histogram_quantile({p}, sum by (le, mode, category) (rate(kvtrace_ttft_part_seconds_bucket[{RATE}])))",
        f"p{int(p * 100)} {{{{mode}}}} {{{{category}}}}") for p in (0.5, 0.9)]),
    ("Collector: TTFT seen by the router, next to vLLM's (p90)", "s",
     [q(f"histogram_quantile(0.9, sum by (le, mode) (rate(kvtrace_ttft_seconds_bucket[{RATE}])))", "router {{mode}}"),
      q(f"histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[{RATE}])))",
        "vLLM (D's own, decode leg only)")]),
    ("KV bytes moved", "Bps",
     [q(f"sum by (op, mode, role) (rate(kvtrace_transfer_bytes_total[{RATE}]))", "{{op}} {{mode}} {{role}}")]),
    ("NIXL transfer time (vLLM's own, p90)", "s",
     [q(f"histogram_quantile(0.9, sum by (le) (rate(vllm:nixl_xfer_time_seconds_bucket[{RATE}])))", "NIXL xfer p90")]),
    ("KV-handoff failures", "short",
     [q(f"sum by (cause, mode, role) (increase(kvtrace_transfer_failures_total[{RATE}])) or vector(0)",
        "{{cause}} {{mode}} {{role}}")]),
    ("Connector time on the engine loop, per step (p99)", "s",
     quantiles("kvtrace_engine_loop_seconds", "part, mode, role")[2:]),
    ("kvtrace's own health: dropped records and export failures", "short",
     [q(f"sum by (mode, role) (increase(kvtrace_dropped_records_total[{RATE}])) or vector(0)", "dropped {{role}}"),
      q(f"sum by (mode, role) (increase(kvtrace_export_failures_total[{RATE}])) or vector(0)",
        "export failures {{role}}"),
      q(f"sum(increase(kvtrace_collector_requests_rejected_total[{RATE}])) or vector(0)", "collector rejected")]),
    # The collector's receiver spends ~0.3 ms of CPU per export request whatever its size (README, "Senders'
    # batches"): few spans per request makes the same load cost it more.
    ("Collector: spans per export request (senders' batching)", "short",
     [q(f"sum(rate(kvtrace_collector_spans_received_total[{RATE}])) / "
        f"sum(rate(kvtrace_collector_export_requests_total[{RATE}]))", "spans per request")]),
]


def dashboard() -> dict:
    panels: list[dict] = [{
        "type": "text", "title": "Read this first", "id": 1, "gridPos": {"h": 4, "w": 24, "x": 0, "y": 0},
        "options": {"mode": "markdown", "content": NOTE},
    }]
    for i, (title, unit, queries) in enumerate(PANELS):
        panels.append({
            "type": "timeseries", "title": title, "id": i + 2,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 4 + 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": t["expr"], "legendFormat": t["legend"],
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}} for j, t in enumerate(queries)],
        })
    return {
        "title": "kvtrace — KV handoff (Prometheus)", "uid": "kvtrace-prometheus", "schemaVersion": 39,
        "tags": ["kvtrace", "vllm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "links": [{"title": "kvtrace dashboard (per-request traces)", "type": "link", "url": "http://127.0.0.1:8501",
                   "targetBlank": True}],
        "panels": panels,
    }


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of a dashboard JSON."""
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", ())]


if __name__ == "__main__":
    out = Path(__file__).with_name("kvtrace.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out} ({len(queries(dashboard()))} queries)")
