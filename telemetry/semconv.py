"""The span contract: every span name, attribute key, category and stage order kvtrace uses.

This module is the single source of truth for the shape of a kvtrace trace. The connector
records against it, the collector attributes against it and the dashboard labels with it.
docs/CONTRACT.md renders it as tables; ``tests/telemetry/test_semconv.py`` keeps the two in
step.

Registry names from OpenTelemetry's semantic conventions are reused where one fits
(``service.name``, ``error.type``, ``gen_ai.usage.*``); everything else lives under
``kvtrace.*``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from opentelemetry.trace import SpanKind

# --------------------------------------------------------------------------------------
# Closed value sets
# --------------------------------------------------------------------------------------


class Category(str, enum.Enum):
    """Where an instant of time to first token goes in the critical-path breakdown."""

    ROOT = "root"
    COMPUTE = "compute"
    QUEUE = "queue"
    COORDINATION = "coordination"
    WIRE = "wire"
    UNATTRIBUTED = "unattributed"


CATEGORY_MEANINGS: Final[dict[Category, str]] = {
    Category.ROOT: "The request as the router sees it; the whole that the other categories split.",
    Category.COMPUTE: "Work on the request itself: each API server rendering and tokenising the prompt "
                      "(input), the prefill forward pass on P, the first decode step on D. It grows with "
                      "the prompt and the model, not with how P and D are wired.",
    Category.QUEUE: "Waiting for an engine: in its scheduler for a slot, and (pull) for D's engine step to "
                    "reach the READ.",
    Category.COORDINATION: "Messages and book-keeping between router, P and D: routing, the router's legs "
                           "(a leg counts only after its engine's last stage: the answer's way back through "
                           "vLLM's output processing and HTTP), allocation, registration, rendezvous, "
                           "handshake, descriptors, completion.",
    Category.WIRE: "Bytes moving: the NIXL WRITE (push) or READ (pull).",
    Category.UNATTRIBUTED: "Time no span covers (assigned by the collector): HTTP delivery of each leg to its "
                           "API server before vLLM stamps its arrival, and gaps between stages.",
}

BREAKDOWN_CATEGORIES: Final[tuple[Category, ...]] = (
    Category.COMPUTE, Category.QUEUE, Category.COORDINATION, Category.WIRE, Category.UNATTRIBUTED)
"""The parts one request's TTFT is split into, in the order every table, chart and metric shows them."""


class Mode(str, enum.Enum):
    """How the KV cache crosses from P to D."""

    PUSH = "push"
    PULL = "pull"


class Role(str, enum.Enum):
    """Which side of the handoff an instance plays (vLLM's ``kv_role``, simplified)."""

    PRODUCER = "producer"
    """The prefill instance (P)."""
    CONSUMER = "consumer"
    """The decode instance (D)."""
    ROUTER = "router"
    """The P/D proxy."""


class Side(str, enum.Enum):
    """Where a stage's span is recorded."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


class RendezvousOrder(str, enum.Enum):
    """Which half of the push rendezvous reached P's writer first."""

    REGISTRATION_FIRST = "registration_first"
    """D's PUSH_REG was waiting when P's blocks were ready: prefill hid the coordination."""
    KV_FIRST = "kv_first"
    """P's blocks waited for D's registration: that wait is on the critical path."""


class TtftReference(str, enum.Enum):
    """What a request's TTFT is measured from and to: which part of the deployment the trace shows
    (the collector takes the first that fits, in this order; :data:`TTFT_REFERENCE_MEANINGS`)."""

    ROUTER = "router"
    GATEWAY = "gateway"
    ENGINE = "engine"


TTFT_REFERENCE_MEANINGS: Final[dict[TtftReference, str]] = {
    TtftReference.ROUTER: "kvtrace's router served it: from pd.request's start to the first token the router saw.",
    TtftReference.GATEWAY: "The user's gateway or router exported a span enclosing the request (the trace's "
                           "outermost span from outside the contract, e.g. one whose traceparent reached both "
                           "engines): from that span's start to D's first token (engine.first_token's end).",
    TtftReference.ENGINE: "No span from in front of the engines: from P's API server having the request "
                          "(engine.input on P, else its queue) to D's first token (engine.first_token's end).",
}


class HandshakeKind(str, enum.Enum):
    """How much of the remote agent a handshake set up."""

    FULL = "full"
    """Metadata exchange plus remote descriptor lists (needed to READ or WRITE)."""
    NOTIF_ONLY = "notif_only"
    """Just enough to send notifications (push: D → P registration)."""


