"""Other OpenTelemetry collectors, run as real peers for tests and benchmarks.

``Rotel`` runs the ``rotel`` agent (PyPI package ``rotel``: a Rust OTLP collector) on
127.0.0.1 in the foreground of its own process group, with an OTLP or blackhole exporter.

``KafkaMockCluster`` runs librdkafka's mock Kafka cluster (shipped in ``confluent-kafka``) in a process of
its own, with topics of a given partition count: real Kafka-protocol brokers on 127.0.0.1.

``ClickHouseServer`` runs a real ClickHouse server (the engine in PyPI ``chdb-core``, pinned) on
127.0.0.1: a fleet's shared store for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .launch import free_port


def rotel_binary() -> str:
    import rotel  # the PyPI wheel carries the agent binary

    path = Path(rotel.__file__).with_name("rotel-agent")
    if not path.exists():
        raise FileNotFoundError(f"rotel agent binary not found at {path}")
    return str(path)


class Rotel:
    def __init__(self, export_to: str | None = None, *, protocol: str = "grpc",
                 batch_timeout: str = "100ms", kafka: tuple[str, str] | None = None) -> None:
        """``export_to``: an OTLP endpoint URL; None exports to rotel's blackhole, or with ``kafka``
        (brokers, topic) to that Kafka topic (rotel's kafka exporter: protobuf, messages not keyed)."""
        self.grpc_port = free_port()
        self.http_port = free_port()
        self._dir = tempfile.mkdtemp(prefix="kvtrace-rotel-")
        self._command = [
            rotel_binary(), "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--pid-file", os.path.join(self._dir, "rotel.pid"),
            "--log-file", os.path.join(self._dir, "rotel.log"),
            "--batch-timeout", batch_timeout,
        ]
        if kafka is not None:
            self._command += ["--exporter", "kafka", "--kafka-exporter-brokers", kafka[0],
                              "--kafka-exporter-traces-topic", kafka[1], "--kafka-exporter-format", "protobuf"]
        elif export_to is None:
            self._command += ["--exporter", "blackhole"]
        else:
            self._command += ["--exporter", "otlp", "--otlp-exporter-endpoint", export_to,
                              "--otlp-exporter-protocol", protocol]
        self._process: subprocess.Popen | None = None

    @property
    def grpc_endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> "Rotel":
        self._process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL,
                                         stderr=open(os.path.join(self._dir, "stderr.log"), "wb"),
                                         start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.grpc_port), 0.2):
                return self
            if self._process.poll() is not None:
                raise RuntimeError(f"rotel exited with {self._process.returncode}: "
                                   f"{Path(self._dir, 'stderr.log').read_text()[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError("rotel did not start listening")

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(5)


CLICKHOUSE_CONFIG = """<clickhouse>
  <listen_host>127.0.0.1</listen_host>
  <http_port>{http_port}</http_port>
  <tcp_port>{tcp_port}</tcp_port>
  <logger><level>warning</level><console>0</console></logger>{remote_servers}
</clickhouse>
"""
# chdb is ClickHouse in a library: this starts its HTTP and native listeners, then holds the server
# up with a query that sleeps (a day at most); stopping kills that query, or the process.
_CLICKHOUSE_SERVE = """import sys, chdb._chdb as chdb
try:
    chdb.query("SYSTEM START LISTEN HTTP; SYSTEM START LISTEN TCP; SELECT sleepEachRow(1) FROM numbers(86400) "
               "SETTINGS function_sleep_max_microseconds_per_block = 0, max_block_size = 1", "TabSeparated",
               path=sys.argv[1])
except Exception as exc:
    print(exc, file=sys.stderr)
"""


class ClickHouseServer:
    """A ClickHouse server on 127.0.0.1 in its own process and folder, HTTP (``url``) and native ports."""

    def __init__(self, directory: str | None = None, *, remote_servers: str = "") -> None:
        self.http_port, self.tcp_port = free_port(), free_port()
        self._own_directory = directory is None  # made here: removed on exit (a given one is the caller's to keep)
        self.directory = Path(directory or tempfile.mkdtemp(prefix="kvtrace-clickhouse-"))
        self.remote_servers = remote_servers  # <remote_servers> XML: the clusters this server knows
        self._process: subprocess.Popen | None = None

    def store_url(self, database: str) -> str:
        """The ``--store`` URL of a database on this server."""
        return f"clickhouse://127.0.0.1:{self.http_port}/{database}"

    def __enter__(self) -> "ClickHouseServer":
        import sys

        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "config.xml").write_text(CLICKHOUSE_CONFIG.format(
            http_port=self.http_port, tcp_port=self.tcp_port, remote_servers=self.remote_servers))
        self._process = subprocess.Popen([sys.executable, "-c", _CLICKHOUSE_SERVE, str(self.directory)],
                                         cwd=self.directory, stdout=subprocess.DEVNULL,
                                         stderr=open(self.directory / "stderr.log", "wb"), start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.http_port), 0.2):
                return self
            if self._process.poll() is not None:
                raise RuntimeError(f"the ClickHouse server exited with {self._process.returncode}: "
                                   f"{(self.directory / 'stderr.log').read_text()[-2000:]}")
            time.sleep(0.1)
        self.__exit__()
        raise TimeoutError("the ClickHouse server did not start listening within 60 s")

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(5)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


