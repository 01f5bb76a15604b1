"""Options of the kvtrace connectors, read once from the ``kvtrace`` block of vLLM's
``kv_connector_extra_config`` (the telemetry keys in the same block belong to
:class:`kvtrace.telemetry.TelemetryConfig`).

Two of them reach NIXL and CPU settings that vLLM itself does not expose. Both are off by
default, so the connectors behave exactly like vLLM's unless asked:

``nixl_progress_delay_us``
    NIXL's Python API creates its agent with the progress thread's delay hard-coded to 0,
    a busy spin: about one core per worker, idle or not. A delay (1000 µs measured well on
    CPU hosts) lets the thread sleep between polls. The thread stays on: turning it off
    hangs push WRITEs.
``keep_cpu_affinity``
    On CPU, vLLM's NIXL worker re-pins the model thread to the last core of each NUMA node,
    so a prefill and a decode instance on one host end up on the same core. With this set,
    the connector restores the affinity the process had before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvtrace.telemetry.config import ConfigError, TelemetryConfig, parse_bool, parse_int

BLOCK_KEY = "kvtrace"


@dataclasses.dataclass(frozen=True)
class ConnectorOptions:
    nixl_progress_delay_us: int | None = None
    keep_cpu_affinity: bool = False

    @classmethod
    def load(cls, block: Mapping[str, Any]) -> "ConnectorOptions":
        values: dict[str, Any] = {}
        if block.get("nixl_progress_delay_us") is not None:
            values["nixl_progress_delay_us"] = parse_int(
                "kvtrace.nixl_progress_delay_us", block["nixl_progress_delay_us"], minimum=0,
                maximum=10_000_000)
        if block.get("keep_cpu_affinity") is not None:
            values["keep_cpu_affinity"] = parse_bool("kvtrace.keep_cpu_affinity",
                                                      block["keep_cpu_affinity"])
        return cls(**values)

    def resource_attributes(self) -> dict[str, Any]:
        """Visible in every span's resource, so a trace says how the engine was tuned."""
        return {
            "kvtrace.nixl.progress_delay_us": -1 if self.nixl_progress_delay_us is None
            else self.nixl_progress_delay_us,
            "kvtrace.cpu.keep_affinity": self.keep_cpu_affinity,
        }


CONNECTOR_KEYS = frozenset(f.name for f in dataclasses.fields(ConnectorOptions))


def load_block(extra_config: Mapping[str, Any] | None) -> tuple[TelemetryConfig, ConnectorOptions]:
    """Parse and validate the ``kvtrace`` block; a bad value raises ConfigError naming its key."""
    block = (extra_config or {}).get(BLOCK_KEY) or {}
    if not isinstance(block, Mapping):
        raise ConfigError("kv_connector_extra_config.kvtrace", f"expected an object, got {block!r}")
    return (TelemetryConfig.load(block, known_elsewhere=CONNECTOR_KEYS), ConnectorOptions.load(block))
