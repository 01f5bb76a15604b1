"""Sweep runs read back from the store (``kvtrace bench sweep`` records them): the numbers behind
``kvtrace compare``, ``kvtrace whatif`` and the dashboard's Runs page, per (prompt length, rate
or concurrency) point. Through :class:`.reader.StoreReader` (``reader.compare_runs`` ...); percentiles per :mod:`.quantiles`.

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
from typing import Any

from .. import schema
from ..breakdown import (
    ALLOCATION, D_INPUT, D_REGISTRATION, P_INPUT, P_PREFILL, P_QUEUE, P_REGISTRATION, PREFILL_LEG, R_REGISTRATION,
    READ_WAIT, RENDEZVOUS,
)
from .quantiles import quantile

PARTS = schema.PARTS
POINT_KEY = ("point_prompt_tokens", "point_rate", "point_concurrency")
QUANTILES = (0.5, 0.9, 0.99)
# The stages between routing and the transfer, per mode: measured from their critical time.
MIDDLE = {
    "push": {P_INPUT, P_QUEUE, P_PREFILL, D_INPUT, ALLOCATION, D_REGISTRATION, P_REGISTRATION, RENDEZVOUS},
    "pull": {P_INPUT, P_QUEUE, P_PREFILL, PREFILL_LEG, R_REGISTRATION, D_INPUT, ALLOCATION, READ_WAIT},
}
OTHER = {"push": "pull", "pull": "push"}


class RunNotFound(LookupError):
    pass


def point_label(prompt_tokens: int, rate: float | None, concurrency: int | None) -> str:
    load = f"{rate:g}/s" if rate is not None else f"c={concurrency}"
    return f"{prompt_tokens} tok @ {load}"


def list_runs(reader: Any) -> list[dict[str, Any]]:
    """Every recorded run, newest first: id, mode, status, when, and its swept requests stored."""
    field = reader.dialect.json_string
    return reader.sql(f"""SELECT r.run_id, {field('r.config', 'mode')} AS mode,
            {field('r.config', 'status')} AS status, r.recorded_at, coalesce(q.requests, 0) AS requests
        FROM runs r LEFT JOIN (SELECT run_id, count(*) AS requests FROM requests
                               WHERE point_prompt_tokens IS NOT NULL GROUP BY run_id) q ON q.run_id = r.run_id
        ORDER BY r.recorded_at DESC""").to_pylist()


def default_pair(listed: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Of :func:`list_runs`' runs (newest first), the two to compare first: the newest push run and the
    newest pull run, else the two newest."""
    if len(listed) < 2:
        return None
    ids = [r["run_id"] for r in listed]
    newest: dict[str, str] = {}
    for r in listed:
        newest.setdefault(r["mode"], r["run_id"])
    first = newest.get("push", ids[0])
    second = newest.get("pull", ids[1] if ids[1] != first else ids[0])
    return first, (second if second != first else next(i for i in ids if i != first))


def run_record(reader: Any, run_id: str) -> dict[str, Any]:
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


def requests_of(reader: Any, run_id: str) -> list[dict[str, Any]]:
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


def compare(reader: Any, run_a: str, run_b: str) -> dict[str, Any]:
    """Both runs' records and per-point statistics, matched by point."""
    records = {run: run_record(reader, run) for run in (run_a, run_b)}
    stats = {run: {s.point: s for s in point_stats(requests_of(reader, run))} for run in (run_a, run_b)}
    points = sorted(set(stats[run_a]) | set(stats[run_b]), key=lambda p: (p[0], p[1] or 0, p[2] or 0))
    return {"records": records, "stats": stats, "points": points}


# --------------------------------------------------------------------------------------
# What-if
# --------------------------------------------------------------------------------------


def stage_table(reader: Any, run_id: str) -> dict[str, dict[tuple[str, str], tuple[int, int, float]]]:
    """Per request of the run: (side, stage) -> (start ns, end ns on the router's clock, critical ms)."""
    rows = reader.sql("SELECT s.trace_id, side, stage, start_ns AS s, end_ns AS e, critical_ms "
                      "FROM stages s JOIN requests r USING (trace_id) WHERE r.run_id = ? AND "
                      "r.point_prompt_tokens IS NOT NULL", [run_id]).to_pylist()
    out: dict[str, dict[tuple[str, str], tuple[float, float, float]]] = {}
    for row in rows:
        out.setdefault(row["trace_id"], {})[(row["side"], row["stage"])] = (row["s"], row["e"], row["critical_ms"])
    return out


def _duration(stages: dict, stage_key: tuple[str, str]) -> float:
    """A stage's duration in ms (0 where the trace lacks it)."""
    found = stages.get(stage_key)
    return (found[1] - found[0]) / 1e6 if found else 0.0


def estimate_other_mode(mode: str, ttft_ms: float, stages: dict[tuple[str, str], tuple[int, int, float]]) -> float:
    """TTFT this request would have had in the other mode (the module's model)."""
    measured_middle = sum(stages[k][2] for k in MIDDLE[mode] if k in stages)
    p_head = sum(_duration(stages, k) for k in (P_INPUT, P_QUEUE, P_PREFILL))
    d_head = _duration(stages, D_INPUT) + _duration(stages, ALLOCATION)
    if mode == "pull":  # to push: D's side runs beside P's
        other_middle = max(p_head, d_head)
    else:  # to pull: one after the other, with P's answer back at the router between them
        prefill, leg = stages.get(P_PREFILL), stages.get(PREFILL_LEG)
        answer_back = max(0, leg[1] - prefill[1]) / 1e6 if prefill and leg else 0.0
        other_middle = p_head + answer_back + d_head
    return ttft_ms - measured_middle + other_middle


def whatif(reader: Any, run_id: str, against: str | None = None) -> dict[str, Any]:
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
