"""The hot-path recorder: the engine loop and NIXL threads record, a background thread exports.

On the calling thread :meth:`Recorder.record` does one bound check and one ``deque.append``
of a tuple of ids and monotonic timestamps; nothing is formatted, allocated per attribute
or locked. A named daemon thread turns records into OpenTelemetry spans with explicit
start and end times (monotonic → wall clock with one offset per process, read again each export
cycle so that a stepped system clock is followed), feeds the
Prometheus metrics, and exports. A full buffer drops and counts; an exporter that is down
or slow only ever costs that thread. Modelled on the OpenTelemetry SDK's BatchProcessor.
"""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from . import semconv
from .clock import TEST_CLOCK_SHIFT_ATTRIBUTE, TEST_CLOCK_SHIFT_ENV, parse_clock_shift
from .config import DEFAULT_MAX_EXPORT_BATCH_SIZE, DEFAULT_MAX_QUEUE_SIZE, DEFAULT_SCHEDULE_DELAY_MS
from .context import TraceRef, new_span_id
from .metrics import NoOpMetrics
from .semconv import Stage

logger = logging.getLogger(__name__)

_ENGINE_LOOP = -1
"""Pseudo-stage of an engine-loop record: feeds a histogram, never becomes a span."""

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_TRANSFER_OPS = {Stage.WRITE: "write", Stage.READ: "read"}
_REQUEST_ID_ATTRIBUTES = (semconv.ATTR_REQUEST_ID, semconv.ATTR_REMOTE_REQUEST_ID)
_FAILURE_LOG_INTERVAL_S = 60.0


def _shutdown_if_alive(weak_shutdown) -> None:
    shutdown = weak_shutdown()
    if shutdown is not None:
        shutdown()


@dataclass(frozen=True)
class RecorderStats:
    """Counters of one recorder since it started (or since the fork that made this process)."""

    dropped: int
    exported_spans: int
    export_failures: int
    failed_spans: int


CLOCK_STEP_NS = 100_000
"""How far the system clock must have been stepped (against the monotonic clock) before a recorder's
conversion follows it: far above a re-read's noise (well under 1 µs), far below what attribution resolves."""


def wall_clock_offset_ns() -> int:
    """``time.time_ns() - time.perf_counter_ns()``, from the tightest of a few bracketed reads."""
    best: tuple[int, int] | None = None
    for _ in range(7):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) // 2)
    assert best is not None
    return best[1]


