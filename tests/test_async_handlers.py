"""``async def`` handlers on the worker's event loop (django_dbqueue/worker/asyncloop.py, asyncconsumer.py).

The handlers are in tests/testapp/queues.py (queues ``a-*``). The process
tests start real ``runqueueworker`` processes against the test database,
each with its output in a file, and kill what is left at the end.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

import django_dbqueue
from django_dbqueue.handlers import is_async
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.running import HandlerOutcome, decide
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from tests.support.processes import LoggedCommands, read_marks, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


class Workers(LoggedCommands):
    """`LoggedCommands` whose workers mark each message they start and finish (``read_marks``)."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.marks = tmp_path / "marks"

    def start(self, *args: object, marks: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
        return super().start(*args, marks=marks or self.marks, **env)

    def starts(self) -> Counter[int]:
        return Counter(pk for event, pk, _ in read_marks(self.marks) if event == "start")


@pytest.fixture
def workers(tmp_path):
    started = Workers(tmp_path)
    yield started
    started.close()


def archived(ids: list[int]) -> dict[int, ArchivedMessage]:
    rows = list(ArchivedMessage.objects.filter(message_id__in=ids))
    assert len(rows) == len({row.message_id for row in rows}), "a message archived twice"
    return {row.message_id: row for row in rows}


# --- without a worker process --------------------------------------------------------


def test_async_handlers_are_told_apart_from_sync_ones():
    from tests.testapp import queues

    assert is_async(queues.async_sleep) and is_async(queues.mixed_async)
    assert not is_async(queues.mixed_sync) and not is_async(None)

    class Callable:
        async def __call__(self, message): ...

    assert is_async(Callable())


def test_decide_outside_a_worker_runs_an_async_handler_to_its_end():
    """Tests and the immediate mode call decide(): the handler runs on a loop of its own, ORM calls included."""
    message = django_dbqueue.enqueue("a-outcomes", {"action": "progress"})
    claimed = Message.objects.claim(["a-outcomes"], 1)[0]
    verdict = decide(claimed)
    assert verdict.outcome == HandlerOutcome.ACKED and verdict.result == {"seen": True}
    assert verdict.record() == HandlerOutcome.ACKED
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.progress == {"done": 1, "total": 2, "note": "half"} and row.meta == {"step": "one"}


def test_a_sync_handler_that_returns_a_coroutine_fails_saying_so():
    async def forgot(message): ...

    django_dbqueue.enqueue("a-plain", {})
    claimed = Message.objects.claim(["a-plain"], 1)[0]
    verdict = decide(claimed, handler=lambda message: forgot(message))
    assert verdict.outcome == HandlerOutcome.FAILED
    assert "declare it with async def" in str(verdict.error)


def test_a_cancel_asked_before_an_async_handler_starts_cancels_it_unrun():
    from django_dbqueue.running import adecide

    django_dbqueue.enqueue("a-sleep", {"sleep": 30})
    claimed = Message.objects.claim(["a-sleep"], 1)[0]
    claimed.heard_cancel()
    verdict = asyncio.run(adecide(claimed))
    assert verdict.outcome == HandlerOutcome.CANCELLED


def test_the_worker_splits_its_queues_between_the_loop_and_the_threads():
    worker = QueueWorker(WorkerConfig(queues=["a-sleep", "w-ok", "a-mixed"]))
    assert worker.async_queues == ["a-sleep"]
    assert worker.sync_queues == ["w-ok", "a-mixed"]  # a mixed queue: threads claim, async kinds run on the loop
    assert worker.event_loop is not None
    assert worker.async_description() == "100 at once on one event loop; queues a-sleep"
    assert QueueWorker(WorkerConfig(queues=["w-ok"])).event_loop is None


def test_a_queue_with_sync_and_async_handlers_is_warned_about_at_start(caplog):
    mixed = QueueWorker(WorkerConfig(queues=["a-sleep", "w-ok", "a-mixed"], concurrency=2, async_concurrency=50))
    mixed.log_banner()
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "queue a-mixed has sync and async def handlers" in warning.getMessage()
    assert "at most --concurrency (2) at once, not --async-concurrency (50)" in warning.getMessage()
    assert "a queue of their own" in warning.getMessage()
    caplog.clear()
    QueueWorker(WorkerConfig(queues=["a-sleep", "w-ok"], async_timeout=5)).log_banner()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_an_async_timeout_without_async_handlers_is_warned_about_at_start(caplog):
    QueueWorker(WorkerConfig(queues=["w-ok"], async_timeout=5)).log_banner()
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "--async-timeout applies to async def handlers, and no queue it serves has one" in warning.getMessage()


def test_command_rejects_a_bad_async_concurrency():
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=r"async.concurrency"):
        call_command("runqueueworker", "a-sleep", "--async-concurrency", "0")


