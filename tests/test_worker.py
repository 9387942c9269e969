"""The worker, in this process and as real ``runqueueworker`` processes."""

import logging
import re
import signal
import sys
import time

import pytest
from django.core.management import call_command
from django.db import connection

import django_dbqueue
from django_dbqueue import handlers
from django_dbqueue.models import ArchivedMessage, Message, Outcome, Worker
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from tests.support.processes import ROOT, read_marks, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def run(queues, **options) -> ExitStatus:
    return QueueWorker(WorkerConfig(queues=queues, until_empty=True, **options)).run()


def test_handlers_are_discovered_from_queues_modules():
    names = {queue for queue, _ in handlers.registered()}
    assert {"w-ok", "w-outcomes", "w-slow", "w-poison"} <= names


def test_each_handler_outcome_is_recorded(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "BACKOFF_BASE": 60}
    ids = {
        action: django_dbqueue.enqueue("w-outcomes", {"action": action}).pk
        for action in ("ok", "raise", "reject", "retry", "defer")
    }
    assert run(["w-outcomes"], concurrency=2, batch_size=3) == ExitStatus.OK
    archived = {row.message_id: row for row in ArchivedMessage.objects.all()}
    assert archived[ids["ok"]].outcome == Outcome.ACKED and archived[ids["ok"]].result == "fine"
    assert archived[ids["reject"]].outcome == Outcome.DEAD and archived[ids["reject"]].last_error == "not for us"
    live = {m.pk: m for m in Message.objects.all()}
    assert set(live) == {ids["raise"], ids["retry"], ids["defer"]}
    assert "ValueError: asked to fail" in live[ids["raise"]].last_error
    assert live[ids["raise"]].attempts == 1 and live[ids["raise"]].lease_token is None
    assert live[ids["retry"]].last_error == "try later"
    assert live[ids["defer"]].attempts == 0  # a deferral is not a failed attempt
    assert set(Message.objects.scheduled().values_list("pk", flat=True)) == set(live)
    assert Worker.objects.count() == 0  # removed on a clean exit


def test_invalid_handler_request_fails_the_message_and_the_worker_carries_on():
    bad = django_dbqueue.enqueue("w-outcomes", {"action": "bad-defer"}, max_attempts=1)
    good = django_dbqueue.enqueue("w-outcomes", {"action": "ok"})
    assert run(["w-outcomes"]) == ExitStatus.OK
    assert "until must be timezone-aware" in ArchivedMessage.objects.get(message_id=bad.pk).last_error
    assert ArchivedMessage.objects.get(message_id=good.pk).outcome == Outcome.ACKED


def test_until_empty_ignores_what_no_claim_would_take():
    from datetime import timedelta

    from django.utils import timezone

    django_dbqueue.enqueue("w-ok", {}, expires_at=timezone.now() + timedelta(seconds=0.3))
    time.sleep(0.5)  # expired, not yet reaped: ready by time, but no claim takes it
    started = time.monotonic()
    assert run(["w-ok"]) == ExitStatus.OK
    assert time.monotonic() - started < 30 and Message.objects.count() == 1


def test_the_worker_leaves_no_connection_open_after_its_summary():
    """The summary counts what is left waiting before the worker closes its connections, not after."""
    from django.db import connections

    django_dbqueue.enqueue("w-ok", {}, delay=3600)  # left waiting: the summary reads the table
    assert run(["w-ok"]) == ExitStatus.OK
    assert [alias for alias in connections if connections[alias].connection is not None] == []


def test_message_without_handler_is_dead_lettered_with_a_reason():
    message = django_dbqueue.enqueue("w-nobody", {}, kind="mystery")
    assert run(["w-nobody"]) == ExitStatus.OK
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.DEAD
    assert row.last_error == "no handler for queue 'w-nobody', kind 'mystery'"


