"""The assembler on a fake clock: decision wait, max age, the memory bound, late and duplicate spans."""

from kvtrace.collectors.assembler import Assembler
from kvtrace.collectors.model import Origin, SpanRow

ORIGIN = Origin.of({"service.name": "svc", "service.instance.id": "svc-0", "kvtrace.role": "producer",
                    "kvtrace.mode": "push"})


def row(trace: int, span: int) -> SpanRow:
    return SpanRow(trace.to_bytes(16, "big"), span.to_bytes(8, "big"), b"", "kv.write", 10**18, 10**18 + 5, 0, ORIGIN,
                   "write", {})


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(**options):
    clock, decided = Clock(), []
    assembler = Assembler(lambda trace_id, spans, late: decided.append((trace_id.hex(), sorted(s.span_id.hex() for s in spans), late)),
                          clock=clock, **options)
    return assembler, clock, decided


def test_a_trace_is_decided_once_quiet_for_the_decision_wait():
    assembler, clock, decided = make(decision_wait_s=2.0, max_age_s=30.0)
    assembler.add([row(1, 1)])
    clock.now = 1.0
    assembler.add([row(2, 1)])
    clock.now = 1.5
    assembler.add([row(1, 2)])  # trace 1 heard from again: it now waits longer than trace 2
    clock.now = 3.0
    assert assembler.poll() == 1 and decided == [(f"{2:032x}", [f"{1:016x}"], False)]
    clock.now = 3.4
    assert assembler.poll() == 0
    clock.now = 3.5
    assert assembler.poll() == 1 and decided[-1] == (f"{1:032x}", [f"{1:016x}", f"{2:016x}"], False)
    assert assembler.pending() == 0


def test_a_trace_that_never_goes_quiet_is_decided_at_max_age():
    assembler, clock, decided = make(decision_wait_s=2.0, max_age_s=5.0)
    for step in range(12):
        clock.now = step * 0.5
        assembler.add([row(7, step)])
        assembler.poll()
    assert len(decided) == 1 and len(decided[0][1]) == 11  # decided at 5.0 s, with the 11 spans until then
    assert assembler.pending() == 1  # the span after the decision starts it again, as late
    clock.now = 20.0
    assembler.poll()
    assert decided[-1][2] is True and len(decided[-1][1]) == 12 and assembler.stats.traces_late == 1


def test_memory_is_bounded_by_deciding_the_quietest_trace_early():
    assembler, clock, decided = make(decision_wait_s=10.0, max_traces=3)
    for trace in range(3):
        clock.now = trace
        assembler.add([row(trace, 1)])
    clock.now = 3
    assembler.add([row(0, 2)])  # trace 0 is the newest again
    assembler.add([row(3, 1)])  # one over the bound: trace 1, quiet the longest, goes early
    assert [d[0] for d in decided] == [f"{1:032x}"]
    assert assembler.pending() == 3 and assembler.stats.traces_evicted == 1


def test_duplicates_collapse_and_late_spans_redecide_with_the_earlier_ones():
    assembler, clock, decided = make(decision_wait_s=1.0)
    assembler.add([row(5, 1), row(5, 1), row(5, 2)])
    assert assembler.stats.duplicate_spans == 1
    clock.now = 2.0
    assembler.poll()
    assembler.add([row(5, 3)])
    clock.now = 4.0
    assembler.poll()
    assert decided == [(f"{5:032x}", [f"{1:016x}", f"{2:016x}"], False),
                       (f"{5:032x}", [f"{1:016x}", f"{2:016x}", f"{3:016x}"], True)]
