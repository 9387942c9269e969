"""queueanalytics on real Spark reading a partitioned archive (docs/archive.md): a task per partition.

The archive, partitioned by day, holds rows created over six hours across a
midnight; Spark's JDBC tasks each read inside one partition (the database
prunes to it, EXPLAIN shows) and together give the figures of the plain
Python reference, as on a plain archive (test_analytics.py).
"""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from django_dbqueue.contrib.spark.jdbc import jdbc_target
from django_dbqueue.contrib.spark.job import AnalyticsJob
from django_dbqueue.contrib.spark.source import CLOCK_SKEW, JdbcSource, Window, aligned_slices, slice_predicates
from django_dbqueue.contrib.spark.synthetic import archive_rows, insert_archive
from django_dbqueue.models import ArchivedMessage, QueueStat
from django_dbqueue.models.partitions import ArchiveLayout
from tests.support.plans import partition_plan
from tests.test_analytics import assert_matches_reference
from tests.test_analytics_slices import partition_of

pytestmark = [
    pytest.mark.spark,
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has no table partitions"),
]

ROWS = 20_000
# Two days back, so that the window is past whenever the test runs, and its partitions few
# (from its day to the days the layout keeps created ahead of now).
MIDNIGHT = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=2)
SINCE, UNTIL = MIDNIGHT - timedelta(hours=3), MIDNIGHT + timedelta(hours=3)
ACCURACY = 10_000


@pytest.fixture(scope="module")
def archive(django_db_setup, django_db_blocker):
    """Rows across a midnight in an archive partitioned by day, committed for Spark's connections; plain after."""
    with django_db_blocker.unblock():
        rows = list(archive_rows(ROWS, start=SINCE, hours=6, seed=34))
        assert insert_archive(rows) == ROWS
        layout = ArchiveLayout()
        layout.convert("daily")
        try:
            yield rows
        finally:
            layout.convert(None)
            ArchivedMessage.objects.all()._raw_delete(connection.alias)
            QueueStat.objects.all().delete()


def partition_index(finished: float, uppers: list[datetime | None]) -> int:
    """The partition a row's ``finished`` (seconds since the epoch, as Spark reads it) lies in."""
    return partition_of(datetime.fromtimestamp(finished, UTC), uppers)


def test_each_task_reads_inside_one_partition_and_the_figures_equal_the_reference(archive, spark):
    uppers = [partition.upper for partition in ArchiveLayout().partitions()]
    window = Window(SINCE, UNTIL)
    slices = aligned_slices(uppers, SINCE - CLOCK_SKEW, UNTIL, 4)
    frames = JdbcSource(partitions=4).read(spark, window)
    assert frames.archive.rdd.getNumPartitions() == len(slices)
    assert frames.archive.count() == frames.rows
    assert "finished_at" not in frames.archive.columns  # the pruning column is not among the figures' inputs
    # Each task's rows lie in one partition; the window's rows are spread over both days' tasks.
    spans = frames.archive.rdd.glom().map(lambda rows: [row.finished for row in rows]).collect()
    touched = set()
    for finished in spans:
        where = {partition_index(moment, uppers) for moment in finished}
        assert len(where) <= 1, where
        touched |= where
    assert len(touched) >= 2
    busy = [len(finished) for finished, (lower, _) in zip(spans, slices, strict=True) if lower < UNTIL]
    assert len(busy) >= 4 and min(busy) > 0

    AnalyticsJob(since=SINCE, until=UNTIL, accuracy=ACCURACY, partitions=4).run()
    assert_matches_reference(archive, SINCE, UNTIL, live=[])


def test_a_task_s_query_reads_only_its_partition(archive):
    """Spark sends ``SELECT ... FROM (the window's query) archive_window WHERE <predicate>``: one partition is read."""
    target = jdbc_target("default")
    partitions = ArchiveLayout().partitions()
    uppers = [partition.upper for partition in partitions]
    window = Window(SINCE, UNTIL)
    table = JdbcSource().archive_query(target, window, with_finished_at=True)
    slices = aligned_slices(uppers, SINCE - CLOCK_SKEW, UNTIL, 4)
    names = [partition.name for partition in partitions]
    for (lower, _), predicate in zip(slices, slice_predicates(target, slices), strict=True):
        plan = partition_plan(f"SELECT * FROM {table} WHERE {predicate}")
        scanned = [name for name in names if name in plan]
        assert scanned == [names[partition_of(lower, uppers)]], (predicate, plan)
