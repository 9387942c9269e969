"""Cancel a message, also while it runs; progress and meta reported by a running handler."""

import signal
import sys
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_dbqueue
from django_dbqueue import control
from django_dbqueue.control import CancelResult
from django_dbqueue.exceptions import Cancelled, InvalidOption
from django_dbqueue.models import ArchivedMessage, Message, Outcome, Worker
from django_dbqueue.reaper import Reaper
from django_dbqueue.running import HandlerOutcome, process
from django_dbqueue.worker.heartbeat import Heartbeat
from django_dbqueue.worker.ledger import Ledger
from tests.support.processes import alive, read_marks, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def heartbeat(queue: str = "q") -> Heartbeat:
    return Heartbeat(
        name="test", queues=[queue], using="default", concurrency=1, visibility_timeout=None, ledger=Ledger()
    )


def claimed(queue: str = "q", **options) -> Message:
    django_dbqueue.enqueue(queue, {}, **options)
    [message] = Message.objects.claim(queue)
    return message


# --- cancel() ------------------------------------------------------------------------


def test_a_message_not_running_is_archived_at_once_by_id_or_by_object():
    ready, scheduled = django_dbqueue.enqueue("q", {}), django_dbqueue.enqueue("q", {}, delay=3600)
    assert control.cancel(ready.pk, by="ops") == CancelResult.ARCHIVED
    assert django_dbqueue.cancel(scheduled) == CancelResult.ARCHIVED
    assert not Message.objects.exists()
    assert set(ArchivedMessage.objects.values_list("outcome", flat=True)) == {Outcome.CANCELLED}
    assert ArchivedMessage.objects.get(message_id=ready.pk).last_error == "cancelled by ops"
    gone = control.cancel(ready.pk)
    assert gone == CancelResult.GONE and not gone


def test_a_running_message_is_flagged_not_archived_and_a_second_cancel_keeps_the_first_time():
    message = claimed()
    assert control.cancel(message.pk) == CancelResult.REQUESTED
    first = Message.objects.get().cancel_requested_at
    assert first is not None and not ArchivedMessage.objects.exists()
    assert control.cancel(message.pk) == CancelResult.REQUESTED
    assert Message.objects.get().cancel_requested_at == first


def test_a_message_whose_lease_ran_out_is_not_running_and_is_archived():
    message = claimed()
    Message.objects.filter(pk=message.pk).update(available_at=timezone.now() - timedelta(seconds=1))
    assert control.cancel(message.pk) == CancelResult.ARCHIVED
    assert message.ack() is False  # its late worker finds the lease gone


# --- the worker's side, in this process -----------------------------------------------


def cancelled_meanwhile(m: Message) -> None:
    """An operator cancels ``m`` while its handler runs, and the worker's heartbeat passes."""
    control.cancel(m.pk, by="ops")
    assert not m.cancel_requested()  # nothing tells the handler until a heartbeat
    heartbeat().exchange_reports([m])
    assert m.cancel_requested()


def test_the_heartbeat_tells_the_handler_and_the_message_is_archived_as_cancelled_never_retried():
    message = claimed(max_attempts=5)

    def handler(m):
        m.checkpoint()  # not cancelled yet
        cancelled_meanwhile(m)
        m.set_progress(1, 10)  # a checkpoint: raises Cancelled

    assert process(message, handler=handler) == HandlerOutcome.CANCELLED
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert (row.outcome, row.attempts) == (Outcome.CANCELLED, 1)
    assert row.last_error == f"cancelled while it ran: message {message.pk}: cancel was asked"
    assert row.progress == {"done": 1, "total": 10, "note": ""}  # the last report, kept
    assert not Message.objects.exists()  # not back in the queue, although attempts are left


def test_whatever_the_handler_raises_once_cancelled_is_a_cancel_not_a_failure():
    message = claimed(max_attempts=5)

    def handler(m):
        cancelled_meanwhile(m)
        raise ValueError("interrupted")

    assert process(message, handler=handler) == HandlerOutcome.CANCELLED
    row = ArchivedMessage.objects.get()
    assert row.outcome == Outcome.CANCELLED and "ValueError: interrupted" in row.last_error


def test_a_handler_that_finishes_despite_the_request_is_acked():
    message = claimed()

    def handler(m):
        cancelled_meanwhile(m)
        return "done anyway"

    assert process(message, handler=handler) == HandlerOutcome.ACKED
    assert ArchivedMessage.objects.get().outcome == Outcome.ACKED


