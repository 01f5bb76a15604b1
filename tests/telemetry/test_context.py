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
    child = sampler.start(parent)
    assert child.sampled and child.trace_id == parent.trace_id and child.span_id != parent.span_id
    assert sampler.start(None).sampled is False
    assert Sampler("always_off").start(parent).sampled is False
