"""Enqueue from model saves and deletes: the transactional outbox."""

from decimal import Decimal

import pytest
from django.db import connections, transaction

from django_dbqueue import outbox, signals
from django_dbqueue.exceptions import InvalidOption, InvalidQueueName, PayloadNotSerializable, UnknownOption
from django_dbqueue.models import Message
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


@pytest.fixture
def rules():
    """Rules registered by a test are disconnected after it."""
    made = []

    def register(function, *args, **kwargs):
        rule = function(*args, **kwargs)
        made.append(rule)
        return rule

    yield register
    for rule in made:
        rule.disconnect()


def order_placed(rules, **extra):
    options = {
        "payload": lambda order: {"number": order.number, "total": str(order.total)},
        "key": lambda order: f"order-{order.pk}",
        "kind": "placed",
        "when": "created",
        **extra,
    }
    return rules(outbox.enqueue_on_save, Order, "ob-orders", **options)


def test_rolled_back_save_leaves_no_message_and_a_committed_one_exactly_one(rules):
    order_placed(rules)
    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(number="A-1", total=5)
        assert Message.objects.filter(queue="ob-orders").count() == 1  # written inside the save's transaction
        raise Rollback
    assert not Order.objects.exists() and not Message.objects.exists()

    with transaction.atomic():
        order = Order.objects.create(number="A-2", total="9.50")
    message = Message.objects.get()
    assert (message.queue, message.kind, message.key) == ("ob-orders", "placed", f"order-{order.pk}")
    assert message.payload == {"number": "A-2", "total": "9.50"}


def test_a_failing_enqueue_rolls_the_save_back(rules):
    """The same transaction both ways: when the message cannot be written, neither is the order."""
    rules(outbox.enqueue_on_save, Order, "ob-orders", payload=lambda order: {"total": order.total})  # a Decimal
    with pytest.raises(PayloadNotSerializable, match="payload\\['total'\\] is of type Decimal"), transaction.atomic():
        Order.objects.create(number="A-3", total=Decimal("1.50"))
    assert not Order.objects.exists() and not Message.objects.exists()


def test_when_filters_saves(rules):
    order_placed(rules)
    rules(
        outbox.enqueue_on_save,
        Order,
        "ob-changes",
        payload=lambda order: {"number": order.number},
        when="updated",
    )
    rules(
        outbox.enqueue_on_save,
        Order,
        "ob-big",
        payload={"big": True},
        when=lambda order, created: order.total >= 100,
    )
    order = Order.objects.create(number="A-4", total=10)
    order.total = 150
    order.save()
    order.save()
    counts = dict.fromkeys(["ob-orders", "ob-changes", "ob-big"], 0)
    for queue in Message.objects.values_list("queue", flat=True):
        counts[queue] += 1
    assert counts == {"ob-orders": 1, "ob-changes": 2, "ob-big": 2}


def test_the_key_deduplicates_saves_while_the_message_is_live(rules):
    rules(
        outbox.enqueue_on_save,
        Order,
        "ob-sync",
        payload=lambda order: {"id": order.pk},
        key=lambda order: f"sync-{order.pk}",
    )
    order = Order.objects.create(number="A-5")
    order.save()
    order.save()
    assert Message.objects.filter(queue="ob-sync").count() == 1


def test_delete_twin_commits_and_rolls_back_with_the_delete(rules):
    rules(
        outbox.enqueue_on_delete,
        Order,
        "ob-deleted",
        payload=lambda order: {"number": order.number, "id": order.pk},
        kind="deleted",
    )
    orders = [Order.objects.create(number=f"D-{n}") for n in range(3)]
    with pytest.raises(Rollback), transaction.atomic():
        orders[0].delete()
        raise Rollback
    assert not Message.objects.exists() and Order.objects.count() == 3
    first_pk = orders[1].pk
    Order.objects.get(number="D-0").delete()  # no atomic() of ours: Django deletes in a transaction anyway
    Order.objects.filter(number__in=["D-1", "D-2"]).delete()  # a queryset delete sends post_delete per row
    payloads = sorted(m.payload["number"] for m in Message.objects.filter(queue="ob-deleted", kind="deleted"))
    assert payloads == ["D-0", "D-1", "D-2"]
    assert Message.objects.filter(payload__id=first_pk).count() == 1


def test_bulk_create_and_update_send_no_post_save_so_enqueue_saved_does_it(rules):
    order_placed(rules)
    with transaction.atomic():
        orders = Order.objects.bulk_create([Order(number=f"B-{n}", total=n) for n in range(3)])
        assert not Message.objects.exists()  # bulk_create sends no post_save
        written = outbox.enqueue_saved(orders, created=True)
    assert len(written) == 3
    stored = Message.objects.order_by("payload__number")
    assert [m.payload["number"] for m in stored] == ["B-0", "B-1", "B-2"]
    assert {m.key for m in stored} == {f"order-{o.pk}" for o in orders}

    with pytest.raises(Rollback), transaction.atomic():
        more = Order.objects.bulk_create([Order(number="B-9")])
        outbox.enqueue_saved(more, created=True)
        raise Rollback
    assert Message.objects.count() == 3

    Order.objects.filter(number="B-1").update(total=42)  # update() sends no post_save either
    assert outbox.enqueue_saved(Order.objects.filter(number="B-1"), created=False) == []  # "created" rule only


