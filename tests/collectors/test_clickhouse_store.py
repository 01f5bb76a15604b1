"""The fleet's shared store: a real ClickHouse server (chdb-core) written by a real collector answers every
reader question with the numbers the embedded DuckDB store gives for the same spans."""

import math
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from kvtrace.collectors import clickhouse, schema
from kvtrace.collectors.config import CollectorConfig
from kvtrace.collectors.read import Filters, StoreUnavailable, open_store
from kvtrace.collectors.service import Collector
from kvtrace.testbed.synthetic import Generator, Workload
from tests.collectors.traces import build
from tests.helpers import feed

START = datetime.now(timezone.utc).replace(second=0, microsecond=0) - timedelta(minutes=20)


def _payloads() -> list[bytes]:
    """Synthetic traffic over ~6 minutes and two runs (failures and incomplete traces included), and contract
    traces of every shape: kv_first, a failed READ, a missing completion, a late TP rank, skewed clocks."""
    workload = Workload(rate_per_s=4.0, failure_rate=0.05, incomplete_rate=0.05, late_registration_rate=0.2,
                        run_every_s=180.0, sweep_concurrency=(1, 4), seed=11)
    synthetic = list(Generator(workload).requests(1_500, int(START.timestamp() * 1e9), per_request=200))
    shapes = [build("push", "kv_first"), build("pull", fail="read"), build("push", drop={"decode:completion"}),
              build("pull", late_rank_ms=40.0), build("push", skew_ms={"prefill": 30.0, "decode": -20.0}),
              build("push", drop={"decode"})]
    runs = [_run_record(run_id, i) for i, run_id in enumerate(("push-000", "pull-001", "push-002"))]
    return synthetic + [request.SerializeToString() for built in shapes for request in built.requests] + runs


def _run_record(run_id: str, i: int) -> bytes:
    """A sweep's ``kvtrace.run`` record of one of the synthetic runs (a trace of its own)."""
    import json

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from kvtrace.telemetry import semconv

    at = int((START + timedelta(minutes=3 * i)).timestamp() * 1e9)
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in ((semconv.RES_SERVICE_INSTANCE_ID, "sweep"), (semconv.RES_RUN_ID, run_id)):
        resource_spans.resource.attributes.add(key=key).value.string_value = value
    span = resource_spans.scope_spans.add().spans.add(
        trace_id=bytes([0xAB, i + 1]) * 8, span_id=bytes([0xCD, i + 1]) * 4, name=semconv.SPAN_RUN,
        start_time_unix_nano=at, end_time_unix_nano=at + 10**9)
    span.attributes.add(key=semconv.RUN_CONFIG).value.string_value = json.dumps(
        {"mode": run_id.split("-")[0], "status": "done", "started_ns": at})
    return request.SerializeToString()


def _collect(store: str, wal_dir, payloads: list[bytes]) -> None:
    collector = Collector(CollectorConfig(db_path=store, wal_dir=str(wal_dir), grpc_port=None, http_port=0,
                                          query_port=None, decision_wait_s=0.0))
    collector.start()
    feed(collector, payloads)
    collector.shutdown()


@pytest.fixture(scope="module")
def payloads():
    return _payloads()


@pytest.fixture(scope="module")
def duck(payloads, tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity-duckdb")
    path = str(folder / "kvtrace.duckdb")
    _collect(path, folder / "wal", payloads)
    return path


@pytest.fixture(scope="module", params=["one-server", "two-shards"])
def stores(request, duck, payloads, clickhouse_server, tmp_path_factory):
    """The same spans in a DuckDB file and in a ClickHouse database (on one server, or sharded over two behind
    Distributed tables), each written by a collector."""
    server = request.getfixturevalue("clickhouse_cluster") if request.param == "two-shards" else clickhouse_server
    url = server.store_url("parity")
    _collect(url, tmp_path_factory.mktemp("clickhouse-wal"), payloads)
    return open_store(duck), open_store(url)


WINDOW = Filters(since=START + timedelta(minutes=1), until=START + timedelta(minutes=4))
NARROW = Filters(modes=("push",), min_length_bucket=9, max_length_bucket=12)
FILTERS = {"all": Filters(), "window": WINDOW, "push-length": NARROW}
QUESTIONS = ["kpis", "unattributed_shares", "parts_by_mode", "cohorts", "ttft_over_time", "ttft_cdf",
             "parts_by_length", "transfers", "stage_table", "stage_heatmap", "rendezvous", "kv_hold",
             "decode_smoothness", "slowest", "health"]


def _plain(value):
    """An answer as plain Python (tables as rows, rows of a question that does not order them sorted)."""
    if isinstance(value, pa.Table):
        value = value.to_pylist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if items and all(isinstance(v, dict) for v in items):
            items.sort(key=lambda row: repr(sorted((k, v) for k, v in row.items() if not isinstance(v, float))))
        return items
    return value


def _same(a, b, where="answer"):
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), \
            f"{where}: DuckDB {a!r}, ClickHouse {b!r}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: {len(a)} rows != {len(b) if b else b}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: DuckDB {a!r}, ClickHouse {b!r}"


