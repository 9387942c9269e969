"""The analytics benchmark: archived rows per second through the whole pipeline.

Fills the archive with synthetic rows in a window of its own (January 2001,
queues named ``analyticsbench.*``), runs :class:`AnalyticsJob` over that
window several times, reports the median, and removes its rows again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import Max, Min

from ..db.stats import refresh_statistics
from ..models import ArchivedMessage, QueueStat
from .job import AnalyticsJob
from .session import spark_session
from .synthetic import archive_rows, insert_archive

BENCH_START = datetime(2001, 1, 1, tzinfo=UTC)
BENCH_HOURS = 48
BENCH_PREFIX = "analyticsbench."


@dataclass(frozen=True)
class BenchResult:
    rows: int
    runs: list[float]  # seconds per run
    fill_seconds: float

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.runs)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.median_seconds


def run_bench(
    rows: int, *, repeat: int = 3, master: str = "local[*]", using: str = "default", partitions: int | None = None
) -> BenchResult:
    """Time ``repeat`` runs of the job over ``rows`` synthetic archived rows (Spark started beforehand)."""
    cleanup(using)
    started = time.perf_counter()
    insert_archive(
        archive_rows(rows, start=BENCH_START, hours=BENCH_HOURS, seed=rows, queue_prefix=BENCH_PREFIX), using=using
    )
    refresh_statistics(using, ArchivedMessage._meta.db_table, force=True)
    fill = time.perf_counter() - started
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
        cleanup(using)
    return BenchResult(rows=rows, runs=runs, fill_seconds=fill)


def cleanup(using: str, batch: int = 50_000) -> None:
    """Delete the benchmark's rows in primary-key ranges: one DELETE of millions of rows takes ages and locks."""
    archive = ArchivedMessage.objects.using(using).filter(queue__startswith=BENCH_PREFIX)
    bounds = archive.aggregate(lo=Min("id"), hi=Max("id"))
    if bounds["lo"] is not None:
        for start in range(bounds["lo"], bounds["hi"] + 1, batch):
            archive.filter(id__gte=start, id__lt=start + batch)._raw_delete(using)
    QueueStat.objects.using(using).filter(queue__startswith=BENCH_PREFIX).delete()
