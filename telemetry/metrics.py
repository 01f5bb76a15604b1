"""Prometheus metrics of the KV handoff and of kvtrace itself.

Observed on the recorder's background thread, never on the engine loop.

Multiprocess: vLLM's API server sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the
engine processes, so inside vLLM these metrics are written to that directory and appear
on vLLM's own ``/metrics`` endpoint next to ``vllm:*`` (prometheus-client's multiprocess
mode drops exemplars). Outside that mode, ``metrics_port`` serves this process's
registry on 127.0.0.1 in OpenMetrics format, exemplars (the trace id) included.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Final

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server

logger = logging.getLogger(__name__)

STAGE_DURATION: Final = "kvtrace_stage_duration_seconds"
ENGINE_LOOP: Final = "kvtrace_engine_loop_seconds"
TRANSFER_BYTES: Final = "kvtrace_transfer_bytes_total"
TRANSFER_FAILURES: Final = "kvtrace_transfer_failures_total"
DROPPED_RECORDS: Final = "kvtrace_dropped_records_total"
EXPORT_FAILURES: Final = "kvtrace_export_failures_total"

# From 50 µs (a descriptor prep on a small request) to 30 s (a stuck rendezvous).
STAGE_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
# Per engine step: connector calls should stay in the µs range; ms is already costly.
LOOP_BUCKETS: Final = (
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025,
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
)


def multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class KvtraceMetrics:
    """The metric families, bound to one (mode, role) pair so callers pass only what varies."""

    def __init__(self, mode: str, role: str, registry: CollectorRegistry | None = REGISTRY) -> None:
        made = families(functools.partial(Histogram, registry=registry), functools.partial(Counter, registry=registry), [])
        self._stage, self._loop = made["kvtrace_stage"], made["kvtrace_engine_loop"]
        self._bytes, self._failures = made["kvtrace_transfer_bytes"], made["kvtrace_failures"]
        self._dropped, self._export_failures = made["kvtrace_dropped"], made["kvtrace_export_failures"]
        self._mode, self._role = mode, role
        self._exemplars = not multiprocess_mode()
        self._loop_children: dict[str, Any] = {}

    def observe_stage(self, stage: str, seconds: float, trace_id: int | None) -> None:
        exemplar = {"trace_id": f"{trace_id:032x}"} if trace_id and self._exemplars else None
        self._stage.labels(stage, self._mode, self._role).observe(seconds, exemplar)

    def observe_engine_loop(self, seconds: float, part: str) -> None:
        child = self._loop_children.get(part)
        if child is None:  # labels() costs a lookup per call: keep the child, it is per step
            child = self._loop_children[part] = self._loop.labels(part, self._mode, self._role)
        child.observe(seconds)

    def add_transfer_bytes(self, op: str, n: int) -> None:
        self._bytes.labels(op, self._mode, self._role).inc(n)

    def add_failure(self, cause: str) -> None:
        self._failures.labels(cause, self._mode, self._role).inc()

    def add_dropped(self, n: int) -> None:
        self._dropped.labels(self._mode, self._role).inc(n)

    def add_export_failure(self) -> None:
        self._export_failures.labels(self._mode, self._role).inc()


class NoOpMetrics:
    """Stands in when metrics are off, so the recorder never branches per record."""

    def observe_stage(self, stage: str, seconds: float, trace_id: int | None) -> None: ...
    def observe_engine_loop(self, seconds: float, part: str) -> None: ...
    def add_transfer_bytes(self, op: str, n: int) -> None: ...
    def add_failure(self, cause: str) -> None: ...
    def add_dropped(self, n: int) -> None: ...
    def add_export_failure(self) -> None: ...


_process_metrics: KvtraceMetrics | None = None


def process_metrics(mode: str, role: str, port: int | None = None) -> KvtraceMetrics:
    """The one metrics object of this process (families can be registered once per registry)."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = KvtraceMetrics(mode, role)
        if port is not None and not multiprocess_mode():
            start_http_server(port, addr="127.0.0.1")
            logger.info("kvtrace metrics on http://127.0.0.1:%d/metrics", port)
    return _process_metrics