class Recorder:
    """Records stage timings on the hot path and exports them as spans off it.

    Thread-safe (``deque.append`` and ``popleft`` are atomic), fork-safe (the child starts
    with an empty buffer and its own worker thread), and flushed at interpreter exit.
    """

    enabled = True
    now = staticmethod(time.perf_counter_ns)
    """The recorder's clock: monotonic ns. Take every ``start_ns``/``end_ns`` from it."""

    def __init__(
        self,
        exporter: SpanExporter | None,
        resource: Resource,
        *,
        metrics: Any = None,
        clock_sync: Callable[["Recorder"], Any] | None = None,
        hash_request_id: Callable[[str], str] | None = None,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        schedule_delay_ms: int = DEFAULT_SCHEDULE_DELAY_MS,
        max_export_batch_size: int = DEFAULT_MAX_EXPORT_BATCH_SIZE,
    ) -> None:
        if max_queue_size < 1 or max_export_batch_size < 1 or schedule_delay_ms < 1:
            raise ValueError("max_queue_size, max_export_batch_size and schedule_delay_ms must be >= 1")
        if max_export_batch_size > max_queue_size:
            raise ValueError("max_export_batch_size must not exceed max_queue_size")
        self._exporter = exporter
        self._resource = resource
        self._metrics = metrics if metrics is not None else NoOpMetrics()
        self._max_queue_size = max_queue_size
        self._batch_size = max_export_batch_size
        self._delay_s = schedule_delay_ms / 1000
        self._scope = InstrumentationScope(semconv.INSTRUMENTATION_SCOPE)
        # Made on the exporter thread (and again in a forked child): a ClockSync holds a channel.
        self._clock_sync_factory = clock_sync
        # Privacy: applied where spans are built, so every id any part of kvtrace exports passes here.
        self._hash_request_id = hash_request_id
        self._init_process_state()

        # Fork safety, as the OTel SDK does it: a weak reference so the hook keeps nothing alive.
        weak_reinit = weakref.WeakMethod(self._at_fork_reinit)
        os.register_at_fork(after_in_child=lambda: (m := weak_reinit()) is not None and m())
        weak_shutdown = weakref.WeakMethod(self.shutdown)
        atexit.register(_shutdown_if_alive, weak_shutdown)
        # vLLM's engine core and workers are multiprocessing children, which leave through os._exit
        # after running multiprocessing's finalizers, not atexit's: flush there too.
        multiprocessing.util.Finalize(self, _shutdown_if_alive, args=(weak_shutdown,), exitpriority=100)

    def _init_process_state(self) -> None:
        self._buffer: collections.deque = collections.deque(maxlen=self._max_queue_size)
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._offset_ns = wall_clock_offset_ns()
        self._shift_ns, self._drift_ppm = parse_clock_shift(os.environ.get(TEST_CLOCK_SHIFT_ENV))
        if self._shift_ns or self._drift_ppm:
            logger.warning("kvtrace: TEST CLOCK SHIFT active: this process exports times %+.3f ms off, drifting "
                           "%+.1f ppm (%s; for tests only)", self._shift_ns / 1e6, self._drift_ppm,
                           TEST_CLOCK_SHIFT_ENV)
        self._mono0 = time.perf_counter_ns()
        if self._shift_ns or self._drift_ppm:  # so a test can undo the shift exactly
            self._resource = self._resource.merge(Resource({TEST_CLOCK_SHIFT_ATTRIBUTE: (
                f"{self._shift_ns}:{self._drift_ppm}:{self._mono0 + self._offset_ns}")}))
        self._clock_sync: Any = None
        self._pid = os.getpid()
        self._shutdown = False
        self._dropped = 0
        self._dropped_reported = 0
        self._exported_spans = 0
        self._export_failures = 0
        self._failed_spans = 0
        self._last_failure_log = -_FAILURE_LOG_INTERVAL_S
        self._worker = threading.Thread(target=self._run, name="kvtrace-exporter", daemon=True)
        self._worker.start()

    def _at_fork_reinit(self) -> None:
        # Records in the parent's buffer are the parent's to export; the child starts clean.
        self._init_process_state()

    # ------------------------------------------------------------------ hot path

    def record(
        self,
        ref: TraceRef | None,
        stage: Stage,
        start_ns: int,
        end_ns: int,
        attrs: Mapping[str, Any] | None = None,
        span_id: int = 0,
        error: str | None = None,
    ) -> None:
        """Record one stage. ``ref`` is the parent span (``None``: metrics only, no span).

        ``span_id`` fixes the new span's id when children will point at it; 0 lets the
        exporter thread choose. ``error`` is a :class:`~semconv.FailureCause` value.
        """
        buffer = self._buffer
        if len(buffer) == self._max_queue_size:
            # The append below evicts the oldest record. Under the GIL this increment has no
            # call inside it, so no thread switch can split it.
            self._dropped += 1
        buffer.append((ref, stage, start_ns, end_ns, attrs, span_id, error))
        if len(buffer) >= self._batch_size and not self._wake.is_set():
            self._wake.set()

    def record_engine_loop(self, duration_ns: int, part: str = "scheduler") -> None:
        """Record the time the connector spent on the engine loop in one step.

        ``part`` is ``scheduler`` or ``worker``: with one GPU the worker runs on the same
        loop as the scheduler, with several it runs in its own process.
        """
        self.record(None, _ENGINE_LOOP, duration_ns, 0, part)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ off the hot path

    def to_wall_ns(self, monotonic_ns: int) -> int:
        """A reading of :attr:`now` as the wall time this process exports (spans, clock exchanges)."""
        wall = monotonic_ns + self._offset_ns
        if self._shift_ns or self._drift_ppm:  # test-only: as if on another host's clock
            wall += self._shift_ns + int((monotonic_ns - self._mono0) * self._drift_ppm * 1e-6)
        return wall

    def from_wall_ns(self, wall_ns: int) -> int:
        """A wall-clock instant (another process's stamp on this host) on :attr:`now`'s clock: the inverse
        of :meth:`to_wall_ns` without its test shift, so the span exports that very instant. One read of
        no clock: taking the instant's age instead (``now() - (time.time_ns() - wall_ns)``) moves it
        earlier by any wait between the two reads, such as another thread holding the GIL."""
        return wall_ns - self._offset_ns

    def wall_ns(self) -> int:
        """This process's exported clock now."""
        return self.to_wall_ns(time.perf_counter_ns())

    def stats(self) -> RecorderStats:
        return RecorderStats(self._dropped, self._exported_spans, self._export_failures,
                             self._failed_spans)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export everything recorded so far; returns False if the exporter did not confirm."""
        self._export_pending()
        if self._exporter is None:
            return True
        return bool(self._exporter.force_flush(timeout_millis))

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        """Flush what is buffered and stop; safe to call more than once, and without records."""
        if self._shutdown or self._pid != os.getpid():
            return
        self._shutdown = True
        self._wake.set()
        self._worker.join(timeout_millis / 1000)
        if self._worker.is_alive():
            logger.warning("kvtrace: exporter thread still busy after %d ms at shutdown", timeout_millis)
            return
        if self._exporter is not None:
            self._exporter.shutdown()

    def _run(self) -> None:
        while not self._shutdown:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._follow_clock_steps()
            self._export_pending()
            self._sync_clock()
        self._export_pending()
        if self._clock_sync is not None:
            self._clock_sync.close()

    def _follow_clock_steps(self) -> None:
        """Follow the system clock where it is stepped (an NTP step, a VM's time sync): monotonic time
        never is, so a process's exported times would part from every other's by each step since it
        started. Only a real step moves the offset (over :data:`CLOCK_STEP_NS`; a re-read alone differs
        by its noise), so two records of one instant export the same time; records taken since the last
        export carry a step with them, off by at most one export interval's worth of stepping."""
        offset = wall_clock_offset_ns()
        if abs(offset - self._offset_ns) > CLOCK_STEP_NS:
            self._offset_ns = offset

    def _sync_clock(self) -> None:
        """Measure this process's clock against the collector's, when due (.clock)."""
        if self._clock_sync is None and self._clock_sync_factory is not None:
            try:
                self._clock_sync = self._clock_sync_factory(self)
            except Exception:
                logger.exception("kvtrace: clock alignment could not start; offsets will be inferred")
                self._clock_sync_factory = None
                return
        if self._clock_sync is not None:
            self._clock_sync.tick()

    def _export_pending(self) -> None:
        with self._export_lock:
            buffer = self._buffer
            while buffer:
                spans = []
                for _ in range(self._batch_size):
                    try:
                        record = buffer.popleft()
                    except IndexError:
                        break
                    try:
                        span = self._process(record)
                    except Exception:  # a malformed record must not stop the exporter
                        logger.exception("kvtrace: could not build a span from a record")
                        continue
                    if span is not None:
                        spans.append(span)
                if spans:
                    self._export(spans)
            dropped = self._dropped
            if dropped > self._dropped_reported:
                self._metrics.add_dropped(dropped - self._dropped_reported)
                self._dropped_reported = dropped

    def _process(self, record: tuple) -> ReadableSpan | None:
        ref, stage, start_ns, end_ns, attrs, span_id, error = record
        if stage == _ENGINE_LOOP:
            self._metrics.observe_engine_loop(start_ns / 1e9, attrs)
            return None
        sampled = ref is not None and ref.sampled
        label = semconv.STAGE_LABELS[stage]
        self._metrics.observe_stage(label, (end_ns - start_ns) / 1e9, ref.trace_id if sampled else None)
        if stage in _TRANSFER_OPS and attrs and semconv.ATTR_TRANSFER_BYTES in attrs:
            self._metrics.add_transfer_bytes(_TRANSFER_OPS[stage], int(attrs[semconv.ATTR_TRANSFER_BYTES]))
        if error is not None:
            self._metrics.add_failure(error)
        if not sampled or self._exporter is None:
            return None

        spec = semconv.STAGES[stage]
        attributes: dict[str, Any] = {semconv.ATTR_CATEGORY: spec.category.value, semconv.ATTR_STAGE: label}
        if attrs:
            attributes.update(attrs)
            if self._hash_request_id is not None:
                for key in _REQUEST_ID_ATTRIBUTES:
                    if key in attributes:
                        attributes[key] = self._hash_request_id(str(attributes[key]))
        start, end = self.to_wall_ns(start_ns), self.to_wall_ns(end_ns)
        status, events = Status(StatusCode.UNSET), ()
        if error is not None:
            attributes[semconv.ATTR_FAILURE_CAUSE] = error
            status = Status(StatusCode.ERROR, error)
            events = (Event(semconv.FAILURE_EVENT, {semconv.ATTR_FAILURE_CAUSE: error}, end),)
        return ReadableSpan(
            name=spec.span_name,
            context=SpanContext(ref.trace_id, span_id or new_span_id(), False, _SAMPLED),
            parent=SpanContext(ref.trace_id, ref.span_id, True, _SAMPLED) if ref.span_id else None,
            resource=self._resource,
            attributes=attributes,
            events=events,
            kind=spec.kind,
            status=status,
            start_time=start,
            end_time=end,
            instrumentation_scope=self._scope,
        )

    def _export(self, spans: list[ReadableSpan]) -> None:
        assert self._exporter is not None
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))  # don't trace ourselves
        try:
            result = self._exporter.export(spans)
        except Exception:
            logger.exception("kvtrace: span exporter raised")
            result = SpanExportResult.FAILURE
        finally:
            detach(token)
        if result is SpanExportResult.SUCCESS:
            self._exported_spans += len(spans)
            return
        self._export_failures += 1
        self._failed_spans += len(spans)
        self._metrics.add_export_failure()
        now = time.monotonic()
        if now - self._last_failure_log >= _FAILURE_LOG_INTERVAL_S:  # one warning a minute at most
            self._last_failure_log = now
            logger.warning("kvtrace: span export failed (%d batches so far)", self._export_failures)


class NoOpRecorder:
    """The recorder when telemetry is off: every call returns at once."""

    enabled = False
    now = staticmethod(time.perf_counter_ns)

    def record(self, ref: Any, stage: Any, start_ns: int, end_ns: int, attrs: Any = None,
               span_id: int = 0, error: str | None = None) -> None:
        return None

    def record_engine_loop(self, duration_ns: int, part: str = "scheduler") -> None:
        return None

    def to_wall_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + wall_clock_offset_ns()

    def from_wall_ns(self, wall_ns: int) -> int:
        return wall_ns - wall_clock_offset_ns()

    def stats(self) -> RecorderStats:
        return RecorderStats(0, 0, 0, 0)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        return None
