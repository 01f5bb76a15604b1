"""Groups spans into traces and decides when a trace is ready, as the tail-sampling processor does.

Spans arrive in any order, from many processes, sometimes twice. A trace is held until
``decision_wait`` has passed since its last span arrived (stragglers from P's release
usually land just after D's first token), or until ``max_age`` since its first span, and
then handed on. Pending traces are kept in order of their last span, so a poll looks only
at the traces that are ready (and, about once a second, scans all for ``max_age``). Memory
is bounded by ``max_traces``: past it, the trace quietest the longest is handed on early and
counted. A span for a trace already handed on is late: the trace is handed on
again with it (the store replaces the trace's breakdown), from a bounded cache of recently
decided traces.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .model import SpanRow


@dataclass
class TraceBuffer:
    spans: dict[bytes, SpanRow] = field(default_factory=dict)  # span id -> span (duplicates collapse)
    first_seen: float = 0.0
    last_seen: float = 0.0
    late: bool = False


@dataclass
class AssemblerStats:
    traces_decided: int = 0
    traces_evicted: int = 0  # handed on early because max_traces was reached
    traces_late: int = 0
    duplicate_spans: int = 0


class Assembler:
    def __init__(self, on_trace: Callable[[bytes, list[SpanRow], bool], None], *,
                 decision_wait_s: float = 2.0, max_age_s: float = 30.0, max_traces: int = 50_000,
                 decided_cache: int = 50_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._on_trace = on_trace  # (trace id as bytes, spans, late)
        self._wait = decision_wait_s
        self._max_age = max_age_s
        self._max_traces = max_traces
        self._clock = clock
        self._pending: collections.OrderedDict[bytes, TraceBuffer] = collections.OrderedDict()
        self._decided: collections.OrderedDict[bytes, dict[bytes, SpanRow]] = collections.OrderedDict()
        self._decided_cache = decided_cache
        self._next_age_scan = 0.0
        self._lock = threading.Lock()
        self.stats = AssemblerStats()

    def add(self, rows: list[SpanRow]) -> None:
        now = self._clock()
        evicted = []
        pending = self._pending
        with self._lock:
            for row in rows:
                buffer = pending.get(row.trace_id)
                if buffer is None:
                    decided = self._decided.pop(row.trace_id, None)
                    buffer = TraceBuffer(dict(decided) if decided else {}, now, now, late=decided is not None)
                    if decided is not None:
                        self.stats.traces_late += 1
                    pending[row.trace_id] = buffer
                elif buffer.last_seen != now:
                    buffer.last_seen = now
                    pending.move_to_end(row.trace_id)  # keep the order of last arrival
                spans = buffer.spans
                if row.span_id in spans:
                    self.stats.duplicate_spans += 1
                spans[row.span_id] = row
            while len(self._pending) > self._max_traces:
                trace_id, buffer = self._pending.popitem(last=False)
                self.stats.traces_evicted += 1
                evicted.append((trace_id, buffer))
        self._decide_all(evicted)

    def poll(self, flush_all: bool = False) -> int:
        """Hand on every trace that is ready; returns how many."""
        now = self._clock()
        ready = []
        pending = self._pending
        with self._lock:
            if flush_all:
                ready = list(pending.items())
                pending.clear()
            while pending:  # oldest last arrival first: stop at the first still waiting
                trace_id, buffer = next(iter(pending.items()))
                if now - buffer.last_seen < self._wait:
                    break
                ready.append((trace_id, pending.pop(trace_id)))
            if pending and now >= self._next_age_scan:
                self._next_age_scan = now + min(1.0, self._max_age / 4)
                for trace_id in [t for t, b in pending.items() if now - b.first_seen >= self._max_age]:
                    ready.append((trace_id, pending.pop(trace_id)))
        self._decide_all(ready)
        return len(ready)

    def pending(self) -> int:
        return len(self._pending)

    def forget(self, trace_ids: set[bytes]) -> None:
        """Drop these traces undecided (their spans are another collector's to assemble now: a Kafka
        partition moved, :mod:`.kafka`)."""
        with self._lock:
            for trace_id in trace_ids:
                self._pending.pop(trace_id, None)

    def _decide_all(self, ready: list[tuple[bytes, TraceBuffer]]) -> None:
        if not ready:
            return
        self.stats.traces_decided += len(ready)
        with self._lock:
            decided = self._decided
            for trace_id, buffer in ready:
                decided[trace_id] = buffer.spans
            while len(decided) > self._decided_cache:
                decided.popitem(last=False)
        for trace_id, buffer in ready:
            self._on_trace(trace_id, list(buffer.spans.values()), buffer.late)
