"""``kvtrace bench sweep``: runs of a pair swept over (prompt length × rate or concurrency), each
recorded in the collector's store.

A run is one configuration of the pair (mode, model, options). Against a real deployment
(``--router URL``) a sweep is one run, recorded through ``--collector``; with ``--local`` it
starts the collector on ``--db`` and, for each ``--mode``, the local testbed pair, so
``--mode push --mode pull`` records two runs. Every request carries its run id (the client's
span's resource, and with ``--local`` the engines' and router's too), and each run ends with a
``kvtrace.run`` span holding its configuration and per-point results.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvtrace.telemetry import semconv
from kvtrace.telemetry.setup import hardware_summary
from kvtrace.telemetry.versions import installed_version

from .loadgen import Client, Point, PointResult, client_session, prompt_ids, run_point

logger = logging.getLogger(__name__)
CONNECTORS = {"push": "NixlPushConnector", "pull": "NixlPullConnector"}


@dataclasses.dataclass
class SweepConfig:
    points: list[Point]
    requests: int = 12  # per point, after warm-up
    output_tokens: int = 16
    warmup: int = 2  # per run, before the points; not recorded as points
    seed: int = 0
    max_seconds: float = 600.0  # per point: no request is sent after this
    model_name: str = "tiny"  # the served model's name (the testbed serves "tiny")
    request_timeout_s: float = 300.0
    lengths_file: str | None = None  # where the points' length distribution came from, if one did

    def validate(self) -> None:
        if not self.points:
            raise ValueError("nothing to sweep: give --prompt-tokens and --rate or --concurrency")
        for point in self.points:
            if point.prompt_tokens < 1:
                raise ValueError(f"--prompt-tokens {point.prompt_tokens}: must be >= 1")
            if point.rate is not None and not point.rate > 0:
                raise ValueError(f"--rate {point.rate:g}: must be > 0")
            if point.concurrency is not None and point.concurrency < 1:
                raise ValueError(f"--concurrency {point.concurrency}: must be >= 1")
        if self.requests < 1 or self.output_tokens < 1 or self.warmup < 0:
            raise ValueError("--requests and --output-tokens must be >= 1, --warmup >= 0")
        if self.max_seconds <= 0:
            raise ValueError("--max-seconds must be > 0")


def new_run_id(mode: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}-{uuid.uuid4().hex[:6]}"


class RunTelemetry:
    """The load generator's tracer for one run: client spans and the run record, to ``endpoint``
    (OTLP/HTTP), under ``service.name=kvtrace-bench`` with the run's id."""

    def __init__(self, endpoint: str, run_id: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({
            semconv.RES_SERVICE_NAME: "kvtrace-bench", semconv.RES_RUN_ID: run_id,
            semconv.RES_HOST_NAME: os.uname().nodename}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                            schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("kvtrace.bench", installed_version("kvtrace") or "")

    def record_run(self, config: dict[str, Any]) -> None:
        now = time.time_ns()
        span = self.tracer.start_span(semconv.SPAN_RUN, context=Context(), start_time=config["started_ns"])
        span.set_attribute(semconv.RUN_CONFIG, json.dumps(config, sort_keys=True, default=str))
        span.end(end_time=max(now, config["started_ns"]))

    def close(self) -> None:
        self.provider.force_flush(30_000)
        self.provider.shutdown()


def run_config(run_id: str, mode: str, sweep: SweepConfig, router: str, local: dict[str, Any] | None,
               results: list[PointResult], started_ns: int, status: str) -> dict[str, Any]:
    """What the run record holds: the configuration beside the load generator's results. The
    engines' own versions and hardware come from their resource attributes (the store's origins)."""
    config: dict[str, Any] = {
        "run_id": run_id, "mode": mode, "connector": CONNECTORS.get(mode, ""), "router": router,
        "kvtrace_version": installed_version("kvtrace"), "load_generator_host": hardware_summary(),
        "prompt_tokens": sorted({p.prompt_tokens for p in sweep.points}),
        "length_distribution": _distribution(sweep),
        "rates": sorted({p.rate for p in sweep.points if p.rate is not None}),
        "concurrencies": sorted({p.concurrency for p in sweep.points if p.concurrency is not None}),
        "requests_per_point": sweep.requests, "output_tokens": sweep.output_tokens, "ignore_eos": True,
        "warmup": sweep.warmup, "seed": sweep.seed, "served_model": sweep.model_name,
        "started_ns": started_ns, "ended_ns": time.time_ns(), "status": status,
        "points": [r.summary() for r in results],
    }
    if local:
        config.update(local)
    return config


def _distribution(sweep: SweepConfig) -> dict[str, Any] | None:
    """The prompt-length distribution the points drew from, summarised (None: fixed lengths)."""
    lengths = next((p.lengths for p in sweep.points if p.lengths), ())
    if not lengths:
        return None
    return {"file": sweep.lengths_file, "values": len(lengths), "min": lengths[0],
            "p50": lengths[len(lengths) // 2], "p90": lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))],
            "max": lengths[-1], "mean": round(sum(lengths) / len(lengths), 1)}


async def _warm_up(client: Client, count: int, length: int, seed: int) -> None:
    """``count`` requests sent one after another, without a point (so without a client span)."""
    rng = random.Random(f"warmup:{seed}")
    async with client_session() as session:
        for _ in range(count):
            await client.send(session, prompt_ids(length, rng), None)


async def sweep_run(router: str, sweep: SweepConfig, telemetry: RunTelemetry, stop: asyncio.Event,
                    progress: Any) -> tuple[list[PointResult], str]:
    """One run: warm-up, then every point in order. Returns the points' results and a status
    (``complete``, ``interrupted``)."""
    client = Client(router, sweep.model_name, sweep.output_tokens, telemetry.tracer, sweep.request_timeout_s)
    await _warm_up(client, sweep.warmup, min(p.prompt_tokens for p in sweep.points), sweep.seed)
    results = []
    for point in sweep.points:
        if stop.is_set():
            return results, "interrupted"
        progress.set_postfix_str(point.label)
        result = await run_point(client, point, sweep.requests, sweep.seed, stop, sweep.max_seconds,
                                 on_done=lambda _: progress.update(1))
        results.append(result)
        rate = (f"requested {point.rate:g}/s, scheduled {result.scheduled_rate:.3f}/s, "
                f"achieved {result.achieved_rate:.3f}/s ({(result.achieved_rate / point.rate - 1) * 100:+.1f} %)"
                if point.rate is not None else f"concurrency {point.concurrency}: {result.achieved_rate:.3f} req/s")
        ok = sum(o.ok for o in result.outcomes)
        errors = result.summary()["errors"]
        progress.write(f"  {point.prompt_tokens:>6} tokens: {ok}/{len(result.outcomes)} ok; {rate}"
                       + (f"; failures: {'; '.join(errors)}" if errors else ""), file=sys.stderr)
        if result.interrupted and stop.is_set():
            return results, "interrupted"
    return results, "complete"


@contextlib.contextmanager
def ctrl_c_stops(loop: asyncio.AbstractEventLoop, stop: asyncio.Event):
    """Ctrl-C (and SIGTERM) set ``stop``: no new requests, in-flight ones get a moment, the run is
    recorded as interrupted; a second Ctrl-C raises as usual."""
    def first(*_: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        print("\nstopping: no new requests; what finished is kept (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def sweep(sweep_config: SweepConfig, *, modes: list[str], router: str | None, collector: str | None,
          db: str | None, model: str = "tiny", log_dir: str | None = None) -> list[str]:
    """Run the sweep; returns the run ids recorded. ``router``: one run against that deployment
    (``modes`` names its mode); else the local testbed, one run per mode, collector on ``db``."""
    from tqdm import tqdm

    sweep_config.validate()
    total = len(sweep_config.points) * sweep_config.requests * len(modes)
    progress = tqdm(total=total, unit="req", desc="sweep", file=sys.stderr, dynamic_ncols=True)
    run_ids: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.callback(progress.close)
        if router is None:
            endpoint, collector_obj = _local_collector(stack, db)
        else:
            endpoint, collector_obj = _otlp_traces_url(collector), None
        for mode in modes:
            run_id = new_run_id(mode)
            local: dict[str, Any] | None = None
            if router is None:
                pair, local = _local_pair(stack, mode, model, endpoint, run_id, log_dir)
                url = pair.router_url
            else:
                url = router
            progress.write(f"run {run_id}: {mode} via {url}", file=sys.stderr)
            telemetry = RunTelemetry(endpoint, run_id)
            started = time.time_ns()
            loop = asyncio.new_event_loop()
            stop = asyncio.Event()
            try:
                with ctrl_c_stops(loop, stop):
                    results, status = loop.run_until_complete(
                        sweep_run(url, sweep_config, telemetry, stop, progress))
            finally:
                loop.close()
            telemetry.record_run(run_config(run_id, mode, sweep_config, url, local, results, started, status))
            telemetry.close()
            run_ids.append(run_id)
            if router is None:
                # The engines export every 0.5 s and lose what is still queued when stopped: let
                # the last requests' spans reach the collector before the pair goes.
                _settle(collector_obj, run_id, sum(o.ok for r in results for o in r.outcomes), progress)
                pair.stop()  # before the next mode's pair starts (stopping twice is harmless)
            if status == "interrupted":
                break
        if collector_obj is not None:
            _drain(collector_obj, run_ids, progress)
    return run_ids


def _otlp_traces_url(collector: str | None) -> str:
    url = collector or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or "http://127.0.0.1:4318"
    return url if url.rstrip("/").endswith("/v1/traces") else url.rstrip("/") + "/v1/traces"


def _local_collector(stack: contextlib.ExitStack, db: str | None) -> tuple[str, Any]:
    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.service import Collector
    from kvtrace.testbed.launch import free_port

    if not db:
        raise ValueError("--local needs --db PATH: the collector the sweep starts stores the runs there")
    collector = Collector(CollectorConfig(db_path=db, grpc_port=None, http_port=free_port(), decision_wait_s=1.0))
    collector.start()
    stack.callback(collector.shutdown)
    return f"http://127.0.0.1:{collector.receivers[0].port}/v1/traces", collector


def _local_pair(stack: contextlib.ExitStack, mode: str, model: str, endpoint: str, run_id: str,
                log_dir: str | None) -> tuple[Any, dict[str, Any]]:
    from kvtrace.testbed import recipes
    from kvtrace.testbed.launch import LocalPair, PairConfig

    config = PairConfig(mode=mode, model=model, otlp_endpoint=endpoint, run_id=run_id,
                        log_dir=Path(log_dir) / run_id if log_dir else None)
    pair = LocalPair(config)
    stack.callback(pair.stop)  # also on Ctrl-C or an error
    pair.start()
    local = {"model": model, "model_recipe": recipes.RECIPES[model],
             "kv_bytes_per_token": recipes.kv_bytes_per_token(model), "prefix_cache": config.prefix_caching,
             "max_model_len": config.max_model_len, "kvtrace_options": config.kvtrace_block(),
             "testbed": "local 1P1D, vLLM on CPU, NIXL/UCX over loopback"}
    return pair, local


def _settle(collector: Any, run_id: str, finished: int, progress: Any, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until the run's finished requests all have complete traces in the store."""
    def complete() -> int:
        return collector.store.query("SELECT count(*) FROM requests WHERE run_id = ? AND complete AND "
                                     "point_prompt_tokens IS NOT NULL", [run_id])[0][0]

    if not _poll_store(collector, lambda: complete() >= finished, timeout_s):
        progress.write(f"warning: run {run_id}: {finished - complete()} of {finished} requests' traces were still "
                       f"incomplete after {timeout_s:.0f} s", file=sys.stderr)


def _drain(collector: Any, run_ids: list[str], progress: Any) -> None:
    """Wait until the collector has decided every trace and stored the run records (bounded)."""
    def drained() -> bool:
        status = collector.status()
        recorded = collector.store.query("SELECT count(*) FROM runs WHERE run_id IN (SELECT unnest(?))", [run_ids])
        return not status["pending_traces"] + status["queued_requests"] and recorded[0][0] == len(run_ids)

    if not _poll_store(collector, drained, 60.0):
        progress.write("warning: the collector had not decided every trace after 60 s; stored what it had",
                       file=sys.stderr)


def _poll_store(collector: Any, done: Callable[[], bool], timeout_s: float) -> bool:
    """Flush the collector's store and ask ``done()`` every 0.5 s until it holds (True) or
    ``timeout_s`` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        collector.store.flush()
        if done():
            return True
        time.sleep(0.5)
    return False
