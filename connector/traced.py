"""The traced facades: vLLM's NIXL push and pull connectors, plus per-request timing.

Each override calls vLLM's method unchanged and times around it; kvtrace's own work goes
through a :class:`~.guard.Guard`, so it can neither raise into vLLM nor alter its result.
With telemetry disabled (``kvtrace.enabled: false`` or ``OTEL_SDK_DISABLED=true``) no
tracing object exists and each override is one attribute check away from vLLM's method.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector as VllmNixlPullConnector,
    NixlPushConnector as VllmNixlPushConnector,
)

from kvtrace.telemetry import Mode, Role, configure, sampler, semconv
from kvtrace.telemetry.metrics import FanOut, PendingStats, multiprocess_mode, process_metrics

from .compat import check_vllm_version
from .stats import KvtraceConnectorStats, KvtracePromMetrics
from .guard import Guard
from .options import load_block
from .scheduler_tracing import SchedulerTracing
from .tuning import worker_construction
from .worker_tracing import WorkerTracing

logger = logging.getLogger(__name__)

_now = time.perf_counter_ns


_pending: PendingStats | None = None  # this process's kvtrace observations, until vLLM collects them


def connector_metrics(config: Any, mode: str, role: str) -> Any:
    """The recorder's metrics sink inside vLLM: observations wait in :class:`PendingStats` until
    vLLM collects the connector's stats (to its /metrics); ``metrics_port`` adds this process's
    own endpoint (outside vLLM's multiprocess mode)."""
    global _pending
    if _pending is None:
        _pending = PendingStats(mode, role)
    if config.metrics_port is not None and not multiprocess_mode():
        return FanOut(_pending, process_metrics(mode, role, config.metrics_port))
    return _pending


def _role(kv_role: str | None) -> Role:
    return Role.CONSUMER if kv_role == "kv_consumer" else Role.PRODUCER


class _Traced:
    """Overrides shared by the push and pull facades (mixed in before vLLM's class)."""

    _kvtrace_mode: Mode
    _kvtrace_scheduler: SchedulerTracing | None = None
    _kvtrace_worker: WorkerTracing | None = None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm_version()
        kv_config = vllm_config.kv_transfer_config
        telemetry_config, options = load_block(kv_config.kv_connector_extra_config)
        tuning = worker_construction(options) if role == KVConnectorRole.WORKER else contextlib.nullcontext()
        with tuning:
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]

        name = type(self).__name__
        self.kvtrace_guard = Guard()
        if not telemetry_config.enabled:
            logger.info("kvtrace: telemetry disabled; %s runs untraced", name)
            return
        engine_role = _role(kv_config.kv_role)
        resource = options.resource_attributes()
        if self.connector_worker is not None:  # each TP rank is a process of its own (rank 0 may share the core's)
            resource[semconv.RES_TP_RANK] = getattr(self.connector_worker, "tp_rank", 0)
        recorder = configure(telemetry_config, engine_role, self._kvtrace_mode,
                             engine_id=self.engine_id, extra_resource=resource,
                             metrics=connector_metrics(telemetry_config, self._kvtrace_mode.value, engine_role.value))
        if self.connector_scheduler is not None:
            trace_key = (telemetry_config.hash_key or "").encode() if telemetry_config.hash_request_ids else b""
            self._kvtrace_scheduler = SchedulerTracing(
                recorder, sampler(telemetry_config), engine_role, self.engine_id, trace_key=trace_key)
        if self.connector_worker is not None:
            self._kvtrace_worker = WorkerTracing(recorder, self._kvtrace_mode.value, self.engine_id,
                                                 self.kvtrace_guard)
            self._kvtrace_worker.install(self.connector_worker)
        self._kvtrace_recorder = recorder
        self._kvtrace_worker_loop_ns = 0
        if not getattr(vllm_config, "shutdown_timeout", 1):
            logger.warning("kvtrace: vLLM's --shutdown-timeout is 0, so a stopping engine core is killed before it "
                           "exits and flushes: the spans of the last ~%d ms are lost; set "
                           "--shutdown-timeout 5 to keep them", telemetry_config.schedule_delay_ms)
        logger.info("kvtrace: traced %s active (%s, %s, engine %s, spans to %s)", name,
                    role.name.lower(), engine_role.value, self.engine_id,
                    telemetry_config.endpoint or telemetry_config.exporter)

    # ------------------------------------------------------------------ metrics (vLLM's stats seam)

    def get_kv_connector_stats(self):
        # Always kvtrace's stats class, never NIXL's own: vLLM aggregates the scheduler's stats
        # into the workers' (and workers' into each other's), and NIXL's aggregate() fails on a
        # key it does not know — so every object on this path must be one that accepts any key.
        base = super().get_kv_connector_stats()  # type: ignore[misc]
        pending = _pending.drain() if _pending is not None else None
        if base is None and (pending is None or not any(pending.values())):
            return None
        stats = KvtraceConnectorStats()
        if base is not None:
            stats.aggregate(base)
        return stats.add_pending(pending or {})

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return KvtraceConnectorStats(data=data) if data is not None else KvtraceConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvtracePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Any) -> None:
        kv = self._kvtrace_scheduler
        if kv is None:
            return super().on_new_request(request)  # type: ignore[misc]
        t0 = _now()
        self.kvtrace_guard.run(kv.on_new_request, request)
        result = super().on_new_request(request)  # type: ignore[misc]
        self.kvtrace_guard.run(kv.add_loop_time, _now() - t0, request.request_id)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        kv = self._kvtrace_scheduler
        if kv is None:
            return super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]
        t0 = _now()
        first_remote = self.kvtrace_guard.run(kv.before_alloc, request, num_external_tokens)
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]
        pending = getattr(self.connector_scheduler, "_push_pending_registrations", None)
        self.kvtrace_guard.run(kv.after_alloc, request, blocks, num_external_tokens, bool(first_remote), pending)
        self.kvtrace_guard.run(kv.add_loop_time, _now() - t0, request.request_id)
        return result

    def build_connector_meta(self, scheduler_output: Any):
        kv = self._kvtrace_scheduler
        if kv is None:
            return super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        t0 = _now()
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        self.kvtrace_guard.run(kv.attach_traces, meta)
        self.kvtrace_guard.run(kv.add_loop_time, _now() - t0)
        self.kvtrace_guard.run(kv.on_schedule, scheduler_output)
        return meta

    def update_connector_output(self, connector_output: Any):
        kv = self._kvtrace_scheduler
        if kv is None:
            return super().update_connector_output(connector_output)  # type: ignore[misc]
        t0 = _now()
        result = super().update_connector_output(connector_output)  # type: ignore[misc]
        self.kvtrace_guard.run(kv.on_connector_output, connector_output)
        self.kvtrace_guard.run(kv.add_loop_time, _now() - t0)
        return result

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        result = super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]
        if self._kvtrace_scheduler is not None:
            self.kvtrace_guard.run(self._kvtrace_scheduler.on_finished, request, result[1])
        return result

    def request_finished(self, request: Any, block_ids: Any):
        result = super().request_finished(request, block_ids)  # type: ignore[misc]
        if self._kvtrace_scheduler is not None:
            self.kvtrace_guard.run(self._kvtrace_scheduler.on_finished, request, result[1])
        return result

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        kv = self._kvtrace_worker
        if kv is None:
            return super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        t0 = _now()
        self.kvtrace_guard.run(kv.on_metadata, self._connector_metadata)  # type: ignore[attr-defined]
        result = super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        self._kvtrace_worker_loop_ns += _now() - t0
        return result

    def get_transfer_results(self, finished_req_ids: set[str]):
        kv = self._kvtrace_worker
        if kv is None:
            return super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        t0 = _now()
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        self.kvtrace_guard.run(kv.on_transfer_results, results)
        self._kvtrace_worker_loop_ns += _now() - t0
        return results

    def build_connector_worker_meta(self):
        kv = self._kvtrace_worker
        if kv is None:
            return super().build_connector_worker_meta()  # type: ignore[misc]
        self._kvtrace_recorder.record_engine_loop(self._kvtrace_worker_loop_ns, "worker")
        self._kvtrace_worker_loop_ns = 0
        return self.kvtrace_guard.run(kv.take_report)


