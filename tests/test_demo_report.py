"""The demo's printed summary: exact percentiles for its few requests, from the store's rows."""

from __future__ import annotations

from kvtrace import demo
from kvtrace.collectors.read import Filters, open_store
from tests.collectors.traces import build, store_of


def test_the_demo_prints_each_stages_exact_median_and_says_so(tmp_path, capsys):
    builts = [build(mode, late_rank_ms=float(i), d_queue_ms=1.3 * i) for i, mode in enumerate(["push", "pull"] * 4)]
    db = store_of(tmp_path / "demo.duckdb", builts)
    store = open_store(db)
    demo._report(store, Filters(), ["push", "pull"])
    out = capsys.readouterr().out
    assert out.count("median duration (exact)") == 2
    where = "mode = 'push' AND complete"
    exact = store.sql(f"SELECT quantile_cont(duration_ms, 0.5) AS q FROM stages JOIN requests USING (trace_id) "
                      f"WHERE {where} AND stages.stage = 'd_queue'").to_pylist()[0]["q"]
    push = out.split("push: each stage")[1].split("pull: each stage")[0]
    (line,) = [row for row in push.splitlines() if " d_queue " in row]
    assert line.split()[3] == f"{exact:.2f}"
    p50 = store.sql(f"SELECT quantile_cont(ttft_ms, 0.5) AS q FROM requests WHERE {where}").to_pylist()[0]["q"]
    (mode_line,) = [row for row in out.splitlines() if row.startswith("push ")]
    assert mode_line.split()[2] == f"{p50:.1f}"
