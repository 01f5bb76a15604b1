"""What kvtrace adds to the messages vLLM already exchanges, so one trace spans P and D.

No vLLM code is changed; each carrier is a field vLLM passes on without reading:

* ``kv_transfer_params[semconv.PARAM_TRACEPARENT]`` (the contract owns the key) — router → P and D engines, and P's returned
  params → router → D (pull). A W3C ``traceparent`` string.
* ``registration[REG_KEY]`` — D → P inside the push registration (PUSH_REG), which vLLM
  msgpack-encodes whole: ``{"traceparent": str, "allocated_ns": int}``.
* ``NixlConnectorMetadata.kvtrace_traces`` — scheduler → workers of one instance:
  ``{request id: traceparent}`` for requests the workers have not seen yet.
* :class:`WorkerReport` — workers → scheduler, as the step's ``kv_connector_worker_meta``:
  when each transfer finished on the worker, per-request engine-loop time, expired leases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

REG_KEY = "kvtrace"
META_TRACES = "kvtrace_traces"

base_request_id = get_base_request_id
"""P and D share the router's X-Request-Id, so their ids agree once vLLM's suffix is gone."""


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """One step's worker-side timings, for the scheduler-side spans (plain data: pickled)."""

    ready_ns: dict[str, int] = field(default_factory=dict)
    """Request id → when its KV transfer finished as seen by the worker (monotonic ns)."""
    loop_ns: dict[str, int] = field(default_factory=dict)
    """Request id → worker engine-loop time spent on it (pull descriptor prep)."""
    expired: set[str] = field(default_factory=set)
    """Request ids whose send lease expired on this worker."""
    prepped_ns: dict[str, int] = field(default_factory=dict)
    """Request id → when the worker began preparing its READ (pull; monotonic ns): ends ``kv.read_wait``."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "WorkerReport":
        """Merge TP ranks: a request is ready when its last rank is."""
        if not isinstance(other, WorkerReport):
            return self
        for request_id, ns in other.ready_ns.items():
            self.ready_ns[request_id] = max(ns, self.ready_ns.get(request_id, ns))
        for request_id, ns in other.loop_ns.items():
            self.loop_ns[request_id] = self.loop_ns.get(request_id, 0) + ns
        self.expired |= other.expired
        for request_id, ns in other.prepped_ns.items():  # waited until its last rank began
            self.prepped_ns[request_id] = max(ns, self.prepped_ns.get(request_id, ns))
        return self

    def __bool__(self) -> bool:
        return bool(self.ready_ns or self.loop_ns or self.expired or self.prepped_ns)
