"""Critical-path attribution of time to first token (TTFT).

TTFT runs from the router's arrival (``pd.request`` start) to the first token the router
saw (``kvtrace.router.ttft_ns``). Behind another router it runs from the user's gateway span, or
from P's input, to D's first token (:class:`~kvtrace.telemetry.semconv.TtftReference`). The path
is walked back from D's ``engine.first_token``:
at each stage, the predecessor that finished last (among the stages it depends on, per
mode) is taken, and the stage is charged only for the time after that predecessor ended —
so the part of a push rendezvous that waited for a prefill still running is charged to the
prefill (``registration_first``), while a rendezvous that waited for D's registration
(``kv_first``) is charged to coordination. Time between stages that no span covers (HTTP,
tokenisation, the first chunk's way back to the router) is ``unattributed``. Segments are
contiguous and clipped to [arrival, first token], so the categories sum to TTFT exactly and
none is negative. A stage the trace lacks (no kvtrace router, a dropped span, a stage an older
sender does not record) is bridged: the walk goes on to what that stage would have waited for.
A stage recorded by several processes of one side (tensor-parallel ranks) runs from the first
one's start to the last one's end: the KV cache has landed when the last rank's transfer has.

Spans from other processes are first put on the trace's router's clock, or P's where no kvtrace
router served it (:mod:`.clocks`: measured offsets with an error bound, or offsets inferred from
the order of the trace's spans).
"""

from __future__ import annotations

from typing import Any

from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Category

from .breakdown import (
    ALLOCATION, D_COMPLETION, D_DESCRIPTOR_PREP, D_HANDSHAKE, D_INPUT, D_OUTPUT, D_QUEUE, D_REGISTRATION, DECODE,
    DECODE_LEG, FIRST_TOKEN, GAP, INGRESS, P_DESCRIPTOR_PREP, P_HANDSHAKE, P_INPUT, P_PREFILL, P_QUEUE, P_REGISTRATION,
    PREFILL, PREFILL_LEG, R_REGISTRATION, READ, READ_WAIT, RELAY, RENDEZVOUS, ROOT, ROUTE, ROUTER, STAGE_CATEGORY,
    STAGE_KEYS, UNLISTED_CATEGORY, WRITE, Breakdown, Segment,
)
from .clocks import ClockAligner, ClockBook
from .explain import explain
from .model import INT32_MAX, INT64_MAX, SpanRow, finite_number, whole_number
from .wire import native

