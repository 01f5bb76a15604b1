"""Critical-path attribution on traces built to the contract."""

import pytest

from kvtrace.collectors.attribution import Attributor
from tests.collectors.traces import MS, build


def attribute(built, attributor=None):
    return (attributor or Attributor()).attribute(built.trace_id, built.rows())


def check_invariants(breakdown):
    assert sum(breakdown.parts.values()) == breakdown.ttft_ns
    assert all(v >= 0 for v in breakdown.parts.values()), breakdown.parts
    assert all(s.critical_ns >= 0 and s.duration >= 0 for s in breakdown.stages)


@pytest.mark.parametrize("mode, order", [("push", "registration_first"), ("push", "kv_first"), ("pull", "")])
def test_categories_are_exact_and_sum_to_ttft(mode, order):
    built = build(mode, order or "registration_first")
    breakdown = attribute(built)
    check_invariants(breakdown)
    assert breakdown.ttft_ns == built.ttft_ns
    assert breakdown.parts == built.expected
    assert breakdown.complete and not breakdown.missing and not breakdown.error
    assert breakdown.mode == mode
    assert breakdown.request_id == "cmpl-x-0"
    assert breakdown.transfer_bytes == 2_097_152 and breakdown.prompt_tokens == 2000
    if mode == "push":
        assert breakdown.rendezvous_order == order


def test_registration_first_charges_the_wait_to_prefill_kv_first_to_the_registration():
    reg_first = {(s.side, s.stage): s for s in attribute(build("push", "registration_first")).stages}
    kv_first = {(s.side, s.stage): s for s in attribute(build("push", "kv_first")).stages}
    # The rendezvous span lasts 32 ms, but only the 2 ms after prefill ended are critical.
    assert reg_first[("prefill", "rendezvous")].duration == 32 * MS
    assert reg_first[("prefill", "rendezvous")].critical_ns == 2 * MS
    assert reg_first[("prefill", "prefill")].critical_ns == 144 * MS
    # kv_first: P waited 18 ms for D's registration, so the path runs through D's registration.
    assert kv_first[("prefill", "rendezvous")].duration == 18 * MS
    assert kv_first[("decode", "registration")].critical_ns == 161 * MS
    assert kv_first[("prefill", "prefill")].critical_ns == 0


def test_failed_transfer_is_flagged():
    breakdown = attribute(build("pull", fail="read"))
    assert breakdown.error
    check_invariants(breakdown)


# (without any router span the trace is complete for what an engine-referenced trace carries:
# test_behind_any_router.py)
@pytest.mark.parametrize("drop", ["prefill", "decode", "router:decode_leg", "decode:completion", "prefill:write"])
def test_missing_halves_are_incomplete_but_consistent(drop):
    breakdown = attribute(build("push", drop={drop}))
    assert not breakdown.complete and breakdown.missing
    check_invariants(breakdown)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("skew", [50, -50])
def test_clock_skew_is_estimated_and_never_makes_a_stage_negative(mode, skew):
    attributor = Attributor()
    breakdowns = [attribute(build(mode, skew_ms={"decode": skew}), attributor) for _ in range(20)]
    for breakdown in breakdowns:
        check_invariants(breakdown)
    last = breakdowns[-1]
    # D's times are shifted by `skew` ms; the estimate brings them back within a few ms.
    assert abs(last.offsets_ns["decode-0"] + skew * MS) <= 5 * MS, last.offsets_ns
    unskewed = attribute(build(mode))
    for category, ns in unskewed.parts.items():
        assert abs(last.parts[category] - ns) <= 5 * MS, (category, last.parts, unskewed.parts)


def test_same_host_needs_no_correction():
    attributor = Attributor()
    for _ in range(5):
        breakdown = attribute(build("push"), attributor)
    assert breakdown.offsets_ns == {"router-0": 0, "prefill-0": 0, "decode-0": 0}  # every instance, none moved


