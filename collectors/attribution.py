"""Critical-path attribution of time to first token (TTFT).

TTFT runs from the router's arrival (``pd.request`` start) to the first token the router
saw (``kvtrace.router.ttft_ns``). The path is walked back from D's ``engine.first_token``:
at each stage, the predecessor that finished last (among the stages it depends on, per
mode) is taken, and the stage is charged only for the time after that predecessor ended —
so the part of a push rendezvous that waited for a prefill still running is charged to the
prefill (``registration_first``), while a rendezvous that waited for D's registration
(``kv_first``) is charged to coordination. Time between stages that no span covers (HTTP,
tokenisation, the first chunk's way back to the router) is ``unattributed``. Segments are
contiguous and clipped to [arrival, first token], so the categories sum to TTFT exactly and
none is negative.

Spans from different hosts are put on the router's clock with a per-instance offset
estimated from causally ordered pairs (P admitted after the router routed; D's first token
before the router saw it; P's WRITE posted before D saw it land; D's registration sent
before P received it). Each pair bounds the offset on one side; bounds from recent traces
are intersected per instance. When zero lies inside them the clocks are taken as they are;
otherwise the offset is the middle of the intersection.
"""

from __future__ import annotations

import collections
import operator
import statistics
from dataclasses import dataclass, field

from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Category, Side, Stage

from .model import SpanRow

ROUTER, PREFILL, DECODE = (side.value for side in (Side.ROUTER, Side.PREFILL, Side.DECODE))
ROUTE = (ROUTER, semconv.STAGE_LABELS[Stage.PD_ROUTE])
ROOT = (ROUTER, semconv.STAGE_LABELS[Stage.PD_REQUEST])
FIRST_TOKEN = (DECODE, semconv.STAGE_LABELS[Stage.FIRST_TOKEN])
ALLOCATION = (DECODE, semconv.STAGE_LABELS[Stage.ALLOCATION])
D_COMPLETION = (DECODE, semconv.STAGE_LABELS[Stage.COMPLETION])

# For each stage on the critical path, the stages it waits for (the one that ended last wins).
PREDECESSORS: dict[str, dict[tuple[str, str], list[tuple[str, str]]]] = {
    "push": {
        FIRST_TOKEN: [(DECODE, "d_queue")],
        (DECODE, "d_queue"): [(DECODE, "completion")],
        (DECODE, "completion"): [(PREFILL, "write")],
        (PREFILL, "write"): [(PREFILL, "descriptor_prep")],
        (PREFILL, "descriptor_prep"): [(PREFILL, "handshake"), (PREFILL, "rendezvous")],
        (PREFILL, "handshake"): [(PREFILL, "rendezvous")],
        (PREFILL, "rendezvous"): [(PREFILL, "prefill"), (PREFILL, "registration")],
        (PREFILL, "registration"): [(DECODE, "registration")],
        (DECODE, "registration"): [(DECODE, "allocation")],
        (DECODE, "allocation"): [ROUTE],
        (PREFILL, "prefill"): [(PREFILL, "p_queue")],
        (PREFILL, "p_queue"): [ROUTE],
        ROUTE: [],
    },
    "pull": {
        FIRST_TOKEN: [(DECODE, "d_queue")],
        (DECODE, "d_queue"): [(DECODE, "completion")],
        (DECODE, "completion"): [(DECODE, "read")],
        (DECODE, "read"): [(DECODE, "descriptor_prep")],
        (DECODE, "descriptor_prep"): [(DECODE, "handshake"), (DECODE, "allocation")],
        (DECODE, "handshake"): [(DECODE, "allocation")],
        (DECODE, "allocation"): [(ROUTER, "registration")],
        (ROUTER, "registration"): [(PREFILL, "prefill")],
        (PREFILL, "prefill"): [(PREFILL, "p_queue")],
        (PREFILL, "p_queue"): [ROUTE],
        ROUTE: [],
    },
}
OPTIONAL = {(PREFILL, "handshake"), (DECODE, "handshake")}  # once per remote engine, not per request
EXPECTED = {mode: (set(graph) | {ROOT}) - OPTIONAL for mode, graph in PREDECESSORS.items()}
STAGE_CATEGORY = {semconv.STAGE_LABELS[stage]: spec.category.value for stage, spec in semconv.STAGES.items()}
"""Each contract stage's category; a stage outside the contract counts as coordination."""
# stage label -> the detail attributes recorded on it (no other span's attributes are read)
_DETAILS: dict[str, list[str]] = {}
for _key, _stages in semconv.DETAIL_ATTRIBUTES.items():
    for _stage in _stages:
        _DETAILS.setdefault(semconv.STAGE_LABELS[_stage], []).append(_key)