# --------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------


class Stage(enum.IntEnum):
    """Every stage of a request, in lifecycle order.

    An ``IntEnum`` so the hot path records a small int, not a string. The value is the
    stage's position in the lifecycle (see :data:`STAGE_ORDER`).
    """

    PD_REQUEST = 0
    PD_ROUTE = 1
    P_INPUT = 2
    P_QUEUE = 3
    PREFILL = 4
    PREFILL_LEG = 5
    D_INPUT = 6
    ALLOCATION = 7
    READ_WAIT = 8
    REGISTRATION = 9
    RENDEZVOUS = 10
    HANDSHAKE = 11
    DESCRIPTOR_PREP = 12
    WRITE = 13
    READ = 14
    COMPLETION = 15
    D_QUEUE = 16
    FIRST_TOKEN = 17
    DECODE_LEG = 18


@dataclass(frozen=True)
class StageSpec:
    """What one stage is: its span name, category, where it is recorded and what it spans."""

    span_name: str
    category: Category
    sides: tuple[Side, ...]
    start: str
    end: str
    kind: SpanKind = SpanKind.INTERNAL


# Span names. Two stages share ``engine.queue`` (P and D); the recording instance's
# ``kvtrace.role`` resource attribute tells them apart.
SPAN_PD_REQUEST: Final = "pd.request"
SPAN_PD_ROUTE: Final = "pd.route"
SPAN_PD_PREFILL_LEG: Final = "pd.prefill_leg"
SPAN_PD_DECODE_LEG: Final = "pd.decode_leg"
SPAN_ENGINE_INPUT: Final = "engine.input"
SPAN_ENGINE_QUEUE: Final = "engine.queue"
SPAN_ENGINE_PREFILL: Final = "engine.prefill"
SPAN_KV_ALLOCATION: Final = "kv.allocation"
SPAN_KV_READ_WAIT: Final = "kv.read_wait"
SPAN_KV_REGISTRATION: Final = "kv.registration"
SPAN_KV_RENDEZVOUS: Final = "kv.rendezvous"
SPAN_KV_HANDSHAKE: Final = "kv.handshake"
SPAN_KV_DESCRIPTOR_PREP: Final = "kv.descriptor_prep"
SPAN_KV_WRITE: Final = "kv.write"
SPAN_KV_READ: Final = "kv.read"
SPAN_KV_COMPLETION: Final = "kv.completion"
SPAN_ENGINE_FIRST_TOKEN: Final = "engine.first_token"

_R, _P, _D = Side.ROUTER, Side.PREFILL, Side.DECODE

