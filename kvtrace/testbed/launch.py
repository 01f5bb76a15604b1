"""Start a real 1P1D pair (vLLM on CPU, NIXL over loopback) and the kvtrace router, and stop them.

Everything listens on 127.0.0.1. Each instance runs in its own process group pinned to its
own core (P on the first, D on the last), with the kvtrace connectors loaded through
``kv_connector_module_path`` and the CPU options of :mod:`kvtrace.connector.options` on.
Stopping sends SIGTERM to each group's leader, waits for the group, and only then kills; shared-memory segments
the pair created under /dev/shm are removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtrace.telemetry.clock import TEST_CLOCK_SHIFT_ENV
from kvtrace.telemetry.config import KVTRACE_CLOCK_ENDPOINT, KVTRACE_HASH_KEY
from kvtrace.telemetry.semconv import RES_RUN_ID

from . import recipes as tiny_model

PREFILL_ENGINE_ID = "kvtrace-prefill"
DECODE_ENGINE_ID = "kvtrace-decode"
CPU_OPTIONS = {"nixl_progress_delay_us": 1000, "keep_cpu_affinity": True}
SHUTDOWN_TIMEOUT_S = 5
SHM = Path("/dev/shm")
START_ATTEMPTS = 3
ADDRESS_IN_USE = "address already in use"
"""What a bind that lost the race for its port logs, compared lower-cased (strerror says "Address already in use",
asyncio's server "address already in use")."""


class PortTaken(RuntimeError):
    """A process of the pair exited at start-up because its port was taken."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def free_port() -> int:
    """A free 127.0.0.1 port for another process to bind later, outside the kernel's ephemeral range:
    a port from that range can be taken by any outgoing connection before the other process binds it."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(20_000, 65_000) if not low <= p <= high]
    for port in random.sample(candidates, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free port outside the ephemeral range")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


@dataclasses.dataclass
class PairConfig:
    mode: str = "push"
    model: str = tiny_model.DEFAULT_RECIPE
    """Which local recipe to build and serve (:data:`kvtrace.testbed.recipes.RECIPES`)."""
    model_dir: Path | None = None
    """Serve this folder instead (already built)."""
    otlp_endpoint: str | None = None
    """Where engines and router send spans; None: tracing on, nothing exported."""
    otlp_protocol: str = "http/protobuf"
    """OTLP/HTTP by default: the gRPC exporter keeps background threads in each engine process,
    and on a 2-core machine pull TPOT measured 1.049x untraced with gRPC export (twice) but
    1.006x with OTLP/HTTP (see the README on how noisy pair-level runs are here)."""
    tracing: bool = True
    """False loads the kvtrace connectors with ``kvtrace.enabled: false`` (vLLM's behaviour)."""
    cpu_options: bool = True
    prefix_caching: bool = False
    max_model_len: int = 4096
    decode_tp: int = 1
    """Tensor-parallel size of D; above 1 its workers run as separate processes, one per core."""
    router_port: int | None = None
    log_dir: Path | None = None
    ready_timeout_s: float = 300.0
    run_id: str = ""
    """Tags every span of the pair (engines and router) with ``kvtrace.run.id``."""
    clock_shift: dict = dataclasses.field(default_factory=dict)
    """Test-only: ``{"prefill"|"decode"|"router": "SKEW_MS[:DRIFT_PPM]"}``, as if that process ran on
    a host whose clock is off (``KVTRACE_TEST_CLOCK_SHIFT``)."""
    extra_kvtrace: dict = dataclasses.field(default_factory=dict)
    hash_key: str | None = None
    """Export request ids keyed-hashed in every process (router flag, engines' kvtrace block), with
    this key in each one's KVTRACE_HASH_KEY."""
    clock_endpoint: str | None = None
    """The kvtrace collector's URL for every process's clock exchange, where spans go elsewhere first
    (an OpenTelemetry Collector in between)."""
    vllm_tracing: bool = False
    """Turn vLLM's own tracing on too (``--otlp-traces-endpoint``, to the same endpoint): vLLM then hands
    the engine the ``traceparent`` a caller sent, and exports its ``llm_request`` spans."""

    def kvtrace_block(self) -> dict:
        block: dict[str, Any] = {"enabled": self.tracing, **self.extra_kvtrace}
        if self.hash_key:
            block["hash_request_ids"] = True
        if self.run_id:
            block["resource_attributes"] = {**block.get("resource_attributes", {}), RES_RUN_ID: self.run_id}
        if self.cpu_options:
            block.update(CPU_OPTIONS)
        if self.otlp_endpoint:
            block["endpoint"] = self.otlp_endpoint
            block.setdefault("protocol", self.otlp_protocol)
        if self.clock_endpoint:
            block["clock_endpoint"] = self.clock_endpoint
        return block


@dataclasses.dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str


class LocalPair:
    """``with LocalPair(PairConfig(mode="pull")) as pair: pair.router_url ...``"""

    def __init__(self, config: PairConfig) -> None:
        if config.mode not in ("push", "pull"):
            raise ValueError(f"mode must be push or pull, got {config.mode!r}")
        if config.model not in tiny_model.RECIPES:
            raise ValueError(f"model {config.model!r}: choose one of {', '.join(tiny_model.RECIPES)}")
        self.config = config
        self.procs: list[_Proc] = []
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvtrace-pair-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._shm_before: set[str] = set()
        self.ports = self._pick_ports()

    def _pick_ports(self) -> dict[str, int]:
        """Five distinct free ports (the router's from the config where it names one)."""
        ports: dict[str, int] = {}
        if self.config.router_port:
            ports["router"] = self.config.router_port
        for name in ("p_http", "d_http", "p_kv", "d_kv", "router"):
            while name not in ports:
                port = free_port()
                if port not in ports.values():
                    ports[name] = port
        return ports

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}"

    @property
    def prefill_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['p_http']}"

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['d_http']}"

    def __enter__(self) -> "LocalPair":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ start

    def _engine_command(self, role: str) -> tuple[list[str], dict[str, str], set[int]]:
        c = self.config
        prefill = role == "prefill"
        kv_config = {
            "kv_connector": "NixlPushConnector" if c.mode == "push" else "NixlPullConnector",
            "kv_connector_module_path": "kvtrace.connector",
            "kv_role": "kv_producer" if prefill else "kv_consumer",
            "engine_id": PREFILL_ENGINE_ID if prefill else DECODE_ENGINE_ID,
            "kv_connector_extra_config": {"kvtrace": c.kvtrace_block()},
        }
        port = self.ports["p_http" if prefill else "d_http"]
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(c.model_dir), "--served-model-name", "tiny",
                   "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                   "--max-model-len", str(c.max_model_len), "--max-num-seqs", "8",
                   # a grace period at stop, so the engine core exits (and kvtrace's recorder flushes its
                   # last spans) instead of being killed at once (vLLM's default, 0)
                   "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                   "--kv-transfer-config", json.dumps(kv_config)]
        if c.tracing:  # the receipt time of each leg, for the engine's input stage
            command += ["--middleware", "kvtrace.connector.RequestReceipt"]
        if c.vllm_tracing and c.otlp_endpoint:
            command += ["--otlp-traces-endpoint", c.otlp_endpoint]
        if not c.prefix_caching:
            command.append("--no-enable-prefix-caching")
        cores = sorted(os.sched_getaffinity(0))
        core = cores[0] if prefill else cores[-1]
        omp_bind = str(core)
        pinned = {core}
        if not prefill and c.decode_tp > 1:
            if len(cores) < c.decode_tp:
                raise ValueError(f"decode_tp={c.decode_tp} needs {c.decode_tp} cores, this machine has {len(cores)}")
            command += ["--tensor-parallel-size", str(c.decode_tp)]
            omp_bind = "|".join(str(x) for x in cores[-c.decode_tp:])  # one core per rank
            pinned = set(cores[-c.decode_tp:])
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # GiB: room for several 4k-token requests of the transfer-heavy model (64 KiB a token)
            "VLLM_CPU_KVCACHE_SPACE": "1" if tiny_model.kv_bytes_per_token(c.model) <= 4096 else "2",
            "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.ports["p_kv" if prefill else "d_kv"]),
            "UCX_NET_DEVICES": "lo",  # keep every UCX listener on loopback
            "VLLM_LOGGING_LEVEL": "INFO",
        }
        if role in c.clock_shift:
            env[TEST_CLOCK_SHIFT_ENV] = c.clock_shift[role]
        if c.vllm_tracing:  # vLLM's exporter reads its protocol from here (gRPC by default)
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = c.kvtrace_block().get("protocol", c.otlp_protocol)
        if c.hash_key:
            env[KVTRACE_HASH_KEY] = c.hash_key
        return command, env, pinned

    def _spawn(self, name: str, command: list[str], env: dict[str, str], cores: set[int] | None,
               url: str) -> None:
        log = self.log_dir / f"{name}.log"
        if cores:  # taskset pins before Python starts; no preexec_fn, which forks with threads
            command = ["taskset", "-c", ",".join(map(str, sorted(cores))), *command]
        with open(log, "wb") as handle:
            popen = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(_Proc(name, popen, log, url))

    def start(self) -> None:
        """Start the pair; where a process finds its port taken (another process bound it between
        :func:`free_port` and the start), start again on fresh ports, up to :data:`START_ATTEMPTS` times."""
        c = self.config
        c.model_dir = Path(c.model_dir or tiny_model.build(name=c.model))
        self._shm_before = set(os.listdir(SHM)) if SHM.exists() else set()
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except PortTaken as exc:
                if attempt == START_ATTEMPTS:
                    raise
                print(f"kvtrace pair: {exc.name}'s port was taken; starting again on fresh ports "
                      f"({attempt}/{START_ATTEMPTS})", file=sys.stderr)
                self.ports = self._pick_ports()

    def _start_once(self) -> None:
        c = self.config
        try:
            for role in ("prefill", "decode"):
                command, env, cores = self._engine_command(role)
                url = self.prefill_url if role == "prefill" else self.decode_url
                self._spawn(role, command, env, cores, url)
            self._spawn_router("router", self.ports["router"], c.clock_shift.get("router"))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _spawn_router(self, name: str, port: int, clock_shift: str | None) -> str:
        c = self.config
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp" if c.tracing else "none"}
        if c.run_id:
            env["OTEL_RESOURCE_ATTRIBUTES"] = f"{RES_RUN_ID}={c.run_id}"
        if c.otlp_endpoint and c.tracing:
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = c.otlp_endpoint
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = c.kvtrace_block()["protocol"]
        if not c.tracing:
            env["OTEL_SDK_DISABLED"] = "true"
        if clock_shift:
            env[TEST_CLOCK_SHIFT_ENV] = clock_shift
        if c.clock_endpoint:
            env[KVTRACE_CLOCK_ENDPOINT] = c.clock_endpoint
        command = [sys.executable, "-m", "kvtrace", "router", "--mode", c.mode, "--prefill", self.prefill_url,
                   "--decode", self.decode_url, "--port", str(port), "--prefill-engine-id", PREFILL_ENGINE_ID,
                   "--prefill-kv-port", str(self.ports["p_kv"])]
        if c.hash_key:
            env[KVTRACE_HASH_KEY] = c.hash_key
            command.append("--hash-request-ids")
        url = f"http://127.0.0.1:{port}"
        self._spawn(name, command, env, None, url)
        return url

    def add_router(self, clock_shift: str | None = None) -> str:
        """Another router in front of the same pair (several routers: several clocks); returns its URL."""
        url = self._spawn_router(f"router-{len(self.procs)}", free_port(), clock_shift)
        self._wait_ready()
        return url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = list(self.procs)
        while pending:
            for proc in list(pending):
                if proc.popen.poll() is not None:
                    last = tail(proc.log)
                    message = f"{proc.name} exited with {proc.popen.returncode} during start-up; last log lines:\n{last}"
                    raise PortTaken(message, proc.name) if ADDRESS_IN_USE in last.lower() else RuntimeError(message)
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(proc.url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            pending.remove(proc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {self.config.ready_timeout_s:.0f}s: "
                                   f"{[p.name for p in pending]}; logs in {self.log_dir}")
            time.sleep(1)

    # ------------------------------------------------------------------ stop

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each process we started, wait for its group, then SIGKILL what is left.

        Only the leader (vLLM's API server) gets SIGTERM: it stops its engine core, which exits
        through multiprocessing's finalizers (kvtrace flushes its spans there). A second SIGTERM
        straight to the engine core — as a signal to the whole group would send — lands after vLLM
        has restored the default handler for its teardown, and kills it halfway."""
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            # Children of the group (EngineCore) may outlive the leader briefly.
            while _group_alive(proc.popen.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(proc.popen.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
        self.procs.clear()
        self._clean_shm()

    def _clean_shm(self) -> None:
        if not SHM.exists():
            return
        for name in set(os.listdir(SHM)) - self._shm_before:
            path = SHM / name
            with contextlib.suppress(OSError):
                if path.stat().st_uid == os.getuid():
                    path.unlink()

    def idle_cpu_percent(self, seconds: float = 5.0) -> float:
        """CPU used by all our processes (and their children) over ``seconds``, in % of one core."""
        def total() -> float:
            ticks = 0
            for proc in self.procs:
                for pid in group_pids(proc.popen.pid):
                    with contextlib.suppress(OSError, IndexError, ValueError):
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                        ticks += int(fields[11]) + int(fields[12])  # utime + stime
            return ticks / os.sysconf("SC_CLK_TCK")
        before = total()
        time.sleep(seconds)
        return 100.0 * (total() - before) / seconds


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
    return pids


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
