"""What attribution produces: a request's TTFT split into parts, and each stage on the router's
clock with its critical part — plus the stage keys every part of the collector names stages by.

A stage key is ``(side, stage label)``: ``("prefill", "write")``. The sides and labels are the
contract's (:mod:`kvtrace.telemetry.semconv`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Side, Stage

ROUTER, PREFILL, DECODE = (side.value for side in (Side.ROUTER, Side.PREFILL, Side.DECODE))


STAGE_KEYS: dict[tuple[str, str], tuple[str, str]] = {}
"""Every contract and derived stage key, as one object: ``STAGE_KEYS.get(key, key)``. A tuple's hash is not
cached and dicts compare keys by identity first: keys made this way (the attribution's index, then a
few dozen lookups per trace) skip comparing both strings at each lookup."""


def _shared(key: tuple[str, str]) -> tuple[str, str]:
    return STAGE_KEYS.setdefault(key, key)


def contract_key(side: str, stage: Stage) -> tuple[str, str]:
    """A contract stage's key on one side: ``contract_key(PREFILL, Stage.WRITE)`` is ``("prefill", "write")``."""
    return _shared((side, semconv.STAGE_LABELS[stage]))


# Every contract stage's key, by where it is recorded (R_, P_, D_ where a stage has several sides).
ROOT = contract_key(ROUTER, Stage.PD_REQUEST)
ROUTE = contract_key(ROUTER, Stage.PD_ROUTE)
PREFILL_LEG = contract_key(ROUTER, Stage.PREFILL_LEG)
R_REGISTRATION = contract_key(ROUTER, Stage.REGISTRATION)
DECODE_LEG = contract_key(ROUTER, Stage.DECODE_LEG)
P_INPUT = contract_key(PREFILL, Stage.P_INPUT)
P_QUEUE = contract_key(PREFILL, Stage.P_QUEUE)
P_PREFILL = contract_key(PREFILL, Stage.PREFILL)
P_REGISTRATION = contract_key(PREFILL, Stage.REGISTRATION)
RENDEZVOUS = contract_key(PREFILL, Stage.RENDEZVOUS)
P_HANDSHAKE = contract_key(PREFILL, Stage.HANDSHAKE)
P_DESCRIPTOR_PREP = contract_key(PREFILL, Stage.DESCRIPTOR_PREP)
WRITE = contract_key(PREFILL, Stage.WRITE)
P_COMPLETION = contract_key(PREFILL, Stage.COMPLETION)
D_INPUT = contract_key(DECODE, Stage.D_INPUT)
ALLOCATION = contract_key(DECODE, Stage.ALLOCATION)
READ_WAIT = contract_key(DECODE, Stage.READ_WAIT)
D_REGISTRATION = contract_key(DECODE, Stage.REGISTRATION)
D_HANDSHAKE = contract_key(DECODE, Stage.HANDSHAKE)
D_DESCRIPTOR_PREP = contract_key(DECODE, Stage.DESCRIPTOR_PREP)
READ = contract_key(DECODE, Stage.READ)
D_COMPLETION = contract_key(DECODE, Stage.COMPLETION)
D_QUEUE = contract_key(DECODE, Stage.D_QUEUE)
FIRST_TOKEN = contract_key(DECODE, Stage.FIRST_TOKEN)
for _stage, _spec in semconv.STAGES.items():  # and those of the other sides
    for _side in _spec.sides:
        contract_key(_side.value, _stage)
# The collector's own stages: derived from spans' times, no span of their own.
INGRESS = _shared((ROUTER, semconv.INGRESS_LABEL))
"""Behind the user's gateway: its span's start -> P's API server has the request (derived, no span)."""
RELAY = _shared((ROUTER, semconv.RELAY_LABEL))
"""Pull behind another router: P's prefill done -> D's API server has the request (derived, no span)."""
D_OUTPUT = _shared((DECODE, semconv.OUTPUT_LABEL))
"""Behind another router, with vLLM's tracing on: D's first token on its way out of D's API server (derived)."""
STAGE_CATEGORY = {
    **{semconv.STAGE_LABELS[stage]: spec.category.value for stage, spec in semconv.STAGES.items()},
    **dict.fromkeys(semconv.DERIVED_STAGE_LABELS, semconv.Category.COORDINATION.value),
    # spans that enclose the request (the gateway's, vLLM's own per engine) are drawn like pd.request
    **dict.fromkeys((semconv.GATEWAY_REQUEST_LABEL, semconv.VLLM_SPAN_REQUEST), semconv.Category.ROOT.value),
}
"""Each stage's category, the contract's and the collector's own (:func:`category_of` for any stage)."""
UNLISTED_CATEGORY = semconv.Category.COORDINATION.value
"""A stage outside both counts as coordination: time the request spent on something neither P nor D computes."""


