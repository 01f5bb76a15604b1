"""Push's rendezvous, as P's writer thread and D's registration sender live it: wrappers on the
few worker methods that carry a request's identity through the registration and the match.

* D: ``_send_registration_to_p`` (handshake with P if needed, then PUSH_REG) and
  ``_do_send_reg_notif`` (PUSH_REG sent: ``kv.registration`` from allocation to here);
* P: ``_handle_push_reg_notif`` (a PUSH_REG arrived: ``kv.registration`` received, an instant),
  ``_pop_matching_finished_blocks`` (were P's blocks already waiting? ``kv_first``) and
  ``_pop_matching_registration`` (was D's registration already waiting? ``registration_first``):
  ``kv.rendezvous`` from whichever half arrived first to both present.

A mixin of :class:`.worker_tracing.WorkerTracing`, which installs these by name
(``WRAPPED_METHODS``) and owns the state they share.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtrace.telemetry import semconv
from kvtrace.telemetry.context import TraceRef, parse_traceparent
from kvtrace.telemetry.semconv import RendezvousOrder, Stage

from .protocol import REG_KEY

PUSH_REG_PREFIX = b"PUSH_REG:"
_MAX_TRACKED = 65_536  # requests whose context a worker remembers (oldest forgotten first)


class PushRendezvous:
    """The push wrappers; the state and helpers they use (``_rec``, ``_guard``, ``_local``,
    ``ref_for``, ``remember``, ``_attrs``, the arrival tables) are :class:`.worker_tracing.WorkerTracing`'s."""

    def _wrap_send_registration_to_p(self, original):
        # Push D, writer thread: handshake with P if needed, then send PUSH_REG.
        def send_registration_to_p(req_id, reg_data, *args, **kwargs):
            ref = self.ref_for(req_id) or self._guard.run(_registration_ref, reg_data)
            self._guard.run(self._working_for, req_id, ref)
            return original(req_id, reg_data, *args, **kwargs)
        return send_registration_to_p

    def _wrap_do_send_reg_notif(self, original):
        def do_send_reg_notif(req_id, reg_data, *args, **kwargs):
            result = original(req_id, reg_data, *args, **kwargs)
            self._guard.run(self._record_registration_sent, req_id, reg_data)
            return result
        return do_send_reg_notif

    def _record_registration_sent(self, request_id: str, registration: dict) -> None:
        ref = self.ref_for(request_id) or _registration_ref(registration)
        now = self._rec.now()
        start = (registration.get(REG_KEY) or {}).get("allocated_ns", now)
        self._rec.record(ref, Stage.REGISTRATION, min(start, now), now, self._attrs(request_id))

    def _wrap_handle_push_reg_notif(self, original):
        def handle_push_reg_notif(notif, *args, **kwargs):
            self._local.registration_arrived = self._rec.now()
            self._local.registration_notif = notif
            return original(notif, *args, **kwargs)
        return handle_push_reg_notif

    def _wrap_pop_matching_finished_blocks(self, original):
        # Push P, writer: a registration arrived; are P's blocks already waiting for it?
        def pop_matching_finished_blocks(request_id, *args, **kwargs):
            match = original(request_id, *args, **kwargs)
            self._guard.run(self._on_registration, request_id, match)
            return match
        return pop_matching_finished_blocks

    def _on_registration(self, d_request_id: str, match: Any) -> None:
        arrived = getattr(self._local, "registration_arrived", 0) or self._rec.now()
        ref = self.ref_for(d_request_id)
        if ref is None:  # P has not seen this request yet: read D's context from the payload
            ref = _registration_ref(_decode_registration(getattr(self._local, "registration_notif", b"")))
            self.remember(d_request_id, ref)
        attrs = self._attrs(d_request_id)
        self._rec.record(ref, Stage.REGISTRATION, arrived, arrived, attrs)  # received on P
        if match is None:
            _bounded_put(self._registration_arrived, d_request_id, arrived)
            return
        p_request_id = match[0]
        blocks_arrived = self._blocks_arrived.pop(p_request_id, arrived)
        self._rec.record(ref or self.ref_for(p_request_id), Stage.RENDEZVOUS, blocks_arrived,
                         self._rec.now(), {**attrs, semconv.ATTR_RENDEZVOUS_ORDER:
                                           RendezvousOrder.KV_FIRST.value})

    def _wrap_pop_matching_registration(self, original):
        # Push P, writer: P's blocks arrived; is D's registration already waiting?
        def pop_matching_registration(request_id, *args, **kwargs):
            arrived = self._rec.now()
            registration = original(request_id, *args, **kwargs)
            self._guard.run(self._on_blocks, request_id, registration, arrived)
            return registration
        return pop_matching_registration

    def _on_blocks(self, p_request_id: str, registration: dict | None, arrived: int) -> None:
        if registration is None:
            _bounded_put(self._blocks_arrived, p_request_id, arrived)
            return
        d_request_id = registration.get("request_id", p_request_id)
        registered = self._registration_arrived.pop(d_request_id, arrived)
        ref = self.ref_for(p_request_id) or _registration_ref(registration)
        self._rec.record(ref, Stage.RENDEZVOUS, registered, self._rec.now(),
                         {**self._attrs(p_request_id), semconv.ATTR_RENDEZVOUS_ORDER:
                          RendezvousOrder.REGISTRATION_FIRST.value})


def _decode_registration(notif: bytes) -> dict | None:
    if not notif.startswith(PUSH_REG_PREFIX):
        return None
    decoded = msgspec.msgpack.decode(notif[len(PUSH_REG_PREFIX):])
    return decoded if isinstance(decoded, dict) else None


def _registration_ref(registration: dict | None) -> TraceRef | None:
    carried = (registration or {}).get(REG_KEY) or {}
    return parse_traceparent(carried.get("traceparent"))


def _bounded_put(table: dict, key: str, value: int, keep_first: bool = False) -> None:
    """Insert, forgetting the oldest entry past _MAX_TRACKED (requests that never finished)."""
    if keep_first and key in table:
        return
    table[key] = value
    if len(table) > _MAX_TRACKED:
        table.pop(next(iter(table)), None)
