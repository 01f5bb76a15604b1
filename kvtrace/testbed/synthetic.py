"""Synthetic 1P1D traffic as OTLP export requests: contract-shaped traces with realistic variety.

For load and scale work (``bench/dashboard_scale.py``, the dashboard's browser test) where a real
pair would take hours: each request gets a prompt length (log-normal), a mode, queueing, a
prefill that grows with the prompt, a push rendezvous that is usually ``registration_first``
(``kv_first`` when D registers late), a WRITE or READ sized by the prompt, descriptor prep on
the decode loop in pull, a decode whose TPOT pull slows a little, and a few failed transfers
and incomplete traces. Spans are encoded straight to protobuf bytes from per-stage templates
(~4 µs a span), so a million requests take minutes, not hours. The timing model is a
plausible shape, not a measurement of anything.
"""

from __future__ import annotations

import dataclasses
import math
import random
import struct
from collections.abc import Iterator

from kvtrace.collectors.wire import field, key_value, varint
from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Stage

MS = 1_000_000


_FIXED64 = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class Instance:
    role: semconv.Role
    mode: str
    instance: str
    run_id: str = ""

    def resource(self) -> bytes:
        attributes = [(semconv.RES_SERVICE_NAME, semconv.DEFAULT_SERVICE_NAMES[self.role]),
                      (semconv.RES_SERVICE_INSTANCE_ID, self.instance), (semconv.RES_ROLE, self.role.value),
                      (semconv.RES_MODE, self.mode)]
        if self.run_id:
            attributes.append((semconv.RES_RUN_ID, self.run_id))
        return b"".join(field(1, key_value(k, v)) for k, v in attributes)


@dataclasses.dataclass(frozen=True)
class ClientInstance:
    """The load generator's client (``kvtrace.client.request`` spans), a resource of its own."""

    run_id: str

    def resource(self) -> bytes:
        return field(1, key_value(semconv.RES_SERVICE_NAME, "kvtrace-bench")) + field(1, key_value(
            semconv.RES_RUN_ID, self.run_id))


_SCOPE = field(1, field(1, semconv.INSTRUMENTATION_SCOPE.encode()))  # ScopeSpans.scope = {name}


def _span(trace_id: bytes, span_id: bytes, parent: bytes, stage: Stage, start: int, end: int,
          attrs: bytes, error: str | None = None) -> bytes:
    spec = semconv.STAGES[stage]
    body = (field(1, trace_id) + field(2, span_id) + (field(4, parent) if parent else b"") + field(5, spec.span_name.encode())
            + varint(6 << 3) + varint(spec.kind.value + 1)
            + varint(7 << 3 | 1) + _FIXED64.pack(start) + varint(8 << 3 | 1) + _FIXED64.pack(end)
            + _STAGE_ATTRS[stage] + attrs)
    if error:
        body += field(9, key_value(semconv.ATTR_FAILURE_CAUSE, error)) + field(15, varint(3 << 3) + varint(2))
    return body


def _client_span(trace_id: bytes, span_id: bytes, t0: int, ttft_ms: float, tpot_ms: float, last_ms: float,
                 tokens: int, concurrency: int, prompt_tokens: int) -> bytes:
    """The client's ``kvtrace.client.request``: sent 0.3 ms before the router had it, read 0.4 ms after."""
    attrs = b"".join(field(9, key_value(k, v)) for k, v in (
        (semconv.CLIENT_TTFT_NS, int((ttft_ms + 0.7) * MS)), (semconv.CLIENT_TPOT_NS, int(tpot_ms * MS)),
        (semconv.CLIENT_ITL_P50_NS, int(tpot_ms * 0.97 * MS)), (semconv.CLIENT_ITL_P99_NS, int(tpot_ms * 1.6 * MS)),
        (semconv.CLIENT_OUTPUT_TOKENS, tokens), (semconv.BENCH_CONCURRENCY, concurrency),
        (semconv.BENCH_PROMPT_TOKENS, prompt_tokens)))
    return (field(1, trace_id) + field(2, span_id) + field(5, semconv.SPAN_CLIENT_REQUEST.encode())
            + varint(6 << 3) + varint(3)  # SPAN_KIND_CLIENT
            + varint(7 << 3 | 1) + _FIXED64.pack(t0 - int(0.3 * MS)) + varint(8 << 3 | 1)
            + _FIXED64.pack(t0 + int((last_ms + 0.9) * MS)) + attrs)


