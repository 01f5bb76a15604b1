"""Keeps kvtrace's own failures away from vLLM: catch, count, log once per place."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Guard:
    """``run(fn, *args)`` calls kvtrace code; an exception there is counted and logged once per
    function, and ``None`` is returned. vLLM's own calls never go through it: their results and
    exceptions stay theirs."""

    def __init__(self) -> None:
        self.errors = 0
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            name = getattr(fn, "__qualname__", repr(fn))
            with self._lock:
                self.errors += 1
                first = name not in self._logged
                self._logged.add(name)
            if first:
                logger.exception("kvtrace: instrumentation error in %s (counted; logged once)", name)
            return None
