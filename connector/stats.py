"""kvtrace's metrics on vLLM's own ``/metrics``, through vLLM's connector-stats seam.

vLLM ships each connector's ``KVConnectorStats`` from the workers and the scheduler to the API
server with the engine's stats, and there hands them to the connector class's
``build_prom_metrics`` object — how NIXL's ``vllm:nixl_*`` histograms reach ``/metrics``, with one
API server or several. kvtrace rides along: its observations (made on the recorder's exporter
thread into a :class:`~kvtrace.telemetry.metrics.PendingStats`) are drained into the same stats
object beside NIXL's lists, and observed into ``kvtrace_*`` families built with vLLM's own
(multiprocess-aware) metric classes and its ``model_name``/``engine`` labels.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

from kvtrace.telemetry.metrics import PendingStats, families, observe_pending


class KvtraceConnectorStats(NixlKVConnectorStats):
    """NIXL's transfer stats plus kvtrace's pending observations (lists that concatenate)."""

    def reset(self) -> None:
        super().reset()
        self.data.update(PendingStats.empty())

    def _kvtrace_entries(self) -> int:
        return sum(len(self.data.get(key, ())) for key in PendingStats.KEYS)

    def is_empty(self) -> bool:
        return super().is_empty() and self._kvtrace_entries() == 0

    def aggregate(self, other: Any) -> Any:
        # other may be NIXL's own stats (a worker of another class) or ours
        return self if other.is_empty() else self.add_pending(other.data)

    def reduce(self) -> dict[str, int | float]:
        summary = super().reduce()
        summary["kvtrace stage records"] = len(self.data.get("kvtrace_stage", ()))
        return summary

    def add_pending(self, pending: dict[str, list]) -> "KvtraceConnectorStats":
        """Concatenate lists by key (any key: NIXL's, kvtrace's, or another release's)."""
        for key, values in pending.items():
            self.data.setdefault(key, []).extend(values)
        return self


class KvtracePromMetrics(NixlPromMetrics):
    """NIXL's metrics as vLLM builds them, plus kvtrace's families."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._kvtrace = families(metric_types[Histogram], metric_types[Counter], labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        observe_pending(self._kvtrace, transfer_stats_data, self.per_engine_labelvalues[engine_idx])
