"""Faults injected into real worker processes against the real databases (issue 15).

Each test starts real ``runqueueworker`` or ``reapqueue`` processes
(tests/support/processes.py), injects one failure, names in its docstring
the defect it guards against, and asserts:

- nothing was lost: every message is live, acked, dead or expired exactly
  once (:func:`fates`), with the counts;
- nothing ran past its attempts (:func:`within_attempts`: the handlers'
  marks and the archive's attempts);
- the worker carried on (it processed the normal messages that followed
  and exited 0) or exited non-zero.

Faults patched into a process (a database refusing a write, a bug in a
consumer thread, a failing reaper pass) are in tests/support/faulty.py.
A database restart under a running worker is tests/test_db_restart.py (it
runs a private MariaDB server; not repeated here). The table of faults, and
what each does, is in docs/reliability.md.
"""

import select
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

import django_dbqueue
from django_dbqueue.conf import queue_options
from django_dbqueue.models import ArchivedMessage, Message, Outcome, Worker
from django_dbqueue.worker import ExitStatus
from tests.support.factories import WorkerFactory
from tests.support.processes import ROOT, read_marks, start_command, start_faulty, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def finish(process: subprocess.Popen[str], timeout: float = 90) -> tuple[int, str]:
    """Wait for a worker to exit; a worker that does not is wedged: kill it and fail with its log."""
    try:
        _, log = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, log = process.communicate()
        pytest.fail(f"the process did not exit within {timeout}s (wedged?); its log ends:\n{log[-3000:]}")
    return process.returncode, log


def fates(messages) -> dict[int, str]:
    """Where each message is now: ``"live"`` or its archive outcome. Fails if one is lost or in two places."""
    ids = {message.pk for message in messages}
    live = set(Message.objects.filter(pk__in=ids).values_list("pk", flat=True))
    archived = list(ArchivedMessage.objects.filter(message_id__in=ids).values_list("message_id", "outcome"))
    times = Counter(pk for pk, _ in archived)
    assert not [pk for pk, n in times.items() if n > 1], f"archived more than once: {times}"
    assert not live & set(times), f"both live and archived: {live & set(times)}"
    assert live | set(times) == ids, f"lost (neither live nor archived): {ids - live - set(times)}"
    return {**dict.fromkeys(live, "live"), **dict(archived)}


def within_attempts(messages, marks) -> None:
    """No message ran more often than its attempts allow (a release gives its attempt back: not counted)."""
    starts = Counter(pk for event, pk, _ in read_marks(marks) if event == "start")
    for message in messages:
        allowed = message.max_attempts or queue_options(message.queue).max_attempts
        assert starts[message.pk] <= allowed + message.payload.get("releases", 0), (message.pk, starts[message.pk])
    for row in ArchivedMessage.objects.filter(message_id__in=[m.pk for m in messages]):
        assert row.attempts <= (row.max_attempts or queue_options(row.queue).max_attempts), row


def not_in_flight(messages) -> None:
    held = list(Message.objects.filter(pk__in=[m.pk for m in messages]).in_flight().values_list("pk", flat=True))
    assert not held, f"still leased: {held}"


