#!/usr/bin/env python3
"""Collector ingest: spans per CPU-second, kvtrace's collector beside rotel, on the same load.

The load is contract-shaped traces (14 spans each: router, P and D stages with kvtrace's
attributes), pre-encoded into OTLP export requests of ~500 spans. Each collector runs as
its own process pinned to one core; this process sends from the other core over OTLP/gRPC
with four streams. kvtrace's collector receives, writes its write-ahead log, decodes,
stores in DuckDB (Arrow batches), assembles and attributes every trace; rotel receives,
batches and exports to its blackhole. Throughput is spans divided by the collector
process's own CPU time (user + system, all threads, from wait4), so "per core" holds
whatever else the machine does; wall time is printed too.

Target (issue 4): >= 100k spans/s per core for kvtrace.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402

from kvtrace.collectors.peers import rotel_binary  # noqa: E402
from kvtrace.testbed.launch import free_port  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
STAGES = [  # (service, role, span name, stage, category)
    ("kvtrace-router", "router", "pd.request", "pd_request", "root"),
    ("kvtrace-router", "router", "pd.route", "pd_route", "coordination"),
    ("vllm-prefill", "producer", "engine.queue", "p_queue", "queue"),
    ("vllm-prefill", "producer", "engine.prefill", "prefill", "compute"),
    ("vllm-prefill", "producer", "kv.registration", "registration", "coordination"),
    ("vllm-prefill", "producer", "kv.rendezvous", "rendezvous", "coordination"),
    ("vllm-prefill", "producer", "kv.descriptor_prep", "descriptor_prep", "coordination"),
    ("vllm-prefill", "producer", "kv.write", "write", "wire"),
    ("vllm-prefill", "producer", "kv.completion", "completion", "coordination"),
    ("vllm-decode", "consumer", "kv.allocation", "allocation", "coordination"),
    ("vllm-decode", "consumer", "kv.registration", "registration", "coordination"),
    ("vllm-decode", "consumer", "kv.completion", "completion", "coordination"),
    ("vllm-decode", "consumer", "engine.queue", "d_queue", "queue"),
    ("vllm-decode", "consumer", "engine.first_token", "first_token", "compute"),
]


def _kv(key, value):
    v = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def make_load(traces: int, per_request: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    base = time.time_ns() - 3_600 * 10**9
    requests, current, spans_in = [], None, 0
    services = {}
    for t in range(traces):
        if current is None or spans_in >= per_request:
            if current is not None:
                requests.append(current.SerializeToString())
            current, spans_in, services = ExportTraceServiceRequest(), 0, {}
        trace_id = rng.getrandbits(128).to_bytes(16, "big")
        root_id = rng.getrandbits(64).to_bytes(8, "big")
        start = base + t * 1_000_000
        for i, (service, role, name, stage, category) in enumerate(STAGES):
            scope_spans = services.get(service)
            if scope_spans is None:
                rs = current.resource_spans.add()
                rs.resource.attributes.extend([_kv("service.name", service), _kv("kvtrace.role", role),
                                               _kv("kvtrace.mode", "push"),
                                               _kv("service.instance.id", f"{service}-0")])
                scope_spans = services[service] = rs.scope_spans.add()
                scope_spans.scope.name = "kvtrace"
            span = scope_spans.spans.add()
            span.trace_id = trace_id
            span.span_id = root_id if i == 0 else rng.getrandbits(64).to_bytes(8, "big")
            if i:
                span.parent_span_id = root_id
            span.name = name
            span.start_time_unix_nano = start + i * 2_000_000
            span.end_time_unix_nano = start + i * 2_000_000 + (300_000_000 if i == 0 else 1_500_000)
            span.attributes.extend([_kv("kvtrace.stage", stage), _kv("kvtrace.category", category),
                                    _kv("kvtrace.request_id", f"cmpl-{t}-0")])
            if name == "pd.request":
                span.attributes.append(_kv("kvtrace.router.ttft_ns", 250_000_000))
            if name == "kv.write":
                span.attributes.append(_kv("kvtrace.transfer.bytes", 2_097_152))
            spans_in += 1
    requests.append(current.SerializeToString())
    return requests


def send(port: int, load: list[bytes], streams: int = 4) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    grpc.channel_ready_future(channel).result(timeout=60)
    export = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)

    def one(payload: bytes) -> None:
        for attempt in range(100):
            try:
                export(payload, timeout=60)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                time.sleep(0.01 * (attempt + 1))  # the collector said "busy": back off, retry
        raise RuntimeError("collector stayed busy")

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, load))
    channel.close()


def run_process(command: list[str], port: int, load: list[bytes], core: int) -> tuple[float, float]:
    """(CPU seconds of the collector process, wall seconds of the send)."""
    process = subprocess.Popen(["taskset", "-c", str(core), *command], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        started = time.perf_counter()
        send(port, load)
        wall = time.perf_counter() - started
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # a clean stop: kvtrace flushes its store
    _, status, usage = os.wait4(process.pid, 0)
    return usage.ru_utime + usage.ru_stime, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=15_000, help="traces of 14 spans (default 15000)")
    parser.add_argument("--batch", type=int, default=500, help="spans per export request")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    collector_core, sender_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {sender_core})
    print(f"building {args.traces * len(STAGES):,} spans...", file=sys.stderr)
    load = make_load(args.traces, args.batch)
    spans = args.traces * len(STAGES)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        db = os.path.join(tmp, "bench.duckdb")
        print("kvtrace collector...", file=sys.stderr)
        cpu, wall = run_process([sys.executable, "-m", "kvtrace", "collector", "--db", db, "--grpc-port",
                                 str(port), "--http-port", "-1", "--decision-wait", "0.5"],
                                port, load, collector_core)
        import duckdb

        con = duckdb.connect(db, read_only=True)
        stored = con.execute("SELECT count(*) FROM spans").fetchone()[0]
        attributed = con.execute("SELECT count(*) FROM requests").fetchone()[0]
        con.close()
        results["kvtrace collector"] = (cpu, wall)
        # The same start and stop with one tiny request: start-up and shutdown CPU, subtracted
        # below to give the steady-state rate.
        idle_port = free_port()
        idle_cpu, _ = run_process([sys.executable, "-m", "kvtrace", "collector", "--db",
                                   os.path.join(tmp, "idle.duckdb"), "--grpc-port", str(idle_port),
                                   "--http-port", "-1"], idle_port, load[:1], collector_core)
        port = free_port()
        print("rotel...", file=sys.stderr)
        rotel = [rotel_binary(), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{port}",
                 "--otlp-http-endpoint", f"127.0.0.1:{free_port()}", "--exporter", "blackhole",
                 "--pid-file", os.path.join(tmp, "rotel.pid"), "--log-file", os.path.join(tmp, "rotel.log")]
        results["rotel (blackhole)"] = run_process(rotel, port, load, collector_core)

    print(f"{spans:,} spans in {len(load)} OTLP/gRPC requests; collector pinned to core {collector_core}, "
          f"sender on core {sender_core}")
    print(f"kvtrace: {stored:,} spans stored, {attributed:,} traces attributed")
    print(f"{'':20}{'CPU s':>8}{'spans/CPU-s':>14}{'wall s':>8}{'spans/s wall':>14}")
    for name, (cpu, wall) in results.items():
        print(f"{name:<20}{cpu:>8.2f}{spans / cpu:>14,.0f}{wall:>8.2f}{spans / wall:>14,.0f}")
    steady = spans / max(results["kvtrace collector"][0] - idle_cpu, 1e-9)
    print(f"kvtrace start-up + shutdown alone: {idle_cpu:.2f} CPU s; steady state {steady:,.0f} spans/CPU-s")
    kv_rate = spans / results["kvtrace collector"][0]
    print(f"kvtrace / rotel, spans per CPU-second: {kv_rate / (spans / results['rotel (blackhole)'][0]):.2f}")
    print("target >= 100,000 spans/s per core (steady state):",
          "met" if steady >= 100_000 and stored == spans else "not met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