def test_until_empty_and_max_messages(tmp_path):
    django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(7)])
    worker = QueueWorker(WorkerConfig(queues=["w-ok"], max_messages=3, batch_size=2))
    assert worker.run() == ExitStatus.OK
    assert ArchivedMessage.objects.count() == 3 and Message.objects.count() == 4
    assert Message.objects.in_flight().count() == 0  # nothing claimed beyond the limit stays held
    assert run(["w-ok"], batch_size=5) == ExitStatus.OK
    assert ArchivedMessage.objects.acked().count() == 7


def test_until_empty_waits_for_a_claim_another_thread_has_not_handed_over(monkeypatch):
    """--until-empty used to stop with messages left (19 of 500 once, in a MariaDB run of 4 threads).

    Thread 1 found nothing to claim (thread 0's claim had them), saw
    nothing held (thread 0 had not handed its claim to the ledger yet) and
    nothing claimable (the rows were leased): it stopped the worker, which
    released thread 0's batch unstarted. Forced here: thread 0 holds its
    committed claim until thread 1 has decided.
    """
    import threading

    from django_dbqueue.models import MessageQuerySet
    from django_dbqueue.worker.consumer import Consumer

    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(5)])
    real_claim, real_nothing_left = MessageQuerySet.claim, Consumer.nothing_left
    committed, decided = threading.Event(), threading.Event()

    def claim(self, *args, **kwargs):
        thread = threading.current_thread().name
        if thread == "dbqueue-consumer-1":
            committed.wait(30)  # claim only once thread 0 has leased every message
        claimed = real_claim(self, *args, **kwargs)
        if thread == "dbqueue-consumer-0" and not committed.is_set():
            committed.set()
            decided.wait(30)  # committed, not handed over, until thread 1 has decided
        return claimed

    def nothing_left(self):
        try:
            return real_nothing_left(self)
        finally:
            if self.slot == 1 and committed.is_set():
                decided.set()

    monkeypatch.setattr(MessageQuerySet, "claim", claim)
    monkeypatch.setattr(Consumer, "nothing_left", nothing_left)
    assert run(["w-ok"], concurrency=2, batch_size=5, max_runtime=60) == ExitStatus.OK
    assert committed.is_set() and decided.is_set()
    assert not Message.objects.exists()
    assert sorted(ArchivedMessage.objects.acked().values_list("message_id", flat=True)) == [m.pk for m in sent]


def test_a_closed_connection_error_does_not_end_a_consumer(monkeypatch):
    """InterfaceError, a driver's already-closed connection, is weathered like DatabaseError.

    A stand-in raises it: drivers raise it only in races with a server
    restart that cannot be staged on demand (tests/test_db_restart.py
    stages the restart itself). The first claim and the first batch's ack fail.
    """
    from django.db import InterfaceError

    from django_dbqueue.models import MessageQuerySet
    from django_dbqueue.worker.consumer import Consumer

    django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(4)])
    failures = {"claim": 1, "ack": 1}

    def failing_once(what, real):
        def call(*args, **kwargs):
            if failures[what]:
                failures[what] -= 1
                raise InterfaceError(0, "")
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(Consumer, "claim", failing_once("claim", Consumer.claim))
    monkeypatch.setattr(MessageQuerySet, "ack_many", failing_once("ack", MessageQuerySet.ack_many))
    assert run(["w-ok"], batch_size=2, max_runtime=60) == ExitStatus.OK
    assert failures == {"claim": 0, "ack": 0}
    assert ArchivedMessage.objects.acked().count() == 4 and not Message.objects.exists()


def test_a_crashed_consumer_stops_the_worker_with_an_error_status(monkeypatch, caplog):
    """An unexpected error in one consumer's loop (not in a handler) ends the worker non-zero, with its traceback."""
    from django_dbqueue.worker.consumer import Consumer

    real_claim = Consumer.claim

    def claim(self):
        if self.slot == 1:
            raise OverflowError("date value out of range")
        return real_claim(self)

    monkeypatch.setattr(Consumer, "claim", claim)
    django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(3)])
    # Without --until-empty: only the crash (or, were it ignored, the max runtime) ends the run.
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        status = QueueWorker(WorkerConfig(queues=["w-ok"], concurrency=2, max_runtime=60)).run()
    assert status == ExitStatus.ERROR
    assert "thread dbqueue-consumer-1 crashed; the worker stops" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text
    assert "OverflowError: date value out of range" in caplog.text
    assert "exits (ERROR: thread dbqueue-consumer-1 crashed)" in caplog.text
    assert not Message.objects.in_flight().exists()  # nothing left held
    assert not Worker.objects.exists()  # it held nothing: its row is removed


