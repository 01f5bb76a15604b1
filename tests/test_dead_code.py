"""No dead code: vulture reads the packages, the tests and the benchmarks together (what only a test or
a benchmark uses is used), and finds nothing beyond the names tests/dead_code_allowed.py explains."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READ = ["collectors", "connector", "telemetry", "dashboard", "kvtrace", "tests", "bench"]


def _vulture(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vulture", *paths, "--min-confidence", "60"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_nothing_is_defined_and_never_used():
    found = _vulture(*READ, "tests/dead_code_allowed.py")
    assert found.returncode == 0, found.stdout + found.stderr


def test_the_check_finds_a_function_nobody_calls(tmp_path):
    (tmp_path / "module.py").write_text("def used():\n    return 1\n\n\ndef forgotten():\n    return 2\n\n\nused()\n")
    found = _vulture(str(tmp_path / "module.py"))
    assert found.returncode != 0 and "unused function 'forgotten'" in found.stdout and "'used'" not in found.stdout
