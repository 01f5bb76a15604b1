"""A delegating proxy in place of vLLM's NIXL agent (``worker.nixl_wrapper``): every NIXL call goes
through it unchanged, and kvtrace notes what it needs on the way (a transfer prepared, posted, its
state and NIXL's own telemetry, released; notifications arriving) — no vLLM logic is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .worker_tracing import WorkerTracing


class TracedNixlAgent:
    """Delegates every call to vLLM's NIXL agent, noting what kvtrace needs on the way.

    Called from the worker's main thread, the push writer and the handshake thread; each
    hook touches only dicts keyed by handle or request (atomic under the GIL).
    """

    def __init__(self, agent: Any, tracing: "WorkerTracing") -> None:
        self._agent = agent
        self._tracing = tracing
        self._guard = tracing._guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def make_prepped_xfer(self, operation, *args, **kwargs):
        handle = self._agent.make_prepped_xfer(operation, *args, **kwargs)
        notif = kwargs.get("notif_msg", args[4] if len(args) > 4 else b"")
        self._guard.run(self._tracing.on_prepped, handle, operation, notif)
        return handle

    def transfer(self, handle, *args, **kwargs):
        # The span starts when the request is handed to NIXL.
        self._guard.run(self._tracing.on_posted, handle)
        return self._agent.transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle):
        state = self._agent.check_xfer_state(handle)
        self._guard.run(self._tracing.on_state, handle, state)
        return state

    def get_xfer_telemetry(self, handle):
        telemetry = self._agent.get_xfer_telemetry(handle)
        self._guard.run(self._tracing.on_telemetry, handle, telemetry)
        return telemetry

    def release_xfer_handle(self, handle, *args, **kwargs):
        result = self._agent.release_xfer_handle(handle, *args, **kwargs)
        self._guard.run(self._tracing.on_released, handle)
        return result

    def get_new_notifs(self, *args, **kwargs):
        notifs = self._agent.get_new_notifs(*args, **kwargs)
        if notifs:
            self._guard.run(self._tracing.on_notifications, notifs)
        return notifs
