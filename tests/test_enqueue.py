from datetime import UTC, datetime, timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

import django_dbqueue
from django_dbqueue.db import errors
from django_dbqueue.db.clock import db_now
from django_dbqueue.exceptions import PayloadNotSerializable
from django_dbqueue.models import Message, inserting
from django_dbqueue.models.messages import build_message

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
    replied again. The wrapper here deletes the row right after the INSERT
    runs, before enqueue() sees its result: a consumer that is that quick.
    """
    taken = []

    def take_at_once(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.startswith(f"INSERT INTO {connection.ops.quote_name('dbqueue_message')}"):
            with connection.cursor() as cursor:
                cursor.execute("DELETE FROM dbqueue_message WHERE queue = %s", ["replies"])
                taken.append(cursor.rowcount)
        return result

    with connection.execute_wrapper(take_at_once):
        message = django_dbqueue.enqueue("replies", {"n": 1}, key=key, delay=5)
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


def test_values_every_row_shares_are_written_once_and_stored_exactly():
    """MySQL's driver quotes into the statement's text: a shared value is quoted once, by the same rules."""
    tricky = "50% of 'it', \"quoted\", %s, %(x)s, back\\slash; DROP TABLE x; -- é 😀"
    headers = {"note": tricky}
    django_dbqueue.enqueue_many("bulk", [{"t": tricky, "n": n} for n in range(3)], kind=tricky[:100], headers=headers)
    stored = list(Message.objects.filter(queue="bulk").order_by("id"))
    assert [m.payload for m in stored] == [{"t": tricky, "n": n} for n in range(3)]
    assert all(m.headers == headers and m.kind == tricky[:100] for m in stored)


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite binds every value of every row")
def test_enqueue_many_sends_what_its_messages_share_once():
    """PostgreSQL gets one value per shared column (not an array of copies), MySQL one quoted into the text."""
    sent: list[object] = []

    def keep(execute, sql, params, many, context):
        if sql.startswith("INSERT"):
            sent.extend(params)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        django_dbqueue.enqueue_many("bulk-shared", [{"n": n} for n in range(50)], kind="k-shared")
    flat = [v for p in sent for v in (p if isinstance(p, list) else [p])]
    assert flat.count("bulk-shared") <= 1 and flat.count("k-shared") <= 1
    assert sorted(v for v in flat if isinstance(v, str) and v.startswith('{"n"')) == sorted(
        f'{{"n": {n}}}' for n in range(50)
    )
    assert sorted(m.payload["n"] for m in Message.objects.filter(queue="bulk-shared", kind="k-shared")) == list(
        range(50)
    )


@pytest.mark.parametrize("priority", [-32768, 32766])
def test_enqueue_many_stores_the_extreme_priorities_every_row_shares(priority):
    """A shared value is sent once: -32768 must not read as ``-(32768::smallint)`` on PostgreSQL."""
    messages = django_dbqueue.enqueue_many("bulk-extreme", [{"n": 1}, {"n": 2}], priority=priority)
    assert len(messages) == 2
    assert list(Message.objects.filter(queue="bulk-extreme").values_list("priority", flat=True)) == [priority] * 2


def test_rows_of_one_insert_keep_the_values_they_do_not_share():
    """Copies of one payload to several queues, one with its own priority and time: each row keeps its own."""
    pending = [
        build_message("q-a", {"same": 1}, {"priority": 1}),
        build_message("q-b", {"same": 1}, {"priority": 1, "kind": "other"}),
        build_message("q-c", {"same": 1}, {"priority": 5, "delay": 3600}),
    ]
    Message.objects.insert_built(pending)
    stored = {m.queue: m for m in Message.objects.all()}
    assert {q: (m.payload, m.priority, m.kind) for q, m in stored.items()} == {
        "q-a": ({"same": 1}, 1, ""),
        "q-b": ({"same": 1}, 1, "other"),
        "q-c": ({"same": 1}, 5, ""),
    }
    assert stored["q-c"].available_at - stored["q-a"].available_at == timedelta(seconds=3600)


def test_built_messages_are_written_in_the_order_given_keyed_or_not():
    """A FIFO group runs by id, and of two messages with one key the first takes it: the ids follow the order
    given, whichever messages carry a key, a key with a rule, or none (docs/workflows.md, "Keyed steps")."""
    pending = [
        build_message("in-order", {"n": 0}, {"key": "a", "group": "g"}),
        build_message("in-order", {"n": 1}, {"group": "g"}),
        build_message("in-order", {"n": 2}, {"key": "b", "unique": 60, "group": "g"}),
        build_message("in-order", {"n": 3}, {"key": "a", "group": "g"}),
        build_message("in-order", {"n": 4}, {"group": "g"}),
    ]
    result = Message.objects.insert_built(pending)
    assert [m.payload["n"] for m in Message.objects.order_by("id")] == [0, 1, 2, 4]
    assert [m.was_created for m in result] == [True, True, True, False, True]
    # The second message with key "a" is the first one's row, as a message of its own.
    assert result[3] is not result[0] and (result[3].pk, result[3].payload) == (result[0].pk, {"n": 0})


@pytest.mark.django_db(transaction=True)
def test_a_retried_batch_starts_again_from_the_messages_as_built(monkeypatch):
    """Fault: a batch's try ran into a live key (its message became the live one), then hit a deadlock and
    rolled back, and the live one finished before the retry. The retry writes the message as it was built:
    its own payload in a new row, not a copy of the finished message with its id and lease."""
    live = django_dbqueue.enqueue("retry-built", {"who": "other"}, key="k")
    [running] = django_dbqueue.claim("retry-built")
    pending = [build_message("retry-built", {"who": "mine"}, {"key": "k"}), build_message("retry-built", {}, {})]
    real, tries = inserting.insert_messages, []

    def deadlocked_once(*args, **kwargs):
        tries.append(1)
        if len(tries) == 1:  # the second run of the batch, after the keyed one adopted the live message
            raise deadlock(connection.vendor)
        return real(*args, **kwargs)

    def finish_in_between(attempt):
        assert running.ack() is True
        return 0

    monkeypatch.setattr(inserting, "insert_messages", deadlocked_once)
    monkeypatch.setattr(errors, "backoff", finish_in_between)
    result = Message.objects.insert_built(pending)
    assert len(tries) == 2
    mine = Message.objects.get(key="k")
    assert (mine.payload, mine.lease_token, mine.attempts) == ({"who": "mine"}, None, 0) and mine.pk != live.pk
    assert (result[0].pk, result[0].was_created) == (mine.pk, True)


def deadlock(vendor: str) -> OperationalError:
    """A deadlock as each driver raises it, which the queue takes for weather and retries (nothing landed)."""
    if vendor == "mysql":
        import MySQLdb

        error = OperationalError(1213, "Deadlock found when trying to get lock (injected)")
        error.__cause__ = MySQLdb.OperationalError(1213, "Deadlock found when trying to get lock (injected)")
    elif vendor == "postgresql":
        import psycopg

        error = OperationalError("deadlock detected (injected)")
        error.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected (injected)")
    else:
        error = OperationalError("database is locked (injected)")
    return error


def test_enqueue_many_with_delay():
    django_dbqueue.enqueue_many("bulk", [{}, {}], delay=3600)
    assert Message.objects.scheduled().count() == 2


def test_enqueue_many_of_nothing():
    assert django_dbqueue.enqueue_many("bulk", []) == []


@pytest.mark.skipif(
    connection.vendor != "mysql", reason="MySQL's answer to an INSERT is lastrowid; elsewhere it is not the id"
)
def test_without_returning_the_clock_is_read_first_and_the_id_taken_from_the_insert(monkeypatch):
    """MySQL itself has no RETURNING (MariaDB has): this server stands in for it with the feature switched off."""
    monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    statements = []
    with connection.execute_wrapper(lambda execute, sql, *args: statements.append(sql) or execute(sql, *args)):
        message = django_dbqueue.enqueue("q", {"n": 1}, delay=5)
    # The clock, then the INSERT (after a new connection's SETs; then, maybe, the workers' nudge addresses).
    clock, insert = [sql for sql in statements if not sql.startswith("SET")][:2]
    assert clock.startswith("SELECT UTC_TIMESTAMP") and insert.startswith("INSERT") and "RETURNING" not in insert
    stored = Message.objects.get()
    assert (message.pk, message.created_at) == (stored.pk, stored.created_at)
    assert message.available_at == stored.available_at == stored.created_at + timedelta(seconds=5)


def test_the_size_limit_counts_the_stored_text_in_which_non_ascii_is_escaped():
    """The INSERT's JSON escapes "é" to six characters: the limit counts those, what the statement carries.

    Counted in UTF-8 (two bytes), 500,000 of them passed the check and made a
    3 MB row, and a batch of such rows passed MySQL's max_allowed_packet.
    """
    within = {"text": "é" * 160_000}  # 960,012 characters stored
    message = django_dbqueue.enqueue("q", within)
    assert Message.objects.get(pk=message.pk).payload == within
    over = {"text": "é" * 170_000}  # 340,000 bytes in UTF-8, but 1,020,012 characters stored
    with pytest.raises(PayloadNotSerializable, match=r"1,020,012 bytes as stored JSON.*the limit is 1,000,000"):
        django_dbqueue.enqueue("q", over)
    assert Message.objects.count() == 1


@pytest.mark.parametrize(
    ("timing", "due_after"),
    [({}, timedelta(0)), ({"delay": 5}, timedelta(seconds=5)), ({"delay": timedelta(0)}, timedelta(0)), (None, None)],
    ids=["now", "delay", "zero-delay", "run_at"],
)
def test_what_enqueue_returns_is_what_it_stored(timing, due_after):
    """One INSERT per timing (its SQL written once): the message returned carries the stored row's values."""
    run_at = timezone.now() + timedelta(hours=1)
    fields = ("queue", "kind", "key", "payload", "headers", "priority", "max_attempts", "expires_at")
    times = ("created_at", "available_at", "first_available_at")
    for _ in range(2):  # the second call runs the statement written by the first
        options = timing if timing is not None else {"run_at": run_at}
        message = django_dbqueue.enqueue("q", {"n": 1}, kind="k", headers={"h": 1}, priority=3, **options)
        stored = Message.objects.get(pk=message.pk)
        assert [getattr(message, f) for f in fields + times] == [getattr(stored, f) for f in fields + times]
        if due_after is None:
            assert stored.available_at == stored.first_available_at == run_at
        else:
            assert stored.available_at - stored.created_at == due_after


