"""``kvtrace compare`` and ``kvtrace whatif``: runs recorded by ``kvtrace bench sweep``, read back
from the store, per (prompt length, rate or concurrency) point.

compare: client-measured TTFT / TPOT / ITL percentiles, the trace-derived TTFT beside the
client's (and their difference at p50), and the mean TTFT split into the breakdown's parts.

whatif: from one mode's traces, what TTFT the other mode would have given the same requests.
Each request's measured TTFT keeps everything the two modes share — routing, the transfer
from descriptor prep on (same wire time), D's completion, queue and first token, the router's
way back, and the unattributed time — and swaps the part between routing and the transfer:

* push: P's input, queue and prefill run beside D's input and allocation (D registers while P
  prefills), so that part is the longer of the two: ``max(P, D)``.
* pull: they run one after the other, with P's answer going back to the router between them:
  ``P + answer back + D`` (the router's relay and D's wait for its engine step, ``read_wait``,
  taken as zero: D idle).

The measured part is the critical-path time of those stages in the request's own trace; the
estimated one is built from the same request's stage durations (push: D's registration
message taken as free). See the README for what this leaves out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.collectors import schema
from kvtrace.collectors.reader import StoreReader

PARTS = schema.PARTS
POINT_KEY = ("point_prompt_tokens", "point_rate", "point_concurrency")
QUANTILES = (0.5, 0.9, 0.99)
# The stages between routing and the transfer, per mode: measured from their critical time.
MIDDLE = {
    "push": {("prefill", "p_input"), ("prefill", "p_queue"), ("prefill", "prefill"), ("decode", "d_input"),
             ("decode", "allocation"), ("decode", "registration"), ("prefill", "registration"),
             ("prefill", "rendezvous")},
    "pull": {("prefill", "p_input"), ("prefill", "p_queue"), ("prefill", "prefill"), ("router", "prefill_leg"),
             ("router", "registration"), ("decode", "d_input"), ("decode", "allocation"), ("decode", "read_wait")},
}
OTHER = {"push": "pull", "pull": "push"}


class RunNotFound(LookupError):
    pass


def point_label(prompt_tokens: int, rate: float | None, concurrency: int | None) -> str:
    load = f"{rate:g}/s" if rate is not None else f"c={concurrency}"
    return f"{prompt_tokens} tok @ {load}"


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (DuckDB's quantile_cont, numpy's default)."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_record(reader: StoreReader, run_id: str) -> dict[str, Any]:
    """The run's configuration (its ``kvtrace.run`` record) with the engines' versions and
    hardware as their resource attributes gave them."""
    rows = reader.sql("SELECT config FROM runs WHERE run_id = ?", [run_id]).to_pylist()
    if not rows:
        known = [r["run_id"] for r in reader.sql("SELECT run_id FROM runs ORDER BY recorded_at").to_pylist()]
        raise RunNotFound(f"no run {run_id!r} in the store" + (f"; runs: {', '.join(known)}" if known else
                                                                "; it has no run records (kvtrace bench sweep)"))
    config = json.loads(rows[0]["config"])
    engines = reader.sql("SELECT DISTINCT role, vllm_version, nixl_version, hardware FROM origins "
                         "WHERE run_id = ? AND role IN ('producer', 'consumer') ORDER BY role", [run_id]).to_pylist()
    config["engines"] = engines
    return config


def requests_of(reader: StoreReader, run_id: str) -> list[dict[str, Any]]:
    """The run's swept requests (warm-up excluded: it has no point), one dict per request."""
    columns = ["trace_id", "mode", *POINT_KEY, "ttft_ms", *(f"{p}_ms" for p in PARTS), "client_ttft_ms",
               "client_tpot_ms", "client_itl_p50_ms", "client_itl_p99_ms", "tpot_ms", "complete", "error"]
    return reader.sql(f"SELECT {', '.join(columns)} FROM requests WHERE run_id = ? AND point_prompt_tokens "
                      "IS NOT NULL ORDER BY started_at", [run_id]).to_pylist()


