"""kvtrace: observability for prefill/decode-disaggregated LLM serving in vLLM.

Subpackages: ``kvtrace.telemetry`` (contract, recorder, export), ``kvtrace.connector``
(traced NIXL connectors), ``kvtrace.collectors`` (OTLP in, attribution, store),
``kvtrace.dashboard`` (Streamlit). The CLI is ``kvtrace`` (``kvtrace.cli``).
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("kvtrace")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