def test_a_flagged_message_claimed_again_is_cancelled_without_running():
    message = claimed()
    control.cancel(message.pk)
    # Its worker died: the lease runs out and another worker claims it before the reaper passes.
    Message.objects.filter(pk=message.pk).update(available_at=timezone.now() - timedelta(seconds=1))
    [again] = Message.objects.claim("q")
    ran = []
    assert process(again, handler=ran.append) == HandlerOutcome.CANCELLED
    assert ran == [] and ArchivedMessage.objects.get().last_error == "cancelled before it ran"


def test_checkpoint_raises_only_once_cancel_was_asked():
    message = claimed()
    message.checkpoint()
    control.cancel(message.pk)
    message.checkpoint()  # the flag is in the database, not yet in the worker
    heartbeat().exchange_reports([message])
    with pytest.raises(Cancelled, match=f"message {message.pk}: cancel was asked"):
        message.checkpoint()


# --- progress and meta ----------------------------------------------------------------


def test_reports_touch_no_database_and_the_heartbeat_writes_only_what_changed():
    message, beat = claimed(), heartbeat()
    with CaptureQueriesContext(connection) as queries:
        for done in range(100):
            message.set_progress(done, 100, note="copying")
            message.update_meta({"rows": done}, table="orders")
    assert len(queries) == 0
    with CaptureQueriesContext(connection) as queries:
        beat.exchange_reports([message])
    updates = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert len(updates) == 1  # the last report, once
    stored = Message.objects.get()
    assert stored.progress == {"done": 99, "total": 100, "note": "copying"}
    assert stored.meta == {"rows": 99, "table": "orders"}
    with CaptureQueriesContext(connection) as queries:
        beat.exchange_reports([message])
    assert not [q for q in queries if q["sql"].lstrip().upper().startswith("UPDATE")]  # nothing new


def test_a_report_not_yet_written_by_a_heartbeat_still_reaches_the_archive_on_ack():
    message, batch = claimed(), claimed()
    message.set_progress(3, None, note="almost")
    assert message.ack()
    batch.update_meta(source="batch")
    assert django_dbqueue.ack_many([batch]) == [True]
    assert ArchivedMessage.objects.get(message_id=message.pk).progress == {"done": 3, "total": None, "note": "almost"}
    assert ArchivedMessage.objects.get(message_id=batch.pk).meta == {"source": "batch"}


def test_a_report_after_the_lease_was_lost_is_not_written():
    message = claimed()
    control.release_lease(message)
    message.set_progress(1, 2)
    heartbeat().exchange_reports([message])
    assert Message.objects.get().progress is None


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ((-1,), "done must be a finite number >= 0"),
        ((float("nan"),), "done must be a finite number >= 0"),
        ((True,), "done must be a finite number >= 0"),
        ((1, "10"), "total must be a finite number >= 0"),
        ((11, 10), r"done \(11\) is more than its total \(10\)"),
        ((1, 10, 5), "note must be a string"),
    ],
)
def test_bad_progress_is_refused_with_its_reason(args, problem):
    message = claimed()
    with pytest.raises(InvalidOption, match=problem):
        message.set_progress(*args)
    assert message.unreported() is None  # nothing kept to write


def test_meta_that_json_cannot_hold_is_refused():
    message = claimed()
    with pytest.raises(InvalidOption, match="meta"):
        message.update_meta(when=timezone.now())
    assert message.meta is None


# --- real worker processes --------------------------------------------------------------


@pytest.mark.slow
def test_cancel_a_message_running_in_a_worker_process(tmp_path):
    marks = tmp_path / "marks"
    message = django_dbqueue.enqueue("w-cancel", {"steps": 600}, max_attempts=5)
    worker = start_worker("w-cancel", "--max-runtime", "120", marks=marks)
    try:
        # The heartbeat writes the handler's progress (every 2 s by default).
        running = wait_for(
            lambda: Message.objects.filter(pk=message.pk, progress__isnull=False).first(), what="reported progress"
        )
        assert running.progress["total"] == 600 and running.progress["note"].startswith("step ")
        assert running.meta["step"] >= 0
        assert control.cancel(message.pk, by="ops") == CancelResult.REQUESTED
        row = wait_for(lambda: ArchivedMessage.objects.filter(message_id=message.pk).first(), what="the cancel")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    assert (row.outcome, row.attempts) == (Outcome.CANCELLED, 1), err
    assert f":{worker.pid}:" in row.finished_by  # the worker archived it, not the reaper
    assert row.progress["done"] < 600 and row.meta["step"] < 600
    assert not Message.objects.exists()
    assert [event for event, _, _ in read_marks(marks)] == ["start"]  # stopped, never finished, never rerun