def _points(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(tuple(row[k] for k in POINT_KEY), []).append(row)
    return dict(sorted(out.items(), key=lambda item: (item[0][0], item[0][1] or 0, item[0][2] or 0)))


@dataclass
class PointStats:
    point: tuple
    requests: int
    client_ttft: tuple[float, ...]
    trace_ttft: tuple[float, ...]
    ttft_gap_p50: float  # median over requests of client TTFT - trace TTFT
    client_tpot: tuple[float, ...]
    itl_p50: float  # median of the requests' median inter-token latency
    itl_p99: float  # p99 over the requests' p99 inter-token latency
    parts: dict[str, float]  # mean ms per part (they sum to the mean trace TTFT)
    complete: int

    @property
    def label(self) -> str:
        return point_label(*self.point)


def point_stats(rows: list[dict[str, Any]]) -> list[PointStats]:
    stats = []
    for point, members in _points(rows).items():
        ok = [r for r in members if r["client_ttft_ms"] is not None]
        stats.append(PointStats(
            point=point, requests=len(ok),
            client_ttft=tuple(quantile([r["client_ttft_ms"] for r in ok], q) for q in QUANTILES),
            trace_ttft=tuple(quantile([r["ttft_ms"] for r in ok], q) for q in QUANTILES),
            ttft_gap_p50=quantile([r["client_ttft_ms"] - r["ttft_ms"] for r in ok], 0.5),
            client_tpot=tuple(quantile([r["client_tpot_ms"] for r in ok], q) for q in QUANTILES),
            itl_p50=quantile([r["client_itl_p50_ms"] for r in ok], 0.5),
            itl_p99=quantile([r["client_itl_p99_ms"] for r in ok], 0.99),
            parts={p: (sum(r[f"{p}_ms"] for r in ok) / len(ok)) if ok else math.nan for p in PARTS},
            complete=sum(bool(r["complete"]) for r in ok)))
    return stats


def compare(reader: StoreReader, run_a: str, run_b: str) -> dict[str, Any]:
    """Both runs' records and per-point statistics, matched by point."""
    records = {run: run_record(reader, run) for run in (run_a, run_b)}
    stats = {run: {s.point: s for s in point_stats(requests_of(reader, run))} for run in (run_a, run_b)}
    points = sorted(set(stats[run_a]) | set(stats[run_b]), key=lambda p: (p[0], p[1] or 0, p[2] or 0))
    return {"records": records, "stats": stats, "points": points}


def _ms(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.1f}"


def compare_text(result: dict[str, Any], run_a: str, run_b: str) -> str:
    records, stats = result["records"], result["stats"]
    lines = []
    for run in (run_a, run_b):
        r = records[run]
        engines = "; ".join(f"{e['role']}: vLLM {e['vllm_version']}, NIXL {e['nixl_version']}, {e['hardware']}"
                            for e in r.get("engines", []))
        lines.append(f"{run}: {r.get('mode')} ({r.get('connector')}), model {r.get('model', r.get('served_model'))}"
                     f"{' (' + str(r['kv_bytes_per_token']) + ' B KV/token)' if r.get('kv_bytes_per_token') else ''}, "
                     f"output {r.get('output_tokens')} tokens, prefix cache {r.get('prefix_cache', 'n/a')}, "
                     f"status {r.get('status')}; kvtrace {r.get('kvtrace_version')}; {engines or 'engines unknown'}")
    lines.append("")
    lines.append("ms; TTFT client = measured by the load generator, trace = the collector's (router's) TTFT; "
                 "gap = median of client - trace; parts = mean per request")
    header = (f"{'point':<20}{'run':<4}{'n':>4}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'trace p50':>10}{'gap':>6}"
              f"{'TPOT p50':>9}{'p90':>7}{'ITL p50':>8}{'p99':>7}  " + " ".join(f"{p[:6]:>7}" for p in PARTS))
    lines.append(header)
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


def compare_figures(result: dict[str, Any], run_a: str, run_b: str) -> dict[str, Any]:
    """Plotly figures: TTFT percentiles per point (client and trace), and the mean breakdown."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    stats = result["stats"]
    labels = [point_label(*p) for p in result["points"]]
    ttft = go.Figure()
    for run, dash in ((run_a, "solid"), (run_b, "dot")):
        mode = result["records"][run].get("mode", run)
        for index, q in enumerate(QUANTILES):
            ttft.add_scatter(x=labels, y=[stats[run][p].client_ttft[index] if p in stats[run] else None
                                          for p in result["points"]], name=f"{mode} client p{int(q * 100)}",
                             mode="lines+markers", line={"dash": dash})
        ttft.add_scatter(x=labels, y=[stats[run][p].trace_ttft[0] if p in stats[run] else None
                                      for p in result["points"]], name=f"{mode} trace p50", mode="markers",
                         marker={"symbol": "x", "size": 10})
    ttft.update_layout(title="TTFT per point (ms)", xaxis_title="point", yaxis_title="ms", template="plotly_white")
    parts = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=[
        f"{result['records'][r].get('mode', r)}: {r}" for r in (run_a, run_b)])
    colors = {"compute": "#4C78A8", "queue": "#F58518", "coordination": "#E45756", "wire": "#54A24B",
              "unattributed": "#BAB0AC"}
    for column, run in enumerate((run_a, run_b), 1):
        for part in PARTS:
            parts.add_bar(x=labels, y=[stats[run][p].parts[part] if p in stats[run] else None for p in result["points"]],
                          name=part, marker_color=colors.get(part), showlegend=column == 1, row=1, col=column)
    parts.update_layout(barmode="stack", title="Where TTFT went: mean per request (ms)", template="plotly_white")
    return {"ttft": ttft, "breakdown": parts}


def save_figures(figures: dict[str, Any], out: str | Path, stem: str) -> list[Path]:
    """Each figure as HTML, and as PNG where kaleido (and a Chrome or Chromium) is there."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in figures.items():
        html = out / f"{stem}-{name}.html"
        figure.write_html(html, include_plotlyjs="cdn")
        written.append(html)
        png = out / f"{stem}-{name}.png"
        try:
            figure.write_image(png, width=1100, height=550)
            written.append(png)
        except Exception as exc:  # no kaleido, or no browser for it: the HTML is there
            print(f"PNG not written ({type(exc).__name__}: {str(exc)[:120]}); HTML only", flush=True)
    return written


# --------------------------------------------------------------------------------------
# What-if
# --------------------------------------------------------------------------------------


def stage_table(reader: StoreReader, run_id: str) -> dict[str, dict[tuple[str, str], tuple[float, float, float]]]:
    """Per request of the run: (side, stage) -> (start ms, end ms on the router's clock, critical ms)."""
    rows = reader.sql("SELECT s.trace_id, side, stage, start_ns / 1e6 AS s, end_ns / 1e6 AS e, critical_ms "
                      "FROM stages s JOIN requests r USING (trace_id) WHERE r.run_id = ? AND "
                      "r.point_prompt_tokens IS NOT NULL", [run_id]).to_pylist()
    out: dict[str, dict[tuple[str, str], tuple[float, float, float]]] = {}
    for row in rows:
        out.setdefault(row["trace_id"], {})[(row["side"], row["stage"])] = (row["s"], row["e"], row["critical_ms"])
    return out


def _duration(stages: dict, key: tuple[str, str]) -> float:
    found = stages.get(key)
    return found[1] - found[0] if found else 0.0


def estimate_other_mode(mode: str, ttft_ms: float, stages: dict[tuple[str, str], tuple[float, float, float]]) -> float:
    """TTFT this request would have had in the other mode (the module's model)."""
    measured_middle = sum(stages[k][2] for k in MIDDLE[mode] if k in stages)
    p_head = sum(_duration(stages, ("prefill", s)) for s in ("p_input", "p_queue", "prefill"))
    d_head = _duration(stages, ("decode", "d_input")) + _duration(stages, ("decode", "allocation"))
    if mode == "pull":  # to push: D's side runs beside P's
        other_middle = max(p_head, d_head)
    else:  # to pull: one after the other, with P's answer back at the router between them
        prefill, leg = stages.get(("prefill", "prefill")), stages.get(("router", "prefill_leg"))
        answer_back = max(0.0, leg[1] - prefill[1]) if prefill and leg else 0.0
        other_middle = p_head + answer_back + d_head
    return ttft_ms - measured_middle + other_middle


def whatif(reader: StoreReader, run_id: str, against: str | None = None) -> dict[str, Any]:
    """Per point: this run's measured TTFT percentiles, the other mode's estimated from its traces,
    and (``against``: a run of the other mode over the same points) the other mode's measured and
    the estimate's error."""
    record = run_record(reader, run_id)
    mode = record.get("mode")
    if mode not in MIDDLE:
        raise ValueError(f"run {run_id}: mode {mode!r} is neither push nor pull")
    other_rows: dict[tuple, list[dict[str, Any]]] = {}
    if against:
        other_record = run_record(reader, against)
        if other_record.get("mode") != OTHER[mode]:
            raise ValueError(f"--against {against}: a {other_record.get('mode')} run; a {OTHER[mode]} run is needed")
        other_rows = _points(requests_of(reader, against))
    stages = stage_table(reader, run_id)
    points = []
    for point, rows in _points(requests_of(reader, run_id)).items():
        rows = [r for r in rows if r["trace_id"] in stages]
        measured = [r["ttft_ms"] for r in rows]
        estimated = [estimate_other_mode(mode, r["ttft_ms"], stages[r["trace_id"]]) for r in rows]
        entry = {"point": point, "requests": len(rows),
                 "measured": {q: quantile(measured, q) for q in (0.5, 0.9)},
                 "estimated": {q: quantile(estimated, q) for q in (0.5, 0.9)}}
        if against:
            actual = [r["ttft_ms"] for r in other_rows.get(point, [])]
            entry["other_measured"] = {q: quantile(actual, q) for q in (0.5, 0.9)}
            entry["error"] = {q: (entry["estimated"][q] / entry["other_measured"][q] - 1)
                              if entry["other_measured"][q] else math.nan for q in (0.5, 0.9)}
        points.append(entry)
    return {"run": run_id, "mode": mode, "other": OTHER[mode], "against": against, "points": points}


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
