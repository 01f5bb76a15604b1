"""``kvtrace demo``: a real 1P1D pair on this machine, traced into the embedded collector.

Builds the tiny local model, starts the kvtrace collector (OTLP in, DuckDB store) and then,
per mode, P, D and the router on 127.0.0.1 with the kvtrace connectors; sends a mixed
workload, waits for every trace to be attributed, and prints where time to first token
went — per mode, the TTFT percentiles and the critical-path split into compute, queue,
coordination and wire, then each stage's median duration and critical part. Stops every
process it started and removes the shared memory they left; the DuckDB file stays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def _send(url: str, i: int, words: int, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)),
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()


def _progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    end = "\n" if done == total else ""
    print(f"\r  {label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, file=sys.stderr,
          flush=True)


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format)."""
    widths = [max(len(h), *(len(format(r[k], f)) if r[k] is not None else 1 for r in rows)) for k, h, f in columns]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths))]
    for row in rows:
        lines.append("  ".join((format(row[k], f) if row[k] is not None else "-").rjust(w)
                               for (k, _, f), w in zip(columns, widths)))
    return "\n".join(lines)


def run(modes: list[str], requests: int, max_tokens: int, db: Path) -> None:
    from kvtrace.collectors import queries
    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.service import Collector
    from kvtrace.testbed.launch import LocalPair, PairConfig
    from kvtrace.testbed.model import build

    print("building the tiny local model (once; cached)...", file=sys.stderr)
    model_dir = build()
    collector = Collector(CollectorConfig(db_path=str(db), grpc_port=None, http_port=0, decision_wait_s=1.0))
    collector.start()
    endpoint = collector.receivers[0].endpoint
    try:
        for mode in modes:
            print(f"starting a {mode} pair: prefill, decode and router on 127.0.0.1 (about 40 s)...",
                  file=sys.stderr)
            before = collector.store.query("SELECT count(*) FROM requests WHERE mode = ?", [mode])[0][0]
            with LocalPair(PairConfig(mode=mode, model_dir=model_dir, otlp_endpoint=endpoint)) as pair:
                for i in range(requests):
                    _send(pair.router_url, i, (30, 300, 700)[i % 3], max_tokens)
                    _progress(f"{mode} requests", i + 1, requests)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # every trace attributed
                    collector.store.flush()
                    done = collector.store.query("SELECT count(*) FROM requests WHERE mode = ? AND complete",
                                                 [mode])[0][0]
                    if done - before >= requests:
                        break
                    time.sleep(0.5)
        collector.assembler.poll(flush_all=True)
        collector.store.flush()
        con = collector.store._con
        print("\nTTFT and where it went (critical path, medians in ms), per mode:")
        print(_table(queries.percentiles(con, "mode").to_pylist(), [
            ("group", "mode", ""), ("requests", "requests", "d"), ("ttft_p50_ms", "TTFT p50", ".1f"),
            ("ttft_p90_ms", "p90", ".1f"), ("compute_p50_ms", "compute", ".1f"), ("queue_p50_ms", "queue", ".1f"),
            ("coordination_p50_ms", "coordination", ".1f"), ("wire_p50_ms", "wire", ".1f"),
            ("unattributed_p50_ms", "unattributed", ".1f")]))
        for mode in modes:
            print(f"\n{mode}: each stage, median duration and median part on the critical path (ms)")
            print(_table(queries.stage_summary(con, mode).to_pylist(), [
                ("side", "side", ""), ("stage", "stage", ""), ("category", "category", ""),
                ("duration_p50_ms", "duration", ".2f"), ("critical_p50_ms", "critical", ".2f")]))
        print(f"\nstored in {db} (tables requests, span_rows, origins, batches, runs; views spans, stages)")
    finally:
        collector.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtrace demo", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["push", "pull", "both"], default="both")
    parser.add_argument("--requests", type=int, default=12, help="requests per mode (default 12)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--db", type=Path, default=Path("kvtrace-demo.duckdb"),
                        help="DuckDB file for the collector (default ./kvtrace-demo.duckdb)")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    run(["push", "pull"] if args.mode == "both" else [args.mode], args.requests, args.max_tokens, args.db)
    return 0