# --- real worker processes -----------------------------------------------------------


def test_many_async_messages_run_once_with_far_more_in_flight_than_threads(workers):
    ids = [m.pk for m in django_dbqueue.enqueue_many("a-sleep", [{"sleep": 0.5}] * 300)]
    worker = workers.start("a-sleep", "--until-empty", "--async-concurrency", "100", "--no-schedules", "-v", "0")
    status, output = workers.finish(worker)
    assert status == ExitStatus.OK, output
    rows = archived(ids)
    assert len(rows) == 300 and {row.outcome for row in rows.values()} == {Outcome.ACKED}
    assert not Message.objects.filter(queue="a-sleep").exists()
    assert set(workers.starts().values()) == {1}  # each handler ran once
    # One consumer thread and one loop: yet dozens ran at once.
    assert max(row.result["in_flight"] for row in rows.values()) >= 50


@pytest.mark.slow
def test_cancel_of_a_running_async_handler_is_asyncio_cancellation(workers):
    message = django_dbqueue.enqueue("a-sleep", {"sleep": 60})
    worker = workers.start("a-sleep", "--no-schedules")
    wait_for(lambda: workers.starts()[message.pk], timeout=30, what="the handler to start")
    assert django_dbqueue.cancel(message.pk) == django_dbqueue.CancelResult.REQUESTED
    row = wait_for(lambda: ArchivedMessage.objects.filter(message_id=message.pk).first(), timeout=30, what="archive")
    assert row.outcome == Outcome.CANCELLED and "asyncio cancellation" in row.last_error
    worker.send_signal(signal.SIGTERM)
    status, output = workers.finish(worker)
    assert status == ExitStatus.OK, output


def test_an_async_handler_past_its_timeout_is_cancelled_and_fails(workers):
    message = django_dbqueue.enqueue("a-sleep", {"sleep": 60}, max_attempts=1)
    worker = workers.start("a-sleep", "--until-empty", "--async-timeout", "0.5", "--no-schedules")
    status, output = workers.finish(worker)
    assert status == ExitStatus.OK, output
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.DEAD
    assert "HandlerTimeout" in row.last_error and "longer than 0.5s" in row.last_error


@pytest.mark.slow
def test_async_outcomes_retries_dead_letters_progress_and_a_blocked_loop(workers):
    """MAX_ATTEMPTS 2 and no backoff on a-outcomes (tests/settings.py)."""
    failing = django_dbqueue.enqueue("a-outcomes", {"action": "raise"})
    rejected = django_dbqueue.enqueue("a-outcomes", {"action": "reject"})
    reporting = django_dbqueue.enqueue("a-outcomes", {"action": "progress"})
    blocking = django_dbqueue.enqueue("a-outcomes", {"action": "block", "sleep": 2.0})
    worker = workers.start("a-outcomes", "--until-empty", "--no-schedules")
    status, output = workers.finish(worker)
    assert status == ExitStatus.OK, output
    rows = archived([failing.pk, rejected.pk, reporting.pk, blocking.pk])
    assert rows[failing.pk].outcome == Outcome.DEAD and rows[failing.pk].attempts == 2
    assert "asked to fail" in rows[failing.pk].last_error
    assert workers.starts()[failing.pk] == 2  # retried once, then dead
    assert rows[rejected.pk].outcome == Outcome.DEAD and rows[rejected.pk].attempts == 1
    assert rows[reporting.pk].outcome == Outcome.ACKED and rows[reporting.pk].result == {"seen": True}
    assert rows[reporting.pk].progress == {"done": 1, "total": 2, "note": "half"}
    assert rows[blocking.pk].outcome == Outcome.ACKED
    assert "the event loop has been blocked" in output and f"message {blocking.pk}" in output


