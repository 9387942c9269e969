"""The partitioned archive (docs/archive.md): its layout, its boundaries, its upkeep and its conversion.

The server tests convert the test database's real archive and convert it
back to the plain layout afterwards (the rollback is under test too).
"""

import os
import signal
import threading
from datetime import UTC, datetime, timedelta
from io import StringIO
from zoneinfo import ZoneInfo

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction

import django_dbqueue
from django_dbqueue.conf import find_problems
from django_dbqueue.db import partitions as ddl
from django_dbqueue.db.partitions import PartitioningUnsupported
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.models.partitions import AHEAD, OLD_TABLE, ArchiveLayout, ranges
from django_dbqueue.reaper import Reaper
from tests.support.factories import ArchivedMessageFactory
from tests.support.processes import start_command, wait_for

servers = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite has no table partitions; its archive stays one table"
)


def partition_of(pk):
    """The name of the partition that holds archive row ``pk``."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT tableoid::regclass::text FROM dbqueue_archive WHERE id = %s", [pk])
            return cursor.fetchone()[0]
        for partition in ArchiveLayout().partitions():
            cursor.execute(f"SELECT 1 FROM dbqueue_archive PARTITION ({partition.name}) WHERE id = %s", [pk])
            if cursor.fetchone():
                return partition.name
    return None


def label_of(name):
    return name.rsplit("_", 1)[-1] if connection.vendor == "postgresql" else name


@pytest.fixture
def layout(transactional_db):
    """An ArchiveLayout on the test database, whose archive is plain again after the test."""
    yield ArchiveLayout()
    layout = ArchiveLayout()
    if layout.converting():
        layout.convert(None)
    if layout.partitioned():
        layout.convert(None)
    assert not layout.partitioned() and not layout.converting()


def test_the_setting_takes_daily_weekly_or_none_and_names_a_bad_value():
    assert find_problems({"ARCHIVE_PARTITIONS": "daily"}) == []
    assert find_problems({"ARCHIVE_PARTITIONS": "weekly"}) == []
    assert find_problems({"ARCHIVE_PARTITIONS": None}) == []
    assert find_problems({"ARCHIVE_PARTITIONS": "monthly"}) == [
        "DBQUEUE['ARCHIVE_PARTITIONS'] must be one of 'daily', 'weekly' or None, not 'monthly'"
    ]


def test_days_start_at_midnight_in_the_configured_time_zone():
    paris = ZoneInfo("Europe/Paris")
    found = ranges("daily", paris, datetime(2026, 3, 28, 12, tzinfo=UTC), datetime(2026, 3, 30, 1, tzinfo=UTC))
    assert [r.label for r in found] == ["20260328", "20260329", "20260330"]
    # Midnight in Paris: 23:00 UTC in winter, 22:00 UTC after the clocks went forward on the 29th (a 23-hour day).
    assert [r.upper for r in found] == [
        datetime(2026, 3, 28, 23, tzinfo=UTC),
        datetime(2026, 3, 29, 22, tzinfo=UTC),
        datetime(2026, 3, 30, 22, tzinfo=UTC),
    ]
    utc = ranges(
        "daily", ZoneInfo("UTC"), datetime(2026, 11, 26, 23, 59, tzinfo=UTC), datetime(2026, 11, 27, tzinfo=UTC)
    )
    assert [(r.label, r.upper) for r in utc] == [
        ("20261126", datetime(2026, 11, 27, tzinfo=UTC)),
        ("20261127", datetime(2026, 11, 28, tzinfo=UTC)),
    ]


def test_weeks_start_on_monday():
    found = ranges("weekly", ZoneInfo("UTC"), datetime(2026, 11, 26, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC))
    assert [(r.label, r.upper) for r in found] == [
        ("20261123", datetime(2026, 11, 30, tzinfo=UTC)),
        ("20261130", datetime(2026, 12, 7, tzinfo=UTC)),
    ]


@pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite refusal")
def test_sqlite_refuses_a_conversion_naming_the_database(transactional_db):
    with pytest.raises(PartitioningUnsupported, match="'default' is SQLite, which has no table partitions"):
        ArchiveLayout().convert("daily")


@servers
def test_an_empty_archive_converts_and_acks_land_in_todays_partition(layout):
    assert layout.convert("daily") == 0
    assert layout.partitioned() and not layout.converting()
    found = layout.partitions()
    assert found[-1].upper is None  # the catch-all
    today = datetime.now(UTC).strftime("%Y%m%d")
    assert label_of(found[0].name) == f"p{today}"
    assert len(found) == 1 + 1 + AHEAD["daily"]  # today, a week ahead, one more to reach past it, and the catch-all
    for n in range(3):
        django_dbqueue.enqueue("partitions", {"n": n})
    one, *two = Message.objects.claim("partitions", 3)
    assert one.ack() is True  # one by one
    assert Message.objects.ack_many(two) == [True, True]  # the completer's INSERT ... SELECT
    rows = ArchivedMessage.objects.filter(queue="partitions")
    assert sorted(rows.values_list("outcome", flat=True)) == [Outcome.ACKED] * 3
    assert {label_of(partition_of(row.pk)) for row in rows} == {f"p{today}"}


@servers
def test_rows_convert_behind_in_chunks_with_their_ids_and_back_again(layout):
    now = datetime.now(UTC)
    old = [ArchivedMessageFactory(finished_at=now - timedelta(days=n % 3, minutes=1)) for n in range(25)]
    ids = sorted(row.pk for row in old)
    chunks = []
    assert layout.convert("daily", chunk_size=7, on_chunk=chunks.append) == 25
    assert sum(chunks) == 25 and len(chunks) >= 4
    assert sorted(ArchivedMessage.objects.values_list("pk", flat=True)) == ids
    # Rows of two days ago are in their own day's partition, created for them.
    two_days = min(old, key=lambda row: row.finished_at)
    assert label_of(partition_of(two_days.pk)) == f"p{two_days.finished_at:%Y%m%d}"
    fresh = ArchivedMessageFactory(finished_at=now)
    assert fresh.pk > ids[-1]
    assert layout.convert(None, chunk_size=10) == 26
    assert not layout.partitioned()
    assert sorted(ArchivedMessage.objects.values_list("pk", flat=True)) == [*ids, fresh.pk]
    assert ArchivedMessageFactory(finished_at=now).pk > fresh.pk


@servers
def test_a_conversion_resumes_where_it_stopped(layout):
    now = datetime.now(UTC)
    ids = [ArchivedMessageFactory(finished_at=now - timedelta(hours=n)).pk for n in range(20)]
    # A conversion killed after its swap and one chunk: the old table still holds every row.
    layout._start("daily")
    assert layout.converting()
    names = ddl.columns("default", OLD_TABLE)
    low = min(ids)
    ddl.copy_ids("default", OLD_TABLE, "dbqueue_archive", names, low - 1, low + 4)
    assert ArchivedMessage.objects.count() == 5
    plan = layout.plan("daily")
    assert plan.resuming and plan.rows_to_copy == 15
    assert "15 old row(s) left to copy behind" in str(plan)
    assert layout.convert("daily", chunk_size=4) == 15
    assert sorted(ArchivedMessage.objects.values_list("pk", flat=True)) == sorted(ids)
    assert not layout.converting()


@servers
def test_a_row_at_the_exact_boundary_goes_to_the_next_day(layout):
    layout.convert("daily")
    first, second = layout.partitions()[:2]
    before = ArchivedMessageFactory(finished_at=first.upper - timedelta(microseconds=1))
    at = ArchivedMessageFactory(finished_at=first.upper)
    assert partition_of(before.pk) == first.name
    assert partition_of(at.pk) == second.name


@servers
def test_days_follow_the_configured_time_zone(layout, settings):
    settings.TIME_ZONE = "America/New_York"
    layout = ArchiveLayout()
    layout.convert("daily")
    first, second = layout.partitions()[:2]
    # A New York midnight is 04:00 or 05:00 UTC, never 00:00.
    assert first.upper.astimezone(ZoneInfo("America/New_York")).hour == 0
    assert first.upper.hour in (4, 5)
    late = ArchivedMessageFactory(finished_at=first.upper - timedelta(seconds=1))
    assert partition_of(late.pk) == first.name
    assert partition_of(ArchivedMessageFactory(finished_at=first.upper).pk) == second.name


@servers
def test_a_week_without_upkeep_loses_no_row_and_the_next_pass_repairs_the_layout(layout):
    layout.convert("daily")
    last = [p for p in layout.partitions() if p.upper is not None][-1]
    # The reaper was down: rows finish past the last partition created ahead.
    late = [ArchivedMessageFactory(finished_at=last.upper + timedelta(days=n, hours=1)) for n in range(3)]
    catch_all = layout.partitions()[-1]
    assert all(partition_of(row.pk) == catch_all.name for row in late)
    created = layout.ensure_ahead("daily", now=late[-1].finished_at)
    assert [f"{row.finished_at:%Y%m%d}" for row in late] == created[:3]
    for row in late:
        assert label_of(partition_of(row.pk)) == f"p{row.finished_at:%Y%m%d}"
    assert ArchivedMessage.objects.count() == 3
    assert layout.ensure_ahead("daily", now=late[-1].finished_at) == []


@servers
def test_a_row_older_than_the_lowest_partition_stays_and_creation_ahead_goes_on(layout):
    now = datetime.now(UTC)
    for n in range(5):
        ArchivedMessageFactory(finished_at=now - timedelta(days=n))
    layout.convert("daily")
    layout.drop_before(now - timedelta(days=2))
    lowest = next(p for p in layout.partitions() if p.upper is not None)
    # A row finished before the lowest range (a clock set back), then a week without upkeep.
    old = ArchivedMessageFactory(finished_at=now - timedelta(days=10))
    last = [p for p in layout.partitions() if p.upper is not None][-1]
    late = ArchivedMessageFactory(finished_at=last.upper + timedelta(days=1, hours=1))
    before = ArchivedMessage.objects.count()
    created = layout.ensure_ahead("daily", now=late.finished_at)
    assert f"{late.finished_at:%Y%m%d}" in created
    assert label_of(partition_of(late.pk)) == f"p{late.finished_at:%Y%m%d}"
    expected = layout.partitions()[-1].name if connection.vendor == "postgresql" else lowest.name
    assert partition_of(old.pk) == expected  # no range takes it on PostgreSQL: the default partition keeps it
    assert ArchivedMessage.objects.count() == before


@servers
def test_retention_drops_whole_partitions(layout):
    now = datetime.now(UTC)
    rows = [ArchivedMessageFactory(finished_at=now - timedelta(days=n)) for n in range(5)]
    layout.convert("daily")
    cutoff = now - timedelta(days=2)
    gone = layout.drop_before(cutoff)
    assert gone and all(p.upper <= cutoff for p in gone)
    assert ddl.detached("default", "dbqueue_archive") == []  # their tables freed too
    kept = set(ArchivedMessage.objects.values_list("pk", flat=True))
    assert kept == {row.pk for row in rows if row.finished_at >= gone[-1].upper}
    assert {rows[0].pk, rows[1].pk} <= kept


@servers
def test_the_reaper_creates_missing_partitions_and_drops_those_past_every_retention(layout, settings):
    now = datetime.now(UTC)
    old = [ArchivedMessageFactory(finished_at=now - timedelta(days=n)) for n in (0, 1, 5, 6)]
    layout.convert("daily")
    # The partitions ahead are gone, as if the reaper had not run for a week: tomorrow's rows go to the catch-all.
    ahead = [p for p in layout.partitions() if p.upper is not None and p.upper > now + timedelta(days=1)]
    ddl.drop_partitions("default", "dbqueue_archive", [p.name for p in ahead])
    tomorrow = ArchivedMessageFactory(finished_at=now + timedelta(days=1, minutes=1))
    assert partition_of(tomorrow.pk) == layout.partitions()[-1].name
    settings.DBQUEUE = {
        **settings.DBQUEUE,
        "ARCHIVE_PARTITIONS": "daily",
        "RETENTION_DAYS": 3,
        "QUEUES": {"short": {"RETENTION_DAYS": 1}},
    }
    report = Reaper().run_once()
    assert report.partitions_created == len(ahead)
    assert report.partitions_dropped >= 2  # the days of 5 and 6 days ago, and any emptier ones before them
    assert label_of(partition_of(tomorrow.pk)) == f"p{tomorrow.finished_at:%Y%m%d}"
    kept = set(ArchivedMessage.objects.values_list("pk", flat=True))
    assert kept == {old[0].pk, old[1].pk, tomorrow.pk}
    assert "archive partition(s) created" in str(report)
    # A queue that keeps its rows for ever keeps every partition.
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": {"forever": {"RETENTION_DAYS": None}}}
    ArchivedMessageFactory(queue="forever", finished_at=now - timedelta(days=30))
    assert Reaper().run_once().partitions_dropped == 0


@servers
def test_the_reaper_says_once_that_the_setting_asks_for_partitions_the_archive_lacks(layout, settings, caplog):
    settings.DBQUEUE = {**settings.DBQUEUE, "ARCHIVE_PARTITIONS": "weekly"}
    reaper = Reaper()
    with caplog.at_level("WARNING", logger="django_dbqueue"):
        reaper.run_once()
        reaper.run_once()
    told = [r.getMessage() for r in caplog.records if "one plain table" in r.getMessage()]
    assert told == [
        "reaper: ARCHIVE_PARTITIONS is 'weekly' but the archive on 'default' is one plain table; "
        "convert it with manage.py partitionarchive (docs/archive.md)"
    ]


def test_partitionarchive_without_the_setting_says_what_to_set(transactional_db):
    with pytest.raises(CommandError, match="ARCHIVE_PARTITIONS is None: set it to 'daily' or 'weekly'"):
        call_command("partitionarchive")


@pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite refusal")
def test_partitionarchive_on_sqlite_names_the_database(transactional_db, settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "ARCHIVE_PARTITIONS": "daily"}
    with pytest.raises(CommandError, match="'default' is SQLite, which has no table partitions"):
        call_command("partitionarchive", "--dry-run")


@servers
def test_partitionarchive_dry_run_prints_the_plan_and_changes_nothing(layout, settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "ARCHIVE_PARTITIONS": "weekly"}
    ArchivedMessageFactory.create_batch(3)
    out = StringIO()
    call_command("partitionarchive", "--dry-run", stdout=out)
    assert "the archive is plain" in out.getvalue()
    assert "1. create dbqueue_archive_partitioned empty, partitioned weekly" in out.getvalue()
    assert "3. copy the 3 old row(s) behind" in out.getvalue()
    assert not layout.partitioned() and not layout.converting()
    call_command("partitionarchive", stdout=out)
    assert "done: 3 old row(s) copied; the archive is partitioned" in out.getvalue()
    out = StringIO()
    call_command("partitionarchive", stdout=out)
    assert "already; nothing to convert" in out.getvalue()
    call_command("partitionarchive", "--rollback", stdout=out)
    assert out.getvalue().endswith("done: 3 old row(s) copied; the archive is one plain table\n")
    assert ArchivedMessage.objects.count() == 3


@servers
@pytest.mark.slow
def test_a_conversion_killed_halfway_resumes_with_nothing_lost_or_doubled(layout):
    """SIGKILL of the real command while it copies, enqueues and acks going on; a second run finishes the copy."""
    now = datetime.now(UTC)
    ArchivedMessage.objects.bulk_create(
        ArchivedMessageFactory.build(finished_at=now - timedelta(days=n % 4, seconds=n)) for n in range(3000)
    )
    ids = set(ArchivedMessage.objects.values_list("pk", flat=True))
    settings = '{"ARCHIVE_PARTITIONS": "daily"}'
    command = start_command("partitionarchive", "--chunk-size", 5, DBQUEUE_TEST_SETTINGS=settings)
    copied = wait_for(
        lambda: layout.converting() and (n := ArchivedMessage.objects.count()) >= 300 and n,
        timeout=120,
        what="the conversion to copy a tenth of the rows",
    )
    os.kill(command.pid, signal.SIGKILL)
    command.wait(timeout=30)
    assert copied < 3000 and layout.converting()
    # The queue keeps running meanwhile: acks land in the partitioned archive.
    django_dbqueue.enqueue("partitions", {"during": True})
    [message] = Message.objects.claim("partitions")
    assert message.ack() is True
    fresh = ArchivedMessage.objects.get(message_id=message.pk, queue="partitions")  # factory rows have ids too
    finish = start_command("partitionarchive", "--chunk-size", 50, DBQUEUE_TEST_SETTINGS=settings)
    out, err = finish.communicate(timeout=300)
    assert finish.returncode == 0, err
    assert "a conversion is under way" in out
    assert not layout.converting() and layout.partitioned()
    found = list(ArchivedMessage.objects.values_list("pk", flat=True))
    assert len(found) == len(set(found)) == 3001
    assert set(found) == ids | {fresh.pk}


@servers
def test_the_reaper_vacuums_a_partitioned_archive_whose_partitions_hold_dead_rows(layout):
    """PostgreSQL keeps a partitioned table's statistics in its partitions: the reaper's VACUUM reads them there."""
    if connection.vendor != "postgresql" or connection.pg_version < 150000:
        pytest.skip("VACUUM is PostgreSQL's; the test reads statistics flushed on demand, from PostgreSQL 15 on")
    from django_dbqueue.db.stats import vacuum_if_bloated

    layout.convert("daily")
    ArchivedMessage.objects.bulk_create(ArchivedMessageFactory.build() for _ in range(300))
    ArchivedMessage.objects.all().delete()

    def dead_rows():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT SUM(n_dead_tup) FROM pg_stat_user_tables WHERE relid IN "
                "(SELECT relid FROM pg_partition_tree('dbqueue_archive'))"
            )
            return cursor.fetchone()[0]

    assert dead_rows() >= 300
    assert not vacuum_if_bloated("default", "dbqueue_archive")  # 300 dead rows are not worth a VACUUM
    assert vacuum_if_bloated("default", "dbqueue_archive", min_dead=100)
    assert dead_rows() == 0


@servers
def test_upkeep_behind_a_long_transaction_gives_up_in_time_and_acks_go_on(layout, settings, caplog):
    """A DDL waiting for its lock holds up every later write to the table: the upkeep's wait is bounded.

    Another connection keeps a transaction open after reading the archive
    (an analytics read, an open shell). Without the bound the upkeep would
    wait for it for ever, and an ack queued behind the upkeep's lock would
    wait too: the ack is made in a thread, and must finish while the reader
    is still open.
    """
    now = datetime.now(UTC)
    old = ArchivedMessageFactory(finished_at=now - timedelta(days=5))
    layout.convert("daily")
    partition_name = partition_of(old.pk)
    ahead = [p for p in layout.partitions() if p.upper is not None and p.upper > now + timedelta(days=1)]
    ddl.drop_partitions("default", "dbqueue_archive", [p.name for p in ahead])
    settings.DBQUEUE = {**settings.DBQUEUE, "ARCHIVE_PARTITIONS": "daily", "RETENTION_DAYS": 2}
    reading, release, failures = threading.Event(), threading.Event(), []

    def long_reader():
        try:
            with transaction.atomic():
                assert ArchivedMessage.objects.filter(pk=old.pk).exists()
                reading.set()
                assert release.wait(60)
        except Exception as exc:  # reported by the test, not lost with the thread
            failures.append(exc)
        finally:
            reading.set()
            connections.close_all()

    reader = threading.Thread(target=long_reader)
    reader.start()
    try:
        assert reading.wait(30) and not failures
        reaper = Reaper()
        with caplog.at_level("WARNING", logger="django_dbqueue"):
            report = reaper.run_once()
            waited = [r.getMessage() for r in caplog.records if "tried again in 30 s" in r.getMessage()]
            # The same reaper backs off: its next pass does not hold acks up behind the reader again.
            assert reaper.run_once().partitions_dropped == 0
            assert len([r for r in caplog.records if "tried again" in r.getMessage()]) == 2
        assert (report.partitions_created, report.partitions_dropped) == (0, 0)
        assert len(waited) == 2 and "creating partitions ahead" in waited[0] and "retiring" in waited[1]
        assert "held its lock for more than 1 s" in waited[1]
        assert partition_name in [p.name for p in layout.partitions()]  # (its row went by the row pruning)

        acked = []

        def ack():
            try:
                acked.append(ArchivedMessageFactory(finished_at=datetime.now(UTC)).pk)
            finally:
                connections.close_all()

        acker = threading.Thread(target=ack)
        acker.start()
        acker.join(30)
        assert acked, "an ack waited behind the upkeep although the reader is still open"
    finally:
        release.set()
        reader.join(60)
    assert not failures
    report = Reaper().run_once()
    assert report.partitions_created == len(ahead) and report.partitions_dropped >= 1
    assert partition_name not in [p.name for p in layout.partitions()]


@servers
def test_retired_partitions_leave_the_archive_at_once_and_their_tables_go_one_a_pass(layout, settings):
    """A pass takes expired partitions out of the archive (a catalog change) and frees one detached table.

    Freeing a table's files costs in proportion to its size, and a server
    does it with the dropped table's locks held: on detached tables it
    holds up no ack, and one a pass spreads a large retention over passes.
    A reaper killed after detaching leaves the same state: later passes
    finish it.
    """
    if not ddl.retires_to_tables("default"):
        pytest.skip("MySQL drops partitions in place: no retired table is left")
    now = datetime.now(UTC)
    old = [ArchivedMessageFactory(finished_at=now - timedelta(days=n)) for n in (5, 6, 7)]
    kept = ArchivedMessageFactory(finished_at=now)
    layout.convert("daily")
    settings.DBQUEUE = {**settings.DBQUEUE, "ARCHIVE_PARTITIONS": "daily", "RETENTION_DAYS": 2}
    expired = [p.name for p in layout.droppable(now - timedelta(days=2))]
    assert len(expired) >= 3 and {partition_of(row.pk) for row in old} <= set(expired)

    report = Reaper().run_once()
    assert (report.partitions_dropped, report.partitions_freed) == (len(expired), 1)
    assert "1 retired partition table(s) freed" in str(report)
    assert not set(expired) & {p.name for p in layout.partitions()}
    assert not ArchivedMessage.objects.filter(pk__in=[row.pk for row in old]).exists()
    left = ddl.detached("default", "dbqueue_archive")
    assert len(left) == len(expired) - 1  # the oldest freed by this pass
    for remaining in range(len(left) - 1, -1, -1):
        report = Reaper().run_once()
        assert (report.partitions_dropped, report.partitions_freed) == (0, 1)
        assert len(ddl.detached("default", "dbqueue_archive")) == remaining
    assert Reaper().run_once().partitions_freed == 0
    assert ArchivedMessage.objects.filter(pk=kept.pk).exists()


@servers
def test_a_conversion_frees_retired_partitions_first(layout, settings):
    """On PostgreSQL a retired table would stand in the way of a partition of the same day, created anew."""
    if not ddl.retires_to_tables("default"):
        pytest.skip("MySQL drops partitions in place: no retired table is left")
    now = datetime.now(UTC)
    ArchivedMessageFactory(finished_at=now - timedelta(days=5))
    layout.convert("daily")
    retired = layout.retire_before(now - timedelta(days=2))
    assert retired and ddl.detached("default", "dbqueue_archive")
    layout.convert(None)
    layout.convert("daily", since=now - timedelta(days=6))
    assert ddl.detached("default", "dbqueue_archive") == []
    assert {p.name for p in retired} <= {p.name for p in layout.partitions()}
