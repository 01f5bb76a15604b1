"""Stage timing on the worker side: the engine loop of the worker, the push writer thread and
the handshake thread.

Two seams, both installed on the worker instance after vLLM built it:

* a delegating proxy in place of ``worker.nixl_wrapper`` (:class:`TracedNixlAgent`): every
  NIXL call passes through it, so WRITE/READ posting, completion, NIXL's own telemetry and
  notification arrival are seen without touching vLLM's logic;
* wrappers on a few private worker methods that carry request identity (which request a
  descriptor prep, a handshake or a rendezvous belongs to). Each is looked up once at
  start-up (:data:`WRAPPED_METHODS`); a missing one is named in one log line and only its
  stage is lost.

Everything recorded here is ids and ``recorder.now()``; a failure inside kvtrace is counted
and logged once, and vLLM's call proceeds with its own arguments and result.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from kvtrace.telemetry import semconv
from kvtrace.telemetry.context import TraceRef, parse_traceparent
from kvtrace.telemetry.semconv import FailureCause, HandshakeKind, Stage

from .guard import Guard
from .nixl_agent import TracedNixlAgent
from .protocol import META_TRACES, WorkerReport, base_request_id
from .push_rendezvous import _MAX_TRACKED, PUSH_REG_PREFIX, PushRendezvous, _bounded_put, _registration_ref

logger = logging.getLogger(__name__)

HEARTBEAT_PREFIX = b"HB:"

WRAPPED_METHODS = {
    "pull": ("_read_blocks_for_req", "_ensure_handshake", "_reap_expired_send_leases"),
    "push": ("_xfer_blocks_for_req", "_do_start_push_kv", "_send_registration_to_p",
             "_do_send_reg_notif", "_handle_push_reg_notif", "_pop_matching_registration",
             "_pop_matching_finished_blocks", "_ensure_handshake", "_reap_expired_send_leases"),
}


class _InFlight:
    __slots__ = ("ref", "request_id", "stage", "posted_ns", "done_ns", "state", "telemetry")

    def __init__(self, ref: TraceRef | None, request_id: str, stage: Stage, posted_ns: int) -> None:
        self.ref, self.request_id, self.stage, self.posted_ns = ref, request_id, stage, posted_ns
        self.done_ns = 0
        self.state = ""
        self.telemetry: dict[str, Any] = {}


class WorkerTracing(PushRendezvous):
    """Per worker: trace contexts by request, in-flight transfers, rendezvous halves."""

    def __init__(self, recorder: Any, mode: str, engine_id: str, guard: Guard) -> None:
        self._rec = recorder
        self._mode = mode
        self._engine_id = engine_id
        self._guard = guard
        self._traces: OrderedDict[str, TraceRef] = OrderedDict()  # base request id -> context
        self._local = threading.local()  # the request a thread is working for right now
        self._inflight: dict[Any, _InFlight] = {}
        self._ready_ns: dict[str, int] = {}
        self._report = WorkerReport()
        self._report_lock = threading.Lock()
        self._registration_arrived: dict[str, int] = {}  # push P: D request id -> ns
        self._blocks_arrived: dict[str, int] = {}  # push P: P request id -> ns
        self._handshakes: set[int] = set()

    # ------------------------------------------------------------------ contexts

    def remember(self, request_id: str, ref: TraceRef | None) -> None:
        if ref is None:
            return
        key = base_request_id(request_id)
        self._traces[key] = ref
        self._traces.move_to_end(key)
        while len(self._traces) > _MAX_TRACKED:
            self._traces.popitem(last=False)

    def ref_for(self, request_id: str) -> TraceRef | None:
        return self._traces.get(base_request_id(request_id))

    def _attrs(self, request_id: str) -> dict[str, Any]:
        return {semconv.ATTR_REQUEST_ID: base_request_id(request_id),
                semconv.ATTR_ENGINE_ID: self._engine_id}

    def on_metadata(self, metadata: Any) -> None:
        for request_id, traceparent in (getattr(metadata, META_TRACES, None) or {}).items():
            self.remember(request_id, parse_traceparent(traceparent))

    # ------------------------------------------------------------------ reports

    def mark_ready(self, request_id: str, ns: int) -> None:
        _bounded_put(self._ready_ns, request_id, ns, keep_first=True)

    def on_transfer_results(self, results: Any) -> None:
        now = self._rec.now()
        with self._report_lock:
            for request_id in (results.finished_recving or set()) | (results.finished_sending or set()):
                self._report.ready_ns[request_id] = self._ready_ns.pop(request_id, now)

    def take_report(self) -> WorkerReport | None:
        """This step's report for the scheduler, or None (most decode steps have nothing)."""
        if not self._report:
            return None
        with self._report_lock:
            report, self._report = self._report, WorkerReport()
        return report

    def add_request_loop_time(self, request_id: str, ns: int) -> None:
        with self._report_lock:
            self._report.loop_ns[request_id] = self._report.loop_ns.get(request_id, 0) + ns

    # ------------------------------------------------------------------ install

    def install(self, worker: Any) -> list[str]:
        """Put the proxy and wrappers on ``worker``; returns the names that were missing."""
        missing = []
        if hasattr(worker, "nixl_wrapper"):
            worker.nixl_wrapper = TracedNixlAgent(worker.nixl_wrapper, self)
        else:
            missing.append("nixl_wrapper")
        for name in WRAPPED_METHODS[self._mode]:
            original = getattr(worker, name, None)
            if original is None or not callable(original):
                missing.append(name)
                continue
            setattr(worker, name, getattr(self, f"_wrap{name}")(original))
        if missing:
            logger.error("kvtrace: vLLM internals not found, their stages will be missing from "
                         "traces: %s (written against vLLM 0.32.0)", ", ".join(missing))
        return missing

    # ------------------------------------------------------------------ wrappers

    def _working_for(self, request_id: str | None, ref: TraceRef | None) -> None:
        self._local.request_id = request_id
        self._local.ref = ref
        self._local.prep_start = self._rec.now()
        self._local.prep_end = 0

    def _current(self) -> tuple[str | None, TraceRef | None]:
        return getattr(self._local, "request_id", None), getattr(self._local, "ref", None)

    def _record_prep(self, request_id: str, on_engine_loop: bool) -> int:
        start, end = self._local.prep_start, self._local.prep_end
        if on_engine_loop:  # pull: the scheduler ends the request's kv.read_wait here
            with self._report_lock:
                self._report.prepped_ns.setdefault(request_id, start)
        if end:
            attrs = {**self._attrs(request_id), semconv.ATTR_ON_ENGINE_LOOP: on_engine_loop}
            self._rec.record(self._local.ref, Stage.DESCRIPTOR_PREP, start, end, attrs)
        self._local.request_id = self._local.ref = None
        return self._rec.now() - start

    def _wrap_read_blocks_for_req(self, original):
        # Pull D, engine loop: plan, prepare descriptors and post the READ for one request.
        def read_blocks_for_req(req_id, meta, *args, **kwargs):
            self._guard.run(self._working_for, req_id, self.ref_for(req_id))
            try:
                return original(req_id, meta, *args, **kwargs)
            finally:
                loop_ns = self._guard.run(self._record_prep, req_id, True)
                if loop_ns:
                    self._guard.run(self.add_request_loop_time, req_id, loop_ns)
        return read_blocks_for_req

    def _wrap_do_start_push_kv(self, original):
        # Push P, writer thread: the rendezvous is complete; handshake if needed, then WRITE.
        def do_start_push_kv(request_id, local_block_ids, registration_data, *args, **kwargs):
            ref = self.ref_for(request_id) or self._guard.run(_registration_ref, registration_data)
            self._guard.run(self._working_for, request_id, ref)
            return original(request_id, local_block_ids, registration_data, *args, **kwargs)
        return do_start_push_kv

    def _wrap_xfer_blocks_for_req(self, original):
        # Push P, writer thread: descriptor prep for every D rank, then the WRITEs are posted.
        def xfer_blocks_for_req(*args, **kwargs):
            request_id = kwargs.get("req_id", args[0] if args else None)
            self._guard.run(setattr, self._local, "prep_start", self._rec.now())
            try:
                return original(*args, **kwargs)
            finally:
                self._guard.run(self._record_prep, request_id, False)
        return xfer_blocks_for_req

    def _wrap_ensure_handshake(self, original):
        # Any thread: returns None when connected, else the Future of a handshake.
        def ensure_handshake(*args, **kwargs):
            future = original(*args, **kwargs)
            if future is not None:
                kind = HandshakeKind.NOTIF_ONLY if kwargs.get("notif_agents_only") else HandshakeKind.FULL
                self._guard.run(self._watch_handshake, future, kind)
            return future
        return ensure_handshake

    def _watch_handshake(self, future: Any, kind: HandshakeKind) -> None:
        if id(future) in self._handshakes:  # several requests can wait on one handshake
            return
        self._handshakes.add(id(future))
        request_id, ref = self._current()
        start = self._rec.now()
        attrs = {semconv.ATTR_HANDSHAKE_KIND: kind.value, semconv.ATTR_ENGINE_ID: self._engine_id}
        if request_id:
            attrs[semconv.ATTR_REQUEST_ID] = base_request_id(request_id)

        def done(f: Any) -> None:
            self._handshakes.discard(id(f))
            error = FailureCause.HANDSHAKE_FAILED.value if f.exception() is not None else None
            self._rec.record(ref, Stage.HANDSHAKE, start, self._rec.now(), attrs, error=error)

        future.add_done_callback(lambda f: self._guard.run(done, f))

    def _wrap_reap_expired_send_leases(self, original):
        def reap_expired_send_leases(done_sending, *args, **kwargs):
            before = set(done_sending)
            result = original(done_sending, *args, **kwargs)
            expired = set(done_sending) - before
            if expired:
                with self._report_lock:
                    self._report.expired |= expired
            return result
        return reap_expired_send_leases

    # ------------------------------------------------------------------ NIXL proxy hooks

    def on_prepped(self, handle: Any, operation: str, notif_msg: bytes) -> None:
        """A transfer was prepared (descriptor prep ends); remember whose it is."""
        now = self._rec.now()
        self._local.prep_end = now
        request_id, ref = self._current()
        if request_id is None and notif_msg:  # prepared outside our wrappers: use the notif id
            request_id = notif_msg.decode(errors="replace").rsplit(":", 1)[0]
        request_id = request_id or ""
        stage = Stage.WRITE if operation == "WRITE" else Stage.READ
        self._inflight[handle] = _InFlight(ref or self.ref_for(request_id), request_id, stage, now)

    def on_posted(self, handle: Any) -> None:
        flight = self._inflight.get(handle)
        if flight is not None:
            flight.posted_ns = self._rec.now()

    def on_state(self, handle: Any, state: str) -> None:
        flight = self._inflight.get(handle)
        if flight is not None and state != "PROC" and not flight.done_ns:
            flight.done_ns, flight.state = self._rec.now(), state

    def on_telemetry(self, handle: Any, telemetry: Any) -> None:
        flight = self._inflight.get(handle)
        if flight is not None and telemetry is not None:
            flight.telemetry = {
                semconv.ATTR_TRANSFER_BYTES: int(telemetry.totalBytes),
                semconv.ATTR_TRANSFER_DESCRIPTORS: int(telemetry.descCount),
                semconv.ATTR_TRANSFER_POST_US: int(telemetry.postDuration),
                semconv.ATTR_TRANSFER_XFER_US: int(telemetry.xferDuration),
            }

    def on_released(self, handle: Any) -> None:
        flight = self._inflight.pop(handle, None)
        if flight is None:
            return
        end = flight.done_ns or self._rec.now()
        error = None if flight.state in ("DONE", "") else FailureCause.TRANSFER_FAILED.value
        attrs = {**self._attrs(flight.request_id), **flight.telemetry}
        self._rec.record(flight.ref, flight.stage, flight.posted_ns, end, attrs, error=error)
        self.mark_ready(flight.request_id, end)

    def on_notifications(self, notifs: dict) -> None:
        """Completion notifications (``<request id>:<count>``) mark when a transfer landed."""
        now = self._rec.now()
        for messages in notifs.values():
            for message in messages:
                if message.startswith(PUSH_REG_PREFIX) or message.startswith(HEARTBEAT_PREFIX):
                    continue
                self.mark_ready(message.decode(errors="replace").rsplit(":", 1)[0], now)