def test_the_stores_hold_the_same_requests(stores):
    duck, house = stores
    assert house.source.kind == "clickhouse"
    count = "SELECT count(*) AS n, count(DISTINCT trace_id) AS traces FROM requests"
    assert duck.sql(count).to_pylist() == house.sql(count).to_pylist()
    assert duck.sql(count).to_pylist()[0]["n"] > 1_000


def test_filter_options_are_the_same(stores):
    duck, house = stores
    _same(_plain(duck.filter_options()), _plain(house.filter_options()))


@pytest.mark.parametrize("filters", FILTERS, ids=str)
@pytest.mark.parametrize("question", QUESTIONS)
def test_every_reader_question_has_the_same_answer(stores, question, filters):
    duck, house = stores
    a, b = (_plain(getattr(reader, question)(FILTERS[filters])) for reader in stores)
    if question == "health":  # the collectors' own counters differ (other runs, other timings): same columns
        a_runs, b_runs = a.pop("collector"), b.pop("collector")  # (recorded now: outside a past window)
        assert bool(a_runs) == bool(b_runs) == (filters != "window")
        assert not a_runs or a_runs[0].keys() == b_runs[0].keys()
    assert a, f"{question}: nothing to compare"
    _same(a, b, question)


def test_the_runs_questions_have_the_same_answers(stores):
    """The sweep's questions (kvtrace compare / whatif and the dashboard's Runs page)."""
    from kvtrace.collectors.read import runs

    duck, house = stores
    listed = _plain(runs.list_runs(duck))
    assert len(listed) == 3
    _same(listed, _plain(runs.list_runs(house)), "list_runs")
    for run_id in ("push-000", "pull-001"):
        _same(runs.run_record(duck, run_id), runs.run_record(house, run_id), f"run_record {run_id}")
        a, b = runs.stage_table(duck, run_id), runs.stage_table(house, run_id)
        assert len(a) > 100 and a == b, run_id
    a, b = (_plain(runs.whatif(reader, "push-000", "pull-001")) for reader in stores)
    assert len(a["points"]) == 2 and all(p["requests"] > 50 for p in a["points"])
    _same(a, b, "whatif")
    a, b = runs.compare(duck, "push-000", "pull-001"), runs.compare(house, "push-000", "pull-001")
    _same(_plain(a["records"]), _plain(b["records"]), "compare")
    assert a["points"] == b["points"] and len(a["points"]) == 2
    for run_id in a["stats"]:
        _same(_plain([vars(s) for s in a["stats"][run_id].values()]),
              _plain([vars(s) for s in b["stats"][run_id].values()]), f"compare {run_id}")


def test_a_request_sample_holds_the_same_tail_and_size(stores):
    duck, house = stores
    a, b = (_plain(reader.requests_sample(Filters(), sample=300, top=20)) for reader in stores)
    assert len(a) == len(b) == 320
    _same([r for r in a if r["top"]], [r for r in b if r["top"]], "top")


def test_a_box_compared_with_the_rest_is_the_same(stores):
    duck, house = stores
    args = (Filters(), START + timedelta(minutes=2), START + timedelta(minutes=3, seconds=30), 0.0, 400.0)
    a, b = (_plain(reader.compare(*args)) for reader in stores)
    assert a["selected"] > 0
    _same(a, b, "compare")


