"""Configuration: OTEL_* variables, the kvtrace block's precedence, and one named error per bad value."""

import pytest

from kvtrace.telemetry.config import ConfigError, TelemetryConfig


def load(block=None, **env):
    return TelemetryConfig.load(block, env)


def test_defaults_record_nothing_to_export():
    config = load()
    assert config.enabled and not config.traces_enabled
    assert config.protocol == "grpc" and config.sampler == "parentbased_always_on"


def test_grpc_endpoint_is_used_as_is_and_http_gets_the_signal_path():
    assert load(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317").endpoint == "http://127.0.0.1:4317"
    http = load(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318/",
                OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    assert http.endpoint == "http://127.0.0.1:4318/v1/traces" and http.traces_enabled
    signal = load(OTEL_EXPORTER_OTLP_ENDPOINT="http://a:1", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://b:2/x",
                  OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    assert signal.endpoint == "http://b:2/x"


def test_env_is_read():
    config = load(
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="https://apm.example:443",
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_HEADERS="api-key=s%20ecret,x-team=kv",
        OTEL_EXPORTER_OTLP_TIMEOUT="2500",
        OTEL_SERVICE_NAME="prefill-a",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=prod,k8s.pod.name=p-0",
        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0.25",
        OTEL_BSP_MAX_QUEUE_SIZE="4096",
    )
    assert config.headers == {"api-key": "s ecret", "x-team": "kv"}
    assert config.timeout_ms == 2500 and config.service_name == "prefill-a"
    assert config.resource_attributes == {"deployment.environment": "prod", "k8s.pod.name": "p-0"}
    assert (config.sampler, config.sampler_arg) == ("parentbased_traceidratio", 0.25)
    assert config.max_queue_size == 4096


def test_kvtrace_block_wins_over_env():
    config = load(
        {"endpoint": "http://127.0.0.1:9999", "protocol": "http/protobuf", "sampler_arg": 0.5,
         "headers": {"a": "b"}, "service_name": "mine"},
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:4317", OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_TRACES_SAMPLER_ARG="0.1", OTEL_EXPORTER_OTLP_HEADERS="c=d", OTEL_SERVICE_NAME="env",
    )
    assert config.endpoint == "http://127.0.0.1:9999" and config.protocol == "http/protobuf"
    assert config.sampler_arg == 0.5 and config.headers == {"a": "b"} and config.service_name == "mine"


def test_disabling():
    assert not load(OTEL_SDK_DISABLED="true", OTEL_EXPORTER_OTLP_ENDPOINT="http://x:1").traces_enabled
    assert not load({"enabled": False}, OTEL_EXPORTER_OTLP_ENDPOINT="http://x:1").traces_enabled
    assert not load(OTEL_TRACES_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT="http://x:1").traces_enabled
    assert load(OTEL_TRACES_EXPORTER="console").traces_enabled


@pytest.mark.parametrize(
    "block, env, key",
    [
        (None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ({"protocol": "udp"}, {}, "kvtrace.protocol"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://:4317"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://host:99999"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"endpoint": "ftp://host:21"}, {}, "kvtrace.endpoint"),
        (None, {"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
        (None, {"OTEL_TRACES_SAMPLER_ARG": "-0.1"}, "OTEL_TRACES_SAMPLER_ARG"),
        (None, {"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"sampler_arg": float("nan")}, {}, "kvtrace.sampler_arg"),
        (None, {"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        (None, {"OTEL_EXPORTER_OTLP_HEADERS": "no-equals-sign"}, "OTEL_EXPORTER_OTLP_HEADERS"),
        (None, {"OTEL_RESOURCE_ATTRIBUTES": "=value"}, "OTEL_RESOURCE_ATTRIBUTES"),
        (None, {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (None, {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
        (None, {"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE"),
        (None, {"OTEL_SDK_DISABLED": "maybe"}, "OTEL_SDK_DISABLED"),
        ({"metrics_port": 70000}, {}, "kvtrace.metrics_port"),
        ({"hash_request_ids": "sure"}, {}, "kvtrace.hash_request_ids"),
        ({"max_queue_size": 10, "max_export_batch_size": 20}, {}, "max_export_batch_size"),
        ({"endpont": "http://x:1"}, {}, "kvtrace.endpont"),
    ],
)
def test_each_bad_value_names_its_key(block, env, key):
    with pytest.raises(ConfigError) as raised:
        TelemetryConfig.load(block, env)
    assert raised.value.key == key
    assert key in str(raised.value)


def test_keys_owned_by_the_connector_pass_through():
    config = TelemetryConfig.load({"nixl_progress_delay_us": 1000}, {},
                                  known_elsewhere={"nixl_progress_delay_us"})
    assert config.enabled


def test_the_clock_exchange_goes_to_its_own_endpoint_where_one_is_set():
    plain = TelemetryConfig.load({"endpoint": "http://otel-agent:4318/v1/traces", "protocol": "http/protobuf"}, {})
    assert plain.clock_target == ("http://otel-agent:4318/v1/traces", "http/protobuf")  # beside the spans
    config = TelemetryConfig.load({"endpoint": "http://otel-agent:4318/v1/traces", "protocol": "http/protobuf"},
                                  {"KVTRACE_CLOCK_ENDPOINT": "http://kvtrace:4317", "KVTRACE_CLOCK_PROTOCOL": "grpc"})
    assert config.clock_target == ("http://kvtrace:4317", "grpc")
    block = TelemetryConfig.load({"endpoint": "http://a:1/v1/traces", "clock_endpoint": "http://b:2/v1/traces"},
                                 {"KVTRACE_CLOCK_ENDPOINT": "http://c:3"})
    assert block.clock_target == ("http://b:2/v1/traces", "grpc")  # the block wins; the traces' protocol
    with pytest.raises(ConfigError, match="KVTRACE_CLOCK_ENDPOINT"):
        TelemetryConfig.load({}, {"KVTRACE_CLOCK_ENDPOINT": "kvtrace:4317"})
    with pytest.raises(ConfigError, match="clock_protocol"):
        TelemetryConfig.load({"clock_protocol": "http/json"}, {})
