#!/usr/bin/env python3
"""What tracing costs a real 1P1D pair: TTFT and TPOT with kvtrace on (100 % sampled) vs off.

Two pairs run side by side on this machine (same model, same cores, same connectors; one
with ``kvtrace.enabled: true`` exporting every span to an OTLP receiver here, one with
``enabled: false``). Requests alternate between them, one at a time, so drift on the
machine hits both alike; the run is done twice with the pairs' start order swapped. TTFT is the client's time to the first streamed token through
each pair's router; TPOT is the mean gap between the following tokens.

Target (issue 3): <= 1 % difference in TTFT p50 and TPOT p50.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtrace.collectors.receivers import OtlpGrpcReceiver, OtlpHttpReceiver  # noqa: E402
from kvtrace.testbed.launch import LocalPair, PairConfig  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(words))


def stream_timings(base_url: str, text: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in ms for one streamed completion."""
    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    arrivals = []
    with urllib.request.urlopen(request, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(f"expected {max_tokens} streamed tokens, got {len(arrivals)}")
    ttft = (arrivals[0] - start) * 1000
    tpot = (arrivals[-1] - arrivals[0]) * 1000 / (len(arrivals) - 1)
    return ttft, tpot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--requests", type=int, default=60, help="requests per side (default 60)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--protocol", choices=["grpc", "http/protobuf"], default="http/protobuf",
                        help="OTLP protocol the traced engines export with (default http/protobuf)")
    parser.add_argument("--metrics-only", action="store_true",
                        help="the traced side records but exports no spans (isolates the export's cost)")
    parser.add_argument("--aa", action="store_true",
                        help="A/A run: both pairs untraced, to measure the noise floor of the setup")
    args = parser.parse_args()
    if args.requests < 2 or args.max_tokens < 3:
        parser.error("--requests must be >= 2 and --max-tokens >= 3")

    spans = [0]

    def count(batch):
        spans[0] += len(batch.rows)

    sink = (OtlpGrpcReceiver if args.protocol == "grpc" else OtlpHttpReceiver)(count, port=0)
    sink.start()
    results: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    # Two rounds with the traced pair first, then second, to launch: whatever the order of
    # start-up does to a pair (it measured up to 3 % in an A/A run) falls on both sides.
    try:
        for round_, first in enumerate(("on", "off")):
            configs = {"on": PairConfig(mode=args.mode, tracing=args.aa is False,
                                        otlp_endpoint=None if args.aa or args.metrics_only else sink.endpoint,
                                        otlp_protocol=args.protocol),
                       "off": PairConfig(mode=args.mode, tracing=False)}
            second = "off" if first == "on" else "on"
            print(f"round {round_ + 1}/2: starting two {args.mode} pairs ({first} first)...", file=sys.stderr)
            with LocalPair(configs[first]) as a, LocalPair(configs[second]) as b:
                pairs = {first: a, second: b}
                for warm in range(2):  # first requests pay one-time handshakes: not counted
                    for pair in pairs.values():
                        stream_timings(pair.router_url, prompt(warm, 50), args.max_tokens)
                half = args.requests // 2
                for i in range(half):
                    words = (40, 400, 800)[i % 3]
                    order = ("on", "off") if i % 2 == 0 else ("off", "on")
                    for side in order:
                        results[side].append(stream_timings(pairs[side].router_url, prompt(i, words),
                                                             args.max_tokens))
                    print(f"\r{i + 1}/{half}", end="", file=sys.stderr, flush=True)
                print(file=sys.stderr)
                time.sleep(2)  # the traced side's last spans
    finally:
        sink.shutdown()

    def p50(side: str, index: int) -> float:
        return statistics.median(r[index] for r in results[side])

    ttft_on, ttft_off, tpot_on, tpot_off = p50("on", 0), p50("off", 0), p50("on", 1), p50("off", 1)
    ttft_ratio, tpot_ratio = ttft_on / ttft_off, tpot_on / tpot_off
    if args.aa:
        print("A/A run: both sides untraced; the ratios below are the setup's noise floor")
    print(f"spans exported over OTLP {args.protocol}" + (" (metrics only)" if args.metrics_only else ""))
    print(f"mode {args.mode}, {args.requests} requests per side, {args.max_tokens} tokens each, "
          f"prompts of ~40/400/800 words; spans received from the traced pair: {spans[0]}")
    print(f"{'':14}{'tracing on':>12}{'tracing off':>13}{'ratio':>8}")
    print(f"{'TTFT p50 ms':14}{ttft_on:>12.1f}{ttft_off:>13.1f}{ttft_ratio:>8.3f}")
    print(f"{'TPOT p50 ms':14}{tpot_on:>12.2f}{tpot_off:>13.2f}{tpot_ratio:>8.3f}")
    within = round(abs(ttft_ratio - 1), 3) <= 0.01 and round(abs(tpot_ratio - 1), 3) <= 0.01
    print("target (<= 1 % difference):", "met" if within else "not met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
