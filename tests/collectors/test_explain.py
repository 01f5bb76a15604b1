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
