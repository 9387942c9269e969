"""The figures: per queue, kind and hour, computed by Spark from the source's DataFrames.

Definitions (docs/analytics.md says the same for readers):

- an archived message counts in the hour its ``finished_at`` falls in, when
  its outcome is acked, dead or expired (cancelled messages are not counted);
- ``enqueued`` counts by ``created_at``: archived and live messages created in
  the hour (messages pruned from the archive are gone from it);
- ``retried``: finished after more than one attempt;
- ``wait``: last claim minus first availability; ``processing``: finished
  minus last claim; both over acked and dead messages that were claimed;
- percentiles are Spark's ``percentile_approx`` with ``accuracy``: the value
  returned has a rank within ``n / accuracy`` of the exact percentile's rank;
- the error type of a dead letter: the last line of ``last_error`` (a
  traceback's ends ``ValueError: ...``) up to its colon when it starts with a
  dotted name, else that line cut to ``ERROR_TYPE_LENGTH`` characters;
- ``throughput``: finished messages per second of the hour.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ...models import Outcome
from .source import Frames, Window, in_window

if TYPE_CHECKING:
    from pyspark.sql import Column

FINISHED = (Outcome.ACKED.value, Outcome.DEAD.value, Outcome.EXPIRED.value)
PERCENTILES = (0.5, 0.95, 0.99)
DEFAULT_ACCURACY = 10_000
DEFAULT_TOP_ERRORS = 5
ERROR_TYPE_LENGTH = 100
ERROR_NAME = r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(:|$)"
KEY = ("hour", "queue", "kind")


def _hour(column: str) -> Column:
    from pyspark.sql import functions as F

    return (F.floor(F.col(column) / 3600) * 3600).cast("long")


def error_type(column: str = "last_error") -> Column:
    """The error type of a dead letter's ``last_error`` (see the module's docstring)."""
    from pyspark.sql import functions as F

    stripped = F.regexp_replace(F.coalesce(F.col(column), F.lit("")), r"\s+$", "")
    last_line = F.trim(F.element_at(F.split(stripped, r"\r?\n"), -1))
    name = F.regexp_extract(last_line, ERROR_NAME, 1)
    return (
        F.when(name != "", name)
        .when(last_line != "", F.substring(last_line, 1, ERROR_TYPE_LENGTH))
        .otherwise(F.lit("(empty)"))
    )


def hourly_stats(
    frames: Frames,
    window: Window,
    *,
    accuracy: int = DEFAULT_ACCURACY,
    top_errors: int = DEFAULT_TOP_ERRORS,
) -> list[dict[str, Any]]:
    """One dict of ``QueueStat`` fields per (hour, queue, kind) with anything in the window.

    Spark does the counting and the percentiles; the few result rows are
    assembled here.
    """
    from pyspark.sql import functions as F

    outcome = F.col("outcome")
    finished = frames.archive.filter(outcome.isin(*FINISHED) & in_window("finished", window)).withColumn(
        "hour", _hour("finished")
    )
    timed = outcome.isin(Outcome.ACKED.value, Outcome.DEAD.value) & F.col("claimed").isNotNull()
    wait = F.when(timed, F.col("claimed") - F.col("first_available"))
    processing = F.when(timed, F.col("finished") - F.col("claimed"))
    percentiles = list(PERCENTILES)
    main = finished.groupBy(*KEY).agg(
        *[F.sum((outcome == name).cast("long")).alias(name) for name in FINISHED],
        F.sum((F.col("attempts") > 1).cast("long")).alias("retried"),
        F.count(F.lit(1)).alias("finished_count"),
        F.percentile_approx(wait, percentiles, accuracy).alias("wait"),
        F.percentile_approx(processing, percentiles, accuracy).alias("processing"),
    )
    # Attempts and error types in one pass: counts per (attempts, error type of dead letters).
    details = (
        finished.withColumn("error_type", F.when(outcome == Outcome.DEAD.value, error_type()))
        .groupBy(*KEY, "attempts", "error_type")
        .count()
    )
    created = frames.archive.select("queue", "kind", "created").unionByName(
        frames.live.select("queue", "kind", "created")
    )
    enqueued = created.filter(in_window("created", window)).withColumn("hour", _hour("created")).groupBy(*KEY).count()

    stats: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(_empty)
    for row in main.collect():
        stat = stats[(row["hour"], row["queue"], row["kind"])]
        for name in (*FINISHED, "retried"):
            stat[name] = row[name]
        stat["throughput"] = row["finished_count"] / 3600.0
        for prefix in ("wait", "processing"):
            values = row[prefix] or [None] * len(PERCENTILES)
            for p, value in zip(PERCENTILES, values, strict=True):
                stat[f"{prefix}_p{round(p * 100)}"] = value
    by_key: dict[tuple[Any, ...], Counter[str]] = defaultdict(Counter)
    for row in details.collect():
        key = (row["hour"], row["queue"], row["kind"])
        attempts = stats[key]["attempts"]
        attempts[str(row["attempts"])] = attempts.get(str(row["attempts"]), 0) + row["count"]
        if row["error_type"] is not None:
            by_key[key][row["error_type"]] += row["count"]
    for key, counts in by_key.items():
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top_errors]
        stats[key]["top_errors"] = [[name, count] for name, count in ranked]
    for row in enqueued.collect():
        stats[(row["hour"], row["queue"], row["kind"])]["enqueued"] = row["count"]

    result = []
    for (hour, queue, kind), stat in sorted(stats.items()):
        stat["attempts"] = dict(sorted(stat["attempts"].items(), key=lambda item: int(item[0])))
        result.append({"hour": datetime.fromtimestamp(hour, UTC), "queue": queue, "kind": kind, **stat})
    return result


def _empty() -> dict[str, Any]:
    return {
        "enqueued": 0,
        "acked": 0,
        "dead": 0,
        "expired": 0,
        "retried": 0,
        **{f"{prefix}_p{round(p * 100)}": None for prefix in ("wait", "processing") for p in PERCENTILES},
        "attempts": {},
        "top_errors": [],
        "throughput": 0.0,
    }
