"""kvtrace.collectors: OTLP in, assembled traces, critical-path attribution of TTFT, an
embedded DuckDB store, a tee to any OTLP backend — and the read side every reader goes through.

The pipeline, a chain like an OpenTelemetry Collector's (wired in :mod:`.service`, run by
``kvtrace collector``): receivers (:mod:`.receivers`, decoding with :mod:`.model`) → write-ahead
log (:mod:`.wal`) → store writer (:mod:`.store`, layout in :mod:`.schema`) and assembler
(:mod:`.assembler`) → attribution (:mod:`.attribution`, clocks from :mod:`.clocks`, the result a
:mod:`.breakdown`) → store writer and forwarder (:mod:`.forwarder`, with :mod:`.breakdown_span`).
A running collector answers reads on :mod:`.query_service`.

The read side, :mod:`.read`: the questions the dashboard and the CLI ask, over a file or a
running collector. The pipeline never imports it (tests/test_layering.py).
"""

from . import compiled as _compiled

_compiled.install()  # before any per-trace module is imported: a compiled one runs only while it is current