@pytest.mark.slow
def test_the_heartbeat_extends_a_running_async_handler_s_lease_and_writes_its_progress(workers):
    """A lease of 5 s and a handler of 12 s: without the heartbeat the second worker would claim it again."""
    message = django_dbqueue.enqueue("a-outcomes", {"action": "progress", "sleep": 12})
    first = workers.start("a-outcomes", "--visibility-timeout", "5", "--no-schedules")
    wait_for(lambda: workers.starts()[message.pk], timeout=30, what="the handler to start")
    claimed = Message.objects.get(pk=message.pk)
    second = workers.start("a-outcomes", "--visibility-timeout", "5", "--no-schedules")
    # Its progress, reported as it began, reaches the row while it runs; its lease moves on.
    running = wait_for(
        lambda: (
            (row := Message.objects.filter(pk=message.pk).first())
            and row.progress == {"done": 1, "total": 2, "note": "half"}
            and row.available_at > claimed.available_at
            and row
        ),
        timeout=30,
        what="a heartbeat to write its progress and extend its lease",
    )
    assert running.meta == {"step": "one"} and running.lease_token == claimed.lease_token
    row = wait_for(lambda: ArchivedMessage.objects.filter(message_id=message.pk).first(), timeout=60, what="ack")
    assert row.outcome == Outcome.ACKED and row.attempts == 1
    assert workers.starts()[message.pk] == 1  # the second worker never got it
    for worker in (first, second):
        worker.send_signal(signal.SIGTERM)
        status, output = workers.finish(worker)
        assert status == ExitStatus.OK, output


def test_sync_and_async_handlers_serve_one_worker_at_once(workers):
    plain = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(20)])]
    waiting = [m.pk for m in django_dbqueue.enqueue_many("a-sleep", [{"sleep": 0.2}] * 20)]
    mixed_sync = [m.pk for m in django_dbqueue.enqueue_many("a-mixed", [{}] * 10, kind="sync")]
    mixed_async = [m.pk for m in django_dbqueue.enqueue_many("a-mixed", [{}] * 10, kind="async")]
    worker = workers.start("w-ok", "a-sleep", "a-mixed", "--until-empty", "--concurrency", "2", "--no-schedules")
    status, output = workers.finish(worker)
    assert status == ExitStatus.OK, output
    rows = archived(plain + waiting + mixed_sync + mixed_async)
    assert len(rows) == 60 and {row.outcome for row in rows.values()} == {Outcome.ACKED}
    assert {rows[pk].result["how"] for pk in mixed_sync} == {"sync"}
    assert {rows[pk].result["how"] for pk in mixed_async} == {"async"}


def test_sigterm_lets_running_async_handlers_finish_and_leaves_the_rest_ready(workers):
    ids = [m.pk for m in django_dbqueue.enqueue_many("a-sleep", [{"sleep": 2}] * 30)]
    worker = workers.start("a-sleep", "--async-concurrency", "10", "--grace", "30", "--no-schedules")
    wait_for(lambda: len(workers.starts()) == 10, timeout=30, what="ten handlers to start")
    worker.send_signal(signal.SIGTERM)
    status, output = workers.finish(worker)
    assert status == ExitStatus.OK, output
    started = workers.starts()
    assert len(started) == 10 and set(started.values()) == {1}
    rows = archived(ids)
    assert set(rows) == set(started) and {row.outcome for row in rows.values()} == {Outcome.ACKED}
    left = Message.objects.filter(queue="a-sleep")
    assert left.count() == 20 and not left.filter(lease_token__isnull=False).exclude(lease_token="").exists()


@pytest.mark.slow
def test_a_killed_worker_s_async_messages_come_back_by_lease_and_run_again(workers):
    ids = [m.pk for m in django_dbqueue.enqueue_many("a-sleep", [{"sleep": 60, "first_only": True}] * 10)]
    first = workers.start("a-sleep", "--visibility-timeout", "2", "--no-schedules")
    wait_for(lambda: len(workers.starts()) == 10, timeout=30, what="the handlers to start")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    second = workers.start("a-sleep", "--no-schedules")
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=ids).count() == 10, timeout=60, what="reruns")
    second.send_signal(signal.SIGTERM)
    status, output = workers.finish(second)
    assert status == ExitStatus.OK, output
    rows = archived(ids)
    assert {row.outcome for row in rows.values()} == {Outcome.ACKED}
    assert {row.attempts for row in rows.values()} == {2}
    assert set(workers.starts().values()) == {2}


@pytest.mark.slow
def test_a_pool_runs_async_handlers_with_a_loop_in_each_child(workers):
    ids = [m.pk for m in django_dbqueue.enqueue_many("a-sleep", [{"sleep": 0.3}] * 200)]
    pool = workers.start("a-sleep", "--processes", "2", "--until-empty", "--async-concurrency", "50", "-v", "0")
    status, output = workers.finish(pool)
    assert status == ExitStatus.OK, output
    rows = archived(ids)
    assert len(rows) == 200 and {row.outcome for row in rows.values()} == {Outcome.ACKED}
    assert set(workers.starts().values()) == {1}
    assert len({row.result["pid"] for row in rows.values()}) == 2
