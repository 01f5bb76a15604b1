"""The figures' data as the browser receives it (what the pages draw is tested in test_app and test_browser)."""

from datetime import datetime, timezone

from kvtrace.dashboard import charts


def test_the_slow_scatter_sends_start_times_as_epoch_ms_and_trace_ids_only_for_the_slowest():
    aware = datetime(2026, 12, 1, 10, 0, 0, 250_000, tzinfo=timezone.utc)
    sample = [{"mode": "push", "top": False, "trace_id": "a" * 32, "started_at": aware, "ttft_ms": 100.0},
              {"mode": "push", "top": True, "trace_id": "b" * 32, "started_at": aware.replace(tzinfo=None),
               "ttft_ms": 900.0}]
    figure = charts.slow_scatter(sample)
    assert figure.layout.xaxis.type == "date"
    sampled, slowest = figure.data
    expected = 1_796_119_200_250.0  # 2026-12-01T10:00:00.25Z; a naive time is read as UTC
    assert sampled.x == (expected,) and slowest.x == (expected,)
    assert sampled.customdata is None and "trace" not in sampled.hovertemplate
    assert list(slowest.customdata) == ["b" * 32] and "%{customdata}" in slowest.hovertemplate
