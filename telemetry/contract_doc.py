"""Render the span contract in :mod:`semconv` as Markdown (``kvtrace contract``, docs/CONTRACT.md)."""

from __future__ import annotations

import functools
import inspect

from . import semconv


def _constants(prefix: str) -> list[tuple[str, str]]:
    """(value, docstring) of every ``prefix*`` string constant in semconv, in source order."""
    return [(value, _doc_of(name)) for name, value in vars(semconv).items()
            if name.startswith(prefix) and isinstance(value, str)]


@functools.cache
def _source() -> str:
    return inspect.getsource(semconv)


def _doc_of(name: str) -> str:
    """The docstring under a semconv constant, by its name, on one line."""
    source = _source()
    start = source.find(f"\n{name}: Final")
    tail = source[start:].split("\n", 2) if start >= 0 else []
    if len(tail) < 3 or not tail[2].lstrip().startswith('"""'):
        return ""
    return " ".join(tail[2].lstrip()[3:].split('"""', 1)[0].split())


def _markdown(docstring: str) -> str:
    return docstring.replace(":class:`", "`").replace(":data:`", "`").replace("``", "`")


def _read_on(key: str, prefix: str) -> str:
    """Where the collector's breakdown reads an attribute (it reads no other span attributes)."""
    if key in semconv.DETAIL_ATTRIBUTES:
        return ", ".join(f"`{semconv.STAGE_LABELS[stage]}`" for stage in semconv.DETAIL_ATTRIBUTES[key])
    if key == semconv.ATTR_REQUEST_ID:
        return "`pd_request`, else any span"
    if key == semconv.ATTR_STAGE:
        return "spans outside the stage table"
    if prefix == "RES_" and key in (semconv.RES_SERVICE_NAME, semconv.RES_SERVICE_INSTANCE_ID, semconv.RES_ROLE,
                                    semconv.RES_MODE, semconv.RES_RUN_ID, semconv.RES_HOST_NAME,
                                    semconv.RES_VLLM_VERSION, semconv.RES_NIXL_VERSION, semconv.RES_HARDWARE,
                                    semconv.RES_CONTRACT_VERSION):
        return "every resource"
    return ""


def _breakdown_section() -> list[str]:
    """The span the collector adds to each forwarded trace, and its attributes."""
    lines = ["", "## The breakdown span (added by the collector to each trace it forwards)", "",
             f"`{semconv.SPAN_BREAKDOWN}`: {_markdown(_doc_of('SPAN_BREAKDOWN'))}", "",
             f"`{semconv.SPAN_CRITICAL_SEGMENT}`: {_markdown(_doc_of('SPAN_CRITICAL_SEGMENT'))}", "",
             "| key | meaning |", "|---|---|"]
    for value, doc in _constants("BREAKDOWN_"):
        lines.append(f"| `{value}` | {_markdown(doc)} |")
        if value == semconv.BREAKDOWN_TTFT_MS:
            for table, name in ((semconv.BREAKDOWN_PART_MS, "BREAKDOWN_PART_MS"),
                                (semconv.BREAKDOWN_PART_SHARE, "BREAKDOWN_PART_SHARE")):
                keys = ", ".join(f"`{key}`" for key in table.values())
                lines.append(f"| {keys} | {_markdown(_doc_of(name))} |")
    lines.append(f"| `{semconv.CRITICAL_SIDE}` | {_markdown(_doc_of('CRITICAL_SIDE'))} |")
    return lines


