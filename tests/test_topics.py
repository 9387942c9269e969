"""Topics: a copy per subscribed queue, from the setting and the table, in one transaction."""

import pytest
from django.core.exceptions import ValidationError
from django.db import transaction

import django_dbqueue
from django_dbqueue.exceptions import InvalidOption, InvalidQueueName, PayloadNotSerializable, UnknownOption
from django_dbqueue.models import ArchivedMessage, Message, Subscription

pytestmark = pytest.mark.django_db(transaction=True)


def test_subscribers_come_from_the_setting_and_the_table():
    assert django_dbqueue.subscribers("t-orders") == ["t-email", "t-invoicing"]
    django_dbqueue.subscribe("t-orders", "t-audit")
    django_dbqueue.subscribe("t-orders", "t-audit")  # idempotent
    django_dbqueue.subscribe("t-orders", "t-email")  # in both: one copy
    assert django_dbqueue.subscribers("t-orders") == ["t-audit", "t-email", "t-invoicing"]
    assert Subscription.objects.count() == 2
    assert django_dbqueue.unsubscribe("t-orders", "t-audit") is True
    assert django_dbqueue.unsubscribe("t-orders", "t-audit") is False
    assert django_dbqueue.subscribers("t-orders") == ["t-email", "t-invoicing"]
    assert django_dbqueue.subscribers("nobody-listens") == []


def test_publish_writes_one_copy_per_subscribed_queue():
    django_dbqueue.subscribe("t-orders", "t-audit")
    django_dbqueue.subscribe("t-orders", "t-email")
    copies = django_dbqueue.publish("t-orders", {"order": 7}, kind="placed", headers={"by": "shop"}, priority=-1)
    assert sorted(m.queue for m in copies) == ["t-audit", "t-email", "t-invoicing"]
    stored = Message.objects.order_by("queue")
    assert [m.queue for m in stored] == ["t-audit", "t-email", "t-invoicing"]
    assert all(m.payload == {"order": 7} and m.kind == "placed" and m.priority == -1 for m in stored)
    assert all(m.headers == {"by": "shop", "topic": "t-orders"} for m in stored)
    assert len({m.pk for m in stored}) == 3


def test_consumers_compete_inside_each_queue_but_every_queue_gets_every_message():
    for n in range(4):
        django_dbqueue.publish("t-orders", {"n": n})
    got = {}
    for queue in ("t-email", "t-invoicing"):
        first = django_dbqueue.claim(queue, 2, worker=f"{queue}-a")
        second = django_dbqueue.claim(queue, 5, worker=f"{queue}-b")
        assert not {m.pk for m in first} & {m.pk for m in second}
        got[queue] = sorted(m.payload["n"] for m in first + second)
        django_dbqueue.ack_many(first + second)
    assert got == {"t-email": [0, 1, 2, 3], "t-invoicing": [0, 1, 2, 3]}
    assert ArchivedMessage.objects.acked().count() == 8


def test_a_publication_is_one_transaction():
    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        django_dbqueue.publish("t-orders", {"n": 1})
        assert Message.objects.count() == 2
        raise Rollback
    assert not Message.objects.exists()


def test_keyed_publication_is_deduplicated_per_queue():
    django_dbqueue.enqueue("t-email", {"old": True}, key="order-7")
    copies = django_dbqueue.publish("t-orders", {"new": True}, key="order-7")
    by_queue = {m.queue: m for m in copies}
    assert by_queue["t-email"].payload == {"old": True} and not by_queue["t-email"].was_created
    assert by_queue["t-invoicing"].payload == {"new": True} and by_queue["t-invoicing"].was_created
    assert Message.objects.count() == 2


def test_no_subscribers_writes_nothing():
    assert django_dbqueue.publish("nobody-listens", {"n": 1}) == []
    assert not Message.objects.exists()


@pytest.mark.parametrize(
    ("topic", "payload", "options", "error", "words"),
    [
        ("bad topic", {}, {}, InvalidQueueName, "topic name 'bad topic' may only hold"),
        ("", {}, {}, InvalidQueueName, "a topic name must not be empty"),
        ("t-orders", {"x": {1}}, {}, PayloadNotSerializable, "payload['x']"),
        ("t-orders", {}, {"priority": "high"}, InvalidOption, "priority must be an integer"),
        ("t-orders", {}, {"prio": 1}, UnknownOption, "'prio'"),
        ("t-orders", {}, {"headers": [1]}, PayloadNotSerializable, "headers must be a dict"),
        ("nobody-listens", None, {}, PayloadNotSerializable, "payload is None"),
    ],
)
def test_bad_publications_are_refused_and_write_nothing(topic, payload, options, error, words):
    with pytest.raises(error) as caught:
        django_dbqueue.publish(topic, payload, **options)
    assert words in str(caught.value)
    assert not Message.objects.exists()


def test_subscribers_on_different_databases_are_refused(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "TOPICS": {"split": ["t-email", "elsewhere"]}}
    with pytest.raises(InvalidOption, match=r"different databases .*'elsewhere' on 'queues'"):
        django_dbqueue.publish("split", {})
    assert not Message.objects.exists()


def test_subscription_rows_validate_their_names():
    with pytest.raises(InvalidQueueName, match="topic name"):
        django_dbqueue.subscribe("bad topic", "q")
    with pytest.raises(InvalidQueueName, match="queue name"):
        django_dbqueue.subscribe("t", "bad queue")
    with pytest.raises(ValidationError) as caught:
        Subscription(topic="bad topic", queue="-bad").full_clean()
    assert set(caught.value.message_dict) == {"topic", "queue"}
    assert not Subscription.objects.exists()


def test_subscriptions_in_the_admin(admin_client):
    django_dbqueue.subscribe("t-orders", "t-email")
    django_dbqueue.subscribe("t-orders", "t-audit")
    page = admin_client.get("/admin/django_dbqueue/subscription/")
    assert page.status_code == 200
    assert page.content.count(b"t-orders") >= 2 and b"in topics setting" in page.content.lower()
    response = admin_client.post("/admin/django_dbqueue/subscription/add/", {"topic": "t-orders", "queue": "has space"})
    assert response.status_code == 200 and b"may only hold" in response.content
    admin_client.post("/admin/django_dbqueue/subscription/add/", {"topic": "t-orders", "queue": "t-new"})
    assert "t-new" in django_dbqueue.subscribers("t-orders")
