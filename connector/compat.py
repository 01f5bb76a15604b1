"""Which vLLM releases the traced connectors are tested against, and what happens outside them.

The connectors hook vLLM's NIXL classes (VLLM_HOOKS in the design notes); each release can move
a hooked method. ``tests/connector`` runs against every version in :data:`TESTED_VLLM` (``make
test`` builds one environment per release); elsewhere the hooks may still fit, so kvtrace warns
rather than refuses — a hook that is actually gone fails loudly at start-up on its own.
"""

from __future__ import annotations

import logging

from packaging.specifiers import SpecifierSet

logger = logging.getLogger(__name__)

# Keep pyproject's `gpu` extra in step (a test holds them equal). A dev or rc build counts as
# its release; a local tag (+cu129) is ignored.
TESTED_VLLM = SpecifierSet(">=0.32,<0.34", prereleases=True)


def is_tested(version: str) -> bool:
    return version in TESTED_VLLM


def tested_range() -> str:
    return str(TESTED_VLLM)


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
