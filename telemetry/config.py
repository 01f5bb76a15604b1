"""Telemetry configuration: standard OTEL_* environment variables plus a ``kvtrace`` block.

Precedence, highest first: the ``kvtrace`` block of vLLM's ``kv_connector_extra_config``
(or keyword arguments), then the environment, then the defaults below. Every value is
checked once, at start-up; a bad one raises :class:`ConfigError` naming the key, so a
typo never turns into silently missing traces.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Mapping
from typing import Any, Final
from urllib.parse import unquote, urlparse

# --------------------------------------------------------------------------------------
# Environment variables read (OpenTelemetry's names; see the OTel SDK configuration spec)
# --------------------------------------------------------------------------------------

OTEL_SDK_DISABLED: Final = "OTEL_SDK_DISABLED"
"""``true`` turns all kvtrace telemetry off."""
OTEL_TRACES_EXPORTER: Final = "OTEL_TRACES_EXPORTER"
"""``otlp`` (default), ``console`` or ``none``."""
OTEL_EXPORTER_OTLP_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL; for http/protobuf, ``/v1/traces`` is appended."""
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""Full traces URL, used as is. vLLM's ``--otlp-traces-endpoint`` writes this one."""
OTEL_EXPORTER_OTLP_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
"""``grpc`` (default, as vLLM's own tracing assumes) or ``http/protobuf``."""
OTEL_EXPORTER_OTLP_HEADERS: Final = "OTEL_EXPORTER_OTLP_HEADERS"
OTEL_EXPORTER_OTLP_TRACES_HEADERS: Final = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
"""``key=value,key2=value2``, values URL-encoded."""
OTEL_EXPORTER_OTLP_TIMEOUT: Final = "OTEL_EXPORTER_OTLP_TIMEOUT"
OTEL_EXPORTER_OTLP_TRACES_TIMEOUT: Final = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
"""Export timeout in milliseconds (the specification's unit)."""
OTEL_SERVICE_NAME: Final = "OTEL_SERVICE_NAME"
OTEL_RESOURCE_ATTRIBUTES: Final = "OTEL_RESOURCE_ATTRIBUTES"
"""``key=value,...``, values URL-encoded."""
OTEL_TRACES_SAMPLER: Final = "OTEL_TRACES_SAMPLER"
OTEL_TRACES_SAMPLER_ARG: Final = "OTEL_TRACES_SAMPLER_ARG"
OTEL_BSP_MAX_QUEUE_SIZE: Final = "OTEL_BSP_MAX_QUEUE_SIZE"
OTEL_BSP_SCHEDULE_DELAY: Final = "OTEL_BSP_SCHEDULE_DELAY"
OTEL_BSP_MAX_EXPORT_BATCH_SIZE: Final = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
# kvtrace's own: request-id hashing must be switchable where no kvtrace block exists (the router)
KVTRACE_HASH_REQUEST_IDS: Final = "KVTRACE_HASH_REQUEST_IDS"
KVTRACE_HASH_KEY: Final = "KVTRACE_HASH_KEY"
KVTRACE_CLOCK_ENDPOINT: Final = "KVTRACE_CLOCK_ENDPOINT"
"""Where the clock exchange goes when spans reach the kvtrace collector through another OTLP collector
(which would answer it 404): the kvtrace collector's own URL. Default: the traces endpoint."""
KVTRACE_CLOCK_PROTOCOL: Final = "KVTRACE_CLOCK_PROTOCOL"
"""The clock endpoint's protocol (``grpc`` or ``http/protobuf``); default: the traces protocol."""

PROTOCOLS: Final = ("grpc", "http/protobuf")
EXPORTERS: Final = ("otlp", "console", "none")
SAMPLERS: Final = (
    "always_on", "always_off", "traceidratio",
    "parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio",
)

# Records are small tuples, so the queue can be far deeper than the SDK's 2048 spans.
DEFAULT_MAX_QUEUE_SIZE: Final = 65_536
DEFAULT_SCHEDULE_DELAY_MS: Final = 500
DEFAULT_MAX_EXPORT_BATCH_SIZE: Final = 512
DEFAULT_EXPORT_TIMEOUT_MS: Final = 10_000
DEFAULT_CLOCK_SYNC_INTERVAL_MS: Final = 2_000


