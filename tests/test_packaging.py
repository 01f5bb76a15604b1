"""The wheel installs everything under the kvtrace namespace and nothing at top level."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from kvtrace.collectors import compiled

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("connector", "telemetry", "collectors", "dashboard")


def test_wheel_installs_only_the_kvtrace_namespace(tmp_path):
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                            str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, text=True)
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr  # setuptools' warning
    (wheel,) = (tmp_path / "dist").glob("kvtrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    dist_info = {t for t in top_level if t.endswith(".dist-info")}
    assert top_level - dist_info == {"kvtrace"} and len(dist_info) == 1
    for folder in FOLDERS:
        assert f"kvtrace/{folder}/__init__.py" in names
    assert "kvtrace/telemetry/recorder.py" in names and "kvtrace/cli.py" in names
    # the dashboard's pages are scripts Streamlit runs by path, shipped as package data
    assert {"kvtrace/dashboard/app_pages/overview.py", "kvtrace/dashboard/icon.png"} <= set(names)
    assert any(n.startswith("kvtrace/collectors/_otlp.") and n.endswith(".so") for n in names)  # native decoder
    for module in compiled.MODULES:  # compiled by Cython, shipped beside their sources and the build's record
        assert any(n.startswith(f"kvtrace/collectors/{module}.") and n.endswith(".so") for n in names), module
        assert f"kvtrace/collectors/{module}.py" in names
    record = json.loads(zipfile.ZipFile(wheel).read(f"kvtrace/collectors/{compiled.RECORD}"))
    assert record == {m: compiled.source_digest(ROOT / "collectors" / f"{m}.py") for m in compiled.MODULES}
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvtrace = kvtrace.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # Installed on its own, the wheel's modules are the ones imported (not the source tree).
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                    str(target), str(wheel)], check=True)
    installed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert installed - {"bin"} == {"kvtrace"}  # bin/ holds the console script
    probe = ("import kvtrace.telemetry, kvtrace.connector, kvtrace.collectors, kvtrace.dashboard;"
             "from kvtrace.collectors import attribution, compiled, model;"
             "print(kvtrace.telemetry.__file__, model.DECODER, sorted(set(compiled.status().values())))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(target)}).stdout
    assert out.strip().startswith(str(target / "kvtrace" / "telemetry"))
    assert out.strip().endswith(" native ['compiled']")  # the decoder native, the per-trace modules compiled
    assert "kvtrace/collectors/read/reader.py" in names
    # From the wheel, a benchmark says it needs a checkout (its scripts are not installed), in one line.
    bench = subprocess.run([sys.executable, "-m", "kvtrace", "bench", "recorder"], cwd=tmp_path, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(target)})
    assert bench.returncode == 2 and "needs a source checkout" in bench.stderr and "Traceback" not in bench.stderr


def test_editable_install_resolves_the_root_folders(tmp_path):
    out = subprocess.run([sys.executable, "-c", "import kvtrace.telemetry as t, kvtrace.collectors._otlp as n;"
                          "import kvtrace.collectors.attribution as a; print(t.__file__); print(n.__file__);"
                          "print(a.__file__)"],
                         cwd=tmp_path, check=True, capture_output=True, text=True).stdout.split()
    assert Path(out[0]) == ROOT / "telemetry" / "__init__.py"
    assert Path(out[1]).parent == ROOT / "collectors"  # the native decoder, built in place
    assert Path(out[2]).parent == ROOT / "collectors" and out[2].endswith(".so")  # compiled in place too


def test_gpu_extra_resolves_with_vllm_0_33(tmp_path):
    """What a GPU host runs: ``pip install 'kvtrace[gpu]'`` with the newest tested vLLM. A dry run
    against the package index (metadata only, nothing installed), read back from pip's report."""
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                    "--no-build-isolation", "--report", str(report), f"{ROOT}[gpu]", "vllm==0.33.0"],
                   check=True, capture_output=True, timeout=600)
    chosen = {item["metadata"]["name"]: item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    assert chosen["kvtrace"] and chosen["vllm"] == "0.33.0"
    assert tuple(int(p) for p in chosen["nixl"].split(".")[:2]) >= (1, 5)
