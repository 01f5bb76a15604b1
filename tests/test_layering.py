"""What each layer may import, read from the source: the collector and the contract must run where
neither vLLM nor kvtrace's application (router, demo, testbed) is installed, and the dashboard
reads the store through the collector's reader only."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {  # folder -> the kvtrace packages its modules may import
    "telemetry": {"kvtrace.telemetry"},
    "collectors": {"kvtrace.collectors", "kvtrace.telemetry"},
    "connector": {"kvtrace.connector", "kvtrace.telemetry"},
    "dashboard": {"kvtrace.dashboard", "kvtrace.collectors", "kvtrace.telemetry"},
}
FORBIDDEN_MODULES = {"dashboard": {"duckdb"}, "telemetry": {"vllm", "duckdb"}, "collectors": {"vllm"}}


def _imports(path: Path, package: str) -> set[str]:
    """Every module a file imports, relative imports resolved against its package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:
                found.add(node.module)
    return found


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(folder):
    problems = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = f"kvtrace.{folder}"
        for module in _imports(path, package):
            top = module.split(".")[0]
            if top == "kvtrace" and not any(module == a or module.startswith(a + ".") for a in ALLOWED[folder]):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
            if top in FORBIDDEN_MODULES.get(folder, ()):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not problems, "\n".join(problems)


def test_the_reader_is_the_dashboards_only_way_to_the_store():
    used = set()
    for path in (ROOT / "dashboard").rglob("*.py"):
        used |= {m for m in _imports(path, "kvtrace.dashboard") if m.startswith("kvtrace.collectors")}
    assert used == {"kvtrace.collectors.reader"}, used