def test_publish_on_save_fans_out_in_the_same_transaction(rules):
    rules(
        outbox.publish_on_save,
        Order,
        "t-orders",
        payload=lambda order: {"number": order.number},
        kind="placed",
        when="created",
    )
    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(number="P-1")
        raise Rollback
    assert not Message.objects.exists()
    Order.objects.create(number="P-2")
    copies = sorted(Message.objects.values_list("queue", "kind", "payload"))
    assert copies == [("t-email", "placed", {"number": "P-2"}), ("t-invoicing", "placed", {"number": "P-2"})]


@pytest.mark.django_db(transaction=True, databases=["default", "queues"])
def test_a_queue_on_another_database_is_written_on_commit(rules):
    """Queue 'elsewhere' lives on alias 'queues': its own connection, its own transaction."""
    heard = []
    signals.message_enqueued.connect(lambda sender, **kw: heard.append(kw), weak=False, dispatch_uid="t-ob")
    try:
        rules(outbox.enqueue_on_save, Order, "elsewhere", payload=lambda order: {"number": order.number})
        with pytest.raises(Rollback), transaction.atomic():
            Order.objects.create(number="E-1")
            assert not Message.objects.using("queues").exists()  # not yet: only on commit
            raise Rollback
        assert not Message.objects.using("queues").exists()

        with transaction.atomic():
            Order.objects.create(number="E-2")
            assert not Message.objects.using("queues").exists()
        message = Message.objects.using("queues").get()
        assert message.payload == {"number": "E-2"} and message.queue == "elsewhere"
        assert [event["using"] for event in heard] == ["queues"]
        assert not connections["queues"].in_atomic_block
    finally:
        signals.message_enqueued.disconnect(dispatch_uid="t-ob")


def test_loaddata_saves_are_not_business_events(rules):
    order_placed(rules, when=None)
    order = Order(number="R-1")
    order.save_base(raw=True)
    assert Order.objects.count() == 1 and not Message.objects.exists()


def test_registering_again_replaces_the_rule(rules):
    order_placed(rules)
    order_placed(rules, kind="placed-v2")
    Order.objects.create(number="X-1")
    assert list(Message.objects.values_list("kind", flat=True)) == ["placed-v2"]
    assert len(outbox.rules_for(Order)) == 1


@pytest.mark.parametrize(
    ("function", "args", "kwargs", "error", "words"),
    [
        (outbox.enqueue_on_save, (Order, "bad queue"), {"payload": {}}, InvalidQueueName, "may only hold"),
        (outbox.publish_on_save, (Order, ""), {"payload": {}}, InvalidQueueName, "a topic name must not be empty"),
        (outbox.enqueue_on_save, ("testapp.Nope", "q"), {"payload": {}}, InvalidOption, "no model 'testapp.Nope'"),
        (outbox.enqueue_on_save, (object, "q"), {"payload": {}}, InvalidOption, "must be a Django model class"),
        (outbox.enqueue_on_save, (Order, "q"), {"payload": {"x": {1}}}, PayloadNotSerializable, "payload['x']"),
        (outbox.enqueue_on_save, (Order, "q"), {"payload": {}, "priorty": 1}, UnknownOption, "'priorty'"),
        (outbox.enqueue_on_save, (Order, "q"), {"payload": {}, "when": "always"}, InvalidOption, "when must be"),
        (outbox.enqueue_on_delete, (Order, "q"), {"payload": {}, "when": "created"}, InvalidOption, "when must be"),
        (outbox.enqueue_on_save, (Order, "q"), {"payload": {}, "kind": 5}, InvalidOption, "kind must be a string"),
        (outbox.enqueue_on_save, (Order, "q"), {"payload": {}, "key": ""}, InvalidOption, "key must be"),
    ],
)
def test_bad_rules_are_refused_and_connect_nothing(function, args, kwargs, error, words):
    with pytest.raises(error) as caught:
        function(*args, **kwargs)
    assert words in str(caught.value)
    assert outbox.rules_for(Order) == [] and outbox.rules_for(Order, "delete") == []
    Order.objects.create(number="N-1")
    assert not Message.objects.exists()


def test_a_model_label_works_like_the_class(rules):
    rules(outbox.enqueue_on_save, "testapp.Order", "ob-label", payload=lambda order: {"n": order.number})
    Order.objects.create(number="L-1")
    assert Message.objects.get().payload == {"n": "L-1"}