def test_one_trace_is_the_same(stores):
    duck, house = stores
    slowest = duck.slowest(Filters(), limit=3).column("trace_id").to_pylist()
    failed = duck.sql("SELECT trace_id FROM requests WHERE error LIMIT 1").column(0).to_pylist()
    for trace_id in slowest + failed:
        a, b = duck.trace(trace_id), house.trace(trace_id)
        for found in (a, b):  # which commit wrote the row, and when, are the store's own
            del found["request"]["flush_id"], found["request"]["updated_at"]
        _same(_plain(a), _plain(b), trace_id)
        assert house.explanation(trace_id) == duck.explanation(trace_id) != ""
        # the spans: the same, with the attributes the collector reads (a shared store keeps those)
        spans_a, spans_b = (sorted(r.trace_spans(trace_id), key=lambda s: (s["start_ns"], s["span_id"]))
                            for r in stores)
        assert [(s["span_id"], s["name"], s["start_ns"], s["end_ns"], s["status"], s["stage"]) for s in spans_a] == \
               [(s["span_id"], s["name"], s["start_ns"], s["end_ns"], s["status"], s["stage"]) for s in spans_b]
        for x, y in zip(spans_a, spans_b):
            kept = {k: v for k, v in x["attributes"].items() if k in y["attributes"]}
            assert kept and kept == {k: v for k, v in y["attributes"].items() if k in kept}
        assert house.trace_view(trace_id)["stages"]
    assert house.trace("0" * 32) is None


def _collect_in_steps(store: str, wal_dir, steps: list[list[bytes]]) -> None:
    """One collector given each step's requests, its traces decided and committed before the next."""
    collector = Collector(CollectorConfig(db_path=store, wal_dir=str(wal_dir), grpc_port=None, http_port=0,
                                          query_port=None, decision_wait_s=0.0))
    collector.start()
    for step in steps:
        feed(collector, step)
        deadline = time.monotonic() + 10
        while collector.intake.queued() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        collector.assembler.poll(flush_all=True)
        collector.store.flush()
    collector.shutdown()


def test_late_spans_replace_the_decision_and_a_replay_collapses(clickhouse_server, tmp_path):
    """D's spans arrive after the trace was decided without them: the stored row is replaced, in
    ClickHouse as in DuckDB. The same spans written again by another collector (a replay after a kill)
    leave each span and each request once."""
    built = build("push")
    requests = [r.SerializeToString() for r in built.requests]
    decode = [p for p, r in zip(requests, built.requests)
              if any(a.value.string_value == "consumer" for rs in r.resource_spans for a in rs.resource.attributes)]
    early = [p for p in requests if p not in decode]
    assert decode and early
    answers = []
    for store in (str(tmp_path / "late.duckdb"), clickhouse_server.store_url("late")):
        _collect_in_steps(store, tmp_path / f"wal-{len(answers)}", [early, decode])
        reader = open_store(store)
        answers.append(_plain(reader.sql(
            "SELECT trace_id, complete, missing, ttft_ms, compute_ms, coordination_ms, wire_ms FROM requests")))
    assert answers[0] == answers[1] and answers[0][0]["complete"] is True
    url = clickhouse_server.store_url("late")
    _collect(url, tmp_path / "wal-again", requests)  # another collector, the same spans again
    reader = open_store(url)
    spans = reader.sql("SELECT count(*) AS n, count(DISTINCT span_id) AS ids FROM spans").to_pylist()[0]
    assert spans["n"] == spans["ids"] == sum(len(s.spans) for r in built.requests for rs in r.resource_spans
                                               for s in rs.scope_spans)
    assert _plain(reader.sql("SELECT trace_id, complete, missing, ttft_ms, compute_ms, coordination_ms, wire_ms "
                             "FROM requests")) == answers[1]


def test_a_bad_store_url_and_an_unreachable_server_say_so(clickhouse_server):
    with pytest.raises(ValueError, match="--store"):
        CollectorConfig(db_path="clickhouse://", grpc_port=None, http_port=0).validate()
    with pytest.raises(ValueError, match="not a database name"):
        clickhouse.ClickHouseAddress.parse("clickhouse://127.0.0.1:8123/a-b")
    reader = open_store("clickhouse://127.0.0.1:9/nowhere")
    with pytest.raises(StoreUnavailable, match="clickhouse://127.0.0.1:9/nowhere"):
        reader.kpis(Filters())


