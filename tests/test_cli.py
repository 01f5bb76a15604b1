import subprocess
import sys

import pytest

from kvtrace import cli
from kvtrace.telemetry.contract_doc import render
from pathlib import Path


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvtrace", *args], capture_output=True, text=True)


def test_help_lists_the_subcommands():
    result = run("--help")
    assert result.returncode == 0
    for name in ("version", "contract", "bench", "router", "collector", "dashboard", "demo", "query", "compare",
                 "whatif"):
        assert name in result.stdout


def test_version_reports_each_component(capsys):
    assert cli.main(["version"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines()]
    assert names == ["kvtrace", "vllm", "nixl", "opentelemetry-sdk", "prometheus-client"]
    assert "not installed" not in out.splitlines()[3]  # the SDK is a core dependency


@pytest.mark.parametrize("name", ["dashboard", "query"])
def test_store_commands_need_a_store(name, capsys):
    args = [name] if name == "dashboard" else [name, "SELECT 1"]
    assert cli.main(args) == 2
    assert "give --db PATH" in capsys.readouterr().err


def test_query_prints_and_writes_a_stopped_store(tmp_path, capsys):
    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.model import SpanBatch
    from kvtrace.collectors.service import Collector
    from tests.collectors.traces import build

    db = str(tmp_path / "k.duckdb")
    collector = Collector(CollectorConfig(db_path=db, grpc_port=None, http_port=0, decision_wait_s=0.0))
    collector.start()
    for request in build("push").requests:
        collector.consume(SpanBatch.of(request))
    collector.shutdown()
    assert cli.main(["query", "--db", db, "SELECT mode, round(ttft_ms) AS ttft FROM requests"]) == 0
    assert capsys.readouterr().out.split() == ["mode", "ttft", "push", "169.0"]
    out = tmp_path / "requests.parquet"
    assert cli.main(["query", "--db", db, "SELECT * FROM requests", "--out", str(out)]) == 0
    import duckdb

    assert duckdb.sql(f"SELECT count(*) FROM '{out}'").fetchall() == [(1,)]  # a user's own DuckDB reads it
    assert cli.main(["query", "--db", db, "DROP TABLE requests"]) == 2
    assert "SELECT" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error():
    result = run("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_contract_doc_is_current():
    """docs/CONTRACT.md is generated from semconv; regenerate with `kvtrace contract`."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "CONTRACT.md"
    assert doc.read_text() == render(), "run: kvtrace contract > docs/CONTRACT.md"


@pytest.mark.parametrize("args", [
    ["--grpc-port", "70000"], ["--http-port", "-2", "--grpc-port", "-1"], ["--metrics-port", "99999"],
    ["--query-port", "70000"], ["--tls-cert", "/nonexistent.pem"], ["--tls-cert", "/etc/hostname", "--tls-key",
                                                                    "/nonexistent.pem"],
    ["--queue-requests", "0"], ["--max-traces", "0"], ["--max-body-bytes", "0"], ["--archive-gib", "-1"],
    ["--decision-wait", "-1"], ["--max-age", "0"], ["--forward-policy", "slow:abc"], ["--db", "/no/such/dir/x.duckdb"],
])
def test_every_collector_error_names_a_flag_the_command_has(args, capsys, tmp_path):
    """A bad value stops the collector with one line naming the flag to fix — one that exists."""
    full = ["collector", "--db", str(tmp_path / "c.duckdb"), *args] if "--db" not in args else ["collector", *args]
    assert cli.main(full) == 2
    message = capsys.readouterr().err
    named = {word.rstrip(":,") for word in message.split() if word.startswith("--")}
    options = {option for action in cli.build_parser()._subparsers._group_actions[0].choices["collector"]._actions
               for option in action.option_strings}
    assert named and named <= options, (message, named - options)


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--query-port", "--metrics-port"])
def test_a_collector_whose_port_is_taken_says_so_in_one_line(tmp_path, flag):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"--http-port": "-1", "--grpc-port": "0", "--query-port": "-1", flag: str(port)}
        result = subprocess.run([sys.executable, "-m", "kvtrace", "collector", "--db", str(tmp_path / "c.duckdb"),
                                 *[a for pair in ports.items() for a in pair]], capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"kvtrace collector: {flag} {port}: cannot listen on 127.0.0.1:{port}" in result.stderr