# For each stage on the critical path, the stages it waits for (the one that ended last wins).
# A stage newer senders record is listed with the one it follows in older traces (p_queue waits
# for P's input, or, without it, for the route), so those still walk the same path.
PREDECESSORS: dict[str, dict[tuple[str, str], list[tuple[str, str]]]] = {
    "push": {
        DECODE_LEG: [FIRST_TOKEN],
        D_OUTPUT: [FIRST_TOKEN],
        FIRST_TOKEN: [D_QUEUE],
        D_QUEUE: [D_COMPLETION],
        D_COMPLETION: [WRITE],
        WRITE: [P_DESCRIPTOR_PREP],
        P_DESCRIPTOR_PREP: [P_HANDSHAKE, RENDEZVOUS],
        P_HANDSHAKE: [RENDEZVOUS],
        RENDEZVOUS: [P_PREFILL, P_REGISTRATION],
        P_REGISTRATION: [D_REGISTRATION],
        D_REGISTRATION: [ALLOCATION],
        ALLOCATION: [D_INPUT, ROUTE, INGRESS],
        D_INPUT: [ROUTE, INGRESS],
        P_PREFILL: [P_QUEUE],
        P_QUEUE: [P_INPUT, ROUTE, INGRESS],
        P_INPUT: [ROUTE, INGRESS],
        ROUTE: [],
        INGRESS: [],
    },
    "pull": {
        DECODE_LEG: [FIRST_TOKEN],
        D_OUTPUT: [FIRST_TOKEN],
        FIRST_TOKEN: [D_QUEUE],
        D_QUEUE: [D_COMPLETION],
        D_COMPLETION: [READ],
        READ: [D_DESCRIPTOR_PREP],
        D_DESCRIPTOR_PREP: [D_HANDSHAKE, READ_WAIT, ALLOCATION],
        D_HANDSHAKE: [READ_WAIT, ALLOCATION],
        READ_WAIT: [ALLOCATION],
        ALLOCATION: [D_INPUT, RELAY, R_REGISTRATION],
        D_INPUT: [RELAY, R_REGISTRATION],
        RELAY: [P_PREFILL],
        R_REGISTRATION: [PREFILL_LEG, P_PREFILL],
        PREFILL_LEG: [P_PREFILL],
        P_PREFILL: [P_QUEUE],
        P_QUEUE: [P_INPUT, ROUTE, INGRESS],
        P_INPUT: [ROUTE, INGRESS],
        ROUTE: [],
        INGRESS: [],
    },
}
OPTIONAL = {P_HANDSHAKE, D_HANDSHAKE}  # once per remote engine, not per request
DERIVED = {INGRESS, RELAY, D_OUTPUT}  # the collector's, not spans: never expected, never bridged through (the
# relay never stands in for the router's registration)
EXPECTED = {mode: (set(graph) | {ROOT}) - OPTIONAL - DERIVED for mode, graph in PREDECESSORS.items()}
"""What a trace served by kvtrace's router, recorded with today's contract, has."""
_ROUTER_KEYS = frozenset((ROUTER, semconv.STAGE_LABELS[stage]) for stage in semconv.ROUTER_STAGES) | {R_REGISTRATION}
_SINCE = {(side.value, semconv.STAGE_LABELS[stage]): version for stage, version in semconv.STAGE_SINCE.items()
          for side in semconv.STAGES[stage].sides}
_CONTRACT_SIDES = frozenset({ROUTER, PREFILL, DECODE})
_ROUTER_REF, _GATEWAY_REF, _ENGINE_REF = (r.value for r in semconv.TtftReference)
_expected_cache: dict[tuple[str, str, int], frozenset] = {}


def expected_stages(mode: str, reference: str, version: int) -> frozenset:
    """The stages a complete trace has: those of its mode, less the router's where kvtrace's router did
    not serve it, less those added to the contract after its senders' version."""
    key = (mode, reference, version)
    found = _expected_cache.get(key)
    if found is None:
        stages = EXPECTED[mode] - (_ROUTER_KEYS if reference != _ROUTER_REF else set())
        found = _expected_cache[key] = frozenset(k for k in stages if _SINCE.get(k, 1) <= version)
    return found


# How a detail attribute lands in the breakdown: its field and how the spans that record it combine (TP ranks
# sum their transfers; the largest of counts recorded on both sides; the last of the router's). The largest
# value each takes: :data:`_LIMIT`.
TEXT, SUM, LARGEST, LAST = "text", "sum", "largest", "last"
_DETAIL_FIELDS: dict[str, tuple[str, str]] = {
    semconv.ATTR_RENDEZVOUS_ORDER: ("rendezvous_order", TEXT),
    semconv.ATTR_TRANSFER_BYTES: ("transfer_bytes", SUM),
    semconv.ATTR_TRANSFER_DESCRIPTORS: ("transfer_descriptors", SUM),
    semconv.ATTR_TRANSFER_POST_US: ("transfer_post_us", SUM),
    semconv.ATTR_TRANSFER_XFER_US: ("transfer_xfer_us", SUM),
    semconv.ATTR_ENGINE_LOOP_NS: ("engine_loop_ns", SUM),
    semconv.ATTR_INPUT_TOKENS: ("prompt_tokens", LARGEST),
    semconv.ATTR_OUTPUT_TOKENS: ("output_tokens", LAST),
    semconv.ATTR_ROUTER_LAST_TOKEN_NS: ("last_token_ns", LAST),
    semconv.ATTR_BLOCK_COUNT: ("block_count", LARGEST),
}
# stage label -> the detail attributes recorded on it that land in the breakdown (no other span's attributes
# are read; the router's TTFT, a detail too, is read from the root)
_DETAILS: dict[str, tuple[str, ...]] = {}
for _key, _stages in semconv.DETAIL_ATTRIBUTES.items():
    for _stage in _stages:
        if _key in _DETAIL_FIELDS:
            _label = semconv.STAGE_LABELS[_stage]
            _DETAILS[_label] = (*_DETAILS.get(_label, ()), _key)