def test_a_crashed_heartbeat_stops_the_worker_with_an_error_status(settings, monkeypatch, caplog):
    from django_dbqueue.worker.heartbeat import Heartbeat

    settings.DBQUEUE = {**settings.DBQUEUE, "HEARTBEAT_INTERVAL": 0.2, "WORKER_STALE_AFTER": 5}

    def beat(self):
        raise ZeroDivisionError("heartbeat bug")

    monkeypatch.setattr(Heartbeat, "beat", beat)
    assert QueueWorker(WorkerConfig(queues=["w-ok"], max_runtime=60)).run() == ExitStatus.ERROR
    assert "thread dbqueue-heartbeat crashed" in caplog.text and "ZeroDivisionError: heartbeat bug" in caplog.text


def test_a_crash_while_holding_messages_leaves_the_row_for_the_reaper(monkeypatch):
    """Acks never written (a bug crashed the thread before) leave the messages leased: the row stays for the reaper.

    (An error writing the acks is not a crash: tests/test_faults.py.)
    """
    from django_dbqueue.worker.consumer import Consumer

    def flush(self):
        if self.ledger.unacked(self.slot):
            raise OverflowError("a bug before the acks are written")

    monkeypatch.setattr(Consumer, "flush", flush)
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(2)])
    worker = QueueWorker(WorkerConfig(queues=["w-ok"], batch_size=2, until_empty=True, max_runtime=60))
    assert worker.run() == ExitStatus.ERROR
    assert set(Message.objects.in_flight().values_list("pk", flat=True)) == {m.pk for m in sent}
    assert Worker.objects.filter(name=worker.name).exists()


def test_paused_queue_is_skipped():
    from django_dbqueue.control import set_paused

    django_dbqueue.enqueue("w-ok", {})
    set_paused("w-ok", True)
    assert run(["w-ok"], max_runtime=1) == ExitStatus.OK
    assert Message.objects.ready().count() == 1
    set_paused("w-ok", False)
    assert run(["w-ok"]) == ExitStatus.OK
    assert Message.objects.count() == 0


@pytest.mark.slow
def test_heartbeat_keeps_long_work_leased(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "HEARTBEAT_INTERVAL": 0.2, "WORKER_STALE_AFTER": 5}
    message = django_dbqueue.enqueue("w-slow", {"sleep": 2.5})
    # The lease is 1 s, the handler takes 2.5 s: without the heartbeat it would expire.
    assert run(["w-slow"], visibility_timeout=1) == ExitStatus.OK
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.ACKED and row.attempts == 1


def test_command_rejects_bad_arguments():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--exec needs the queues"):
        call_command("runqueueworker", exec_command="cat")
    with pytest.raises(CommandError, match="queue name"):
        call_command("runqueueworker", "bad queue!")


# --- real processes ------------------------------------------------------------


def test_worker_process_registers_itself_and_logs_each_message(tmp_path):
    django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(5)])
    worker = start_worker("w-ok", "--until-empty", "-v3", marks=tmp_path / "marks")
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == ExitStatus.OK, err
    assert len(re.findall(r"message \d+ w-ok acked in \d", err)) == 5  # one line per message
    assert ArchivedMessage.objects.acked().count() == 5
    assert {pid for _, _, pid in read_marks(tmp_path / "marks")} == {worker.pid}
    assert Worker.objects.count() == 0


def test_worker_row_while_running(tmp_path):
    worker = start_worker("w-ok", "--concurrency", "3", "--max-runtime", "30")
    try:
        row = wait_for(lambda: Worker.objects.filter(pid=worker.pid).first(), what="the worker row")
        assert row.queues == ["w-ok"] and row.concurrency == 3
        django_dbqueue.enqueue("w-ok", {})
        wait_for(lambda: Worker.objects.filter(pid=worker.pid, processed=1).exists(), what="the processed count")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=60)
    assert worker.returncode == ExitStatus.OK
    assert not Worker.objects.filter(pid=worker.pid).exists()