@pytest.mark.slow
def test_cancel_an_exec_command_stops_its_process_group_even_when_it_ignores_sigterm(tmp_path):
    pid_file = tmp_path / "pid"
    program = tmp_path / "stubborn.py"
    program.write_text(
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(600)\n"
    )
    message = django_dbqueue.enqueue("x-cancel", {})
    worker = start_worker("x-cancel", "--exec", f"{sys.executable} {program}", "--max-runtime", "120")
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="the command to start")
        pids = [int(pid) for pid in pid_file.read_text().split()]
        assert control.cancel(message.pk) == CancelResult.REQUESTED
        # Seen at the next heartbeat; SIGTERM is ignored, SIGKILL follows after the grace (5 s).
        row = wait_for(lambda: ArchivedMessage.objects.filter(message_id=message.pk).first(), what="the cancel")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    assert row.outcome == Outcome.CANCELLED, err
    assert "was stopped with its process group" in row.last_error
    for pid in pids:  # the command and its child are gone
        wait_for(lambda pid=pid: not alive(pid), timeout=10, what=f"process {pid} to be gone")


@pytest.mark.slow
def test_cancel_a_message_whose_worker_died_is_finished_by_the_reaper(tmp_path):
    marks = tmp_path / "marks"
    message = django_dbqueue.enqueue("w-cancel", {"steps": 600, "report": False}, max_attempts=5)
    worker = start_worker("w-cancel", "--visibility-timeout", "300", marks=marks)
    try:
        wait_for(lambda: ("start", message.pk, worker.pid) in read_marks(marks), what="the handler to start")
    finally:
        worker.kill()  # SIGKILL: no shutdown, its row and its lease stay
        worker.communicate(timeout=60)
    assert control.cancel(message.pk) == CancelResult.REQUESTED  # its lease still holds: flagged
    # Its heartbeat has stopped; rather than wait WORKER_STALE_AFTER, date its last one back.
    Worker.objects.filter(pid=worker.pid).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    report = Reaper().run_once()
    assert (report.stale_workers, report.cancelled, report.released) == (1, 1, 0)
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.CANCELLED and "stopped answering" in row.last_error
    assert not Message.objects.exists()


def test_the_reaper_cancels_a_flagged_message_whose_lease_ran_out():
    message = claimed()
    control.cancel(message.pk)
    Message.objects.filter(pk=message.pk).update(available_at=timezone.now() - timedelta(seconds=1))
    report = Reaper().run_once()
    assert report.cancelled == 1 and "lease ran out" in ArchivedMessage.objects.get().last_error


@pytest.mark.parametrize("bad", [15.5, None, "15", True, 0, -3])
def test_cancel_refuses_an_id_that_is_not_a_positive_integer_and_changes_nothing(bad):
    """cancel(15.5) cancelled message 15 (Django made 15 of it); cancel(None) answered GONE."""
    message = django_dbqueue.enqueue("q", {})
    Message.objects.filter(pk=message.pk).update(id=15)
    with pytest.raises(InvalidOption, match=repr(bad).replace("'", ".").replace("(", ".").replace(")", ".")):
        control.cancel(bad)
    assert Message.objects.filter(pk=15).exists() and ArchivedMessage.objects.count() == 0


def test_the_other_id_taking_controls_refuse_what_is_not_their_message():
    message = django_dbqueue.enqueue("q", {})
    for call, what in (
        (lambda: control.run_now(message.pk + 0.5), "run_now"),
        (lambda: control.release_lease(message.pk), "release_lease"),
        (lambda: control.replay(message.pk), "replay"),
        (lambda: Message.objects.locate(float(message.pk)), "message must be a Message or its integer id"),
    ):
        with pytest.raises(InvalidOption, match=what):
            call()
    assert Message.objects.get().pk == message.pk and ArchivedMessage.objects.count() == 0