_TTFT = semconv.ATTR_ROUTER_TTFT_NS
_CLIENT_SPAN = semconv.SPAN_CLIENT_REQUEST
_CLIENT_KEYS = frozenset(semconv.CLIENT_ATTRIBUTES)
_VLLM_SPAN, _VLLM_TTFT = semconv.VLLM_SPAN_REQUEST, semconv.VLLM_TIME_TO_FIRST_TOKEN
_NOT_OUTER = frozenset({_CLIENT_SPAN, _VLLM_SPAN})  # the load generator's; vLLM's own, one per engine
_GATEWAY_REQUEST, _ROOT_CATEGORY = semconv.GATEWAY_REQUEST_LABEL, Category.ROOT.value
_UNATTRIBUTED = Category.UNATTRIBUTED.value
_COORDINATION = Category.COORDINATION.value
_same_key = STAGE_KEYS.get


class Attributor:
    def __init__(self, clock_book: ClockBook | None = None) -> None:
        self.aligner = ClockAligner(clock_book)

    def attribute(self, trace_id: str, spans: list[SpanRow]) -> Breakdown | None:
        """The trace's breakdown; None for a trace with no kvtrace span (nothing to attribute)."""
        index, first_of, ranks, failed, mode, p_any, d_any, client = index_spans(spans)
        contract = 0  # the lowest contract version its senders declare (0: none declares one)
        undeclared = False  # a sender older than the version attribute
        for span in first_of.values():  # per process, not per span: a process records one version
            origin = span.origin
            if origin.side in _CONTRACT_SIDES:
                if origin.contract:
                    contract = min(contract, origin.contract) if contract else origin.contract
                else:
                    undeclared = True
        root = index.get(ROOT)
        if root is None and p_any is None and d_any is None and client is None:
            return None  # no kvtrace span (vLLM's own tracing, a gateway alone): not a request
        outer = _outer_span(spans, index.get(FIRST_TOKEN)) if root is None else None
        if mode not in PREDECESSORS:
            mode = "push"
        offsets, bounds, suspect = self.aligner.align(index, root, mode, p_any, d_any, first_of, outer)
        timings = timings_of(index, offsets)
        for key, by_rank in ranks.items():  # from the first rank's start to the last one's end
            shifted = [(s.start + offsets.get(s.origin.instance, 0), s.end + offsets.get(s.origin.instance, 0))
                       for s in by_rank.values()]
            timings[key] = (min(t[0] for t in shifted), max(t[1] for t in shifted), timings[key][2])
        first = timings.get(FIRST_TOKEN)
        if root is not None:
            reference = _ROUTER_REF
            start = root.start
            ttft = whole_number(root.attrs.get(_TTFT))
            end = start + ttft if ttft else (first[1] if first else root.end)
        else:
            reference = _GATEWAY_REF if outer is not None else _ENGINE_REF
            p_first = timings.get(P_INPUT) or timings.get(P_QUEUE)
            if outer is not None:  # the gateway's span: the request as it saw it, under a name of its own
                start = outer.start + offsets.get(outer.origin.instance, 0)
                outer_key = (outer.origin.side, outer.stage)
                if index.get(outer_key) is outer:
                    timings[(outer.origin.side, _GATEWAY_REQUEST)] = timings.pop(outer_key)[:2] + (_ROOT_CATEGORY,)
                if p_first is not None and p_first[0] > start:  # the gateway routing it, until P had it
                    timings[INGRESS] = (start, p_first[0], _COORDINATION)
            else:  # P's API server having it, else the earliest of P's stages, else the earliest stage
                start = p_first[0] if p_first else min((t[0] for t in timings.values()),
                                                       default=client.start if client else 0)
            end = first[1] if first else max((t[1] for t in timings.values()), default=start)
            if first is not None and d_any is not None:  # D's API server has the first token (vLLM's span)
                out = _first_token_out(spans, offsets.get(d_any.origin.instance, 0))
                if out > end:
                    timings[D_OUTPUT] = (end, out, _COORDINATION)
                    end = out
            if mode == "pull":
                _add_relay(timings)
        if end < start:  # a first token before the start: a sender's clock or its times are off; no TTFT to split
            end = start
        parts, critical, segments = walk(timings, PREDECESSORS[mode], start, end)

        if undeclared:  # an older sender: version 2 recorded engine.input, version 1 did not
            inferred = 2 if P_INPUT in index or D_INPUT in index else 1
            contract = min(contract, inferred) if contract else inferred
        missing = expected_stages(mode, reference, contract or semconv.CONTRACT_VERSION) - index.keys()
        missing = sorted(f"{side}:{stage}" for side, stage in missing) if missing else []
        breakdown = Breakdown(
            trace_id=trace_id, request_id=_request_id(root, spans), mode=mode, start_ns=start,
            ttft_ns=end - start, parts=parts, timings=timings, critical_ns=critical,
            complete=not missing, missing=missing, error=failed is not None, segments=segments,
            error_stage=(failed.origin.side, failed.stage) if failed is not None else None,
            error_type=str(failed.attrs.get(semconv.ATTR_FAILURE_CAUSE) or "") if failed is not None else "",
            root_span_id=root.span_id if root is not None else outer.span_id if outer is not None else b"",
            ttft_reference=reference,
            offsets_ns=offsets, clock_bounds_ns=bounds, clock_suspect=suspect,
            prefill_instance=p_any.origin.instance if p_any else "",
            decode_instance=d_any.origin.instance if d_any else "",
            run_id=_run_id(root, first_of),
            e2e_ns=root.end - root.start if root is not None else 0,
        )
        details(breakdown, spans)
        if client is not None:
            breakdown.client = {key: value for key, value in client.attrs.items() if key in _CLIENT_KEYS}
            if not breakdown.run_id:
                breakdown.run_id = client.origin.run_id
        breakdown.explanation = explain(breakdown)
        return breakdown


