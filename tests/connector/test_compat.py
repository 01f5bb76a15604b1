"""The tested vLLM range: what the connector says at start-up, and that the gpu extra agrees."""

import logging
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from kvtrace.connector import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version,tested", [
    ("0.32.0", True), ("0.32.1", True), ("0.33.0", True), ("0.33.0+cu129", True),
    ("0.33.1rc1", True), ("0.31.9", False), ("0.34.0", False), ("0.34.0rc1", False), ("1.0.0", False),
])
def test_tested_range(version, tested):
    assert compat.is_tested(version) is tested


def test_logs_the_version_and_warns_outside_the_range(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=compat.__name__)
    monkeypatch.setattr(compat, "_checked", False)
    assert compat.check_vllm_version("0.35.0") is False
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "0.35.0" in warning[0].getMessage()
    assert compat.tested_range() in warning[0].getMessage()
    caplog.clear()
    compat.check_vllm_version("0.35.0")  # once per process
    assert not caplog.records


def test_installed_vllm_is_in_range_and_logged(monkeypatch, caplog):
    import vllm

    caplog.set_level(logging.INFO, logger=compat.__name__)
    monkeypatch.setattr(compat, "_checked", False)
    assert compat.check_vllm_version() is True
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert vllm.__version__ in caplog.records[0].getMessage()


def test_gpu_extra_accepts_exactly_the_tested_releases():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm_req = next(Requirement(r) for r in extras["gpu"] if Requirement(r).name == "vllm")
    nixl_req = next(Requirement(r) for r in extras["gpu"] if Requirement(r).name == "nixl")
    for version in ("0.31.0", "0.32.0", "0.32.3", "0.33.0", "0.33.2", "0.34.0"):
        assert (version in vllm_req.specifier) is compat.is_tested(version), version
    assert "1.5.0" in nixl_req.specifier and "1.5.1" in nixl_req.specifier


def test_sleep_mode_answer_is_vllms_own():
    """vLLM asks the loaded connector class whether ``--enable-sleep-mode`` may run with it; the
    traced classes must answer as vLLM's do (0.33: push refuses, pull accepts with UCX only)."""
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as vllm_nixl

    from kvtrace.connector import NixlPullConnector, NixlPushConnector

    config = KVTransferConfig(kv_connector="NixlPushConnector", kv_role="kv_producer")
    if not hasattr(vllm_nixl.NixlPushConnector, "supports_sleep_mode"):
        assert Version(vllm.__version__).release < (0, 33)
        return
    for traced, own in ((NixlPushConnector, vllm_nixl.NixlPushConnector),
                        (NixlPullConnector, vllm_nixl.NixlPullConnector)):
        assert traced.supports_sleep_mode(config) == own.supports_sleep_mode(config)
    if Version(vllm.__version__).release >= (0, 33):
        assert NixlPushConnector.supports_sleep_mode(config) is False
        assert NixlPullConnector.supports_sleep_mode(config) is True


def test_runs_against_the_expected_vllm():
    """``make test`` runs tests/connector once per tested release; each run names the one it
    expects, so an environment that silently fell back to another vLLM fails here."""
    import os

    import vllm

    expected = os.environ.get("KVTRACE_EXPECT_VLLM")
    assert expected is None or vllm.__version__ == expected, (vllm.__version__, expected)
