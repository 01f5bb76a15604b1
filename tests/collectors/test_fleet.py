"""Fleet mode: collectors in one Kafka consumer group (librdkafka's mock cluster, real Kafka protocol) write
one shared ClickHouse store; what they decide is what one embedded collector decides from the same spans."""

import signal
import subprocess
import sys
import time

import pytest

from kvtrace.collectors.config import CollectorConfig
from kvtrace.collectors.model import SpanBatch
from kvtrace.collectors.query_service import QueryRefused
from kvtrace.collectors.read import StoreUnavailable, open_store
from kvtrace.collectors.service import Collector
from kvtrace.testbed.fleet import FleetGenerator, FleetShape, publish
from kvtrace.testbed.peers import KafkaMockCluster
from tests.collectors.traces import build
from tests.helpers import feed

TOPIC, PARTITIONS = "otlp_spans", 6
TRACES = 3_000
COMPARED = ("trace_id", "mode", "started_at", "ttft_ms", "compute_ms", "queue_ms", "coordination_ms", "wire_ms",
            "unattributed_ms", "complete", "missing", "error", "rendezvous_order", "prefill_instance",
            "decode_instance", "clock_offsets", "clock_bounds", "clock_suspect", "stage_start_ns", "stage_end_ns",
            "stage_critical_ns", "explanation")


@pytest.fixture(scope="module")
def kafka():
    with KafkaMockCluster({TOPIC: PARTITIONS, "unkeyed": 2, "crash": PARTITIONS, "rotel": 2, "clocks": PARTITIONS,
                           "fleet-sharded": PARTITIONS, "fleet-measured": PARTITIONS}) as cluster:
        yield cluster


SHAPE = FleetShape(routers=2, prefill=16, decode=16, skew_ms=50.0)


@pytest.fixture(scope="module")
def fleet_start():
    return time.time_ns() - 600 * 10**9


@pytest.fixture(scope="module")
def fleet_messages(fleet_start):
    return list(FleetGenerator(SHAPE).messages(TRACES, fleet_start))


def _exchange_clocks(collector: Collector, start_ns: int) -> list[str]:
    """Clock exchanges of every process of the fleet with ``collector``, around the messages' time: three per
    process, 30 s apart; returns the processes."""
    exchanges = list(FleetGenerator(SHAPE).clock_exchanges(start_ns, 60.0))  # the same skews (seeded)
    for instance, t1, t2, t3, t4 in exchanges:
        collector.clocks.add(instance, t1, t2, t3, t4)
    return sorted({instance for instance, *_ in exchanges})


def _fleet_collector(store: str, kafka, tmp_path, name: str, **overrides) -> Collector:
    collector = Collector(CollectorConfig(**{
        "db_path": store, "wal_dir": str(tmp_path / name), "grpc_port": None, "http_port": None, "query_port": None,
        "decision_wait_s": 0.5, "kafka_brokers": kafka.bootstrap_servers, **overrides}))
    collector.start()
    return collector


def _rows(reader) -> dict[str, dict]:
    columns = ", ".join(COMPARED)
    return {r["trace_id"]: r for r in reader.sql(f"SELECT {columns} FROM requests").to_pylist()}


