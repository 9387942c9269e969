"""``AnalyticsJob``: read, compute, write. ``manage.py queueanalytics`` is a thin parser over it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ...progress import NullProgress, Progress
from .metrics import DEFAULT_ACCURACY, DEFAULT_TOP_ERRORS, hourly_stats
from .progress import watch_stages
from .session import require, spark_session
from .sink import write_parquet, write_table
from .source import JdbcSource, ParquetSource, Source, Window


def floor_hour(value: datetime) -> datetime:
    return value.replace(minute=0, second=0, microsecond=0)


def hour_window(since: datetime, until: datetime) -> Window:
    """The whole hours covering ``[since, until)``: figures are per hour, so a window is too."""
    end = floor_hour(until)
    return Window(floor_hour(since), end if end == until else end + timedelta(hours=1))


@dataclass(frozen=True)
class JobResult:
    window: Window
    rows_read: int
    stats_written: int
    seconds: float

    @property
    def rows_per_second(self) -> float:
        return self.rows_read / self.seconds if self.seconds else 0.0


@dataclass
class AnalyticsJob:
    """Compute the hourly figures of ``[since, until)`` (widened to whole hours) and store them.

    Reads the database ``using`` through JDBC, or ``parquet_in`` (a directory
    written by ``exportarchive``); writes ``QueueStat`` rows to ``using`` and,
    with ``parquet_out``, Parquet files. ``progress`` shows Spark's stages as they run.
    """

    since: datetime
    until: datetime
    using: str = "default"
    master: str = "local[*]"
    parquet_in: str | os.PathLike[str] | None = None
    parquet_out: str | os.PathLike[str] | None = None
    partitions: int | None = None
    accuracy: int = DEFAULT_ACCURACY
    top_errors: int = DEFAULT_TOP_ERRORS
    progress: Progress = field(default_factory=NullProgress)
    # Only these hours of the window (an incremental run's), not all of it.
    hours: frozenset[datetime] | None = None

    def source(self) -> Source:
        return ParquetSource(self.parquet_in) if self.parquet_in else JdbcSource(self.using, self.partitions)

    def run(self) -> JobResult:
        window = hour_window(self.since, self.until)
        if self.hours is not None:
            window = Window(window.since, window.until, self.hours)
        require("pyspark")
        from pyspark import StorageLevel

        started = time.perf_counter()
        spark = spark_session(self.master)
        with watch_stages(spark.sparkContext, self.progress):
            frames = self.source().read(spark, window)
            # Several aggregations read the archive: read it from the database once.
            frames.archive.persist(StorageLevel.MEMORY_AND_DISK)
            try:
                rows = frames.rows if frames.rows is not None else frames.archive.count() + frames.live.count()
                stats = hourly_stats(frames, window, accuracy=self.accuracy, top_errors=self.top_errors)
            finally:
                frames.archive.unpersist()
            written = write_table(stats, window, self.using)
            if self.parquet_out:
                write_parquet(spark, stats, self.parquet_out)
        return JobResult(window, rows, written, time.perf_counter() - started)
