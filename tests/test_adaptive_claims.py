"""Adaptive claiming, the worker's default (worker/sizing.py, docs/workers.md "Adaptive claiming")."""

import signal
import threading
from types import SimpleNamespace

import pytest
from django.db import OperationalError, transaction
from hypothesis import given
from hypothesis import strategies as st

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.models.messages import MessageQuerySet
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from django_dbqueue.worker.ledger import Ledger
from django_dbqueue.worker.sizing import BATCH_BUDGET, MAX_BATCH, ClaimSizer, give_back, stays_in_batch
from tests.support.processes import read_marks, start_worker, wait_for

# --- the size, in plain Python ------------------------------------------------------------------------


def test_the_size_starts_at_one_grows_for_short_handlers_and_falls_for_a_slow_one():
    sizer = ClaimSizer(None)
    assert sizer.adaptive and sizer.size() == 1  # nothing seen yet: as --batch-size 1
    for _ in range(30):
        sizer.ran(0.001)
    assert sizer.size() == MAX_BATCH
    sizer.ran(2.0)
    assert sizer.size() == 1  # one slow handler is enough to claim one at a time
    sizer.ran(0.001)
    assert sizer.size() == 1  # and a single short one is not enough to batch again
    for _ in range(30):
        sizer.ran(0.001)
    assert sizer.size() == MAX_BATCH


def test_a_fixed_batch_size_and_single_attempt_queues_are_not_adapted():
    fixed = ClaimSizer(7)
    fixed.ran(0.0001)
    assert not fixed.adaptive and fixed.size() == 7
    single = ClaimSizer(None, one_at_a_time=True)
    for _ in range(10):
        single.ran(0.0001)
    assert single.size() == 1


@given(st.lists(st.floats(min_value=0, max_value=60, allow_nan=False), max_size=50))
def test_the_size_stays_within_bounds_and_within_the_budget(durations):
    """Against the docs' rule: between 1 and MAX_BATCH, and more than one only if that many fit the budget."""
    sizer = ClaimSizer(None)
    for seconds in durations:
        sizer.ran(seconds)
        size = sizer.size()
        assert 1 <= size <= MAX_BATCH
        if size > 1:
            assert size * sizer.average <= BATCH_BUDGET * (1 + 1e-9)


def test_a_message_on_its_last_attempt_does_not_stay_a_batch_mate():
    message = Message(queue="a-any", attempts=1, max_attempts=3)
    assert stays_in_batch(message)
    message.attempts = 3
    assert not stays_in_batch(message)


def test_the_ledger_gives_up_only_what_waits_behind_a_long_handler():
    ledger = Ledger()
    m = [SimpleNamespace(pk=n) for n in range(7)]
    ledger.claimed("a", m[0:3])
    ledger.claimed("b", m[3:5])
    ledger.claimed("c", m[5:7])
    assert ledger.start("a") is m[0] and ledger.start("b") is m[3]  # c claimed, runs nothing yet
    assert ledger.take_behind_long(60) == []
    threading.Event().wait(0.05)
    taken = ledger.take_behind_long(0.01)
    assert [x.pk for x in taken] == [1, 2, 4]
    ledger.finish("a", ok=True)
    assert ledger.start("a") is None  # its batch-mates are gone from the ledger
    assert ledger.start("c") is m[5]  # c started only now: not long yet
    assert ledger.take_behind_long(1.0) == []


# --- a real worker, on the database -------------------------------------------------------------------


on_database = pytest.mark.django_db(transaction=True)


def noop(message):
    pass


@on_database
def test_a_flood_of_short_jobs_is_claimed_in_batches(monkeypatch):
    sizes = []
    claim = MessageQuerySet.claim

    def counting(self, queues, limit=1, **kwargs):
        sizes.append(limit)
        return claim(self, queues, limit, **kwargs)

    monkeypatch.setattr(MessageQuerySet, "claim", counting)
    django_dbqueue.enqueue_many("a-flood", [{}] * 300)
    assert QueueWorker(WorkerConfig(queues=["a-flood"], until_empty=True, handler=noop)).run() == ExitStatus.OK
    assert ArchivedMessage.objects.filter(queue="a-flood", outcome=Outcome.ACKED).count() == 300
    assert sizes[0] == 1 and max(sizes) == MAX_BATCH
    assert len(sizes) < 300 / 5  # one claim per message would be 300


