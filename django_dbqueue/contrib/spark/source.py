"""Where the analytics read from: the database through Spark's JDBC source, or Parquet files.

Both sources give the same two DataFrames, times as seconds since the epoch
(floats), already limited to the window:

- ``archive``: id, queue, kind, outcome, attempts, created, first_available,
  claimed, finished, last_error (dead letters only, NULL otherwise): archived
  messages that finished or were created in the window;
- ``live``: id, queue, kind, created: live messages created in the window
  (the backlog, counted as enqueued).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import reduce
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Protocol

from django.db.models import Count, Max, Min, Q

from ...exceptions import DbQueueError
from ...models import ArchivedMessage, Message
from ...models.partitions import ArchiveLayout
from .jdbc import JdbcTarget, jdbc_target

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

ARCHIVE_SCHEMA = (
    "id BIGINT, queue STRING, kind STRING, outcome STRING, attempts INT, created DOUBLE, "
    "first_available DOUBLE, claimed DOUBLE, finished DOUBLE, last_error STRING"
)
LIVE_SCHEMA = "id BIGINT, queue STRING, kind STRING, created DOUBLE"
# Rows a JDBC partition fetches per round trip.
FETCH_SIZE = 10_000
# A message finishes after it was created; this much clock difference between the hosts that
# wrote the two times is tolerated when a read of "created in the window" is bounded by
# finished_at (which the archive's index serves; created_at has no index).
CLOCK_SKEW = timedelta(minutes=1)
HOUR = timedelta(hours=1)


class MissingExport(DbQueueError):
    """A Parquet directory without the files ``manage.py exportarchive`` writes."""


@dataclass(frozen=True)
class Window:
    """Half-open: ``since <= t < until``, aware datetimes.

    With ``hours`` (starts of whole hours inside it), only those hours: an
    incremental run recomputes the hours new rows touched, which need not be
    one stretch.
    """

    since: datetime
    until: datetime
    hours: frozenset[datetime] | None = None

    def __post_init__(self) -> None:
        if self.since.tzinfo is None or self.until.tzinfo is None:
            raise ValueError("window bounds must be aware datetimes")
        if self.since >= self.until:
            raise ValueError(f"the window is empty: since {self.since} is not before until {self.until}")
        if self.hours is not None and not all(self.since <= hour < self.until for hour in self.hours):
            raise ValueError("the window's hours must lie inside it")

    def ranges(self) -> list[tuple[datetime, datetime]]:
        """The window as half-open ranges: one, or each stretch of consecutive ``hours``."""
        if self.hours is None:
            return [(self.since, self.until)]
        ranges: list[tuple[datetime, datetime]] = []
        for hour in sorted(self.hours):
            if ranges and ranges[-1][1] == hour:
                ranges[-1] = (ranges[-1][0], hour + HOUR)
            else:
                ranges.append((hour, hour + HOUR))
        return ranges

    def q(self, column: str) -> Q:
        """The ORM condition ``column`` in the window."""
        conditions = [Q(**{f"{column}__gte": since, f"{column}__lt": until}) for since, until in self.ranges()]
        return reduce(operator.or_, conditions)


def in_window(column: str, window: Window) -> Column:
    """``column`` (seconds since the epoch) in one of the window's ranges."""
    from pyspark.sql import functions as F

    condition = F.lit(False)
    for since, until in window.ranges():
        condition = condition | ((F.col(column) >= since.timestamp()) & (F.col(column) < until.timestamp()))
    return condition


