"""``kvtrace demo``: a real 1P1D pair on this machine, traced, in push and in pull.

Builds the tiny local model, starts P, D and the router on 127.0.0.1 with the kvtrace
connectors, sends a mixed workload, receives every span over OTLP/gRPC in this process and
prints, per mode, the median duration of each stage and the router's TTFT. Stops every
process it started and removes the shared memory they left.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from collections import defaultdict

from kvtrace.collectors.receivers import OtlpGrpcReceiver
from kvtrace.telemetry.semconv import STAGE_ORDER

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


class _Spans:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, int, dict]] = []  # (trace id, stage, duration ns, attrs)
        self._lock = threading.Lock()

    def __call__(self, request) -> None:
        rows = []
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {a.key: a.value for a in span.attributes}
                    stage = attrs["kvtrace.stage"].string_value if "kvtrace.stage" in attrs else span.name
                    rows.append((span.trace_id.hex(), stage,
                                 span.end_time_unix_nano - span.start_time_unix_nano, attrs))
        with self._lock:
            self.rows.extend(rows)


def _send(url: str, i: int, words: int, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)),
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": f"demo-{i}"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()


def _progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    print(f"\r  {label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end="", file=sys.stderr,
          flush=True)
    if done == total:
        print(file=sys.stderr)


def run(modes: list[str], requests: int, max_tokens: int) -> dict[str, dict[str, float]]:
    from kvtrace.testbed.launch import LocalPair, PairConfig
    from kvtrace.testbed.model import build

    print("building the tiny local model (once; cached)...", file=sys.stderr)
    model_dir = build()
    medians: dict[str, dict[str, float]] = {}
    for mode in modes:
        spans = _Spans()
        receiver = OtlpGrpcReceiver(spans, port=0)
        receiver.start()
        try:
            print(f"starting a {mode} pair: prefill, decode and router on 127.0.0.1 (about 40 s)...",
                  file=sys.stderr)
            with LocalPair(PairConfig(mode=mode, model_dir=model_dir, otlp_endpoint=receiver.endpoint)) as pair:
                for i in range(requests):
                    _send(pair.router_url, i, (30, 300, 700)[i % 3], max_tokens)
                    _progress(f"{mode} requests", i + 1, requests)
                time.sleep(2)  # the last spans of every process
        finally:
            receiver.shutdown()
        per_stage: dict[str, list[float]] = defaultdict(list)
        for _, stage, duration, attrs in spans.rows:
            if stage == "pd.request" and "kvtrace.router.ttft_ns" in attrs:
                per_stage["TTFT (router)"].append(attrs["kvtrace.router.ttft_ns"].int_value / 1e6)
            elif stage not in ("pd.request", "pd.route"):
                per_stage[stage].append(duration / 1e6)
        medians[mode] = {stage: statistics.median(values) for stage, values in per_stage.items()}
    return medians


def print_table(medians: dict[str, dict[str, float]]) -> None:
    modes = list(medians)
    order = [s.name.lower() for s in STAGE_ORDER] + ["TTFT (router)"]
    stages = [s for s in order if any(s in m for m in medians.values())]
    print("\nmedian per stage, ms (stages a mode does not have are blank)")
    print(f"{'stage':<18}" + "".join(f"{m:>10}" for m in modes))
    for stage in stages:
        cells = "".join(f"{medians[m][stage]:>10.2f}" if stage in medians[m] else f"{'':>10}" for m in modes)
        print(f"{stage:<18}{cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtrace demo", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["push", "pull", "both"], default="both")
    parser.add_argument("--requests", type=int, default=12, help="requests per mode (default 12)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    modes = ["push", "pull"] if args.mode == "both" else [args.mode]
    print_table(run(modes, args.requests, args.max_tokens))
    return 0
