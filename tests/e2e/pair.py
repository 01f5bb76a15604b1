"""Shared by the end-to-end tests: a workload, an OTLP sink, and the checks on assembled traces.

These tests run a real 1P1D pair (vLLM on CPU, NIXL/UCX over loopback, the tiny local
model) through the kvtrace router, with every span landing in an OTLP/gRPC receiver here.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvtrace.collectors.receivers import OtlpHttpReceiver
from kvtrace.testbed.launch import LocalPair, PairConfig
from kvtrace.testbed.recipes import kv_bytes_per_token

BLOCK_SIZE = 128  # vLLM's CPU default
TOLERANCE_NS = 2_000_000  # each process converts its monotonic clock to wall time separately

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def prompt(i: int, words: int) -> str:
    """A prompt carrying a unique marker, so leaks of prompt text can be searched for."""
    body = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
    return f"zq{i:03d}marker {body}"


@dataclass
class Call:
    request_id: str
    chat: bool
    stream: bool
    text: str
    prompt_tokens: int = 0
    output: str = ""
    status: int = 0
    seconds: float = 0.0


def send(base_url: str, call: Call, max_tokens: int = 8, timeout: float = 120) -> Call:
    path = "/v1/chat/completions" if call.chat else "/v1/completions"
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": call.stream}
    if call.chat:
        body["messages"] = [{"role": "user", "content": call.text}]
    else:
        body["prompt"] = call.text
    if call.stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "X-Request-Id": call.request_id})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            call.status = resp.status
            raw = resp.read().decode()
    except urllib.error.HTTPError as exc:
        call.status = exc.code
        call.output = exc.read().decode(errors="replace")
        return call
    call.seconds = time.monotonic() - start
    if call.stream:
        pieces = []
        for line in raw.splitlines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    call.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    pieces.append((choice.get("delta") or {}).get("content") if call.chat else choice.get("text"))
        call.output = "".join(p or "" for p in pieces)
    else:
        payload = json.loads(raw)
        call.prompt_tokens = payload["usage"]["prompt_tokens"]
        choice = payload["choices"][0]
        call.output = choice["message"]["content"] if call.chat else choice["text"]
    return call


def workload(tag: str) -> list[Call]:
    """Short and long prompts, completions and chat, streaming and not."""
    calls = []
    shapes = [(20, False, False), (800, False, False), (20, True, True), (850, False, True),
              (300, True, False), (900, True, True), (60, False, True), (700, False, False)]
    for i, (words, chat, stream) in enumerate(shapes):
        calls.append(Call(f"{tag}-{i}", chat, stream, prompt(i, words)))
    return calls


class SpanSink:
    """Collects spans from an OTLP/HTTP receiver on 127.0.0.1 (the testbed's default protocol)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.receiver = OtlpHttpReceiver(self._consume, port=0)

    def _consume(self, batch) -> None:
        rows = []
        for rs in batch.request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    rows.append({
                        "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano, "status": s.status.code,
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                        "events": [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        "resource": resource,
                    })
        with self._lock:
            self.spans.extend(rows)

    def traces(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        with self._lock:
            for span in self.spans:
                out.setdefault(span["trace_id"], []).append(span)
        return out

    def wait_for(self, predicate, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.25)
        return predicate(self)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class RunResult:
    calls: list[Call]
    untraced_outputs: list[str]
    traces: dict[str, list[dict]]
    idle_cpu_percent: float
    extra: dict = field(default_factory=dict)


def is_request(span: dict, request_id: str) -> bool:
    """Whether a span's kvtrace.request_id is the engines' id for this X-Request-Id."""
    return span["attrs"].get("kvtrace.request_id") in (f"cmpl-{request_id}-0", f"chatcmpl-{request_id}")


def trace_of(traces: dict[str, list[dict]], request_id: str) -> list[dict]:
    """The spans of the trace whose pd.request names this router request id."""
    matches = [spans for spans in traces.values()
               if any(s["name"] == "pd.request" and is_request(s, request_id) for s in spans)]
    assert len(matches) == 1, f"{request_id}: {len(matches)} traces carry its pd.request"
    return matches[0]


def expected_kv_bytes(prompt_tokens: int) -> int:
    return math.ceil(prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token()


def run_mode(mode: str, log_dir, extra_calls=None) -> RunResult:
    """Run the workload traced, then again untraced on a fresh pair, and collect everything."""
    sink = SpanSink()
    sink.receiver.start()
    try:
        calls = workload(mode)
        with LocalPair(PairConfig(mode=mode, otlp_endpoint=sink.receiver.endpoint,
                                  log_dir=log_dir / f"{mode}-traced")) as pair:
            for call in calls:
                send(pair.router_url, call)
            extra = extra_calls(pair) if extra_calls else {}
            request_ids = [c.request_id for c in calls]
            sink.wait_for(lambda s: all(
                sum(1 for spans in s.traces().values() for sp in spans
                    if sp["name"] == "engine.first_token" and is_request(sp, rid)) == 1
                for rid in request_ids))
            time.sleep(1.5)  # let the last spans of every process (P's release) arrive
            idle = pair.idle_cpu_percent(3.0)
        untraced = [Call(c.request_id + "-off", c.chat, c.stream, c.text) for c in calls]
        with LocalPair(PairConfig(mode=mode, tracing=False, log_dir=log_dir / f"{mode}-untraced")) as pair:
            for call in untraced:
                send(pair.router_url, call)
        return RunResult(calls, [c.output for c in untraced], sink.traces(), idle, extra)
    finally:
        sink.receiver.shutdown()


def concurrent_sends(base_url: str, calls: list[Call], width: int) -> list[Call]:
    with concurrent.futures.ThreadPoolExecutor(width) as pool:
        return list(pool.map(lambda c: send(base_url, c), calls))