# --- poison values ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 5])
def test_poison_values_end_as_documented_and_the_worker_carries_on(tmp_path, batch_size):
    """Values that once wedged a worker: each message stayed in flight for ever, its lease extended by the heartbeat.

    PostgreSQL: a result or an exception text holding NUL (in a batch, the
    whole batch's acks); MariaDB: a result over max_allowed_packet; every
    database: ``Retry(delay=1e12)`` and ``Defer(delay=1e12)``.
    """
    marks = tmp_path / "marks"
    poison = {
        "result-nul": django_dbqueue.enqueue("f-poison", {"action": "result-nul"}, max_attempts=1),
        "result-huge": django_dbqueue.enqueue("f-poison", {"action": "result-huge"}, max_attempts=1),
        "error-nul": django_dbqueue.enqueue("f-poison", {"action": "error-nul"}, max_attempts=1),
        "retry-forever": django_dbqueue.enqueue("f-poison", {"action": "retry-forever"}, max_attempts=2),
        "defer-forever": django_dbqueue.enqueue("f-poison", {"action": "defer-forever"}, max_attempts=1),
    }
    following = django_dbqueue.enqueue_many("f-poison", [{"action": "ok"}] * 3)
    status, log = finish(start_worker("f-poison", "--until-empty", "--batch-size", batch_size, marks=marks))
    assert status == ExitStatus.OK, log
    sent = [*poison.values(), *following]
    fate = fates(sent)
    within_attempts(sent, marks)
    not_in_flight(sent)
    rows = {row.message_id: row for row in ArchivedMessage.objects.all()}
    assert [fate[m.pk] for m in following] == [Outcome.ACKED] * 3  # it carried on

    # A result that cannot be stored is not kept; the ack stands, and the row says why.
    for name, words in (("result-nul", "NUL character"), ("result-huge", "the limit is 1,000,000")):
        row = rows[poison[name].pk]
        assert row.outcome == Outcome.ACKED and row.result is None, name
        assert "result not kept" in row.last_error and words in row.last_error, row.last_error
    # An exception text with NUL: the failure is recorded, escaped.
    row = rows[poison["error-nul"].pk]
    assert row.outcome == Outcome.DEAD and "cannot parse byte \\x00 here" in row.last_error
    # Defer(delay=1e12): the handler's request is refused; the attempt fails (its last: dead).
    row = rows[poison["defer-forever"].pk]
    assert row.outcome == Outcome.DEAD and "the limit is" in row.last_error and "ten years" in row.last_error
    # Retry(delay=1e12): a failed attempt, retried after its backoff (or dead at the second, if the
    # worker saw it ready again before the queues were empty).
    retried = poison["retry-forever"].pk
    if fate[retried] == "live":
        live = Message.objects.get(pk=retried)
        assert live.attempts == 1 and live.lease_token is None and "ten years" in live.last_error
    else:
        assert fate[retried] == Outcome.DEAD and rows[retried].attempts == 2
    counts = Counter(fate.values())
    assert counts[Outcome.ACKED] == 5 and counts[Outcome.DEAD] + counts["live"] == 3, counts


def test_an_exec_command_printing_nul_is_recorded_escaped(tmp_path):
    """PostgreSQL: an ``--exec`` command printing NUL to stdout or stderr wedged its message in flight."""
    marks = tmp_path / "marks"
    acked = django_dbqueue.enqueue("w-exec", {"nul": True, "exit": 0})
    failed = django_dbqueue.enqueue("w-exec", {"nul": True, "exit": 3}, max_attempts=1)
    following = django_dbqueue.enqueue("w-exec", {"exit": 0})
    command = f"{sys.executable} {ROOT / 'tests' / 'support' / 'exec_consumer.py'} {marks}"
    status, log = finish(start_worker("w-exec", "--until-empty", "--exec", command))
    assert status == ExitStatus.OK, log
    assert fates([acked, failed, following]) == {
        acked.pk: Outcome.ACKED,
        failed.pk: Outcome.DEAD,
        following.pk: Outcome.ACKED,
    }
    assert ArchivedMessage.objects.get(message_id=acked.pk).result == "out\\x00put"
    assert "err\\x00or" in ArchivedMessage.objects.get(message_id=failed.pk).last_error


@pytest.mark.parametrize("batch_size", [1, 5])
def test_an_outcome_the_database_refuses_is_recorded_otherwise_and_the_worker_goes_on(tmp_path, batch_size):
    """A permanent error writing an outcome was retried for ever (every database error was taken for weather).

    The message stayed in flight, and in a batch its ack held back the
    others'. The database's refusal is injected (tests/support/faulty.py
    says why a real one cannot be provoked any more).
    """
    marks = tmp_path / "marks"
    before = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(2)])
    refused = django_dbqueue.enqueue("w-ok", {"unstorable": True})
    after = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(2, 6)])
    argv = ("runqueueworker", "w-ok", "--until-empty", "--batch-size", batch_size)
    process = start_faulty("unstorable-ack", *argv, marks=marks)
    status, log = finish(process)
    assert status == ExitStatus.OK, log
    sent = [*before, refused, *after]
    fate = fates(sent)
    assert fate == {m.pk: Outcome.DEAD if m.pk == refused.pk else Outcome.ACKED for m in sent}
    row = ArchivedMessage.objects.get(message_id=refused.pk)
    assert "the handler succeeded, but its outcome (acked) could not be stored: DataError" in row.last_error
    assert row.attempts == 1  # recorded at once, not run again
    done = Counter(pk for event, pk, _ in read_marks(marks) if event == "done")
    assert done == Counter(m.pk for m in sent)  # each handler ran once
    assert log.count(f"message {refused.pk}: its outcome (acked) cannot be stored") == 1  # never retried
    assert "retrying" not in log
    if batch_size > 1:
        assert "writing them one by one" in log


