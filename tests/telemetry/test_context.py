import pytest

from kvtrace.telemetry.context import Sampler, TraceRef, format_traceparent, new_trace_id, parse_traceparent


def test_traceparent_round_trip():
    ref = TraceRef(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True)
    text = format_traceparent(ref)
    assert text == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(text) == ref
    assert parse_traceparent(text[:-2] + "00").sampled is False


@pytest.mark.parametrize("bad", [
    None, "", "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
])
def test_invalid_traceparent_is_ignored(bad):
    assert parse_traceparent(bad) is None


def test_ratio_sampler_is_deterministic_and_roughly_right():
    ids = [new_trace_id() for _ in range(4000)]
    half = Sampler("traceidratio", 0.5)
    decisions = [half.should_sample(i) for i in ids]
    assert decisions == [half.should_sample(i) for i in ids]
    assert 0.45 < sum(decisions) / len(ids) < 0.55
    assert not any(Sampler("traceidratio", 0.0).should_sample(i) for i in ids)
    assert all(Sampler("traceidratio", 1.0).should_sample(i) for i in ids)


def test_parent_based_follows_the_parent():
    sampler = Sampler("parentbased_always_off")
    parent = TraceRef(new_trace_id(), 1, True)
    assert sampler.should_sample(parent.trace_id, parent) is True
    assert sampler.should_sample(new_trace_id()) is False
    assert Sampler("always_off").should_sample(parent.trace_id, parent) is False


# --------------------------------------------------------------------------------------
# The hand-written parser and sampler (the engine loop's) against the SDK's own
# --------------------------------------------------------------------------------------

def _sdk_parse(header):
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    span = trace.get_current_span(TraceContextTextMapPropagator().extract(
        {} if header is None else {"traceparent": header})).get_span_context()
    return TraceRef(span.trace_id, span.span_id, span.trace_flags.sampled) if span.is_valid else None


def _headers():
    """Valid headers and every way the tests know to break one, plus random mutations."""
    import random

    rng = random.Random(11)
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    cases = [None, "", good, good.upper(), " " + good + "\t", good + "-x", "01" + good[2:] + "-future",
             "ff" + good[2:], "00-" + "0" * 32 + good[35:], good[:36] + "0" * 16 + good[52:], good[:-2] + "00",
             good[:-2] + "03", good[:-1], good + "0", "0x" + good[2:], good.replace("-", "_")]
    alphabet = "0123456789abcdefABCDEF- \tz"
    for _ in range(2000):
        text = list(rng.choice(cases[2:]))
        for _ in range(rng.randint(1, 3)):
            text[rng.randrange(len(text))] = rng.choice(alphabet)
        cases.append("".join(text))
    return cases


def test_the_hand_written_traceparent_parser_agrees_with_the_sdks_propagator():
    for header in _headers():
        assert parse_traceparent(header) == _sdk_parse(header), header


@pytest.mark.parametrize("name, ratio", [("always_on", 1.0), ("always_off", 1.0), ("traceidratio", 0.25),
                                         ("parentbased_always_on", 1.0), ("parentbased_always_off", 1.0),
                                         ("parentbased_traceidratio", 0.3)])
def test_the_hand_written_sampler_decides_as_the_sdks(name, ratio):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from kvtrace.telemetry.context import sdk_sampler

    ours, sdk = Sampler(name, ratio), sdk_sampler(name, ratio)
    for i in range(3000):
        trace_id = new_trace_id()
        parent = None if i % 3 == 0 else TraceRef(trace_id, 7, i % 3 == 1)
        context = None if parent is None else trace.set_span_in_context(NonRecordingSpan(SpanContext(
            trace_id, 7, is_remote=True, trace_flags=TraceFlags(int(parent.sampled)))))
        expected = sdk.should_sample(context, trace_id, "pd.request").decision.is_sampled()
        assert ours.should_sample(trace_id, parent) == expected, (name, trace_id, parent)
