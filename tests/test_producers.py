"""Every producer through one insert path: each option it takes is honoured, and each bad value refused, alike.

The producers: ``enqueue``, ``enqueue_many``, ``publish`` (to two queues),
the outbox (``enqueue_on_save``, ``publish_on_save``), the Tasks backend,
schedules, ``replay`` and ``request``. Each takes some of enqueue's options
(``ACCEPTS``); for each of those the matrix checks the stored rows, and for
each bad value that the option (or the payload, or a header hook) can carry,
that the call raises the documented exception and writes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone as dj_timezone

import django_dbqueue
from django_dbqueue import control, outbox, propagation
from django_dbqueue.exceptions import ImproperlyConfiguredQueue, InvalidOption, PayloadNotSerializable, RequestTimeout
from django_dbqueue.models import ArchivedMessage, Message, Outcome, UniqueWindow
from django_dbqueue.models.messages import ENQUEUE_OPTIONS
from django_dbqueue.operations import finish
from django_dbqueue.schedules.scheduler import Scheduler
from django_dbqueue.tasks.compat import FRAMEWORK
from tests.support.schedules import Clock, at
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)

# Every option a message can carry (not `using`, which picks a database): a new option joins the matrix.
ALL = ENQUEUE_OPTIONS - {"using"}


def _outbox_save(register: Callable[..., outbox.OutboxRule], target: str, payload: Any, options: dict) -> None:
    options = dict(options)
    kind, key = options.pop("kind", ""), options.pop("key", None)
    rule = register(Order, target, payload=payload, kind=kind, key=key, name="matrix", **options)
    try:
        with transaction.atomic():
            Order.objects.create(number=uuid.uuid4().hex[:16])
    finally:
        rule.disconnect()


def _task(payload: Any, options: dict) -> None:
    from tests.testapp import tasks

    given = {}
    if "priority" in options:
        given["priority"] = -options["priority"]  # the backend stores the framework's priority negated
    if "run_at" in options:
        given["run_after"] = options["run_at"]
    tasks.echo.using(**given).enqueue(payload)


def _schedule(payload: Any, options: dict) -> None:
    django_dbqueue.schedule(name="matrix", every=3600, queue="p-schedule", payload=payload, **options)(lambda m: None)
    Scheduler(clock=Clock(at(2026, 5, 1, 10, 20))).run_now("matrix")


def _replay(payload: Any, options: dict) -> None:
    """A dead letter enqueued with ``options``, replayed with ``payload``."""
    with propagation_off():
        live = django_dbqueue.enqueue("p-replay", {"first": True}, **options)
    finish(live, Outcome.DEAD, match="id", error="for the matrix")
    control.replay(ArchivedMessage.objects.get(message_id=live.pk), payload=payload)


def _request(payload: Any, options: dict) -> None:
    with pytest.raises(RequestTimeout):
        django_dbqueue.request("p-request", payload, timeout=0.2, poll_interval=0.05, **options)


PRODUCERS: dict[str, tuple[frozenset[str], Callable[[Any, dict], None]]] = {
    "enqueue": (ALL, lambda p, o: django_dbqueue.enqueue("p-one", p, **o)),
    # One payload with a key (a key for many is refused), else two: the multi-row path.
    "enqueue_many": (ALL, lambda p, o: django_dbqueue.enqueue_many("p-many", [p] if "key" in o else [p, p], **o)),
    "publish": (ALL, lambda p, o: django_dbqueue.publish("t-orders", p, **o)),  # t-email and t-invoicing
    "enqueue_on_save": (ALL, lambda p, o: _outbox_save(outbox.enqueue_on_save, "p-outbox", p, o)),
    "publish_on_save": (ALL, lambda p, o: _outbox_save(outbox.publish_on_save, "t-orders", p, o)),
    "task": (frozenset({"priority", "run_at"}), _task),
    "schedule": (frozenset({"kind", "headers", "priority", "max_attempts"}), _schedule),
    "replay": (frozenset({"kind", "key", "group", "headers", "priority", "max_attempts"}), _replay),
    "request": (frozenset({"kind", "headers", "priority", "max_attempts"}), _request),
}

if FRAMEWORK is None:
    del PRODUCERS["task"]


class propagation_off:
    """Header hooks off inside (a replay's dead letter is made before the hook under test applies)."""

    def __enter__(self) -> None:
        self.saved = list(propagation.hooks)
        propagation.hooks.clear()

    def __exit__(self, *exc: object) -> None:
        propagation.hooks[:] = self.saved


@pytest.fixture(autouse=True)
def _clean_declarations(schedules):
    """Schedules declared by the matrix go away after each test (the ``schedules`` fixture)."""


def produce(name: str, payload: Any = None, **options: Any) -> None:
    PRODUCERS[name][1]({"n": 1} if payload is None else payload, options)


def written(name: str) -> list[Message]:
    """The live rows the producer wrote (a replay's dead letter is not one of them: it left the table)."""
    return list(Message.objects.order_by("queue", "id"))


def counts() -> tuple[int, int]:
    return Message.objects.count(), ArchivedMessage.objects.count()


# --- options honoured ---------------------------------------------------------------------

HOUR = timedelta(hours=1)


def check_field(name: str, option: str, value: Any, field: str, expected: Any) -> None:
    produce(name, **{option: value})
    rows = written(name)
    assert rows, f"{name} wrote nothing"
    assert all(getattr(row, field) == expected for row in rows), [(r.queue, getattr(r, field)) for r in rows]


def honour_kind(name: str) -> None:
    check_field(name, "kind", "k1", "kind", "k1")


def honour_priority(name: str) -> None:
    check_field(name, "priority", 5, "priority", 5)


def honour_max_attempts(name: str) -> None:
    check_field(name, "max_attempts", 3, "max_attempts", 3)


def honour_group(name: str) -> None:
    check_field(name, "group", "g1", "group", "g1")


def honour_headers(name: str) -> None:
    produce(name, headers={"h": "v"})
    rows = written(name)
    assert rows and all(row.headers.get("h") == "v" for row in rows)


def honour_key(name: str) -> None:
    produce(name, key="k1")
    first = written(name)
    assert first and all(row.key == "k1" for row in first)
    if name == "replay":
        return  # a replay whose key is live is refused: DuplicateKey (tests/test_control.py)
    produce(name, key="k1", payload={"n": 2})
    assert [row.pk for row in written(name)] == [row.pk for row in first], "a live key was inserted again"


def _finish_all() -> None:
    for row in Message.objects.all():
        finish(row, Outcome.ACKED, match="id")


def honour_unique(name: str) -> None:
    produce(name, key="k1", unique=HOUR)
    assert written(name)
    _finish_all()  # the messages are gone, their window is not
    produce(name, key="k1", unique=HOUR, payload={"n": 2})
    assert written(name) == [], "a second message inside the unique window was inserted"
    assert UniqueWindow.objects.exists()


def honour_debounce(name: str) -> None:
    produce(name, key="k1", debounce=timedelta(seconds=30), payload={"v": 1})
    first = written(name)
    produce(name, key="k1", debounce=timedelta(seconds=30), payload={"v": 2})
    rows = written(name)
    assert len(rows) == len(first), "the debounced message was inserted beside the waiting one"
    assert [row.payload for row in rows] == [{"v": 2}] * len(rows), "the last payload did not win"
    for row in rows:
        assert timedelta(seconds=25) < row.available_at - row.created_at <= timedelta(seconds=31)
    assert not Message.objects.ready().exists(), "a debounced message is due at once"


def honour_delay(name: str) -> None:
    produce(name, delay=60)
    rows = written(name)
    assert rows and all(timedelta(seconds=59) < r.available_at - r.created_at < timedelta(seconds=61) for r in rows)


def honour_run_at(name: str) -> None:
    when = (dj_timezone.now() + HOUR).replace(microsecond=0)
    check_field(name, "run_at", when, "available_at", when)


def honour_expires_at(name: str) -> None:
    when = (dj_timezone.now() + HOUR).replace(microsecond=0)
    check_field(name, "expires_at", when, "expires_at", when)


HONOURED = {
    "kind": honour_kind,
    "priority": honour_priority,
    "max_attempts": honour_max_attempts,
    "group": honour_group,
    "headers": honour_headers,
    "key": honour_key,
    "unique": honour_unique,
    "debounce": honour_debounce,
    "delay": honour_delay,
    "run_at": honour_run_at,
    "expires_at": honour_expires_at,
}
assert set(HONOURED) == ALL


@pytest.mark.parametrize(
    ("producer", "option"),
    [(p, o) for p, (accepts, _) in PRODUCERS.items() for o in sorted(accepts)],
)
def test_each_producer_honours_each_option_it_takes(producer, option):
    HONOURED[option](producer)


def stamp(queue: str, kind: str, headers: dict[str, Any]) -> dict[str, Any]:
    return {**headers, "stamped": queue}


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_each_producer_runs_the_header_hooks(producer):
    propagation.add(stamp)
    try:
        produce(producer)
    finally:
        propagation.remove(stamp)
    rows = written(producer)
    assert rows and all(row.headers.get("stamped") == row.queue for row in rows)


# --- bad values refused, nothing written ----------------------------------------------------

FAR = datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))  # past year 9999 in UTC

BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    # (option it needs, options, exception, words of the message)
    ("kind", {"kind": "k\x00"}, InvalidOption, "NUL"),
    ("priority", {"priority": 10**6}, InvalidOption, "priority must be"),
    ("headers", {"headers": {"h": "a\x00b"}}, PayloadNotSerializable, "NUL"),
    ("max_attempts", {"max_attempts": 0}, InvalidOption, "max_attempts must be"),
    ("group", {"group": ""}, InvalidOption, "group must be"),
    ("key", {"key": "x" * 256}, InvalidOption, "key is 256 characters"),
    ("unique", {"key": "k", "unique": "forever"}, InvalidOption, "unique must be"),
    ("debounce", {"key": "k", "debounce": -1}, InvalidOption, "debounce must be"),
    ("delay", {"delay": -1}, InvalidOption, "delay must be"),
    ("run_at", {"run_at": FAR}, InvalidOption, "run_at is 9999-12-31T23:00:00-05:00; the latest"),
    ("expires_at", {"expires_at": FAR}, InvalidOption, "expires_at is 9999-12-31T23:00:00-05:00; the latest"),
]


def _bad_cases() -> list[Any]:
    cases = []
    for producer, (accepts, _) in PRODUCERS.items():
        for needs, options, error, words in BAD:
            if needs in accepts and not (producer in ("schedule", "replay") and needs != "headers"):
                cases.append(pytest.param(producer, options, error, words, id=f"{producer}-{needs}"))
    return cases