def _wait(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.parametrize("sharded, measured", [(False, False), (True, False), (False, True)],
                         ids=["one-server", "two-shards", "measured-clocks"])
def test_three_collectors_in_a_group_decide_each_trace_once_as_one_embedded_collector(
        kafka, fleet_start, fleet_messages, clickhouse_server, tmp_path, request, sharded, measured):
    """Into one ClickHouse server, and into two shards behind Distributed tables; with clocks inferred from span
    order, and with every process's clock measured (by one collector of the group, and by the embedded one)."""
    if sharded:
        cluster = request.getfixturevalue("clickhouse_cluster")
        url, topic = cluster.store_url("fleet"), "fleet-sharded"
    else:
        url, topic = clickhouse_server.store_url("fleet_measured" if measured else "fleet"), \
            "fleet-measured" if measured else TOPIC
    collectors = [_fleet_collector(url, kafka, tmp_path, f"c{i}", kafka_topic=topic, kafka_group="fleet")
                  for i in range(3)]
    try:
        _wait(lambda: all(c.kafka.stats.partitions for c in collectors), 60, "the group to share the partitions")
        if measured:
            processes = _exchange_clocks(collectors[0], fleet_start)
            _wait(lambda: all(c.clocks.measured(p) for c in collectors for p in processes), 30,
                  "every collector to know every measured clock")
        assert publish(kafka.bootstrap_servers, topic, fleet_messages) == len(fleet_messages)
        reader = open_store(url)
        _wait(lambda: reader.sql("SELECT count() AS n FROM requests").to_pylist()[0]["n"] >= TRACES, 180,
              "every trace in the store")
        _wait(lambda: all(c.kafka.pending_traces() == 0 for c in collectors), 30, "every trace durable")
        owned = [set(c.kafka.stats.partitions) for c in collectors]
    finally:
        for c in collectors:
            c.shutdown()
    assert sorted(p for o in owned for p in o) == list(range(PARTITIONS)), owned  # each partition one owner
    decided = [c.assembler.stats.traces_decided for c in collectors]
    late = sum(c.assembler.stats.traces_late for c in collectors)
    assert sum(decided) - late == TRACES, decided  # each trace decided by one collector: none split
    assert all(decided), decided
    assert sum(c.kafka.stats.unkeyed for c in collectors) == 0

    embedded = str(tmp_path / "embedded.duckdb")
    one = Collector(CollectorConfig(db_path=embedded, grpc_port=None, http_port=0, query_port=None,
                                    decision_wait_s=0.5))
    one.start()
    if measured:  # the same exchanges, against the embedded collector's clock
        _exchange_clocks(one, fleet_start)
    feed(one, [value for _, value in fleet_messages])
    one.shutdown()
    fleet, alone = _rows(open_store(url)), _rows(open_store(embedded))
    assert len(fleet) == len(alone) == TRACES
    # Each trace's breakdown is computed from its own spans, except the clock offsets inferred for a process
    # without clock exchanges: those come from a window over the process's recent traces (.clocks), which a
    # shard sees a third of. Where a trace's offsets match, its breakdown matches to the ns.
    # With every process measured, each shard places it as the embedded collector does: every trace the same.
    same_clocks = [t for t in alone if alone[t]["clock_offsets"] == fleet[t]["clock_offsets"]]
    assert len(same_clocks) >= (TRACES if measured else 0.9 * TRACES), len(same_clocks)
    assert sum(bool(row["clock_bounds"]) for row in fleet.values()) >= (0.95 * TRACES if measured else 0)
    different = {t: sorted(k for k in COMPARED if alone[t][k] != fleet[t][k]) for t in same_clocks
                 if alone[t] != fleet[t]}
    assert not different, (len(different), list(different.items())[:3])
    independent = ("mode", "started_at", "ttft_ms", "complete", "missing", "error", "prefill_instance",
                   "decode_instance")
    assert all(alone[t][k] == fleet[t][k] for t in alone for k in independent)
    drift = max(abs(a - b) for t in alone for (_, a), (_, b) in zip(alone[t]["clock_offsets"],
                                                                     fleet[t]["clock_offsets"]))
    assert drift < 2_000_000, drift  # ns: the windows' estimates stay within 2 ms of each other


def test_messages_not_keyed_by_trace_id_are_counted_and_warned_about(kafka, fleet_messages, clickhouse_server,
                                                                     tmp_path, caplog):
    collector = _fleet_collector(clickhouse_server.store_url("unkeyed"), kafka, tmp_path, "u", kafka_topic="unkeyed",
                                 kafka_group="unkeyed")
    try:
        publish(kafka.bootstrap_servers, "unkeyed", fleet_messages[:60], keyed=False)
        _wait(lambda: collector.kafka.stats.messages >= 60, 60, "the messages")
    finally:
        collector.shutdown()
    assert collector.kafka.stats.unkeyed == 60
    warnings = [r.getMessage() for r in caplog.records if "not keyed by their trace id" in r.getMessage()]
    assert len(warnings) == 1 and "partition_traces_by_id: true" in warnings[0]


def _collector_process(url: str, kafka, wal_dir, group: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "collector", "--store", url, "--kafka", kafka.bootstrap_servers,
         "--topic", "crash", "--group", group, "--grpc-port", "-1", "--http-port", "-1", "--decision-wait", "0.5",
         "--wal-dir", str(wal_dir)], stdout=subprocess.DEVNULL, stderr=open(f"{wal_dir}.log", "ab"))


