"""Versions of the packages kvtrace works with, as installed (for resources and `kvtrace version`)."""

from __future__ import annotations

from importlib import metadata


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed, else ``None``."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
