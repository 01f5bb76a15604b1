"""The one definition of a percentile in kvtrace, exact and estimated.

Exact: linear interpolation between the closest ranks — DuckDB's ``quantile_cont``, numpy's
default — over the values themselves (:func:`quantile`; in SQL, :meth:`.sources.Dialect.quantiles`).
The reader, the sweep runs, the load generator's per-request ITL percentiles and the demo all
use it, so a p99 on one page is the same kind of number as a p99 on another.

Estimated: over many requests the reader reads the rollups' log-bucketed histograms
(``schema.HIST_PER_OCTAVE`` buckets per doubling) and interpolates inside the bucket that holds
the rank (:func:`histogram_quantiles`): within a bucket's width, ±4 %. Up to
:data:`EXACT_QUANTILES_UP_TO` selected requests the KPIs are exact.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import pyarrow as pa

from .. import schema

EXACT_QUANTILES_UP_TO = 200_000
"""Up to this many requests under the filters, the KPI percentiles are exact (``quantile_cont`` over the
rows: 5.5 ms for 200k rows in memory here, median of 7); above it they come from the rollup's histogram (±4 %)."""


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
    """Quantiles of a log-bucketed histogram ((bucket, count) pairs), interpolated log-linearly
    inside the bucket that holds each (linearly in the lowest, which starts at 0)."""
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
        bucket, n = pairs[i]
        before = cumulative[i] - n
        fraction = min(1.0, max(0.0, (rank - before) / n))
        low, high = schema.bucket_bounds(bucket)
        out.append(low + (high - low) * fraction if low <= 0 else low * (high / low) ** fraction)
    return out


def grouped_histogram_quantiles(table: pa.Table, keys: Sequence[str], bucket: str, count: str,
                                quantiles: Sequence[float]) -> dict[tuple, list[float | None]]:
    """:func:`histogram_quantiles` per group of ``keys`` of a (keys…, bucket, count) table."""
    groups: dict[tuple, list[tuple[int, float]]] = {}
    columns = [table.column(k).to_pylist() for k in keys]
    for i, (b, n) in enumerate(zip(table.column(bucket).to_pylist(), table.column(count).to_pylist())):
        groups.setdefault(tuple(c[i] for c in columns), []).append((b, n))
    return {key: histogram_quantiles(pairs, quantiles) for key, pairs in groups.items()}
