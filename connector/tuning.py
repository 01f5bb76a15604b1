"""The two engine settings vLLM cannot reach: NIXL's progress-thread delay and CPU affinity.

Both apply only while the worker is being constructed (see :mod:`.options` for why they
exist). The progress delay is set on the agent config at the one place NIXL builds its
agent, for the duration of that call, under a lock; if NIXL's module layout is not what
this was written against, start-up says so in one line and the agent keeps NIXL's default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

from .options import ConnectorOptions

logger = logging.getLogger(__name__)

_agent_lock = threading.Lock()


def _nixl_bindings():
    """The pybind module whose ``nixlAgent`` NIXL's ``nixl_agent.__init__`` calls."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    agent_cls = base_worker.NixlWrapper
    api = sys.modules.get(getattr(agent_cls, "__module__", ""), None)
    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgent"):
        return None
    return bindings


@contextlib.contextmanager
def nixl_progress_delay(delay_us: int | None) -> Iterator[None]:
    """While active, NIXL agents are created with ``pthrDelay = delay_us``."""
    if delay_us is None:
        yield
        return
    bindings = _nixl_bindings()
    if bindings is None:
        logger.error("kvtrace: nixl_progress_delay_us ignored: NIXL's nixl_agent/nixlBind.nixlAgent "
                     "not found (NIXL version mismatch); the progress thread keeps a zero delay")
        yield
        return
    with _agent_lock:
        create_agent = bindings.nixlAgent

        def create_with_delay(name, config):
            config.pthrDelay = delay_us
            logger.info("kvtrace: NIXL agent %s progress-thread delay %d us", name, delay_us)
            return create_agent(name, config)

        bindings.nixlAgent = create_with_delay
        try:
            yield
        finally:
            bindings.nixlAgent = create_agent


@contextlib.contextmanager
def keep_affinity(enabled: bool) -> Iterator[None]:
    """Restore the process's CPU affinity after the block if it changed inside."""
    if not enabled or not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            logger.info("kvtrace: kept CPU affinity %s (vLLM's NIXL worker had set %s)",
                        sorted(before), sorted(after))


@contextlib.contextmanager
def worker_construction(options: ConnectorOptions) -> Iterator[None]:
    with keep_affinity(options.keep_cpu_affinity), nixl_progress_delay(options.nixl_progress_delay_us):
        yield
