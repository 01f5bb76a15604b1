"""kvtrace.collectors: OTLP receivers, trace assembly, TTFT attribution, store and forwarding."""
