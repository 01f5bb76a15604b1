"""One trace read back: its original spans as records the Trace page shows, and the per-rank view
of stages that several tensor-parallel ranks recorded.

The spans come from the store's source as the collector decoded them (:class:`..model.SpanRow`:
side and stage already derived); only each span's own bytes are parsed again here, for the
attributes the collector did not need to read.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from kvtrace.telemetry import semconv

from ..breakdown import category_of
from ..model import SpanRow

CONTRACT_SIDES = frozenset(semconv.SIDE_OF_ROLE.values())


def origin_ns(request: dict[str, Any]) -> int:
    """A request row's start on its reference clock, ns (stored to the µs): its stages' zero."""
    return int(request["started_at"].timestamp() * 1e6) * 1000


def span_records(rows: list[SpanRow]) -> list[dict[str, Any]]:
    """The spans as dicts with every attribute, in order of start: name, ids (hex), times (ns on the
    sender's clock), status, side, stage, attributes, event names and the resource's attributes."""
    resources: dict[int, dict[str, Any]] = {}
    out = []
    for row in rows:
        resource = resources.get(id(row.origin))
        if resource is None:
            parsed = Resource.FromString(row.origin.resource)
            resource = resources[id(row.origin)] = {a.key: _scalar(a.value) for a in parsed.attributes}
        span = Span.FromString(row.raw)
        out.append({"name": row.name, "span_id": row.span_id.hex(), "parent_span_id": row.parent_span_id.hex(),
                    "start_ns": row.start, "end_ns": row.end, "status": row.status, "side": row.side,
                    "stage": row.stage, "attributes": {a.key: _scalar(a.value) for a in span.attributes},
                    "events": [e.name for e in span.events], "resource": resource})
    return sorted(out, key=lambda s: s["start_ns"])


def with_span_details(stages: list[dict], spans: list[dict]) -> list[dict]:
    """The stored stages, each with ``hover`` (its span's attributes and instance) where its span is kept."""
    first: dict[tuple[str, str], dict] = {}
    for span in spans:
        first.setdefault((span["side"], span["stage"]), span)
    out = []
    for stage in stages:
        span = first.get((stage["side"], stage["stage"]))
        if span is not None:
            shown = {k: v for k, v in span["attributes"].items() if k not in (semconv.ATTR_CATEGORY, semconv.ATTR_STAGE)}
            stage = {**stage, "hover": "<br>" + "<br>".join(f"{k}: {v}" for k, v in sorted(shown.items()))
                     + f"<br>instance: {span['resource'].get(semconv.RES_SERVICE_INSTANCE_ID, '')}"}
        out.append(stage)
    return out


def rank_stages(spans: list[dict], request: dict[str, Any]) -> list[dict]:
    """Stages that several processes of one side recorded (tensor-parallel ranks: each rank's transfer),
    one entry per process (its ``kvtrace.tp_rank``, else its place in order of start), on the request's
    reference clock in ms from its start, with its bytes and a ``lane`` of its own. ``spans``:
    :func:`span_records`; ``request``: the request row of :meth:`.reader.StoreReader.trace`."""
    by_stage: dict[tuple[str, str], dict[str, dict]] = {}
    for span in spans:
        if span["side"] not in CONTRACT_SIDES:
            continue
        instance = span["resource"].get(semconv.RES_SERVICE_INSTANCE_ID, "")
        first = by_stage.setdefault((span["side"], span["stage"]), {}).get(instance)
        if first is None or span["start_ns"] < first["start_ns"]:
            by_stage[(span["side"], span["stage"])][instance] = span
    zero = origin_ns(request)
    offsets = request.get("clock_offsets") or {}
    out = []
    for (side, stage), by_instance in by_stage.items():
        if len(by_instance) < 2:
            continue
        for order, (instance, span) in enumerate(sorted(by_instance.items(), key=lambda item: item[1]["start_ns"])):
            rank = span["resource"].get(semconv.RES_TP_RANK, order)  # the worker's own rank, else its order
            offset = offsets.get(instance, 0)
            start, end = span["start_ns"] + offset - zero, span["end_ns"] + offset - zero
            out.append({"side": side, "stage": stage, "rank": rank, "instance": instance,
                        "lane": f"{side} · {stage} · rank {rank}", "category": category_of(stage),
                        "start_ms": start / 1e6, "end_ms": end / 1e6, "duration_ms": (end - start) / 1e6,
                        "critical_ms": 0.0, "bytes": span["attributes"].get(semconv.ATTR_TRANSFER_BYTES)})
    return out


def _scalar(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else None
