"""The collector end to end in-process: contract traces in any order, attribution, store."""

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace.collectors import wire
from kvtrace.collectors.model import SpanBatch
from tests.helpers import wait_until
from tests.collectors.traces import MS, build, shuffled_span_requests

CATEGORIES = ("compute", "queue", "coordination", "wire", "unattributed")


def decided(built):
    """The breakdown the collector makes of a built trace."""
    from kvtrace.collectors.attribution import Attributor

    return Attributor().attribute(built.trace_id, built.rows())


def requests_rows(collector):
    collector.store.flush()
    return collector.store.query(
        "SELECT trace_id, mode, ttft_ms, compute_ms, queue_ms, coordination_ms, wire_ms, unattributed_ms, "
        "complete, error, rendezvous_order, missing FROM requests ORDER BY trace_id")


def test_shuffled_duplicated_skewed_traces_are_attributed_exactly(make_collector):
    collector = make_collector()
    cases = [build("push", "registration_first"), build("push", "kv_first"), build("pull"),
             build("pull", fail="read"), build("push", drop={"decode"}), build("pull", drop={"prefill"}),
             build("push", skew_ms={"decode": 50}, hosts="fast"),
             build("pull", skew_ms={"decode": -50}, hosts="slow")]
    for request in shuffled_span_requests(cases):
        collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: len(requests_rows(collector)) == len(cases))
    rows = {r[0]: r for r in requests_rows(collector)}
    for built in cases:
        ttft, parts = rows[built.trace_id][2], rows[built.trace_id][3:8]
        assert sum(parts) == pytest.approx(ttft, abs=1e-6)
        assert all(p >= 0 for p in parts)
        assert ttft == pytest.approx(built.ttft_ns / MS)
    exact = cases[:4]  # same clocks, both halves: the numbers are known
    for built in exact:
        parts = dict(zip(CATEGORIES, rows[built.trace_id][3:8]))
        assert parts == pytest.approx({k: v / MS for k, v in built.expected.items()}, abs=1e-6)
    assert rows[cases[1].trace_id][10] == "kv_first" and rows[cases[0].trace_id][10] == "registration_first"
    assert rows[cases[3].trace_id][9] is True  # the failed READ
    for incomplete in cases[4:6]:
        assert rows[incomplete.trace_id][8] is False and rows[incomplete.trace_id][11]
    spans = collector.store.query("SELECT count(*), count(DISTINCT trace_id || span_id) FROM spans")[0]
    total = sum(len(ss.spans) for b in cases for r in b.requests for rs in r.resource_spans for ss in rs.scope_spans)
    assert spans[1] == total and spans[0] > total  # every span stored; retried duplicates kept raw
    stages = collector.store.query("SELECT count(*) FROM stages WHERE critical_ms < 0 OR duration_ms < 0")[0][0]
    assert stages == 0


def test_late_span_replaces_the_breakdown(make_collector):
    collector = make_collector()
    built = build("push")
    requests = shuffled_span_requests([built], seed=3)
    late = next(r for r in requests if r.resource_spans[0].scope_spans[0].spans[0].name == "engine.first_token")
    early = [r for r in requests if r.resource_spans[0].scope_spans[0].spans[0].name != "engine.first_token"]
    for request in early:
        collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: len(requests_rows(collector)) == 1)
    assert requests_rows(collector)[0][8] is False  # first decision: no first token yet
    collector.consume(SpanBatch.of(late))
    assert wait_until(lambda: requests_rows(collector)[0][8] is True)
    assert collector.assembler.stats.traces_late == 1
    assert collector.store.query("SELECT count(*) FROM requests")[0][0] == 1