_STAGE_ATTRS = {stage: field(9, key_value(semconv.ATTR_CATEGORY, spec.category.value))
                + field(9, key_value(semconv.ATTR_STAGE, semconv.STAGE_LABELS[stage])) for stage, spec in semconv.STAGES.items()}


@dataclasses.dataclass
class Workload:
    """What to generate: requests per second, the push share, prompt lengths (log-normal around
    ``median_tokens``), output tokens, KV bytes per token, and how often things go wrong."""

    rate_per_s: float = 10.0
    push_share: float = 0.5
    median_tokens: int = 1500
    output_tokens: int = 64
    kv_bytes_per_token: int = 160 * 1024
    failure_rate: float = 0.003
    incomplete_rate: float = 0.002
    late_registration_rate: float = 0.08
    run_every_s: float = 0.0
    """Alternate push and pull runs of this length (0: mix the modes in one run)."""
    sweep_concurrency: tuple[int, ...] = ()
    """With runs: each request is a sweep's, at one of these concurrency points in turn (a client span with
    the client's measures and the point, as ``kvtrace bench sweep`` sends)."""
    seed: int = 1


class Generator:
    """``requests(n, start_ns)`` yields OTLP export requests (bytes) of about ``per_request`` spans."""

    def __init__(self, workload: Workload | None = None) -> None:
        self.w = workload or Workload()
        self._rng = random.Random(self.w.seed)

    def _instances(self, mode: str, run: int) -> dict[str, Instance | ClientInstance]:
        run_id = f"{mode}-{run:03d}" if self.w.run_every_s else ""
        return {"client": ClientInstance(run_id), **{side: Instance(role, mode, f"{'h200-a' if side == 'prefill' else 'h200-b' if side == 'decode' else 'router'}"
                                           f":{mode}:{run}", run_id)
                for side, role in (("router", semconv.Role.ROUTER), ("prefill", semconv.Role.PRODUCER),
                                   ("decode", semconv.Role.CONSUMER))}}

    def requests(self, n: int, start_ns: int, per_request: int = 500) -> Iterator[bytes]:
        rng, w = self._rng, self.w
        grouped: dict[Instance, list[bytes]] = {}
        spans_in = 0
        t = start_ns
        for i in range(n):
            t += int(rng.expovariate(w.rate_per_s) * 1e9)
            if w.run_every_s:
                run = int((t - start_ns) / 1e9 // w.run_every_s)
                mode = "push" if run % 2 == 0 else "pull"
            else:
                run, mode = 0, "push" if rng.random() < w.push_share else "pull"
            instances = self._instances(mode, run)
            for side, span in self.request_spans(i, mode, t):
                grouped.setdefault(instances[side], []).append(span)
                spans_in += 1
            if spans_in >= per_request:
                yield self._encode(grouped)
                grouped, spans_in = {}, 0
        if grouped:
            yield self._encode(grouped)

    @staticmethod
    def _encode(grouped: dict[Instance, list[bytes]]) -> bytes:
        return b"".join(field(1, field(1, inst.resource()) + field(2, _SCOPE + b"".join(field(2, s) for s in spans)))
                        for inst, spans in grouped.items())

    def request_spans(self, i: int, mode: str, t0: int, skew_ns: dict[str, int] | None = None) -> list[tuple[str, bytes]]:
        """One request's spans as (side, span bytes); ``skew_ns``: each side's clock ahead of the router's."""
        rng, w = self._rng, self.w
        trace_id = rng.getrandbits(128).to_bytes(16, "big")
        root_id = rng.getrandbits(64).to_bytes(8, "big")
        tokens = max(16, min(32_000, int(rng.lognormvariate(math.log(w.median_tokens), 0.9))))
        blocks = -(-tokens // 128)
        kv_bytes = blocks * 128 * w.kv_bytes_per_token
        request_attr = field(9, key_value(semconv.ATTR_REQUEST_ID, f"cmpl-syn{i}-0"))
        out: list[tuple[str, bytes]] = []
        failed = rng.random() < w.failure_rate
        drop_completion = rng.random() < w.incomplete_rate

        skews = skew_ns or {}

        def put(side: str, stage: Stage, start_ms: float, end_ms: float, extra: bytes = b"", error: str | None = None):
            at = t0 + skews.get(side, 0)
            out.append((side, _span(trace_id, rng.getrandbits(64).to_bytes(8, "big"), root_id, stage,
                                    at + int(start_ms * MS), at + int(end_ms * MS), request_attr + extra, error)))

        load = rng.random()  # how busy the engines are for this request
        route = 0.05 + rng.random() * 0.2
        put("router", Stage.PD_ROUTE, 0.0, route)
        p_in = route + 1.2 + tokens * 0.0015  # HTTP and tokenisation on P
        put("prefill", Stage.P_INPUT, route + 0.3, p_in)
        p_queue = rng.expovariate(1 / (2 + 25 * load ** 3))
        prefill = 8 + tokens * 0.018 * (1 + 0.15 * rng.random())
        put("prefill", Stage.P_QUEUE, p_in, p_in + p_queue)
        p_start = p_in + p_queue
        p_end = p_start + prefill
        put("prefill", Stage.PREFILL, p_start, p_end, field(9, key_value(semconv.ATTR_INPUT_TOKENS, tokens)))
        wire = 0.4 + kv_bytes / 18e9 * 1e3 * (1 + 0.3 * rng.random())
        descriptors = blocks * 64
        transfer = (field(9, key_value(semconv.ATTR_TRANSFER_BYTES, kv_bytes))
                    + field(9, key_value(semconv.ATTR_TRANSFER_DESCRIPTORS, descriptors))
                    + field(9, key_value(semconv.ATTR_TRANSFER_POST_US, int(20 + descriptors * 0.05)))
                    + field(9, key_value(semconv.ATTR_TRANSFER_XFER_US, int(wire * 1e3 * 0.9))))
        error = semconv.FailureCause.TRANSFER_FAILED.value if failed else None
        allocation_attrs = (field(9, key_value(semconv.ATTR_INPUT_TOKENS, tokens))
                            + field(9, key_value(semconv.ATTR_BLOCK_COUNT, blocks)))
        if mode == "push":
            put("router", Stage.PREFILL_LEG, route, p_end + 0.8)
            d_in = route + 1.0 + tokens * 0.0015
            put("decode", Stage.D_INPUT, route + 0.3, d_in)
            alloc_end = d_in + 0.3 + rng.random() * 0.4
            put("decode", Stage.ALLOCATION, d_in, alloc_end, allocation_attrs)
            reg_sent = alloc_end + (0.3 if rng.random() > w.late_registration_rate else prefill * (1.1 + rng.random()))
            put("decode", Stage.REGISTRATION, alloc_end, reg_sent)
            reg_arrived = reg_sent + 0.15
            put("prefill", Stage.REGISTRATION, reg_arrived, reg_arrived)
            first, both = min(reg_arrived, p_end), max(reg_arrived, p_end) + 0.05
            order = semconv.RendezvousOrder.REGISTRATION_FIRST if reg_arrived <= p_end else semconv.RendezvousOrder.KV_FIRST
            put("prefill", Stage.RENDEZVOUS, first, both, field(9, key_value(semconv.ATTR_RENDEZVOUS_ORDER, order.value)))
            prep = 0.1 + blocks * 0.004
            put("prefill", Stage.DESCRIPTOR_PREP, both, both + prep, field(9, key_value(semconv.ATTR_ON_ENGINE_LOOP, False)))
            w_start = both + prep
            put("prefill", Stage.WRITE, w_start, w_start + wire, transfer, error)
            landed = w_start + wire
            put("prefill", Stage.COMPLETION, landed + 0.3, landed + 0.3 + rng.random() * 2)
            loop_ns = int((0.02 + rng.random() * 0.03) * MS)
            tpot = 7.0 * (1 + 0.2 * load) * (1 + 0.05 * rng.random())
        else:
            relay_start = p_end + 1.0
            put("router", Stage.PREFILL_LEG, route, relay_start)
            relay_end = relay_start + 0.4 + rng.random() * 0.3
            put("router", Stage.REGISTRATION, relay_start, relay_end)
            d_in = relay_end + 1.0 + tokens * 0.0015
            put("decode", Stage.D_INPUT, relay_end + 0.3, d_in)
            alloc_end = d_in + 0.3 + rng.random() * 0.4 + rng.expovariate(1 / (1 + 8 * load ** 2))
            put("decode", Stage.ALLOCATION, d_in, alloc_end, allocation_attrs)
            prep = 0.2 + blocks * 0.012
            step = rng.expovariate(1 / (0.5 + 6 * load ** 2))  # D's step reaches the READ after its forward
            put("decode", Stage.READ_WAIT, alloc_end, alloc_end + step)
            alloc_end += step
            put("decode", Stage.DESCRIPTOR_PREP, alloc_end, alloc_end + prep, field(9, key_value(semconv.ATTR_ON_ENGINE_LOOP, True)))
            r_start = alloc_end + prep
            put("decode", Stage.READ, r_start, r_start + wire, transfer, error)
            landed = r_start + wire
            put("prefill", Stage.COMPLETION, landed + 0.3, landed + 0.8)
            loop_ns = int((prep + 0.05) * MS)
            tpot = 7.0 * (1 + 0.45 * load) * (1 + 0.05 * rng.random()) + prep * 0.3
        done = landed + 0.2 + rng.expovariate(1 / (0.8 + 10 * load ** 3))  # the scheduler sees it next step
        if not drop_completion:
            put("decode", Stage.COMPLETION, landed, done, field(9, key_value(semconv.ATTR_ENGINE_LOOP_NS, loop_ns)))
        d_queue = rng.expovariate(1 / (0.5 + 6 * load ** 3))
        put("decode", Stage.D_QUEUE, done, done + d_queue)
        first_token = tpot * (1 + 0.2 * rng.random())
        ft_end = done + d_queue + first_token
        put("decode", Stage.FIRST_TOKEN, done + d_queue, ft_end)
        ttft = ft_end + 0.6 + rng.random() * 0.8
        put("router", Stage.DECODE_LEG, route if mode == "push" else relay_end, ttft)
        last = ttft + (w.output_tokens - 1) * tpot
        root = (field(9, key_value(semconv.ATTR_REQUEST_ID, f"cmpl-syn{i}-0"))
                + field(9, key_value(semconv.ATTR_ROUTER_TTFT_NS, int(ttft * MS)))
                + field(9, key_value(semconv.ATTR_ROUTER_LAST_TOKEN_NS, int(last * MS)))
                + field(9, key_value(semconv.ATTR_OUTPUT_TOKENS, w.output_tokens)))
        out.append(("router", _span(trace_id, root_id, b"", Stage.PD_REQUEST, t0, t0 + int((last + 0.5) * MS), root,
                                    semconv.FailureCause.UPSTREAM_ERROR.value if failed else None)))
        if w.sweep_concurrency and w.run_every_s:
            out.append(("client", _client_span(trace_id, rng.getrandbits(64).to_bytes(8, "big"), t0, ttft, tpot, last,
                                               w.output_tokens, w.sweep_concurrency[i % len(w.sweep_concurrency)],
                                               w.median_tokens)))
        return out
