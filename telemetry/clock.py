"""Each process measures its span clock against the collector's, NTP-style, from its exporter thread.

Every ``clock_sync_interval_ms`` (2 s) the recorder's exporter thread — never the engine loop —
reads its clock (``t1``) and sends the collector a request; the collector answers with its clock
when the request arrived (``t2``) and when it answered (``t3``); the sender notes ``t4`` on return
and sends ``(t1, t2, t3, t4)`` with its next exchange. Each round is a burst of eight exchanges back
to back, of which only the shortest round trip is kept (NTP's clock filter). The collector derives the sender's offset
``((t2 - t1) + (t3 - t4)) / 2`` and the round trip ``(t4 - t1) - (t3 - t2)``, whose half bounds
the offset's error (the one assumption: the request and the answer spend no less than zero
time on the way); see :mod:`kvtrace.collectors.clocks`.

The exchange goes to the same collector as the spans: ``POST /v1/kvtrace/clock`` beside
``/v1/traces`` (OTLP/HTTP), or ``/kvtrace.v1.Clock/Exchange`` on the OTLP/gRPC port, with the
exporter's headers — or, where spans pass another OTLP collector first (which cannot carry it), to
``clock_endpoint`` (``KVTRACE_CLOCK_ENDPOINT``): kvtrace's collector itself. A collector that does
not know it answers 404 / UNIMPLEMENTED: the exchange stops after logging once, and the collector
falls back to inferring offsets from causally ordered spans.

The clock read is the recorder's own (``Recorder.wall_ns``): the one the spans carry, test-only
shift included (:data:`TEST_CLOCK_SHIFT_ENV`).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Final
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

HTTP_PATH: Final = "/v1/kvtrace/clock"
GRPC_METHOD: Final = "/kvtrace.v1.Clock/Exchange"
DEFAULT_INTERVAL_MS: Final = 2_000
BURST: Final = 8
"""Exchanges per round; the shortest round trip of them is kept."""

TEST_CLOCK_SHIFT_ENV: Final = "KVTRACE_TEST_CLOCK_SHIFT"
"""Test-only: ``SKEW_MS[:DRIFT_PPM]`` added to every time this process exports (spans and clock
exchanges), as if it ran on a host whose clock is SKEW_MS ahead and gains DRIFT_PPM. For
end-to-end tests of clock alignment on one machine; never set it in production."""


TEST_CLOCK_SHIFT_ATTRIBUTE: Final = "kvtrace.test.clock_shift"
"""Resource attribute of a process whose clock is shifted for a test: ``SKEW_NS:DRIFT_PPM:EPOCH_NS``,
where EPOCH_NS is the true wall time the drift counts from. Exported time ``e`` of true time ``w``:
``e = w + SKEW_NS + (w - EPOCH_NS) * DRIFT_PPM / 1e6``."""


def unshift(exported_ns: int, attribute: str) -> int:
    """The true time of a time a shifted process exported (test helper, the inverse of the shift)."""
    skew, ppm, epoch = attribute.split(":")
    k = float(ppm) * 1e-6
    return round((exported_ns - int(skew) + int(epoch) * k) / (1 + k))


def parse_clock_shift(text: str | None) -> tuple[int, float]:
    """``SKEW_MS[:DRIFT_PPM]`` -> (skew ns, drift ppm); (0, 0.0) when unset."""
    if not text:
        return 0, 0.0
    skew, _, drift = text.partition(":")
    try:
        return int(float(skew) * 1e6), float(drift or 0.0)
    except ValueError:
        raise ValueError(f"{TEST_CLOCK_SHIFT_ENV}={text!r}: expected SKEW_MS or SKEW_MS:DRIFT_PPM") from None


class ClockSync:
    """One process's side of the exchange; :meth:`tick` is called from the exporter thread."""

    def __init__(self, endpoint: str, protocol: str, instance: str, wall_ns: Callable[[], int], *,
                 headers: Mapping[str, str] | None = None, interval_ms: int = DEFAULT_INTERVAL_MS,
                 timeout_s: float = 2.0) -> None:
        self._instance = instance
        self._wall_ns = wall_ns
        self._headers = dict(headers or {})
        self._interval_s = interval_ms / 1000
        self._timeout = timeout_s
        self._next = 0.0
        self._previous: list[int] | None = None  # the last completed exchange, sent with the next
        self.exchanges = 0
        self.enabled = True
        parsed = urlparse(endpoint)
        self._grpc = protocol == "grpc"
        if self._grpc:
            import grpc

            target = parsed.netloc or parsed.path
            channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if parsed.scheme == "https"
                       else grpc.insecure_channel(target))
            self._channel = channel
            self._call = channel.unary_unary(GRPC_METHOD, request_serializer=None, response_deserializer=None)
        else:
            self._channel = None
            self._https = parsed.scheme == "https"
            self._netloc = parsed.netloc
            self._connection: http.client.HTTPConnection | None = None  # kept alive: no connect per exchange

    def tick(self) -> None:
        """Exchange once if it is time; never raises (a failure only costs this exchange)."""
        now = time.monotonic()
        if not self.enabled or now < self._next:
            return
        self._next = now + self._interval_s
        try:
            self._exchange()
        except Exception as exc:  # the collector is down or slow: spans and metrics carry on
            logger.debug("kvtrace: clock exchange failed: %s", exc)

    def close(self) -> None:
        if self._previous is not None and self.enabled:  # hand the last sample over
            self._next = 0.0
            self.tick()
        if self._channel is not None:
            self._channel.close()
        elif self._connection is not None:
            self._connection.close()

    def _exchange(self) -> None:
        """A burst of :data:`BURST` exchanges back to back; the one with the shortest round trip is
        handed over with the next burst (a round trip stretched by a thread waiting for the GIL or
        the CPU is also a lopsided one: its offset is the least trustworthy)."""
        best: list[int] | None = None
        for _ in range(BURST):
            # Everything but the send happens before t1 and after t4: only the wire and the
            # collector's turn-around lie between them (the collector needs no t1 until the next one).
            payload = json.dumps({"instance": self._instance, "previous": self._previous}).encode()
            self._previous = None  # handed over: the collector has it
            t1 = self._wall_ns()
            answer = self._send(payload)
            t4 = self._wall_ns()
            if answer is None:
                return
            reply = json.loads(answer)
            sample = [t1, int(reply["t2"]), int(reply["t3"]), t4]
            if best is None or (sample[3] - sample[0]) - (sample[2] - sample[1]) < (best[3] - best[0]) - (best[2] - best[1]):
                best = sample
        self._previous = best
        self.exchanges += 1

    def _send(self, payload: bytes) -> bytes | None:
        metadata = list(self._headers.items())
        if self._grpc:
            import grpc

            try:
                return self._call(payload, timeout=self._timeout, metadata=[(k.lower(), v) for k, v in metadata])
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._give_up("the collector does not answer clock exchanges (not a kvtrace collector? set "
                                  "clock_endpoint / KVTRACE_CLOCK_ENDPOINT to kvtrace's collector)")
                    return None
                raise
        if self._connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._connection = kind(self._netloc, timeout=self._timeout)
        try:
            self._connection.request("POST", HTTP_PATH, payload, {"Content-Type": "application/json", **self._headers})
            response = self._connection.getresponse()
            answer = response.read()
        except (OSError, http.client.HTTPException):
            self._connection.close()
            self._connection = None
            raise
        if response.status in (404, 405, 415):
            self._give_up(f"the collector answered HTTP {response.status} (not a kvtrace collector? set "
                          f"clock_endpoint / KVTRACE_CLOCK_ENDPOINT to kvtrace's collector)")
            return None
        if response.status != 200:
            raise OSError(f"HTTP {response.status}")
        return answer

    def _give_up(self, why: str) -> None:
        self.enabled = False
        logger.warning("kvtrace: clock alignment off for this process: %s; the collector infers offsets "
                       "from span order instead", why)