def test_span_for_a_forgotten_trace_does_not_overwrite_its_breakdown(make_collector):
    # The assembler remembers max_traces decided traces; a span arriving after that starts
    # a one-span "trace" whose breakdown must not replace the whole one already stored.
    collector = make_collector(max_traces=2)
    first, *others = [build("push") for _ in range(4)]
    for built in [first, *others]:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
        assert wait_until(lambda: built.trace_id in {r[0] for r in requests_rows(collector)})
    collector.consume(SpanBatch.of(first.requests[0]))  # a retry, long after
    assert wait_until(lambda: collector.assembler.stats.traces_decided == 5)
    row = next(r for r in requests_rows(collector) if r[0] == first.trace_id)
    assert row[8] is True and row[2] == pytest.approx(first.ttft_ns / MS)
    assert collector.store.query("SELECT count(*) FROM requests")[0][0] == 4


def test_a_trace_that_cannot_be_attributed_does_not_stop_the_others(make_collector):
    collector = make_collector()
    broken, fine = build("push"), build("pull")
    attribute = collector.attributor.attribute

    def failing(trace_id, spans):
        if trace_id == broken.trace_id:
            raise RuntimeError("boom")
        return attribute(trace_id, spans)

    collector.attributor.attribute = failing
    for built in (broken, fine):
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    assert wait_until(lambda: [r[0] for r in requests_rows(collector)] == [fine.trace_id])
    assert collector.metrics._rejected.labels("attribution_error")._value.get() == 1
    assert collector.store.query("SELECT count(DISTINCT trace_id) FROM spans")[0][0] == 2  # both stored


def test_every_requests_column_is_written_by_the_store(make_collector):
    """Requests are inserted by column name: the table the writer builds must name every column of
    ``requests`` (a column it forgot would otherwise be silently NULL) and no other."""
    from kvtrace.collectors.store import request_table

    collector = make_collector()
    written = request_table([decided(build("push"))], 1, {}, lambda key: 1).column_names
    declared = [name for name, *_ in collector.store.query("DESCRIBE requests")]
    assert sorted(written) == sorted(declared) and len(written) == len(set(written))


def test_client_columns_hold_the_client_spans_measures_and_stay_null_without_one():
    """A sweep's requests carry the load generator's client span; others have none, and a flush may hold
    both kinds or only the second."""
    from kvtrace.collectors.store import request_table
    from kvtrace.telemetry import semconv

    swept, served = decided(build("push")), decided(build("pull"))
    swept.client = {semconv.CLIENT_TTFT_NS: 12.5 * MS, semconv.CLIENT_OUTPUT_TOKENS: 7, semconv.BENCH_RATE: 2.0}
    both = request_table([swept, served], 1, {}, lambda key: 1)
    assert both.column("client_ttft_ms").to_pylist() == [12.5, None]
    assert both.column("client_output_tokens").to_pylist() == [7, None]
    assert both.column("point_rate").to_pylist() == [2.0, None]
    assert both.column("client_tpot_ms").to_pylist() == [None, None]  # not on this client span
    only_served = request_table([served, served], 2, {}, lambda key: 1)
    clients = ["client_ttft_ms", "client_tpot_ms", "client_itl_p50_ms", "client_itl_p99_ms", "client_output_tokens",
               "point_rate", "point_concurrency", "point_prompt_tokens"]
    for column in clients:
        assert only_served.column(column).to_pylist() == [None, None]
        assert only_served.schema.field(column).type == both.schema.field(column).type


def test_every_span_keeps_its_place_in_the_export_request_that_brought_it(make_collector):
    """``batch_id`` and ``batch_index`` name each span's export request and its index there (how a trace's
    originals are found in the write-ahead log), over requests of different lengths stored in one flush."""
    collector = make_collector()
    sent = {}  # (trace, span) -> (which request, index in it)
    requests = [request for built in (build("push"), build("pull", drop={"router"}), build("push", "kv_first"))
                for request in built.requests]
    for number, request in enumerate(requests):
        batch = SpanBatch.of(request)
        sent.update({(row.trace_id.hex(), row.span_id.hex()): (number, index) for index, row in enumerate(batch.rows)})
        collector.consume(batch)
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 3)
    collector.store.flush()
    stored = {(t, s): (batch, index) for t, s, batch, index in collector.store.query(
        "SELECT trace_id, span_id, batch_id, batch_index FROM spans")}
    assert {key: index for key, (_, index) in stored.items()} == {key: index for key, (_, index) in sent.items()}

    def grouped(places: dict) -> set[frozenset]:  # the spans of each request (or batch id) together
        return {frozenset(key for key, (other, _) in places.items() if other == batch) for batch, _ in places.values()}
    assert grouped(stored) == grouped(sent) and len(grouped(sent)) == len(requests)