@pytest.mark.slow
def test_sigterm_finishes_the_running_handler_and_releases_the_rest_at_once(tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-slow", {"sleep": 4}, priority=-1)
    rest = [m.pk for m in django_dbqueue.enqueue_many("w-slow", [{"sleep": 0}] * 5)]
    worker = start_worker("w-slow", "--batch-size", "6", marks=marks)
    wait_for(lambda: ("start", slow.pk, worker.pid) in read_marks(marks), what="the slow handler to start")
    assert Message.objects.filter(pk__in=rest, lease_token__isnull=False).count() == 5  # claimed, unstarted
    worker.send_signal(signal.SIGTERM)
    # The unstarted five are ready again long before the running handler ends.
    wait_for(
        lambda: Message.objects.filter(pk__in=rest, lease_token__isnull=True, attempts=0).ready().count() == 5,
        timeout=3,
        what="the unstarted messages to be released",
    )
    assert worker.poll() is None  # still finishing the slow one
    worker.communicate(timeout=60)
    assert worker.returncode == ExitStatus.OK
    assert ArchivedMessage.objects.get(message_id=slow.pk).outcome == Outcome.ACKED
    assert ("start", rest[0], worker.pid) not in read_marks(marks)


@pytest.mark.slow
def test_leases_are_kept_through_the_shutdown_grace(tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-slow", {"sleep": 10})
    worker = start_worker("w-slow", "--visibility-timeout", "4", marks=marks)
    wait_for(lambda: read_marks(marks), what="the handler to start")
    worker.send_signal(signal.SIGTERM)
    # The 4 s lease would have run out twice over without the heartbeat, which
    # beats every 1.3 s: a beat may come over 2 s late on a loaded machine.
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == ExitStatus.OK, err
    row = ArchivedMessage.objects.get(message_id=slow.pk)
    assert row.outcome == Outcome.ACKED and row.attempts == 1


def test_grace_running_out_leaves_the_worker_row_for_the_reaper(tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-slow", {"sleep": 60})
    worker = start_worker("w-slow", "--grace", "1", marks=marks)
    wait_for(lambda: read_marks(marks), what="the handler to start")
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=30)
    assert worker.returncode == ExitStatus.ABANDONED
    # The row stays, so the reaper releases the message once the heartbeat is stale,
    # instead of it waiting out a whole lease.
    assert Worker.objects.filter(pid=worker.pid).exists()
    assert Message.objects.in_flight().get().pk == slow.pk


def test_second_signal_exits_at_once(tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-slow", {"sleep": 60})
    worker = start_worker("w-slow", marks=marks)
    wait_for(lambda: read_marks(marks), what="the handler to start")
    worker.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=15)
    assert worker.returncode == ExitStatus.FORCED
    assert Message.objects.in_flight().get().pk == slow.pk  # its lease will expire


@pytest.mark.slow
def test_killed_worker_message_runs_again_within_15_seconds(tmp_path):
    """Default settings; a lease of 10 minutes; the reaper sees the silent heartbeat."""
    marks = tmp_path / "marks"
    message = django_dbqueue.enqueue("w-slow", {"sleep": 600})
    first = start_worker("w-slow", "--visibility-timeout", "600", marks=marks)
    wait_for(lambda: read_marks(marks), what="the handler to start")
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=10)
    killed_at = time.monotonic()
    second = start_worker("w-slow", "--visibility-timeout", "600", "--reap", marks=marks)
    try:
        wait_for(
            lambda: ArchivedMessage.objects.filter(message_id=message.pk, outcome=Outcome.ACKED).exists(),
            timeout=60,
            what="the second worker to process the message",
        )
        assert time.monotonic() - killed_at < 15
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=60)
    assert [e for e in read_marks(marks) if e[0] == "done"] == [("done", message.pk, second.pid)]
    assert ArchivedMessage.objects.get(message_id=message.pk).attempts == 2
    assert not Worker.objects.exists()