class ConfigError(ValueError):
    """A configuration value kvtrace cannot use; ``key`` names where it came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"kvtrace config: {key}: {message}")
        self.key = key


@dataclasses.dataclass(frozen=True)
class TelemetryConfig:
    """Everything the recorder, exporter and metrics need, validated.

    Keys of the ``kvtrace`` block have the field names below.
    """

    enabled: bool = True
    exporter: str = "otlp"
    endpoint: str | None = None
    protocol: str = "grpc"
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    timeout_ms: int = DEFAULT_EXPORT_TIMEOUT_MS
    service_name: str | None = None
    resource_attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    schedule_delay_ms: int = DEFAULT_SCHEDULE_DELAY_MS
    max_export_batch_size: int = DEFAULT_MAX_EXPORT_BATCH_SIZE
    hash_request_ids: bool = False
    hash_key: str | None = dataclasses.field(default=None, repr=False)
    """The key of the request-id hash, shared by the router, P and D (KVTRACE_HASH_KEY)."""
    metrics_port: int | None = None
    clock_sync_interval_ms: int = DEFAULT_CLOCK_SYNC_INTERVAL_MS
    """How often the exporter thread measures this process's clock against the collector's (0: never)."""
    clock_endpoint: str | None = None
    """The kvtrace collector's URL for the clock exchange (:data:`KVTRACE_CLOCK_ENDPOINT`); None: the
    traces endpoint. Set it where an OpenTelemetry Collector sits between this process and kvtrace's."""
    clock_protocol: str | None = None
    """The clock endpoint's protocol; None: the traces protocol."""

    @property
    def clock_target(self) -> tuple[str | None, str]:
        """(URL, protocol) of the clock exchange."""
        return self.clock_endpoint or self.endpoint, self.clock_protocol or self.protocol

    @property
    def traces_enabled(self) -> bool:
        """Spans are exported (an OTLP endpoint is set, or the console exporter is chosen)."""
        if not self.enabled or self.exporter == "none":
            return False
        return self.exporter == "console" or self.endpoint is not None

    @classmethod
    def load(
        cls,
        block: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        known_elsewhere: Collection[str] = (),
    ) -> "TelemetryConfig":
        """Build from a ``kvtrace`` block (explicit, wins) and the environment.

        ``known_elsewhere`` lists block keys that another component (the connector) owns;
        any other unknown key is an error, so misspelt options fail loudly.
        """
        env = os.environ if environ is None else environ
        block = dict(block or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - fields - set(known_elsewhere))
        if unknown:
            raise ConfigError(f"kvtrace.{unknown[0]}", f"unknown option; known: {sorted(fields)}")

        def pick(field: str, *env_keys: str) -> tuple[str, Any] | None:
            if field in block and block[field] is not None:
                return f"kvtrace.{field}", block[field]
            for key in env_keys:
                if env.get(key, "").strip():
                    return key, env[key].strip()
            return None

        values: dict[str, Any] = {}

        disabled = pick("enabled")
        if disabled is not None:
            values["enabled"] = parse_bool(*disabled)
        elif env.get(OTEL_SDK_DISABLED, "").strip():
            values["enabled"] = not parse_bool(OTEL_SDK_DISABLED, env[OTEL_SDK_DISABLED])

        if (got := pick("exporter", OTEL_TRACES_EXPORTER)) is not None:
            values["exporter"] = parse_choice(*got, EXPORTERS)

        if (got := pick("protocol", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
                        OTEL_EXPORTER_OTLP_PROTOCOL)) is not None:
            values["protocol"] = parse_choice(*got, PROTOCOLS)
        protocol = values.get("protocol", cls.protocol)

        if (got := pick("endpoint", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)) is not None:
            values["endpoint"] = parse_endpoint(*got)
        elif (got := pick("_", OTEL_EXPORTER_OTLP_ENDPOINT)) is not None:
            base = parse_endpoint(*got)
            values["endpoint"] = base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"

        if (got := pick("headers", OTEL_EXPORTER_OTLP_TRACES_HEADERS,
                        OTEL_EXPORTER_OTLP_HEADERS)) is not None:
            values["headers"] = parse_pairs(*got)
        if (got := pick("timeout_ms", OTEL_EXPORTER_OTLP_TRACES_TIMEOUT,
                        OTEL_EXPORTER_OTLP_TIMEOUT)) is not None:
            values["timeout_ms"] = parse_int(*got, minimum=1)
        if (got := pick("service_name", OTEL_SERVICE_NAME)) is not None:
            values["service_name"] = parse_str(*got)
        if (got := pick("resource_attributes", OTEL_RESOURCE_ATTRIBUTES)) is not None:
            values["resource_attributes"] = parse_pairs(*got)

        if (got := pick("sampler", OTEL_TRACES_SAMPLER)) is not None:
            values["sampler"] = parse_choice(*got, SAMPLERS)
        if (got := pick("sampler_arg", OTEL_TRACES_SAMPLER_ARG)) is not None:
            values["sampler_arg"] = parse_ratio(*got)

        if (got := pick("max_queue_size", OTEL_BSP_MAX_QUEUE_SIZE)) is not None:
            values["max_queue_size"] = parse_int(*got, minimum=1)
        if (got := pick("schedule_delay_ms", OTEL_BSP_SCHEDULE_DELAY)) is not None:
            values["schedule_delay_ms"] = parse_int(*got, minimum=1)
        if (got := pick("max_export_batch_size", OTEL_BSP_MAX_EXPORT_BATCH_SIZE)) is not None:
            values["max_export_batch_size"] = parse_int(*got, minimum=1)
        if (got := pick("hash_request_ids", KVTRACE_HASH_REQUEST_IDS)) is not None:
            values["hash_request_ids"] = parse_bool(*got)
        if (got := pick("hash_key", KVTRACE_HASH_KEY)) is not None:
            values["hash_key"] = parse_str(*got)
        if (got := pick("metrics_port")) is not None:
            values["metrics_port"] = parse_int(*got, minimum=0, maximum=65535)
        if (got := pick("clock_sync_interval_ms")) is not None:
            values["clock_sync_interval_ms"] = parse_int(*got, minimum=0, maximum=3_600_000)
        if (got := pick("clock_endpoint", KVTRACE_CLOCK_ENDPOINT)) is not None:
            values["clock_endpoint"] = parse_endpoint(*got)
        if (got := pick("clock_protocol", KVTRACE_CLOCK_PROTOCOL)) is not None:
            values["clock_protocol"] = parse_choice(*got, PROTOCOLS)

        config = cls(**values)
        if config.hash_request_ids and not config.hash_key:
            raise ConfigError("hash_request_ids", f"needs a key shared by the router, P and D: set "
                              f"{KVTRACE_HASH_KEY} in each (or kvtrace.hash_key)")
        if config.max_export_batch_size > config.max_queue_size:
            raise ConfigError(
                "max_export_batch_size",
                f"{config.max_export_batch_size} exceeds max_queue_size {config.max_queue_size}",
            )
        return config


