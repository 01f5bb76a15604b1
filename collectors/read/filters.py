"""What a reader question can be narrowed to, as the SQL WHERE clause of a rollup or of ``requests``."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from .. import schema


@dataclasses.dataclass(frozen=True)
class Filters:
    """What every page can narrow to. Times are floored to the minute (the rollups' grain), so a
    rollup and a raw-row query of the same filters count the same requests."""

    since: datetime | None = None
    until: datetime | None = None
    modes: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    instances: tuple[str, ...] = ()  # a request matches when its P or its D is one of them
    min_length_bucket: int | None = None  # log2 of prompt tokens (schema.LENGTH_BUCKET_SQL)
    max_length_bucket: int | None = None

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None:
                if value.tzinfo is None:
                    value = value.replace(tzinfo=timezone.utc)
                object.__setattr__(self, name, value.replace(second=0, microsecond=0))

    def where(self, *, rollup: bool, alias: str = "") -> tuple[str, list]:
        """A WHERE clause (with its parameters) for a rollup table or for ``requests``."""
        a = alias
        clauses, params = [], []
        time_column = f"{a}minute" if rollup else f"{a}started_at"
        length = f"{a}length_bucket" if rollup else f"({schema.LENGTH_BUCKET_SQL.replace('prompt_tokens', a + 'prompt_tokens')})"
        for column, bound, value in ((time_column, ">=", self.since), (time_column, "<", self.until),
                                     (length, ">=", self.min_length_bucket), (length, "<=", self.max_length_bucket)):
            if value is not None:
                clauses.append(f"{column} {bound} ?")
                params.append(value)
        for column, values in ((f"{a}mode", self.modes), (f"{a}run_id", self.runs)):
            if values:
                clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
                params += list(values)
        if self.instances:
            marks = ", ".join("?" * len(self.instances))
            clauses.append(f"({a}prefill_instance IN ({marks}) OR {a}decode_instance IN ({marks}))")
            params += list(self.instances) * 2
        return " AND ".join(clauses) or "TRUE", params


def length_label(bucket: int) -> str:
    """A prompt-length bucket as people say it (``1k-2k``)."""
    if bucket < 0:
        return "unknown"
    return f"{_tokens(2 ** bucket)}-{_tokens(2 ** (bucket + 1))}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)