def test_every_span_keeps_its_own_sender(make_collector):
    """The span table maps each span's resource (an index into its own request's resources) to the file's
    origin ids for the whole flush at once: over requests with one and with several resources stored in one
    flush, each stored span must name its own sender."""
    collector = make_collector()
    requests = [*build("push").requests]  # one resource each
    for built in (build("pull"), build("push", "kv_first")):  # all of a trace's resources in one request
        merged = ExportTraceServiceRequest()
        for request in built.requests:
            merged.resource_spans.extend(request.resource_spans)
        requests.append(merged)
    assert any(len(r.resource_spans) > 1 for r in requests) and any(len(r.resource_spans) == 1 for r in requests)
    sent = {}
    for request in requests:
        batch = SpanBatch.of(request)
        sent.update({(row.trace_id.hex(), row.span_id.hex()): (row.origin.service, row.origin.instance)
                     for row in batch.rows})
        collector.consume(batch)
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 3)
    collector.store.flush()
    stored = {(t, s): (service, instance) for t, s, service, instance in collector.store.query(
        "SELECT trace_id, span_id, service, instance FROM spans")}
    assert stored == sent and len(set(sent.values())) > 2


def test_every_span_keeps_its_own_name_and_stage(make_collector):
    """The span table's name and stage columns are built per flush from every batch's columns at once: each
    stored row must hold its own span's name and stage, over several export requests in one flush, with a
    name outside the contract (non-ASCII) among them."""
    collector = make_collector()
    requests = shuffled_span_requests([build("push", "kv_first"), build("pull"), build("pull", fail="read")], seed=5)
    requests[3].resource_spans[0].scope_spans[0].spans[0].name = "vendor.ステージ-é"
    sent = {}
    for request in requests:
        batch = SpanBatch.of(request)
        sent.update({(row.trace_id.hex(), row.span_id.hex()): (row.name, row.stage) for row in batch.rows})
        collector.consume(batch)
    assert wait_until(lambda: collector.store.query("SELECT count(*) FROM requests")[0][0] == 3)
    collector.store.flush()
    stored = {(t, s): (name, stage) for t, s, name, stage in collector.store.query(
        "SELECT trace_id, span_id, name, stage FROM spans")}
    assert stored == sent and "vendor.ステージ-é" in {name for name, _ in stored.values()}
    assert len({name for name, _ in sent.values()}) > 5 and len({stage for _, stage in sent.values()}) > 10


@pytest.mark.skipif(wire.native is None, reason="native module not built")
def test_the_stage_columns_are_the_same_native_or_python(monkeypatch):
    """``store.stage_columns`` natively and in Python: the same ids (new stages assigned in the same
    order), times and offsets, over traces of every shape (TP ranks, a gateway's, failed, incomplete)."""
    from kvtrace.collectors import store

    cases = [build("push", "kv_first"), build("pull", late_rank_ms=3), build("push", drop={"decode:completion"}),
             build("pull", fail="read"), build("push", router="gw", contract=1), build("push", drop={"router"})]
    breakdowns = [decided(b) for b in cases]
    results = []
    for native in (store.native, None):
        monkeypatch.setattr(store, "native", native)
        known = {("router", "pd_route"): 7}
        assigned: dict = {}  # as the stores assign: once per new stage, the same id when asked again
        columns = store.stage_columns(breakdowns, known, lambda key: assigned.setdefault(key, 100 + len(assigned)))
        results.append(([column.to_pylist() for column in columns], list(assigned.items())))
    assert results[0] == results[1]
    (ids, starts, ends, critical, offsets), assigned = results[0]
    assert offsets[-1] == len(ids) == sum(len(b.timings) for b in breakdowns) and len(offsets) == len(breakdowns) + 1
    assert ("router", "pd_route") not in dict(assigned) and 7 in ids and set(ids) == {7, *dict(assigned).values()}
    assert all(e >= s for s, e in zip(starts, ends)) and sum(critical) > 0