def aligned_slices(
    uppers: list[datetime | None], floor: datetime, until: datetime, tasks: int
) -> list[tuple[datetime, datetime | None]]:
    """Half-open ``finished_at`` ranges from ``floor`` on, each inside one partition, for a partitioned read.

    ``uppers`` are the partitions' upper bounds (None: the catch-all). The ranges
    join up with nothing between them, so together they read every row from
    ``floor`` on wherever it lies (a PostgreSQL default partition too). A
    partition the window's finish times (before ``until``) fall in is cut into
    equal stretches of time when there are fewer such partitions than
    ``tasks``, so that Spark still has a task per core.
    """
    edges = [floor, *sorted({upper for upper in uppers if upper is not None and upper > floor})]
    slices = list(zip(edges, [*edges[1:], None], strict=True))
    busy = sum(1 for lower, _ in slices if lower < until)
    pieces = max(1, -(-tasks // busy))
    aligned: list[tuple[datetime, datetime | None]] = []
    for lower, upper in slices:
        end = until if upper is None or upper > until else upper
        if pieces == 1 or lower >= end:
            aligned.append((lower, upper))
            continue
        step = (end - lower) / pieces
        points = [lower + step * i for i in range(pieces)] + [end]
        aligned.extend(pairwise(points))
        if upper is None or upper > end:
            aligned.append((end, upper))
    return aligned


def slice_predicates(target: JdbcTarget, slices: list[tuple[datetime, datetime | None]]) -> list[str]:
    """A WHERE condition on ``finished_at`` per slice: Spark runs a task for each."""
    col = target.quote("finished_at")
    return [
        f"{col} >= {target.timestamp(lower)}" + (f" AND {col} < {target.timestamp(upper)}" if upper else "")
        for lower, upper in slices
    ]


@dataclass(frozen=True)
class Frames:
    archive: DataFrame
    live: DataFrame
    rows: int | None  # archive plus live rows read, when the source knows it without a pass over them


class Source(Protocol):
    def read(self, spark: SparkSession, window: Window) -> Frames: ...


class JdbcSource:
    """Reads the Django database ``using`` with partitioned JDBC reads.

    A task per ``id`` range; on a partitioned archive, a task per partition of ``finished_at`` (or stretch of one).
    """

    def __init__(self, using: str = "default", partitions: int | None = None) -> None:
        self.using = using
        self.partitions = partitions

    def read(self, spark: SparkSession, window: Window) -> Frames:
        target = jdbc_target(self.using)
        partitions = self.partitions or spark.sparkContext.defaultParallelism
        # finished_at >= since (less the clock skew) holds for every row of the window, and lets the
        # database read the finished_at index from there instead of the whole archive.
        touched = Q(finished_at__gte=window.since - CLOCK_SKEW) & (window.q("finished_at") | window.q("created_at"))
        archive_bounds = (
            ArchivedMessage.objects.using(self.using)
            .filter(touched)
            .aggregate(lo=Min("id"), hi=Max("id"), n=Count("id"))
        )
        live_bounds = (
            Message.objects.using(self.using)
            .filter(window.q("created_at"))
            .aggregate(lo=Min("id"), hi=Max("id"), n=Count("id"))
        )
        uppers = [partition.upper for partition in ArchiveLayout(self.using).partitions()]
        archive_sql = self.archive_query(target, window, with_finished_at=bool(uppers))
        live_sql = self._live_query(target, window)
        if uppers and archive_bounds["n"]:
            # A partitioned archive: a task per partition (or stretch of one), its rows pruned to it.
            slices = aligned_slices(uppers, window.since - CLOCK_SKEW, window.until, partitions)
            archive = self._load_slices(spark, target, archive_sql, slices)
        else:
            archive = self._load(spark, target, archive_sql, ARCHIVE_SCHEMA, archive_bounds, partitions)
        return Frames(
            archive=archive,
            live=self._load(spark, target, live_sql, LIVE_SCHEMA, live_bounds, partitions),
            rows=archive_bounds["n"] + live_bounds["n"],
        )

    @staticmethod
    def _between(target: JdbcTarget, column: str, window: Window) -> str:
        col = target.quote(column)
        return (
            "("
            + " OR ".join(
                f"({col} >= {target.timestamp(since)} AND {col} < {target.timestamp(until)})"
                for since, until in window.ranges()
            )
            + ")"
        )

    def archive_query(self, target: JdbcTarget, window: Window, with_finished_at: bool = False) -> str:
        """The archive rows of ``window`` as a derived table; ``with_finished_at`` for `slice_predicates`."""
        q = target.quote
        # A partitioned read's predicates name finished_at itself, so that the database prunes to a partition.
        raw = f", {q('finished_at')}" if with_finished_at else ""
        return (
            f"(SELECT {q('id')}, {q('queue')}, {q('kind')}, {q('outcome')}, {q('attempts')}, "
            f"{target.epoch('created_at')} AS created, {target.epoch('first_available_at')} AS first_available, "
            f"{target.epoch('claimed_at')} AS claimed, {target.epoch('finished_at')} AS finished, "
            f"CASE WHEN {q('outcome')} = 'dead' THEN {q('last_error')} END AS last_error{raw} "
            f"FROM {q(ArchivedMessage._meta.db_table)} "
            f"WHERE {q('finished_at')} >= {target.timestamp(window.since - CLOCK_SKEW)} "
            f"AND ({self._between(target, 'finished_at', window)} OR {self._between(target, 'created_at', window)})"
            ") archive_window"
        )

    def _live_query(self, target: JdbcTarget, window: Window) -> str:
        q = target.quote
        return (
            f"(SELECT {q('id')}, {q('queue')}, {q('kind')}, {target.epoch('created_at')} AS created "
            f"FROM {q(Message._meta.db_table)} WHERE {self._between(target, 'created_at', window)}) live_window"
        )

    @staticmethod
    def _load_slices(
        spark: SparkSession, target: JdbcTarget, table: str, slices: list[tuple[datetime, datetime | None]]
    ) -> DataFrame:
        reader = spark.read.options(customSchema=ARCHIVE_SCHEMA, fetchsize=str(FETCH_SIZE))
        predicates = slice_predicates(target, slices)
        return reader.jdbc(target.url, table, predicates=predicates, properties=target.properties).drop("finished_at")

    @staticmethod
    def _load(
        spark: SparkSession, target: JdbcTarget, table: str, schema: str, bounds: dict[str, Any], partitions: int
    ) -> DataFrame:
        if bounds["n"] == 0:
            return spark.createDataFrame([], schema)
        reader = spark.read.format("jdbc").options(
            url=target.url, dbtable=table, customSchema=schema, fetchsize=str(FETCH_SIZE), **target.properties
        )
        if bounds["hi"] > bounds["lo"] and partitions > 1:
            reader = reader.options(
                partitionColumn="id",
                lowerBound=str(bounds["lo"]),
                upperBound=str(bounds["hi"] + 1),
                numPartitions=str(partitions),
            )
        return reader.load()


class ParquetSource:
    """Reads ``archive.parquet`` and ``live.parquet`` that ``manage.py exportarchive`` wrote into ``directory``,
    or the day partitions ``exportarchive --incremental`` appends there (the archive alone: no backlog)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)

    def read(self, spark: SparkSession, window: Window) -> Frames:
        from pyspark.sql import functions as F

        paths = {name: os.path.join(self.directory, f"{name}.parquet") for name in ("archive", "live")}
        missing = [path for path in paths.values() if not os.path.exists(path)]
        lake = missing and _is_lake(self.directory)
        if lake:
            # exportarchive --incremental: the archive partitioned by day; no live table.
            paths = {"archive": self.directory}
        elif missing:
            raise MissingExport(
                f"{' and '.join(missing)} not found; write them with manage.py exportarchive --out {self.directory}"
            )

        def seconds(column: str) -> Column:
            return F.unix_micros(F.col(column)) / F.lit(1_000_000.0)

        def between(column: str) -> Column:
            return in_window(column, window)

        archive = spark.read.parquet(paths["archive"]).select(
            F.col("id").cast("bigint"),
            "queue",
            "kind",
            "outcome",
            F.col("attempts").cast("int"),
            seconds("created_at").alias("created"),
            seconds("first_available_at").alias("first_available"),
            seconds("claimed_at").alias("claimed"),
            seconds("finished_at").alias("finished"),
            F.when(F.col("outcome") == "dead", F.col("last_error")).alias("last_error"),
        )
        archive = archive.filter(between("finished") | between("created"))
        if lake:
            return Frames(archive=archive, live=spark.createDataFrame([], LIVE_SCHEMA), rows=None)
        live = (
            spark.read.parquet(paths["live"])
            .select(F.col("id").cast("bigint"), "queue", "kind", seconds("created_at").alias("created"))
            .filter(between("created"))
        )
        return Frames(archive=archive, live=live, rows=None)


def _is_lake(directory: str) -> bool:
    """A directory ``exportarchive --incremental`` wrote: ``finished_date=...`` partitions."""
    return os.path.isdir(directory) and any(entry.startswith("finished_date=") for entry in os.listdir(directory))
