"""Which vLLM releases the traced connectors are tested against, and what happens outside them.

The connectors hook vLLM's NIXL classes (VLLM_HOOKS in the design notes); each release can move
a hooked method. ``tests/connector`` runs against every version in :data:`TESTED_VLLM` (``make
test`` builds one environment per release); elsewhere the hooks may still fit, so kvtrace warns
rather than refuses — a hook that is actually gone fails loudly at start-up on its own.
"""

from __future__ import annotations

import logging

from packaging.version import Version

logger = logging.getLogger(__name__)

# Lowest tested release, first untested one. Keep pyproject's `gpu` extra in step.
TESTED_VLLM = ("0.32", "0.34")


def _release(version: str) -> tuple[int, ...]:
    """``"0.33.0+cu129"`` → ``(0, 33, 0)``; a dev or rc build counts as its release."""
    return Version(version).release


def is_tested(version: str) -> bool:
    low, high = (_release(v) for v in TESTED_VLLM)
    return low <= _release(version) < high


def tested_range() -> str:
    return f">={TESTED_VLLM[0]},<{TESTED_VLLM[1]}"


_checked = False


def check_vllm_version(version: str | None = None) -> bool:
    """Log the vLLM version found (once per process); warn, naming the tested range, outside it."""
    global _checked
    if version is None:
        import vllm

        version = vllm.__version__
    tested = is_tested(version)
    if not _checked:
        _checked = True
        if tested:
            logger.info("kvtrace: vLLM %s (tested range %s)", version, tested_range())
        else:
            logger.warning("kvtrace: vLLM %s is outside the tested range %s: the traced connectors "
                           "may miss a hook or time a moved method; run tests/connector against it",
                           version, tested_range())
    return tested