@pytest.mark.skipif(wire.native is None, reason="native module not built")
def test_the_number_columns_are_the_same_native_or_python(monkeypatch):
    """``store.number_columns`` natively and in Python: the same values, types and nulls, over real breakdowns of
    every shape and random fields on each column's edges (0 as null, negative times floored to the µs, int32's
    limits, ints past int64 or a column's type, which go the Python way: the same columns, or the same error)."""
    import random

    import pyarrow as pa

    from kvtrace.collectors import store
    from kvtrace.collectors.model import INT32_MAX

    rng = random.Random(20)
    cases = [build("push", "kv_first"), build("pull", late_rank_ms=3), build("push", drop={"decode:completion"}),
             build("pull", fail="read"), build("push", router="gw", contract=1), build("push", drop={"router"})]
    edges = [0, 1, -1, -999, -1000, -1001, 999, 1000, 1001, 2**53 + 1, -(2**63), 2**63 - 1, INT32_MAX, -INT32_MAX - 1,
             1_234_567_890_123]

    def random_breakdowns(n):
        out = []
        for _ in range(n):
            b = decided(rng.choice(cases))
            for column, field, part, kind in store.NUMBER_COLUMNS:
                if rng.random() < 0.3:
                    value = rng.choice(edges) if rng.random() < 0.5 else rng.randint(0, 10**12)
                    if kind == store.INT32:
                        value = max(-INT32_MAX - 1, min(INT32_MAX, value))
                    if part is not None:
                        b.parts[part] = value
                    elif field not in ("tpot_ns", "kv_hold_ns"):  # properties: set what they are made of
                        setattr(b, field, value)
            if rng.random() < 0.2:
                b.parts.pop(rng.choice(list(b.parts)), None)  # a category the trace has none of
            if rng.random() < 0.3:
                b.output_tokens, b.last_token_ns = rng.choice([0, 1, 2, 17]), b.ttft_ns + rng.randint(-10, 10**9)
            out.append(b)
        return out

    def both(breakdowns):
        results = []
        for native in (store.native, None):
            monkeypatch.setattr(store, "native", native)
            try:
                columns = store.number_columns(breakdowns)
                results.append({name: (str(column.type), column.to_pylist()) for name, column in columns.items()})
            except Exception as exc:  # noqa: BLE001 - the same error either way is what is asserted
                results.append(type(exc))
        return results

    for _ in range(40):
        native_columns, python_columns = both(random_breakdowns(rng.randint(0, 30)))
        assert native_columns == python_columns
    native_columns, _ = both(random_breakdowns(20))
    assert set(native_columns) == {column for column, _, _, _ in store.NUMBER_COLUMNS}
    assert native_columns["e2e_ms"][0] == "double" and native_columns["started_at"][0] == "timestamp[us, tz=UTC]"
    assert native_columns["output_tokens"][0] == "int32" and native_columns["transfer_bytes"][0] == "int64"

    b = decided(cases[0])
    b.e2e_ns, b.output_tokens = 0, 1
    assert both([b])[0]["e2e_ms"][1] == [None] and both([b])[0]["tpot_ms"][1] == [None]
    b.start_ns = -1001  # floored, as Python's //
    assert both([b])[0]["started_at"][1] == both([b])[1]["started_at"][1]
    b.transfer_bytes = 2**64  # past int64: the Python way, and its error
    assert both([b]) == [OverflowError, OverflowError]
    b.transfer_bytes, b.prompt_tokens = 5, INT32_MAX + 1  # past int32: the same
    assert both([b]) == [pa.ArrowInvalid, pa.ArrowInvalid]
    b.prompt_tokens, b.parts["compute"] = 5, 2**70  # a part past int64 is still a double
    assert both([b])[0] == both([b])[1] and both([b])[0]["compute_ms"][1] == [2**70 / 1e6]


