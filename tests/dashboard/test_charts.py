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


def test_a_stage_share_bar_carries_its_stages_row_in_its_hover_estimates_to_two_digits():
    row = {"mode": "push", "side": "prefill", "stage": "prefill", "ttft_share": 0.81, "p50_ms": 146.123,
           "p99_ms": 1234.5, "critical_per_request_ms": 140.5, "on_path": 0.97}
    off_path = {**row, "stage": "handshake", "ttft_share": 0.0}
    (bar,) = charts.stage_shares([row, off_path]).data  # a stage off the path has no bar
    assert bar.y == ("prefill · prefill",) and bar.x == (81.0,)
    assert [list(c) for c in bar.customdata] == [[146.123, 1234.5, 140.5, 97.0]]
    assert "p50 %{customdata[0]:.2f} ms" in bar.hovertemplate  # measured: as it is
    assert "in %{customdata[3]:.0f}% of requests" in bar.hovertemplate
    (estimated,) = charts.stage_shares([row], exact=False).data
    assert "p50 %{customdata[0]:,.2r} ms, p99 %{customdata[1]:,.2r} ms" in estimated.hovertemplate  # 150, 1,200

