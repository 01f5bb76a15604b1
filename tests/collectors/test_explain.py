"""A decided trace in one sentence: one contract trace per shape, through the real attributor, and
the sentence where operators read it (the store, the forwarded breakdown span, ``kvtrace explain``)."""

from __future__ import annotations

import re

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace import cli
from kvtrace.collectors.breakdown import READ
from kvtrace.collectors.breakdown_span import BreakdownSpans
from kvtrace.collectors.explain import RUNNER_UP_SHARE, explain
from kvtrace.collectors.read import Filters, open_store
from kvtrace.telemetry import semconv
from tests.collectors.test_attribution import attribute
from tests.collectors.traces import build, store_of

SHAPES = {  # shape: (the trace, its sentence)
    "compute-bound": (dict(mode="push"), "91 % compute: P's prefill of 2,000 tokens took 144 ms."),
    "kv_first rendezvous": (
        dict(mode="push", order="kv_first"),
        "89 % coordination: D's registration took 161 ms to reach P, whose finished blocks waited 18 ms for it "
        "at the rendezvous."),
    "wire-bound": (  # a second TP rank whose READ lands 500 ms late: the path runs through it
        dict(mode="pull", late_rank_ms=500),
        "75 % wire: the NIXL READ of 4.2 MB took 508 ms (8.3 MB/s); 24 % compute: P's prefill of 2,000 tokens "
        "took 144 ms."),
    "queue-bound": (
        dict(mode="push", d_queue_ms=400),
        "71 % queue: the request waited 400 ms in D's queue before its first decode step; 27 % compute: P's "
        "prefill of 2,000 tokens took 144 ms."),
    "failed": (dict(mode="pull", fail="read"), "Failed: D's read ended in error (transfer_failed) 170 ms in."),
    "incomplete (a side)": (dict(mode="push", drop={"decode"}),
                            "Incomplete: no span from D arrived; of 169 ms seen, 87 % compute: P's prefill of "
                            "2,000 tokens took 144 ms."),
    "incomplete (a stage)": (dict(mode="push", drop={"prefill:write"}),
                             "Incomplete: prefill:write never arrived; of 169 ms seen, 91 % compute: P's prefill "
                             "of 2,000 tokens took 144 ms."),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_has_its_sentence(shape):
    kwargs, expected = SHAPES[shape]
    breakdown = attribute(build(**kwargs))
    assert breakdown.explanation == explain(breakdown)  # the attributor derives it, once
    assert breakdown.explanation == expected


@pytest.mark.parametrize("transfer_bytes, size", [(4_194_304, "4.2 MB"), (50_000, "50.0 kB"), (2_500_000_000, "2.5 GB")])
def test_a_transfer_reads_in_the_units_of_its_rate_and_of_the_dashboard(transfer_bytes, size):
    """Size and rate in decimal units, as the Push vs pull page's "MB per request" and "MB/s": the size
    over the READ's time gives the rate printed beside it (a MiB there read 5 % off its MB/s)."""
    breakdown = attribute(build("pull", late_rank_ms=500))
    breakdown.transfer_bytes = transfer_bytes
    sentence = explain(breakdown)
    found = re.search(r"the NIXL READ of ([\d.,]+) (kB|MB|GB) took [\d.,]+ ms \(([\d.]+) (MB|GB)/s\)", sentence)
    assert found, sentence
    assert f"{found[1]} {found[2]}" == size
    start, end, _ = breakdown.timings[READ]
    stated = float(found[1].replace(",", "")) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[found[2]]
    rate = float(found[3]) * {"MB": 1e6, "GB": 1e9}[found[4]]
    assert stated / ((end - start) / 1e9) == pytest.approx(rate, rel=0.03)


def test_the_sentence_follows_the_numbers_not_a_template():
    """The dominant part and its stage come from the breakdown: a longer queue turns a compute-bound
    trace queue-bound, and the runner-up is named only above its threshold."""
    compute = attribute(build("push", d_queue_ms=30))
    assert compute.explanation == "78 % compute: P's prefill of 2,000 tokens took 144 ms."
    assert compute.parts["queue"] < RUNNER_UP_SHARE * compute.ttft_ns and "queue" not in compute.explanation
    queue = attribute(build("push", d_queue_ms=2_000))
    assert queue.explanation.startswith("92 % queue: the request waited 2,000 ms in D's queue")


def test_an_uncovered_gap_says_where_it_is():
    """P's spans never came and nothing else covers its prefill: the part no span covers is the
    largest, and the sentence says where it sits on the path."""
    breakdown = attribute(build("pull", drop={"prefill", "router:prefill_leg"}))
    assert breakdown.parts["unattributed"] == max(breakdown.parts.values())
    assert breakdown.explanation == (
        "Incomplete: no span from P arrived and router:prefill_leg never arrived; of 181 ms seen, 84 % "
        "unattributed: no span covers 152 ms of the critical path (the longest, 151 ms, between the router's "
        "pd route and the router's registration).")


def test_it_is_stored_forwarded_and_printed(tmp_path, capsys):
    traces = [build("push", order="kv_first"), build("pull", fail="read")]
    db = store_of(tmp_path / "k.duckdb", traces)
    reader = open_store(db)
    stored = {r["trace_id"]: r["explanation"] for r in reader.sql("SELECT trace_id, explanation FROM requests")
              .to_pylist()}
    assert stored == {t.trace_id: attribute(t).explanation for t in traces}
    assert reader.slowest(Filters()).column("explanation").to_pylist()[0] in stored.values()

    assert cli.main(["explain", traces[0].trace_id.upper(), "--db", db]) == 0
    assert capsys.readouterr().out.strip() == SHAPES["kv_first rendezvous"][1]
    assert cli.main(["explain", "0" * 32, "--db", db]) == 1
    assert "no request with trace id" in capsys.readouterr().err
    assert cli.main(["explain", "not-a-trace", "--db", db]) == 2
    assert "not a trace id" in capsys.readouterr().err

    breakdown = attribute(traces[0])
    spans = BreakdownSpans()
    encoded, _ = spans.encode(bytes.fromhex(traces[0].trace_id), breakdown, revision=1)
    request = ExportTraceServiceRequest.FromString(spans.request([encoded]))
    (span,) = request.resource_spans[0].scope_spans[0].spans
    attrs = {a.key: a.value.string_value for a in span.attributes}
    assert attrs[semconv.BREAKDOWN_EXPLANATION] == breakdown.explanation


def _random_breakdown(rng, builts):
    """A breakdown of random fields, as far as the explanation reads them: every rule, ties, numbers on
    the formats' boundaries (halves, 10 ms, 0.1 ms, 10 MB, 1 GB), stages outside the contract (some of
    their names not ASCII), missing stages and sides, failures with and without their stage's timing."""
    from kvtrace.collectors import breakdown as keys
    from kvtrace.collectors.breakdown import GAP, Breakdown

    def ns():
        return rng.choice([0, 1, 49_999, 50_000, 99_999, 100_000, 150_000, 9_999_999, 10_000_000, 12_500_000,
                           13_500_000, 2_500_000, 1_234_567_890, rng.randint(1, 10**6), rng.randint(1, 10**9),
                           rng.randint(1, 10**13), rng.randint(-10**6, 0)])

    contract = [keys.P_PREFILL, keys.RENDEZVOUS, keys.D_REGISTRATION, keys.WRITE, keys.READ, keys.D_QUEUE,
                keys.FIRST_TOKEN, keys.P_QUEUE, keys.ALLOCATION, keys.ROUTE, keys.RELAY, keys.INGRESS, keys.D_OUTPUT]
    others = [("gw", "ingress_hop"), ("gateway", "auth_check"), ("decode", "ré_ordonné"), ("side_x", "a_b_c"),
              ("prefill", "queue")]
    categories = ["compute", "queue", "coordination", "wire", "unattributed", "root", "other"]
    chosen = rng.sample(contract + others, rng.randint(0, 10))
    timings = {}
    for key in chosen:
        start = rng.randint(0, 10**9)
        timings[key] = (start, start + abs(ns()), rng.choice(categories))
    critical = {key: ns() for key in rng.sample(chosen, rng.randint(0, len(chosen)))}
    if rng.random() < 0.2:  # a tie on the path: the larger key wins
        for key in critical:
            critical[key] = 7_000_000
    parts = {part: rng.choice([0, 0, ns(), 5_000_000]) for part in ("compute", "queue", "coordination", "wire",
                                                                      "unattributed")}
    segments, t = [], 0
    for _ in range(rng.randint(0, 8)):
        width = abs(ns())
        segments.append((GAP if rng.random() < 0.4 else rng.choice(chosen or [keys.P_PREFILL]), t, t + width))
        t += width
    missing = rng.sample(["prefill:write", "decode:read", "router:route", "decode:completion", "prefill:prefill",
                          "gw", "décodé:étape", "prefill:rendezvous"], rng.randint(0, 6))
    error_stage = rng.choice([None, rng.choice(chosen or [keys.READ]), keys.READ])
    if rng.random() < 0.3 and builts:  # a real trace's breakdown with a few fields changed
        b = attribute(rng.choice(builts))
        b.parts = parts if rng.random() < 0.5 else b.parts
    else:
        b = Breakdown(trace_id="0" * 32, request_id="", mode="push", start_ns=rng.randint(0, 10**9),
                      ttft_ns=rng.choice([0, -5, sum(parts.values()) or 1, ns(), 2**52, 7]), parts=parts,
                      timings=timings, critical_ns=critical, complete=rng.random() < 0.6, missing=missing,
                      error=rng.random() < 0.15, segments=segments)
        b.error_stage = error_stage
        b.error_type = rng.choice(["", "transfer_failed", "délai"])
    b.prefill_instance = rng.choice(["", "p0"])
    b.decode_instance = rng.choice(["", "d0"])
    b.rendezvous_order = rng.choice(["", "kv_first", "registration_first", "other"])
    b.transfer_bytes = rng.choice([0, 999, 50_000, 99_999, 100_000, 4_194_304, 9_999_999, 10_000_000, 999_999_999,
                                   1_000_000_000, 2_500_000_000, rng.randint(1, 2**40)])
    b.prompt_tokens = rng.choice([0, 7, 999, 1000, 2_000, 16_384, 1_234_567])
    return b


@pytest.mark.skipif(__import__("kvtrace.collectors.wire", fromlist=["native"]).native is None,
                    reason="native module not built")
def test_the_sentence_is_the_same_native_or_python():
    """``_otlp.explain`` against its reference ``explain_python``: the same sentence, character for character,
    on contract traces of every shape and on 20,000 random breakdowns; the native half explains nearly all
    of them itself (it hands Python only a number it cannot carry exactly, or a value of another type)."""
    import random

    from kvtrace.collectors.explain import _NATIVE_CONFIG, explain_python
    from kvtrace.collectors.wire import native

    builts = [build(**kwargs) for kwargs, _ in SHAPES.values()] + [
        build("pull", drop={"prefill", "router:prefill_leg"}), build("push", router="gw"),
        build("pull", router="gw"), build("push", d_queue_ms=2_000), build("push", fail="write")]
    rng = random.Random(20261207)
    cases = [attribute(b) for b in builts] + [_random_breakdown(rng, builts) for _ in range(20_000)]
    handed_back = 0
    for b in cases:
        expected = explain_python(b)
        try:
            got = native.explain(b, _NATIVE_CONFIG)
        except (OverflowError, TypeError, UnicodeError):
            handed_back += 1
            got = expected
        assert got == expected, b
        assert explain(b) == expected
    assert handed_back < len(cases) // 100


def test_numbers_beyond_what_c_carries_are_explained_in_python():
    """A TTFT past 2**53 ns (a sender's broken clock) and a stage name with a lone surrogate (from JSON):
    the native half hands them to Python, whose sentence they get."""
    from kvtrace.collectors.explain import explain_python

    far = attribute(build("push"))
    far.ttft_ns, far.parts = 2**70, {**far.parts, "compute": 2**69}
    assert explain(far) == explain_python(far) and explain(far).startswith("50 % compute: ")
    odd = attribute(build("push"))
    odd.timings[("gw", "x\ud800")] = (0, 10**9, "coordination")
    odd.critical_ns = {("gw", "x\ud800"): 10**9}
    odd.parts, odd.ttft_ns = {**dict.fromkeys(odd.parts, 0), "coordination": 10**9}, 10**9
    assert explain(odd) == explain_python(odd) == "100 % coordination: gw's x\ud800 took 1,000 ms."