STAGES: Final[dict[Stage, StageSpec]] = {
    Stage.PD_REQUEST: StageSpec(
        SPAN_PD_REQUEST, Category.ROOT, (_R,),
        "client request in", "last byte out", SpanKind.SERVER),
    Stage.PD_ROUTE: StageSpec(
        SPAN_PD_ROUTE, Category.COORDINATION, (_R,),
        "request parsed", "P's leg written to its socket (P and D chosen, the leg built and sent)"),
    Stage.P_INPUT: StageSpec(
        SPAN_ENGINE_INPUT, Category.COMPUTE, (_P,),
        "P's API server has the request (kvtrace's middleware, else vLLM's arrival_time)",
        "P's engine admits it (after rendering, tokenising, input processing and the hand-over)"),
    Stage.P_QUEUE: StageSpec(
        SPAN_ENGINE_QUEUE, Category.QUEUE, (_P,),
        "request waiting in P's scheduler", "scheduled for prefill"),
    Stage.PREFILL: StageSpec(
        SPAN_ENGINE_PREFILL, Category.COMPUTE, (_P,),
        "scheduled for prefill", "prefill forward done, KV ready"),
    Stage.PREFILL_LEG: StageSpec(
        SPAN_PD_PREFILL_LEG, Category.COORDINATION, (_R,),
        "P's leg written to its socket", "P's answer (its kv_transfer_params) is back at the router"),
    Stage.D_INPUT: StageSpec(
        SPAN_ENGINE_INPUT, Category.COMPUTE, (_D,),
        "D's API server has the request (kvtrace's middleware, else vLLM's arrival_time)",
        "D's engine admits it (after rendering, tokenising, input processing and the hand-over)"),
    Stage.ALLOCATION: StageSpec(
        SPAN_KV_ALLOCATION, Category.COORDINATION, (_D,),
        "D admission", "D blocks allocated (update_state_after_alloc)"),
    Stage.READ_WAIT: StageSpec(
        SPAN_KV_READ_WAIT, Category.QUEUE, (_D,),
        "pull: D's blocks allocated",
        "D's worker starts preparing the READ (its engine step reached start_load_kv, after the forward)"),
    Stage.REGISTRATION: StageSpec(
        SPAN_KV_REGISTRATION, Category.COORDINATION, (_D, _P, _R),
        "push: allocation done (D); pull: P's params reach the router",
        "push: PUSH_REG sent (D) / received (P, an instant); pull: D's leg written to its socket"),
    Stage.RENDEZVOUS: StageSpec(
        SPAN_KV_RENDEZVOUS, Category.COORDINATION, (_P,),
        "first of {registration, KV ready} at P's writer", "both present"),
    Stage.HANDSHAKE: StageSpec(
        SPAN_KV_HANDSHAKE, Category.COORDINATION, (_P, _D),
        "first contact with a remote engine", "remote agent added"),
    Stage.DESCRIPTOR_PREP: StageSpec(
        SPAN_KV_DESCRIPTOR_PREP, Category.COORDINATION, (_P, _D),
        "block-id mapping starts", "make_prepped_xfer returned"),
    Stage.WRITE: StageSpec(
        SPAN_KV_WRITE, Category.WIRE, (_P,),
        "transfer() posted", "DONE observed"),
    Stage.READ: StageSpec(
        SPAN_KV_READ, Category.WIRE, (_D,),
        "transfer() posted", "DONE observed"),
    Stage.COMPLETION: StageSpec(
        SPAN_KV_COMPLETION, Category.COORDINATION, (_D, _P),
        "transfer done / notification arrives",
        "engine scheduler knows (update_connector_output)"),
    Stage.D_QUEUE: StageSpec(
        SPAN_ENGINE_QUEUE, Category.QUEUE, (_D,),
        "KV ready", "scheduled for decode"),
    Stage.FIRST_TOKEN: StageSpec(
        SPAN_ENGINE_FIRST_TOKEN, Category.COMPUTE, (_D,),
        "scheduled for decode", "first token emitted"),
    Stage.DECODE_LEG: StageSpec(
        SPAN_PD_DECODE_LEG, Category.COORDINATION, (_R,),
        "D's leg written to its socket", "the first chunk (first token) is back at the router"),
}

CONTRACT_VERSION: Final = 3
"""The version of this contract the senders record (resource attribute ``kvtrace.contract.version``).
1: the first; 2: ``engine.input`` on P and D, ``kv.read_wait``, the router's legs; 3: the version
attribute itself, traces joined behind any router (a caller's ``traceparent``, else one trace per
base request id). A sender without the attribute is read as 2 where its trace has an ``engine.input``
span, else as 1 (a collector cannot tell apart a version-2 trace that lost both input spans)."""

STAGE_SINCE: Final[dict[Stage, int]] = {
    Stage.P_INPUT: 2, Stage.D_INPUT: 2, Stage.READ_WAIT: 2, Stage.PREFILL_LEG: 2, Stage.DECODE_LEG: 2}
"""The contract version that added a stage (1 for the others): a trace is complete when it has every
stage its senders' version records."""

ROUTER_STAGES: Final[frozenset[Stage]] = frozenset(
    stage for stage, spec in STAGES.items() if spec.sides == (Side.ROUTER,))
"""The stages only kvtrace's router records (expected only where it served the request)."""

OUTPUT_LABEL: Final = "output"
"""A stage the collector derives, not a span: with no kvtrace router in front and vLLM's own tracing on,
D's first token from ``engine.first_token``'s end to D's API server having it (vLLM's ``llm_request``
span on D: its start plus ``gen_ai.latency.time_to_first_token``) — the way out through vLLM's output
processing, where kvtrace's router would see it as its decode leg (coordination). Its side is ``decode``."""

VLLM_SPAN_REQUEST: Final = "llm_request"
"""vLLM's own span per request and engine (``--otlp-traces-endpoint``), from its arrival to its end."""

VLLM_TIME_TO_FIRST_TOKEN: Final = "gen_ai.latency.time_to_first_token"
"""On ``llm_request``: seconds from the request's arrival to its first token at the API server (double)."""

