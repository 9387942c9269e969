"""The analytics benchmark: archived rows per second through the whole pipeline.

Fills the archive with synthetic rows in a window of its own (January 2001,
queues named ``analyticsbench.*``), runs `AnalyticsJob` over that
window several times, reports the median, and removes its rows again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import Max, Min

from ...db.stats import refresh_statistics
from ...models import ArchivedMessage, QueueStat
from .incremental import last_archived, run_incremental, save_watermark
from .job import AnalyticsJob
from .models import Watermark
from .session import spark_session
from .synthetic import archive_rows, insert_archive

BENCH_START = datetime(2001, 1, 1, tzinfo=UTC)
BENCH_HOURS = 48
BENCH_PREFIX = "analyticsbench."
BENCH_WATERMARK = "analyticsbench"


class BenchmarkRefused(Exception):
    """The benchmark would touch rows that are not its own."""


@dataclass(frozen=True)
class BenchResult:
    rows: int
    runs: list[float]  # seconds per run
    fill_seconds: float | None  # None: the rows of an earlier --bench-keep run were reused

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.runs)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.median_seconds


def fill(rows: int, using: str) -> float | None:
    """Fill the archive with the benchmark's ``rows`` rows; returns the seconds it took, or None when the
    rows of an earlier ``keep`` run are there already (as many: the same seed gives the same rows)."""
    if ArchivedMessage.objects.using(using).filter(queue__startswith=BENCH_PREFIX).count() == rows:
        return None
    cleanup(using)
    started = time.perf_counter()
    insert_archive(
        archive_rows(rows, start=BENCH_START, hours=BENCH_HOURS, seed=rows, queue_prefix=BENCH_PREFIX), using=using
    )
    refresh_statistics(using, ArchivedMessage._meta.db_table, force=True)
    return time.perf_counter() - started


def run_bench(
    rows: int,
    *,
    repeat: int = 3,
    master: str = "local[*]",
    using: str = "default",
    partitions: int | None = None,
    keep: bool = False,
) -> BenchResult:
    """Time ``repeat`` runs of the job over ``rows`` synthetic archived rows (Spark started beforehand).

    With ``keep``, the rows stay for the next benchmark, which reuses them instead of filling again.
    """
    filled = fill(rows, using)
    spark_session(master)
    job = AnalyticsJob(
        since=BENCH_START,
        # Expired messages finish up to 11 minutes after they were created.
        until=BENCH_START + timedelta(hours=BENCH_HOURS + 1),
        using=using,
        master=master,
        partitions=partitions,
    )
    try:
        runs = []
        for _ in range(repeat):
            result = job.run()
            if result.rows_read != rows:
                raise AssertionError(f"the job read {result.rows_read} rows of the {rows} written")
            runs.append(result.seconds)
    finally:
        if not keep:
            cleanup(using)
    return BenchResult(rows=rows, runs=runs, fill_seconds=filled)


def cleanup(using: str, batch: int = 50_000) -> None:
    """Delete the benchmark's rows in primary-key ranges: one DELETE of millions of rows takes ages and locks."""
    archive = ArchivedMessage.objects.using(using).filter(queue__startswith=BENCH_PREFIX)
    bounds = archive.aggregate(lo=Min("id"), hi=Max("id"))
    if bounds["lo"] is not None:
        for start in range(bounds["lo"], bounds["hi"] + 1, batch):
            archive.filter(id__gte=start, id__lt=start + batch)._raw_delete(using)
    QueueStat.objects.using(using).filter(queue__startswith=BENCH_PREFIX).delete()


@dataclass(frozen=True)
class IncrementalBenchResult:
    rows: int  # the archive's size
    new_rows: int  # rows added before each incremental run
    runs: list[float]  # seconds per incremental run
    rows_read: list[int]  # rows each run read (the hours the new rows touched)
    hours: list[int]  # hours each run recomputed
    fill_seconds: float | None

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.runs)


def run_incremental_bench(
    rows: int,
    new_rows: int,
    *,
    repeat: int = 3,
    master: str = "local[*]",
    using: str = "default",
    partitions: int | None = None,
    keep: bool = False,
) -> IncrementalBenchResult:
    """Time ``repeat`` incremental runs, each after ``new_rows`` rows were added to an archive of ``rows``.

    Before each run the watermark (its own, ``analyticsbench``) is set to the
    archive's last row; the new rows finish in the hour after the benchmark's
    window, and are deleted again after the run. It needs an archive with no
    rows but its own: an incremental run reads every row past the watermark.
    """
    others = ArchivedMessage.objects.using(using).exclude(queue__startswith=BENCH_PREFIX)
    if others.exists():
        raise BenchmarkRefused(
            f"the archive of database {using!r} holds rows other than the benchmark's; "
            "run the incremental benchmark on a database of its own"
        )
    filled = fill(rows, using)
    spark_session(master)
    job = AnalyticsJob(since=BENCH_START, until=BENCH_START, using=using, master=master, partitions=partitions)
    runs, read, hours = [], [], []
    try:
        for i in range(repeat):
            mark = last_archived(using)
            top = ArchivedMessage.objects.using(using).aggregate(top=Max("id"))["top"]
            assert mark is not None and top is not None
            save_watermark(BENCH_WATERMARK, using, mark, mark.finished_at, 0)
            start = BENCH_START + timedelta(hours=BENCH_HOURS + 2)
            insert_archive(
                archive_rows(new_rows, start=start, hours=1, seed=rows + i, queue_prefix=BENCH_PREFIX), using=using
            )
            result = run_incremental(job, name=BENCH_WATERMARK)
            runs.append(result.seconds)
            read.append(result.job.rows_read if result.job else 0)
            hours.append(result.hours)
            ArchivedMessage.objects.using(using).filter(id__gt=top)._raw_delete(using)
    finally:
        Watermark.objects.using(using).filter(name=BENCH_WATERMARK).delete()
        if not keep:
            cleanup(using)
    return IncrementalBenchResult(rows, new_rows, runs, read, hours, filled)
