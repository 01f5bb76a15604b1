#!/usr/bin/env python3
"""Collector ingest: spans per CPU-second, kvtrace's collector beside rotel, on the same load.

The load is contract-shaped traces (14 spans each: router, P and D stages with kvtrace's
attributes), pre-encoded into OTLP export requests of ~500 spans. Each collector runs as
its own process pinned to one core; this process sends from the other core over OTLP/gRPC
with four streams. kvtrace's collector receives, writes its write-ahead log, decodes,
stores in DuckDB (Arrow batches), assembles and attributes every trace; rotel receives,
batches and exports to its blackhole. Throughput is spans divided by the collector
process's own CPU time (user + system, all threads, from wait4), so "per core" holds
whatever else the machine does. Each process first gets a small warm-up load (other
traces: first calls, lazy imports), then a first load of the same size as the measured one (other
traces again), then the measured load. Steady state is that last load's CPU alone, from the moment
the collector is quiet after the first load to the moment it is quiet again (every span stored,
every trace decided), read from /proc: a collector that has been running, as in production. Under
its first load a fresh collector grows its memory to its working size (~300 MB: DuckDB's table
data until its next checkpoint, the allocators' pools): ~0.4 minor page faults a span, each a page
the kernel maps and zeroes, 1.4-2.2 µs of system CPU a span against 0.6-0.8 µs once grown (two
runs of three rounds, 2026-12-05). So the first load's figure is printed beside it (the figure this
bench called steady state until then), with the faults and system CPU per span of each. The
whole-run figure adds start-up and shutdown. Rounds alternate kvtrace and rotel, and medians are
printed, because this shared machine's speed drifts between runs.

With ``--forward``, each round also runs kvtrace's collector forwarding to a rotel (pinned to
the sender's core, exporting to its blackhole): once the spans as received only ("tee"), once
with one ``kvtrace.breakdown`` span per trace too ("forwarding"; ``--forward-critical-path``
adds the segments), so each cost shows beside the same collector without it.

Last, the collector's steady-state CPU split by thread, read from /proc by the names it gives its
threads in the OS (``collectors/threads.py``): the gRPC workers (receive, decode, log), the pipeline
(assembly, attribution, breakdown spans), the store's writer (DuckDB), each forwarder.

Target (issues 4 and 13): >= 100k spans/s per core for kvtrace, with forwarding on too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402

from kvtrace.testbed.peers import rotel_binary  # noqa: E402
from kvtrace.testbed.launch import free_port  # noqa: E402
from kvtrace.telemetry import semconv  # noqa: E402
from kvtrace.telemetry.semconv import Side, Stage  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_SERVICE = {"router": "kvtrace-router", "producer": "vllm-prefill", "consumer": "vllm-decode"}
_ROLE = {side: role for role, side in semconv.SIDE_OF_ROLE.items()}
STAGES = [  # (service, role, span name, stage label, category): a push trace's spans, named by the contract
    (_SERVICE[_ROLE[side.value]], _ROLE[side.value], semconv.STAGES[stage].span_name, semconv.STAGE_LABELS[stage],
     semconv.STAGES[stage].category.value)
    for side, stage in [(Side.ROUTER, Stage.PD_REQUEST), (Side.ROUTER, Stage.PD_ROUTE), (Side.PREFILL, Stage.P_QUEUE),
                        (Side.PREFILL, Stage.PREFILL), (Side.PREFILL, Stage.REGISTRATION),
                        (Side.PREFILL, Stage.RENDEZVOUS), (Side.PREFILL, Stage.DESCRIPTOR_PREP),
                        (Side.PREFILL, Stage.WRITE), (Side.PREFILL, Stage.COMPLETION), (Side.DECODE, Stage.ALLOCATION),
                        (Side.DECODE, Stage.REGISTRATION), (Side.DECODE, Stage.COMPLETION),
                        (Side.DECODE, Stage.D_QUEUE), (Side.DECODE, Stage.FIRST_TOKEN)]
]


def _kv(key, value):
    v = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def instance_of(service: str) -> str:
    """The ``service.instance.id`` of the load's one process of ``service``."""
    return f"{service}-0"


