#!/usr/bin/env python3
"""Where the collector's CPU goes: each pipeline stage's cost per span, on one thread.

The same load as bench/collector_ingest.py (contract-shaped traces, ~500 spans per export
request) is pushed through the collector's own parts in order, in this process and on one
thread, with the store's writer thread off so that each stage's CPU time is its own:
decode and check (native or Python) → write-ahead log → store buffer → (with ``--forward``) the
tee queueing each request as received → assembler → decision + attribution + metrics → (with
``--forward``) the decided traces' breakdown spans, encoded and queued for an upstream that is
never called → store flush (Arrow → DuckDB, one transaction per 65,536 spans, the writer
thread's size limit) → DuckDB's checkpoints (the ones it makes on its own as its WAL grows, and
one at the end, as a clean stop makes: what is still in the WAL is work deferred, not saved).
A warm-up of other traces goes first (first calls, lazy imports: pyarrow's first conversion
alone costs ~0.2 s). No gRPC: bench/collector_ingest.py measures the whole process.

With ``--clocks``, every sender's clock is measured, as kvtrace's own senders exchange clocks with
the collector by default: each trace's offsets then come from the measured fits (and are checked
against the span order) instead of being inferred from it. The load's span times are not causally
ordered (D's registration starts 12 ms after P received it), so on measured clocks every trace is
flagged ``clock_suspect``: the check stops at that pair, its fifth of six.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from collector_ingest import STAGES, instance_of, make_load  # noqa: E402

from kvtrace.collectors.compiled import running_as_python  # noqa: E402
from kvtrace.collectors.config import CollectorConfig  # noqa: E402
from kvtrace.collectors.model import DECODER, SpanBatch  # noqa: E402
from kvtrace.collectors.service import GC_YOUNG_THRESHOLD, Collector  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=15_000, help="traces of 14 spans (default 15000)")
    parser.add_argument("--batch", type=int, default=500, help="spans per export request")
    parser.add_argument("--forward", action="store_true",
                        help="forwarding on (tee and breakdown spans), as collector_ingest.py --forward runs it")
    parser.add_argument("--clocks", action="store_true",
                        help="every sender's clock measured (clock exchanges before the load), as deployed")
    parser.add_argument("--db", help="a store to ingest into (copied first, left unchanged): the cost per span into a "
                                     "store that already holds many requests, as a long-running collector's does")
    parser.add_argument("--seed", type=int, default=1,
                        help="the load's trace ids (default 1; with --db, one that did not fill that store)")
    args = parser.parse_args()
    load_start = time.time_ns() - 3_600 * 10**9
    load = make_load(args.traces, args.batch, seed=args.seed, start_ns=load_start)
    spans = args.traces * len(STAGES)
    costs: dict[str, float] = {}

    def charge(stage: str, since: float) -> float:
        now = time.process_time()
        costs[stage] = costs.get(stage, 0.0) + now - since
        return now

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.db)) if args.db else None) as tmp:
        db_path = os.path.join(tmp, "stages.duckdb")
        if args.db:
            shutil.copyfile(args.db, db_path)
        before = _count(db_path, "spans"), _count(db_path, "requests")
        # A forwarder whose upstream's thread never starts: what it queues is encoded, never sent.
        collector = Collector(CollectorConfig(db_path=db_path, grpc_port=0,
                                              http_port=None, decision_wait_s=0.0,
                                              forward=["grpc://127.0.0.1:9"] if args.forward else []))
        forwarder = collector.forwarder
        if args.clocks:  # an exchange every 2 s over the load's time, each with a 0.2 ms round trip
            for at in range(load_start - 4 * 10**9, load_start + args.traces * 10**6 + 4 * 10**9, 2 * 10**9):
                for service in sorted({stage[0] for stage in STAGES}):
                    collector.clocks.add(instance_of(service), at - 100_000, at, at + 20_000, at + 120_000)
        forwarding = [0.0]  # CPU seconds inside the forwarder's consume (called by the decisions)
        if forwarder is not None:
            consume = forwarder.consume

            def timed_consume(*args_) -> None:
                started = time.process_time()
                consume(*args_)
                forwarding[0] += time.process_time() - started
            forwarder.consume = timed_consume
        gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)  # as Collector.start sets it
        flush_every = collector.store._flush_rows
        warm_up = make_load(200, args.batch, seed=2)
        for payload in warm_up:  # stored, not attributed
            collector.store.add_spans(SpanBatch.decode(payload), collector.wal.append(payload))
        collector.store.flush()
        buffered = 0
        collecting = [0.0, 0.0]  # the cyclic GC's CPU seconds during the load, its current start

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                collecting[1] = time.process_time()
            else:
                collecting[0] += time.process_time() - collecting[1]
        gc.callbacks.append(on_gc)
        t = time.process_time()
        for payload in load:
            batch = SpanBatch.decode(payload)
            t = charge(f"decode + check ({DECODER})", t)
            position = collector.wal.append(payload)
            t = charge("write-ahead log", t)
            collector.store.add_spans(batch, position)
            t = charge("store buffer", t)
            if forwarder is not None:
                forwarder.consume_batch(payload, len(batch.rows))
                t = charge("tee (queued as received)", t)
            collector.assembler.add(batch.rows)
            t = charge("assembler", t)
            forwarding[0] = 0.0
            collector.assembler.poll(flush_all=True)
            if forwarder is not None:
                costs["breakdown spans (encode, queue)"] = costs.get("breakdown spans (encode, queue)", 0.0) + forwarding[0]
                t += forwarding[0]  # charged on its own line, not to the decisions
            t = charge("decide + attribute + metrics", t)
            buffered += len(batch.rows)
            if buffered >= flush_every:
                collector.store.flush()
                buffered = 0
                t = charge("store flush (DuckDB)", t)
        collector.store.flush()
        t = charge("store flush (DuckDB)", t)
        gc.callbacks.remove(on_gc)
        collector.store.query("CHECKPOINT")
        charge("checkpoint at the end", t)
        stored = collector.store.query("SELECT count(*) FROM spans")[0][0] - 200 * len(STAGES) - before[0]
        attributed = collector.store.query("SELECT count(*) FROM requests")[0][0] - before[1]
        measured, suspect = collector.store.query("SELECT count(*) FILTER (WHERE cardinality(clock_bounds) > 1), "
                                                  "count(*) FILTER (WHERE clock_suspect) FROM requests")[0]
        collector.store.shutdown()
        collector.wal.close()

    total = sum(costs.values())
    into = f" into a store of {before[1]:,} requests ({before[0]:,} spans)" if args.db else ""
    print(f"{spans:,} spans ({stored:,} stored, {attributed:,} traces attributed){into}, one thread, CPU time per span:")
    as_python = running_as_python()
    print(f"  (per-trace modules {'running as Python: ' + ', '.join(as_python) if as_python else 'compiled'}; "
          f"clocks {'measured' if args.clocks else 'inferred from span order'}: {measured:,} traces on measured "
          f"offsets, {suspect:,} flagged clock_suspect)")
    if attributed < args.traces:
        print(f"  !! {args.traces - attributed:,} of the load's trace ids were already stored: each flush holding one "
              f"was retried (OR IGNORE); pick another --seed")
    for stage, seconds in costs.items():
        print(f"  {stage:<33}{seconds / spans * 1e6:>7.2f} µs  {seconds / total:>6.1%}")
    print(f"  {'total':<33}{total / spans * 1e6:>7.2f} µs  -> {spans / total:,.0f} spans per CPU-second")
    print(f"  {'(in the above: the cyclic GC)':<33}{collecting[0] / spans * 1e6:>7.2f} µs  {collecting[0] / total:>6.1%}")
    return 0


def _count(db_path: str, table: str) -> int:
    """Rows in one of a store's tables; 0 with no store there yet."""
    if not os.path.exists(db_path):
        return 0
    import duckdb
    with duckdb.connect(db_path, read_only=True) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


if __name__ == "__main__":
    raise SystemExit(main())
