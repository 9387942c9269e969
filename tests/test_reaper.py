import threading
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.models import Q
from django.utils import timezone

import django_dbqueue
from django_dbqueue.db.transactions import try_lock
from django_dbqueue.models import ArchivedMessage, Message, Outcome, Worker
from django_dbqueue.progress import progress_for
from django_dbqueue.reaper import Reaper, lock_name
from tests.support.factories import ArchivedMessageFactory, WorkerFactory
from tests.support.terminal import SteppedClock, Terminal

pytestmark = pytest.mark.django_db(transaction=True)


def test_stale_worker_messages_come_back_at_once():
    dead = WorkerFactory(stale=True)
    alive = WorkerFactory()
    django_dbqueue.enqueue_many("q", [{"n": n} for n in range(3)])
    held = Message.objects.claim("q", 2, visibility_timeout=600, worker=dead.name)
    kept = Message.objects.claim("q", 1, visibility_timeout=600, worker=alive.name)
    report = Reaper().run_once()
    assert (report.stale_workers, report.released) == (1, 2)
    ready = Message.objects.ready()
    assert set(ready.values_list("pk", flat=True)) == {m.pk for m in held}
    assert all(m.attempts == 1 and m.claimed_by == "" for m in ready)  # the attempt still counts
    assert Message.objects.in_flight().get().pk == kept[0].pk
    assert list(Worker.objects.values_list("name", flat=True)) == [alive.name]
    assert not held[0].ack()  # the dead worker's lease is gone


def test_stale_worker_on_its_last_attempt_is_dead_lettered():
    dead = WorkerFactory(stale=True)
    message = django_dbqueue.enqueue("q", {}, max_attempts=1)
    Message.objects.claim("q", visibility_timeout=600, worker=dead.name)
    report = Reaper().run_once()
    assert report.poison == 1 and report.released == 0
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.DEAD and f"worker {dead.name} stopped answering" in row.last_error


def test_expired_lease_on_last_attempt_is_dead_lettered_and_never_claimed():
    poison = django_dbqueue.enqueue("q", {}, max_attempts=1)
    other = django_dbqueue.enqueue("q", {}, max_attempts=2)
    Message.objects.claim("q", 2, visibility_timeout=0.2)
    time.sleep(0.4)
    # Both leases ran out; only the one with attempts left may be claimed again.
    assert [m.pk for m in Message.objects.claim("q", 5, visibility_timeout=600)] == [other.pk]
    assert Reaper().run_once().poison == 1
    row = ArchivedMessage.objects.get(message_id=poison.pk)
    assert row.outcome == Outcome.DEAD and "lease expired on attempt 1" in row.last_error
    assert Message.objects.get().pk == other.pk  # in flight, with a live lease: untouched


def test_expired_messages_are_archived_unless_held():
    past = timezone.now() - timedelta(seconds=1)
    gone = django_dbqueue.enqueue("q", {"n": 1}, expires_at=past)
    held = django_dbqueue.enqueue("q", {"n": 2}, expires_at=timezone.now() + timedelta(seconds=2))
    Message.objects.claim("q", visibility_timeout=600)
    fresh = django_dbqueue.enqueue("q", {"n": 3}, expires_at=timezone.now() + timedelta(hours=1))
    time.sleep(2.1)
    assert Reaper(batch_size=1).run_once().expired == 1
    assert ArchivedMessage.objects.get().message_id == gone.pk
    assert ArchivedMessage.objects.get().outcome == Outcome.EXPIRED
    assert set(Message.objects.values_list("pk", flat=True)) == {held.pk, fresh.pk}


def test_prune_respects_each_queue_retention_in_batches(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "RETENTION_DAYS": 30, "QUEUES": {"keep": {"RETENTION_DAYS": None}}}
    old = timezone.now() - timedelta(days=40)
    ArchivedMessageFactory.create_batch(5, queue="q", finished_at=old)
    ArchivedMessageFactory.create_batch(2, queue="keep", finished_at=old)
    recent = ArchivedMessageFactory(queue="q")
    assert Reaper(batch_size=2).run_once().pruned == 5
    assert set(ArchivedMessage.objects.values_list("queue", flat=True)) == {"keep", "q"}
    assert ArchivedMessage.objects.filter(queue="q").get().pk == recent.pk