def _reference_section() -> list[str]:
    """What a TTFT runs from, and which stages a complete trace has, per reference and contract version."""
    lines = ["", "## TTFT references and completeness", "", "| reference | TTFT runs |", "|---|---|"]
    lines += [f"| `{r.value}` | {semconv.TTFT_REFERENCE_MEANINGS[r]} |" for r in semconv.TtftReference]
    since = ", ".join(f"`{stage.name.lower()}` ({version})" for stage, version in semconv.STAGE_SINCE.items())
    router = ", ".join(f"`{stage.name.lower()}`" for stage in sorted(semconv.ROUTER_STAGES))
    lines += ["", f"A trace is complete when it has every stage of its mode that its reference and its senders' "
              f"contract version record: the router's stages ({router}, and pull's router `registration`) only "
              f"with the `router` reference; a stage added in a later version than its senders' only from that "
              f"version on — {since}; `handshake` never (once per remote engine). Contract version "
              f"{semconv.CONTRACT_VERSION}: {_markdown(_doc_of('CONTRACT_VERSION'))}"]
    return lines


def render() -> str:
    lines = [
        "# kvtrace span contract",
        "",
        "Generated from `kvtrace.telemetry.semconv` by `kvtrace contract`; do not edit by hand.",
        "",
        "## Stages, in lifecycle order",
        "",
        "| # | stage | span | category | recorded on | from | to |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage in semconv.STAGE_ORDER:
        spec = semconv.STAGES[stage]
        sides = ", ".join(f"{s.value} ({semconv.RECORDED_ON[(s, stage)]})" for s in spec.sides)
        lines.append(f"| {stage.value} | `{stage.name.lower()}` | `{spec.span_name}` | "
                     f"{spec.category.value} | {sides} | {spec.start} | {spec.end} |")
    lines += ["", "Stages the collector names itself, with no span of their own:", ""]
    lines += [f"- `{getattr(semconv, name)}`: {_markdown(_doc_of(name))}"
              for name in ("INGRESS_LABEL", "RELAY_LABEL", "OUTPUT_LABEL", "GATEWAY_REQUEST_LABEL")]
    lines += ["", "## Categories", "", "| category | meaning |", "|---|---|"]
    lines += [f"| `{c.value}` | {semconv.CATEGORY_MEANINGS[c]} |" for c in semconv.Category]
    lines += _reference_section()
    for title, prefix in (("Span attributes", "ATTR_"), ("Resource attributes", "RES_")):
        lines += ["", f"## {title}", "", "| key | meaning | the collector reads it on |", "|---|---|---|"]
        seen = set()
        for value, doc in _constants(prefix):
            if value not in seen:
                seen.add(value)
                lines.append(f"| `{value}` | {_markdown(doc)} | {_read_on(value, prefix)} |")
    lines += ["", "## The load generator's spans (`kvtrace bench sweep`)", "",
              f"`{semconv.SPAN_CLIENT_REQUEST}`: {_markdown(_doc_of('SPAN_CLIENT_REQUEST'))}", "",
              f"`{semconv.SPAN_RUN}`: {_markdown(_doc_of('SPAN_RUN'))}", "", "| key | meaning |", "|---|---|"]
    lines += [f"| `{value}` | {_markdown(doc)} |"
              for prefix in ("CLIENT_", "BENCH_", "RUN_") for value, doc in _constants(prefix)]
    lines += _breakdown_section()
    lines += ["", "## Closed value sets", ""]
    for enum in (semconv.Mode, semconv.Role, semconv.RendezvousOrder, semconv.HandshakeKind,
                 semconv.FailureCause, semconv.TtftReference):
        lines.append(f"- `{enum.__name__}`: " + ", ".join(f"`{m.value}`" for m in enum))
    lines += ["", f"Trace context between router, P and D, the first that reaches an engine: the caller's W3C "
              f"`traceparent` (vLLM's `trace_headers`, with its own tracing on), a `traceparent` under the key "
              f"`{semconv.PARAM_TRACEPARENT}` of vLLM's `kv_transfer_params` (kvtrace's router; P's returned "
              f"params in pull), else a trace id and parent span id derived from the base request id P and D "
              f"share (keyed BLAKE2b; the request-id hash key where one is set)."]
    lines += ["", f"Span events: `{semconv.FAILURE_EVENT}` on a failed stage, with "
              f"`{semconv.ATTR_FAILURE_CAUSE}`; the span's status is ERROR.", ""]
    return "\n".join(lines)
