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
    for name in ("version", "contract", "bench", "router", "collector", "dashboard", "demo"):
        assert name in result.stdout


def test_version_reports_each_component(capsys):
    assert cli.main(["version"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines()]
    assert names == ["kvtrace", "vllm", "nixl", "opentelemetry-sdk", "prometheus-client"]
    assert "not installed" not in out.splitlines()[3]  # the SDK is a core dependency


@pytest.mark.parametrize("name", ["dashboard"])
def test_unbuilt_commands_say_so_and_fail(name, capsys):
    assert cli.main([name]) == 2
    assert "not yet available" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error():
    result = run("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_contract_doc_is_current():
    """docs/CONTRACT.md is generated from semconv; regenerate with `kvtrace contract`."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "CONTRACT.md"
    assert doc.read_text() == render(), "run: kvtrace contract > docs/CONTRACT.md"