INGRESS_LABEL: Final = "ingress"
"""A stage the collector derives, not a span: behind the user's gateway (the ``gateway`` reference), from
the gateway span's start to P's API server having the request — the gateway's own routing and the HTTP
delivery to P, which no span of ours splits (coordination; kvtrace's router splits it into ``pd_route``
and unattributed delivery). Its side is ``router`` (whatever routes)."""

GATEWAY_REQUEST_LABEL: Final = "gateway_request"
"""The stage label the collector gives the user's gateway span that is a trace's TTFT reference (its side
is the gateway's service): the request as the gateway saw it, category ``root`` like ``pd.request``."""

RELAY_LABEL: Final = "relay"
"""A stage the collector derives, not a span: pull, with no kvtrace router in front, the time from P's
prefill ending to D's API server having the request — the user's router taking P's answer and sending
D its leg (coordination). Its side is ``router`` (whatever routes)."""

DERIVED_STAGE_LABELS: Final = (INGRESS_LABEL, RELAY_LABEL, OUTPUT_LABEL)
"""The stages the collector names between spans (coordination), where no kvtrace router splits the time."""

STAGE_ORDER: Final[tuple[Stage, ...]] = tuple(sorted(Stage))
"""Stages in the order a request meets them (handshake, when it happens, sits before prep)."""

ROLE_SIDES: Final[dict[Role, Side]] = {Role.ROUTER: Side.ROUTER, Role.PRODUCER: Side.PREFILL, Role.CONSUMER: Side.DECODE}
"""Where an instance's spans are recorded, from its ``kvtrace.role`` (a :class:`Role` value)."""

STAGE_OF_SPAN: Final[dict[tuple[Side, str], Stage]] = {
    (side, spec.span_name): stage for stage, spec in STAGES.items() for side in spec.sides}
"""The stage a span is, from where it was recorded and its name (``engine.queue`` is P's or D's
queue): what a reader of the trace gets without reading ``kvtrace.stage``."""

STAGE_LABELS: Final[dict[Stage, str]] = {stage: stage.name.lower() for stage in Stage}

SIDE_OF_ROLE: Final[dict[str, str]] = {role.value: side.value for role, side in ROLE_SIDES.items()}
"""``kvtrace.role`` value -> side value: :data:`ROLE_SIDES` as the strings resources and stores carry."""

CATEGORY_NAMES: Final[tuple[str, ...]] = tuple(c.value for c in BREAKDOWN_CATEGORIES)
"""The parts of TTFT as strings, in the contract's order (what breakdowns, tables and metrics key by)."""

_RANK_OF_LABEL = {label: int(stage) for stage, label in STAGE_LABELS.items()}


def stage_rank(label: str) -> int:
    """A stage label's place in the lifecycle (:data:`STAGE_ORDER`); 99 for a stage outside the contract."""
    return _RANK_OF_LABEL.get(label, 99)

_ENGINE, _WRITER, _ROUTER_LOOP, _API_SERVER = "engine loop", "writer thread", "event loop", "API server"
RECORDED_ON: Final[dict[tuple[Side, Stage], str]] = {
    (_R, Stage.PD_REQUEST): _ROUTER_LOOP, (_R, Stage.PD_ROUTE): _ROUTER_LOOP, (_R, Stage.REGISTRATION): _ROUTER_LOOP,
    (_R, Stage.PREFILL_LEG): _ROUTER_LOOP, (_R, Stage.DECODE_LEG): _ROUTER_LOOP,
    (_P, Stage.P_INPUT): _API_SERVER, (_D, Stage.D_INPUT): _API_SERVER,
    (_P, Stage.P_QUEUE): _ENGINE, (_P, Stage.PREFILL): _ENGINE, (_P, Stage.COMPLETION): _ENGINE,
    (_P, Stage.REGISTRATION): _WRITER, (_P, Stage.RENDEZVOUS): _WRITER, (_P, Stage.HANDSHAKE): _WRITER,
    (_P, Stage.DESCRIPTOR_PREP): _WRITER, (_P, Stage.WRITE): _WRITER,
    (_D, Stage.ALLOCATION): _ENGINE, (_D, Stage.READ_WAIT): _ENGINE, (_D, Stage.COMPLETION): _ENGINE, (_D, Stage.D_QUEUE): _ENGINE,
    (_D, Stage.FIRST_TOKEN): _ENGINE, (_D, Stage.DESCRIPTOR_PREP): _ENGINE, (_D, Stage.READ): _ENGINE,
    (_D, Stage.HANDSHAKE): _ENGINE, (_D, Stage.REGISTRATION): _WRITER,
}
"""The thread of its process each stage is timed on (push: P's ``nixl-push-writer`` and D's
registration sender; pull: D's engine loop posts the READ; input: the API server in front of
the engine, timed by the engine from vLLM's arrival time). A waterfall draws one lane per
(side, thread)."""
"""The value of ``kvtrace.stage`` (and the ``stage`` label of metrics) for each stage."""