def make_load(traces: int, per_request: int, seed: int = 1, start_ns: int | None = None) -> list[bytes]:
    """``traces`` traces of :data:`STAGES`, the first starting at ``start_ns`` (default an hour ago), one every ms,
    in export requests of ``per_request`` spans."""
    rng = random.Random(seed)
    base = time.time_ns() - 3_600 * 10**9 if start_ns is None else start_ns
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
                                               _kv("service.instance.id", instance_of(service))])
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


def _stat_fields(stat_path: str) -> list[str]:
    """A /proc ``stat`` file's fields after the command name (a process's: all its threads; a task's: one)."""
    with open(stat_path) as f:
        return f.read().rsplit(")", 1)[1].split()


def _stat_cpu_seconds(stat_path: str) -> float:
    """User + system CPU from a /proc ``stat`` file."""
    fields = _stat_fields(stat_path)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _memory_counters(pid: int) -> tuple[int, float]:
    """A process's minor page faults so far (each a page the kernel mapped, and zeroed, on first touch) and
    its system CPU seconds (the kernel's time on its behalf, those faults' included)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (from /proc)."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (``/proc/PID/task/*/comm``), a pool's numbered workers summed
    (``kv-otlp-grpc_0``, ``_1``, ... as ``kv-otlp-grpc``): kvtrace's collector names its threads in
    the OS (``collectors/threads.py``); what it does not name shows as the executable's name."""
    seconds: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = f.read().strip()
            cpu = _stat_cpu_seconds(f"/proc/{pid}/task/{task}/stat")
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = name.rstrip("0123456789").rstrip("_") or name
        seconds[name] = seconds.get(name, 0.0) + cpu
    return seconds


def _wait_until_quiet(pid: int, window_s: float = 0.5, limit_s: float = 60.0) -> float:
    """Wait until two windows in a row add under 10 ms of CPU (the collector has done all
    the work it was sent: decisions, store flushes); returns the CPU seconds then."""
    deadline = time.monotonic() + limit_s
    cpu, quiet = _cpu_seconds(pid), 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(window_s)
        now = _cpu_seconds(pid)
        quiet = quiet + 1 if now - cpu < 0.01 else 0
        cpu = now
    return cpu