@pytest.mark.parametrize(("producer", "options", "error", "words"), _bad_cases())
def test_each_producer_refuses_each_bad_value_and_writes_nothing(producer, options, error, words):
    if producer == "task" and "priority" in options:
        pytest.skip("the Tasks framework bounds a task's priority itself (-100 to 100)")
    before = counts()
    with pytest.raises(refusal(producer, error), match=words):
        produce(producer, **options)
    assert counts() == before


def refusal(producer: str, error: type[Exception]) -> type[Exception]:
    """What the producer raises for a bad value: schedules are declarations, refused as a configuration (E003)."""
    return ImproperlyConfiguredQueue if producer == "schedule" else error


def nul_hook(queue: str, kind: str, headers: dict[str, Any]) -> dict[str, Any]:
    return {**headers, "bad": "nul\x00"}


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_a_header_hooks_bad_value_is_refused_by_every_producer_on_every_database(producer):
    """The hooks run before the headers' check: a NUL was stored by MariaDB and SQLite, refused by PostgreSQL."""
    propagation.add(nul_hook)
    before = counts()
    try:
        with pytest.raises(PayloadNotSerializable, match=r"headers.*NUL"):
            produce(producer)
    finally:
        propagation.remove(nul_hook)
    if producer == "replay":
        before = (before[0], before[1] + 1)  # its dead letter, made before the hook applied
    assert counts() == before


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_an_integer_of_5000_digits_in_a_payload_is_refused_by_every_producer(producer):
    """It was a bare ValueError from the JSON encoder (Python reads no integer past 4,300 digits)."""
    before = counts()
    with pytest.raises(refusal(producer, PayloadNotSerializable), match="more than 4,300 digits"):
        produce(producer, payload={"n": 10**5000})
    if producer == "replay":
        before = (before[0], before[1] + 1)
    assert counts() == before


# --- the seams the matrix found ---------------------------------------------------------------


