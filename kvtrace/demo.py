"""``kvtrace demo``: a real 1P1D pair on this machine, traced into the embedded collector.

Builds the tiny local model, starts the kvtrace collector (OTLP in, DuckDB store) and then,
per mode, P, D and the router on 127.0.0.1 with the kvtrace connectors; sends a mixed
workload, waits for every trace to be attributed, and prints where time to first token
went — per mode, the TTFT percentiles and the critical-path split into compute, queue,
coordination and wire, then each stage's median duration and critical part — and serves the
dashboard on the demo's data until Ctrl-C (``--no-dashboard`` for scripts). Stops every
process it started and removes the shared memory they left; the DuckDB file stays.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
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


def run(modes: list[str], requests: int, max_tokens: int, db: Path, dashboard: bool, port: int) -> None:
    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.read import Filters, open_store
    from kvtrace.collectors.service import Collector
    from kvtrace.testbed.launch import LocalPair, PairConfig
    from kvtrace.testbed.recipes import build

    print("building the tiny local model (once; cached)...", file=sys.stderr)
    model_dir = build()
    collector = Collector(CollectorConfig(db_path=str(db), grpc_port=None, http_port=0, decision_wait_s=1.0))
    collector.start()
    endpoint = collector.receivers[0].endpoint
    store = open_store(db)  # through the collector's query endpoint while it runs
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        for mode in modes:
            run_id = f"demo-{mode}-{stamp}"
            print(f"starting a {mode} pair: prefill, decode and router on 127.0.0.1 (about 40 s)...",
                  file=sys.stderr)
            with LocalPair(PairConfig(mode=mode, model_dir=model_dir, otlp_endpoint=endpoint, run_id=run_id)) as pair:
                for i in range(requests):
                    _send(pair.router_url, i, (30, 300, 700)[i % 3], max_tokens)
                    _progress(f"{mode} requests", i + 1, requests)
                deadline = time.monotonic() + 30
                mine = Filters(runs=(run_id,))
                while time.monotonic() < deadline:  # every trace attributed
                    k = store.kpis(mine)
                    if k["requests"] - k["incomplete"] >= requests:
                        break
                    time.sleep(0.5)
        collector.assembler.poll(flush_all=True)
        collector.store.flush()
        _report(store, Filters(runs=tuple(f"demo-{mode}-{stamp}" for mode in modes)), modes)
        print(f"\nstored in {db} (`kvtrace query --db {db} \"SELECT * FROM requests\"`)")
        if dashboard:
            _serve_dashboard(db, port)
    finally:
        collector.shutdown()


def _report(store, f, modes: list[str]) -> None:
    """Per mode, TTFT percentiles and the critical-path split, then each stage's median and critical part."""
    from kvtrace.collectors.read import ESTIMATE_ERROR_TEXT, PART_COLUMNS

    kpis = {mode: store.kpis(dataclasses.replace(f, modes=(mode,))) for mode in modes}
    rows = [{"mode": r["mode"], "requests": r["requests"], **{k: kpis[r["mode"]][k] for k in (
             "ttft_p50_ms", "ttft_p90_ms")}, **{c: r[c] for c in PART_COLUMNS}}
            for r in store.parts_by_mode(f).to_pylist()]
    print("\nTTFT and where it went (critical path; p50/p90 of TTFT, mean of each part, in ms), per mode:")
    print(_table(rows, [("mode", "mode", ""), ("requests", "requests", "d"), ("ttft_p50_ms", "TTFT p50", ".1f"),
                        ("ttft_p90_ms", "p90", ".1f"), ("compute_ms", "compute", ".1f"), ("queue_ms", "queue", ".1f"),
                        ("coordination_ms", "coordination", ".1f"), ("wire_ms", "wire", ".1f"),
                        ("unattributed_ms", "unattributed", ".1f")]))
    shares = store.unattributed_shares(f)
    print("unattributed share of TTFT: " + "; ".join(
        f"{mode} p50 {shares[mode]['p50']:.1%}, p90 {shares[mode]['p90']:.1%}" for mode in modes if mode in shares))
    stages = store.stage_table(f)
    measured = ("exact" if all(r["quantiles_exact"] for r in stages) else
                f"histogram estimate, {ESTIMATE_ERROR_TEXT}")
    for mode in modes:
        print(f"\n{mode}: each stage, median duration ({measured}) and its mean time on the critical path (ms)")
        print(_table([r for r in stages if r["mode"] == mode], [
            ("side", "side", ""), ("stage", "stage", ""), ("category", "category", ""),
            ("p50_ms", "duration", ".2f"), ("critical_per_request_ms", "critical", ".2f")]))


def _serve_dashboard(db: Path, port: int) -> None:
    """The dashboard on the demo's store (the collector keeps serving it) until Ctrl-C."""
    import signal

    from kvtrace.dashboard.launch import start, stop
    from kvtrace.dashboard.settings import Settings

    process = start(Settings(db=str(db)), port=port)
    print(f"\nthe dashboard: http://127.0.0.1:{port}   (Ctrl-C stops it and the collector)", flush=True)
    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        while not stopped.is_set() and process.poll() is None:
            stopped.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtrace demo", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["push", "pull", "both"], default="both")
    parser.add_argument("--requests", type=int, default=12, help="requests per mode (default 12)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--db", type=Path, default=Path("kvtrace-demo.duckdb"),
                        help="DuckDB file for the collector (default ./kvtrace-demo.duckdb)")
    parser.add_argument("--no-dashboard", action="store_true", help="print the breakdown and exit (for scripts)")
    parser.add_argument("--port", type=int, default=8501, help="the dashboard's port (default 8501)")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    run(["push", "pull"] if args.mode == "both" else [args.mode], args.requests, args.max_tokens, args.db,
        dashboard=not args.no_dashboard, port=args.port)
    return 0