@pytest.mark.slow
def test_poison_message_is_dead_lettered_while_others_flow(tmp_path):
    marks = tmp_path / "marks"
    poison = django_dbqueue.enqueue("w-poison", {}, max_attempts=2)
    good = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(20)])]
    deadline = time.monotonic() + 120
    runs = 0
    while time.monotonic() < deadline:
        done = ArchivedMessage.objects.filter(message_id__in=good, outcome=Outcome.ACKED).count() == len(good)
        if done and ArchivedMessage.objects.filter(message_id=poison.pk).exists():
            break
        # Each run claims the poison message (and dies) or works the rest; the reaper
        # of a later run dead-letters the poison once its last lease has expired.
        worker = start_worker(
            "w-poison", "w-ok", "--visibility-timeout", "1", "--reap", "--max-runtime", "4", marks=marks
        )
        worker.communicate(timeout=60)
        runs += 1
    row = ArchivedMessage.objects.get(message_id=poison.pk)
    assert row.outcome == Outcome.DEAD and row.attempts == 2
    assert "the worker died running it" in row.last_error
    done = [pk for event, pk, _ in read_marks(marks) if event == "done"]
    # Each good message ran, and was acked once. With a 1-second lease (which the poison needs, to come
    # back quickly), a busy machine can let a good message's lease run out before its ack: it then runs
    # again, as at-least-once delivery allows, and the late ack changes nothing.
    assert set(done) == set(good)
    acked = ArchivedMessage.objects.filter(message_id__in=good).values_list("message_id", "outcome")
    assert sorted(acked) == sorted((pk, Outcome.ACKED) for pk in good)
    assert [e for e, pk, _ in read_marks(marks) if pk == poison.pk] == ["start", "start"]
    assert runs >= 3


def test_exec_mode_acks_on_exit_0_and_fails_with_stderr(tmp_path):
    marks = tmp_path / "marks"
    ok = django_dbqueue.enqueue("w-exec", {"exit": 0, "text": "it's $(rm -rf /); `x`"}, kind="k1")
    bad = django_dbqueue.enqueue("w-exec", {"exit": 3}, max_attempts=1)
    command = f"{sys.executable} {ROOT / 'tests' / 'support' / 'exec_consumer.py'} {marks}"
    worker = start_worker("w-exec", "--until-empty", "--exec", command)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == ExitStatus.OK, err
    acked = ArchivedMessage.objects.get(message_id=ok.pk)
    assert acked.outcome == Outcome.ACKED
    seen = marks.read_text().splitlines()
    assert f"{ok.pk} w-exec k1 1 it's $(rm -rf /); `x`" in seen  # data reached the consumer untouched
    dead = ArchivedMessage.objects.get(message_id=bad.pk)
    assert dead.outcome == Outcome.DEAD
    assert "exited with status 3" in dead.last_error and "consumer says: cannot do 3" in dead.last_error


def test_exec_mode_command_that_does_not_exist():
    django_dbqueue.enqueue("w-exec", {}, max_attempts=1)
    worker = start_worker("w-exec", "--until-empty", "--exec", "no-such-program-here --flag")
    worker.communicate(timeout=60)
    assert "cannot run 'no-such-program-here'" in ArchivedMessage.objects.get().last_error


def test_postgres_notify_wakes_an_idle_worker():
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; on other databases workers poll")
    worker = start_worker("w-ok", "--poll-interval", "60", "--max-poll-interval", "60", "--max-runtime", "50")
    try:
        wait_for(lambda: Worker.objects.filter(pid=worker.pid).exists(), what="the worker to start")
        time.sleep(1)  # it has polled once and now waits 60 s, unless woken
        started = time.monotonic()
        message = django_dbqueue.enqueue("w-ok", {})
        wait_for(
            lambda: ArchivedMessage.objects.filter(message_id=message.pk).exists(),
            timeout=40,
            what="the notified worker to process the message",
        )
        # Polling alone would take close to 60 s; the notification wakes it at once.
        assert time.monotonic() - started < 10
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=60)
