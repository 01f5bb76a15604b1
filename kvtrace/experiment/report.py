"""What ``kvtrace compare`` and ``kvtrace whatif`` print and save (the numbers: :mod:`kvtrace.collectors.read.runs`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvtrace.collectors.read.runs import PARTS, point_label


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.1f}"


def describe_run(record: dict[str, Any]) -> str:
    """One line: the run's configuration and its engines (versions and hardware as they reported them)."""
    engines = "; ".join(f"{e['role']}: vLLM {e['vllm_version']}, NIXL {e['nixl_version']}, {e['hardware']}"
                        for e in record.get("engines", []))
    kv = f" ({record['kv_bytes_per_token']:,} B KV/token)" if record.get("kv_bytes_per_token") else ""
    return (f"{record['run_id']}: {record.get('mode')} ({record.get('connector')}), model "
            f"{record.get('model', record.get('served_model'))}{kv}, output {record.get('output_tokens')} tokens, "
            f"prefix cache {record.get('prefix_cache', 'n/a')}, status {record.get('status')}; "
            f"kvtrace {record.get('kvtrace_version')}; {engines or 'engines unknown'}")


def compare_text(result: dict[str, Any], run_a: str, run_b: str) -> str:
    stats = result["stats"]
    lines = [describe_run(result["records"][run]) for run in (run_a, run_b)]
    lines += ["", "ms; TTFT client = measured by the load generator, trace = the collector's (router's) TTFT; "
              "gap = median of client - trace; parts = mean per request",
              f"{'point':<20}{'run':<4}{'n':>4}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'trace p50':>10}{'gap':>6}"
              f"{'TPOT p50':>9}{'p90':>7}{'ITL p50':>8}{'p99':>7}  " + " ".join(f"{p[:6]:>7}" for p in PARTS)]
    for point in result["points"]:
        for tag, run in (("A", run_a), ("B", run_b)):
            s = stats[run].get(point)
            if s is None:
                lines.append(f"{point_label(*point):<20}{tag:<4}   0")
                continue
            lines.append(f"{s.label:<20}{tag:<4}{s.requests:>4}{_ms(s.client_ttft[0]):>10}{_ms(s.client_ttft[1]):>9}"
                         f"{_ms(s.client_ttft[2]):>9}{_ms(s.trace_ttft[0]):>10}{_ms(s.ttft_gap_p50):>6}"
                         f"{_ms(s.client_tpot[0]):>9}{_ms(s.client_tpot[1]):>7}{_ms(s.itl_p50):>8}{_ms(s.itl_p99):>7}  "
                         + " ".join(f"{_ms(s.parts[p]):>7}" for p in PARTS))
    lines.append(f"A = {run_a}, B = {run_b}")
    return "\n".join(lines)


def whatif_text(result: dict[str, Any]) -> str:
    mode, other = result["mode"], result["other"]
    lines = [f"run {result['run']} ({mode}): TTFT measured, and estimated in {other} from its traces (ms)"]
    header = f"{'point':<20}{'n':>4}{mode + ' p50':>11}{'p90':>9}{'est ' + other + ' p50':>15}{'p90':>9}"
    if result["against"]:
        header += f"{other + ' p50':>11}{'p90':>9}{'err p50':>9}{'err p90':>9}"
    lines.append(header)
    for e in result["points"]:
        line = (f"{point_label(*e['point']):<20}{e['requests']:>4}{_ms(e['measured'][0.5]):>11}"
                f"{_ms(e['measured'][0.9]):>9}{_ms(e['estimated'][0.5]):>15}{_ms(e['estimated'][0.9]):>9}")
        if result["against"]:
            line += (f"{_ms(e['other_measured'][0.5]):>11}{_ms(e['other_measured'][0.9]):>9}"
                     f"{e['error'][0.5] * 100:>+8.1f}%{e['error'][0.9] * 100:>+8.1f}%")
        lines.append(line)
    if result["against"]:
        lines.append(f"measured {other}: run {result['against']}; err = estimate / measured - 1")
    return "\n".join(lines)


def save_figures(result: dict[str, Any], run_a: str, run_b: str, out: str | Path) -> list[Path]:
    """The Runs page's two figures as HTML, and as PNG where kaleido (and a Chrome or Chromium) is there."""
    from kvtrace.dashboard import charts

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in (("ttft", charts.run_ttft(result, run_a, run_b)),
                         ("breakdown", charts.run_breakdown(result, run_a, run_b))):
        stem = out / f"compare-{run_a}-{run_b}-{name}"
        figure.write_html(stem.with_suffix(".html"), include_plotlyjs="cdn")
        written.append(stem.with_suffix(".html"))
        try:
            figure.write_image(stem.with_suffix(".png"), width=1200, height=520)
            written.append(stem.with_suffix(".png"))
        except Exception as exc:  # no kaleido, or no browser for it: the HTML is there
            print(f"PNG not written ({type(exc).__name__}: {str(exc)[:160]}); HTML only")
    return written