Index = tuple[dict, dict, dict, "SpanRow | None", str, "SpanRow | None", "SpanRow | None", "SpanRow | None"]


def index_spans_python(spans: list[SpanRow]) -> Index:
    """A trace's spans, indexed for its attribution: (per stage its earliest span; per process its earliest span
    (P and D can be several processes); the stages several processes of one side recorded (TP ranks), each
    process's first; the earliest span that ended in error; the mode (the first sender's that names one); a span
    from P and one from D; the load generator's client span). The reference of the native ``_otlp.index_spans``."""
    index: dict[tuple[str, str], SpanRow] = {}  # per stage, its earliest span
    failed: SpanRow | None = None  # the earliest span that ended in error
    mode = ""
    p_any = d_any = None  # a span from P and from D: their instances
    first_of: dict[str, SpanRow] = {}  # instance -> its earliest span (P and D can be several processes)
    client = None
    ranks: dict[tuple[str, str], dict[str, SpanRow]] = {}  # stages several processes recorded
    for span in spans:
        if span.name == _CLIENT_SPAN:  # the load generator's view: read, but not a stage
            client = span
            continue
        origin = span.origin
        known = first_of.get(origin.instance)
        if known is None or span.start < known.start:
            first_of[origin.instance] = span
        side = origin.side
        key = (side, span.stage)
        key = _same_key(key, key)  # the contract's object for it (STAGE_KEYS)
        seen = index.get(key)
        if seen is None:
            index[key] = span
        elif (seen.origin.instance == origin.instance or side not in _CONTRACT_SIDES) and key not in ranks:
            if span.start < seen.start:  # a stage repeated (preemption): its first time counts
                index[key] = span
        else:  # another process of the side recorded it too (a TP rank): keep each one's first
            by_rank = ranks.get(key)
            if by_rank is None:
                by_rank = ranks[key] = {seen.origin.instance: seen}
            mine = by_rank.get(origin.instance)
            if mine is None or span.start < mine.start:
                by_rank[origin.instance] = span
            if span.start < seen.start:
                index[key] = span
        if span.status == 2 and (failed is None or span.start < failed.start):
            failed = span
        if not mode:
            mode = origin.mode
        if side == PREFILL:
            p_any = p_any or span
        elif side == DECODE:
            d_any = d_any or span
    return index, first_of, ranks, failed, mode, p_any, d_any, client


