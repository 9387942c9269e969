"""Every refused call names the problem and leaves both tables exactly as they were."""

import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest

import django_dbqueue
from django_dbqueue.exceptions import (
    InvalidOption,
    InvalidQueueName,
    NotClaimed,
    PayloadNotSerializable,
    UnknownOption,
)
from django_dbqueue.models import ArchivedMessage, Message

pytestmark = pytest.mark.django_db(transaction=True)

ENQUEUE_REFUSALS = [
    # (queue, payload, options, exception, words the message must contain)
    ("", {}, {}, InvalidQueueName, "must not be empty"),
    ("a" * 65, {}, {}, InvalidQueueName, "the limit is 64"),
    ("has space", {}, {}, InvalidQueueName, "may only hold"),
    ("émails", {}, {}, InvalidQueueName, "'émails' may only hold ASCII letters, digits"),
    ("-dash-first", {}, {}, InvalidQueueName, "start with a letter or digit"),
    (7, {}, {}, InvalidQueueName, "must be a string"),
    ("q", None, {}, PayloadNotSerializable, "pass {} for an empty payload"),
    ("q", {"when": datetime(2026, 1, 1)}, {}, PayloadNotSerializable, "payload['when'] is of type datetime"),
    ("q", {"price": Decimal("1.5")}, {}, PayloadNotSerializable, "payload['price'] is of type Decimal"),
    ("q", {"n": float("nan")}, {}, PayloadNotSerializable, "JSON cannot represent"),
    ("q", {1: "int key"}, {}, PayloadNotSerializable, "JSON object keys are strings"),
    ("q", [{"deep": [object()]}], {}, PayloadNotSerializable, "payload[0]['deep'][0]"),
    ("q", {}, {"headers": ["not", "a", "dict"]}, PayloadNotSerializable, "headers must be a dict"),
    ("q", {}, {"headers": {"at": datetime(2026, 1, 1)}}, PayloadNotSerializable, "headers['at']"),
    ("q", {}, {"kind": 3}, InvalidOption, "kind must be a string"),
    ("q", {}, {"kind": "k" * 101}, InvalidOption, "the limit is 100"),
    ("q", {}, {"key": ""}, InvalidOption, "key must be a non-empty string"),
    ("q", {}, {"key": "k" * 256}, InvalidOption, "the limit is 255"),
    ("q", {}, {"priority": 40000}, InvalidOption, "from -32768 to 32766"),
    ("q", {}, {"priority": 32767}, InvalidOption, "from -32768 to 32766"),  # flow control's: set aside
    ("q", {}, {"priority": "high"}, InvalidOption, "priority must be an integer"),
    ("q", {}, {"delay": -1}, InvalidOption, "delay must be >= 0"),
    ("q", {}, {"delay": "soon"}, InvalidOption, "delay must be a number of seconds"),
    ("q", {}, {"delay": 5, "run_at": datetime(2030, 1, 1).astimezone()}, InvalidOption, "not both"),
    ("q", {}, {"run_at": datetime(2030, 1, 1)}, InvalidOption, "run_at must be timezone-aware"),
    ("q", {}, {"expires_at": "tomorrow"}, InvalidOption, "expires_at must be a datetime"),
    ("q", {}, {"max_attempts": 0}, InvalidOption, "max_attempts must be an integer from 1"),
    # group, unique and debounce: docs/api.md's InvalidOption row names each.
    ("q", {}, {"group": ""}, InvalidOption, "group must be a non-empty string"),
    ("q", {}, {"group": 5}, InvalidOption, "group must be a non-empty string"),
    ("q", {}, {"group": "g" * 256}, InvalidOption, "group is 256 characters; the limit is 255"),
    ("q", {}, {"unique": "always", "key": "k"}, InvalidOption, 'unique must be "until-finished" or a timedelta'),
    ("q", {}, {"unique": timedelta(0), "key": "k"}, InvalidOption, "unique must be > 0 seconds"),
    ("q", {}, {"unique": timedelta(seconds=5)}, InvalidOption, "give key= as well"),
    ("q", {}, {"debounce": -1, "key": "k"}, InvalidOption, "debounce must be > 0 seconds"),
    ("q", {}, {"debounce": 5}, InvalidOption, "give key= as well"),
    ("q", {}, {"unique": timedelta(seconds=5), "debounce": 5, "key": "k"}, InvalidOption, "not both"),
    ("q", {}, {"debounce": 5, "key": "k", "delay": 3}, InvalidOption, "leave out delay and run_at"),
    ("q", {}, {"prioritty": 1}, UnknownOption, "unknown enqueue option(s) 'prioritty'"),
]


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        (
            datetime(2026, 11, 26, 2, 30, 1, 123456, tzinfo=UTC),
            "value.isoformat() and parse it back in the handler (datetime.fromisoformat)",
        ),
        (date(2026, 11, 26), "value.isoformat() and parse it back in the handler (date.fromisoformat)"),
        (time(2, 30), "value.isoformat() and parse it back in the handler (time.fromisoformat)"),
        (timedelta(minutes=5), "value.total_seconds()"),
        (Decimal("19.99"), "str(value)"),
        (uuid.UUID("12345678-1234-5678-1234-567812345678"), "str(value)"),
        ({1, 2}, "a list"),
        (b"raw", "value.decode()"),
        (Fraction(1, 3), "convert it to JSON first: a dict of its fields, str(value), or its id"),
        (object(), "convert it to JSON first"),
    ],
)
def test_a_value_json_cannot_hold_names_the_fix_and_is_not_cut_mid_word(unchanged, value, fix):
    with pytest.raises(PayloadNotSerializable) as caught:
        django_dbqueue.enqueue("q", {"at": value})
    text = str(caught.value)
    assert f"payload['at'] is of type {type(value).__name__} ({value!r})" in text  # the whole repr, not cut
    assert fix in text


