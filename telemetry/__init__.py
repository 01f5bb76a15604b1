"""kvtrace.telemetry: the span contract, the hot-path recorder, OTLP export and Prometheus.

Typical use inside an engine process::

    from kvtrace.telemetry import TelemetryConfig, configure, Role, Mode, Stage

    recorder = configure(TelemetryConfig.load(block), Role.PRODUCER, Mode.PUSH, engine_id=eid)
    t0 = recorder.now()
    ...                                   # the work being timed
    recorder.record(ref, Stage.WRITE, t0, recorder.now(), {ATTR_TRANSFER_BYTES: n})
"""

from .config import ConfigError, TelemetryConfig
from .context import Sampler, TraceRef, format_traceparent, new_span_id, new_trace_id, parse_traceparent
from .recorder import NoOpRecorder, Recorder, RecorderStats
from .semconv import STAGE_ORDER, STAGES, Category, FailureCause, Mode, Role, Stage
from .setup import build_exporter, build_resource, configure, get_recorder, sampler

__all__ = [
    "Category", "ConfigError", "FailureCause", "Mode", "NoOpRecorder", "Recorder", "RecorderStats",
    "Role", "STAGES", "STAGE_ORDER", "Sampler", "Stage", "TelemetryConfig", "TraceRef",
    "build_exporter", "build_resource", "configure", "format_traceparent", "get_recorder",
    "new_span_id", "new_trace_id", "parse_traceparent", "sampler",
]