# The loop's constants, for the native half (_otlp.c).
_INDEX_CONFIG = (_CLIENT_SPAN, STAGE_KEYS, _CONTRACT_SIDES, PREFILL, DECODE)


def index_spans(spans: list[SpanRow]) -> Index:
    """:func:`index_spans_python`, natively where the extension is built."""
    if native is not None:
        return native.index_spans(spans, _INDEX_CONFIG)
    return index_spans_python(spans)


def timings_of_python(index: dict[tuple[str, str], SpanRow], offsets: dict[str, int]
                      ) -> dict[tuple[str, str], tuple[int, int, str]]:
    """Each indexed stage's (start, end, category) with its process's clock offset added. The reference of the
    native ``_otlp.timings_of``."""
    timings: dict[tuple[str, str], tuple[int, int, str]] = {}
    origin = off = None
    for key, span in index.items():
        if span.origin is not origin:  # spans of one instance share their Origin
            origin = span.origin
            off = offsets.get(origin.instance, 0)
        timings[key] = (span.start + off, span.end + off, STAGE_CATEGORY.get(key[1], UNLISTED_CATEGORY))
    return timings


def timings_of(index: dict[tuple[str, str], SpanRow], offsets: dict[str, int]
               ) -> dict[tuple[str, str], tuple[int, int, str]]:
    """:func:`timings_of_python`, natively where the extension is built."""
    if native is not None:
        return native.timings_of(index, offsets, STAGE_CATEGORY, UNLISTED_CATEGORY)
    return timings_of_python(index, offsets)


TRANSFER_LIMIT = 2**40
"""The most a request's transfer fields hold (bytes: 1 TiB; µs: 12.7 days), so that a minute's sums in the
rollups' 64-bit columns fit over 8 million requests; larger values are a sender's error, left out."""
# The counts stored as 32-bit columns (requests.prompt_tokens, output_tokens, block_count), the transfer's
# fields; the others as 64-bit.
_LIMIT = {**dict.fromkeys((semconv.ATTR_INPUT_TOKENS, semconv.ATTR_OUTPUT_TOKENS, semconv.ATTR_BLOCK_COUNT),
                          INT32_MAX),
          **dict.fromkeys((semconv.ATTR_TRANSFER_BYTES, semconv.ATTR_TRANSFER_DESCRIPTORS, semconv.ATTR_TRANSFER_POST_US,
                           semconv.ATTR_TRANSFER_XFER_US), TRANSFER_LIMIT)}


def _sum(total: int, number: int, limit: int) -> int:
    """``total + number`` (ranks' values add up), or ``total`` where the sum would pass ``limit``."""
    return total + number if total + number <= limit else total