def test_pruning_tells_each_batch_to_its_listener():
    old = timezone.now() - timedelta(days=40)
    ArchivedMessageFactory.create_batch(5, queue="q", finished_at=old)
    ArchivedMessageFactory(queue="q")
    batches = []
    pruned = ArchivedMessage.objects.prune(Q(), timezone.now() - timedelta(days=30), 2, on_batch=batches.append)
    assert (pruned, batches) == (5, [2, 2, 1])


def test_pruning_reports_its_progress_against_the_count_to_go(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "RETENTION_DAYS": 30}
    ArchivedMessageFactory.create_batch(5, queue="q", finished_at=timezone.now() - timedelta(days=40))
    out = Terminal()
    # Each reading of the clock is a second later: every batch is drawn.
    progress = progress_for(out, tty=True, clock=SteppedClock(auto=1), width=200)
    assert Reaper(batch_size=2, progress=progress).run_once().pruned == 5
    shown = out.getvalue().split("\r")
    assert [line.rstrip() for line in shown if "rows (" in line] == [
        "pruning the archive: [....................] 0/5 rows (0%)",
        "pruning the archive: [########............] 2/5 rows (40%), 2 rows/s, 2s left",
        "pruning the archive: [################....] 4/5 rows (80%), 2 rows/s, 1s left",
        "pruning the archive: [####################] 5/5 rows (100%), 1.7 rows/s",
    ]
    assert out.lines() == [""]  # cleared at the end: the pass's report follows


def test_reapqueue_shows_pruning_progress_on_a_terminal_and_nothing_with_v0(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "RETENTION_DAYS": 30, "REAP_BATCH_SIZE": 2}
    ArchivedMessageFactory.create_batch(5, queue="q", finished_at=timezone.now() - timedelta(days=40))
    out = Terminal()
    call_command("reapqueue", stdout=out)
    assert "pruning the archive: [....................] 0/5 rows (0%)" in out.getvalue()
    assert out.lines()[-2].endswith("5 archive row(s) pruned")
    ArchivedMessageFactory.create_batch(5, queue="q", finished_at=timezone.now() - timedelta(days=40))
    quiet = Terminal()
    call_command("reapqueue", "-v0", stdout=quiet)
    assert "pruning" not in quiet.getvalue()
    assert quiet.getvalue().endswith("5 archive row(s) pruned\n")
    assert ArchivedMessage.objects.count() == 0


def test_only_one_reaper_acts_at_a_time():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer at a time; there every reaper takes the lock")
    holding, done = threading.Event(), threading.Event()

    def other_reaper():
        with try_lock("default", lock_name("default")) as held:
            assert held
            holding.set()
            done.wait(30)
        connections.close_all()

    thread = threading.Thread(target=other_reaper)
    thread.start()
    try:
        assert holding.wait(30)
        assert Reaper().run_once() is None
    finally:
        done.set()
        thread.join()
    assert Reaper().run_once() is not None  # released with the other's session


def test_reapqueue_prints_what_it_did(capsys):
    WorkerFactory(stale=True)
    call_command("reapqueue")
    assert "1 stale worker(s) removed, 0 message(s) released" in capsys.readouterr().out


def _loop_after_a_failed_pass(monkeypatch, failure):
    """Run Reaper.loop over one stale worker, the first pass raising ``failure``; stop after the first report."""
    WorkerFactory(stale=True)
    real_run_once = Reaper.run_once
    passes = []

    def run_once(self):
        passes.append(len(passes))
        if len(passes) == 1:
            raise failure
        return real_run_once(self)

    monkeypatch.setattr(Reaper, "run_once", run_once)
    stop, reports = threading.Event(), []

    def on_report(report):
        reports.append(report)
        stop.set()

    thread = threading.Thread(target=Reaper().loop, args=(stop, 0.05, on_report))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return reports


def test_the_loop_survives_a_failed_pass_and_stops_when_told(monkeypatch, caplog):
    from django.db import OperationalError

    reports = _loop_after_a_failed_pass(monkeypatch, OperationalError("the server went away"))
    assert "reaper: a pass failed (the server went away)" in caplog.text
    assert [r.stale_workers for r in reports] == [1]  # the next pass did the work, then the loop stopped
    assert not Worker.objects.exists()