# --------------------------------------------------------------------------------------
# Span attributes
# --------------------------------------------------------------------------------------

PARAM_TRACEPARENT: Final = "kvtrace_traceparent"
"""Key in vLLM's ``kv_transfer_params`` carrying the W3C ``traceparent`` router → P and D (and
P's returned params → router → D in pull). vLLM passes the key on without reading it."""

PARAM_RECEIVED: Final = "kvtrace_received_ns"
"""Key in ``kv_transfer_params``, the last of the last object of a leg's body, that kvtrace's router
sends as :data:`RECEIVED_PLACEHOLDER`; kvtrace's ASGI middleware in vLLM's API server
(``--middleware kvtrace.connector.RequestReceipt``) overwrites it with the wall time the request
reached the server, so the engine's input stage starts there rather than at vLLM's own
``arrival_time`` (taken after the HTTP body is parsed and validated)."""

RECEIVED_PLACEHOLDER: Final = "0" * 19
"""19 zero digits: room for a wall-clock ns value, overwritten in place (the body keeps its length)."""

ATTR_CATEGORY: Final = "kvtrace.category"
"""The stage's :class:`Category` value; set by kvtrace on every span it exports."""

ATTR_STAGE: Final = "kvtrace.stage"
"""The :class:`Stage` name in lower case (``p_queue``, ``write``, ...); disambiguates ``engine.queue``."""

ATTR_REQUEST_ID: Final = "kvtrace.request_id"
"""The base request id (vLLM's random suffix stripped), or its hash when hashing is on."""

ATTR_REMOTE_REQUEST_ID: Final = "kvtrace.remote_request_id"
"""The peer engine's id for the same request (P's id on D, D's id on P)."""

ATTR_ENGINE_ID: Final = "kvtrace.engine_id"
"""This engine's NIXL engine id (also a resource attribute)."""

ATTR_REMOTE_ENGINE_ID: Final = "kvtrace.remote_engine_id"
"""The peer engine's NIXL engine id."""

ATTR_BLOCK_COUNT: Final = "kvtrace.block_count"
"""KV blocks the stage handled."""

ATTR_RENDEZVOUS_ORDER: Final = "kvtrace.rendezvous.order"
"""A :class:`RendezvousOrder` value; only the ``kv_first`` wait is on the critical path."""

ATTR_HANDSHAKE_KIND: Final = "kvtrace.handshake.kind"
"""A :class:`HandshakeKind` value."""

ATTR_ON_ENGINE_LOOP: Final = "kvtrace.on_engine_loop"
"""True when the stage ran on the engine's main loop (pull descriptor prep), blocking steps."""

ATTR_ENGINE_LOOP_NS: Final = "kvtrace.engine_loop_ns"
"""Per-request sum of time spent inside connector calls on the engine loop, in ns."""

ATTR_TRANSFER_BYTES: Final = "kvtrace.transfer.bytes"
"""Bytes moved by a WRITE or READ (NIXL telemetry ``totalBytes``)."""

ATTR_TRANSFER_DESCRIPTORS: Final = "kvtrace.transfer.descriptors"
"""Descriptors in the transfer (NIXL telemetry ``descCount``)."""

ATTR_TRANSFER_POST_US: Final = "kvtrace.transfer.post_us"
"""NIXL's own post time for the transfer, in µs (``postDuration``)."""

ATTR_TRANSFER_XFER_US: Final = "kvtrace.transfer.xfer_us"
"""NIXL's own transfer time, in µs (``xferDuration``)."""

ATTR_FAILURE_CAUSE: Final = "error.type"
"""Why a stage failed (a :class:`FailureCause` value); OpenTelemetry's registry name."""

ATTR_HTTP_STATUS: Final = "http.response.status_code"
"""The status the router answered the client with (on ``pd.request``; OpenTelemetry's name)."""

