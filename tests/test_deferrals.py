"""Bounded deferrals: a message counts how often it was put off, and dies past its queue's MAX_DEFERRALS."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

import django_dbqueue
from django_dbqueue import handlers
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.running import HandlerOutcome, process
from django_dbqueue.worker import ExitStatus
from tests.support.admin_helpers import staff
from tests.support.processes import start_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def always_defers():
    """A handler for queue "jobs" that puts every message off by a day."""

    @handlers.handler("jobs")
    def defer(message):
        raise django_dbqueue.Defer(delay=timedelta(days=1))

    yield defer
    handlers.unregister("jobs", None)


def claim(queue="jobs"):
    [message] = Message.objects.claim(queue)
    return message


def make_ready(message):
    """A deferred message ready again now, as if its day had passed."""
    assert Message.objects.run_now(message.pk)


def test_each_snooze_counts_a_deferral_and_no_attempt():
    message = django_dbqueue.enqueue("jobs", {})
    for n in (1, 2, 3):
        assert claim().snooze(delay=0)
        stored = Message.objects.get(pk=message.pk)
        assert (stored.deferrals, stored.attempts) == (n, 0)


def test_defer_past_the_cap_dead_letters_with_a_reason(settings, always_defers):
    settings.DBQUEUE = {"QUEUES": {"jobs": {"MAX_DEFERRALS": 2}}}
    message = django_dbqueue.enqueue("jobs", {"n": 1})
    assert process(claim()) == HandlerOutcome.DEFERRED
    make_ready(message)
    assert process(claim()) == HandlerOutcome.DEFERRED
    make_ready(message)
    assert process(claim()) == HandlerOutcome.REJECTED
    assert not Message.objects.exists()
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.DEAD and row.deferrals == 2 and row.attempts == 1
    assert row.last_error == "deferred 2 times; the queue's MAX_DEFERRALS is 2"


def test_the_cap_is_per_queue(settings, always_defers):
    settings.DBQUEUE = {"MAX_DEFERRALS": 1, "QUEUES": {"other": {"MAX_DEFERRALS": 5}}}
    django_dbqueue.enqueue("jobs", {})
    other = django_dbqueue.enqueue("other", {})
    assert process(claim()) == HandlerOutcome.DEFERRED
    Message.objects.filter(queue="jobs").update(available_at=timezone.now() - timedelta(seconds=1))
    assert process(claim()) == HandlerOutcome.REJECTED
    for _ in range(5):
        assert claim("other").snooze(delay=0)
    sixth = claim("other")
    assert sixth.snooze(delay=0)  # the sixth deferral is refused: dead instead
    row = ArchivedMessage.objects.get(message_id=other.pk)
    assert row.outcome == Outcome.DEAD and row.deferrals == 5
    assert "the queue's MAX_DEFERRALS is 5" in row.last_error


def test_zero_allows_no_deferral(settings):
    settings.DBQUEUE = {"MAX_DEFERRALS": 0}
    message = django_dbqueue.enqueue("jobs", {})
    assert claim().snooze(until=timezone.now() + timedelta(hours=1))
    row = ArchivedMessage.objects.dead().get(message_id=message.pk)
    assert row.last_error == "deferred 0 times; the queue's MAX_DEFERRALS is 0"


def test_the_count_is_kept_in_the_archive_by_every_ack():
    one = django_dbqueue.enqueue("jobs", {"n": 1})
    many = django_dbqueue.enqueue("batch", {"n": 2})
    for _ in range(3):
        assert claim().snooze(delay=0)
        assert claim("batch").snooze(delay=0)
    assert claim().ack()  # one message: the archive row is built in Python
    assert Message.objects.ack_many([claim("batch")]) == [True]  # a batch: copied inside the database
    assert ArchivedMessage.objects.get(message_id=one.pk).deferrals == 3
    assert ArchivedMessage.objects.get(message_id=many.pk).deferrals == 3


def test_a_replay_starts_counting_again(settings):
    settings.DBQUEUE = {"MAX_DEFERRALS": 0}
    django_dbqueue.enqueue("jobs", {})
    claim().snooze(delay=0)
    row = ArchivedMessage.objects.dead().get()
    replayed = django_dbqueue.replay(row)
    assert Message.objects.get(pk=replayed.pk).deferrals == 0


def test_waiting_for_a_handler_is_not_a_deferral(settings):
    settings.DBQUEUE = {"MAX_DEFERRALS": 0, "QUEUES": {"jobs": {"UNHANDLED": "keep"}}}
    django_dbqueue.enqueue("jobs", {}, kind="nobody-handles-this")
    assert process(claim()) == HandlerOutcome.UNHANDLED
    kept = Message.objects.get()
    assert kept.deferrals == 0 and kept.lease_token is None


def test_the_admin_shows_the_count(client):
    django_dbqueue.enqueue("jobs", {})
    for _ in range(7):
        claim().snooze(delay=0)
    live = Message.objects.get()
    client.force_login(staff("viewer", "view_message", "view_archivedmessage"))
    page = client.get(reverse("admin:django_dbqueue_message_change", args=[live.pk])).content.decode()
    assert "Deferrals" in page and ">7<" in page
    claim().ack()
    row = ArchivedMessage.objects.get()
    page = client.get(reverse("admin:django_dbqueue_archivedmessage_change", args=[row.pk])).content.decode()
    assert "Deferrals" in page and ">7<" in page


@pytest.mark.slow
def test_a_worker_process_dead_letters_a_message_that_always_defers():
    """A real worker: the default cap (100) ends a handler that defers for ever."""
    message = django_dbqueue.enqueue("w-defer-always", {})
    worker = start_worker("w-defer-always", "--until-empty")
    _, err = worker.communicate(timeout=120)
    assert worker.returncode == ExitStatus.OK, err
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.DEAD and row.deferrals == 100 and row.attempts == 1
    assert row.last_error == "deferred 100 times; the queue's MAX_DEFERRALS is 100"
