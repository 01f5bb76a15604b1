#!/usr/bin/env python3
"""Connector cost per engine step, traced vs untraced, measured in-process (low noise).

The pair benchmark (connector_overhead.py) sees TTFT/TPOT through HTTP, two engines and a
router, where the setup's own noise is a few percent. This one isolates what tracing adds
to one decode step: it builds vLLM's real decode-side connectors (scheduler and worker
roles, push and pull) with and without kvtrace tracing, on a fake NIXL agent, and times
the connector calls vLLM makes every step — ``build_connector_meta``,
``update_connector_output``, ``bind_connector_metadata``, ``start_load_kv``,
``get_transfer_results``, ``build_connector_worker_meta``, ``clear_connector_metadata`` —
for a batch of running requests. Rounds alternate between the two.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(model_dir: str, mode: str, traced: bool):
    from kvtrace.testbed.inproc import build_connector, stand_in_transfer_topology

    connector = "NixlPushConnector" if mode == "push" else "NixlPullConnector"
    block = {"exporter": "console" if traced else "none", "enabled": traced}
    scheduler = build_connector(model_dir, connector, "kv_consumer", "scheduler", "d-engine", block)
    worker = build_connector(model_dir, connector, "kv_consumer", "worker", "d-engine", block)
    stand_in_transfer_topology(worker.connector_worker)
    return scheduler, worker


def steps(scheduler, worker, n: int, batch: int) -> float:
    from vllm.v1.outputs import KVConnectorOutput

    output = SimpleNamespace(num_scheduled_tokens={f"cmpl-r{i}-0-aaaaaaaa": 1 for i in range(batch)})
    start = time.perf_counter_ns()
    for _ in range(n):
        meta = scheduler.build_connector_meta(output)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        results = worker.get_transfer_results(set())
        report = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        scheduler.update_connector_output(KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            kv_connector_worker_meta=report))
    return (time.perf_counter_ns() - start) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5000, help="steps per round (default 5000)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=8, help="running requests per step")
    parser.add_argument("--tpot-ms", type=float, default=11.0,
                        help="a decode step's duration to compare against (the pair's TPOT p50)")
    args = parser.parse_args()

    import logging

    logging.disable(logging.WARNING)  # the console exporter and vLLM's start-up chatter
    from kvtrace.telemetry import setup as telemetry_setup
    from kvtrace.testbed.recipes import build as build_model

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    telemetry_setup.build_exporter = lambda config: InMemorySpanExporter()  # spans kept, not printed
    model_dir = str(build_model())
    print(f"{'mode':<6}{'untraced ns/step':>18}{'traced ns/step':>16}{'added':>10}{'of a step':>12}")
    for mode in ("push", "pull"):
        sides = {"off": build(model_dir, mode, False), "on": build(model_dir, mode, True)}
        samples: dict[str, list[float]] = {"off": [], "on": []}
        for round_ in range(args.rounds + 1):
            for side in (("off", "on") if round_ % 2 else ("on", "off")):
                gc.collect()
                ns = steps(*sides[side], args.steps, args.batch)
                if round_:  # round 0 warms up
                    samples[side].append(ns)
        off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
        added = on - off
        print(f"{mode:<6}{off:>18.0f}{on:>16.0f}{added:>9.0f}ns{100 * added / (args.tpot_ms * 1e6):>11.3f}%")
    print(f"(batch of {args.batch} running requests; 'of a step' against a {args.tpot_ms} ms decode step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