def test_the_pipeline_leaves_no_reference_cycles(tmp_path):
    """What lets the collector set the GC's young threshold high (``service.GC_YOUNG_THRESHOLD``): decoding,
    logging, storing, assembling, attributing, forwarding and flushing traces of every shape leave no
    garbage that only the cyclic GC would free (its young collections used to cost ~7 % of the pipeline)."""
    import gc

    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.service import Collector

    # The pipeline's parts in order on this thread, as bench/collector_stages.py drives them; the
    # forwarder's upstream thread is never started, so nothing is sent.
    collector = Collector(CollectorConfig(db_path=str(tmp_path / "cycles.duckdb"), grpc_port=0, http_port=None,
                                          decision_wait_s=0.0, forward=["grpc://127.0.0.1:9"]))

    def shapes(request_id: str) -> list:
        return [build("push", "kv_first", request_id=request_id), build("pull", late_rank_ms=3, request_id=request_id),
                build("push", drop={"decode:completion"}, request_id=request_id),
                build("pull", fail="read", request_id=request_id),
                build("push", router="gw", contract=1, request_id=request_id),
                build("push", drop={"router"}, request_id=request_id),
                build("pull", skew_ms={"decode": -50}, hosts="slow", request_id=request_id)]

    def run(payloads: list[bytes]) -> None:
        for payload in payloads:
            batch = SpanBatch.decode(payload)
            collector.store.add_spans(batch, collector.wal.append(payload))
            collector.forwarder.consume_batch(payload, len(batch.rows))
            collector.assembler.add(batch.rows)
            collector.assembler.poll(flush_all=True)
        collector.forwarder.flush()
        collector.store.flush()

    try:
        first, counted = (shapes(request_id) for request_id in ("cmpl-first", "cmpl-counted"))
        run([r.SerializeToString() for r in shuffled_span_requests(first)])  # first calls (imports, caches)
        # built before counting: OpenTelemetry's SDK, which records the test traces, makes cycles of its own
        payloads = [r.SerializeToString() for r in shuffled_span_requests(counted)]
        gc.collect()
        gc.disable()
        try:
            run(payloads)
            found = gc.collect()
        finally:
            gc.enable()
        assert collector.store.query("SELECT count(*) FROM requests")[0][0] == 2 * len(counted)
        assert found == 0
    finally:
        collector.store.shutdown()
        collector.wal.close()