class NixlPullConnector(_Traced, VllmNixlPullConnector):
    """vLLM's pull (READ) connector, traced. Load with ``kv_connector_module_path="kvtrace.connector"``."""

    _kvtrace_mode = Mode.PULL


class NixlPushConnector(_Traced, VllmNixlPushConnector):
    """vLLM's push (WRITE) connector, traced."""

    _kvtrace_mode = Mode.PUSH

    def build_connector_meta(self, scheduler_output: Any):
        kv = self._kvtrace_scheduler
        deadlines = getattr(self.connector_scheduler, "_push_registration_deadlines", None)
        if kv is None or deadlines is None:
            return super().build_connector_meta(scheduler_output)
        # vLLM's watchdog drops registrations past their deadline inside this call.
        now = time.perf_counter()
        due = [rid for rid, deadline in deadlines.items() if deadline <= now]
        meta = super().build_connector_meta(scheduler_output)
        timed_out = [rid for rid in due if rid not in deadlines]
        if timed_out:
            self.kvtrace_guard.run(kv.on_registration_timeout, timed_out)
        return meta


NixlConnector = NixlPullConnector
"""vLLM's backward-compatible name for the pull connector."""

TracedNixlPullConnector = NixlPullConnector
TracedNixlPushConnector = NixlPushConnector
TracedNixlConnector = NixlConnector
