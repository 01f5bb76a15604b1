"""kvtrace's read side: every question asked of a store, whoever writes it.

``open_store(path)`` (or ``open_store(collector=URL)``) gives a :class:`StoreReader`; the dashboard,
the ``kvtrace query``/``compare``/``whatif`` commands and the demo read only through it.

* :mod:`.sources` — where the data comes from (a file, a running collector, either, or a fleet's
  shared ClickHouse store), behind the
  small :class:`~.sources.StoreSource` interface and its SQL :class:`~.sources.Dialect`
* :mod:`.filters` — what a question can be narrowed to
* :mod:`.quantiles` — the one definition of a percentile (exact, and the histogram estimate)
* :mod:`.reader` — the questions
* :mod:`.traces` — one trace's spans and tensor-parallel ranks
* :mod:`.runs` — sweep runs: compare and what-if

The pipeline (the rest of :mod:`kvtrace.collectors`) never imports this package.
"""

from ..schema import PART_COLUMNS, PARTS

from .filters import Filters, length_label
from .quantiles import ESTIMATE_ERROR, ESTIMATE_ERROR_TEXT, EXACT_QUANTILES_UP_TO
from .reader import StoreReader, is_trace_id, open_store
from .runs import RunNotFound, point_label
from .sources import StoreUnavailable

__all__ = ["ESTIMATE_ERROR", "ESTIMATE_ERROR_TEXT", "EXACT_QUANTILES_UP_TO", "PARTS", "PART_COLUMNS", "Filters",
           "RunNotFound", "StoreReader", "StoreUnavailable", "is_trace_id", "length_label", "open_store", "point_label"]
