"""The per-trace modules Cython compiles (collectors/compiled.py): they run compiled when built and
current, as Python when their source changed or KVTRACE_PURE_PYTHON is set, and both give the same
breakdown, byte for byte, on traces of every shape."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.collectors import attribution, compiled
from kvtrace.collectors.model import SpanBatch
from tests.collectors.traces import build

COLLECTORS = Path(compiled.__file__).parent


def _run(code: str, env: dict | None = None) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}).stdout


def test_the_per_trace_modules_run_compiled():
    # Installed from this repository with a C compiler, they must not fall back to Python silently.
    if os.environ.get(compiled.PURE_ENV):
        pytest.skip("Python was asked for")
    assert attribution.__file__.endswith(".so")
    assert compiled.status() == dict.fromkeys(compiled.MODULES, "compiled")
    assert compiled.running_as_python() == {}


def test_an_edited_source_runs_as_python_and_the_rest_compiled(tmp_path):
    """A copy of the built package with one source edited after the build: that module is imported from
    its source, and the collector's start-up warning names it; the others stay compiled."""
    if not attribution.__file__.endswith(".so"):
        pytest.skip("not compiled here")
    copy = tmp_path / "collectors"
    shutil.copytree(COLLECTORS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "explain.py").open("a") as source:
        source.write("\nEDITED = True\n")
    out = _run("import json, kvtrace.collectors as c;"
               f"c.__path__[:] = [{str(copy)!r}];"
               "import kvtrace.collectors.attribution as a, kvtrace.collectors.explain as e;"
               "print(json.dumps([a.__file__, e.__file__, e.EDITED, c.compiled.running_as_python(),"
               " c.compiled.status()]))")
    attribution_file, explain_file, edited, as_python, status = json.loads(out)
    assert attribution_file.startswith(str(copy)) and attribution_file.endswith(".so")
    assert explain_file == str(copy / "explain.py") and edited is True
    assert list(as_python) == ["explain"] and "changed since it was compiled" in as_python["explain"]
    assert status["clocks"] == status["breakdown"] == "compiled"


def test_without_the_build_record_every_module_runs_as_python(tmp_path):
    """Extensions whose build left no record of their sources cannot be shown current: run as Python."""
    if not attribution.__file__.endswith(".so"):
        pytest.skip("not compiled here")
    copy = tmp_path / "collectors"
    shutil.copytree(COLLECTORS, copy, ignore=shutil.ignore_patterns("__pycache__", compiled.RECORD))
    out = _run("import json, kvtrace.collectors as c;"
               f"c.__path__[:] = [{str(copy)!r}];"
               "import kvtrace.collectors.attribution as a;"
               "print(json.dumps([a.__file__, c.compiled.running_as_python()]))")
    attribution_file, as_python = json.loads(out)
    assert attribution_file == str(copy / "attribution.py")
    assert sorted(as_python) == sorted(compiled.MODULES)
    assert all(f"no {compiled.RECORD} beside it" in why for why in as_python.values())


def test_pure_python_is_asked_for_by_environment():
    out = _run("import json; from kvtrace.collectors import attribution, compiled, model;"
               "print(json.dumps([attribution.__file__, model.DECODER, compiled.status()]))",
               env={compiled.PURE_ENV: "1"})
    attribution_file, decoder, status = json.loads(out)
    assert attribution_file.endswith("attribution.py") and decoder == "python"
    assert status == dict.fromkeys(compiled.MODULES, f"{compiled.PURE_ENV} is set")


# Decodes the export requests given on stdin (JSON: hex payloads, trace by trace) and prints each
# trace's breakdown, every field, as JSON: run once compiled and once as Python.
_ATTRIBUTE = """
import dataclasses, json, sys
from kvtrace.collectors.attribution import Attributor
from kvtrace.collectors.model import SpanBatch
attributor, out = Attributor(), []
for trace in json.load(sys.stdin):
    rows = [row for payload in trace for row in SpanBatch.decode(bytes.fromhex(payload)).rows]
    b = attributor.attribute(rows[0].trace_id.hex(), rows)
    out.append(None if b is None else {k: repr(v) for k, v in dataclasses.asdict(b).items()})
print(json.dumps(out))
"""

_SHAPES = [
    dict(mode="push", order="registration_first"), dict(mode="push", order="kv_first"), dict(mode="pull"),
    dict(mode="push", skew_ms={"decode": 30, "prefill": -12}), dict(mode="pull", skew_ms={"decode": -8}),
    dict(mode="push", drop={"router"}), dict(mode="pull", drop={"router"}), dict(mode="push", fail="write"),
    dict(mode="pull", fail="read"), dict(mode="push", drop={"decode"}), dict(mode="push", drop={"decode:completion"}),
    dict(mode="push", late_rank_ms=4.0), dict(mode="pull", late_rank_ms=4.0), dict(mode="push", contract=1),
    dict(mode="pull", d_queue_ms=40.0),
]


def test_compiled_and_python_give_the_same_breakdowns():
    if not attribution.__file__.endswith(".so"):
        pytest.skip("not compiled here")
    traces = [[request.SerializeToString().hex() for request in build(**shape, at_ms=10.0 * i).requests]
              for i, shape in enumerate(_SHAPES * 3)]  # three rounds: the clock estimates carry over
    runs = [subprocess.run([sys.executable, "-c", _ATTRIBUTE], input=json.dumps(traces), check=True,
                           capture_output=True, text=True, env={**os.environ, **env}).stdout
            for env in ({}, {compiled.PURE_ENV: "1"})]
    compiled_run, python_run = (json.loads(run) for run in runs)
    assert len(compiled_run) == len(traces) and all(b is not None for b in compiled_run)
    assert {b["mode"] for b in compiled_run} == {"'push'", "'pull'"}
    assert {b["complete"] for b in compiled_run} == {"True", "False"} and "True" in {b["error"] for b in compiled_run}
    assert compiled_run == python_run
    # and the parent process's (compiled) attribution agrees on the first trace
    first = [row for payload in traces[0] for row in SpanBatch.decode(bytes.fromhex(payload)).rows]
    assert repr(attribution.Attributor().attribute(first[0].trace_id.hex(), first).parts) == \
        compiled_run[0]["parts"]


def test_the_collector_names_modules_running_as_python_at_start(make_collector, monkeypatch, caplog):
    ran = {**dict.fromkeys(compiled.MODULES, "compiled"), "explain": "collectors/explain.py changed since it was compiled"}
    monkeypatch.setattr(compiled, "_ran", ran)
    with caplog.at_level("WARNING", logger="kvtrace.collectors.service"):
        make_collector()
    (warning,) = [r.getMessage() for r in caplog.records if "not compiled" in r.getMessage()]
    assert "explain: collectors/explain.py changed since it was compiled" in warning
    assert "attribution" not in warning and "clocks" not in warning  # compiled: not named
