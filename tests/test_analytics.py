"""queueanalytics on real Spark (local mode) against the real database of DATABASE_URL.

A generated archive of 50,000 rows with a known distribution is read through
Spark's JDBC source (MariaDB, PostgreSQL, or SQLite's text timestamps) and
from a Parquet export; the figures must equal a reference computed in plain
Python: counts exactly, percentiles within percentile_approx's stated rank
error.
"""

from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from django_dbqueue.contrib.spark.job import AnalyticsJob, hour_window
from django_dbqueue.contrib.spark.source import JdbcSource, Window
from django_dbqueue.contrib.spark.synthetic import archive_rows, insert_archive
from django_dbqueue.models import ArchivedMessage, Message, QueueStat
from tests.support.analytics_reference import reference, within_rank_error
from tests.support.factories import MessageFactory

pytestmark = [pytest.mark.spark, pytest.mark.django_db]

ROWS = 50_000
START = datetime(2026, 3, 1, 0, 0, tzinfo=UTC)
HOURS = 6
SINCE, UNTIL = START, START + timedelta(hours=HOURS)
ACCURACY = 10_000
LIVE = [("orders", "invoice", START + timedelta(minutes=5 + i)) for i in range(30)] + [
    ("emails", "", START + timedelta(hours=2, seconds=i)) for i in range(20)
]


@pytest.fixture(scope="module")
def archive(django_db_setup, django_db_blocker):
    """50,000 archived rows (and a live backlog), committed so that Spark's own connections see them."""
    with django_db_blocker.unblock():
        rows = list(archive_rows(ROWS, start=START, hours=HOURS, seed=6))
        assert insert_archive(rows) == ROWS
        for queue, kind, created in LIVE:
            MessageFactory(queue=queue, kind=kind, created_at=created)
        yield rows
        ArchivedMessage.objects.all()._raw_delete(connection.alias)
        Message.objects.all().delete()
        QueueStat.objects.all().delete()


def assert_matches_reference(rows, since=SINCE, until=UNTIL, live=LIVE):
    expected = reference(rows, live, since, until)
    stats = {(s.hour, s.queue, s.kind): s for s in QueueStat.objects.filter(hour__gte=since, hour__lt=until)}
    assert set(stats) == set(expected)
    for key, want in expected.items():
        got = stats[key]
        for name in ("enqueued", "acked", "dead", "expired", "retried", "attempts", "top_errors"):
            assert getattr(got, name) == want[name], (key, name)
        assert got.throughput == pytest.approx(want["throughput"])
        for prefix in ("wait", "processing"):
            for p in (50, 95, 99):
                value = getattr(got, f"{prefix}_p{p}")
                if not want[prefix]:
                    assert value is None
                    continue
                assert within_rank_error(value, want[prefix], p / 100, ACCURACY), (key, prefix, p, value)
    return expected


def test_figures_read_through_jdbc_equal_the_reference(archive, spark):
    result = AnalyticsJob(since=SINCE, until=UNTIL, accuracy=ACCURACY).run()
    expected = assert_matches_reference(archive)
    in_window = sum(1 for r in archive if SINCE <= r.finished_at < UNTIL or SINCE <= r.created_at < UNTIL)
    assert result.rows_read == in_window + len(LIVE)
    assert result.stats_written == len(expected) == QueueStat.objects.count()
    # The distribution is what was generated: most messages acked, some dead, each error type seen.
    totals = {name: sum(s[name] for s in expected.values()) for name in ("acked", "dead", "expired")}
    assert totals["acked"] > 5 * totals["dead"] > 0 and totals["expired"] > 0
    errors = {name for s in expected.values() for name, _ in s["top_errors"]}
    assert {"ValueError", "payments.CardDeclined", "rejected"} <= errors


def test_reads_are_partitioned_by_id_ranges(archive, spark):
    frames = JdbcSource(partitions=4).read(spark, Window(SINCE, UNTIL))
    assert frames.archive.rdd.getNumPartitions() == 4
    assert frames.archive.count() == frames.rows - len(LIVE)
    # Every partition got a share: the id ranges split the table, not one partition with all of it.
    sizes = frames.archive.rdd.glom().map(len).collect()
    assert min(sizes) > frames.rows / 8


def test_a_sub_window_counts_only_its_hours_and_rerunning_replaces_never_doubles(archive, spark):
    since, until = START + timedelta(hours=2), START + timedelta(hours=4)
    outside = QueueStat.objects.create(hour=START + timedelta(hours=5), queue="orders", acked=999)
    stale = QueueStat.objects.create(hour=since, queue="no-longer-there", acked=7)
    job = AnalyticsJob(since=since + timedelta(minutes=30), until=until - timedelta(minutes=1), accuracy=ACCURACY)
    assert hour_window(job.since, job.until) == Window(since, until)
    job.run()
    expected = assert_matches_reference(archive, since, until)
    job.run()
    assert_matches_reference(archive, since, until)
    assert QueueStat.objects.filter(hour__gte=since, hour__lt=until).count() == len(expected)
    assert not QueueStat.objects.filter(pk=stale.pk).exists()
    outside.refresh_from_db()
    assert outside.acked == 999


def test_parquet_export_gives_the_same_figures_and_parquet_output(archive, spark, tmp_path, capsys):
    import pyarrow.parquet as pq  # here: without the spark extra this module must still be collected

    call_command("exportarchive", f"--out={tmp_path / 'export'}", "--chunk-size=20000")
    assert f"{ROWS} archived rows" in capsys.readouterr().out
    assert pq.read_metadata(tmp_path / "export" / "archive.parquet").num_rows == ROWS
    assert "payload" not in pq.read_schema(tmp_path / "export" / "archive.parquet").names
    out = tmp_path / "stats"
    call_command(
        "queueanalytics",
        f"--since={SINCE.isoformat()}",
        f"--until={UNTIL.isoformat()}",
        f"--parquet-in={tmp_path / 'export'}",
        f"--parquet-out={out}",
        "--master=local[2]",
    )
    expected = assert_matches_reference(archive)
    written = pq.read_table(out).to_pylist()
    assert len(written) == len(expected)
    call_command(
        "queueanalytics", f"--since={SINCE.isoformat()}", f"--until={UNTIL.isoformat()}", f"--parquet-out={out}"
    )
    again = pq.read_table(out).to_pylist()
    assert len(again) == len(expected)
    by_key = {(r["queue"], r["kind"], r["hour_utc"]): r for r in again}
    for (hour, queue, kind), want in expected.items():
        row = by_key[(queue, kind, hour.strftime("%Y-%m-%dT%H"))]
        assert (row["acked"], row["dead"], row["enqueued"]) == (want["acked"], want["dead"], want["enqueued"])
        assert dict(row["attempts"]) == want["attempts"]


def test_a_parquet_directory_without_an_export_is_a_clear_error(spark, tmp_path):
    with pytest.raises(CommandError, match=r"live\.parquet not found; write them with manage\.py exportarchive"):
        call_command("queueanalytics", f"--parquet-in={tmp_path}", "--since=2026-01-01", "--until=2026-01-02")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since=yesterday"], "'yesterday' is not a date or datetime"),
        (["--master=locale[2]"], "'locale[2]' is not a Spark master"),
        (["--since=2026-01-02", "--until=2026-01-01"], "must be before --until"),
        (["--database=nope"], "--database 'nope' is not in DATABASES"),
        (["--partitions=0"], "invalid positive_int value"),
    ],
)
def test_bad_arguments_are_refused_naming_the_problem(args, message):
    with pytest.raises(CommandError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call_command("queueanalytics", *args)
    assert not QueueStat.objects.exists()
