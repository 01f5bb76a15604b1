"""Stage timing on the scheduler side of a connector (the engine-core main loop).

One :class:`SchedulerTracing` per scheduler-role connector. The connector facade calls it
before and after vLLM's own method; it reads ids and a clock, keeps a few integers per
request and hands records to the recorder. Nothing here changes what vLLM does.

Per request, by role:

* producer (P): ``engine.queue`` admission → scheduled (first allocation),
  ``engine.prefill`` scheduled → finished (KV ready), ``kv.completion`` (P's release)
  WRITE done / READ notification seen by the worker → the scheduler frees the blocks.
* consumer (D): ``kv.allocation`` admission → blocks allocated, ``kv.completion`` KV
  arrived at the worker → the scheduler knows, ``engine.queue`` KV ready → scheduled for
  decode, ``engine.first_token`` scheduled → first token sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrace.telemetry import semconv
from kvtrace.telemetry.context import Sampler, TraceRef, parse_traceparent, request_trace
from kvtrace.telemetry.semconv import FailureCause, Role, Stage

from kvtrace.telemetry.semconv import PARAM_RECEIVED, PARAM_TRACEPARENT, RECEIVED_PLACEHOLDER

from .protocol import REG_KEY, WorkerReport, base_request_id
from .receipt import receipt_from_tracestate


def _received_ns(request: Any) -> int:
    """When the request reached this engine's API server, on the wall clock: stamped by kvtrace's
    middleware (.receipt) in kvtrace's router's leg, or in the tracestate of a traced request from
    another router; else vLLM's own arrival_time (taken later, before tokenising); 0 if none."""
    stamped = (request.kv_transfer_params or {}).get(PARAM_RECEIVED)
    if isinstance(stamped, str) and stamped.isdigit() and stamped != RECEIVED_PLACEHOLDER:
        return int(stamped)
    if request.trace_headers and (received := receipt_from_tracestate(request.trace_headers.get("tracestate"))):
        return received
    arrival = getattr(request, "arrival_time", None)
    return int(arrival * 1e9) if arrival else 0


@dataclass(slots=True)
class _Request:
    """What the scheduler side keeps per request: a reference and a few timestamps."""

    ref: TraceRef
    request: Any
    attrs: dict
    admitted_ns: int
    scheduled_ns: int = 0  # P: first scheduled; D: scheduled for decode
    allocated_ns: int = 0  # D: its blocks allocated (pull: kv.read_wait starts)
    kv_ready_ns: int = 0  # D: the scheduler knows the KV cache arrived
    loop_ns: int = 0  # per-request connector time on the engine loop