@pytest.mark.parametrize(
    "option",
    [
        {},
        {"kind": "k"},
        {"group": "g"},
        {"headers": {"h": 1}},
        {"priority": -1},
        {"max_attempts": 2},
        {"expires_at": datetime(2099, 1, 1, tzinfo=UTC)},
    ],
    ids=lambda option: next(iter(option), "plain"),
)
def test_a_message_with_only_a_queue_and_a_payload_stores_the_defaults_and_any_other_option_is_kept(option):
    """Such a message's INSERT writes the defaults as SQL and sends two parameters (`insert-plain`):
    one option more, whichever, must take the statement that writes it."""
    for _ in range(2):  # the second call runs the statement written by the first
        message = django_dbqueue.enqueue("q", {"n": 1}, **option)
        stored = Message.objects.get(pk=message.pk)
        blank = Message()
        expected = {f: option.get(f, getattr(blank, f)) for f in ("kind", "key", "group", "headers", "priority")}
        expected |= {f: option.get(f, getattr(blank, f)) for f in ("max_attempts", "expires_at", "replay_of")}
        assert {f: getattr(stored, f) for f in expected} == expected
        assert {f: getattr(message, f) for f in expected} == expected
        assert message.created_at == stored.created_at == stored.available_at == stored.first_available_at