def test_publish_to_two_queues_keeps_its_unique_window():
    first = django_dbqueue.publish("t-orders", {"n": 1}, key="k", unique=HOUR)
    assert sorted(m.queue for m in first) == ["t-email", "t-invoicing"] and all(m.was_created for m in first)
    _finish_all()
    again = django_dbqueue.publish("t-orders", {"n": 2}, key="k", unique=HOUR)
    assert [m.was_created for m in again] == [False, False]
    assert Message.objects.count() == 0


def test_a_debounced_publish_to_two_queues_replaces_the_payload_and_waits():
    django_dbqueue.publish("t-orders", {"v": 1}, key="k", debounce=30)
    django_dbqueue.publish("t-orders", {"v": 2}, key="k", debounce=30)
    rows = list(Message.objects.order_by("queue"))
    assert [(m.queue, m.payload) for m in rows] == [("t-email", {"v": 2}), ("t-invoicing", {"v": 2})]
    assert not Message.objects.ready().exists()


def test_a_debounced_message_moved_into_another_fifo_group_goes_behind_its_head():
    """Moved with its old, lower id, it became the group's head beside the real head in flight."""
    waiting = django_dbqueue.enqueue("fc-fifo", {"v": 1}, key="k", group="a", debounce=30)
    head = django_dbqueue.enqueue("fc-fifo", {"n": "head"}, group="b")
    [claimed] = Message.objects.claim("fc-fifo", 10)  # a's message is not due yet
    assert claimed.pk == head.pk
    moved = django_dbqueue.enqueue("fc-fifo", {"v": 2}, key="k", group="b", debounce=30)
    assert moved.pk > head.pk and not Message.objects.filter(pk=waiting.pk).exists()
    assert Message.objects.filter(key="k").count() == 1
    Message.objects.filter(pk=moved.pk).update(available_at=dj_timezone.now() - HOUR)
    assert Message.objects.claim("fc-fifo", 10) == [], "two messages of one ordered group in flight at once"
    assert claimed.ack()
    [next_one] = Message.objects.claim("fc-fifo", 10)
    assert (next_one.pk, next_one.payload) == (moved.pk, {"v": 2})


def test_a_debounced_message_within_its_group_keeps_its_place():
    first = django_dbqueue.enqueue("fc-fifo", {"v": 1}, key="k", group="a", debounce=30)
    second = django_dbqueue.enqueue("fc-fifo", {"v": 2}, key="k", group="a", debounce=30)
    assert second.pk == first.pk and Message.objects.get().payload == {"v": 2}


def test_a_time_past_year_9999_is_refused_where_it_overflowed():
    latest = datetime(9999, 12, 30, tzinfo=UTC)
    for options in ({"run_at": latest + timedelta(seconds=1)}, {"expires_at": datetime.max.replace(tzinfo=UTC)}):
        with pytest.raises(InvalidOption, match="the latest time a message may name is 9999-12-30 UTC"):
            django_dbqueue.enqueue("q", {}, **options)
    assert Message.objects.count() == 0


def test_an_outbox_rules_bad_value_is_refused_when_it_is_registered_not_at_the_save():
    """The rule's fixed values pass the checks of every message at once; a callable's value at the save."""
    with pytest.raises(InvalidOption, match="priority must be"):
        outbox.enqueue_on_save(Order, "p-outbox", payload={}, priority=10**6)
    with pytest.raises(InvalidOption, match="give key="):
        outbox.publish_on_save(Order, "t-orders", payload={}, unique=HOUR)
    assert outbox.rules_for(Order) == []
    rule = outbox.enqueue_on_save(Order, "p-outbox", payload={}, key=lambda o: o.number, debounce=lambda o: -1)
    try:
        with pytest.raises(InvalidOption, match="debounce must be"), transaction.atomic():
            Order.objects.create(number="o-1")
    finally:
        rule.disconnect()
    assert counts() == (0, 0) and not Order.objects.exists()


def test_a_snooze_past_year_9999_is_refused_and_the_lease_holds():
    django_dbqueue.enqueue("q", {})
    [message] = django_dbqueue.claim("q")
    with pytest.raises(InvalidOption, match="until is 9999-12-31T23:00:00-05:00; the latest"):
        message.snooze(FAR)
    assert Message.objects.get().lease_token == message.lease_token and message.ack()
