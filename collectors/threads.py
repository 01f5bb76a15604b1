"""The collector's threads under their own names in the OS (``top -H``, ``ps -L``,
``/proc/PID/task/TID/comm``), so its CPU can be read per stage from outside the process:
receiving, the pipeline, the store's writer, each forwarder (``bench/collector_ingest.py`` prints
that split). CPython 3.11 leaves every thread named after the executable ("python").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15
_MAX_BYTES = 15  # Linux's limit, without the terminating NUL
_PREFIX, _SHORT = "kvtrace-", "kv-"  # "kvtrace-pipeline" is one byte too long

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def os_name(name: str) -> str:
    """What the OS is told for a thread named ``name``: "kv-" for "kvtrace-", cut to 15 bytes."""
    if name.startswith(_PREFIX):
        name = _SHORT + name[len(_PREFIX):]
    return name.encode()[:_MAX_BYTES].decode(errors="ignore")


def name_os_thread() -> None:
    """Give the calling thread its Python name in the OS (a no-op off Linux). Called first thing on
    each thread the collector starts, and as the gRPC worker pool's initializer."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, os_name(threading.current_thread().name).encode(), 0, 0, 0)