def test_messages_built_by_enqueue_share_no_headers():
    """Messages are built by copying a blank one (not Model.__init__): each still gets its own headers dict."""
    first, second = django_dbqueue.enqueue("q", {}), django_dbqueue.enqueue("q", {})
    first.headers["mine"] = True
    assert second.headers == {} and Message.unsaved(queue="q").headers == {}
    assert first.pk != second.pk and first._state.adding is False and Message.unsaved(queue="q")._state.adding


def test_enqueue_many_of_large_payloads_fits_its_statements_to_the_servers_packet():
    """Twenty payloads of 0.9 MB: MariaDB refused them as one statement (error 1153, max_allowed_packet 16 MiB)."""
    payloads = [{"n": n, "blob": "x" * 900_000} for n in range(20)]
    messages = django_dbqueue.enqueue_many("q", payloads)
    assert len(messages) == 20
    assert sorted(Message.objects.values_list("payload__n", flat=True)) == list(range(20))


def test_keyed_messages_of_one_batch_fit_the_servers_packet_too():
    """The keyed rows of a batch (here from the outbox, one key per order) take the other INSERT."""
    from django_dbqueue import outbox
    from tests.testapp.models import Order

    rule = outbox.enqueue_on_save(
        Order, "q", payload=lambda o: {"blob": "y" * 900_000, "n": o.number}, key=lambda o: o.number
    )
    try:
        with transaction.atomic():
            orders = Order.objects.bulk_create([Order(number=f"o{n}") for n in range(20)])
            written = outbox.enqueue_saved(orders, created=True)
    finally:
        rule.disconnect()
    assert len(written) == 20 and Message.objects.count() == 20