def details_python(breakdown: Breakdown, spans: list[SpanRow]) -> None:
    """The detail attributes' values into the breakdown (:data:`_DETAIL_FIELDS`: sums over the spans that
    record them, the largest of counts, the last); a value that is no whole number in its column's range is
    left out (:func:`.model.whole_number`). The reference of the native ``_otlp.details``."""
    for span in spans:
        keys = _DETAILS.get(span.stage)
        if keys is None:
            continue
        attrs = span.attrs
        for key in keys:
            value = attrs.get(key)
            if not value:
                continue
            field, how = _DETAIL_FIELDS[key]
            if how == TEXT:
                setattr(breakdown, field, str(value))
                continue
            limit = _LIMIT.get(key, INT64_MAX)
            number = whole_number(value, limit)
            if number is None:
                continue
            if how == SUM:
                number = _sum(getattr(breakdown, field), number, limit)
            elif how == LARGEST:
                number = max(getattr(breakdown, field), number)
            setattr(breakdown, field, number)


# The tables for the native half: per stage its keys; per key (field, how, limit); the ways, in its order.
_DETAILS_CONFIG = (_DETAILS, {key: (field, how, _LIMIT.get(key, INT64_MAX))
                              for key, (field, how) in _DETAIL_FIELDS.items()}, (TEXT, SUM, LARGEST, LAST))


def details(breakdown: Breakdown, spans: list[SpanRow]) -> None:
    """:func:`details_python`, natively where the extension is built."""
    if native is not None:
        native.details(breakdown, spans, _DETAILS_CONFIG)
    else:
        details_python(breakdown, spans)


def walk_python(timings: dict[tuple[str, str], tuple[int, int, str]], graph, start: int,
                end: int) -> tuple[dict[str, int], dict[tuple[str, str], int], list[Segment]]:
    """(time per category, time per stage, the segments first to last) on the critical path
    from ``end`` back to ``start``. The reference of the native ``_otlp.walk``."""
    parts = dict.fromkeys(semconv.CATEGORY_NAMES, 0)
    critical: dict[tuple[str, str], int] = {}
    segments: list[Segment] = []  # collected last to first
    if end <= start:
        return parts, critical, segments
    # the first token back at the router, else out of D's API server, else sampled
    node_key = DECODE_LEG if DECODE_LEG in timings else D_OUTPUT if D_OUTPUT in timings else FIRST_TOKEN
    if node_key not in timings:  # no first token: start from whatever ended last
        node_key = max((k for k in timings if k != ROOT), key=lambda k: timings[k][1], default=None)
    t = end
    # Each stage once at most: stages off the graph, all of no length at one instant, would each be the
    # other's predecessor for ever.
    steps = len(timings)
    # Comparisons rather than min()/max() calls: this loop runs for every trace.
    while node_key is not None and t > start and steps:
        steps -= 1
        node_start, node_end, category = timings[node_key]
        preds = graph.get(node_key)
        if preds is None:  # off the known graph: anything that ended before it (but the root)
            preds = [k for k, s in timings.items() if k != node_key and k != ROOT and s[1] <= node_start]
        pred_key, pred_end = None, start
        for key in preds:  # the predecessor that ended last (the first of equals)
            candidate = timings.get(key)
            if candidate is None:  # not in this trace: bridge to what it waits for
                if key in DERIVED:
                    continue
                key = _latest_present(graph, timings, key)
                if key is None:
                    continue
                candidate = timings[key]
            if pred_key is None or candidate[1] > pred_end:
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
            segments.append((GAP, seg_end, t))
        if seg_end > seg_start:
            if category not in parts:  # "root" on a span that is not the router's root
                category = _COORDINATION
            parts[category] += seg_end - seg_start
            critical[node_key] = seg_end - seg_start
            segments.append((node_key, seg_start, seg_end))
        t = seg_start
        node_key = pred_key
    if t > start:
        parts[_UNATTRIBUTED] += t - start
        segments.append((GAP, start, t))
    segments.reverse()
    return parts, critical, segments


# The walk's constants, for the native half (_otlp.c: the same walk in C, 2.5-3.0 µs a trace against 5.5).
_WALK_CONFIG = (frozenset(DERIVED), ROOT, GAP, semconv.CATEGORY_NAMES, _COORDINATION, _UNATTRIBUTED,
                (DECODE_LEG, D_OUTPUT, FIRST_TOKEN))