def test_jittered_bounds_that_do_not_intersect_fall_back_to_the_median_middle():
    from kvtrace.collectors.clocks import OffsetEstimator

    estimator = OffsetEstimator(window=64)
    estimates = []
    for i in range(300):  # true offset ~10 ms; each trace's lower bound is jittered by up to 1 ms
        jitter = (i % 5) * 250_000
        estimates.append(estimator.update("d-0", 10 * MS - 200_000 + jitter, 10 * MS + 200_000 - jitter // 4))
    # Per-trace middles are 10 ms + 0.375 x jitter: their median is 10.1875 ms (the middle of
    # the empty intersection's ends would be 10.375 ms).
    assert all(abs(e - 10_187_500) <= 50_000 for e in estimates[64:])


def test_a_root_stage_off_the_router_counts_as_coordination():
    # A sender outside the contract may label any span kvtrace.stage=pd_request; its category
    # ("root") is not one TTFT is split into, and must not break the walk.
    built = build("push")
    # without the router's decode leg, the walk starts from whatever ended last: D's first token
    rows = [row for row in built.rows() if row.stage != "decode_leg"]
    first_token = next(r for r in rows if r.stage == "first_token")
    rows = [r._replace(stage="pd_request") if r is first_token else r for r in rows]
    breakdown = Attributor().attribute(built.trace_id, rows)
    check_invariants(breakdown)
    assert breakdown.critical_ns[("decode", "pd_request")] > 0 and breakdown.parts["compute"] < built.expected["compute"]


# ---------------------------------------------------------------------- the walk, native and in Python

def _walk_arguments(builts, monkeypatch):
    """The arguments each trace's attribution hands the walk."""
    from kvtrace.collectors import attribution

    seen = []
    walk = attribution.walk
    monkeypatch.setattr(attribution, "walk", lambda *args: seen.append(args) or walk(*args))
    for built in builts:
        attribute(built)
    monkeypatch.setattr(attribution, "walk", walk)
    return seen


def _random_timings(rng, graph):
    """Timings over a random part of the graph, with stages off it, ties, zero lengths, a root and
    categories outside the breakdown's; sometimes none ending before the end."""
    from kvtrace.collectors.breakdown import ROOT

    keys = [k for k in graph if rng.random() < 0.7] + [("gw", f"s{i}") for i in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        keys.append(ROOT)
    times = [rng.choice([0, 100, 100, 250, 500]) + rng.randint(-50, 1_000) for _ in range(8)]
    timings = {}
    for key in keys:
        start = rng.choice(times)
        end = start + rng.choice([0, 0, 1, rng.randint(0, 400)])
        timings[key] = (start, end, rng.choice(["compute", "queue", "coordination", "wire", "root", "other"]))
    start, end = rng.randint(-100, 300), rng.randint(0, 1_500)
    return timings, graph, start, end


@pytest.mark.skipif(__import__("kvtrace.collectors.wire", fromlist=["native"]).native is None,
                    reason="native module not built")
def test_the_walk_is_the_same_native_or_python(monkeypatch):
    """``_otlp.walk`` against its reference ``walk_python``: the same parts, critical times and segments
    (keys, order, values) on contract traces of every shape and on 20,000 random ones (stages missing
    and bridged, off the graph, tied, of no length, outside the categories)."""
    import random

    from kvtrace.collectors.attribution import PREDECESSORS, walk, walk_python
    from kvtrace.collectors.wire import native

    builts = [build("push"), build("push", "kv_first"), build("pull"), build("pull", late_rank_ms=3),
              build("push", drop={"decode:completion"}), build("pull", fail="read"), build("push", router="gw"),
              build("push", router="gw", contract=1), build("pull", router="gw"), build("push", drop={"router"}),
              build("pull", drop={"router", "decode"}), build("push", skew_ms={"decode": 40})]
    cases = _walk_arguments(builts, monkeypatch)
    assert len(cases) == len(builts)
    rng = random.Random(20261203)
    cases += [_random_timings(rng, PREDECESSORS[rng.choice(["push", "pull"])]) for _ in range(20_000)]
    bridged = 0
    for timings, graph, start, end in cases:
        expected = walk_python(timings, graph, start, end)
        got = walk(timings, graph, start, end)
        assert got == expected, (timings, start, end)
        assert list(got[0]) == list(expected[0]) and list(got[1]) == list(expected[1])  # the same order too
        assert sum(got[0].values()) == max(0, end - start)
        bridged += any(k not in timings for k in got[1])  # never: only stages present are charged
    assert bridged == 0
    assert walk.__module__ == "kvtrace.collectors.attribution" and native.walk is not None


def test_the_walk_takes_times_beyond_int64_in_python():
    """A sender's broken clock (times past int64) is walked in Python, whose ints have no bound."""
    from kvtrace.collectors.attribution import PREDECESSORS, walk, walk_python
    from kvtrace.collectors.breakdown import D_QUEUE, FIRST_TOKEN

    far = 2**70
    timings = {D_QUEUE: (far, far + 10, "queue"), FIRST_TOKEN: (far + 10, far + 30, "compute")}
    got = walk(timings, PREDECESSORS["push"], far, far + 40)
    assert got == walk_python(timings, PREDECESSORS["push"], far, far + 40)
    assert got[0]["queue"] == 10 and got[0]["compute"] == 20 and got[0]["unattributed"] == 10


def test_stages_off_the_graph_at_one_instant_end_the_walk():
    """Two stages outside the contract, of no length, at one instant, each ended no later than the other
    started: the walk once took each as the other's predecessor for ever (the pipeline thread hung). Now
    each stage is walked once at most and the rest is unattributed."""
    import threading

    from kvtrace.collectors.attribution import PREDECESSORS, walk, walk_python

    timings = {("gw", "a"): (100, 100, "coordination"), ("gw", "b"): (100, 100, "coordination")}
    results = []
    for fn in (walk, walk_python):
        thread = threading.Thread(target=lambda f=fn: results.append(f(timings, PREDECESSORS["push"], 0, 200)),
                                  daemon=True)
        thread.start()
        thread.join(5)
        assert not thread.is_alive(), f"{fn.__name__} did not end"
    assert results[0] == results[1] and results[0][0]["unattributed"] == 200


# ---------------------------------------------------------------------- hostile senders

def _hostile_senders(rng):
    """Twelve senders of random roles, modes, hosts and contract versions, sharing instances, and the stages
    they may label a span with (the contract's and others)."""
    from kvtrace.collectors.breakdown import STAGE_KEYS
    from kvtrace.collectors.model import Origin
    from kvtrace.telemetry import semconv

    origins = [Origin.of({semconv.RES_SERVICE_NAME: f"svc{i % 4}",
                          semconv.RES_SERVICE_INSTANCE_ID: f"inst{rng.randint(0, 6)}",
                          semconv.RES_ROLE: rng.choice(["router", "producer", "consumer", "gateway", ""]),
                          semconv.RES_MODE: rng.choice(["push", "pull", "", "weird"]),
                          semconv.RES_HOST_NAME: rng.choice(["h0", "h1", ""]),
                          semconv.RES_CONTRACT_VERSION: rng.choice([0, 1, 2, 3, "x"])}) for i in range(12)]
    return origins, sorted({stage for _, stage in STAGE_KEYS}) + ["x", "gateway_request", "llm_request"]


def _hostile_trace(rng, origins, stages):
    """Up to 25 spans from random processes (contract roles and others, shared instances), random stages,
    names, statuses and times, and detail attributes of every wrong kind."""
    from kvtrace.collectors.model import SpanRow
    from kvtrace.telemetry import semconv

    wrong = {
        semconv.ATTR_ROUTER_TTFT_NS: [0, 1, 10**8, -5, "12", 1.5, "abc", True, 2**63],
        semconv.ATTR_TRANSFER_BYTES: [0, 10, "7", 2**62, 2**63 - 1, "x", 1e300, float("nan")],
        semconv.ATTR_INPUT_TOKENS: [1, 100, "5", "many", -3, 3_000_000_000],
        semconv.ATTR_BLOCK_COUNT: [2**40, 4],
        semconv.ATTR_RENDEZVOUS_ORDER: ["kv_first", "registration_first", "x"],
        semconv.VLLM_TIME_TO_FIRST_TOKEN: [0.01, "0.2", 0, "soon", float("inf"), -1.0, 1e30],
        semconv.ATTR_FAILURE_CAUSE: ["timeout"],
    }
    wrong.update({key: [1e12, "a lot", float("nan"), -4, 2**31, 7] for key in semconv.CLIENT_ATTRIBUTES})
    base = 1_700_000_000_000_000_000 + rng.randint(0, 10**9)
    spans = []
    for _ in range(rng.randint(1, 25)):
        start = base + rng.choice([0, 0, rng.randint(-10**9, 10**9)])
        attrs = {key: rng.choice(values) for key, values in wrong.items() if rng.random() < 0.2}
        spans.append(SpanRow(b"t" * 16, rng.randbytes(8), rng.choice([b"", rng.randbytes(8)]),
                             rng.choice(["pd.request", "kvtrace.client.request", "llm_request", "foo"]), start,
                             start + rng.choice([0, 1, rng.randint(0, 10**9)]), rng.choice([0, 1, 2]),
                             rng.choice(origins), rng.choice(stages), attrs))
    return spans


def test_hostile_senders_cost_a_trace_its_details_never_its_breakdown_nor_the_store(tmp_path):
    """3,000 random traces from senders that get everything wrong (times in any order, first tokens before
    the start, ranks of any side, detail attributes that are no numbers, NaN, negative, past int32 or
    int64): each is attributed without an error and within 5 s, its parts are none negative and sum to
    its TTFT, which is never negative, its segments cover it, it has a sentence, and the store takes every
    row in one flush. Before, a string where a count belonged lost the trace's breakdown, and one prompt of
    3e9 tokens (a valid int64) failed every later flush of the store."""
    import random
    import threading

    from kvtrace.collectors.clocks import ClockBook
    from kvtrace.collectors.store import Store

    rng = random.Random(20261203)
    origins, stages = _hostile_senders(rng)
    attributor = Attributor(ClockBook())
    breakdowns = []
    for n in range(3_000):
        spans = _hostile_trace(rng, origins, stages)
        done: list = []

        def attribute_one(trace_id=f"{n:032x}", spans=spans) -> None:
            try:
                done.append(attributor.attribute(trace_id, spans))
            except Exception as exc:  # raised below, in the test's thread
                done.append(exc)
        worker = threading.Thread(target=attribute_one, daemon=True)
        worker.start()
        worker.join(5)
        assert done, f"trace {n}: no breakdown within 5 s"
        breakdown = done[0]
        if isinstance(breakdown, Exception):
            raise AssertionError(f"trace {n} could not be attributed") from breakdown
        if breakdown is None:
            continue
        assert breakdown.ttft_ns >= 0 and sum(breakdown.parts.values()) == breakdown.ttft_ns, n
        assert all(v >= 0 for v in breakdown.parts.values()) and all(v >= 0 for v in breakdown.critical_ns.values())
        assert sum(end - start for _, start, end in breakdown.segments) == breakdown.ttft_ns
        assert breakdown.explanation
        breakdowns.append(breakdown)
    assert len(breakdowns) > 2_000
    store = Store(str(tmp_path / "hostile.duckdb"))
    try:
        for breakdown in breakdowns:
            store.add_breakdown(breakdown)
        store.flush()
        stored = store.query("SELECT count(*), max(prompt_tokens), max(block_count), max(transfer_bytes) FROM requests")[0]
    finally:
        store.shutdown()
    assert stored[0] == len(breakdowns) and stored[1] < 2**31 and stored[2] < 2**31 and stored[3] < 2**63


def test_a_bad_detail_value_is_left_out_and_the_good_ones_kept():
    """P's prefill says 3e9 prompt tokens (a valid int64, past the int32 column) and its WRITE's size is
    no number: those two are left out, the 2,000 prompt tokens D's allocation says stand, and the router's
    TTFT given as a word falls back to D's first token."""
    from kvtrace.telemetry import semconv

    built = build("push")
    rows = []
    for row in built.rows():
        if row.stage == "prefill" and row.origin.side == "prefill":
            row = row._replace(attrs={**row.attrs, semconv.ATTR_INPUT_TOKENS: 3_000_000_000})
        elif row.stage == "allocation":
            row = row._replace(attrs={**row.attrs, semconv.ATTR_INPUT_TOKENS: 2000})
        elif row.stage == "write":
            row = row._replace(attrs={**row.attrs, semconv.ATTR_TRANSFER_BYTES: "many"})
        elif row.stage == "pd_request":
            row = row._replace(attrs={**row.attrs, semconv.ATTR_ROUTER_TTFT_NS: "soon"})
        rows.append(row)
    clean = attribute(built)
    breakdown = Attributor().attribute(built.trace_id, rows)
    assert breakdown.prompt_tokens == 2000
    assert breakdown.transfer_bytes == 0 < clean.transfer_bytes
    assert breakdown.ttft_ns == clean.timings[("decode", "first_token")][1] - clean.start_ns
    check_invariants(breakdown)


# ---------------------------------------------------------------------- the spans indexed, native and in Python

def _same_index(got, expected):
    """Two index_spans results alike: the same keys in the same order, each mapped to the same span object."""
    index, first_of, ranks, failed, mode, p_any, d_any, client = got
    e_index, e_first_of, e_ranks, e_failed, e_mode, e_p, e_d, e_client = expected
    for a, b in ((index, e_index), (first_of, e_first_of)):
        assert list(a) == list(b) and all(a[k] is b[k] for k in b)
    assert list(ranks) == list(e_ranks)
    for key, by_rank in e_ranks.items():
        assert list(ranks[key]) == list(by_rank) and all(ranks[key][i] is s for i, s in by_rank.items())
    assert failed is e_failed and p_any is e_p and d_any is e_d and client is e_client and mode == e_mode


@pytest.mark.skipif(__import__("kvtrace.collectors.wire", fromlist=["native"]).native is None,
                    reason="native module not built")
def test_the_spans_are_indexed_and_timed_the_same_native_or_python():
    """``_otlp.index_spans`` and ``_otlp.timings_of`` against their references: the same stages in the same
    order, the same span object for each stage, process and rank, the same failed, P, D and client spans, the
    same mode and timings, on contract traces of every shape (TP ranks, preempted stages, gateways, older
    contracts, failures) and 5,000 hostile ones (random processes, stages, names, statuses and times)."""
    import random

    from kvtrace.collectors.attribution import index_spans, index_spans_python, timings_of, timings_of_python

    builts = [build("push"), build("push", "kv_first"), build("pull"), build("pull", late_rank_ms=3),
              build("push", late_rank_ms=2), build("push", drop={"decode:completion"}), build("pull", fail="read"),
              build("push", router="gw"), build("push", router="gw", contract=1), build("pull", router="gw"),
              build("push", drop={"router"}), build("pull", drop={"router", "decode"}),
              build("push", skew_ms={"decode": 40})]
    traces = [b.rows() for b in builts]
    traces += [t[::-1] for t in traces]  # the same spans in another order
    rng = random.Random(20261207)
    origins, stages = _hostile_senders(rng)
    traces += [_hostile_trace(rng, origins, stages) for _ in range(5_000)]
    ranked = 0
    for spans in traces:
        got, expected = index_spans(spans), index_spans_python(spans)
        _same_index(got, expected)
        ranked += bool(got[2])
        instances = list(got[1])
        offsets = {i: rng.choice([0, -7, 12_345, 2**70]) for i in instances if rng.random() < 0.6}
        timings = timings_of(got[0], offsets)
        assert timings == timings_of_python(got[0], offsets) and list(timings) == list(got[0])
    assert ranked > 100  # TP ranks, from the contract traces and the hostile ones


@pytest.mark.skipif(__import__("kvtrace.collectors.wire", fromlist=["native"]).native is None,
                    reason="native module not built")
def test_the_details_are_the_same_native_or_python():
    """``_otlp.details`` against its reference ``details_python``: the same fields on the breakdown, on contract
    traces of every shape and 5,000 hostile ones, whose detail attributes are of every wrong kind (words, NaN,
    negative, past int32 or int64, floats, bools, numbers as strings)."""
    import dataclasses
    import random

    from kvtrace.collectors.attribution import _DETAIL_FIELDS, details, details_python
    from kvtrace.collectors.breakdown import Breakdown
    from kvtrace.telemetry import semconv

    builts = [build("push"), build("pull"), build("pull", late_rank_ms=3), build("push", late_rank_ms=2),
              build("push", router="gw"), build("pull", fail="read"), build("push", output_tokens=9)]
    traces = [b.rows() for b in builts]
    rng = random.Random(20261208)
    origins, stages = _hostile_senders(rng)
    traces += [_hostile_trace(rng, origins, stages) for _ in range(5_000)]
    for spans in traces[-2_000:]:  # the details the hostile senders leave out, set and unset (0, "") in turn
        for span in spans:
            for key in (semconv.ATTR_TRANSFER_DESCRIPTORS, semconv.ATTR_TRANSFER_POST_US, semconv.ATTR_TRANSFER_XFER_US,
                        semconv.ATTR_OUTPUT_TOKENS, semconv.ATTR_ROUTER_LAST_TOKEN_NS, semconv.ATTR_RENDEZVOUS_ORDER):
                if rng.random() < 0.3:
                    span.attrs[key] = rng.choice([0, 0.0, "", 3, "12", -1, -0.5, 2**40, 2**40 + 1, 1.5e3, float("nan"),
                                                  True, "x", "kv_first"])
    set_somewhere = set()
    for spans in traces:
        native, python = (Breakdown(trace_id="", request_id="", mode="push", start_ns=0, ttft_ns=0, parts={},
                                    timings={}, critical_ns={}, complete=True, missing=[], error=False)
                          for _ in range(2))
        details(native, spans)
        details_python(python, spans)
        assert dataclasses.asdict(native) == dataclasses.asdict(python), spans
        set_somewhere |= {field for field, _ in _DETAIL_FIELDS.values() if getattr(python, field)}
    assert set_somewhere == {field for field, _ in _DETAIL_FIELDS.values()}  # every detail, from some trace


def test_the_run_is_the_routers_else_the_first_process_that_names_one():
    """One span per process is read for the run id: the same answer as the first span, in arrival order, whose
    process names one (a process names one run for all its spans), over shuffled traces and runs on some sides."""
    import dataclasses
    import random

    rng = random.Random(11)
    for _ in range(200):
        built = build(rng.choice(["push", "pull"]), drop=rng.choice([set(), {"router"}]))
        named = {side: f"run-{side}" for side in ("router", "prefill", "decode") if rng.random() < 0.5}
        origins = {}
        rows = []
        for row in built.rows():
            origin = row.origin
            if origin.instance not in origins:
                origins[origin.instance] = dataclasses.replace(origin, run_id=named.get(origin.side, ""))
            rows.append(row._replace(origin=origins[origin.instance]))
        rng.shuffle(rows)
        breakdown = Attributor().attribute(built.trace_id, rows)
        root = next((r for r in rows if r.origin.side == "router" and r.parent_span_id == b""), None)
        first_named = next((r.origin.run_id for r in rows if r.origin.run_id), "")
        expected = root.origin.run_id if root is not None and root.origin.run_id else first_named
        assert breakdown.run_id == expected, (named, [r.origin.side for r in rows])
        assert breakdown.run_id == "" or breakdown.run_id in named.values()
