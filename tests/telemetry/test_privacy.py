"""The request-id hash: keyed, the same in every process with the key, applied where spans are built."""

import hashlib
import hmac

import pytest

from kvtrace.telemetry import semconv
from kvtrace.telemetry.config import ConfigError, TelemetryConfig
from kvtrace.telemetry.context import TraceRef
from kvtrace.telemetry.privacy import RequestIdHasher
from kvtrace.telemetry.semconv import Stage


def test_hash_is_hmac_sha256_of_the_id_under_the_key():
    hasher = RequestIdHasher("k1")
    expected = hmac.new(b"k1", b"cmpl-abc-0", hashlib.sha256).hexdigest()[:16]
    assert hasher("cmpl-abc-0") == expected == RequestIdHasher("k1")("cmpl-abc-0")
    assert RequestIdHasher("k2")("cmpl-abc-0") != expected  # keyed: another key, another value
    assert "k1" not in repr(hasher)


def test_config_needs_a_key_when_hashing_and_hides_it():
    with pytest.raises(ConfigError, match="KVTRACE_HASH_KEY"):
        TelemetryConfig.load({"hash_request_ids": True}, environ={})
    config = TelemetryConfig.load(None, environ={"KVTRACE_HASH_REQUEST_IDS": "1", "KVTRACE_HASH_KEY": "s3cret"})
    assert config.hash_request_ids and config.hash_key == "s3cret"
    assert "s3cret" not in repr(config)


def test_recorder_exports_hashed_ids_only(make_recorder, memory_exporter):
    hasher = RequestIdHasher("k1")
    recorder = make_recorder(memory_exporter, hash_request_id=hasher)
    ref = TraceRef(0xABC, 0x1, True)
    now = recorder.now()
    recorder.record(ref, Stage.WRITE, now, now + 1000, {semconv.ATTR_REQUEST_ID: "cmpl-raw-0",
                                                        semconv.ATTR_TRANSFER_BYTES: 64})
    recorder.record(ref, Stage.READ, now, now + 1000, {semconv.ATTR_REQUEST_ID: "cmpl-raw-0"}, error="transfer_failed")
    recorder.force_flush()
    spans = memory_exporter.get_finished_spans()
    assert [s.attributes[semconv.ATTR_REQUEST_ID] for s in spans] == [hasher("cmpl-raw-0")] * 2
    assert all("cmpl-raw-0" not in str(s.to_json()) for s in spans)
