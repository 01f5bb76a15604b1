"""Request ids, keyed: what every kvtrace process exports instead of the raw id when asked.

One keyed hash (HMAC-SHA256 of the id's base form — the one P, D and the router share, which is
what every recorder is handed — 16 hex digits) for the router, P and D —
schedulers and workers alike — so a request's spans still join on ``kvtrace.request_id`` while
no exported span, event, metric or log line carries the id vLLM and its clients see. The key is
shared by every process of a deployment (``KVTRACE_HASH_KEY``); without it the hash of a
guessable id could be recomputed by anyone.

Applied on the recorder's exporter thread, never on the engine loop.
"""

from __future__ import annotations

import hashlib
import hmac

_CACHE_LIMIT = 65_536  # a request's spans arrive close together: a small cache saves most HMACs


class RequestIdHasher:
    """``hasher(request_id)`` → 16 hex digits, the same in every process sharing the key."""

    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("a request-id hash needs a non-empty key")
        self._key = key.encode()
        self._cache: dict[str, str] = {}

    def __call__(self, request_id: str) -> str:
        hashed = self._cache.get(request_id)
        if hashed is None:
            hashed = hmac.new(self._key, request_id.encode(), hashlib.sha256).hexdigest()[:16]
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[request_id] = hashed
        return hashed

    def __repr__(self) -> str:  # never the key
        return "RequestIdHasher(<key>)"
