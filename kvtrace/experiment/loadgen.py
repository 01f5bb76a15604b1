"""An open-loop load generator for a kvtrace router, measuring TTFT, TPOT and inter-token latency
at the client.

Each request is a streaming ``/v1/completions`` call with a prompt of random token ids (drawn
from a seeded generator: no prompt text exists anywhere), a fixed output length with
``ignore_eos``, and a W3C ``traceparent`` so the router continues the client's trace: the
client's own span (``kvtrace.client.request``, with what it measured and the point it belongs
to) is the parent of ``pd.request``, and the collector puts both in one row.

Arrivals at a rate are Poisson conditioned on their count: exponential gaps, rescaled so their
mean is exactly 1/rate, so even a short point offers the rate it asks for rather than a random
sample of it. Sending never waits for answers (open loop); at a fixed concurrency, each of N
workers sends its next request when its last one ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any, Callable

import aiohttp
from opentelemetry import trace as otel_trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtrace.collectors.read.quantiles import quantile
from kvtrace.http_sent import SentAt, stamping
from kvtrace.telemetry import semconv

TOKEN_ID_RANGE = (100, 4000)
"""Prompt token ids are drawn from here: valid in any vocabulary of 4k tokens or more, and clear
of the special tokens at the start of most."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One point of a sweep: a prompt length at a rate (requests/s) or at a fixed concurrency."""

    prompt_tokens: int  # with ``lengths``: their median, which names the point
    rate: float | None = None
    concurrency: int | None = None
    lengths: tuple[int, ...] = ()  # a length distribution: each request's length is drawn from these

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("a point has a rate or a concurrency, not both")

    @property
    def label(self) -> str:
        load = f"{self.rate:g}/s" if self.rate is not None else f"c={self.concurrency}"
        return f"{'~' if self.lengths else ''}{self.prompt_tokens} tokens @ {load}"


def read_lengths(path: str) -> tuple[int, ...]:
    """A prompt-length distribution: one length in tokens per line (``#`` comments and blank lines
    skipped), e.g. taken from production logs. Requests draw from it, with replacement."""
    lengths = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{path}:{number}: {text[:40]!r} is not a whole number of tokens") from None
            if value < 1:
                raise ValueError(f"{path}:{number}: a prompt length must be >= 1")
            lengths.append(value)
    if not lengths:
        raise ValueError(f"{path}: no prompt lengths in it")
    return tuple(sorted(lengths))


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it (times in ns)."""

    sent_ns: int  # wall clock
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft_ns: int = 0
    itl_ns: list[int] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    trace_id: str = ""

    @property
    def tpot_ns(self) -> int:
        return int(sum(self.itl_ns) / len(self.itl_ns)) if self.itl_ns else 0


@dataclasses.dataclass
class PointResult:
    point: Point
    outcomes: list[Outcome]
    scheduled_rate: float  # what the schedule offered over its sends (None-rate points: 0)
    achieved_rate: float  # what was sent, over the time the sends took
    duration_s: float
    interrupted: bool = False

    def summary(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.ok]
        return {"prompt_tokens": self.point.prompt_tokens, "rate": self.point.rate,
                "concurrency": self.point.concurrency, "sent": len(self.outcomes), "ok": len(ok),
                "failed": len(self.outcomes) - len(ok), "scheduled_rate": round(self.scheduled_rate, 4),
                "achieved_rate": round(self.achieved_rate, 4), "duration_s": round(self.duration_s, 3),
                "interrupted": self.interrupted,
                "errors": sorted({o.error for o in self.outcomes if o.error})[:5]}


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of ``count`` Poisson arrivals at ``rate``, conditioned on
    their mean gap being exactly 1/rate; the first is sent at once."""
    gaps = [rng.expovariate(rate) for _ in range(count - 1)]
    scale = (count - 1) / rate / sum(gaps) if gaps and sum(gaps) > 0 else 1.0
    offsets, t = [0.0], 0.0
    for gap in gaps:
        t += gap * scale
        offsets.append(t)
    return offsets


def prompt_ids(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)]


def _error_message(body: str) -> str:
    """The message of an OpenAI-style error body (never the prompt: vLLM's messages name limits)."""
    try:
        error = json.loads(body).get("error", {})
        return str(error.get("message") if isinstance(error, dict) else error)[:160]
    except (ValueError, AttributeError):
        return body[:160]


def client_session(**kwargs: Any) -> aiohttp.ClientSession:
    """A session whose requests' TTFT starts as aiohttp writes them (:mod:`kvtrace.http_sent`): the load
    generator's own building of a request, milliseconds when the engines hold the host's cores, is not the
    server's time to first token."""
    return aiohttp.ClientSession(trace_configs=[stamping(time.perf_counter_ns)], **kwargs)


