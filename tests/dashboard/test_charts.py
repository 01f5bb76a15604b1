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


def _contrast(a: str, b: tuple[float, float, float]) -> float:
    """WCAG's contrast ratio of text colour ``a`` (#RRGGBB) on the colour ``b`` (0-255 channels)."""
    lighter, darker = sorted((charts._luminance(charts._rgb(a)), charts._luminance(b)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def test_a_name_inside_a_bar_contrasts_with_the_bar_as_drawn_faded_or_not():
    """On every part's colour, at every opacity a waterfall draws (0.3 to 1), the name's colour reaches WCAG's 4.5
    for text against the bar blended over the white plot; Plotly's own choice put white on the parts' green
    (3.2) and on faded bars (1.45)."""
    for part, color in charts.CATEGORY_COLORS.items():
        for alpha in [0.3 + i * 0.05 for i in range(15)]:
            drawn = tuple(alpha * c + (1 - alpha) * 255 for c in charts._rgb(color))
            assert _contrast(charts.name_color(color, alpha), drawn) >= 4.5, (part, alpha)
    assert charts.name_color(charts.CATEGORY_COLORS["compute"]) == "#FFFFFF"  # the darkest part: white
    assert charts.name_color(charts.CATEGORY_COLORS["coordination"], 0.3) == "#000000"  # pale: black


def test_the_parts_and_the_waterfall_write_their_names_in_those_colours():
    rows = [{"mode": "push", "ttft_ms": 100.0, "compute_ms": 50.0, "queue_ms": 10.0, "coordination_ms": 20.0,
             "wire_ms": 15.0, "unattributed_ms": 5.0, "requests": 3}]
    parts = charts.stacked_parts(rows, share_labels=True)
    assert {t.name: t.insidetextfont.color for t in parts.data} == {
        part: charts.name_color(color) for part, color in charts.CATEGORY_COLORS.items() if part != "root"}
    stages = [{"side": "decode", "stage": "decode_leg", "category": "coordination", "start_ms": 0.0, "end_ms": 100.0,
               "duration_ms": 100.0, "critical_ms": 0.0}]
    leg = charts.waterfall(stages, 100.0).data[0]
    assert list(leg.insidetextfont.color) == [charts.name_color(charts.CATEGORY_COLORS["coordination"], 0.3)]
