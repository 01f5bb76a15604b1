"""This repository at a git revision, or its working tree, copied for a side-by-side bench
(dashboard_ab.py, collector_ab.py)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def copy_at(revision: str | None, paths: tuple[str, ...], into: Path, skip: tuple[str, ...] = ("__pycache__",)) -> None:
    """``paths`` (folders or files of the repository) at ``revision`` under ``into``; None: the working tree as
    it is, uncommitted changes included, without what matches ``skip`` (build outputs a copy must not reuse)."""
    into.mkdir(parents=True, exist_ok=True)
    if revision is None:
        for name in paths:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, into / name, ignore=shutil.ignore_patterns(*skip))
            else:
                shutil.copy2(source, into / name)
        return
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, *paths],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def is_commit(revision: str) -> bool:
    """Whether ``revision`` names a commit of this repository."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                          capture_output=True).returncode == 0