class Client:
    """Sends one streaming completion and measures it; records the client span if a tracer is given."""

    def __init__(self, router: str, model: str, output_tokens: int, tracer: Any = None,
                 timeout_s: float = 300.0) -> None:
        self.url = router.rstrip("/") + "/v1/completions"
        self.model = model
        self.output_tokens = output_tokens
        self.tracer = tracer
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._propagator = TraceContextTextMapPropagator()

    async def send(self, session: aiohttp.ClientSession, prompt: list[int], point: Point | None) -> Outcome:
        # ignore_eos, not min_tokens: the router's prefill leg asks for one token, below any minimum
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.output_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"Content-Type": "application/json"}
        span = None
        sent_ns = time.time_ns()
        if self.tracer is not None and point is not None:
            span = self.tracer.start_span(semconv.SPAN_CLIENT_REQUEST, start_time=sent_ns,
                                          kind=otel_trace.SpanKind.CLIENT)
            self._propagator.inject(headers, otel_trace.set_span_in_context(span))
        outcome = Outcome(sent_ns)
        called = time.perf_counter_ns()
        sent = SentAt(called)  # TTFT starts as the request is written (a session from client_session())
        last = 0
        try:
            async with session.post(self.url, data=json.dumps(body), headers=headers, timeout=self.timeout,
                                    trace_request_ctx=sent) as resp:
                outcome.status = resp.status
                if resp.status != 200:
                    detail = (await resp.read()).decode(errors="replace")
                    outcome.error = f"HTTP {resp.status}: {_error_message(detail)}"
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        now = time.perf_counter_ns()
                        chunk = json.loads(line[6:])
                        if chunk.get("error"):
                            outcome.error = "error in stream"
                            break
                        usage = chunk.get("usage")
                        if usage:
                            outcome.output_tokens = int(usage.get("completion_tokens") or 0)
                        if not chunk.get("choices"):
                            continue
                        if not last:
                            outcome.ttft_ns = now - sent.ns
                        else:
                            outcome.itl_ns.append(now - last)
                        last = now
                    outcome.ok = not outcome.error and outcome.ttft_ns > 0
                    if outcome.ok and not outcome.output_tokens:
                        outcome.output_tokens = len(outcome.itl_ns) + 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.error = type(exc).__name__
        finally:
            if span is not None:
                outcome.trace_id = f"{span.get_span_context().trace_id:032x}"
                self._end_span(span, outcome, point, sent_ns + (time.perf_counter_ns() - called))
        return outcome

    @staticmethod
    def _end_span(span: Any, outcome: Outcome, point: Point, end_ns: int) -> None:
        attributes: dict[str, Any] = {semconv.BENCH_PROMPT_TOKENS: point.prompt_tokens}
        if point.rate is not None:
            attributes[semconv.BENCH_RATE] = float(point.rate)
        else:
            attributes[semconv.BENCH_CONCURRENCY] = point.concurrency
        if outcome.ok:
            attributes[semconv.CLIENT_TTFT_NS] = outcome.ttft_ns
            attributes[semconv.CLIENT_OUTPUT_TOKENS] = outcome.output_tokens
            if outcome.itl_ns:
                attributes[semconv.CLIENT_TPOT_NS] = outcome.tpot_ns
                attributes[semconv.CLIENT_ITL_P50_NS] = round(quantile(outcome.itl_ns, 0.5))
                attributes[semconv.CLIENT_ITL_P99_NS] = round(quantile(outcome.itl_ns, 0.99))
        else:
            span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, outcome.error))
        span.set_attributes(attributes)
        span.end(end_time=end_ns)


async def run_point(client: Client, point: Point, requests: int, seed: int, stop: asyncio.Event,
                    max_seconds: float, on_done: Callable[[Outcome], None] = lambda o: None) -> PointResult:
    """``requests`` requests of one point (fewer if ``stop`` is set or ``max_seconds`` pass: what
    finished is kept). Prompts and arrivals come from ``seed``."""
    rng = random.Random(f"{seed}:{point.prompt_tokens}:{point.rate}:{point.concurrency}")
    prompts = [prompt_ids(rng.choice(point.lengths) if point.lengths else point.prompt_tokens, rng)
               for _ in range(requests)]
    outcomes: list[Outcome] = []
    send_times: list[float] = []
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)
    start = loop.time()
    deadline = start + max_seconds
    interrupted = False

    async def one(prompt: list[int]) -> None:
        send_times.append(loop.time())
        outcome = await client.send(session, prompt, point)
        outcomes.append(outcome)
        on_done(outcome)

    async with client_session(connector=connector) as session:
        tasks: list[asyncio.Task] = []
        if point.rate is not None:
            offsets = arrival_offsets(requests, point.rate, rng)
            for prompt, offset in zip(prompts, offsets):
                wait = start + offset - loop.time()
                if wait > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set() or loop.time() > deadline:
                    interrupted = True
                    break
                tasks.append(asyncio.create_task(one(prompt)))
            scheduled = (len(tasks) - 1) / offsets[len(tasks) - 1] if len(tasks) > 1 else 0.0
        else:
            queue = list(prompts)

            async def worker() -> None:
                while queue and not stop.is_set() and loop.time() < deadline:
                    await one(queue.pop())

            tasks = [asyncio.create_task(worker()) for _ in range(point.concurrency)]
            scheduled = 0.0
        pending = set(tasks)
        while pending:
            remaining = max(0.1, deadline + 60 - loop.time())  # answers to what was sent may run past it
            done, pending = await asyncio.wait(pending, timeout=min(remaining, 0.5))
            if stop.is_set() and pending:  # Ctrl-C: give in-flight requests a moment, then cancel
                _, pending = await asyncio.wait(pending, timeout=5)
                for task in pending:
                    task.cancel()
                interrupted = True
                break
    duration = loop.time() - start
    sent = sorted(send_times)
    achieved = (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else 0.0
    if point.concurrency is not None:
        achieved = len(outcomes) / duration if duration > 0 else 0.0
    return PointResult(point, outcomes, scheduled, achieved, duration, interrupted or len(outcomes) < requests)
