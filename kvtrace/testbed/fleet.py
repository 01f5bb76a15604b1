"""A generated fleet, R routers × P prefill × D decode instances, published to Kafka as the OpenTelemetry
Collector's kafka exporter would (for fleet tests and ``bench/fleet_ingest.py``).

Each request is one of :mod:`.synthetic`'s contract-shaped traces, served by a router, a P and a D drawn at
random; every P and D keeps a clock off its router's by a fixed skew (within ±``skew_ms``), a share of
transfers fail and of traces miss a span, and a share of D's spans arrive late (published after later
requests). The messages are what the contrib kafka exporter writes with ``encoding: otlp_proto`` and
``partition_traces_by_id: true``: one ``ExportTraceServiceRequest`` per resource and trace, its key the
trace id as 32 lower-case hex characters (``[]byte(traceID.String())``). ``keyed=False`` sends them with
no key, as rotel's kafka exporter does.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvtrace.collectors.wire import field as proto_field
from kvtrace.telemetry import semconv

from .synthetic import _SCOPE, Generator, Instance, Workload


@dataclass(frozen=True)
class FleetShape:
    routers: int = 2
    prefill: int = 16
    decode: int = 16
    skew_ms: float = 50.0
    late_share: float = 0.02  # requests whose D spans are published this many requests later:
    late_by: int = 200
    rate_per_s: float = 50.0
    workload: Workload = field(default_factory=lambda: Workload(failure_rate=0.01, incomplete_rate=0.01))
    seed: int = 5


class FleetGenerator:
    def __init__(self, shape: FleetShape | None = None) -> None:
        self.shape = s = shape or FleetShape()
        self._rng = random.Random(s.seed)
        self._traces = Generator(Workload(**{**vars(s.workload), "rate_per_s": s.rate_per_s, "seed": s.seed}))
        self.routers = [f"router-{i}" for i in range(s.routers)]
        self.prefill = [f"p{i:02d}" for i in range(s.prefill)]
        self.decode = [f"d{i:02d}" for i in range(s.decode)]
        self.skew_ns = {name: int(self._rng.uniform(-s.skew_ms, s.skew_ms) * 1e6) for name in self.prefill + self.decode}

    def messages(self, n: int, start_ns: int) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of every message for ``n`` requests from ``start_ns`` on, in publishing order."""
        rng, s, w = self._rng, self.shape, self._traces.w
        held: collections.deque[tuple[int, list[tuple[bytes, bytes]]]] = collections.deque()
        t = start_ns
        for i in range(n):
            t += int(rng.expovariate(s.rate_per_s) * 1e9)
            mode = "push" if rng.random() < w.push_share else "pull"
            names = {"router": rng.choice(self.routers), "prefill": rng.choice(self.prefill),
                     "decode": rng.choice(self.decode)}
            skews = {"prefill": self.skew_ns[names["prefill"]], "decode": self.skew_ns[names["decode"]]}
            by_side: dict[str, list[bytes]] = {}
            spans = self._traces.request_spans(i, mode, t, skews)
            for side, span in spans:
                by_side.setdefault(side, []).append(span)
            key = spans[0][1][2:18].hex().encode()  # the first span's trace id (field 1, 16 bytes)
            messages = [(side, key, _request(Instance(_ROLES[side], mode, names[side]), by_side[side]))
                        for side in ("router", "prefill", "decode") if side in by_side]
            late = rng.random() < s.late_share
            yield from ((k, v) for side, k, v in messages if not (late and side == "decode"))
            if late:
                held.append((i + s.late_by, [(k, v) for side, k, v in messages if side == "decode"]))
            while held and held[0][0] <= i:
                yield from held.popleft()[1]
        for _, late_messages in held:
            yield from late_messages


    def clock_exchanges(self, start_ns: int, span_s: float, every_s: float = 30.0) -> Iterator[tuple[str, int, int, int, int]]:
        """The clock exchanges every router, P and D would have had with one collector from ``start_ns`` for
        ``span_s`` seconds, one each ``every_s``: ``(instance, t1, t2, t3, t4)`` with a 200 µs round trip, the
        instance's clock off the collector's (and its routers') by its skew. The same fleet (seed) gives the
        same exchanges, so two collectors fed them place every process alike."""
        skews = {**{router: 0 for router in self.routers}, **self.skew_ns}
        for k in range(int(span_s // every_s) + 1):
            true = start_ns + int(k * every_s * 1e9)
            for instance, skew in skews.items():
                yield instance, true + skew, true + 100_000, true + 120_000, true + 220_000 + skew


_ROLES = {"router": semconv.Role.ROUTER, "prefill": semconv.Role.PRODUCER, "decode": semconv.Role.CONSUMER}


def _request(instance: Instance, spans: list[bytes]) -> bytes:
    """One ExportTraceServiceRequest: one resource, one scope, these spans."""
    return proto_field(1, proto_field(1, instance.resource())
                       + proto_field(2, _SCOPE + b"".join(proto_field(2, span) for span in spans)))


def publish(brokers: str, topic: str, messages: Iterable[tuple[bytes, bytes]], *, keyed: bool = True) -> int:
    """Produce the messages (acknowledged by every in-sync replica); returns how many."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": brokers, "linger.ms": 5, "acks": "all"})
    failures: list[str] = []

    def delivered(error, _message) -> None:
        if error is not None:
            failures.append(str(error))

    count = 0
    for key, value in messages:
        while True:
            try:
                producer.produce(topic, value=value, key=key if keyed else None, on_delivery=delivered)
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.05)
        count += 1
        if count % 1000 == 0:
            producer.poll(0)
    producer.flush(60)
    if failures:
        raise RuntimeError(f"{len(failures)} of {count} messages were not acknowledged: {failures[0]}")
    return count