def category_of(stage: str) -> str:
    return STAGE_CATEGORY.get(stage, UNLISTED_CATEGORY)


GAP = (semconv.Category.UNATTRIBUTED.value,) * 2
"""The stage key of a critical-path segment no span covers."""
Segment = tuple[tuple[str, str], int, int]
"""A piece of the critical path: (stage key, or :data:`GAP`; start; end), on the router's clock."""
_START = operator.attrgetter("start")


@dataclass(slots=True)
class StageTiming:
    side: str
    stage: str
    category: str
    start: int  # on the router's clock
    end: int
    critical_ns: int = 0

    @property
    def duration(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Breakdown:
    trace_id: str
    request_id: str
    mode: str
    start_ns: int
    ttft_ns: int
    parts: dict[str, int]
    timings: dict[tuple[str, str], tuple[int, int, str]]  # (side, stage) -> start, end (router's clock), category
    critical_ns: dict[tuple[str, str], int]  # (side, stage) -> its time on the critical path, where > 0
    complete: bool
    missing: list[str]
    error: bool
    error_stage: tuple[str, str] | None = None  # the stage of the first span that ended in error
    error_type: str = ""  # that span's error.type
    rendezvous_order: str = ""
    engine_loop_ns: int = 0
    transfer_bytes: int = 0
    transfer_descriptors: int = 0
    transfer_post_us: int = 0
    transfer_xfer_us: int = 0
    prompt_tokens: int = 0
    prefill_instance: str = ""
    decode_instance: str = ""
    offsets_ns: dict[str, int] = field(default_factory=dict)  # added to each instance's times
    clock_bounds_ns: dict[str, int] = field(default_factory=dict)  # each measured offset's error bound
    clock_suspect: bool = False  # a measured offset disagrees with the order of this trace's spans
    run_id: str = ""
    e2e_ns: int = 0  # pd.request: client request in -> last byte out
    output_tokens: int = 0
    last_token_ns: int = 0  # from the start, as the router saw it; 0 if unknown
    block_count: int = 0  # KV blocks D allocated for the request
    client: dict[str, float] = field(default_factory=dict)  # the load generator's client span's
    # measures and point (semconv.CLIENT_ATTRIBUTES present on it), when a sweep sent the request
    segments: list[Segment] = field(default_factory=list)  # the critical path, first to last
    root_span_id: bytes = b""  # pd.request's span id (or the gateway's outer span's), b"" when the trace has none
    ttft_reference: str = semconv.TtftReference.ROUTER.value  # what TTFT runs from (semconv.TtftReference)
    explanation: str = ""  # the trace in one sentence (:func:`.explain.explain`)

    @property
    def critical_path(self) -> str:
        """The stages on the critical path, first to last: ``prefill:prefill>prefill:write>...``."""
        return ">".join([_label(key) for key in reversed(self.critical_ns)])  # the walk goes last to first

    @property
    def tpot_ns(self) -> int:
        """Time per output token after the first, as the router saw it (0 with fewer than 2 tokens)."""
        if self.output_tokens < 2 or self.last_token_ns <= self.ttft_ns:
            return 0
        return (self.last_token_ns - self.ttft_ns) // (self.output_tokens - 1)

    @property
    def kv_hold_ns(self) -> int:
        """How long D held the request's KV blocks before its data landed: from the allocation
        to the transfer's completion on D (push allocates while P prefills; pull after)."""
        allocation, done = self.timings.get(ALLOCATION), self.timings.get(D_COMPLETION)
        if allocation is None or done is None:
            return 0
        return max(0, done[0] - allocation[1])

    @property
    def stages(self) -> list[StageTiming]:
        """Each stage with its times and critical part, in order of start (the store's ``stages`` view)."""
        stages = [StageTiming(side, stage, category, start, end, self.critical_ns.get((side, stage), 0))
                  for (side, stage), (start, end, category) in self.timings.items()]
        return sorted(stages, key=_START)


_LABELS: dict[tuple[str, str], str] = {}


def _label(key: tuple[str, str]) -> str:
    """``side:stage``, made once per stage key."""
    label = _LABELS.get(key)
    if label is None:
        label = _LABELS[key] = f"{key[0]}:{key[1]}"
    return label
