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
        elif isinstance(node, ast.ImportFrom):  # each name imported, as module.name (a submodule, or a name in it)
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(folder):
    problems = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for module in _imports(path, _package_of(path)):
            top = module.split(".")[0]
            if top == "kvtrace" and not any(module == a or module.startswith(a + ".") for a in ALLOWED[folder]):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
            if top in FORBIDDEN_MODULES.get(folder, ()):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not problems, "\n".join(problems)


READ_SIDE = "kvtrace.collectors.read"
DASHBOARD_MAY_IMPORT = {"kvtrace.dashboard", READ_SIDE, "kvtrace.telemetry.semconv"}  # itself, the read side, the contract


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _pipeline_modules():
    """The collector's modules outside its read side."""
    return [path for path in sorted((ROOT / "collectors").rglob("*.py")) if "read" not in path.relative_to(ROOT).parts]


def test_the_pipeline_never_imports_the_read_side():
    problems = [f"{path.relative_to(ROOT)} imports {module}" for path in _pipeline_modules()
                for module in _imports(path, _package_of(path)) if _within(module, {READ_SIDE})]
    assert _pipeline_modules() and not problems, "\n".join(problems)


def test_the_dashboard_imports_only_the_read_side_and_the_contract():
    problems = []
    for path in sorted((ROOT / "dashboard").rglob("*.py")):
        for module in _imports(path, _package_of(path)):
            if module.startswith("kvtrace") and not _within(module, DASHBOARD_MAY_IMPORT):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not problems, "\n".join(problems)


def _package_of(path: Path) -> str:
    """The installed package a file belongs to (folders map to kvtrace.<folder>, subfolders below it)."""
    folder, *rest = path.relative_to(ROOT).parent.parts
    return ".".join(["kvtrace", folder, *rest])


@pytest.mark.parametrize("source, module", [
    ("from .read import open_store\n", "collectors/store.py"),
    ("from kvtrace.collectors.read.quantiles import quantile\n", "collectors/service.py"),
])
def test_the_pipeline_check_catches_an_import_of_the_read_side(tmp_path, source, module):
    path = tmp_path / module
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert all(_within(m, {READ_SIDE}) for m in _imports(path, "kvtrace.collectors"))


def test_the_dashboard_check_catches_an_import_of_the_pipeline(tmp_path):
    path = tmp_path / "page.py"
    path.write_text("from kvtrace.collectors.store import Store\nfrom kvtrace.collectors.read import open_store\n")
    assert [m for m in _imports(path, "kvtrace.dashboard") if not _within(m, DASHBOARD_MAY_IMPORT)] == \
        ["kvtrace.collectors.store.Store"]
