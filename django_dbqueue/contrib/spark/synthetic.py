"""A synthetic archive with a known distribution, for the analytics tests and benchmark.

Rows are generated from a seed (the same seed, the same rows) and inserted
with multi-row INSERTs, many thousands per statement round trip, not one
by one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import connections
from django.db.backends.utils import CursorWrapper

from ...db.sql import json_param
from ...models import ArchivedMessage, Outcome

QUEUES = ("orders", "emails", "reports")
KINDS = ("", "invoice", "reminder")
ERROR_TYPES = ("ValueError", "KeyError", "payments.CardDeclined", "TimeoutError")
# Outcomes and their weights; attempts per outcome and their weights.
T = TypeVar("T")
OUTCOMES: tuple[tuple[str, int], ...] = (
    (Outcome.ACKED.value, 80),
    (Outcome.DEAD.value, 12),
    (Outcome.EXPIRED.value, 6),
    ("cancelled", 2),
)
ATTEMPTS: dict[str, tuple[tuple[int, int], ...]] = {
    Outcome.ACKED.value: ((1, 70), (2, 20), (3, 10)),
    Outcome.DEAD.value: ((3, 60), (5, 30), (1, 10)),
    Outcome.EXPIRED.value: ((0, 50), (1, 50)),
    "cancelled": ((0, 100),),
}
COLUMNS = (
    "message_id",
    "queue",
    "kind",
    "payload",
    "headers",
    "priority",
    "created_at",
    "first_available_at",
    "claimed_at",
    "finished_at",
    "attempts",
    "outcome",
    "finished_by",
    "last_error",
    "replayed_by",
)


@dataclass(frozen=True, slots=True)
class Row:
    queue: str
    kind: str
    outcome: str
    attempts: int
    created_at: datetime
    first_available_at: datetime
    claimed_at: datetime | None
    finished_at: datetime
    last_error: str
    error_type: str | None  # what the analytics must find in last_error (dead letters)


def _pick(rng: random.Random, weighted: Iterable[tuple[T, int]]) -> T:
    pairs = list(weighted)
    return rng.choices([choice for choice, _ in pairs], [weight for _, weight in pairs])[0]


def _us(seconds: float) -> timedelta:
    return timedelta(microseconds=round(seconds * 1_000_000))


def archive_rows(n: int, *, start: datetime, hours: int, seed: int = 0, queue_prefix: str = "") -> Iterator[Row]:
    """``n`` archived messages created uniformly over ``hours`` hours from ``start``.

    Waits are exponential (mean 2 s), processing times log-normal (median
    about 0.2 s), a fifth of the messages start delayed by up to a minute;
    dead letters carry a traceback ending in one of ``ERROR_TYPES``, or a
    rejection reason.
    """
    rng = random.Random(seed)
    for _ in range(n):
        outcome = _pick(rng, OUTCOMES)
        attempts = _pick(rng, ATTEMPTS[outcome])
        created = start + _us(rng.uniform(0, hours * 3600))
        available = created + (_us(rng.uniform(0, 60)) if rng.random() < 0.2 else timedelta(0))
        claimed = available + _us(rng.expovariate(0.5)) if attempts else None
        if claimed is not None and outcome in (Outcome.ACKED.value, Outcome.DEAD.value):
            finished = claimed + _us(rng.lognormvariate(-1.6, 0.8))
        else:
            finished = available + _us(600 + rng.uniform(0, 60))
        last_error, error_type = "", None
        if outcome == Outcome.DEAD.value:
            if rng.random() < 0.1:
                last_error = error_type = "rejected"
            else:
                error_type = rng.choice(ERROR_TYPES)
                last_error = (
                    "Traceback (most recent call last):\n"
                    '  File "handlers.py", line 12, in handle\n'
                    "    raise failure\n"
                    f"{error_type}: failed on attempt {attempts}\n"
                )
        yield Row(
            queue=queue_prefix + rng.choice(QUEUES),
            kind=rng.choice(KINDS),
            outcome=outcome,
            attempts=attempts,
            created_at=created,
            first_available_at=available,
            claimed_at=claimed,
            finished_at=finished,
            last_error=last_error,
            error_type=error_type,
        )


def insert_archive(rows: Iterable[Row], *, using: str = "default", chunk_size: int = 5_000) -> int:
    """Insert ``rows`` into the archive, ``chunk_size`` per multi-row INSERT; returns how many."""
    connection = connections[using]
    qn = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    json_sql = json_param(using)
    placeholders = ", ".join(json_sql if c in ("payload", "headers") else "%s" for c in COLUMNS)
    per_statement = chunk_size
    if connection.features.max_query_params:
        per_statement = min(chunk_size, connection.features.max_query_params // len(COLUMNS))
    head = f"INSERT INTO {qn(ArchivedMessage._meta.db_table)} ({', '.join(qn(c) for c in COLUMNS)}) VALUES "
    empty = json.dumps({})
    written = 0
    batch: list[Any] = []

    def flush(cursor: CursorWrapper) -> None:
        nonlocal written, batch
        if batch:
            count = len(batch) // len(COLUMNS)
            cursor.execute(head + ", ".join([f"({placeholders})"] * count), batch)
            written += count
            batch = []

    # Autocommit: each multi-row INSERT commits, so millions of rows never sit in one transaction.
    with connection.cursor() as cursor:
        for row in rows:
            batch += [
                written + len(batch) // len(COLUMNS) + 1,
                row.queue,
                row.kind,
                empty,
                empty,
                0,
                adapt(row.created_at),
                adapt(row.first_available_at),
                adapt(row.claimed_at),
                adapt(row.finished_at),
                row.attempts,
                row.outcome,
                "synthetic",
                row.last_error,
                "",
            ]
            if len(batch) >= per_statement * len(COLUMNS):
                flush(cursor)
        flush(cursor)
    return written
