"""Traces built to the contract, through kvtrace's own recorder and the OTLP encoder.

Each service (router, P, D) records with its own :class:`Recorder` and resource, exactly
as in production; only the wall-clock offset is pinned so expected numbers are exact, and
``skew_ms`` shifts one service's clock to model hosts that disagree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtrace.collectors.model import SpanBatch
from kvtrace.telemetry import Mode, Role, TelemetryConfig, build_resource, semconv
from kvtrace.telemetry.context import TraceRef, new_span_id, new_trace_id
from kvtrace.telemetry.recorder import Recorder
from kvtrace.telemetry.semconv import Stage

BASE_NS = 1_790_000_000_000_000_000  # wall clock of t=0 (late 2026)
MS = 1_000_000


@dataclass
class Built:
    trace_id: str
    requests: list  # ExportTraceServiceRequest, one per service
    expected: dict[str, int]  # category -> ns, when the test states it
    ttft_ns: int

    def rows(self) -> list:
        """Its spans as the collector decodes them (``SpanRow``), service after service."""
        return [row for request in self.requests for row in SpanBatch.of(request).rows]


def _recorder(role: Role, mode: Mode, skew_ms: float, instance: str,
              contract: int | None = None) -> tuple[Recorder, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    config = TelemetryConfig.load({}, {})
    resource = build_resource(config, role, mode, engine_id=instance,
                              extra={semconv.RES_SERVICE_INSTANCE_ID: instance})
    if contract is not None:  # an older sender: it did not say which contract it records
        resource = Resource({k: v for k, v in resource.attributes.items() if k != semconv.RES_CONTRACT_VERSION})
    recorder = Recorder(exporter, resource, schedule_delay_ms=60_000)
    recorder._offset_ns = BASE_NS + int(skew_ms * MS)  # pinned: times below are exact
    return recorder, exporter


def build(mode: str = "push", order: str = "registration_first", skew_ms: dict | None = None,
          drop: set[str] = frozenset(), fail: str | None = None, request_id: str = "cmpl-x-0",
          hosts: str = "0", router: str | None = None, at_ms: float = 0.0, late_rank_ms: float = 0.0,
          contract: int | None = None, d_queue_ms: float = 1.0, output_tokens: int = 0) -> Built:
    """One request. ``drop`` removes services ("router", "prefill", "decode") or stages
    ("decode:completion"); ``fail`` marks a stage (e.g. "write") as failed; ``router`` names the
    router's instance (default ``router-<hosts>``); ``at_ms`` moves the request later in time.
    ``late_rank_ms``: a second TP rank of the transferring side (P's worker in push, D's in pull)
    whose transfer ends that much later — the KV cache has landed, and D's completion starts, only
    then. ``contract=1``: senders of the first contract (no ``engine.input``, ``kv.read_wait`` or
    router legs, no version attribute). ``d_queue_ms``: how long the request waits in D's queue
    before its first decode step (a queue-bound trace). ``output_tokens``: the router saw that many, the last
    as its span ends (TPOT: the 40 ms after the first token over the tokens after the first)."""
    skew = skew_ms or {}
    m = Mode(mode)
    rec = {
        "router": _recorder(Role.ROUTER, m, skew.get("router", 0), router or f"router-{hosts}", contract),
        "prefill": _recorder(Role.PRODUCER, m, skew.get("prefill", 0), f"prefill-{hosts}", contract),
        "decode": _recorder(Role.CONSUMER, m, skew.get("decode", 0), f"decode-{hosts}", contract),
    }
    if late_rank_ms:
        rank_side = "prefill" if mode == "push" else "decode"
        rec["rank1"] = _recorder(Role.PRODUCER if mode == "push" else Role.CONSUMER, m, skew.get(rank_side, 0),
                                 f"{rank_side}-{hosts}-rank1")
    if contract == 1:
        drop = {*drop, "prefill:p_input", "decode:d_input", "decode:read_wait", "router:prefill_leg",
                "router:decode_leg"}
    trace_id, root_id = new_trace_id(), new_span_id()
    ref = TraceRef(trace_id, root_id)
    attrs = {semconv.ATTR_REQUEST_ID: request_id}

    def put(service: str, stage: Stage, start_ms: float, end_ms: float, extra=None, span_id=0, parent=ref):
        name = stage.name.lower()
        if service in drop or f"{service}:{name}" in drop:
            return
        error = semconv.FailureCause.TRANSFER_FAILED.value if fail == name else None
        rec[service][0].record(parent, stage, int((at_ms + start_ms) * MS), int((at_ms + end_ms) * MS),
                               {**attrs, **(extra or {})},
                               span_id=span_id, error=error)

    expected: dict[str, int] = {}
    put("router", Stage.PD_ROUTE, 0, 1)
    put("prefill", Stage.P_INPUT, 2, 5)  # 1 ms of HTTP after the route: no span covers it
    put("prefill", Stage.P_QUEUE, 5, 6)
    put("prefill", Stage.PREFILL, 6, 150, {semconv.ATTR_INPUT_TOKENS: 2000})
    if mode == "push":
        put("router", Stage.PREFILL_LEG, 1.5, 151)  # off the path in push: D's stream is
        put("decode", Stage.D_INPUT, 2, 6)
        put("decode", Stage.ALLOCATION, 6, 7)
        if order == "registration_first":
            put("decode", Stage.REGISTRATION, 7, 9)
            put("prefill", Stage.REGISTRATION, 120, 120)
            put("prefill", Stage.RENDEZVOUS, 120, 152, {semconv.ATTR_RENDEZVOUS_ORDER: "registration_first"})
            r_end = 152
        else:  # D registered late: P's blocks waited 18 ms
            put("decode", Stage.REGISTRATION, 7, 168)
            put("prefill", Stage.REGISTRATION, 170, 170)
            put("prefill", Stage.RENDEZVOUS, 152, 170, {semconv.ATTR_RENDEZVOUS_ORDER: "kv_first"})
            r_end = 170
        put("prefill", Stage.DESCRIPTOR_PREP, r_end, r_end + 1)
        put("prefill", Stage.WRITE, r_end + 1, r_end + 6, {semconv.ATTR_TRANSFER_BYTES: 2_097_152})
        if late_rank_ms:
            put("rank1", Stage.WRITE, r_end + 1, r_end + 6 + late_rank_ms, {semconv.ATTR_TRANSFER_BYTES: 2_097_152})
        r_end += late_rank_ms
        put("prefill", Stage.COMPLETION, r_end + 6, r_end + 7)
        d_ready = r_end + 6
        put("decode", Stage.COMPLETION, d_ready, d_ready + 2, {semconv.ATTR_ENGINE_LOOP_NS: 1500})
        if order == "registration_first":
            # compute: P input 3, prefill 144, first token 7; coordination: route 1, rendezvous
            # after prefill ended 2, prep 1, D completion 2, the decode leg after the first token 1
            expected = {"compute": 3 + 144 + 7, "queue": 1 + 1, "coordination": 1 + 2 + 1 + 2 + 1, "wire": 5}
        else:
            # P's blocks waited for D's registration, so the path runs through D: compute D input 4,
            # first token 7; coordination route 1, allocation 1, D's registration 161, prep 1,
            # D completion 2, decode leg 1; prefill is off the path
            expected = {"compute": 4 + 7, "queue": 1, "coordination": 1 + 1 + 161 + 1 + 2 + 1, "wire": 5}
    else:
        put("router", Stage.PREFILL_LEG, 1.5, 152)  # P's answer back 2 ms after its prefill ended
        put("router", Stage.REGISTRATION, 152, 152.5)
        put("decode", Stage.D_INPUT, 153, 160)  # D tokenises the prompt again
        put("decode", Stage.ALLOCATION, 160, 161)
        put("decode", Stage.READ_WAIT, 161, 161)  # D's step was idle: the READ was prepared at once
        put("decode", Stage.DESCRIPTOR_PREP, 161, 162, {semconv.ATTR_ON_ENGINE_LOOP: True})
        put("decode", Stage.READ, 162, 170, {semconv.ATTR_TRANSFER_BYTES: 2_097_152})
        if late_rank_ms:
            put("rank1", Stage.READ, 162, 170 + late_rank_ms, {semconv.ATTR_TRANSFER_BYTES: 2_097_152})
        put("prefill", Stage.COMPLETION, 170.5 + late_rank_ms, 171 + late_rank_ms)
        d_ready = 170 + late_rank_ms
        put("decode", Stage.COMPLETION, d_ready, d_ready + 2, {semconv.ATTR_ENGINE_LOOP_NS: 90_000})
        # compute: P input 3, prefill 144, D input 7, first token 7; coordination: route 1, P's
        # answer back 2, relay 0.5, allocation 1, prep 1, D completion 2, decode leg 1
        expected = {"compute": 3 + 144 + 7 + 7, "queue": 2, "coordination": 1 + 2 + 0.5 + 1 + 1 + 2 + 1, "wire": 8}
    put("decode", Stage.D_QUEUE, d_ready + 2, d_ready + 2 + d_queue_ms)
    d_ready += d_queue_ms - 1  # the first decode step starts when the queue lets it
    expected["queue"] = expected.get("queue", 0) + d_queue_ms - 1
    put("decode", Stage.FIRST_TOKEN, d_ready + 3, d_ready + 10)
    ttft_ms = d_ready + 11
    put("router", Stage.DECODE_LEG, 1.5 if mode == "push" else 152.5, ttft_ms)
    tokens = {semconv.ATTR_ROUTER_LAST_TOKEN_NS: int((ttft_ms + 40) * MS),
              semconv.ATTR_OUTPUT_TOKENS: output_tokens} if output_tokens else {}
    put("router", Stage.PD_REQUEST, 0, ttft_ms + 40, {"kvtrace.router.ttft_ns": int(ttft_ms * MS), **tokens},
        span_id=root_id, parent=TraceRef(trace_id, 0))
    if late_rank_ms and "wire" in expected:
        expected["wire"] += late_rank_ms  # the path runs through the last rank's transfer
    expected = {k: int(v * MS) for k, v in expected.items()}
    expected["unattributed"] = int(ttft_ms * MS) - sum(expected.values())

    requests = []
    for service, (recorder, exporter) in rec.items():
        recorder.force_flush()
        spans = exporter.get_finished_spans()
        recorder.shutdown()
        if spans:
            requests.append(encode_spans(spans))
    return Built(f"{trace_id:032x}", requests, expected, int(ttft_ms * MS))


def shuffled_span_requests(builts: list[Built], seed: int = 7) -> list:
    """Every span of every trace in its own request, in random order (duplicates included)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    singles = []
    for built in builts:
        for request in built.requests:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        single = ExportTraceServiceRequest()
                        out_rs = single.resource_spans.add()
                        out_rs.resource.CopyFrom(rs.resource)
                        out_ss = out_rs.scope_spans.add()
                        out_ss.scope.CopyFrom(ss.scope)
                        out_ss.spans.add().CopyFrom(span)
                        singles.append(single)
    rng = random.Random(seed)
    singles += rng.sample(singles, k=len(singles) // 5)  # some arrive twice
    rng.shuffle(singles)
    return singles


def store_of(path, builts) -> str:
    """A store file written by a real collector from these traces (then stopped); more traces can be added
    to it the same way."""
    from kvtrace.collectors.config import CollectorConfig
    from kvtrace.collectors.model import SpanBatch
    from kvtrace.collectors.service import Collector

    collector = Collector(CollectorConfig(db_path=str(path), grpc_port=None, http_port=0, decision_wait_s=0.0))
    collector.start()
    for built in builts:
        for request in built.requests:
            collector.consume(SpanBatch.of(request))
    collector.shutdown()
    return str(path)
