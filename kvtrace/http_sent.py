"""When aiohttp wrote a request to its socket: where the router's legs and the load generator's
TTFT start.

Building a request in aiohttp (URL, headers, payload, the pooled connection) takes a fraction of a
millisecond of CPU, and milliseconds on a host whose cores the engines hold. Timed from the call,
that time would read as the engines' (the router's legs) or the server's (a client's TTFT); timed
from the socket write, it is the caller's own. A :class:`SentAt` passed to a request as
``trace_request_ctx`` holds the call's time until the session's :func:`stamping` hook replaces it
with the time aiohttp wrote the request's body (its first chunk); a session without the hook leaves
the call's time.
"""

from __future__ import annotations

from typing import Any, Callable

import aiohttp


class SentAt:
    """A request's send time: the call's, then (``written``) the socket write's."""

    __slots__ = ("ns", "written")

    def __init__(self, ns: int = 0) -> None:
        self.ns = ns
        self.written = False


def stamping(now: Callable[[], int]) -> aiohttp.TraceConfig:
    """A session hook that stamps each request's :class:`SentAt` with ``now()`` as its body is written."""

    async def written(session: Any, context: Any, params: Any) -> None:
        sent = context.trace_request_ctx
        if isinstance(sent, SentAt) and not sent.written:
            sent.ns, sent.written = now(), True

    config = aiohttp.TraceConfig()
    config.on_request_chunk_sent.append(written)
    return config
