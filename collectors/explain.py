"""A decided trace in one sentence: where its TTFT went, derived by rules from the critical path.

Rules, first that applies (each has a test on a contract trace of its shape):

1. **Failed** — a span ended in error: which stage, its ``error.type``, how far into the request.
   ``Failed: D's read ended in error (timeout) 812 ms in.``
2. **Incomplete** — an expected stage never arrived: which (a whole side, or up to three stages),
   then the part that dominates what was seen, as in 3. ``Incomplete: no span from D arrived; of
   169 ms seen, 87 % compute: P's prefill of 2,000 tokens took 144 ms.``
3. **The dominant part**, then the stage that holds most of it on the critical path, in words of
   its own (a table below, per stage: the prefill names its prompt tokens, the rendezvous says
   what it waited for, a transfer its size and rate), and the runner-up part when it holds at
   least :data:`RUNNER_UP_SHARE` of TTFT. ``62 % coordination: the rendezvous waited 480 ms for
   D's registration; 30 % compute: P's prefill of 16,384 tokens took 231 ms.``

Only numbers and stage names go into the sentence: never prompt or completion text.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtrace.telemetry import semconv
from kvtrace.telemetry.semconv import Category

from . import breakdown as keys
from .breakdown import GAP, Breakdown
from .wire import native

RUNNER_UP_SHARE = 0.2
"""The second part is named too when it holds at least this share of TTFT."""
MAX_MISSING_NAMED = 3

_SIDE_NAME = {keys.ROUTER: "the router", keys.PREFILL: "P", keys.DECODE: "D"}
_KV_FIRST = semconv.RendezvousOrder.KV_FIRST.value
_REGISTRATION_FIRST = semconv.RendezvousOrder.REGISTRATION_FIRST.value
_UNATTRIBUTED = Category.UNATTRIBUTED.value


def _ms(ns: int) -> str:
    ms = ns / 1e6
    return f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.1f} ms" if ms >= 0.1 else f"{ms:.2f} ms"


def _bytes(n: int) -> str:
    """In decimal units, as the rate beside it and the dashboard's "MB per request" (a MiB beside MB/s
    read 5 % off)."""
    mb = n / 1e6
    if mb >= 1_000:
        return f"{mb / 1e3:.1f} GB"
    return f"{mb:,.0f} MB" if mb >= 10 else f"{mb:.1f} MB" if mb >= 0.1 else f"{n / 1e3:.1f} kB"


def _share(part_ns: int, ttft_ns: int) -> str:
    return f"{round(100 * part_ns / ttft_ns)} %"


def _transfer(key: tuple[str, str]) -> Callable[[Breakdown, int], str]:
    op = key[1].upper()  # WRITE, READ

    def phrase(b: Breakdown, critical: int) -> str:
        if not b.transfer_bytes:
            return f"the NIXL {op} took {_ms(critical)}"
        took = b.timings[key]
        rate = b.transfer_bytes / max(took[1] - took[0], 1)  # bytes per ns = GB/s
        speed = f"{rate:.2f} GB/s" if rate >= 0.1 else f"{rate * 1e3:.1f} MB/s"
        return f"the NIXL {op} of {_bytes(b.transfer_bytes)} took {_ms(critical)} ({speed})"
    return phrase


def _prefill(b: Breakdown, critical: int) -> str:
    tokens = f" of {b.prompt_tokens:,} tokens" if b.prompt_tokens else ""
    return f"P's prefill{tokens} took {_ms(critical)}"


def _rendezvous(b: Breakdown, critical: int) -> str:
    if b.rendezvous_order == _KV_FIRST:
        return f"the rendezvous waited {_ms(critical)} for D's registration (P's blocks were ready first)"
    if b.rendezvous_order == _REGISTRATION_FIRST:
        return f"the rendezvous took {_ms(critical)} after D's registration had arrived"
    return f"the rendezvous took {_ms(critical)}"


def _registration(b: Breakdown, critical: int) -> str:
    if b.rendezvous_order == _KV_FIRST and keys.RENDEZVOUS in b.timings:  # P's blocks were ready, waiting for it
        start, end, _ = b.timings[keys.RENDEZVOUS]
        return (f"D's registration took {_ms(critical)} to reach P, whose finished blocks waited "
                f"{_ms(end - start)} for it at the rendezvous")
    return f"D's registration took {_ms(critical)} to reach P"


_PHRASES: dict[tuple[str, str], Callable[[Breakdown, int], str]] = {  # stages whose words need more than the time
    keys.P_PREFILL: _prefill,
    keys.RENDEZVOUS: _rendezvous,
    keys.D_REGISTRATION: _registration,
    keys.WRITE: _transfer(keys.WRITE),
    keys.READ: _transfer(keys.READ),
}
_TEMPLATES: dict[tuple[str, str], str] = {  # the others: their time, in words of their own
    keys.FIRST_TOKEN: "D's first decode step took {ms}",
    keys.P_QUEUE: "the request waited {ms} in P's queue",
    keys.D_QUEUE: "the request waited {ms} in D's queue before its first decode step",
    keys.READ_WAIT: "D waited {ms} for its READ to be issued",
    keys.P_REGISTRATION: "D's registration took {ms} to be matched on P",
    keys.R_REGISTRATION: "the router's registration relay took {ms}",
    keys.P_HANDSHAKE: "the one-time NIXL handshake took {ms}",
    keys.D_HANDSHAKE: "the one-time NIXL handshake took {ms}",
    keys.P_DESCRIPTOR_PREP: "descriptor prep on P took {ms}",
    keys.D_DESCRIPTOR_PREP: "descriptor prep on D's engine loop took {ms}",
    keys.ALLOCATION: "D's block allocation took {ms}",
    keys.RELAY: "the relay from P's finished prefill to D took {ms}",
    keys.INGRESS: "the gateway took {ms} to hand the request to P",
    keys.D_OUTPUT: "the first token took {ms} to leave D's API server",
    keys.ROUTE: "the router's routing took {ms}",
    keys.PREFILL_LEG: "the router's prefill leg took {ms} beyond P's own stages",
    keys.DECODE_LEG: "the first token took {ms} from D back to the router",
}


def _stage_phrase(b: Breakdown, key: tuple[str, str], critical: int) -> str:
    phrase = _PHRASES.get(key)
    if phrase is not None:
        return phrase(b, critical)
    template = _TEMPLATES.get(key)
    if template is not None:
        return template.format(ms=_ms(critical))
    return f"{_stage_name(key)} took {_ms(critical)}"  # a stage outside the contract: named as its sender did


def _longest_gap(b: Breakdown) -> str:
    """`` (the longest, 233 ms, after P's prefill)``: where the widest uncovered segment sits."""
    gaps = [(end - start, i) for i, (key, start, end) in enumerate(b.segments) if key == GAP]
    if not gaps:
        return ""
    width, i = max(gaps)
    before = b.segments[i - 1][0] if i > 0 else None
    after = b.segments[i + 1][0] if i + 1 < len(b.segments) else None
    where = (f"between {_stage_name(before)} and {_stage_name(after)}" if before and after else
             f"after {_stage_name(before)}" if before else f"before {_stage_name(after)}" if after else "")
    if not where:
        return ""
    return f" (the longest, {_ms(width)}, {where})" if len(gaps) > 1 else f" ({where})"


def _stage_name(key: tuple[str, str]) -> str:
    side, stage = key
    return f"{_SIDE_NAME.get(side, side)}'s {stage.replace('_', ' ')}"


def _part_clause(b: Breakdown, part: str) -> str:
    share = _share(b.parts[part], b.ttft_ns)
    if part == _UNATTRIBUTED:
        return f"{share} unattributed: no span covers {_ms(b.parts[part])} of the critical path{_longest_gap(b)}"
    timings = b.timings  # each stage's category as the attribution charged it
    on_path = [(critical, key) for key, critical in b.critical_ns.items()
               if critical > 0 and key in timings and timings[key][2] == part]
    if not on_path:
        return f"{share} {part}"
    critical, key = max(on_path)
    return f"{share} {part}: {_stage_phrase(b, key, critical)}"


def _failed(b: Breakdown) -> str:
    what = f"{_stage_name(b.error_stage)} ended in error" if b.error_stage else "a span ended in error"
    cause = f" ({b.error_type})" if b.error_type else ""
    timing = b.timings.get(b.error_stage) if b.error_stage else None
    into = f" {_ms(max(0, timing[1] - b.start_ns))} in" if timing else ""
    return f"Failed: {what}{cause}{into}."


def _missing(b: Breakdown) -> str:
    """What never arrived: a whole side when none of its spans did, else the stages (a few named)."""
    absent = [side for side, instance in ((keys.PREFILL, b.prefill_instance), (keys.DECODE, b.decode_instance))
              if not instance]
    stages = [m for m in b.missing if m.partition(":")[0] not in absent]
    said = [f"no span from {_SIDE_NAME[side]} arrived" for side in absent]
    if stages:
        named = ", ".join(stages[:MAX_MISSING_NAMED]) + (" …" if len(stages) > MAX_MISSING_NAMED else "")
        said.append(f"{named} never arrived")
    return " and ".join(said)


def explain_python(b: Breakdown) -> str:
    """The trace's one sentence (rules in the module's docstring). The reference of the native ``_otlp.explain``."""
    if b.error:
        return _failed(b)
    ranked = sorted(((ns, part) for part, ns in b.parts.items() if ns > 0), reverse=True)
    if not b.complete:
        seen = f"; of {_ms(b.ttft_ns)} seen, {_part_clause(b, ranked[0][1])}" if ranked and b.ttft_ns > 0 else ""
        return f"Incomplete: {_missing(b)}{seen}."
    if not ranked or b.ttft_ns <= 0:
        return "No time to explain: the trace has no TTFT."
    clauses = [_part_clause(b, ranked[0][1])]
    if len(ranked) > 1 and ranked[1][0] >= RUNNER_UP_SHARE * b.ttft_ns:
        clauses.append(_part_clause(b, ranked[1][1]))
    return "; ".join(clauses) + "."


# The words the native half takes from here: each template split at its one "{ms}", the transfer stages'
# operation as _transfer names it.
_NATIVE_CONFIG = (GAP, _SIDE_NAME, {key: tuple(template.split("{ms}")) for key, template in _TEMPLATES.items()},
                  (keys.P_PREFILL, keys.RENDEZVOUS, keys.D_REGISTRATION, keys.WRITE, keys.READ),
                  (keys.WRITE[1].upper(), keys.READ[1].upper()), keys.PREFILL, keys.DECODE, _KV_FIRST,
                  _REGISTRATION_FIRST, _UNATTRIBUTED, RUNNER_UP_SHARE, MAX_MISSING_NAMED)
assert all(len(parts) == 2 for parts in _NATIVE_CONFIG[2].values()), "each template holds {ms} once"


def explain(b: Breakdown) -> str:
    """:func:`explain_python`, natively where the extension is built (in the attributor, over 4,000 traces in a
    loop: ~1.5 µs a trace against ~5 for the compiled Python)."""
    if native is not None:
        try:
            return native.explain(b, _NATIVE_CONFIG)
        except (OverflowError, TypeError, UnicodeError):
            pass  # a number past int64 or 2**53, a value of another type, a string UTF-8 cannot carry: Python's turn
    return explain_python(b)