def test_the_loop_survives_any_failed_pass_and_logs_its_traceback(monkeypatch, caplog):
    """Only database trouble used to be survived: any other error ended the loop, and with it --reap's worker."""
    reports = _loop_after_a_failed_pass(monkeypatch, ZeroDivisionError("a bug in one pass"))
    assert "reaper: a pass failed; trying again in 0.05s" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text and "ZeroDivisionError: a bug in one pass" in caplog.text
    assert [r.stale_workers for r in reports] == [1]
    assert not Worker.objects.exists()


def test_reapqueue_loop_reports_passes_until_interrupted():
    import select
    import signal

    from django_dbqueue.reaper import ReapReport
    from tests.support.processes import start_command, wait_for

    WorkerFactory(stale=True)
    reaper = start_command("reapqueue", "--loop", "--interval", "0.1", PYTHONUNBUFFERED="1")

    def printed_line():
        ready, _, _ = select.select([reaper.stdout], [], [], 0)
        return reaper.stdout.readline() if ready else None

    try:
        first = wait_for(printed_line, what="the looping reaper to report a pass")
    finally:
        reaper.send_signal(signal.SIGINT)
        rest, err = reaper.communicate(timeout=60)
    assert reaper.returncode == 0, err
    assert first.startswith("1 stale worker(s) removed")
    assert not Worker.objects.exists()
    assert str(ReapReport()) not in rest.splitlines()  # passes that did nothing print nothing


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "1e12"])
def test_reapqueue_interval_is_bounded(value):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="invalid positive_float value"):
        call_command("reapqueue", "--loop", "--interval", value)


def pg_dead_rows(table: str) -> tuple[int, object]:
    """(n_dead_tup, last_vacuum) of ``table``, once this session's statistics reached the server (PostgreSQL 15+)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT n_dead_tup, last_vacuum FROM pg_stat_user_tables WHERE relname = %s", [table])
        return cursor.fetchone()


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="VACUUM is PostgreSQL's; InnoDB purges by itself")
def test_dead_rows_that_pile_up_are_vacuumed_outside_transactions_only():
    from django.db import transaction

    from django_dbqueue.db.stats import vacuum_if_bloated

    if connection.pg_version < 150000:
        pytest.skip("the test reads statistics flushed on demand, from PostgreSQL 15 on")
    table = Message._meta.db_table
    django_dbqueue.enqueue_many("q", [{}] * 300)
    Message.objects.all().delete()
    dead, _ = pg_dead_rows(table)
    assert dead >= 300
    assert not vacuum_if_bloated("default", table)  # 300 dead rows are not worth a VACUUM
    with transaction.atomic():
        assert not vacuum_if_bloated("default", table, min_dead=100)  # VACUUM cannot run in a transaction
    assert vacuum_if_bloated("default", table, min_dead=100)
    dead, vacuumed_at = pg_dead_rows(table)
    assert dead == 0 and vacuumed_at is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="REINDEX giving B-tree pages back: PostgreSQL only")
def test_indexes_left_large_by_a_drained_backlog_are_rebuilt_unless_a_writer_holds_the_table():
    import psycopg

    from django_dbqueue.db.stats import shrink_indexes, vacuum_if_bloated

    table = Message._meta.db_table

    def index_bytes() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_indexes_size(%s::regclass)", [table])
            return cursor.fetchone()[0]

    if connection.pg_version < 150000:
        pytest.skip("the test reads statistics flushed on demand, from PostgreSQL 15 on")
    django_dbqueue.enqueue_many("q", [{}] * 20_000)
    Message.objects.all().delete()
    pg_dead_rows(table)  # the delete's statistics, flushed
    assert vacuum_if_bloated("default", table, min_dead=1)  # as the reaper's pass before: the table is empty now
    bloated = index_bytes()
    assert bloated > 1_000_000
    assert not shrink_indexes("default", table)  # under the default 8 MB: not worth blocking writers
    # A producer's open transaction holds the table: the rebuild waits for its lock 200 ms, then gives up.
    with psycopg.connect(**connection.get_connection_params()) as writer:
        writer.execute(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE")
        started = time.monotonic()
        assert not shrink_indexes("default", table, min_bytes=100_000, lock_timeout_ms=200)
        assert time.monotonic() - started < 30
        writer.rollback()
    assert index_bytes() == bloated
    assert shrink_indexes("default", table, min_bytes=100_000)
    assert index_bytes() < bloated / 5
    django_dbqueue.enqueue("q", {})  # the rebuilt indexes serve as before
    assert Message.objects.claim("q")