def test_a_collector_killed_mid_run_loses_no_acknowledged_span_and_stores_each_trace_once(
        kafka, fleet_messages, clickhouse_server, tmp_path):
    url = clickhouse_server.store_url("crash")
    processes = [_collector_process(url, kafka, tmp_path / f"c{i}", "crash") for i in range(3)]
    reader = open_store(url)
    half = len(fleet_messages) // 2
    try:
        assert publish(kafka.bootstrap_servers, "crash", fleet_messages[:half]) == half
        _wait(lambda: _stored(reader) > 500, 120, "the collectors to store traces")
        processes[0].send_signal(signal.SIGKILL)  # mid-run: traces pending, offsets uncommitted
        processes[0].wait(10)
        killed_at = time.monotonic()
        assert publish(kafka.bootstrap_servers, "crash", fleet_messages[half:]) == len(fleet_messages) - half
        processes[0] = _collector_process(url, kafka, tmp_path / "c0", "crash")  # restarted
        recovery = _wait(lambda: _stored(reader) >= TRACES, 180, "every trace after the restart")
        print(f"\nkill -9 to every trace stored: {time.monotonic() - killed_at:.1f} s (restart to done {recovery:.1f} s)")
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(30)
    published = {value for _, value in fleet_messages}
    spans = sum(len(SpanBatch.decode(value).rows) for value in published)
    stored = reader.sql("SELECT count() AS n, count(DISTINCT span_id) AS ids FROM spans").to_pylist()[0]
    assert stored == {"n": spans, "ids": spans}  # every acknowledged span, once
    requests = reader.sql("SELECT count() AS n, count(DISTINCT trace_id) AS traces FROM requests").to_pylist()[0]
    assert requests == {"n": TRACES, "traces": TRACES}
    versions = reader.sql("SELECT count() AS n FROM request_versions").to_pylist()[0]["n"]
    assert versions >= TRACES  # a trace read twice: its second decision is a superseded version, not a second row


def _stored(reader) -> int:
    try:
        return reader.sql("SELECT count() AS n FROM requests").to_pylist()[0]["n"]
    except (StoreUnavailable, QueryRefused):  # the collectors have not made the database (or its tables) yet
        return 0


