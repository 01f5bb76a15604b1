#!/usr/bin/env python3
"""Fleet ingest: kvtrace collectors in one Kafka consumer group writing a shared ClickHouse store, beside
one embedded collector (OTLP/HTTP into DuckDB) on the same spans.

Real parts on 127.0.0.1: librdkafka's mock cluster (3 brokers, a 6-partition topic, the Kafka protocol),
a ClickHouse 26.9 server (chdb-core), and ``kvtrace collector`` processes. The load is a generated fleet
(``--routers`` × ``--prefill`` × ``--decode``, ±50 ms clock skew, failures, late spans: kvtrace.testbed.fleet),
published as the OpenTelemetry Collector's kafka exporter would (one otlp_proto message per resource and
trace, keyed by trace id).

1. Throughput: ``--collectors`` collectors form the group, then the load is published at ``--rate`` traces
   per second (paced: the mock brokers keep a few MB per partition). Per collector: the spans it received (its health rows) over its own CPU time (user + system, /proc) from
   start until the store holds every trace. The embedded collector gets the same messages over OTLP/HTTP,
   100 messages per request (concatenated ExportTraceServiceRequests are one valid request), into DuckDB.
2. Clocks: with ``--clocks measured`` (the default, as kvtrace's engines run) every router, P and D has
   clock exchanges with one collector of the group and, the same exchanges, with the embedded collector
   (replayed over ``POST /v1/kvtrace/clock``: the generated processes do not exist). The other collectors
   learn them from the shared store, so every trace is placed alike and should equal the embedded breakdown
   to the ns. With ``--clocks inferred`` offsets come from span order over each shard's own traces.
3. End-to-end lag, on the same run: a trace's lag runs from the publish of its last message to its row's
   decision time in the store (``requests.updated_at``). It includes the collector's decision wait
   (``--decision-wait``).

Prints medians and percentiles; absolute numbers on a shared 2-core machine are noisy, ratios less so.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtrace.collectors.model import SpanBatch  # noqa: E402
from kvtrace.collectors.read import open_store  # noqa: E402
from kvtrace.testbed.fleet import FleetGenerator, FleetShape, publish  # noqa: E402
from kvtrace.testbed.launch import free_port  # noqa: E402
from kvtrace.testbed.peers import ClickHouseServer, KafkaMockCluster  # noqa: E402

PARTITIONS = 6


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _collector(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtrace", "collector", *args], stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"), start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _count(reader, table: str = "requests") -> int:
    try:
        return reader.sql(f"SELECT count() AS n FROM {table}").to_pylist()[0]["n"]
    except Exception:  # the database is not made yet
        return 0


def _progress(label: str, done: int, total: int, started: float) -> None:
    rate = done / max(time.monotonic() - started, 1e-9)
    of = f"/{total:,}" if total > 0 else ""
    print(f"\r  {label}: {done:,}{of} traces ({rate:,.0f}/s)", end="", file=sys.stderr, flush=True)


def paced_publish(brokers: str, topic: str, messages: list[tuple[bytes, bytes]], rate: float) -> dict[str, float]:
    """Publish at ``rate`` traces per second (a trace's messages together); each trace's last publish time.
    Paced, not all at once: librdkafka's mock brokers keep a few MB per partition and drop the oldest."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": brokers, "linger.ms": 2, "acks": "all"})
    last_sent: dict[str, float] = {}
    started = time.monotonic()
    for key, value in messages:
        trace = key.decode()
        if trace not in last_sent:
            due = started + len(last_sent) / rate
            while time.monotonic() < due:
                producer.poll(0.001)
            if len(last_sent) % 1000 == 0:
                _progress("published", len(last_sent), -1, started)
        while True:
            try:
                producer.produce(topic, key=key, value=value)
                break
            except BufferError:
                producer.poll(0.01)
        last_sent[trace] = time.time()
    producer.flush(60)
    print(file=sys.stderr)
    return last_sent


Exchange = tuple[str, int, int, int, int]


def replay_clock_exchanges(port: int, exchanges: list[Exchange]) -> None:
    """Each exchange's (t1, t2, t3, t4) handed to the collector as a sender hands its previous exchange."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for instance, *times in exchanges:
            connection.request("POST", "/v1/kvtrace/clock", json.dumps({"instance": instance, "previous": times}),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"clock exchange refused: HTTP {response.status}")
    finally:
        connection.close()


def fleet_run(kafka: KafkaMockCluster, url: str, messages: list[tuple[bytes, bytes]], traces: int, collectors: int,
              decision_wait: float, rate: float, tmp: Path, exchanges: list[Exchange]) -> dict:
    """The group formed, then the load published at ``rate``: spans per CPU-second of each collector, from its
    CPU time once it owns its partitions (start-up and imports left out) until the store holds every trace;
    and each trace's lag from its last message to its decision."""
    reader = open_store(url)
    logs = [tmp / f"collector-{i}.log" for i in range(collectors)]
    clock_port = free_port()  # collector 0 takes the clock exchanges; the others read them from the store
    processes = [_collector(["--store", url, "--kafka", kafka.bootstrap_servers, "--topic", "fleet", "--group",
                             "fleet", "--grpc-port", "-1", "--http-port", str(clock_port if i == 0 else -1),
                             "--decision-wait", str(decision_wait), "--wal-dir", str(tmp / f"wal-{i}")], log)
                 for i, log in enumerate(logs)]
    try:
        _wait(lambda: all("assigned partitions" in log.read_text() for log in logs), 120, "the group to form")
        if exchanges:
            replay_clock_exchanges(clock_port, exchanges)
            _wait(lambda: _count(reader, "clock_samples") >= len(exchanges), 60, "the clock samples in the store")
        time.sleep(8)  # the first assignment is often followed by a second, as the last member joins; and the
        # other collectors read the clock samples back (every second)
        baseline = [_cpu_seconds(p.pid) for p in processes]
        started = time.monotonic()
        last_sent = paced_publish(kafka.bootstrap_servers, "fleet", messages, rate)
        _wait(lambda: _count(reader) >= traces, 600, "every trace in the store")
        elapsed = time.monotonic() - started
        cpu = [_cpu_seconds(p.pid) - b for p, b in zip(processes, baseline)]
    finally:
        for p in processes:
            _stop(p)
    dropped = [log.name for log in logs if "Offset out of range" in log.read_text()]
    if dropped:
        raise RuntimeError(f"the mock brokers dropped messages before they were read ({dropped}): lower --rate")
    runs = {json.loads(row["config"])["wal_dir"]: row["collector_run_id"]
            for row in reader.sql("SELECT collector_run_id, config FROM collector_runs").to_pylist()}
    received = {row["collector_run_id"]: row["spans"] for row in reader.sql(
        "SELECT collector_run_id, max(spans_received) AS spans FROM collector_health GROUP BY 1").to_pylist()}
    spans = [received.get(runs.get(str(tmp / f"wal-{i}"), ""), 0) for i in range(collectors)]
    decided = {r["trace_id"]: r["updated_at"].timestamp()
               for r in reader.sql("SELECT trace_id, updated_at FROM requests").to_pylist()}
    lags = sorted(decided[t] - sent for t, sent in last_sent.items() if t in decided)
    counts = reader.sql("SELECT collector_run_id, max(traces_decided) AS decided, max(traces_late) AS late "
                        "FROM collector_health GROUP BY 1").to_pylist()
    return {"elapsed_s": elapsed, "cpu_s": cpu, "spans": spans, "lags": lags, "rows": _rows(reader),
            "decisions": sum(r["decided"] for r in counts), "late": sum(r["late"] for r in counts),
            "per_cpu_s": [s / c if c else 0.0 for s, c in zip(spans, cpu)]}


def embedded_run(messages: list[tuple[bytes, bytes]], traces: int, decision_wait: float, tmp: Path,
                 exchanges: list[Exchange]) -> dict:
    """The same messages over OTLP/HTTP, 100 per request, into one collector's DuckDB file."""
    db, port = str(tmp / "embedded.duckdb"), free_port()
    process = _collector(["--db", db, "--grpc-port", "-1", "--http-port", str(port), "--decision-wait",
                          str(decision_wait)], tmp / "embedded.log")
    url = f"http://127.0.0.1:{port}/v1/traces"
    _wait(lambda: Path(f"{db}.kvtrace-collector.json").exists(), 60, "the embedded collector")
    replay_clock_exchanges(port, exchanges)
    values = [v for _, v in messages]
    before = _cpu_seconds(process.pid)
    started = time.monotonic()
    try:
        for i in range(0, len(values), 100):
            request = urllib.request.Request(url, data=b"".join(values[i:i + 100]),
                                             headers={"Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
        reader = open_store(db)
        _wait(lambda: reader.sql("SELECT count(*) AS n FROM requests").to_pylist()[0]["n"] >= traces, 600,
              "every trace")
        cpu = _cpu_seconds(process.pid) - before
        elapsed = time.monotonic() - started
    finally:
        _stop(process)
    spans = sum(len(SpanBatch.decode(v).rows) for v in values)
    return {"elapsed_s": elapsed, "cpu_s": cpu, "spans": spans, "per_cpu_s": spans / cpu if cpu else 0.0,
            "rows": _rows(open_store(db))}


COMPARED = ("ttft_ms", "compute_ms", "queue_ms", "coordination_ms", "wire_ms", "unattributed_ms", "complete",
            "missing", "error", "stage_start_ns", "stage_end_ns", "stage_critical_ns")


def _rows(reader) -> dict[str, dict]:
    """Each trace's breakdown as stored, and the clock offsets it was computed with."""
    return {r["trace_id"]: r for r in reader.sql(
        f"SELECT trace_id, clock_offsets, {', '.join(COMPARED)} FROM requests").to_pylist()}


def agreement(fleet: dict[str, dict], alone: dict[str, dict]) -> dict:
    """How the fleet's breakdowns compare with the embedded collector's, trace by trace."""
    same_clocks = [t for t in alone if t in fleet and dict(alone[t]["clock_offsets"]) == dict(fleet[t]["clock_offsets"])]
    exact = [t for t in same_clocks if all(alone[t][k] == fleet[t][k] for k in COMPARED)]
    drift = [abs(a - dict(fleet[t]["clock_offsets"]).get(i, a)) / 1e6 for t in alone if t in fleet
             for i, a in dict(alone[t]["clock_offsets"]).items()]
    return {"traces": len(alone), "in_both": sum(t in fleet for t in alone), "same_clocks": len(same_clocks),
            "exact": len(exact), "max_offset_ms": max(drift, default=0.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=50_000)
    parser.add_argument("--collectors", type=int, default=3)
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--decision-wait", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=1_000.0, help="traces published per second")
    parser.add_argument("--clocks", choices=("measured", "inferred"), default="measured",
                        help="every process's clock exchanges replayed to collector 0 and the embedded one "
                             "(measured), or none (inferred from span order)")
    args = parser.parse_args()
    shape = FleetShape(routers=args.routers, prefill=args.prefill, decode=args.decode)
    print(f"generating {args.traces:,} traces of a {args.routers}R x {args.prefill}P x {args.decode}D fleet ...",
          file=sys.stderr)
    start_ns = time.time_ns() - 3_600 * 10**9
    messages = list(FleetGenerator(shape).messages(args.traces, start_ns))
    span_s = args.traces / shape.rate_per_s + 60  # the requests' arrivals, and the last ones' spans
    exchanges = list(FleetGenerator(shape).clock_exchanges(start_ns, span_s)) if args.clocks == "measured" else []
    tmp = Path(tempfile.mkdtemp(prefix="kvtrace-fleet-bench-"))
    with KafkaMockCluster({"fleet": PARTITIONS}) as kafka, ClickHouseServer(str(tmp / "clickhouse")) as clickhouse:
        fleet = fleet_run(kafka, clickhouse.store_url("fleet_bench"), messages, args.traces, args.collectors,
                          args.decision_wait, args.rate, tmp, exchanges)
    embedded = embedded_run(messages, args.traces, args.decision_wait, tmp, exchanges)
    lags = fleet["lags"]
    agree = agreement(fleet["rows"], embedded["rows"])
    spans = sum(fleet["spans"])
    print(f"\nload: {args.traces:,} traces, {spans:,} spans, {len(messages):,} messages; "
          f"{args.collectors} collectors on a {PARTITIONS}-partition topic; clocks {args.clocks}"
          + (f" ({len(exchanges):,} exchanges replayed)" if exchanges else ""))
    print(f"fleet (Kafka -> ClickHouse), published at {args.rate:g} traces/s: all stored in {fleet['elapsed_s']:.1f} s")
    for i, (n, cpu, rate) in enumerate(zip(fleet["spans"], fleet["cpu_s"], fleet["per_cpu_s"])):
        print(f"  collector {i}: {n:,} spans, {cpu:.1f} CPU-s: {rate:,.0f} spans per CPU-second")
    print(f"  median per collector: {statistics.median(fleet['per_cpu_s']):,.0f} spans per CPU-second")
    print(f"embedded (OTLP/HTTP -> DuckDB), same spans: {embedded['spans']:,} spans, {embedded['cpu_s']:.1f} CPU-s: "
          f"{embedded['per_cpu_s']:,.0f} spans per CPU-second")
    print(f"  fleet collector / embedded: {statistics.median(fleet['per_cpu_s']) / embedded['per_cpu_s']:.2f}")
    print(f"decisions by the fleet: {fleet['decisions']:,} for {args.traces:,} traces ({fleet['late']:,} decided again "
          f"after late spans): {fleet['decisions'] - fleet['late'] - args.traces:,} traces split across collectors")
    print(f"against the embedded collector: {agree['in_both']:,} of {agree['traces']:,} traces in both stores; "
          f"{agree['same_clocks']:,} have the same clock offsets, and {agree['exact']:,} of those have the same "
          f"breakdown to the ns; offsets differ by at most {agree['max_offset_ms']:.3f} ms")
    if lags:
        q = statistics.quantiles(lags, n=100)
        print(f"end-to-end lag, last message to decision ({len(lags):,} traces, decision wait {args.decision_wait:g} s): "
              f"p50 {statistics.median(lags):.2f} s, p99 {q[98]:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