ATTR_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
"""Prompt tokens (OpenTelemetry GenAI convention)."""

ATTR_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
"""Completion tokens (OpenTelemetry GenAI convention)."""

ATTR_ROUTER_TTFT_NS: Final = "kvtrace.router.ttft_ns"
"""Time to first token as the router saw it, in ns from ``pd.request``'s start (on the root)."""

ATTR_ROUTER_LAST_TOKEN_NS: Final = "kvtrace.router.last_token_ns"
"""When the router saw the last token, in ns from ``pd.request``'s start (on the root); with
``gen_ai.usage.output_tokens`` it gives the request's time per output token."""

DETAIL_ATTRIBUTES: Final[dict[str, tuple[Stage, ...]]] = {
    ATTR_ROUTER_TTFT_NS: (Stage.PD_REQUEST,),
    ATTR_ROUTER_LAST_TOKEN_NS: (Stage.PD_REQUEST,),
    ATTR_OUTPUT_TOKENS: (Stage.PD_REQUEST,),
    ATTR_BLOCK_COUNT: (Stage.ALLOCATION,),
    ATTR_RENDEZVOUS_ORDER: (Stage.RENDEZVOUS,),
    ATTR_TRANSFER_BYTES: (Stage.WRITE, Stage.READ),
    ATTR_TRANSFER_DESCRIPTORS: (Stage.WRITE, Stage.READ),
    ATTR_TRANSFER_POST_US: (Stage.WRITE, Stage.READ),
    ATTR_TRANSFER_XFER_US: (Stage.WRITE, Stage.READ),
    ATTR_ENGINE_LOOP_NS: (Stage.COMPLETION,),
    ATTR_INPUT_TOKENS: (Stage.ALLOCATION, Stage.PREFILL),
}
"""The stages that carry each attribute the collector's breakdown reads (it reads no other
stage's attributes)."""

FAILURE_EVENT: Final = "kvtrace.failure"
"""Name of the span event added to a failed stage; carries :data:`ATTR_FAILURE_CAUSE`."""


class FailureCause(str, enum.Enum):
    """Closed set of failure causes a stage can end with."""

    TRANSFER_FAILED = "transfer_failed"
    LEASE_EXPIRED = "lease_expired"
    HANDSHAKE_FAILED = "handshake_failed"
    PREEMPTED = "preempted"
    RETRIED = "retried"
    REGISTRATION_TIMEOUT = "registration_timeout"
    UPSTREAM_ERROR = "upstream_error"
    """The router got an error (or nothing) from an engine: ``pd.request`` ends in error."""


# --------------------------------------------------------------------------------------
# The load generator's spans (``kvtrace bench sweep``): the client's view and run records
# --------------------------------------------------------------------------------------

SPAN_CLIENT_REQUEST: Final = "kvtrace.client.request"
"""One request as the load generator's client saw it: the parent of ``pd.request`` (the client
sends its ``traceparent``), from the request sent to the last byte read, under the resource
``service.name=kvtrace-bench`` with the run's ``kvtrace.run.id``."""

SPAN_RUN: Final = "kvtrace.run"
"""A run record: one configuration of the pair swept over its points, in a trace of its own,
with ``kvtrace.run.config``; sent when the run ends (again, if the run is recorded twice)."""

CLIENT_TTFT_NS: Final = "kvtrace.client.ttft_ns"
"""Time to first token at the client, in ns from the request written to its socket to reading the first token."""

CLIENT_TPOT_NS: Final = "kvtrace.client.tpot_ns"
"""Time per output token after the first at the client, in ns (absent with fewer than 2 tokens)."""

CLIENT_ITL_P50_NS: Final = "kvtrace.client.itl_p50_ns"
"""The request's median inter-token latency at the client, in ns."""

CLIENT_ITL_P99_NS: Final = "kvtrace.client.itl_p99_ns"
"""The request's 99th-percentile inter-token latency at the client, in ns."""

CLIENT_OUTPUT_TOKENS: Final = "kvtrace.client.output_tokens"
"""Tokens the client received."""

BENCH_RATE: Final = "kvtrace.bench.rate"
"""The point's requested arrival rate, requests per second (double; absent at fixed concurrency)."""

BENCH_CONCURRENCY: Final = "kvtrace.bench.concurrency"
"""The point's fixed concurrency (absent for Poisson arrivals)."""

BENCH_PROMPT_TOKENS: Final = "kvtrace.bench.prompt_tokens"
"""The point's prompt length, in tokens, as requested (a length distribution's median)."""

