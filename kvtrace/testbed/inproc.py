"""vLLM's real NIXL connector classes in this process, with a fake NIXL agent.

For unit tests and the per-step cost benchmark: a real ``VllmConfig`` on the tiny local
model (CPU), vLLM's single-rank process groups, and :class:`FakeNixlWrapper` in place of
``nixl_agent`` — it records what is posted and lets the caller choose transfer states and
deliver notifications. Everything else (scheduler, worker, writer thread) is vLLM's code.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from .launch import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32  # the CPU attention backend wants multiples of 32


class FakeHandle:
    def __init__(self, operation: str, notif: bytes) -> None:
        self.operation, self.notif = operation, notif


class FakeNixlWrapper:
    """The subset of ``nixl_agent`` the push/pull paths use, scripted by the caller."""

    def __init__(self, name: str, config=None) -> None:
        self.name = name
        self.state = "DONE"  # what check_xfer_state answers
        self.posted: list[FakeHandle] = []
        self.released: list[FakeHandle] = []
        self.sent: list[tuple[str, bytes]] = []
        self._notifs: list[bytes] = []
        self._lock = threading.Lock()

    def make_prepped_xfer(self, operation, local, local_ids, remote, remote_ids, notif_msg=b"", **kw):
        return FakeHandle(operation, notif_msg)

    def transfer(self, handle, notif_msg=b""):
        self.posted.append(handle)
        return "PROC"

    def check_xfer_state(self, handle):
        return self.state

    def get_xfer_telemetry(self, handle):
        return SimpleNamespace(totalBytes=65536, descCount=4, postDuration=12, xferDuration=340, startTime=0)

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def deliver(self, message: bytes) -> None:
        with self._lock:
            self._notifs.append(message)

    def get_new_notifs(self, backends=()):
        with self._lock:
            notifs, self._notifs = self._notifs, []
        return {"remote-agent": notifs} if notifs else {}

    def send_notif(self, agent_name, notif_msg=b""):
        self.sent.append((agent_name, notif_msg))

    def remove_remote_agent(self, agent_name):
        pass

    def deregister_memory(self, descs):
        pass


def make_vllm_config(model_dir: str, connector: str, kv_role: str, engine_id: str,
                     kvtrace_block: dict | None = None):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, max_model_len=1024, enforce_eager=True, dtype="bfloat16"),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_connector_module_path="kvtrace.connector", kv_role=kv_role,
            engine_id=engine_id, kv_connector_extra_config={"kvtrace": kvtrace_block or {}}),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves this in a real run
    return config


_initialized = False


def init_single_rank(model_dir: str) -> None:
    """vLLM's process groups for one rank (gloo), once per process."""
    global _initialized
    if _initialized:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    config = make_vllm_config(model_dir, "NixlPushConnector", "kv_producer", "setup")
    before = os.sched_getaffinity(0)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)
    os.sched_setaffinity(0, before)
    _initialized = True


def kv_cache_config():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def stand_in_transfer_topology(worker) -> None:
    """What ``register_kv_caches`` (real memory, a live remote agent) would build, reduced to
    what the decode step, the READ's completion and notification counting use: one P rank per D
    rank, the same block size and layout on both sides."""
    engine = SimpleNamespace(remote_block_size=BLOCK_SIZE, remote_physical_blocks_per_logical=1,
                             remote_tp_size=1, remote_dcp_size=1)
    worker.transfer_topo = SimpleNamespace(tp_ratio=lambda remote_tp_size: 1,
                                           unregister_remote_engine=lambda engine_id: None,
                                           get_engine_info=lambda engine_id: engine,
                                           block_size_ratio=lambda remote_block_size: 1)


def build_connector(model_dir: str, connector: str, kv_role: str, role: str, engine_id: str,
                    block: dict | None = None):
    """A kvtrace connector (``role``: scheduler or worker) on a fake NIXL agent."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    import kvtrace.connector as kc

    init_single_rank(model_dir)
    config = make_vllm_config(model_dir, connector, kv_role, engine_id, block)
    real_agent = base_worker.NixlWrapper
    base_worker.NixlWrapper = FakeNixlWrapper
    before = os.sched_getaffinity(0)
    try:
        with set_current_vllm_config(config):
            return getattr(kc, connector)(config, KVConnectorRole[role.upper()], kv_cache_config())
    finally:
        base_worker.NixlWrapper = real_agent
        os.sched_setaffinity(0, before)  # vLLM's CPU worker re-pins the calling thread
