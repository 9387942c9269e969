from datetime import datetime, timedelta

import pytest
from django.db import transaction
from django.db.models.signals import post_save
from django.utils import timezone

import django_dbqueue
from django_dbqueue.db.clock import db_now
from django_dbqueue.models import Message

pytestmark = pytest.mark.django_db(transaction=True)


def test_enqueue_stores_every_field():
    message = django_dbqueue.enqueue(
        "emails",
        {"to": "a@example.com"},
        kind="welcome",
        headers={"correlation_id": "c1"},
        priority=-5,
        max_attempts=3,
    )
    stored = Message.objects.get(pk=message.pk)
    assert stored.payload == {"to": "a@example.com"}
    assert (stored.queue, stored.kind, stored.priority, stored.max_attempts) == ("emails", "welcome", -5, 3)
    assert stored.headers == {"correlation_id": "c1"}
    assert stored.attempts == 0 and stored.lease_token is None
    # The returned object carries the database-computed times, not expressions.
    assert message.created_at == stored.created_at
    assert message.available_at == stored.available_at == stored.first_available_at
    assert abs(stored.created_at - db_now("default")) < timedelta(seconds=5)


def test_manager_enqueue_is_the_same_operation():
    message = Message.objects.enqueue("emails", {"a": 1}, kind="k")
    assert Message.objects.get(pk=message.pk).kind == "k"


def test_delay_and_run_at_schedule_the_message():
    delayed = django_dbqueue.enqueue("q", {}, delay=timedelta(minutes=10))
    at = django_dbqueue.enqueue("q", {}, run_at=timezone.now() + timedelta(hours=1))
    now_ready = django_dbqueue.enqueue("q", {})
    assert set(Message.objects.scheduled().values_list("pk", flat=True)) == {delayed.pk, at.pk}
    assert list(Message.objects.ready().values_list("pk", flat=True)) == [now_ready.pk]
    assert delayed.available_at - delayed.created_at >= timedelta(minutes=9, seconds=59)


def test_key_deduplicates_live_messages():
    first = django_dbqueue.enqueue("q", {"v": 1}, key="order-1")
    again = django_dbqueue.enqueue("q", {"v": 2}, key="order-1")
    other_queue = django_dbqueue.enqueue("other", {"v": 3}, key="order-1")
    assert again.pk == first.pk and again.payload == {"v": 1}
    assert first.was_created and not again.was_created
    assert other_queue.pk != first.pk
    assert Message.objects.filter(queue="q").count() == 1


def test_key_is_free_again_once_the_message_finished():
    first = django_dbqueue.enqueue("q", {}, key="k")
    [claimed] = Message.objects.claim("q")
    assert claimed.ack()
    second = django_dbqueue.enqueue("q", {}, key="k")
    assert second.pk != first.pk and second.was_created


@pytest.mark.parametrize("key", [None, "k1"])
def test_a_message_taken_the_moment_it_is_written_is_enqueued_once(key):
    """A consumer may delete the row as soon as it exists (request/reply's requester does).

    enqueue() must not read the row back after inserting it: that read found
    nothing, the enqueue failed, and the handler that sent a reply ran and
    replied again. post_save fires right after the INSERT, so the receiver
    here plays a consumer that is that quick.
    """
    taken = []

    def take_at_once(sender, instance, created, **kwargs):
        taken.append(Message.objects.filter(pk=instance.pk).delete()[0])

    post_save.connect(take_at_once, sender=Message)
    try:
        message = django_dbqueue.enqueue("replies", {"n": 1}, key=key, delay=5)
    finally:
        post_save.disconnect(take_at_once, sender=Message)
    assert taken == [1] and not Message.objects.exists()
    assert message.pk is not None and message.was_created
    assert isinstance(message.created_at, datetime)
    assert message.available_at == message.first_available_at == message.created_at + timedelta(seconds=5)


def test_rollback_leaves_no_message():
    with pytest.raises(RuntimeError), transaction.atomic():
        django_dbqueue.enqueue("q", {"n": 1})
        django_dbqueue.enqueue_many("q", [{"n": 2}, {"n": 3}])
        raise RuntimeError("the business transaction failed")
    assert Message.objects.count() == 0


def test_commit_with_business_data_keeps_both():
    from tests.testapp.models import Order

    with transaction.atomic():
        order = Order.objects.create(number="A1")
        django_dbqueue.enqueue("orders", {"order": order.pk})
    assert Message.objects.get().payload == {"order": order.pk}


def test_enqueue_many_inserts_in_chunks_and_returns_messages(settings):
    settings.DBQUEUE = {"ENQUEUE_BATCH_SIZE": 7}
    messages = django_dbqueue.enqueue_many("bulk", [{"n": n} for n in range(30)], kind="k", priority=2)
    assert len(messages) == 30
    stored = Message.objects.filter(queue="bulk")
    assert stored.count() == 30
    assert sorted(m.payload["n"] for m in stored) == list(range(30))
    assert {m.kind for m in stored} == {"k"} and {m.priority for m in stored} == {2}
    if messages[0].pk is not None:  # MySQL (not MariaDB) returns no ids from bulk inserts
        assert sorted(m.pk for m in messages) == sorted(stored.values_list("pk", flat=True))


def test_enqueue_many_with_delay():
    django_dbqueue.enqueue_many("bulk", [{}, {}], delay=3600)
    assert Message.objects.scheduled().count() == 2


def test_enqueue_many_of_nothing():
    assert django_dbqueue.enqueue_many("bulk", []) == []
