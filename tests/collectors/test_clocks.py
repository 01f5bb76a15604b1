"""Clock alignment: measured offsets with an error bound, followed through drift, checked against
span order, and used per trace against the trace's own router."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from kvtrace.collectors.attribution import Attributor, index_spans
from kvtrace.collectors.breakdown import ROOT
from kvtrace.collectors.clocks import ClockBook, Sample, contradiction, fit
from kvtrace.telemetry import Role, TelemetryConfig, configure
from kvtrace.telemetry.clock import TEST_CLOCK_SHIFT_ENV, parse_clock_shift
from tests.collectors.traces import BASE_NS, MS, build
from tests.helpers import wait_until

US = 1_000


def exchange(book: ClockBook, instance: str, true_ns: int, skew_ns: int, delay_ns: int, asymmetry: float = 0.5):
    """One exchange of a sender whose clock reads ``true + skew`` with a collector on true time;
    ``asymmetry`` is the share of the round trip spent on the way to the collector."""
    t1 = true_ns + skew_ns
    t2 = true_ns + int(delay_ns * asymmetry)
    t3 = t2 + 20 * US  # the collector's own time, left out of the round trip
    t4 = true_ns + delay_ns + 20 * US + skew_ns
    return book.add(instance, t1, t2, t3, t4)


def test_a_sample_bounds_the_true_offset_whatever_the_asymmetry():
    book = ClockBook()
    for asymmetry in (0.0, 0.3, 0.5, 0.9, 1.0):
        sample = exchange(book, f"s{asymmetry}", BASE_NS, skew_ns=40 * MS, delay_ns=400 * US, asymmetry=asymmetry)
        assert abs(sample.offset - (-40 * MS)) <= sample.bound == 200 * US


def test_two_processes_are_placed_through_a_collector_that_measured_both():
    """In a fleet each collector's offsets are against its own clock: a process and its router are placed
    against each other through one collector that measured both, whichever collector decides the trace."""
    a, b = ClockBook(measured_by="a"), ClockBook(measured_by="b")
    shared = []  # what a and b write to the shared store
    for i in range(3):
        true = BASE_NS + i * 2_000 * MS
        for book, collector_skew in ((a, 0), (b, 7 * MS)):  # b's clock is 7 ms behind a's
            shared.append(exchange(book, "router", true, skew_ns=collector_skew + 3 * MS, delay_ns=300 * US))
        shared.append(exchange(a, "p", true, skew_ns=40 * MS, delay_ns=300 * US))  # p exchanges with a only
        shared.append(exchange(b, "d", true, skew_ns=7 * MS - 20 * MS, delay_ns=300 * US))  # d with b only
    fleet = ClockBook(measured_by="c")  # a third collector, reading both from the shared store
    assert fleet.add_shared(shared) == len(shared) == 12
    assert fleet.add_shared(shared) == 0  # read again: already known
    at = BASE_NS + 4_000 * MS
    assert fleet.offset("p", at) is None  # nothing against the third collector's own clock
    p_offset, p_bound = fleet.between("p", at + 40 * MS, "router", at + 3 * MS)
    d_offset, d_bound = fleet.between("d", at - 20 * MS, "router", at + 3 * MS)
    assert abs(p_offset - (3 * MS - 40 * MS)) <= p_bound and p_bound <= 400 * US  # router - p
    assert abs(d_offset - (3 * MS + 20 * MS)) <= d_bound  # through b: its 7 ms cancel out
    assert fleet.between("p", at, "d", at) is None  # no collector measured both
    assert a.between("p", at + 40 * MS, "router", at + 3 * MS) == (p_offset, p_bound)  # as the measurer sees it


def test_the_fit_follows_a_drifting_clock():
    book = ClockBook()
    drift = 50e-6  # 50 ppm
    for i in range(40):  # every 2 s for 80 s
        true = BASE_NS + i * 2_000 * MS
        exchange(book, "d", true, skew_ns=int(-25 * MS + drift * i * 2_000 * MS), delay_ns=(300 + 37 * (i % 5)) * US)
    for i in (3, 17.5, 39):  # between and at exchanges
        true = BASE_NS + int(i * 2_000 * MS)
        truth = -(-25 * MS + drift * i * 2_000 * MS)
        offset, bound = book.offset("d", true - 25 * MS)
        assert abs(offset - truth) <= bound <= 400 * US, (i, offset - truth, bound)
    later, bound_later = book.offset("d", BASE_NS + 200_000 * MS)  # 2 minutes past the last exchange
    assert bound_later > bound  # outside the samples, the bound widens


def test_a_drift_is_followed_from_the_second_exchange_on():
    """A process that has just started (two or three exchanges, their round trips 0.3-0.7 ms as on a
    busy host): its 50 ppm drift is already in the line, not left to the bound. Flat from the best
    exchange, one second past the last it would be off by 50 µs plus the distance back to that one."""
    drift = 50e-6
    for delays_us in ((300, 700), (700, 300, 650)):
        book = ClockBook()
        for i, delay in enumerate(delays_us):
            exchange(book, "d", BASE_NS + i * 2_000 * MS, skew_ns=int(drift * i * 2_000 * MS), delay_ns=delay * US)
        later = (len(delays_us) - 1) * 2_000 + 1_000  # ms after the first exchange
        offset, bound = book.offset("d", BASE_NS + later * MS)
        truth = -drift * later * MS
        assert abs(offset - truth) <= 5 * US, (delays_us, offset - truth)
        assert abs(offset - truth) <= bound


def test_congested_exchanges_are_left_out_of_the_fit():
    samples = [Sample("x", BASE_NS + i * 1_000 * MS, -10 * MS, 200 * US) for i in range(10)]
    samples.append(Sample("x", BASE_NS + 11_000 * MS, -10 * MS + 5 * MS, 12 * MS))  # a 12 ms round trip
    assert abs(fit(samples).at(BASE_NS + 11_000 * MS)[0] - (-10 * MS)) < 50 * US


def test_a_process_measures_its_shifted_clock_against_a_live_collector(make_collector, monkeypatch):
    collector = make_collector()
    http = next(r for r in collector.receivers if "Http" in type(r).__name__)
    monkeypatch.setenv(TEST_CLOCK_SHIFT_ENV, "50:50")  # 50 ms ahead, gaining 50 ppm
    config = TelemetryConfig.load({"endpoint": http.endpoint, "protocol": "http/protobuf",
                                   "clock_sync_interval_ms": 100, "schedule_delay_ms": 50}, {})
    recorder = configure(config, Role.PRODUCER)
    instance = recorder._resource.attributes["service.instance.id"]
    assert wait_until(lambda: collector.clocks.offset(instance, recorder.wall_ns()) is not None, 10)
    time.sleep(1.0)  # a few more exchanges
    offset, bound = collector.clocks.offset(instance, recorder.wall_ns())
    true = -(recorder.wall_ns() - time.time_ns())  # collector minus sender, read back to back
    assert abs(offset - true) <= bound + 200 * US, (offset, true, bound)
    assert abs(offset + 50 * MS) < 2 * MS and bound < 5 * MS
    assert parse_clock_shift("50:50") == (50 * MS, 50.0)
    assert wait_until(lambda: collector.store.flush() or collector.store.query(
        "SELECT count(*) FROM clock_samples WHERE instance = ?", [instance])[0][0] >= 3, 10)


def test_the_grpc_collector_answers_exchanges_too(make_collector):
    collector = make_collector()
    grpc_receiver = next(r for r in collector.receivers if "Grpc" in type(r).__name__)
    from kvtrace.telemetry.clock import ClockSync

    sync = ClockSync(grpc_receiver.endpoint, "grpc", "g-1", time.time_ns, interval_ms=1)
    for _ in range(3):
        sync.tick()
        time.sleep(0.01)
    assert sync.exchanges == 3 and collector.clocks.offset("g-1", time.time_ns()) is not None
    sync.close()


def _measured(book: ClockBook, skews_ms: dict[str, float], around_ms: float = 0.0):
    """Exchanges of each instance whose clock is ``skew`` ahead of true time (the collector's)."""
    for i in range(6):
        true = BASE_NS + int((around_ms - 5_000 + i * 2_000) * MS)
        for instance, skew in skews_ms.items():
            exchange(book, instance, true, int(skew * MS), delay_ns=(250 + 40 * i) * US)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_measured_offsets_undo_any_skew_and_record_their_bound(mode):
    skew = {"prefill": 50.0, "decode": -50.0}
    book = ClockBook()
    _measured(book, {"router-0": 0.0, "prefill-0": skew["prefill"], "decode-0": skew["decode"]})
    truth = Attributor().attribute(build(mode).trace_id, build(mode).rows())
    skewed = build(mode, skew_ms=skew)
    breakdown = Attributor(book).attribute(skewed.trace_id, skewed.rows())
    for category, ns in truth.parts.items():
        assert abs(breakdown.parts[category] - ns) <= 0.5 * MS, (category, breakdown.parts, truth.parts)
    for instance, true_offset in (("prefill-0", -skew["prefill"] * MS), ("decode-0", -skew["decode"] * MS)):
        assert abs(breakdown.offsets_ns[instance] - true_offset) <= breakdown.clock_bounds_ns[instance] < MS
    assert not breakdown.clock_suspect


def test_two_routers_with_different_clocks_are_each_their_traces_reference():
    book = ClockBook()
    _measured(book, {"router-a": 0.0, "router-b": 30.0, "prefill-0": 12.0, "decode-0": -7.0})
    attributor = Attributor(book)
    truth = Attributor().attribute(build("pull").trace_id, build("pull").rows())
    for name, router_skew in (("router-a", 0.0), ("router-b", 30.0)):
        built = build("pull", router=name, skew_ms={"router": router_skew, "prefill": 12.0, "decode": -7.0})
        breakdown = attributor.attribute(built.trace_id, built.rows())
        for category, ns in truth.parts.items():
            assert abs(breakdown.parts[category] - ns) <= 0.5 * MS, (name, category)
        # P's times go to this router's clock: P is 12 ms ahead of true time, the router `router_skew`
        assert abs(breakdown.offsets_ns["prefill-0"] - (router_skew - 12.0) * MS) <= breakdown.clock_bounds_ns["prefill-0"]


def test_a_measurement_the_span_order_contradicts_is_flagged():
    book = ClockBook()
    _measured(book, {"router-0": 0.0, "prefill-0": 0.0, "decode-0": 80.0})  # D is measured 80 ms ahead...
    built = build("push")  # ... but its spans are on true time
    breakdown = Attributor(book).attribute(built.trace_id, built.rows())
    assert breakdown.clock_suspect
    # named by the first pair it reverses: D's moments land 80 ms early, before the router sent D its leg
    index = index_spans(built.rows())[0]
    assert contradiction(index, index.get(ROOT), "push", breakdown.offsets_ns, breakdown.clock_bounds_ns) == \
        "router sent D's leg -> D had it"
    assert contradiction(index, index.get(ROOT), "push", {i: 0 for i in breakdown.offsets_ns},
                         {i: 0 for i in breakdown.offsets_ns}) is None  # on its true clocks, no pair reversed


def _on_a_worker(rows, side: str, stages: set[str], skew_ms: float):
    """The rows with ``side``'s ``stages`` recorded by a worker process of their own (as vLLM's TP workers
    record the transfer), on a clock ``skew_ms`` ahead of the engine core's; the worker's rows first, so
    that the worker is the side's first process the attributor meets."""
    def moved(r):
        return r._replace(start=r.start + int(skew_ms * MS), end=r.end + int(skew_ms * MS),
                          origin=dataclasses.replace(r.origin, instance=f"{r.origin.instance}-worker"))
    mine = [moved(r) for r in rows if r.origin.side == side and r.stage in stages]
    return mine + [r for r in rows if not (r.origin.side == side and r.stage in stages)]


@pytest.mark.parametrize("mode, side, stages", [
    ("push", "prefill", {"registration", "rendezvous", "descriptor_prep", "write"}),
    ("pull", "decode", {"read_wait", "descriptor_prep", "read"})])
def test_each_process_of_a_side_is_checked_on_its_own_measured_clock(mode, side, stages):
    """A side's processes (engine core, TP workers) each have a clock of their own, measured apart: each span
    is checked on its own process's offset. On the worker's offset, the engine core's spans would contradict
    the span order by the 3 ms between the two clocks (in a real pair on loopback, under a test clock shift
    of 50 ppm counted from each process's start, 0.1-0.3 ms: enough, now and then)."""
    book = ClockBook()
    _measured(book, {"router-0": 0.0, "prefill-0": 0.0, "decode-0": 0.0, f"{side}-0-worker": 3.0})
    built = build(mode)
    rows = _on_a_worker(built.rows(), side, stages, 3.0)
    breakdown = Attributor(book).attribute(built.trace_id, rows)
    assert breakdown.offsets_ns[f"{side}-0-worker"] == pytest.approx(-3 * MS, abs=breakdown.clock_bounds_ns[f"{side}-0-worker"])
    assert not breakdown.clock_suspect
    truth = Attributor().attribute(built.trace_id, build(mode).rows())
    for category, ns in truth.parts.items():
        assert abs(breakdown.parts[category] - ns) <= 0.5 * MS, (category, breakdown.parts, truth.parts)
    # the worker measured 12 ms behind while its spans are on true time: its transfer would start after the
    # other side saw it land (push: D's completion; pull: P's)
    behind = ClockBook()
    _measured(behind, {"router-0": 0.0, "prefill-0": 0.0, "decode-0": 0.0, f"{side}-0-worker": -12.0})
    assert Attributor(behind).attribute(built.trace_id, _on_a_worker(built.rows(), side, stages, 0.0)).clock_suspect


def _with_p_receiving_the_registration_at(rows, at_ns: int):
    """The rows with P's registration (an instant: PUSH_REG received) moved to ``at_ns``."""
    return [r._replace(start=at_ns, end=at_ns) if (r.origin.side, r.stage) == ("prefill", "registration") else r
            for r in rows]


@pytest.mark.parametrize("drop", [set(), {"router"}])  # the router's clock the reference, or P's
def test_a_registration_received_before_ds_span_of_it_ended_is_not_suspect(drop):
    """D's registration span ends once PUSH_REG's send returns; P can have it before then (0.6 ms before, in
    a real pair on loopback). With every clock true and measured, that is no contradiction; P receiving it
    before D's span even began is one."""
    book = ClockBook()
    _measured(book, {"router-0": 0.0, "prefill-0": 0.0, "decode-0": 0.0})
    built = build("push", drop=drop)
    rows = built.rows()
    d_reg = next(r for r in rows if (r.origin.side, r.stage) == ("decode", "registration"))
    early = _with_p_receiving_the_registration_at(rows, d_reg.end - int(0.6 * MS))
    assert not Attributor(book).attribute(built.trace_id, early).clock_suspect
    impossible = _with_p_receiving_the_registration_at(rows, d_reg.start - int(1.5 * MS))
    assert Attributor(book).attribute(built.trace_id, impossible).clock_suspect


def test_without_measurements_the_causal_estimate_stands(monkeypatch):
    built = build("pull", skew_ms={"decode": 40.0})
    attributor = Attributor(ClockBook())  # nobody exchanged
    for _ in range(20):
        breakdown = attributor.attribute(built.trace_id, build("pull", skew_ms={"decode": 40.0}).rows())
    assert breakdown.clock_bounds_ns == {} and abs(breakdown.offsets_ns["decode-0"] + 40 * MS) <= 5 * MS
    assert os.environ.get(TEST_CLOCK_SHIFT_ENV) is None