class PendingStats:
    """The same observations as :class:`KvtraceMetrics`, kept as plain lists until drained.

    Inside vLLM this is the metrics sink: the traced connector drains it into its
    ``KVConnectorStats`` each engine step (vLLM's own seam, which carries the stats to the API
    server and its ``/metrics``, as it does for NIXL's). Each entry carries its labels, so lists
    from several workers or engines simply concatenate. Filled on the exporter thread, drained
    on the engine loop: one lock, held for an append or a swap.
    """

    KEYS: Final = ("kvtrace_stage", "kvtrace_engine_loop", "kvtrace_transfer_bytes", "kvtrace_failures",
                   "kvtrace_dropped", "kvtrace_export_failures")

    def __init__(self, mode: str, role: str) -> None:
        self._mode, self._role = mode, role
        self._lock = threading.Lock()
        self._data = self.empty()

    @classmethod
    def empty(cls) -> dict[str, list]:
        return {key: [] for key in cls.KEYS}

    LIMIT: Final = 65_536
    """Entries kept per key between drains: if nothing drains (vLLM's stats off), memory stays bounded."""

    def _add(self, key: str, entry: list) -> None:
        with self._lock:
            entries = self._data[key]
            if len(entries) < self.LIMIT:
                entries.append(entry)

    def observe_stage(self, stage: str, seconds: float, trace_id: int | None) -> None:
        self._add("kvtrace_stage", [stage, self._mode, self._role, seconds])

    def observe_engine_loop(self, seconds: float, part: str) -> None:
        self._add("kvtrace_engine_loop", [part, self._mode, self._role, seconds])

    def add_transfer_bytes(self, op: str, n: int) -> None:
        self._add("kvtrace_transfer_bytes", [op, self._mode, self._role, n])

    def add_failure(self, cause: str) -> None:
        self._add("kvtrace_failures", [cause, self._mode, self._role, 1])

    def add_dropped(self, n: int) -> None:
        self._add("kvtrace_dropped", [self._mode, self._role, n])

    def add_export_failure(self) -> None:
        self._add("kvtrace_export_failures", [self._mode, self._role, 1])

    def drain(self) -> dict[str, list]:
        with self._lock:
            data, self._data = self._data, self.empty()
        return data


class FanOut:
    """Several metrics sinks as one (vLLM's /metrics and a ``metrics_port`` of its own)."""

    def __init__(self, *sinks: Any) -> None:
        self._sinks = sinks

    def __getattr__(self, name: str) -> Any:
        methods = [getattr(sink, name) for sink in self._sinks]

        def call(*args: Any) -> None:
            for method in methods:
                method(*args)

        setattr(self, name, call)  # built once per method: later lookups find it on the instance
        return call


def families(histogram: Any, counter: Any, labelnames: list[str]) -> dict[str, Any]:
    """kvtrace's metric families built with the given classes and leading labels — vLLM's
    multiprocess-aware ones and its ``model_name``/``engine`` labels on the API server."""
    return {
        "kvtrace_stage": histogram(name=STAGE_DURATION, documentation="Duration of each KV-handoff stage, per request.",
                                   labelnames=[*labelnames, "stage", "mode", "role"], buckets=STAGE_BUCKETS),
        "kvtrace_engine_loop": histogram(
            name=ENGINE_LOOP, documentation="Time the connector spent on the engine loop, per engine step and part.",
            labelnames=[*labelnames, "part", "mode", "role"], buckets=LOOP_BUCKETS),
        "kvtrace_transfer_bytes": counter(name=TRANSFER_BYTES, documentation="Bytes moved by NIXL WRITE or READ.",
                                          labelnames=[*labelnames, "op", "mode", "role"]),
        "kvtrace_failures": counter(name=TRANSFER_FAILURES, documentation="KV-handoff failures by cause.",
                                    labelnames=[*labelnames, "cause", "mode", "role"]),
        "kvtrace_dropped": counter(name=DROPPED_RECORDS, labelnames=[*labelnames, "mode", "role"],
                                   documentation="Stage records kvtrace dropped because its buffer was full."),
        "kvtrace_export_failures": counter(name=EXPORT_FAILURES, labelnames=[*labelnames, "mode", "role"],
                                           documentation="Span export batches that failed (endpoint down, timeout)."),
    }


def observe_pending(metric_families: dict[str, Any], data: dict[str, list], leading: list) -> None:
    """Apply drained :class:`PendingStats` lists to :func:`families` (the API server's side)."""
    for key, family in metric_families.items():
        histogram = key in ("kvtrace_stage", "kvtrace_engine_loop")
        for *labels, value in data.get(key, ()):
            child = family.labels(*leading, *labels)
            child.observe(value) if histogram else child.inc(value)
