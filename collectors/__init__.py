"""kvtrace.collectors: OTLP in, assembled traces, critical-path attribution of TTFT, an
embedded DuckDB store, and a tee to any OTLP backend.

The pipeline reads like an OpenTelemetry Collector's: receivers (``receivers``) → write-ahead
log (``wal``) → decode (``model``) → store (``store``) and assembler (``assembler``) →
attribution (``attribution``); exporters (``forwarder``) tee to upstream APMs. ``service``
wires them; ``kvtrace collector`` runs it.
"""
