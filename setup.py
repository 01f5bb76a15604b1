"""The native parts of the build; everything else is in pyproject.toml.

- ``kvtrace.collectors._otlp``: the OTLP decoder, in C (collectors/_otlp.c); in Python it decodes ~7x slower.
- The collector's per-trace modules (:data:`collectors.compiled.MODULES`), compiled from their own
  ``.py`` files by Cython, with each source's SHA-256 recorded beside them (collectors/compiled.py says
  why, and how an edited source runs as Python until the next build).

Both are optional: without a C compiler the install still works and runs them as Python (the
collector says so at start).
"""

import importlib.util
import json
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kvtrace_compiled", HERE / "collectors" / "compiled.py")
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)

FLAGS = ["-O2", "-Wall", "-Wno-missing-field-initializers"]


def cython_extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:  # a build without its build requirements (pyproject.toml lists Cython)
        return []
    modules = [Extension(f"{compiled.PACKAGE}.{name}", [f"collectors/{name}.py"], optional=True,
                         extra_compile_args=["-O2"]) for name in compiled.MODULES]
    # annotation_typing=False: annotations are documentation here, not C types to enforce.
    return cythonize(modules, build_dir="build/cython", quiet=True,
                     compiler_directives={"language_level": 3, "annotation_typing": False})


class RecordingBuildExt(build_ext):
    """build_ext that writes, beside the compiled modules, the SHA-256 of each source it compiled."""

    def run(self) -> None:
        super().run()
        built: dict[Path, dict[str, str]] = {}
        for ext in self.extensions:
            package, _, name = ext.name.rpartition(".")
            target = Path(self.get_ext_fullpath(ext.name))
            if package == compiled.PACKAGE and name in compiled.MODULES and target.exists():
                built.setdefault(target.parent, {})[name] = compiled.source_digest(HERE / "collectors" / f"{name}.py")
        for folder, digests in built.items():
            (folder / compiled.RECORD).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")

    def get_outputs(self) -> list[str]:  # the record is installed with the extensions
        outputs = super().get_outputs()
        folders = {str(Path(o).parent) for o in outputs if Path(o).name.split(".")[0] in compiled.MODULES}
        return outputs + [str(Path(f) / compiled.RECORD) for f in sorted(folders)]


setup(
    ext_modules=[Extension("kvtrace.collectors._otlp", ["collectors/_otlp.c"], optional=True,
                           extra_compile_args=FLAGS), *cython_extensions()],
    cmdclass={"build_ext": RecordingBuildExt},
)