def test_a_model_instance_in_a_payload_says_to_pass_its_primary_key(unchanged):
    from tests.testapp.models import Order

    order = Order.objects.create(number="A1", total=Decimal("12.50"))
    with pytest.raises(PayloadNotSerializable) as caught:
        django_dbqueue.enqueue("q", {"order": order})
    assert "payload['order'] is of type Order (<Order: A1>)" in str(caught.value)
    assert "pass its primary key (value.pk)" in str(caught.value)


def test_a_long_repr_is_shortened_between_words():
    from django_dbqueue.validation import short_repr

    text = short_repr(["word"] * 40, 60)
    assert len(text) <= 60
    assert text.endswith("'word', ...")


@pytest.fixture
def unchanged():
    """Take a snapshot of both tables with some rows in them; assert it holds after the test."""
    django_dbqueue.enqueue("q", {"kept": True}, key="k1")
    django_dbqueue.enqueue("q", {"kept": 2})
    [done] = Message.objects.claim("q", worker="w")
    done.ack()

    def snapshot():
        return (
            sorted(Message.objects.values_list("id", "queue", "key", "payload", "attempts", "lease_token")),
            sorted(ArchivedMessage.objects.values_list("id", "message_id", "outcome")),
        )

    before = snapshot()
    yield
    assert snapshot() == before


@pytest.mark.parametrize(("queue", "payload", "options", "error", "words"), ENQUEUE_REFUSALS)
def test_enqueue_refusals(unchanged, queue, payload, options, error, words):
    with pytest.raises(error) as caught:
        django_dbqueue.enqueue(queue, payload, **options)
    assert words in str(caught.value)


@pytest.mark.parametrize(("queue", "payload", "options", "error", "words"), ENQUEUE_REFUSALS)
def test_enqueue_many_refusals_write_none_of_the_batch(unchanged, queue, payload, options, error, words):
    good = {"fine": 1}
    if "key" in options:  # any key for a batch is refused first: one key cannot name many messages
        error, words = InvalidOption, "one key for many payloads"
    with pytest.raises(error) as caught:
        django_dbqueue.enqueue_many(queue, [good, good, payload], **options)
    assert words in str(caught.value)


def test_enqueue_many_refuses_one_key_for_many(unchanged):
    with pytest.raises(InvalidOption, match="one key for many payloads"):
        django_dbqueue.enqueue_many("q", [{}, {}], key="same")


@pytest.mark.parametrize(
    ("queues", "options", "error", "words"),
    [
        ([], {}, InvalidQueueName, "no queue named"),
        ("bad queue", {}, InvalidQueueName, "may only hold"),
        ("q", {"limit": 0}, InvalidOption, "limit must be a positive integer"),
        ("q", {"visibility_timeout": 0}, InvalidOption, "visibility_timeout must be > 0"),
        ("q", {"visibility_timeout": timedelta(seconds=-1)}, InvalidOption, "> 0"),
    ],
)
def test_claim_refusals(unchanged, queues, options, error, words):
    limit = options.pop("limit", 1)
    with pytest.raises(error) as caught:
        Message.objects.claim(queues, limit, **options)
    assert words in str(caught.value)


def test_operations_on_a_message_never_claimed(unchanged):
    message = Message.objects.get()  # enqueued, never claimed
    for operation in (message.ack, message.release, lambda: message.fail("x"), lambda: message.extend_lease(5)):
        with pytest.raises(NotClaimed, match="is not claimed"):
            operation()


def test_bad_lease_extension_and_snooze_on_a_claimed_message():
    django_dbqueue.enqueue("q", {})
    [message] = Message.objects.claim("q")
    before = Message.objects.values_list("available_at", "attempts").get()
    with pytest.raises(InvalidOption, match="seconds must be > 0"):
        message.extend_lease(0)
    with pytest.raises(InvalidOption, match="snooze needs exactly one of until or delay"):
        message.snooze()
    with pytest.raises(InvalidOption, match="until must be timezone-aware"):
        message.snooze(datetime(2030, 1, 1))
    assert Message.objects.values_list("available_at", "attempts").get() == before
