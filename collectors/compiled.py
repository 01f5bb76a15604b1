"""The collector's per-trace modules, compiled with Cython where the install could, run as Python otherwise.

Attribution, clock alignment, the explanation and the breakdown run once per trace on the pipeline
thread, a few dozen µs of Python each time. Cython compiles these very files, unchanged, into extension
modules (``setup.py``): the same code with the interpreter's dispatch taken out, ~25 % less CPU per
decided trace (``bench/collector_stages.py``). The ``.py`` files stay the source and the reference.

An extension module would shadow its ``.py`` file whatever the file says now, so an edit to a compiled
module would not run until the next install. :func:`install` puts a finder first on ``sys.meta_path``
that runs the source instead whenever it differs from what was compiled (each build records its
sources' SHA-256 in :data:`RECORD`) or ``KVTRACE_PURE_PYTHON`` is set, and :func:`status` says which
ran (the collector logs it at start).

This module is imported by ``setup.py`` from its path, before anything is installed: stdlib only.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

PACKAGE = "kvtrace.collectors"
MODULES = ("attribution", "clocks", "explain", "breakdown")
"""Compiled where possible: the per-trace work (see the module's docstring). Only these, because the
rest of a span's CPU is DuckDB's and the native decoder's, and each module compiled is one more to keep
free of what Cython reads differently (it compiles with ``annotation_typing=False``: annotations are
not enforced, so the compiled code accepts exactly what the Python code does)."""
RECORD = "_compiled.json"
"""Written beside the extensions by each build: ``{module: SHA-256 of the .py it was compiled from}``."""
PURE_ENV = "KVTRACE_PURE_PYTHON"
"""Set (non-empty): every compiled module runs as Python, as do the native decoder's halves (:mod:`.wire`)."""

_ran: dict[str, str] = {}  # module -> "compiled", or why it runs as Python


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _CompiledWhileCurrent(importlib.abc.MetaPathFinder):
    """For :data:`MODULES` only: the compiled module while its source is the one it was built from,
    the source otherwise."""

    def __init__(self) -> None:
        self._recorded: dict[str, dict[str, str]] = {}  # folder -> its build's record

    def find_spec(self, fullname, path, target=None):
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        source = Path(spec.origin).with_name(f"{name}.py")
        why = self._why_python(name, spec, source)
        _ran[name] = why or "compiled"
        if why and source != Path(spec.origin):
            return importlib.util.spec_from_file_location(fullname, source)
        return spec

    def _why_python(self, name: str, spec, source: Path) -> str:
        """Why the module is to run from its source ("": it runs compiled)."""
        if not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return "not compiled (no C compiler or no Cython at install)"
        if not source.is_file():
            return ""  # shipped without its source: the extension is all there is
        if os.environ.get(PURE_ENV):
            return f"{PURE_ENV} is set"
        compiled_from = self._record(source.parent).get(name)
        if compiled_from is None:
            return f"no {RECORD} beside it says what it was compiled from (reinstall)"
        if compiled_from != source_digest(source):
            return f"{source} changed since it was compiled (reinstall to compile it again)"
        return ""

    def _record(self, folder: Path) -> dict[str, str]:
        key = str(folder)
        if key not in self._recorded:
            try:
                self._recorded[key] = json.loads((folder / RECORD).read_text())
            except (OSError, ValueError):
                self._recorded[key] = {}
        return self._recorded[key]


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _CompiledWhileCurrent) for f in sys.meta_path):
        sys.meta_path.insert(0, _CompiledWhileCurrent())


def status() -> dict[str, str]:
    """Each of :data:`MODULES` imported so far: ``"compiled"``, or why it runs as Python."""
    return dict(_ran)


def running_as_python() -> dict[str, str]:
    """Those of :data:`MODULES` imported so far that run as Python, each with why."""
    return {name: why for name, why in _ran.items() if why != "compiled"}
