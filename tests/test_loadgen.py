"""The sweep's load generator on its own: arrivals, prompts, and the command line's errors.
(Against the real pair: tests/e2e/test_sweep_e2e.py.)"""

import random
import statistics

import pytest

from kvtrace import cli
from kvtrace.experiment.loadgen import TOKEN_ID_RANGE, Point, arrival_offsets, prompt_ids


@pytest.mark.parametrize("rate,count", [(0.25, 8), (2.0, 12), (8.0, 200)])
def test_arrivals_offer_exactly_the_rate_asked(rate, count):
    offsets = arrival_offsets(count, rate, random.Random(5))
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == count
    assert (count - 1) / offsets[-1] == pytest.approx(rate, rel=1e-12)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    if count >= 200:  # still Poisson-shaped: exponential gaps have a coefficient of variation near 1
        assert 0.8 < statistics.pstdev(gaps) / statistics.mean(gaps) < 1.2


def test_arrivals_and_prompts_are_reproducible_by_seed():
    assert arrival_offsets(10, 1.0, random.Random(1)) == arrival_offsets(10, 1.0, random.Random(1))
    assert arrival_offsets(10, 1.0, random.Random(1)) != arrival_offsets(10, 1.0, random.Random(2))
    ids = prompt_ids(512, random.Random(3))
    assert ids == prompt_ids(512, random.Random(3)) and len(ids) == 512
    assert all(TOKEN_ID_RANGE[0] <= i < TOKEN_ID_RANGE[1] for i in ids)


def test_a_point_has_a_rate_or_a_concurrency():
    assert Point(128, rate=2).label == "128 tokens @ 2/s" and Point(64, concurrency=4).label == "64 tokens @ c=4"
    with pytest.raises(ValueError):
        Point(128)
    with pytest.raises(ValueError):
        Point(128, rate=1, concurrency=2)


@pytest.mark.parametrize("argv,message", [
    (["--local", "--db", "x.duckdb", "--prompt-tokens", "128", "--rate", "0"], "--rate 0: must be > 0"),
    (["--local", "--db", "x.duckdb", "--prompt-tokens", "a,b", "--rate", "1"], "expected comma-separated numbers"),
    (["--local", "--db", "x.duckdb", "--prompt-tokens", "128", "--rate", "1", "--requests", "0"], "--requests"),
    (["--local", "--db", "x.duckdb", "--prompt-tokens", "0", "--concurrency", "2"], "--prompt-tokens 0"),
])
def test_bad_sweep_arguments_are_named(argv, message, capsys):
    assert cli.main(["bench", "sweep", *argv]) == 2
    assert message in capsys.readouterr().err


def test_sweep_needs_a_target_and_one_mode_per_deployment(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "sweep", "--prompt-tokens", "128", "--rate", "1"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "sweep", "--router", "http://127.0.0.1:9", "--mode", "push", "--mode", "pull",
                  "--prompt-tokens", "128", "--rate", "1"])
    assert "one --mode" in capsys.readouterr().err


def test_compare_names_a_missing_run(tmp_path, capsys):
    from kvtrace.collectors.store import Store

    db = tmp_path / "empty.duckdb"
    store = Store(str(db))
    store.start("test", {})
    store.shutdown()
    assert cli.main(["compare", "nope-a", "nope-b", "--db", str(db)]) == 2
    assert "no run 'nope-a'" in capsys.readouterr().err


def test_a_length_distribution_file(tmp_path):
    from kvtrace.experiment.loadgen import read_lengths

    path = tmp_path / "lengths.txt"
    path.write_text("# from production\n900\n100\n\n400  # a comment\n")
    assert read_lengths(str(path)) == (100, 400, 900)
    path.write_text("100\nten\n")
    with pytest.raises(ValueError, match="lengths.txt:2: 'ten' is not a whole number"):
        read_lengths(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no prompt lengths"):
        read_lengths(str(path))


def test_requests_draw_their_lengths_from_the_distribution():
    import asyncio

    from kvtrace.experiment import loadgen

    seen = []

    class Recording:  # stands in for the HTTP client: records what would be sent
        async def send(self, session, prompt, point):
            seen.append(len(prompt))
            return loadgen.Outcome(0, ok=True)

    point = Point(400, rate=200.0, lengths=(100, 400, 900))
    result = asyncio.run(loadgen.run_point(Recording(), point, 60, seed=1, stop=asyncio.Event(), max_seconds=30))
    assert len(result.outcomes) == 60 and set(seen) == {100, 400, 900}
    assert point.label == "~400 tokens @ 200/s"


def test_ttft_starts_as_the_request_is_written_not_while_the_client_builds_it(monkeypatch):
    """The client's own building of a request (here a 50 ms encode) is its time, not the server's TTFT;
    the whole exchange, as its span sees it, still includes it."""
    import asyncio
    import json
    import time

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from kvtrace.experiment import loadgen

    encode = json.dumps  # the server's, before the client's is slowed

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b"):
            await response.write(b"data: " + encode({"choices": [{"text": text}]}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def slow_dumps(value, **kwargs):
        time.sleep(0.05)
        return encode(value, **kwargs)

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        async with TestServer(app, host="127.0.0.1") as server, loadgen.client_session() as session:
            client = loadgen.Client(str(server.make_url("")), "tiny", 2)
            monkeypatch.setattr(loadgen.json, "dumps", slow_dumps)  # (the json module: the client's only user)
            started = time.perf_counter_ns()
            outcome = await client.send(session, [1, 2, 3], None)
            return outcome, time.perf_counter_ns() - started

    outcome, elapsed = asyncio.run(run())
    assert outcome.ok and outcome.output_tokens == 2
    assert elapsed >= 50e6 > outcome.ttft_ns > 0