RUN_CONFIG: Final = "kvtrace.run.config"
"""A run's configuration and the load generator's per-point results, as JSON (on ``kvtrace.run``)."""

CLIENT_ATTRIBUTES: Final = (CLIENT_TTFT_NS, CLIENT_TPOT_NS, CLIENT_ITL_P50_NS, CLIENT_ITL_P99_NS,
                            CLIENT_OUTPUT_TOKENS, BENCH_RATE, BENCH_CONCURRENCY, BENCH_PROMPT_TOKENS)
"""What the collector reads on ``kvtrace.client.request`` into the request's row."""

# --------------------------------------------------------------------------------------
# The breakdown span: what the collector adds to each trace it forwards
# --------------------------------------------------------------------------------------

SPAN_BREAKDOWN: Final = "kvtrace.breakdown"
"""Made by the collector, not the engines: a child of ``pd.request`` (a root where the trace has
none) spanning the TTFT on the router's clock, one per decided trace it forwards, with the
attribution's results below, under the collector's resource (``service.name`` ``kvtrace-collector``)."""

SPAN_CRITICAL_SEGMENT: Final = "kvtrace.critical"
"""Optional (``--forward-critical-path``): one child of ``kvtrace.breakdown`` per segment of the
critical path, on the router's clock, named ``kvtrace.critical <side>.<stage>``."""

BREAKDOWN_TTFT_MS: Final = "kvtrace.breakdown.ttft_ms"
"""Time to first token as the router saw it, in ms (double)."""

BREAKDOWN_PART_MS: Final[dict[Category, str]] = {
    c: f"kvtrace.breakdown.{c.value}_ms" for c in BREAKDOWN_CATEGORIES}
"""Each part of TTFT on the critical path, in ms (double); the parts sum to the TTFT."""

BREAKDOWN_PART_SHARE: Final[dict[Category, str]] = {
    c: f"kvtrace.breakdown.{c.value}_share" for c in BREAKDOWN_CATEGORIES}
"""Each part's share of TTFT, 0 to 1 (double): what an APM can take a percentile of directly."""

BREAKDOWN_MODE: Final = "kvtrace.breakdown.mode"
"""The trace's :class:`Mode` (a span attribute here, where the resource is the collector's)."""

BREAKDOWN_RUN_ID: Final = "kvtrace.breakdown.run_id"
"""The experiment run the trace served (``kvtrace.run.id`` of its router or engines); absent if none."""

BREAKDOWN_REQUEST_ID: Final = "kvtrace.breakdown.request_id"
"""The trace's ``kvtrace.request_id`` (hashed where the senders hash it)."""

BREAKDOWN_TTFT_REFERENCE: Final = "kvtrace.breakdown.ttft_reference"
"""What the TTFT is measured from (a :class:`TtftReference` value): ``router``, ``gateway`` or ``engine``."""

BREAKDOWN_RENDEZVOUS_ORDER: Final = "kvtrace.breakdown.rendezvous_order"
"""Push: a :class:`RendezvousOrder` value; absent in pull."""

BREAKDOWN_TRANSFER_BYTES: Final = "kvtrace.breakdown.transfer_bytes"
"""KV bytes moved P -> D for the request (sum over its WRITEs or READs)."""

BREAKDOWN_PROMPT_TOKENS: Final = "kvtrace.breakdown.prompt_tokens"
"""Prompt tokens of the request (int)."""

BREAKDOWN_CRITICAL_PATH: Final = "kvtrace.breakdown.critical_path"
"""The stages on the critical path, first to last, as ``side:stage`` joined by ``>`` (gaps no
span covers are left out: their time is the unattributed part)."""

BREAKDOWN_EXPLANATION: Final = "kvtrace.breakdown.explanation"
"""The trace in one sentence, derived by rules from its critical path: the dominant part and the stage
that holds it, e.g. ``62 % coordination: the rendezvous waited 480 ms for D's registration``
(the rules: ``kvtrace.collectors.explain``). Numbers and stage names only, never prompt text."""

BREAKDOWN_COMPLETE: Final = "kvtrace.breakdown.complete"
"""True when every stage the mode expects was seen (bool)."""

BREAKDOWN_MISSING: Final = "kvtrace.breakdown.missing"
"""The expected stages not seen, ``side:stage`` joined by ``,`` (absent when complete)."""

