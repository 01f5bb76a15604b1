"""The local pair's start when a port it picked is taken before its process binds it."""

from __future__ import annotations

import socket

import pytest

from kvtrace.testbed import launch
from kvtrace.testbed.launch import LocalPair, PairConfig, PortTaken


def test_a_process_whose_port_was_taken_is_named_as_such(tmp_path):
    """A real router on a port another socket holds exits at start-up; the pair says which port race it lost."""
    pair = LocalPair(PairConfig(model_dir=tmp_path, log_dir=tmp_path / "logs", ready_timeout_s=60))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", pair.ports["router"]))
        holder.listen()
        try:
            pair._spawn_router("router", pair.ports["router"], None)
            with pytest.raises(PortTaken) as raised:
                pair._wait_ready()
        finally:
            pair.stop()
    assert raised.value.name == "router"
    assert str(pair.ports["router"]) in str(raised.value)


def test_the_pair_starts_again_on_fresh_ports_when_one_was_taken(tmp_path, monkeypatch):
    pair = LocalPair(PairConfig(model_dir=tmp_path, log_dir=tmp_path / "logs"))
    tried: list[dict[str, int]] = []

    taken_times = [2]  # the first two starts lose the race for a port

    def start_once():
        tried.append(dict(pair.ports))
        if len(tried) <= taken_times[0]:
            raise PortTaken("decode exited: Address already in use", "decode")

    monkeypatch.setattr(pair, "_start_once", start_once)
    pair.start()
    assert len(tried) == launch.START_ATTEMPTS
    assert all(len(set(ports.values())) == 5 for ports in tried)  # five distinct ports each time
    assert tried[0] != tried[1] != tried[2]

    tried.clear()
    taken_times[0] = launch.START_ATTEMPTS
    with pytest.raises(PortTaken):  # taken every time: the last attempt's error, not a silent loop
        pair.start()
    assert len(tried) == launch.START_ATTEMPTS


def test_a_start_failure_that_is_no_port_race_is_not_retried(tmp_path, monkeypatch):
    pair = LocalPair(PairConfig(model_dir=tmp_path, log_dir=tmp_path / "logs"))
    calls = []

    def start_once():
        calls.append(1)
        raise RuntimeError("prefill exited with 1 during start-up")

    monkeypatch.setattr(pair, "_start_once", start_once)
    with pytest.raises(RuntimeError, match="prefill exited"):
        pair.start()
    assert len(calls) == 1