def run_process(command: list[str], port: int, loads: Loads, core: int) -> dict:
    """The process's CPU seconds (``cpu``: the whole process; ``first_cpu``: the first load alone;
    ``load_cpu``: the measured load alone), minor page faults and system CPU seconds in each load
    (``first_faults``, ``load_faults``, ``first_system``, ``load_system``), the measured load's send in wall
    seconds (``wall``) and CPU seconds per thread name (``threads``).

    A load alone: from quiet before it to quiet after it (every span stored, every trace decided)."""
    process = subprocess.Popen(["taskset", "-c", str(core), *command], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        send(port, loads.warm_up)
        start = _wait_until_quiet(process.pid)
        faults_start, system_start = _memory_counters(process.pid)
        send(port, loads.first)
        before = _wait_until_quiet(process.pid)
        faults_before, system_before = _memory_counters(process.pid)
        threads_before = _thread_cpu(process.pid)
        started = time.perf_counter()
        send(port, loads.measured)
        wall = time.perf_counter() - started
        after = _wait_until_quiet(process.pid)
        faults_after, system_after = _memory_counters(process.pid)
        threads = {name: seconds - threads_before.get(name, 0.0) for name, seconds in _thread_cpu(process.pid).items()}
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # a clean stop: kvtrace flushes its store
    _, status, usage = os.wait4(process.pid, 0)
    return {"cpu": usage.ru_utime + usage.ru_stime, "first_cpu": before - start, "load_cpu": after - before,
            "first_faults": faults_before - faults_start, "load_faults": faults_after - faults_before,
            "first_system": system_before - system_start, "load_system": system_after - system_before,
            "wall": wall, "threads": threads}


def rotel_command(port: int, work: str, name: str) -> list[str]:
    """rotel receiving OTLP/gRPC on ``port`` and exporting to its blackhole."""
    return [rotel_binary(), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{port}",
            "--otlp-http-endpoint", f"127.0.0.1:{free_port()}", "--exporter", "blackhole",
            "--pid-file", os.path.join(work, f"{name}.pid"), "--log-file", os.path.join(work, f"{name}.log")]


@dataclasses.dataclass
class Loads:
    """What each collector is sent, in order: the warm-up, the first load, the measured load."""

    warm_up: list[bytes]
    first: list[bytes]
    measured: list[bytes]


def run_kvtrace(work: str, name: str, loads: Loads, core: int, forward: list[str]) -> dict:
    """One kvtrace collector run: its CPU, and what it stored, attributed and forwarded."""
    port = free_port()
    db = os.path.join(work, f"{name}.duckdb")
    command = [sys.executable, "-m", "kvtrace", "collector", "--http-port", "-1", "--decision-wait", "0.5",
               "--db", db, "--grpc-port", str(port), *forward]
    result = run_process(command, port, loads, core)
    con = duckdb.connect(db, read_only=True)
    stored = con.execute("SELECT count(*) FROM spans").fetchone()[0]
    attributed = con.execute("SELECT count(*) FROM requests").fetchone()[0]
    forwarded = con.execute("SELECT coalesce(max(forwarded_spans), 0), coalesce(max(forward_dropped), 0) "
                            "FROM collector_health").fetchone()
    con.close()
    return {**result, "stored": stored, "attributed": attributed, "forwarded": forwarded[0],
            "forward_dropped": forwarded[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=15_000, help="traces of 14 spans (default 15000)")
    parser.add_argument("--batch", type=int, default=500, help="spans per export request")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of kvtrace then rotel (default 3)")
    parser.add_argument("--forward", action="store_true",
                        help="also run kvtrace forwarding to a rotel blackhole (spans + breakdown spans)")
    parser.add_argument("--forward-critical-path", action="store_true",
                        help="with --forward: forward the critical-path segment spans too")
    args = parser.parse_args()
    if args.traces < 1 or args.batch < 1 or args.rounds < 1:
        parser.error("--traces, --batch and --rounds must be >= 1")
    if args.forward_critical_path and not args.forward:
        parser.error("--forward-critical-path goes with --forward")
    cores = sorted(os.sched_getaffinity(0))
    collector_core, sender_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {sender_core})
    print(f"building {args.traces * len(STAGES):,} spans...", file=sys.stderr)
    hour = 3_600 * 10**9
    warm_traces = 200
    loads = Loads(warm_up=make_load(warm_traces, args.batch, seed=2),  # other traces, sent first to each collector
                  first=make_load(args.traces, args.batch, seed=3, start_ns=time.time_ns() - 2 * hour),
                  measured=make_load(args.traces, args.batch, start_ns=time.time_ns() - hour))
    spans = args.traces * len(STAGES)
    warm_spans = warm_traces * len(STAGES)
    all_spans, all_traces = 2 * spans + warm_spans, 2 * args.traces + warm_traces

    # "tee": forwarding the spans as received only (--no-forward-breakdown); "forwarding": with
    # the breakdown spans too. Their difference is what the breakdown spans cost.
    configs = ["kvtrace", *(["tee", "forwarding"] if args.forward else []), "rotel"]
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(1, args.rounds + 1):
            row: dict[str, dict[str, float]] = {}
            work = os.path.join(tmp, f"round-{number}")
            os.mkdir(work)
            print(f"round {number}/{args.rounds}: {', then '.join(configs)}...", file=sys.stderr)
            row["kvtrace"] = run_kvtrace(work, "plain", loads, collector_core, [])
            if args.forward:
                upstream_port = free_port()
                upstream = subprocess.Popen(["taskset", "-c", str(sender_core),
                                             *rotel_command(upstream_port, work, "upstream")],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
                try:
                    grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{upstream_port}")).result(timeout=30)
                    flags = ["--forward", f"grpc://127.0.0.1:{upstream_port}"]
                    row["tee"] = run_kvtrace(work, "tee", loads, collector_core,
                                             [*flags, "--no-forward-breakdown"])
                    row["forwarding"] = run_kvtrace(work, "forwarding", loads, collector_core, [
                        *flags, *(["--forward-critical-path"] if args.forward_critical_path else [])])
                finally:
                    os.killpg(upstream.pid, signal.SIGTERM)
                    upstream.wait(30)
            port = free_port()
            row["rotel"] = run_process(rotel_command(port, work, "rotel"), port, loads, collector_core)
            for result in row.values():
                result["steady"] = spans / max(result["load_cpu"], 1e-9)
                result["first"] = spans / max(result["first_cpu"], 1e-9)
                result["whole"] = all_spans / result["cpu"]
            rounds.append(row)

    print(f"{spans:,} spans in {len(loads.measured)} OTLP/gRPC requests; collector pinned to core {collector_core}, "
          f"sender{' and upstream rotel' if args.forward else ''} on core {sender_core}; {args.rounds} rounds, "
          f"{', '.join(configs)} alternated")
    print(f"spans per CPU-second. steady: the load's CPU alone, sent to a collector that has had a warm-up of "
          f"{warm_spans:,} spans and a first load of {spans:,} (other traces), to quiet after every span is stored; "
          "first load: that first load's CPU alone, into a process that grows to its working size under it")
    header = f"{'round':<7}" + "".join(f"{name + ' steady':>20}{'first load':>11}" for name in configs)
    print(header + (f"{'tee/plain':>11}{'fwd/plain':>11}" if args.forward else "") + f"{'kvtrace/rotel':>15}"
          f"{'(first load)':>14}")

    def line(label: str, row: dict[str, dict[str, float]]) -> str:
        text = f"{label:<7}" + "".join(f"{row[name]['steady']:>20,.0f}{row[name]['first']:>11,.0f}" for name in configs)
        if args.forward:
            text += "".join(f"{row[name]['steady'] / row['kvtrace']['steady']:>11.3f}" for name in ("tee", "forwarding"))
        return (text + f"{row['kvtrace']['steady'] / row['rotel']['steady']:>15.3f}"
                f"{row['kvtrace']['first'] / row['rotel']['first']:>14.3f}")

    for number, row in enumerate(rounds, 1):
        print(line(str(number), row))
    median = {name: {key: statistics.median(row[name][key] for row in rounds) for key in (
        "steady", "first", "whole", "first_faults", "load_faults", "first_system", "load_system")} for name in configs}
    print(line("median", median))
    print("medians: whole run (start-up, the three loads, shutdown) in spans per CPU-second; per span, first load -> "
          "steady: minor page faults, and system CPU (µs)")
    for name in configs:
        m = median[name]
        print(f"  {name:<12}{m['whole']:>10,.0f}   faults {m['first_faults'] / spans:.2f} -> {m['load_faults'] / spans:.2f}"
              f"   system {m['first_system'] / spans * 1e6:.2f} -> {m['load_system'] / spans * 1e6:.2f} µs")
    kvtrace_configs = [name for name in configs if name != "rotel"]
    names = sorted({t for row in rounds for name in kvtrace_configs for t in row[name]["threads"]},
                   key=lambda t: -statistics.median(row["kvtrace"]["threads"].get(t, 0.0) for row in rounds))
    print("the load's CPU by thread, µs per span (steady state, median of the rounds; kv-*: kvtrace's own threads, "
          "python: the process's others, event_engine and grpc_*: gRPC's core)")
    print(f"  {'thread':<18}" + "".join(f"{name:>12}" for name in kvtrace_configs))
    for t in names:
        print(f"  {t:<18}" + "".join(
            f"{statistics.median(row[name]['threads'].get(t, 0.0) for row in rounds) / spans * 1e6:>12.2f}"
            for name in kvtrace_configs))
    kvtrace_runs = [row[name] for row in rounds for name in kvtrace_configs]
    complete = all(r["stored"] == all_spans and r["attributed"] == all_traces for r in kvtrace_runs)
    print(f"every span stored and every trace attributed in every kvtrace run: {'yes' if complete else 'NO'}")
    verdict = median["kvtrace"]["steady"] >= 100_000 and complete
    if args.forward:
        if any(row["tee"]["forwarded"] < all_spans for row in rounds):
            print("tee: NOT every span was forwarded")
        forwarded = [row["forwarding"] for row in rounds]
        # at least every span and one breakdown span per trace (segments, when on, come on top)
        everything = all(r["forwarded"] >= all_spans + all_traces and r["forward_dropped"] == 0 for r in forwarded)
        counts = ", ".join(f"{r['forwarded']:,.0f}" for r in forwarded)
        print(f"forwarded per round (spans + breakdown spans): {counts}; expected at least "
              f"{all_spans + all_traces:,}; dropped: {sum(r['forward_dropped'] for r in forwarded):,.0f}")
        print(f"every span and one breakdown per trace forwarded in every round: {'yes' if everything else 'NO'}")
        verdict = verdict and everything and median["forwarding"]["steady"] >= 100_000
    print("target >= 100,000 spans/s per core (median steady state" + (", with and without forwarding" if args.forward
                                                                          else "") + "):",
          "met" if verdict else "not met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