class SchedulerTracing:
    def __init__(self, recorder: Any, sampler: Sampler, role: Role, engine_id: str, *,
                 trace_key: bytes = b"") -> None:
        self._rec = recorder
        self._trace_key = trace_key
        self._sampler = sampler
        self._producer = role is Role.PRODUCER
        self._engine_id = engine_id
        self._requests: dict[str, _Request] = {}
        self._unsent: dict[str, str] = {}  # request id -> traceparent, not yet sent to workers
        self._awaiting_first_token: dict[str, _Request] = {}
        self._loop_ns = 0

    # ------------------------------------------------------------------ helpers

    def request_id_attr(self, request_id: str) -> str:
        # the base id P, D and the router share; the recorder hashes it when asked (telemetry.privacy)
        return base_request_id(request_id)

    def _trace_ref(self, request: Any) -> TraceRef:
        """The trace this request's spans join, from the first the deployment gives: the caller's W3C
        context (vLLM hands the ``traceparent`` header over as ``trace_headers`` when its own tracing
        is on; Dynamo passes it directly), kvtrace's field in ``kv_transfer_params`` (kvtrace's router;
        in pull, P's returned params relayed to D), else a trace derived from the base request id,
        which P and D share behind any router (push proxies rebuild D's params without our field)."""
        headers = request.trace_headers
        ref = parse_traceparent(headers.get("traceparent")) if headers else None
        if ref is None:
            ref = parse_traceparent((request.kv_transfer_params or {}).get(PARAM_TRACEPARENT))
        if ref is None:
            trace_id, parent_id = request_trace(base_request_id(request.request_id), self._trace_key)
            ref = TraceRef(trace_id, parent_id, self._sampler.should_sample(trace_id))
        return ref

    def add_loop_time(self, ns: int, request_id: str | None = None) -> None:
        self._loop_ns += ns
        if request_id is not None and (state := self._requests.get(request_id)) is not None:
            state.loop_ns += ns

    # ------------------------------------------------------------------ hooks

    def on_new_request(self, request: Any) -> None:
        if not request.kv_transfer_params:
            return  # not a disaggregated request: nothing of ours to time
        ref = self._trace_ref(request)
        attrs = {semconv.ATTR_REQUEST_ID: self.request_id_attr(request.request_id),
                 semconv.ATTR_ENGINE_ID: self._engine_id}
        now = self._rec.now()
        self._requests[request.request_id] = _Request(ref, request, attrs, now)
        self._unsent[request.request_id] = ref.traceparent
        arrived = _received_ns(request)
        if arrived:
            start = self._rec.from_wall_ns(arrived)
            self._rec.record(ref, Stage.P_INPUT if self._producer else Stage.D_INPUT, min(start, now), now, attrs)

    def before_alloc(self, request: Any, num_external_tokens: int) -> bool:
        """True when this allocation is D's first one for a remote prefill (read before vLLM
        clears ``do_remote_prefill``)."""
        params = request.kv_transfer_params or {}
        return bool(params.get("do_remote_prefill")) and not self._producer

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, first_remote: bool,
                    pending_registrations: dict | None) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        now = self._rec.now()
        if self._producer:
            if not state.scheduled_ns:
                state.scheduled_ns = now
                self._rec.record(state.ref, Stage.P_QUEUE, state.admitted_ns, now, state.attrs)
            return
        if not first_remote:
            return
        attrs = {**state.attrs, semconv.ATTR_INPUT_TOKENS: request.num_prompt_tokens,
                 semconv.ATTR_BLOCK_COUNT: sum(map(len, blocks.blocks))}  # every KV-cache group's
        self._rec.record(state.ref, Stage.ALLOCATION, state.admitted_ns, now, attrs)
        state.allocated_ns = now
        if num_external_tokens <= 0:  # full local prefix hit: nothing to transfer
            state.kv_ready_ns = now
            return
        registration = (pending_registrations or {}).get(request.request_id)
        if registration is not None:  # push: the PUSH_REG payload carries our context to P
            registration[REG_KEY] = {"traceparent": state.ref.traceparent, "allocated_ns": now}

    def on_finished(self, request: Any, params: dict | None) -> None:
        """P's request finished (prefill done, KV ready); D's request ended."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if self._producer and state.scheduled_ns:
            attrs = {**state.attrs, semconv.ATTR_INPUT_TOKENS: request.num_prompt_tokens}
            self._rec.record(state.ref, Stage.PREFILL, state.scheduled_ns, self._rec.now(), attrs)
            if params is not None:  # pull: the router relays these params to D
                params[PARAM_TRACEPARENT] = state.ref.traceparent
        if not self._producer:
            self._check_first_tokens(self._rec.now())  # it may finish on its first token
            self._requests.pop(request.request_id, None)
            self._awaiting_first_token.pop(request.request_id, None)
        elif params is None:  # P kept no blocks: no release will follow
            self._requests.pop(request.request_id, None)

    def attach_traces(self, meta: Any) -> None:
        """Scheduler → worker carrier: trace contexts of requests the workers have not seen."""
        if self._unsent:
            meta.kvtrace_traces = self._unsent
            self._unsent = {}

    def on_schedule(self, scheduler_output: Any) -> None:
        """Once per schedule(): preemptions, and D requests whose KV arrived and are now scheduled."""
        now = self._rec.now()
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._on_preempted(request_id, now)
        scheduled = scheduler_output.num_scheduled_tokens
        if not self._producer and self._requests:
            for request_id, state in self._requests.items():
                if state.kv_ready_ns and not state.scheduled_ns and request_id in scheduled:
                    state.scheduled_ns = now
                    self._rec.record(state.ref, Stage.D_QUEUE, state.kv_ready_ns, now, state.attrs)
                    self._awaiting_first_token[request_id] = state
        self._check_first_tokens(now)
        self._rec.record_engine_loop(self._loop_ns)
        self._loop_ns = 0

    def on_connector_output(self, output: Any) -> None:
        report = output.kv_connector_worker_meta
        if not (output.finished_recving or output.finished_sending or output.failed_recving
                or self._awaiting_first_token or report):
            return  # most decode steps
        now = self._rec.now()
        report = report if isinstance(report, WorkerReport) else WorkerReport()
        for request_id, prepped_ns in report.prepped_ns.items():  # pull: D's step reached the READ
            state = self._requests.get(request_id)
            if state is not None and state.allocated_ns:
                self._rec.record(state.ref, Stage.READ_WAIT, state.allocated_ns,
                                 max(state.allocated_ns, min(prepped_ns, now)), state.attrs)
        finished = (output.finished_recving or set()) | (output.finished_sending or set())
        for request_id in finished:
            state = self._requests.get(request_id)
            if state is None:
                continue
            ready_ns = min(report.ready_ns.get(request_id, now), now)
            error = FailureCause.LEASE_EXPIRED.value if request_id in report.expired else None
            loop_ns = state.loop_ns + report.loop_ns.get(request_id, 0)
            attrs = {**state.attrs, semconv.ATTR_ENGINE_LOOP_NS: loop_ns}
            self._rec.record(state.ref, Stage.COMPLETION, ready_ns, now, attrs, error=error)
            if self._producer:
                self._requests.pop(request_id, None)
            else:
                state.kv_ready_ns = now
        for request_id in output.failed_recving or ():
            state = self._requests.get(request_id)
            if state is not None:
                self._rec.record(state.ref, Stage.COMPLETION, now, now, state.attrs,
                                 error=FailureCause.TRANSFER_FAILED.value)
        self._check_first_tokens(now)

    def _on_preempted(self, request_id: str, now: int) -> None:
        """The running stage ends in error; the request queues again from now."""
        state = self._requests.get(request_id)
        if state is None or not state.scheduled_ns:
            return
        stage = Stage.PREFILL if self._producer else Stage.FIRST_TOKEN
        self._rec.record(state.ref, stage, state.scheduled_ns, now, state.attrs,
                         error=FailureCause.PREEMPTED.value)
        self._awaiting_first_token.pop(request_id, None)
        state.scheduled_ns = 0
        if self._producer:
            state.admitted_ns = now  # engine.queue is recorded again when it is rescheduled
        else:
            state.kv_ready_ns = now  # its blocks were freed: D queues until scheduled again

    def on_registration_timeout(self, request_ids: list[str]) -> None:
        now = self._rec.now()
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                self._rec.record(state.ref, Stage.REGISTRATION, state.admitted_ns, now, state.attrs,
                                 error=FailureCause.REGISTRATION_TIMEOUT.value)

    def _check_first_tokens(self, now: int) -> None:
        if not self._awaiting_first_token:
            return
        done = [rid for rid, s in self._awaiting_first_token.items() if s.request.num_output_tokens > 0]
        for request_id in done:
            state = self._awaiting_first_token.pop(request_id)
            self._requests.pop(request_id, None)
            self._rec.record(state.ref, Stage.FIRST_TOKEN, state.scheduled_ns, now, state.attrs)
