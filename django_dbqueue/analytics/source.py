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

import os
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from django.db.models import Count, Max, Min, Q

from ..exceptions import DbQueueError
from ..models import ArchivedMessage, Message
from .jdbc import JdbcTarget, jdbc_target

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

ARCHIVE_SCHEMA = (
    "id BIGINT, queue STRING, kind STRING, outcome STRING, attempts INT, created DOUBLE, "
    "first_available DOUBLE, claimed DOUBLE, finished DOUBLE, last_error STRING"
)
LIVE_SCHEMA = "id BIGINT, queue STRING, kind STRING, created DOUBLE"
# Rows a JDBC partition fetches per round trip.
FETCH_SIZE = 10_000


class MissingExport(DbQueueError):
    """A Parquet directory without the files ``manage.py exportarchive`` writes."""


@dataclass(frozen=True)
class Window:
    """Half-open: ``since <= t < until``, aware datetimes."""

    since: datetime
    until: datetime

    def __post_init__(self) -> None:
        if self.since.tzinfo is None or self.until.tzinfo is None:
            raise ValueError("window bounds must be aware datetimes")
        if self.since >= self.until:
            raise ValueError(f"the window is empty: since {self.since} is not before until {self.until}")


@dataclass(frozen=True)
class Frames:
    archive: DataFrame
    live: DataFrame
    rows: int | None  # archive plus live rows read, when the source knows it without a pass over them


class Source(Protocol):
    def read(self, spark: SparkSession, window: Window) -> Frames: ...


class JdbcSource:
    """Reads the Django database ``using`` with partitioned JDBC reads (``id`` ranges, one per task)."""

    def __init__(self, using: str = "default", partitions: int | None = None) -> None:
        self.using = using
        self.partitions = partitions

    def read(self, spark: SparkSession, window: Window) -> Frames:
        target = jdbc_target(self.using)
        partitions = self.partitions or spark.sparkContext.defaultParallelism
        in_window = Q(finished_at__gte=window.since, finished_at__lt=window.until) | Q(
            created_at__gte=window.since, created_at__lt=window.until
        )
        archive_bounds = (
            ArchivedMessage.objects.using(self.using)
            .filter(in_window)
            .aggregate(lo=Min("id"), hi=Max("id"), n=Count("id"))
        )
        live_bounds = (
            Message.objects.using(self.using)
            .filter(created_at__gte=window.since, created_at__lt=window.until)
            .aggregate(lo=Min("id"), hi=Max("id"), n=Count("id"))
        )
        archive_sql = self._archive_query(target, window)
        live_sql = self._live_query(target, window)
        return Frames(
            archive=self._load(spark, target, archive_sql, ARCHIVE_SCHEMA, archive_bounds, partitions),
            live=self._load(spark, target, live_sql, LIVE_SCHEMA, live_bounds, partitions),
            rows=archive_bounds["n"] + live_bounds["n"],
        )

    @staticmethod
    def _between(target: JdbcTarget, column: str, window: Window) -> str:
        col = target.quote(column)
        return f"({col} >= {target.timestamp(window.since)} AND {col} < {target.timestamp(window.until)})"

    def _archive_query(self, target: JdbcTarget, window: Window) -> str:
        q = target.quote
        return (
            f"(SELECT {q('id')}, {q('queue')}, {q('kind')}, {q('outcome')}, {q('attempts')}, "
            f"{target.epoch('created_at')} AS created, {target.epoch('first_available_at')} AS first_available, "
            f"{target.epoch('claimed_at')} AS claimed, {target.epoch('finished_at')} AS finished, "
            f"CASE WHEN {q('outcome')} = 'dead' THEN {q('last_error')} END AS last_error "
            f"FROM {q(ArchivedMessage._meta.db_table)} "
            f"WHERE {self._between(target, 'finished_at', window)} OR {self._between(target, 'created_at', window)}"
            ") archive_window"
        )

    def _live_query(self, target: JdbcTarget, window: Window) -> str:
        q = target.quote
        return (
            f"(SELECT {q('id')}, {q('queue')}, {q('kind')}, {target.epoch('created_at')} AS created "
            f"FROM {q(Message._meta.db_table)} WHERE {self._between(target, 'created_at', window)}) live_window"
        )

    @staticmethod
    def _load(spark: SparkSession, target: JdbcTarget, table: str, schema: str, bounds: dict, partitions: int):
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
    """Reads ``archive.parquet`` and ``live.parquet`` that ``manage.py exportarchive`` wrote into ``directory``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)

    def read(self, spark: SparkSession, window: Window) -> Frames:
        from pyspark.sql import functions as F

        paths = {name: os.path.join(self.directory, f"{name}.parquet") for name in ("archive", "live")}
        missing = [path for path in paths.values() if not os.path.exists(path)]
        if missing:
            raise MissingExport(
                f"{' and '.join(missing)} not found; write them with manage.py exportarchive --out {self.directory}"
            )
        since, until = window.since.timestamp(), window.until.timestamp()

        def seconds(column: str):
            return F.unix_micros(F.col(column)) / F.lit(1_000_000.0)

        def between(column: str):
            return (F.col(column) >= since) & (F.col(column) < until)

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
        live = (
            spark.read.parquet(paths["live"])
            .select(F.col("id").cast("bigint"), "queue", "kind", seconds("created_at").alias("created"))
            .filter(between("created"))
        )
        return Frames(archive=archive, live=live, rows=None)