_TTFT = semconv.ATTR_ROUTER_TTFT_NS
CATEGORIES = semconv.BREAKDOWN_CATEGORIES
_CATEGORY_NAMES = tuple(c.value for c in CATEGORIES)
_UNATTRIBUTED = Category.UNATTRIBUTED.value
_COORDINATION = Category.COORDINATION.value
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
    rendezvous_order: str = ""
    engine_loop_ns: int = 0
    transfer_bytes: int = 0
    transfer_descriptors: int = 0
    transfer_post_us: int = 0
    transfer_xfer_us: int = 0
    prompt_tokens: int = 0
    prefill_instance: str = ""
    decode_instance: str = ""
    offsets_ns: dict[str, int] = field(default_factory=dict)
    run_id: str = ""
    e2e_ns: int = 0  # pd.request: client request in -> last byte out
    output_tokens: int = 0
    last_token_ns: int = 0  # from the start, as the router saw it; 0 if unknown
    block_count: int = 0  # KV blocks D allocated for the request

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


class _SlidingBound:
    """Max (or min) of the last ``window`` values, O(1) amortised per value (monotonic deque)."""

    def __init__(self, window: int, largest: bool) -> None:
        self._window = window
        self._largest = largest
        self._values: collections.deque[tuple[int, float]] = collections.deque()
        self._seq = 0

    def add(self, value: float) -> None:
        self._seq += 1
        keep_larger = self._largest
        values = self._values
        while values and (values[-1][1] <= value if keep_larger else values[-1][1] >= value):
            values.pop()
        values.append((self._seq, value))
        if values[0][0] <= self._seq - self._window:
            values.popleft()

    @property
    def value(self) -> float | None:
        return self._values[0][1] if self._values else None


_MEDIAN_EVERY = 16


class _InstanceClock:
    """What the last ``window`` traces say about one instance's offset."""

    __slots__ = ("lower", "upper", "mids", "median", "mids_since_median")

    def __init__(self, window: int) -> None:
        self.lower = _SlidingBound(window, largest=True)
        self.upper = _SlidingBound(window, largest=False)
        self.mids: collections.deque[float] = collections.deque(maxlen=window)
        self.median: float | None = None  # of mids, refreshed every _MEDIAN_EVERY new ones
        self.mids_since_median = 0


class OffsetEstimator:
    """Per-instance clock offset (add to the instance's times to get the reference clock),
    from the bounds of the last ``window`` traces."""

    def __init__(self, window: int = 256) -> None:
        self._window = window
        self._clocks: dict[str, _InstanceClock] = {}

    def update(self, instance: str, lower: float | None, upper: float | None) -> int:
        """Add one trace's bounds for ``instance``; returns its offset estimate."""
        clock = self._clocks.get(instance)
        if clock is None:
            clock = self._clocks[instance] = _InstanceClock(self._window)
        if lower is not None:
            clock.lower.add(lower)
        if upper is not None:
            clock.upper.add(upper)
            if lower is not None:
                clock.mids.append((lower + upper) / 2)
                clock.mids_since_median += 1
        return self._estimate(clock)

    @staticmethod
    def _estimate(clock: _InstanceClock) -> int:
        lower, upper = clock.lower.value, clock.upper.value
        if lower is not None and upper is not None and lower > upper:
            # Jitter made the intersection empty: fall back to the typical per-trace middle
            # (a median of the window, refreshed every few traces rather than sorted per trace).
            if not clock.mids:
                return int((lower + upper) / 2)
            if clock.median is None or clock.mids_since_median >= _MEDIAN_EVERY:
                clock.median, clock.mids_since_median = statistics.median(clock.mids), 0
            return int(clock.median)
        if (lower is None or lower <= 0) and (upper is None or upper >= 0):
            return 0  # the clocks are consistent with every causal pair seen: no correction
        if lower is not None and upper is not None:
            return int((lower + upper) / 2)  # skew proven: the middle of what is possible
        return int(lower if lower is not None else upper)


