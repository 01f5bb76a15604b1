"""Each process's clock against its trace's router's: measured where senders exchange clock readings
with the collector (with an error bound), inferred from the order of a trace's spans otherwise.

Senders run an NTP-style exchange with the collector every couple of seconds
(:mod:`kvtrace.telemetry.clock`): for each, the offset ``θ = ((t2 - t1) + (t3 - t4)) / 2`` (add it
to the sender's times to get the collector's) and the round trip ``δ = (t4 - t1) - (t3 - t2)``.
Whatever the network does, the true offset lies within ``θ ± δ/2`` as long as neither direction
takes negative time, so ``δ/2`` is the sample's error bound.

Per sender (and collector measuring it) the book keeps the last :data:`WINDOW` samples and fits ``θ(t) = a + b·(t - t0)`` to
the ones whose round trip is within a few times the best (a congested exchange says little),
each weighted by the inverse square of its round trip, so a clock that drifts (NTP slewing, a
crystal 50 ppm off) is followed between exchanges from the second exchange on. At a used sample the
line is off the truth by at most its residual plus half the sample's round trip; at a time
``t`` the bound is the smallest of those among the samples nearest ``t``, each widened by how far
the fitted slope may be off times its distance to ``t`` — twice a typical sample bound over the
span the samples cover (at least 10 ppm), or 100 ppm where no slope could be fitted. The fit is recomputed when a sample arrives, not per trace: attribution reads
it in O(1).
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtrace.telemetry import semconv

from .breakdown import (
    ALLOCATION, D_COMPLETION, D_INPUT, D_REGISTRATION, DECODE_LEG, FIRST_TOKEN, P_COMPLETION, P_INPUT, P_PREFILL,
    P_QUEUE, P_REGISTRATION, PREFILL_LEG, R_REGISTRATION, READ, ROUTE, ROUTER, WRITE,
)
from .model import whole_number
from .threads import name_os_thread

WINDOW = 64
MAX_SENDERS = 10_000
_CONGESTED = 3.0  # a sample whose round trip is over 3x the best (+ the slack below) is left out
_SLACK_NS = 50_000
_DRIFT_ALLOWANCE = 10e-6  # the least a fitted slope is taken to be off what the clock did
_MAX_DRIFT = 500e-6  # a fitted drift beyond 500 ppm says more about the samples than the clock
_UNFITTED_DRIFT = 100e-6  # how fast a clock is taken to drift where too few samples show its drift
_TTFT = semconv.ATTR_ROUTER_TTFT_NS

logger = logging.getLogger(__name__)


class BadExchange(ValueError):
    """A clock exchange that cannot be read (the sender's to fix)."""


@dataclass(frozen=True, slots=True)
class Sample:
    instance: str
    at: int  # the sender's clock, the exchange's middle
    offset: int  # collector - sender, ns
    delay: int  # round trip less the collector's own time, ns
    measured_by: str = ""  # the collector whose clock ``offset`` is against (fleet mode: one of several)

    @property
    def bound(self) -> int:
        return self.delay // 2


@dataclass(frozen=True, slots=True)
class Fit:
    """``offset(t) = a + slope * (t - t0)``; at each used sample's time ``times[i]`` within
    ``errors[i]``, and between them within the nearest one's error plus 10 ppm of the distance."""

    t0: int
    a: float
    slope: float
    times: tuple[int, ...]  # sorted
    errors: tuple[float, ...]
    slope_error: float = _DRIFT_ALLOWANCE  # how far the slope may be off what the clock did

    def at(self, t: int) -> tuple[int, int]:
        times, errors, slope_error = self.times, self.errors, self.slope_error
        i = bisect.bisect_left(times, t)
        bound = None
        for j in range(max(0, i - 3), min(len(times), i + 3)):  # a loop, not min(genexpr): per trace and process
            near = errors[j] + abs(t - times[j]) * slope_error
            if bound is None or near < bound:
                bound = near
        return int(self.a + self.slope * (t - self.t0)), int(bound)


def fit(samples: list[Sample]) -> Fit:
    best = min(s.delay for s in samples)
    used = [s for s in samples if s.delay <= best * _CONGESTED + _SLACK_NS]
    first, last = min(s.at for s in used), max(s.at for s in used)
    t0 = (first + last) // 2
    slope = 0.0
    # Two exchanges a second or more apart already show a drift: a drifting clock extrapolated flat
    # from its first exchanges (while a process warms up) is off by its whole drift times the distance.
    fitted = len(used) >= 2 and last - first >= 1_000_000_000
    if fitted:  # weighted least squares, in ns around t0: a longer round trip is a looser sample
        weights = [1.0 / max(s.delay, 1) ** 2 for s in used]
        total = sum(weights)
        xs = [s.at - t0 for s in used]
        mean_x = sum(w * x for w, x in zip(weights, xs)) / total
        mean_y = sum(w * s.offset for w, s in zip(weights, used)) / total
        var = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
        slope = sum(w * (x - mean_x) * (s.offset - mean_y) for w, x, s in zip(weights, xs, used)) / var
        a = mean_y - slope * mean_x
    if not fitted or abs(slope) > _MAX_DRIFT:  # too few, too close to see a drift, or implausible: the best
        sample = min(used, key=lambda s: s.delay)
        slope, a = 0.0, float(sample.offset)
        slope_error = _UNFITTED_DRIFT  # no drift measured: what a free-running crystal may do
    else:
        # a slope fitted from samples each off by up to their bound is itself off by up to about
        # twice a typical bound over the time they span (200 ppm for 0.1 ms over 1 s), never less
        # than the allowance
        slope_error = max(_DRIFT_ALLOWANCE, 2 * statistics.median(s.bound for s in used) / (last - first))
    # At each used sample the line is off the truth by at most its residual plus half the sample's
    # round trip; from there on by up to the slope's error times the distance.
    used.sort(key=lambda s: s.at)
    return Fit(t0, a, slope, tuple(s.at for s in used),
               tuple(abs(s.offset - (a + slope * (s.at - t0))) + s.bound for s in used), slope_error)


class ClockBook:
    """The samples of every sender and their fits, per collector that measured them. Exchanges arrive on
    receiver threads; attribution reads on the pipeline thread.

    An offset is against the clock of the collector that measured it, so two senders are placed against
    each other only through a collector that measured both (``θ_a - θ_b``: that collector's clock cancels
    out). One collector measures everything it is asked; in a fleet, the samples other collectors measured
    reach this one through the shared store (:meth:`add_shared`), so every shard places every process the
    same way whichever collector its clock exchanges went to."""

    def __init__(self, on_sample: Callable[[Sample], None] | None = None, window: int = WINDOW,
                 measured_by: str = "") -> None:
        self.measured_by = measured_by
        self._samples: collections.OrderedDict[tuple[str, str], collections.deque[Sample]] = \
            collections.OrderedDict()  # (instance, measured_by)
        self._fits: dict[str, dict[str, Fit]] = {}  # instance -> measured_by -> fit
        self._window = window
        self._on_sample = on_sample
        self._lock = threading.Lock()

    def exchange(self, body: bytes, t2: int) -> bytes:
        """One exchange: take the sender's previous one, answer ``t2`` (when this request arrived,
        from the receiver) and ``t3`` (now, as the answer leaves)."""
        try:
            request = json.loads(body)
            instance, previous = str(request["instance"]), request.get("previous")  # t1 stays with the sender
            if not instance or len(instance) > 512:
                raise ValueError("instance")
            if previous is not None:
                t1, t2_prev, t3_prev, t4 = (int(v) for v in previous)
                self.add(instance, t1, t2_prev, t3_prev, t4)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadExchange(f"clock exchange: {exc}") from None
        return json.dumps({"t2": t2, "t3": time.time_ns()}).encode()

    def add(self, instance: str, t1: int, t2: int, t3: int, t4: int) -> Sample | None:
        """A sample this collector measured."""
        delay = (t4 - t1) - (t3 - t2)
        if delay < 0 or t3 < t2 or t4 < t1:
            return None  # impossible readings (a clock stepped mid-exchange): ignored
        sample = Sample(instance, (t1 + t4) // 2, ((t2 - t1) + (t3 - t4)) // 2, delay, self.measured_by)
        self._keep(sample)
        if self._on_sample is not None:
            self._on_sample(sample)
        return sample

    def add_shared(self, samples: list[Sample]) -> int:
        """Samples other collectors measured (read back from the shared store, oldest first, possibly again);
        returns how many were new. Each (sender, collector) series only grows: one already seen is skipped."""
        kept = 0
        for sample in samples:
            if sample.measured_by == self.measured_by:
                continue
            known = self._samples.get((sample.instance, sample.measured_by))
            if known and sample.at <= known[-1].at:
                continue
            self._keep(sample)
            kept += 1
        return kept

    def _keep(self, sample: Sample) -> None:
        key = (sample.instance, sample.measured_by)
        with self._lock:
            samples = self._samples.get(key)
            if samples is None:
                samples = self._samples[key] = collections.deque(maxlen=self._window)
                while len(self._samples) > MAX_SENDERS:
                    (gone, by), _ = self._samples.popitem(last=False)
                    fits = self._fits.get(gone, {})
                    fits.pop(by, None)
                    if not fits:
                        self._fits.pop(gone, None)
            else:
                self._samples.move_to_end(key)
            samples.append(sample)
            self._fits.setdefault(sample.instance, {})[sample.measured_by] = fit(list(samples))

    def measured(self, instance: str) -> bool:
        return instance in self._fits

    def offset(self, instance: str, at: int) -> tuple[int, int] | None:
        """(this collector - sender, error bound) in ns at the sender's time ``at``; None if this collector
        never measured it."""
        found = self._fits.get(instance, {}).get(self.measured_by)
        return found.at(at) if found is not None else None

    def between(self, instance: str, at: int, reference: str, reference_at: int) -> tuple[int, int] | None:
        """(offset to add to ``instance``'s times to get ``reference``'s, error bound) in ns — ``at`` on the
        instance's clock, ``reference_at`` on the reference's — through the collector that measured both
        most tightly; None if none measured both."""
        fits, reference_fits = self._fits.get(instance), self._fits.get(reference)
        if not fits or not reference_fits:
            return None
        best = None
        for by, found in fits.items():
            other = reference_fits.get(by)
            if other is None:
                continue
            (offset, bound), (reference_offset, reference_bound) = found.at(at), other.at(reference_at)
            if best is None or bound + reference_bound < best[1]:
                best = (offset - reference_offset, bound + reference_bound)
        return best


class SharedSamples:
    """Fleet mode: every ``interval_s``, the samples the fleet's other collectors measured (``read(cursor)``
    -> (samples, next cursor), from the shared store) into this collector's book, on a thread of its own.
    The first read happens at start, before the pipeline decides a trace."""

    def __init__(self, book: ClockBook, read: Callable[[Any], tuple[list[Sample], Any]],
                 interval_s: float = 1.0) -> None:
        self._book, self._read, self._interval_s = book, read, interval_s
        self._cursor: Any = None
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="kvtrace-shared-clocks", daemon=True)
        self.read_samples = 0

    def start(self) -> None:
        self.poll()
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def poll(self) -> None:
        try:
            samples, self._cursor = self._read(self._cursor)
        except Exception as exc:  # the store is away: offsets stay as they are until it is back
            if not self._failing:
                logger.warning("kvtrace collector: cannot read the fleet's clock samples from the store (%s); "
                               "retrying", (str(exc).strip() or type(exc).__name__).splitlines()[0][:200])
            self._failing = True
            return
        self._failing = False
        self.read_samples += self._book.add_shared(samples)

    def _run(self) -> None:
        name_os_thread()
        while not self._stop.wait(self._interval_s):
            self.poll()


# --------------------------------------------------------------------------------------
# Inferred from span order (senders that do not measure), and the check on measured offsets
# --------------------------------------------------------------------------------------


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
        self._clocks: dict[tuple[str, str], _InstanceClock] = {}

    def update(self, pair: tuple[str, str], lower: float | None, upper: float | None) -> int:
        """Add one trace's bounds for ``pair`` (reference instance, instance: two routers' clocks are two
        references); returns the instance's offset estimate onto the reference's clock."""
        clock = self._clocks.get(pair)
        if clock is None:
            clock = self._clocks[pair] = _InstanceClock(self._window)
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


class ClockAligner:
    """Puts each of a trace's instances on the clock of the trace's own router (or of P, with no
    router span). Where a collector has measured both that instance and the router, the offset is
    ``θ_instance - θ_router`` (instance -> collector -> router) within the sum of both bounds;
    otherwise it is inferred from causally ordered pairs of the trace's spans, intersected over
    recent traces (:class:`OffsetEstimator`, kept per (router, instance): two routers' clocks
    are two references). The causal pairs check the measured offsets too, each span on its own
    process's offset: a trace whose span order they contradict by more than the two processes'
    bounds is flagged ``clock_suspect`` (:func:`contradiction`).

    Causal pairs: P's API server got the request after the router routed it; P's prefill ended
    before the router had P's answer; D got its leg after the router sent it (push: after the
    route; pull: after the relay); D's first token before the router saw it; in push, D's
    registration left before P received it, and P posted the WRITE before D saw it land."""

    def __init__(self, book: ClockBook | None = None) -> None:
        self.book = book
        self.estimator = OffsetEstimator()

    def align(self, index: dict[tuple[str, str], Any], root: Any, mode: str, p_any: Any, d_any: Any,
              instances: dict[str, Any], outer: Any = None) -> tuple[dict[str, int], dict[str, int], bool]:
        """(offset to add per instance, error bound per measured instance, suspect) for one trace;
        ``instances``: each process in it, with its earliest span. P and D can each be several
        processes (engine core and workers): each measured one gets its own offset, one that is not
        takes that of a process on its host, else its side's. ``outer``: the user's gateway span,
        where no kvtrace router served the trace — P is then the reference, and the gateway (whose
        clock nobody measures) is placed by the order of its span around P's and D's."""
        offsets, bounds = self._align_sides(index, root, mode, p_any, d_any)
        if outer is not None and offsets:
            offsets[outer.origin.instance] = self._place_outer(index, outer, offsets, p_any, d_any)
        if len(instances) > len(offsets):
            by_host = {span.origin.host: offsets[i] for i, span in instances.items() if i in offsets and span.origin.host}
            side_offset = {span.origin.side: offsets[i] for i, span in instances.items() if i in offsets}
            reference = next(iter(offsets), None)
            measure = (self.book is not None and reference in instances and reference in bounds)
            for instance, span in instances.items():
                if instance in offsets:
                    continue
                measured = self.book.between(instance, span.start, reference, instances[reference].start) \
                    if measure else None
                if measured is not None:
                    offsets[instance], bounds[instance] = measured
                else:
                    offsets[instance] = by_host.get(span.origin.host, side_offset.get(span.origin.side, 0))
        return offsets, bounds, len(bounds) > 1 and contradiction(index, root, mode, offsets, bounds) is not None

    def _align_sides(self, index: dict[tuple[str, str], Any], root: Any, mode: str, p_any: Any, d_any: Any
                     ) -> tuple[dict[str, int], dict[str, int]]:
        """The router (reference), P's first process and D's first process."""
        if root is not None:
            reference, at = root.origin.instance, root.start
        elif p_any is not None:
            reference, at = p_any.origin.instance, p_any.start
        else:
            return {}, {}
        offsets, bounds = {reference: 0}, {}
        measure = self.book is not None and self.book.measured(reference)
        if measure:
            bounds[reference] = 0
        # The span order's bounds are worked out only for an instance that is not measured (a measured instance
        # stays measured: the book extrapolates its fit, with a widening bound, if it stops). No closures here:
        # this runs for every trace, and a closure made per call cost more than the lines it saves.
        get = index.get
        if root is None:  # P is the reference: only the P<->D pairs bound D
            if d_any is not None and not (measure and self._measured(d_any, reference, at, offsets, bounds)):
                lower, upper = _tighten_with_prefill(index, 0, None, None) if mode == "push" else _pull_pairs(index)
                self._estimated(d_any, reference, lower, upper, offsets)
            return offsets, bounds
        p_measured = p_any is not None and measure and self._measured(p_any, reference, at, offsets, bounds)
        d_placed = d_any is None or (measure and self._measured(d_any, reference, at, offsets, bounds))
        if (p_any is None or p_measured) and d_placed:  # both measured, as deployed
            return offsets, bounds
        route_end, answered, token_seen = _router_moments(index, root)
        if p_any is None:
            p_offset = 0
        elif p_measured:
            p_offset = offsets[p_any.origin.instance]
        else:
            first, prefill = get(P_INPUT) or get(P_QUEUE), get(P_PREFILL)
            p_offset = self._estimated(p_any, reference, route_end - first.start if first is not None else None,
                                       answered - prefill.end if prefill is not None else None, offsets)
        if not d_placed:
            first, token, relay = get(D_INPUT) or get(ALLOCATION), get(FIRST_TOKEN), get(R_REGISTRATION)
            sent = relay.end if mode == "pull" and relay is not None else route_end  # pull: after P's params relayed
            lower = sent - first.start if first is not None else None
            upper = token_seen - token.end if token is not None else None
            lower, upper = _tighten_with_prefill(index, p_offset, lower, upper)
            self._estimated(d_any, reference, lower, upper, offsets)
        return offsets, bounds

    def _measured(self, span: Any, reference: str, at: int, offsets: dict[str, int], bounds: dict[str, int]) -> bool:
        """The span's process's measured offset onto ``reference`` (at ``at`` on its clock), into ``offsets`` and
        ``bounds``; False where no collector measured both."""
        found = self.book.between(span.origin.instance, span.start, reference, at)
        if found is None:
            return False
        offsets[span.origin.instance], bounds[span.origin.instance] = found
        return True

    def _estimated(self, span: Any, reference: str, lower: float | None, upper: float | None,
                   offsets: dict[str, int]) -> int:
        """The span's process's offset from this trace's bounds [lower, upper] and the recent traces', into
        ``offsets``."""
        instance = span.origin.instance
        offsets[instance] = estimate = self.estimator.update((reference, instance), lower, upper)
        return estimate

    def _place_outer(self, index, outer: Any, offsets: dict[str, int], p_any: Any, d_any: Any) -> int:
        """The gateway's offset onto P's clock: its span started before P had the request and ended
        after D's first token."""
        get = index.get
        upper = lower = None
        p_first = get(P_INPUT) or get(P_QUEUE)
        if p_first is not None:
            upper = p_first.start + offsets.get(p_first.origin.instance, 0) - outer.start
        token = get(FIRST_TOKEN)
        if token is not None:
            lower = token.end + offsets.get(token.origin.instance, 0) - outer.end
        reference = p_any.origin.instance if p_any is not None else d_any.origin.instance if d_any else ""
        return self.estimator.update((reference, outer.origin.instance), lower, upper)


def _pull_pairs(index):
    """Pull with P as the reference: D had its leg after P's prefill ended; D posted its READ before P
    saw the READ's notification (P's ``kv.completion`` starts there). Not the READ's end: NIXL delivers
    the notification as the transfer completes, before D's worker next polls it and sees it done."""
    get = index.get
    lower = upper = None
    prefill, first = get(P_PREFILL), get(D_INPUT) or get(ALLOCATION)
    if prefill is not None and first is not None:
        lower = prefill.end - first.start
    read, released = get(READ), get(P_COMPLETION)
    if read is not None and released is not None:
        upper = released.start - read.start
    return lower, upper


def _max(a, b):
    """The larger of two bounds, either of which may be None (no bound)."""
    return b if a is None else a if b is None else max(a, b)


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _router_moments(index, root: Any) -> tuple[int, int, int]:
    """On the router's clock: when it had routed the request (P's leg left), when it had P's answer (pull: the
    relay's start), and when it had D's first token (its decode leg's end; without those spans, the root's
    TTFT attribute, else its end)."""
    get = index.get
    route, p_leg, relay, d_leg = get(ROUTE), get(PREFILL_LEG), get(R_REGISTRATION), get(DECODE_LEG)
    ttft = whole_number(root.attrs.get(_TTFT))
    first_token_at_router = root.start + ttft if ttft else root.end
    return (route.end if route is not None else root.start,
            p_leg.end if p_leg is not None else relay.start if relay is not None else first_token_at_router,
            d_leg.end if d_leg is not None else first_token_at_router)


def _tighten_with_prefill(index, p_offset: int, lower, upper):
    """Push: D's registration left before P received it; P posted the WRITE before D saw it land.
    (lower, upper) tightened by those pairs, through P's offset. D's registration span ends once
    PUSH_REG's send has returned, and P can have it before then (0.6 ms before, in a real pair on
    loopback): as an estimate's bound that is close enough, and tighter than its start; the check on
    measured offsets (:func:`contradiction`) takes its start."""
    get = index.get
    d_reg, p_reg = get(D_REGISTRATION), get(P_REGISTRATION)
    if d_reg is not None and p_reg is not None:
        upper = _min(upper, p_reg.start + p_offset - d_reg.end)
    write, d_done = get(WRITE), get(D_COMPLETION)
    if write is not None and d_done is not None:
        lower = _max(lower, write.start + p_offset - d_done.start)
    return lower, upper


def contradiction(index, root: Any, mode: str, offsets: dict[str, int], bounds: dict[str, int]) -> str | None:
    """The first strictly causal pair of the trace's moments that the measured offsets put the wrong way round by
    more than both processes' bounds, named ("earlier -> later"); None where there is none. Each moment is moved
    by its own process's offset: a side's processes (engine core, TP workers) may each run on a clock of their
    own. Only pairs that are strictly causal (a message sent before it was received), and only between measured
    processes (the others check nothing)."""

    def reversed_(earlier: int, earlier_span: Any, later: int, later_span: Any) -> bool:
        a, b = earlier_span.origin.instance, later_span.origin.instance
        bound_a, bound_b = bounds.get(a), bounds.get(b)
        return bound_a is not None and bound_b is not None and \
            earlier + offsets[a] - later - offsets[b] > bound_a + bound_b

    get = index.get
    p_first, d_first = get(P_INPUT) or get(P_QUEUE), get(D_INPUT) or get(ALLOCATION)
    prefill, token = get(P_PREFILL), get(FIRST_TOKEN)
    if root is not None:  # every router moment is on the router's clock: its root span stands for them all
        route_end, answered, token_seen = _router_moments(index, root)
        if p_first is not None and reversed_(route_end, root, p_first.start, p_first):
            return "router sent P's leg -> P had it"
        if prefill is not None and reversed_(prefill.end, prefill, answered, root):
            return "P's prefill ended -> router had P's answer"
        if d_first is not None:  # D had its leg after the router sent it: the leg's start (without that span,
            # the relay's end in pull, the route's in push, whose two legs leave together)
            d_leg, relay = get(DECODE_LEG), get(R_REGISTRATION)
            sent = d_leg.start if d_leg is not None else relay.end if mode == "pull" and relay is not None else route_end
            if reversed_(sent, root, d_first.start, d_first):
                return "router sent D's leg -> D had it"
        if token is not None and reversed_(token.end, token, token_seen, root):
            return "D's first token -> router had it"
    if mode == "push":
        d_reg, p_reg, write, d_done = get(D_REGISTRATION), get(P_REGISTRATION), get(WRITE), get(D_COMPLETION)
        if d_reg is not None and p_reg is not None and reversed_(d_reg.start, d_reg, p_reg.start, p_reg):
            return "D sent its registration -> P had it"
        if write is not None and d_done is not None and reversed_(write.start, write, d_done.start, d_done):
            return "P posted the WRITE -> D saw it land"
        return None
    read, released = get(READ), get(P_COMPLETION)
    if prefill is not None and d_first is not None and reversed_(prefill.end, prefill, d_first.start, d_first):
        return "P's prefill ended -> D had its leg"
    if read is not None and released is not None and reversed_(read.start, read, released.start, released):
        return "D posted the READ -> P saw its notification"
    return None