# --- a handler that gives up its own message ---------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 5])
def test_a_handler_that_gives_up_its_own_message_is_lease_lost_once(tmp_path, batch_size):
    """A handler that released, failed or acked its own message made the worker spin (thousands of warnings a second).

    In batches, ``ack_many`` raised inside the flush: the thread died and
    the batch's other acks were lost.
    """
    marks = tmp_path / "marks"
    own = {
        "release-self": django_dbqueue.enqueue("f-poison", {"action": "release-self", "releases": 1}),
        "fail-self": django_dbqueue.enqueue("f-poison", {"action": "fail-self"}, max_attempts=1),
        "ack-self": django_dbqueue.enqueue("f-poison", {"action": "ack-self"}),
    }
    others = django_dbqueue.enqueue_many("f-poison", [{"action": "ok"}] * 4)
    status, log = finish(start_worker("f-poison", "--until-empty", "--batch-size", batch_size, marks=marks))
    assert status == ExitStatus.OK, log
    sent = [*own.values(), *others]
    fate = fates(sent)
    within_attempts(sent, marks)
    assert fate == {
        own["release-self"].pk: Outcome.ACKED,  # given back by its handler, then run again
        own["fail-self"].pk: Outcome.DEAD,
        own["ack-self"].pk: Outcome.ACKED,
        **{m.pk: Outcome.ACKED for m in others},
    }
    assert "failed by its own handler" in ArchivedMessage.objects.get(message_id=own["fail-self"].pk).last_error
    for message in own.values():
        assert log.count(f"message {message.pk}: lease lost") == 1, log[-3000:]
    assert log.count("lease lost") == 3


# --- a killed thread -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_crashed_consumer_thread_exits_non_zero_and_loses_nothing(tmp_path):
    """An unexpected error in a consumer's loop ended the worker with status 0, or left it with a thread less."""
    marks = tmp_path / "marks"
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(30)])
    process = start_faulty(
        "consumer-crash", "runqueueworker", "w-ok", "--concurrency", "2", "--batch-size", "3", "--max-runtime", "60"
    )
    status, log = finish(process, timeout=120)
    assert status == ExitStatus.ERROR, log
    assert "thread dbqueue-consumer-1 crashed; the worker stops" in log
    assert "Traceback (most recent call last)" in log and "OverflowError: injected" in log
    fate = fates(sent)
    assert set(fate.values()) <= {"live", Outcome.ACKED}
    not_in_flight(sent)  # what it held was written or given back
    # A fresh worker does the rest; nothing runs twice.
    status, log = finish(start_worker("w-ok", "--until-empty", marks=marks))
    assert status == ExitStatus.OK, log
    assert set(fates(sent).values()) == {Outcome.ACKED}


# --- the reaper -----------------------------------------------------------------------------------------


def test_a_failed_reaper_pass_is_logged_and_reapqueue_loop_goes_on():
    """``reapqueue --loop`` ended on any error that was not database trouble."""
    WorkerFactory(stale=True)
    reaper = start_faulty("reaper-pass-fails", "reapqueue", "--loop", "--interval", "0.2", PYTHONUNBUFFERED="1")

    def printed_line():
        ready, _, _ = select.select([reaper.stdout], [], [], 0)
        return reaper.stdout.readline() if ready else reaper.poll() is not None

    try:
        first = wait_for(printed_line, what="the second pass to report")
        assert reaper.poll() is None, "reapqueue --loop exited after a failed pass"
    finally:
        reaper.send_signal(signal.SIGINT)
        _, log = reaper.communicate(timeout=60)
    assert reaper.returncode == 0, log
    assert "reaper: a pass failed; trying again in 0.2s" in log and "RuntimeError: injected" in log
    assert "Traceback (most recent call last)" in log
    assert first.startswith("1 stale worker(s) removed")
    assert not Worker.objects.exists()