class Attributor:
    def __init__(self) -> None:
        self.offsets = OffsetEstimator()

    def attribute(self, trace_id: str, spans: list[SpanRow]) -> Breakdown:
        index: dict[tuple[str, str], SpanRow] = {}  # per stage, its earliest span
        error = False
        mode = ""
        p_any = d_any = None  # a span from P and from D: their instances
        for span in spans:
            origin = span.origin
            side = origin.side
            key = (side, span.stage)
            seen = index.get(key)
            if seen is None or span.start < seen.start:
                index[key] = span
            if span.status == 2:
                error = True
            if not mode:
                mode = origin.mode
            if side == PREFILL:
                p_any = p_any or span
            elif side == DECODE:
                d_any = d_any or span
        root = index.get(ROOT)
        if mode not in PREDECESSORS:
            mode = "push"
        offsets = self._offsets(index, root, mode, p_any, d_any)
        timings: dict[tuple[str, str], tuple[int, int, str]] = {}
        origin = off = None
        for key, span in index.items():
            if span.origin is not origin:  # spans of one instance share their Origin
                origin = span.origin
                off = offsets.get(origin.instance, 0)
            timings[key] = (span.start + off, span.end + off, STAGE_CATEGORY.get(key[1], _COORDINATION))
        first = timings.get(FIRST_TOKEN)
        if root is not None:
            start = root.start
            ttft = root.attrs.get(_TTFT)
            end = start + int(ttft) if ttft else (first[1] if first else root.end)
        else:
            start = min(t[0] for t in timings.values())
            end = first[1] if first else max(t[1] for t in timings.values())
        parts, critical = self._walk(timings, PREDECESSORS[mode], start, end)

        missing = EXPECTED[mode] - index.keys()
        missing = sorted(f"{side}:{stage}" for side, stage in missing) if missing else []
        breakdown = Breakdown(
            trace_id=trace_id, request_id=_request_id(root, spans), mode=mode, start_ns=start,
            ttft_ns=end - start, parts=parts, timings=timings, critical_ns=critical,
            complete=not missing, missing=missing, error=error,
            offsets_ns=offsets,
            prefill_instance=p_any.origin.instance if p_any else "",
            decode_instance=d_any.origin.instance if d_any else "",
            run_id=_run_id(root, spans),
            e2e_ns=root.end - root.start if root is not None else 0,
        )
        self._details(breakdown, spans)
        return breakdown

    # ------------------------------------------------------------------ the walk

    @staticmethod
    def _walk(timings: dict[tuple[str, str], tuple[int, int, str]], graph, start: int,
              end: int) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        """(time per category, time per stage) on the critical path from ``end`` back to ``start``."""
        parts = dict.fromkeys(_CATEGORY_NAMES, 0)
        critical: dict[tuple[str, str], int] = {}
        if end <= start:
            return parts, critical
        node_key = FIRST_TOKEN
        if node_key not in timings:  # no first token: start from whatever ended last
            node_key = max((k for k in timings if k != ROOT), key=lambda k: timings[k][1], default=None)
        t = end
        # Comparisons rather than min()/max() calls: this loop runs for every trace.
        while node_key is not None and t > start:
            node_start, node_end, category = timings[node_key]
            preds = graph.get(node_key)
            if preds is None:  # off the known graph: anything that ended before it (but the root)
                preds = [k for k, s in timings.items() if k != node_key and k != ROOT and s[1] <= node_start]
            pred_key, pred_end = None, start
            for key in preds:  # the predecessor that ended last (the first of equals)
                candidate = timings.get(key)
                if candidate is not None and (pred_key is None or candidate[1] > pred_end):
                    pred_key, pred_end = key, candidate[1]
            # This stage's segment: from when its last predecessor ended (or it started, if
            # later) to when it ended (or t, if the walk is already earlier), within [start, t].
            seg_end = node_end if node_end < t else t
            if seg_end < start:
                seg_end = start
            seg_start = node_start if node_start > pred_end else pred_end
            if seg_start < start:
                seg_start = start
            if seg_start > seg_end:
                seg_start = seg_end
            if seg_end < t:
                parts[_UNATTRIBUTED] += t - seg_end
            if seg_end > seg_start:
                if category not in parts:  # "root" on a span that is not the router's root
                    category = _COORDINATION
                parts[category] += seg_end - seg_start
                critical[node_key] = seg_end - seg_start
            t = seg_start
            node_key = pred_key
        if t > start:
            parts[_UNATTRIBUTED] += t - start
        return parts, critical

    # ------------------------------------------------------------------ clocks

    def _offsets(self, index: dict[tuple[str, str], SpanRow], root: SpanRow | None, mode: str,
                 p_any: SpanRow | None, d_any: SpanRow | None) -> dict[str, int]:
        """Offsets to the router's clock (or P's, without a router) for each instance."""
        offsets: dict[str, int] = {}
        get = index.get
        if root is not None:
            offsets[root.origin.instance] = 0
            route = get(ROUTE)
            route_end = route.end if route is not None else root.start
            ttft = root.attrs.get(_TTFT)
            first_token_at_router = root.start + int(ttft) if ttft else root.end
            relay = get((ROUTER, "registration"))  # pull: P's params relayed to D
            if p_any is not None:
                p_queue, prefill = get((PREFILL, "p_queue")), get((PREFILL, "prefill"))
                lower = route_end - p_queue.start if p_queue is not None else None
                upper = None
                if prefill is not None:
                    upper = (relay.start if relay is not None else first_token_at_router) - prefill.end
                offsets[p_any.origin.instance] = self.offsets.update(p_any.origin.instance, lower, upper)
            if d_any is not None:
                after = relay.end if mode == "pull" and relay is not None else route_end
                allocation, first = get((DECODE, "allocation")), get(FIRST_TOKEN)
                lower = after - allocation.start if allocation is not None else None
                upper = first_token_at_router - first.end if first is not None else None
                p_offset = offsets[p_any.origin.instance] if p_any else 0
                lower, upper = self._tighten_with_prefill(index, p_offset, lower, upper)
                offsets[d_any.origin.instance] = self.offsets.update(d_any.origin.instance, lower, upper)
        elif p_any is not None and d_any is not None:
            offsets[p_any.origin.instance] = 0
            lower, upper = self._tighten_with_prefill(index, 0, None, None)
            offsets[d_any.origin.instance] = self.offsets.update(d_any.origin.instance, lower, upper)
        return offsets

    @staticmethod
    def _tighten_with_prefill(index, p_offset: int, lower, upper):
        """Push: D's registration left before P received it; P posted the WRITE before D saw it land."""
        get = index.get
        d_reg, p_reg = get((DECODE, "registration")), get((PREFILL, "registration"))
        if d_reg is not None and p_reg is not None:
            bound = p_reg.start + p_offset - d_reg.end
            upper = bound if upper is None else min(upper, bound)
        write, d_done = get((PREFILL, "write")), get((DECODE, "completion"))
        if write is not None and d_done is not None:
            bound = write.start + p_offset - d_done.start
            lower = bound if lower is None else max(lower, bound)
        return lower, upper

    # ------------------------------------------------------------------ details

    @staticmethod
    def _details(breakdown: Breakdown, spans: list[SpanRow]) -> None:
        for span in spans:
            keys = _DETAILS.get(span.stage)
            if keys is None:
                continue
            attrs = span.attrs
            for key in keys:
                value = attrs.get(key)
                if not value:
                    continue
                if key == semconv.ATTR_RENDEZVOUS_ORDER:
                    breakdown.rendezvous_order = str(value)
                elif key == semconv.ATTR_TRANSFER_BYTES:
                    breakdown.transfer_bytes += int(value)
                elif key == semconv.ATTR_TRANSFER_DESCRIPTORS:
                    breakdown.transfer_descriptors += int(value)
                elif key == semconv.ATTR_TRANSFER_POST_US:
                    breakdown.transfer_post_us += int(value)
                elif key == semconv.ATTR_TRANSFER_XFER_US:
                    breakdown.transfer_xfer_us += int(value)
                elif key == semconv.ATTR_ENGINE_LOOP_NS:
                    breakdown.engine_loop_ns += int(value)
                elif key == semconv.ATTR_INPUT_TOKENS:
                    breakdown.prompt_tokens = max(breakdown.prompt_tokens, int(value))
                elif key == semconv.ATTR_OUTPUT_TOKENS:
                    breakdown.output_tokens = int(value)
                elif key == semconv.ATTR_ROUTER_LAST_TOKEN_NS:
                    breakdown.last_token_ns = int(value)
                elif key == semconv.ATTR_BLOCK_COUNT:
                    breakdown.block_count = max(breakdown.block_count, int(value))


def _run_id(root: SpanRow | None, spans: list[SpanRow]) -> str:
    """The run the router served, else the first the engines name."""
    if root is not None and root.origin.run_id:
        return root.origin.run_id
    return next((s.origin.run_id for s in spans if s.origin.run_id), "")


def _request_id(root: SpanRow | None, spans: list[SpanRow]) -> str:
    """The root's request id, else the first span's that has one."""
    for span in ([root] if root is not None else []) + spans:
        request_id = span.attrs.get(semconv.ATTR_REQUEST_ID)
        if request_id:
            return str(request_id)
    return ""