def walk(timings: dict[tuple[str, str], tuple[int, int, str]], graph, start: int,
         end: int) -> tuple[dict[str, int], dict[tuple[str, str], int], list[Segment]]:
    """:func:`walk_python`, natively where the extension is built."""
    if native is not None:
        try:
            return native.walk(timings, graph, start, end, _WALK_CONFIG)
        except OverflowError:  # a time beyond int64 (a sender's broken clock): Python's ints have no bound
            pass
    return walk_python(timings, graph, start, end)


def _latest_present(graph, timings, missing: tuple[str, str]) -> tuple[str, str] | None:
    """For a stage the trace lacks, the one of the stages it waits for (bridging those it lacks too)
    that ended last; None if none is there."""
    best, best_end = None, 0
    stack, seen = list(graph.get(missing, ())), {missing}
    while stack:
        key = stack.pop(0)
        if key in seen:
            continue
        seen.add(key)
        found = timings.get(key)
        if found is None:
            if key not in DERIVED:
                stack.extend(graph.get(key, ()))
        elif best is None or found[1] > best_end:
            best, best_end = key, found[1]
    return best


def _first_token_out(spans: list[SpanRow], d_offset: int) -> int:
    """When D's API server had the first token, from vLLM's own ``llm_request`` spans (arrival plus its
    time to first token; D's is the later of P's and D's), on D's clock shifted by ``d_offset``; 0 if none."""
    out = 0
    for span in spans:
        if span.name == _VLLM_SPAN and (ttft := _seconds_ns(span.attrs.get(_VLLM_TTFT))):
            out = max(out, span.start + ttft)
    return out + d_offset if out else 0


def _seconds_ns(value: Any) -> int | None:
    """vLLM's time to first token (seconds, a double) in ns; None for anything that is no finite duration
    under a day."""
    seconds = finite_number(value)
    return int(seconds * 1e9) if seconds is not None and 0 <= seconds < 86_400 else None


def _add_relay(timings: dict[tuple[str, str], tuple[int, int, str]]) -> None:
    """Pull behind another router: name the time from P's prefill ending to D having the request."""
    if R_REGISTRATION in timings:
        return
    prefill, arrived = timings.get(P_PREFILL), timings.get(D_INPUT) or timings.get(ALLOCATION)
    if prefill is not None and arrived is not None and arrived[0] >= prefill[1]:
        timings[RELAY] = (prefill[1], arrived[0], _COORDINATION)


def _outer_span(spans: list[SpanRow], first_token: SpanRow | None) -> SpanRow | None:
    """The user's gateway span enclosing the request: the earliest span from outside the contract whose
    parent is not in the trace (or is the load generator's client span) and that ended no earlier than
    D's first token. vLLM's own ``llm_request`` spans (one per engine, ``--otlp-traces-endpoint``) are
    never it: they sit under the span the engine received."""
    ids = {span.span_id for span in spans if span.name != _CLIENT_SPAN}
    outer = None
    for span in spans:
        if span.origin.side in _CONTRACT_SIDES or span.name in _NOT_OUTER or span.parent_span_id in ids:
            continue
        if first_token is not None and span.end < first_token.end:
            continue
        if outer is None or span.start < outer.start:
            outer = span
    return outer


def _run_id(root: SpanRow | None, first_of: dict[str, SpanRow]) -> str:
    """The run the router served, else the first the processes name. A process names one run for all its spans,
    so one span per process is read (``first_of``: each process's earliest, in order of first appearance)."""
    if root is not None and root.origin.run_id:
        return root.origin.run_id
    for span in first_of.values():
        if span.origin.run_id:
            return span.origin.run_id
    return ""


def _request_id(root: SpanRow | None, spans: list[SpanRow]) -> str:
    """The root's request id, else the first span's that has one."""
    for span in ([root] if root is not None else []) + spans:
        request_id = span.attrs.get(semconv.ATTR_REQUEST_ID)
        if request_id:
            return str(request_id)
    return ""