@pytest.mark.slow
def test_a_failed_reaper_pass_does_not_stop_a_worker_that_reaps(tmp_path):
    """``runqueueworker --reap``: a failed pass crashed the reaper thread, and with it the worker."""
    marks = tmp_path / "marks"
    stale = WorkerFactory(stale=True)
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(3)])
    process = start_faulty("reaper-pass-fails", "runqueueworker", "w-ok", "--reap", "--max-runtime", "6", marks=marks)
    status, log = finish(process)
    assert status == ExitStatus.OK, log
    assert "reaper: a pass failed" in log and "RuntimeError: injected" in log
    assert not Worker.objects.filter(name=stale.name).exists()  # a later pass reaped it
    assert set(fates(sent).values()) == {Outcome.ACKED}


# --- overflowing options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("runqueueworker", "w-ok", "--max-runtime", "1e12"),
        ("runqueueworker", "w-ok", "--visibility-timeout", "inf"),
        ("runqueueworker", "w-ok", "--poll-interval", "nan"),
        ("reapqueue", "--loop", "--interval", "1e12"),
        ("reapqueue", "--loop", "--interval", "nan"),
    ],
    ids=lambda argv: " ".join(argv),
)
def test_an_overflowing_option_is_refused_before_anything_runs(argv):
    """A duration past any timestamp overflowed once the process ran (a lease, a wait), or looped without pause."""
    message = django_dbqueue.enqueue("w-ok", {})
    status, log = finish(start_command(*argv), timeout=60)
    assert status != 0 and "invalid positive_float value" in log, log
    assert fates([message]) == {message.pk: "live"}
    not_in_flight([message])


# --- --until-empty, and a killed worker (long: slow) ------------------------------------------------------


@pytest.mark.slow
def test_until_empty_stops_only_when_nothing_is_left(tmp_path):
    """Once in two runs (MariaDB, 4 threads, batches of 20, 500 messages) the worker exited 0 with 19 messages live.

    A thread took the queues for empty while another's claim had committed
    but was not handed over yet, and the shutdown released that batch unstarted.
    """
    for run in range(3):
        marks = tmp_path / f"marks-{run}"
        sent = django_dbqueue.enqueue_many("w-ok", [{"run": run, "n": n} for n in range(500)])
        worker = start_worker("w-ok", "--until-empty", "--concurrency", "4", "--batch-size", "20", marks=marks)
        status, log = finish(worker, timeout=300)
        assert status == ExitStatus.OK, log
        counts = Counter(fates(sent).values())
        assert counts == {Outcome.ACKED: 500}, f"run {run}: {counts}"
        done = Counter(pk for event, pk, _ in read_marks(marks) if event == "done")
        assert sorted(done) == sorted(m.pk for m in sent) and set(done.values()) == {1}, f"run {run}"


@pytest.mark.slow
def test_a_killed_job_runs_again_within_15_seconds_ahead_of_the_backlog(tmp_path):
    """Default settings: a killed worker's job ran again only after the 19 jobs behind it (39 s after the kill).

    20 jobs of 2 s on one queue; the worker is killed with SIGKILL during
    the first; a fresh ``runqueueworker --reap`` starts at once. Its reaper
    gives the job back once the dead worker's heartbeat is stale
    (WORKER_STALE_AFTER, 8 s), in its place: first.
    """
    marks = tmp_path / "marks"
    jobs = django_dbqueue.enqueue_many("w-sleep", [{"sleep": 2, "n": n} for n in range(20)])
    killed = jobs[0]
    first = start_worker("w-sleep", marks=marks)
    wait_for(lambda: ("start", killed.pk, first.pid) in read_marks(marks), timeout=60, what="the first job to start")
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=10)
    killed_at = time.monotonic()
    second = start_worker("w-sleep", "--reap", marks=marks)
    try:
        wait_for(
            lambda: ("start", killed.pk, second.pid) in read_marks(marks),
            timeout=90,
            interval=0.1,
            what="the killed job to run again",
        )
        after = time.monotonic() - killed_at
    finally:
        second.send_signal(signal.SIGTERM)
        finish(second)
    started = [pk for event, pk, pid in read_marks(marks) if event == "start" and pid == second.pid]
    ahead = started.index(killed.pk)
    report = f"the killed job ran again {after:.1f}s after the kill, after {ahead} of the 19 others"
    print(report)  # the measured time, for docs/reliability.md
    assert after < 15, report
    assert ahead < 19, report
    assert len(set(started)) == len(started)  # no job ran twice in the second worker
    assert fates(jobs)[killed.pk] in ("live", Outcome.ACKED)