class ClickHouseCluster:
    """``shards`` ClickHouse servers that each know the others as the shards of one cluster (``name``), for a
    store sharded over them (``store_url``: every shard's HTTP address and ``?cluster=``)."""

    def __init__(self, shards: int = 2, name: str = "kvtrace") -> None:
        self.name = name
        self.servers = [ClickHouseServer() for _ in range(shards)]
        remote = "".join(f"<shard><replica><host>127.0.0.1</host><port>{s.tcp_port}</port></replica></shard>"
                         for s in self.servers)
        for server in self.servers:
            server.remote_servers = f"\n  <remote_servers><{name}>{remote}</{name}></remote_servers>"

    def store_url(self, database: str) -> str:
        hosts = ",".join(f"127.0.0.1:{s.http_port}" for s in self.servers)
        return f"clickhouse://{hosts}/{database}?cluster={self.name}"

    def __enter__(self) -> "ClickHouseCluster":
        started = []
        try:
            for server in self.servers:
                started.append(server.__enter__())
        except BaseException:
            for server in started:
                server.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.__exit__()


# librdkafka's mock cluster, created through its C API (confluent-kafka does not wrap it): brokers that
# speak the Kafka protocol on 127.0.0.1, with topics made at the partition count asked for.
_KAFKA_MOCK = """import ctypes, glob, os, sys, time
import confluent_kafka
lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(confluent_kafka.__file__) + ".libs", "librdkafka*.so*"))[0])
lib.rd_kafka_conf_new.restype = ctypes.c_void_p
lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
lib.rd_kafka_new.restype = ctypes.c_void_p
lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
error = ctypes.create_string_buffer(512)
conf = lib.rd_kafka_conf_new()
lib.rd_kafka_conf_set(conf, b"log_level", b"3", error, 512)
handle = lib.rd_kafka_new(0, conf, error, 512)
cluster = lib.rd_kafka_mock_cluster_new(handle, int(sys.argv[1]))
for spec in sys.argv[2:]:
    name, partitions = spec.rsplit(":", 1)
    if lib.rd_kafka_mock_topic_create(cluster, name.encode(), int(partitions), 1):
        sys.exit(f"cannot create topic {name}")
print(lib.rd_kafka_mock_cluster_bootstraps(cluster).decode(), flush=True)
sys.stdin.read()  # up until the parent closes our stdin (or stops us)
"""


class KafkaMockCluster:
    """librdkafka's mock cluster of ``brokers`` brokers on 127.0.0.1, with ``topics`` (name -> partitions);
    ``bootstrap_servers`` once entered."""

    def __init__(self, topics: dict[str, int], brokers: int = 3) -> None:
        self.topics, self.brokers = topics, brokers
        self.bootstrap_servers = ""
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "KafkaMockCluster":
        import sys

        self._process = subprocess.Popen(
            [sys.executable, "-c", _KAFKA_MOCK, str(self.brokers), *(f"{t}:{n}" for t, n in self.topics.items())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, text=True)
        line = self._process.stdout.readline().strip()
        if not line:
            self.__exit__()
            raise RuntimeError("librdkafka's mock cluster did not start")
        self.bootstrap_servers = line
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(5)