# --------------------------------------------------------------------------------------
# Parsers: each takes (key, raw value) and raises ConfigError naming the key.
# --------------------------------------------------------------------------------------


def parse_str(key: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(key, f"expected a non-empty string, got {raw!r}")
    return raw.strip()


def parse_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(key, f"expected true or false, got {raw!r}")


def parse_choice(key: str, raw: Any, choices: tuple[str, ...]) -> str:
    text = str(raw).strip().lower()
    if text not in choices:
        hint = " (the Python OTLP exporters have no JSON encoding)" if text == "http/json" else ""
        raise ConfigError(key, f"{raw!r} is not supported{hint}; use one of {list(choices)}")
    return text


def parse_int(key: str, raw: Any, *, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(str(raw).strip()) if not isinstance(raw, int) or isinstance(raw, bool) else raw
    except ValueError:
        raise ConfigError(key, f"expected an integer, got {raw!r}") from None
    if isinstance(raw, bool) or value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(key, f"expected an integer {bound}, got {raw!r}")
    return value


def parse_ratio(key: str, raw: Any) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected a number in [0, 1], got {raw!r}") from None
    if isinstance(raw, bool) or math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(key, f"sampling ratio must be in [0, 1], got {raw!r}")
    return value


def parse_endpoint(key: str, raw: Any) -> str:
    text = parse_str(key, raw)
    parsed = urlparse(text)
    try:
        port = parsed.port  # raises ValueError on a non-numeric or out-of-range port
    except ValueError:
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1:
        raise ConfigError(
            key, f"{text!r} is not a URL like http://127.0.0.1:4317 (scheme http or https, a host)"
        )
    return text


def parse_pairs(key: str, raw: Any) -> dict[str, str]:
    """``k=v,k2=v2`` (URL-encoded values, W3C baggage style) or an explicit mapping."""
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    pairs: dict[str, str] = {}
    for item in str(raw).split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(key, f"expected key=value pairs separated by commas, got {item!r}")
        pairs[unquote(name.strip())] = unquote(value.strip())
    return pairs