def test_decision_versions_rank_replacements_above_first_decisions():
    first, later_first = clickhouse.decision_version(100, False), clickhouse.decision_version(200, False)
    replaced, replaced_again = clickhouse.decision_version(150, True), clickhouse.decision_version(300, True)
    assert later_first < first < replaced < replaced_again
    assert time.time_ns() < 2 ** 62  # the versions never cross


@pytest.mark.parametrize("stores", ["two-shards"], indirect=True)
def test_a_sharded_store_keeps_each_trace_on_one_shard(stores):
    duck, house = stores
    address = house.source.address
    per_shard = []
    for shard in address.shards:
        client = address.client(shard=shard)
        per_shard.append({
            "requests": {r[0] for r in client.query("SELECT trace_id FROM request_versions_local FINAL").result_rows},
            "spans": {r[0] for r in client.query("SELECT DISTINCT lower(TraceId) FROM otel_traces_local").result_rows}})
    assert all(shard["requests"] for shard in per_shard)  # both shards hold traces
    assert not per_shard[0]["requests"] & per_shard[1]["requests"]  # a trace's request on one shard
    assert not per_shard[0]["spans"] & per_shard[1]["spans"]  # and all its spans with it
    assert per_shard[0]["requests"] <= per_shard[0]["spans"] and per_shard[1]["requests"] <= per_shard[1]["spans"]
    total = duck.sql("SELECT count(*) AS n FROM requests").to_pylist()[0]["n"]
    assert sum(len(shard["requests"]) for shard in per_shard) == total


def test_store_urls_name_their_shards_and_cluster(clickhouse_server):
    address = clickhouse.ClickHouseAddress.parse("clickhouse://u:p%40ss@h1:9000,h2/fleet?cluster=kv")
    assert (address.host, address.port, address.user, address.password) == ("h1", 9000, "u", "p@ss")
    assert address.shards == (("h1", 9000), ("h2", 8123)) and address.cluster == "kv"
    assert str(address) == "clickhouse://h1:9000,h2:8123/fleet?cluster=kv"
    with pytest.raises(ValueError, match=r"add \?cluster=NAME"):
        clickhouse.ClickHouseAddress.parse("clickhouse://h1,h2/fleet")
    with pytest.raises(ValueError, match="unknown option 'shard'"):
        clickhouse.ClickHouseAddress.parse("clickhouse://h1/fleet?shard=2")
    with pytest.raises(ValueError, match="no cluster 'nowhere' in its remote_servers"):
        clickhouse.create_schema(clickhouse.ClickHouseAddress.parse(
            clickhouse_server.store_url("lonely") + "?cluster=nowhere"))


@pytest.mark.parametrize("server", ["clickhouse_server", "clickhouse_cluster"])
def test_a_database_of_the_previous_schema_is_brought_up_to_date(request, server):
    """A schema-9 database (its health rows without dropped_decisions) is migrated when a collector opens
    it, on each shard, local and Distributed tables both, rather than refused."""
    address = clickhouse.ClickHouseAddress.parse(request.getfixturevalue(server).store_url("older"))
    clickhouse.create_schema(address)
    for shard in address.shards or ((address.host, address.port),):  # what a schema-9 collector left
        client = address.client(shard=shard)
        for table in (["collector_health", "collector_health_local"] if address.cluster else ["collector_health"]):
            client.command(f"ALTER TABLE {table} DROP COLUMN dropped_decisions")
        client.command("TRUNCATE TABLE schema_version")
        client.command("INSERT INTO schema_version VALUES (9)")
    clickhouse.create_schema(address)
    for shard in address.shards or ((address.host, address.port),):
        client = address.client(shard=shard)
        assert client.query("SELECT max(version) FROM schema_version").result_rows[0][0] == schema.SCHEMA_VERSION
        tables = ["collector_health", "collector_health_local"] if address.cluster else ["collector_health"]
        for table in tables:
            columns = [r[0] for r in client.query(f"SELECT name FROM system.columns WHERE database = "
                                                  f"'{address.database}' AND table = '{table}'").result_rows]
            assert columns[-1] == "dropped_decisions", table