BREAKDOWN_ERROR: Final = "kvtrace.breakdown.error"
"""True when a span of the trace ended in error (the breakdown span's status is ERROR too)."""

BREAKDOWN_PREFILL_INSTANCE: Final = "kvtrace.breakdown.prefill_instance"
"""P's ``service.instance.id``."""

BREAKDOWN_DECODE_INSTANCE: Final = "kvtrace.breakdown.decode_instance"
"""D's ``service.instance.id``."""

BREAKDOWN_PREFILL_OFFSET_MS: Final = "kvtrace.breakdown.prefill_clock_offset_ms"
"""Added to P's times to put them on the router's clock, in ms (double); absent without P's spans."""

BREAKDOWN_DECODE_OFFSET_MS: Final = "kvtrace.breakdown.decode_clock_offset_ms"
"""Added to D's times to put them on the router's clock, in ms (double); absent without D's spans."""

BREAKDOWN_PREFILL_BOUND_MS: Final = "kvtrace.breakdown.prefill_clock_bound_ms"
"""The error bound of P's offset, in ms; absent where the offset was inferred, not measured."""

BREAKDOWN_DECODE_BOUND_MS: Final = "kvtrace.breakdown.decode_clock_bound_ms"
"""The error bound of D's offset, in ms; absent where the offset was inferred, not measured."""

BREAKDOWN_CLOCK_SUSPECT: Final = "kvtrace.breakdown.clock_suspect"
"""True when a measured offset disagrees with the order of the trace's spans (bool)."""

BREAKDOWN_REVISION: Final = "kvtrace.breakdown.revision"
"""1 for a trace's first breakdown; a trace decided again (late spans) gets another breakdown
span with the next revision, which supersedes the earlier: the highest revision is final."""

BREAKDOWN_SUPERSEDES: Final = "kvtrace.breakdown.supersedes"
"""From revision 2 on: the span id (hex) of the breakdown span this one replaces."""

CRITICAL_SIDE: Final = "kvtrace.critical.side"
"""On a critical-path segment: where its stage was recorded (a :class:`Side` value, or
``unattributed`` for a gap); with ``kvtrace.stage`` and ``kvtrace.category``."""

# --------------------------------------------------------------------------------------
# Resource attributes
# --------------------------------------------------------------------------------------

RES_SERVICE_NAME: Final = "service.name"
"""``vllm-prefill``, ``vllm-decode``, ``kvtrace-router`` unless the user names it."""

RES_SERVICE_INSTANCE_ID: Final = "service.instance.id"
"""Unique per process (host, pid and a random suffix)."""

RES_HOST_NAME: Final = "host.name"
"""The host the process runs on (OpenTelemetry's name): processes on one host share one clock."""

RES_ROLE: Final = "kvtrace.role"
"""A :class:`Role` value."""

RES_MODE: Final = "kvtrace.mode"
"""A :class:`Mode` value."""

RES_VLLM_VERSION: Final = "vllm.version"
"""Installed vLLM version (``none`` where vLLM is absent, as on the router)."""

RES_NIXL_VERSION: Final = "nixl.version"
"""Installed NIXL version."""

RES_HARDWARE: Final = "kvtrace.hardware"
"""What the process runs on, in a few words: the GPUs torch sees (``1x NVIDIA H200``) or the CPU
model and the cores it may use (``cpu: Intel(R) Xeon(R) ... x2``); run records show it."""

RES_TP_RANK: Final = "kvtrace.tp_rank"
"""The tensor-parallel rank of a worker process (its transfers are that rank's share of the KV cache)."""

RES_CONTRACT_VERSION: Final = "kvtrace.contract.version"
"""The :data:`CONTRACT_VERSION` the process records (a string of digits)."""

RES_ENGINE_ID: Final = "kvtrace.engine_id"
"""This engine's NIXL engine id (the same key as the span attribute)."""

RES_RUN_ID: Final = "kvtrace.run.id"
"""The experiment run the process serves (one configuration of the pair); set it with
``OTEL_RESOURCE_ATTRIBUTES=kvtrace.run.id=...``. The collector groups breakdowns by it."""

DEFAULT_SERVICE_NAMES: Final[dict[Role, str]] = {
    Role.PRODUCER: "vllm-prefill",
    Role.CONSUMER: "vllm-decode",
    Role.ROUTER: "kvtrace-router",
}

INSTRUMENTATION_SCOPE: Final = "kvtrace"