@on_database
def test_a_batch_mate_on_its_last_attempt_is_given_back_at_once_and_runs_first_next(monkeypatch):
    ids = [m.pk for m in django_dbqueue.enqueue_many("a-last", [{"n": n} for n in range(12)])]
    last = ids[2]
    Message.objects.filter(pk=last).update(attempts=2, max_attempts=3)  # its next claim is its last attempt
    worker = QueueWorker(WorkerConfig(queues=["a-last"], until_empty=True, handler=noop))
    consumer = worker.consumer(0, None)
    consumer.sizer.average = BATCH_BUDGET / 5  # as after a run of short handlers: claims of five
    given = []
    release = Message.release

    def recording(self):
        given.append(self.pk)
        return release(self)

    monkeypatch.setattr(Message, "release", recording)
    consumer.paused = SimpleNamespace(names=lambda: frozenset())
    claimed = consumer.claim()
    assert [m.pk for m in claimed] == [ids[0], ids[1], ids[3], ids[4]] and given == [last]
    back = Message.objects.get(pk=last)
    assert back.lease_token is None and back.attempts == 2  # its place and its attempts kept
    again = consumer.claim()
    # First of the next claim, ahead of the messages enqueued after it: kept there, and runs first.
    assert [m.pk for m in again] == [last, *ids[5:9]] and given == [last]


@on_database
@pytest.mark.slow
def test_short_jobs_behind_a_slow_one_are_given_back_and_run_elsewhere_while_it_runs(tmp_path):
    """Fairness: a slow handler never holds the short jobs claimed with it; they run on another worker."""
    marks = tmp_path / "marks"
    first = start_worker("w-slow", "-v2", marks=marks)
    warm = [m.pk for m in django_dbqueue.enqueue_many("w-slow", [{"sleep": 0}] * 60)]
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=warm).count() == 60, what="the warm-up")
    with transaction.atomic():  # one commit: the worker's next claim sees them all
        slow = django_dbqueue.enqueue("w-slow", {"sleep": 8}, priority=-1)
        short = [m.pk for m in django_dbqueue.enqueue_many("w-slow", [{"sleep": 0}] * 5)]
    wait_for(lambda: ("start", slow.pk, first.pid) in read_marks(marks), what="the slow one")
    wait_for(
        lambda: Message.objects.filter(pk__in=short, lease_token__isnull=True, attempts=0).count() == 5,
        timeout=5,
        what="its batch-mates to be given back",
    )
    second = start_worker("w-slow", marks=marks)
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=short).count() == 5, what="the short ones")
    assert not ArchivedMessage.objects.filter(message_id=slow.pk).exists()  # done while the slow one still runs
    assert all(pid == second.pid for event, pk, pid in read_marks(marks) if pk in short)
    for worker in (first, second):
        worker.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
    second.communicate(timeout=60)
    assert "gave back 5 message(s) waiting behind a handler" in err
    assert ArchivedMessage.objects.get(message_id=slow.pk).outcome == Outcome.ACKED


@on_database
def test_a_give_back_the_database_refuses_is_logged_and_the_lease_runs_out_instead(monkeypatch, caplog):
    django_dbqueue.enqueue_many("a-away", [{}] * 2)
    claimed = django_dbqueue.claim("a-away", 2, visibility_timeout=60)

    def away(self):
        raise OperationalError(2006, "MySQL server has gone away")

    monkeypatch.setattr(Message, "release", away)
    assert give_back(claimed, "w", "its batch-mate runs long") == claimed  # not given back: the caller keeps them
    assert "could not give message" in caplog.text and "gone away" in caplog.text
    assert Message.objects.filter(queue="a-away", lease_token__isnull=False).count() == 2  # held until the lease ends


@on_database
def test_a_last_attempt_batch_mate_the_database_will_not_take_back_stays_in_the_batch(monkeypatch, caplog):
    """Dropped from the batch while still leased, it would wait out its lease and be dead-lettered unrun."""
    django_dbqueue.enqueue_many("a-refused", [{"n": n} for n in range(3)])
    last = Message.objects.filter(queue="a-refused").order_by("id")[1]
    Message.objects.filter(pk=last.pk).update(attempts=2, max_attempts=3)
    consumer = QueueWorker(WorkerConfig(queues=["a-refused"], handler=noop)).consumer(0, None)
    consumer.paused = SimpleNamespace(names=lambda: frozenset())
    consumer.sizer.average = 0.001

    def away(self):
        raise OperationalError(2006, "MySQL server has gone away")

    monkeypatch.setattr(Message, "release", away)
    claimed = consumer.claim()
    assert last.pk in [m.pk for m in claimed] and len(claimed) == 3  # kept, to run in this batch
    assert "could not give message" in caplog.text


def test_rate_limited_and_single_attempt_queues_are_claimed_one_at_a_time(settings):
    queues = {"a-rated": {"RATE_LIMIT": "10/m"}, "a-once": {"MAX_ATTEMPTS": 1}, "a-plain": {}}
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": {**settings.DBQUEUE.get("QUEUES", {}), **queues}}
    for queue, batches in (("a-rated", False), ("a-once", False), ("a-plain", True)):
        consumer = QueueWorker(WorkerConfig(queues=[queue], handler=noop)).consumer(0, None)
        for _ in range(10):
            consumer.sizer.ran(0.001)
        assert (consumer.sizer.size() > 1) is batches, queue
