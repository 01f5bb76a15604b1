"""Small helpers shared by the tests."""

import time


def wait_until(predicate, timeout_s: float = 15.0, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def feed(collector, payloads, timeout_s: float = 60.0) -> None:
    """Each OTLP payload into ``collector``'s pipeline as a sender would send it: while the pipeline is
    full (``Busy``, a sender's 503) it is tried again, for at most ``timeout_s`` in all."""
    # Here, not at the top: the connector and e2e tests import this module for wait_until alone, and the
    # collector's service pulls in DuckDB, gRPC and Arrow (~0.75 s of imports).
    from kvtrace.collectors.model import SpanBatch
    from kvtrace.collectors.service import Busy

    deadline = time.monotonic() + timeout_s
    for payload in payloads:
        batch = SpanBatch.decode(payload)
        while True:
            try:
                collector.consume(batch)
                break
            except Busy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
