"""The one definition of a percentile in kvtrace, exact and estimated.

Exact: linear interpolation between the closest ranks — DuckDB's ``quantile_cont``, numpy's
default — over the values themselves (:func:`quantile`; in SQL, :meth:`.sources.Dialect.quantiles`).
The reader, the sweep runs, the load generator's per-request ITL percentiles and the demo all
use it, so a p99 on one page is the same kind of number as a p99 on another.

Estimated: over many requests the reader reads the rollups' log-bucketed histograms
(``schema.HIST_PER_OCTAVE`` buckets per doubling) and takes, for the bucket that holds the rank, the one
value within :data:`ESTIMATE_ERROR` (±3.9 %) of anything the bucket can hold (:func:`histogram_quantiles`).
Up to :data:`EXACT_QUANTILES_UP_TO` selected requests the KPIs, TTFT over time, the stage table and TPOT
are exact.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import pyarrow as pa

from .. import schema

EXACT_QUANTILES_UP_TO = 200_000
"""Up to this many complete requests under the filters, percentiles are exact (``quantile_cont`` over the
rows: 5.5 ms for 200k rows in memory here, median of 7; the stage table, which reads each of their
stages: 0.13 s at 199k of a million requests); above it they come from the rollups' histograms (within
:data:`ESTIMATE_ERROR`)."""
_GROWTH = 2 ** (1 / schema.HIST_PER_OCTAVE)  # a bucket's high over its low
ESTIMATE_ERROR = (_GROWTH - 1) / (_GROWTH + 1)
"""The most a histogram's estimate is off, relative to the value at its rank: 3.85 % (buckets 2^(1/9) wide)."""
ESTIMATE_ERROR_TEXT = f"±{math.ceil(ESTIMATE_ERROR * 1000) / 10:.1f} %"
""":data:`ESTIMATE_ERROR` as the pages and the demo state it, rounded up (±3.9 %): never a tighter bound than holds."""


def quantile(values: Iterable[float | None], q: float) -> float:
    """The ``q`` quantile of ``values`` (None ignored), interpolated between the closest ranks; NaN if none."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def histogram_quantiles(buckets: Iterable[tuple[int, float]], quantiles: Sequence[float]) -> list[float | None]:
    """Quantiles of a log-bucketed histogram ((bucket, count) pairs): for each, the bucket that holds its
    rank, read as 2·low·high / (low + high), within :data:`ESTIMATE_ERROR` of every value in [low, high]
    (DDSketch's estimate; the lowest bucket, which starts at 0 and holds up to ~1 µs, as its middle).
    Interpolating inside the bucket by rank, as before, was off by up to a whole bucket where values bunch:
    152 ms for a p50 of 144 ms when every request's prefill took 144 ms (8 buckets per doubling then)."""
    pairs = sorted((b, n) for b, n in buckets if n > 0)
    total = sum(n for _, n in pairs)
    if total <= 0:
        return [None] * len(quantiles)
    cumulative, running = [], 0.0
    for _, n in pairs:
        running += n
        cumulative.append(running)
    out: list[float | None] = []
    for q in quantiles:
        rank = q * total
        i = min(bisect.bisect_left(cumulative, rank), len(pairs) - 1)
        low, high = schema.bucket_bounds(pairs[i][0])
        out.append(high / 2 if low <= 0 else 2 * low * high / (low + high))
    return out


def grouped_histogram_quantiles(table: pa.Table, keys: Sequence[str], bucket: str, count: str,
                                quantiles: Sequence[float]) -> dict[tuple, list[float | None]]:
    """:func:`histogram_quantiles` per group of ``keys`` of a (keys…, bucket, count) table."""
    groups: dict[tuple, list[tuple[int, float]]] = {}
    columns = [table.column(k).to_pylist() for k in keys]
    for i, (b, n) in enumerate(zip(table.column(bucket).to_pylist(), table.column(count).to_pylist())):
        groups.setdefault(tuple(c[i] for c in columns), []).append((b, n))
    return {key: histogram_quantiles(pairs, quantiles) for key, pairs in groups.items()}