def test_rotel_s_kafka_exporter_is_detected_as_unkeyed(kafka, clickhouse_server, tmp_path, caplog):
    """Spans through rotel (a real OpenTelemetry collector) into Kafka with its kafka exporter: its messages
    carry no key, and the kvtrace collector reading them says so once, naming what to set."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from kvtrace.testbed.peers import Rotel

    builts = [build("push"), build("pull")]
    collector = _fleet_collector(clickhouse_server.store_url("rotel"), kafka, tmp_path, "r", kafka_topic="rotel",
                                 kafka_group="rotel")
    try:
        with Rotel(kafka=(kafka.bootstrap_servers, "rotel")) as rotel:
            export = grpc.insecure_channel(f"127.0.0.1:{rotel.grpc_port}").unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=trace_service_pb2.ExportTraceServiceRequest.SerializeToString,
                response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString)
            for built in builts:
                for request in built.requests:
                    export(request, timeout=10)
            _wait(lambda: collector.kafka.stats.messages >= 1 and collector.assembler.stats.traces_decided >= 2, 60,
                  "rotel's messages")
    finally:
        collector.shutdown()
    assert collector.kafka.stats.unkeyed == collector.kafka.stats.messages >= 1
    warnings = [r.getMessage() for r in caplog.records if "not keyed by their trace id" in r.getMessage()]
    assert len(warnings) == 1 and "(key b''," in warnings[0]  # rotel sends an empty key
    stored = open_store(clickhouse_server.store_url("rotel")).sql("SELECT trace_id FROM requests").to_pylist()
    assert {r["trace_id"] for r in stored} == {b.trace_id for b in builts}  # one collector: nothing split


def test_clocks_measured_by_one_collector_align_the_traces_every_collector_decides(kafka, clickhouse_server,
                                                                                    tmp_path):
    """Every process exchanges clocks with one collector of the group (its ``clock_endpoint``); the others
    read those samples back from the shared store, so each shard places each process by its measured
    offset (with its error bound), not by inference from the third of the traces it sees."""
    from kvtrace.telemetry.clock import ClockSync

    url = clickhouse_server.store_url("clocks")
    collectors = [_fleet_collector(url, kafka, tmp_path, f"k{i}", kafka_topic="clocks", kafka_group="clocks",
                                   **({"http_port": 0} if i == 0 else {})) for i in range(3)]
    generator = FleetGenerator(FleetShape(routers=2, prefill=4, decode=4, skew_ms=50.0, late_share=0.0))
    skews = {**{router: 0 for router in generator.routers}, **generator.skew_ns}
    endpoint = next(r for r in collectors[0].receivers if "Http" in type(r).__name__).endpoint
    syncs = [ClockSync(endpoint, "http/protobuf", name, lambda s=skew: time.time_ns() + s, interval_ms=1)
             for name, skew in skews.items()]
    try:
        for _ in range(3):  # three bursts each, handed over with the next: two samples per process
            for sync in syncs:
                sync.tick()
            time.sleep(0.3)
        _wait(lambda: all(c.kafka.stats.partitions for c in collectors), 60, "the group to share the partitions")
        _wait(lambda: all(c.clocks.measured(name) for c in collectors for name in skews), 30,
              "every collector to know every measured clock")
        messages = list(generator.messages(600, time.time_ns() - 15 * 10**9))
        assert publish(kafka.bootstrap_servers, "clocks", messages) == len(messages)
        reader = open_store(url)
        _wait(lambda: reader.sql("SELECT count() AS n FROM requests").to_pylist()[0]["n"] >= 600, 120,
              "every trace in the store")
        local = [sum(1 for name in skews if c.clocks.offset(name, time.time_ns()) is not None) for c in collectors]
        shared = [c.shared_clocks.read_samples for c in collectors]
        decided = [c.assembler.stats.traces_decided for c in collectors]
    finally:
        for sync in syncs:
            sync.close()
        for c in collectors:
            c.shutdown()
    assert local == [len(skews), 0, 0] and shared[0] == 0 and all(shared[1:]), (local, shared)
    assert all(decided), decided  # every shard decided traces
    rows = reader.sql("SELECT trace_id, prefill_instance, decode_instance, clock_offsets, clock_bounds "
                      "FROM requests WHERE prefill_instance != '' AND decode_instance != ''").to_pylist()
    assert len(rows) >= 0.9 * 600
    for row in rows:
        offsets, bounds = dict(row["clock_offsets"]), dict(row["clock_bounds"])
        for instance in (row["prefill_instance"], row["decode_instance"]):
            # add the offset to the process's times to get its router's (unskewed) clock: minus its skew
            assert instance in bounds and bounds[instance] < 5_000_000, (row["trace_id"], instance, bounds)
            assert abs(offsets[instance] + skews[instance]) <= bounds[instance] + 200_000, (instance, offsets)


def test_a_clickhouse_server_removes_the_folder_it_made_and_keeps_one_it_was_given(tmp_path):
    """Each ClickHouseServer() made a temporary folder (its data, its log) and left it behind: two more
    under /tmp per test run. Now the folder it made goes with it; a folder it was given stays the caller's."""
    from kvtrace.testbed.peers import ClickHouseServer

    with ClickHouseServer() as server:
        made = server.directory
        assert (made / "config.xml").is_file()
    assert not made.exists()
    given = tmp_path / "kept"
    with ClickHouseServer(str(given)):
        pass
    assert (given / "config.xml").is_file()