def test_a_breakdown_the_store_cannot_take_is_dropped_and_every_other_row_kept(tmp_path, caplog):
    """A decided trace whose row the store refuses (here 3e9 prompt tokens, past the int32 column; the
    attribution bounds today's known causes, this guards against the next) used to fail every later
    flush: nothing was committed again. After three failed flushes the writer commits the spans and the
    rest, then the decisions in halves, and drops only that one, with an error naming its trace."""
    import logging

    from kvtrace.collectors.store import ISOLATE_AFTER, Store

    builts = [build(mode, request_id=f"cmpl-{i}") for i, mode in enumerate(["push", "pull"] * 3)]
    bad = decided(builts[2])
    bad.prompt_tokens = 3_000_000_000
    store = Store(str(tmp_path / "poison.duckdb"), flush_interval_s=0.05)
    store.start("test", {})  # its writer thread
    try:
        with caplog.at_level(logging.ERROR, logger="kvtrace.collectors.store"):
            for request in builts[0].requests:
                store.add_spans(SpanBatch.of(request), None)
            for built in builts:
                store.add_breakdown(bad if built is builts[2] else decided(built))
            assert wait_until(lambda: store.dropped_decisions == 1, timeout_s=30)
            kept = {row[0] for row in store.query("SELECT trace_id FROM requests")}
            assert kept == {b.trace_id for b in builts} - {bad.trace_id}
            assert store.query("SELECT count(*) FROM spans")[0][0] == sum(
                len(ss.spans) for q in builts[0].requests for rs in q.resource_spans for ss in rs.scope_spans)
            assert any(bad.trace_id in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
            failed = [r for r in caplog.records if "a flush into" in r.getMessage()]
            assert len(failed) == ISOLATE_AFTER
            later = build("push", request_id="cmpl-later")  # and the store goes on committing
            store.add_breakdown(decided(later))
            assert wait_until(lambda: store.query("SELECT count(*) FROM requests WHERE trace_id = ?",
                                                  [later.trace_id])[0][0] == 1)
    finally:
        store.shutdown()


def test_a_dropped_breakdown_is_counted_in_the_health_rows_and_in_prometheus(make_collector):
    """A breakdown dropped as above is not lost silently: the collector's status (its health rows, read
    by the Health page) and its Prometheus counter say how many."""
    collector = make_collector()
    bad = decided(build("push"))
    bad.prompt_tokens = 3_000_000_000  # past the int32 column, as above
    collector.store.add_breakdown(bad)
    assert wait_until(lambda: collector.store.dropped_decisions == 1, timeout_s=60)
    assert collector.metrics.registry.get_sample_value("kvtrace_collector_decisions_dropped_total") == 1
    assert collector.status()["dropped_decisions"] == 1
    collector.store.add_health(collector.status())  # what the collector does every few seconds
    assert wait_until(lambda: collector.store.query("SELECT max(dropped_decisions) FROM collector_health")[0][0] == 1,
                      timeout_s=30)


def test_a_store_that_fails_for_a_while_drops_nothing(tmp_path, monkeypatch):
    """Writes that fail whatever they hold (a full disk, the server away), for longer than the writer's
    patience: the isolation finds the rest failing too, puts everything back, and once writes pass again
    every row is committed; no breakdown is dropped."""
    from kvtrace.collectors.store import ISOLATE_AFTER, Store

    builts = [build(mode, request_id=f"cmpl-{i}") for i, mode in enumerate(["push", "pull"] * 2)]
    store = Store(str(tmp_path / "away.duckdb"), flush_interval_s=0.05)
    write, calls = store._write, []

    def failing_for_a_while(pending) -> None:
        calls.append(len(pending.decided))
        if len(calls) <= 2 * ISOLATE_AFTER + 1:  # three flushes, their isolation, three flushes: then they pass
            raise OSError("no space left on device")
        write(pending)
    monkeypatch.setattr(store, "_write", failing_for_a_while)
    store.start("test", {})
    try:
        for built in builts:
            store.add_breakdown(decided(built))
        assert wait_until(lambda: store.query("SELECT count(*) FROM requests")[0][0] == len(builts), timeout_s=30)
        assert store.dropped_decisions == 0 and len(calls) > 2 * ISOLATE_AFTER + 1
    finally:
        store.shutdown()


def test_a_store_with_nothing_new_commits_nothing(tmp_path):
    """Once everything buffered is committed, the writer's next flushes write nothing: a commit with nothing
    new cost ~6 ms of CPU every 0.5 s on an idle collector, and its new data version emptied every reader's
    cache (they key their answers on it). The log position goes with the commit that records it, and comes
    back with a failed one."""
    from kvtrace.collectors.store import Store

    store = Store(str(tmp_path / "idle.duckdb"))
    try:
        request = build("push").requests[0]
        store.add_spans(SpanBatch.of(request), (0, 100))
        store.flush()
        committed = store.data_version
        assert store.committed_position == (0, 100)
        store.flush()
        store.flush()
        assert store.data_version == committed
        store.add_spans(SpanBatch.of(request), (0, 200))
        with pytest.raises(OSError):  # a flush that fails puts the position back with its rows...
            with store.putting_back(store.take()):
                raise OSError("disk full")
        store.flush()  # ... and the next one commits it
        assert store.committed_position == (0, 200) and store.wal_position() == (0, 200)
        assert store.data_version == committed + 1
    finally:
        store.shutdown()
