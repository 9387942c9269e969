import time
from datetime import timedelta

import pytest
from django.utils import timezone

import django_dbqueue
from django_dbqueue.db.clock import DbNow
from django_dbqueue.exceptions import NotClaimed
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from tests.support.factories import MessageFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_claim_leases_in_priority_then_age_order():
    low = django_dbqueue.enqueue("q", {"n": "low"}, priority=5)
    first = django_dbqueue.enqueue("q", {"n": "first"})
    second = django_dbqueue.enqueue("q", {"n": "second"})
    urgent = django_dbqueue.enqueue("q", {"n": "urgent"}, priority=-1)
    claimed = Message.objects.claim("q", limit=3, worker="w1")
    assert [m.pk for m in claimed] == [urgent.pk, first.pk, second.pk]
    assert len({m.lease_token for m in claimed}) == 1
    stored = Message.objects.get(pk=first.pk)
    assert stored.attempts == 1 and stored.claimed_by == "w1" and stored.lease_token == claimed[0].lease_token
    assert stored.available_at > stored.claimed_at
    assert list(Message.objects.in_flight().order_by("pk").values_list("pk", flat=True)) == sorted(
        [urgent.pk, first.pk, second.pk]
    )
    assert [m.pk for m in Message.objects.claim("q", 5)] == [low.pk]
    assert Message.objects.claim("q") == []


def test_a_claimed_message_is_what_the_orm_reads_from_its_row():
    """Claimed rows become messages without Model.__init__: every field as the ORM reads it, and a loaded instance."""
    sent = django_dbqueue.enqueue(
        "q",
        {"n": [1, "é"]},
        kind="k",
        key="k1",
        headers={"h": 1},
        priority=2,
        max_attempts=4,
        expires_at=timezone.now() + timedelta(hours=1),
    )
    Message.objects.filter(pk=sent.pk).update(last_error="before")
    (claimed,) = Message.objects.claim("q", worker="w1")
    stored = Message.objects.get(pk=sent.pk)
    names = [f.attname for f in Message._meta.concrete_fields]
    assert [getattr(claimed, n) for n in names] == [getattr(stored, n) for n in names]
    assert (claimed._state.adding, claimed._state.db) == (False, stored._state.db)
    claimed.refresh_from_db(fields=["attempts"])  # a loaded instance: Django's own methods work on it
    assert claimed.attempts == 1 and claimed.ack(worker="w1")


def test_claim_from_several_queues_serves_the_first_listed_first():
    a = django_dbqueue.enqueue("a", {})
    b1 = django_dbqueue.enqueue("b", {})
    b2 = django_dbqueue.enqueue("b", {})
    assert [m.pk for m in Message.objects.claim(["b", "a"], 2)] == [b1.pk, b2.pk]
    assert [m.pk for m in Message.objects.claim(["b", "a"], 2)] == [a.pk]


def test_claim_skips_scheduled_and_expired():
    django_dbqueue.enqueue("q", {}, delay=3600)
    MessageFactory(queue="q", expires_at=timezone.now() - timedelta(seconds=1))
    assert Message.objects.claim("q", 10) == []


def test_visibility_timeout_comes_from_the_queue_setting():
    django_dbqueue.enqueue("short", {})
    [message] = Message.objects.claim("short")
    assert timedelta(seconds=0.9) <= message.available_at - message.claimed_at <= timedelta(seconds=1.1)


def test_ack_archives_and_deletes():
    sent = django_dbqueue.enqueue("q", {"x": 1}, kind="k", key="key-1", headers={"h": 1})
    [message] = Message.objects.claim("q", worker="w9")
    assert message.ack()
    assert not Message.objects.exists()
    row = ArchivedMessage.objects.get()
    assert (row.message_id, row.outcome, row.queue, row.kind, row.key) == (sent.pk, Outcome.ACKED, "q", "k", "key-1")
    assert row.payload == {"x": 1} and row.headers == {"h": 1}
    assert row.finished_by == "w9" and row.attempts == 1
    assert row.created_at <= row.first_available_at <= row.claimed_at <= row.finished_at


def test_ack_without_archive_just_deletes():
    django_dbqueue.enqueue("no-archive", {})
    [message] = Message.objects.claim("no-archive")
    assert message.ack()
    assert (Message.objects.count(), ArchivedMessage.objects.count()) == (0, 0)


def test_ack_many_reports_each_lease():
    django_dbqueue.enqueue_many("q", [{"n": n} for n in range(4)])
    messages = Message.objects.claim("q", 4)
    stolen = messages[2]
    Message.objects.filter(pk=stolen.pk).update(lease_token="someone-else")
    assert Message.objects.ack_many(messages) == [True, True, False, True]
    assert list(Message.objects.values_list("pk", flat=True)) == [stolen.pk]
    assert ArchivedMessage.objects.acked().count() == 3


@pytest.mark.parametrize("stale_first", [True, False])
def test_ack_many_answers_each_handle_of_one_message_by_its_own_lease(stale_first):
    """A stale handle batched with the live one of the same message is told False, whichever comes first."""
    django_dbqueue.enqueue("q", {"job": 1})
    [stale] = Message.objects.claim("q")
    Message.objects.filter(pk=stale.pk).update(available_at=DbNow())  # its lease ran out
    [live] = Message.objects.claim("q")
    assert live.pk == stale.pk and live.lease_token != stale.lease_token
    django_dbqueue.enqueue("q", {"job": 2})
    [second] = Message.objects.claim("q")
    batch = [stale, live, second] if stale_first else [live, stale, second]
    assert Message.objects.ack_many(batch) == ([False, True, True] if stale_first else [True, False, True])
    assert not Message.objects.exists()
    assert ArchivedMessage.objects.acked().filter(message_id=stale.pk).count() == 1


def test_lease_expiry_redelivers_and_the_late_ack_changes_nothing():
    django_dbqueue.enqueue("q", {"job": 1})
    [first] = Message.objects.claim("q", visibility_timeout=0.5, worker="slow")
    assert Message.objects.claim("q") == []
    time.sleep(1.0)
    [second] = Message.objects.claim("q", worker="fast")
    assert second.pk == first.pk and second.lease_token != first.lease_token and second.attempts == 2
    assert first.ack() is False
    assert first.fail(ValueError("late")) is False
    assert first.extend_lease(60) is False
    assert Message.objects.get().lease_token == second.lease_token
    assert ArchivedMessage.objects.count() == 0
    assert second.ack() is True
    assert ArchivedMessage.objects.get().finished_by == "fast"


def test_a_lease_that_ran_out_is_lost_even_before_another_claim():
    django_dbqueue.enqueue("q", {})
    [message] = Message.objects.claim("q", visibility_timeout=0.3)
    time.sleep(0.5)
    assert message.ack() is False and message.extend_lease(60) is False
    assert Message.objects.ready().count() == 1 and ArchivedMessage.objects.count() == 0


def test_fail_retries_with_backoff_then_dead_letters():
    django_dbqueue.enqueue("q", {}, max_attempts=2)
    [message] = Message.objects.claim("q")
    try:
        raise ValueError("first failure")
    except ValueError as exc:
        assert message.fail(exc)
    stored = Message.objects.get()
    assert stored.lease_token is None and "ValueError: first failure" in stored.last_error
    assert "Traceback" in stored.last_error
    assert Message.objects.scheduled().count() == 1  # backoff: not ready yet
    Message.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    [again] = Message.objects.claim("q")
    assert again.attempts == 2
    assert again.fail("second failure")
    assert not Message.objects.exists()
    dead = ArchivedMessage.objects.dead().get()
    assert dead.attempts == 2 and dead.last_error == "second failure"


def test_fail_without_retry_dead_letters_at_once():
    django_dbqueue.enqueue("q", {})
    [message] = Message.objects.claim("q")
    assert message.fail("bad payload", retry=False)
    assert ArchivedMessage.objects.dead().get().last_error == "bad payload"


def test_backoff_grows_exponentially(settings):
    settings.DBQUEUE = {"BACKOFF_BASE": 10, "BACKOFF_JITTER": 0, "BACKOFF_MAX": 35}
    from django_dbqueue.operations import backoff_delay

    delays = [backoff_delay(Message(queue="q", attempts=n)) for n in (1, 2, 3, 4)]
    assert delays == [10, 20, 35, 35]


def test_reject_requeue_and_dead():
    django_dbqueue.enqueue("q", {"n": 1})
    django_dbqueue.enqueue("q", {"n": 2})
    one, two = Message.objects.claim("q", 2)
    assert one.reject(delay=3600, reason="later")
    assert Message.objects.get(pk=one.pk).last_error == "later"
    assert Message.objects.scheduled().filter(pk=one.pk).exists()
    assert two.reject(requeue=False, reason="malformed order")
    assert ArchivedMessage.objects.dead().get().last_error == "malformed order"


def test_extend_lease_and_release():
    django_dbqueue.enqueue("q", {})
    [message] = Message.objects.claim("q", visibility_timeout=1)
    assert message.extend_lease(3600)
    assert Message.objects.in_flight().get().available_at > timezone.now() + timedelta(minutes=59)
    assert message.release()
    stored = Message.objects.ready().get()
    assert stored.lease_token is None and stored.attempts == 0
    assert Message.objects.claim("q")[0].attempts == 1


def test_snooze_does_not_count_an_attempt():
    django_dbqueue.enqueue("q", {})
    [message] = Message.objects.claim("q")
    assert message.snooze(until=timezone.now() + timedelta(hours=2))
    stored = Message.objects.scheduled().get()
    assert stored.attempts == 0 and stored.available_at > timezone.now() + timedelta(hours=1)


def test_defer_is_a_deprecated_alias_of_snooze():
    django_dbqueue.enqueue("q", {})
    [message] = Message.objects.claim("q")
    with pytest.warns(DeprecationWarning, match=r"Message.defer\(\) is deprecated; use Message.snooze\(\)"):
        assert message.defer(delay=3600)
    assert Message.objects.scheduled().get().attempts == 0


def test_operations_on_an_unclaimed_message_are_refused():
    message = django_dbqueue.enqueue("q", {})
    with pytest.raises(NotClaimed, match="not claimed"):
        message.ack()


def test_queryset_counts_and_oldest_age():
    MessageFactory(queue="a", created_at=timezone.now() - timedelta(minutes=10))
    MessageFactory(queue="a")
    MessageFactory(queue="a", scheduled=True)
    MessageFactory(queue="b", lease_token="t", available_at=timezone.now() + timedelta(minutes=1))
    assert Message.objects.counts_by_queue() == {
        "a": {"ready": 2, "scheduled": 1, "in_flight": 0},
        "b": {"ready": 0, "scheduled": 0, "in_flight": 1},
    }
    age = Message.objects.oldest_ready_age("a")
    assert timedelta(minutes=9) < age < timedelta(minutes=11)
    assert Message.objects.oldest_ready_age("b") is None


def test_a_lease_lost_between_the_batch_copy_and_its_delete_is_not_archived():
    """MySQL/MariaDB/SQLite acknowledge a batch without locking it first: copy, then delete, by the lease guard.

    A lease released between the two statements (the reaper, an operator)
    leaves the delete one row short: the acknowledgement rolls back and
    takes the locking path, so the released message is neither archived
    nor deleted. The release commits from another connection, which the
    copy's unlocked read does not block. PostgreSQL acknowledges in one
    statement, and SQLite's acknowledgement holds the one write lock from
    its BEGIN: neither has such a window (their fallback runs in
    test_ack_many_reports_each_lease).
    """
    import threading

    from django.db import connection, connections

    if connection.vendor != "mysql":
        pytest.skip("no window between the copy and the delete on this database")
    django_dbqueue.enqueue_many("q", [{"n": n} for n in range(3)])
    messages = Message.objects.claim("q", 3)
    released = messages[1]
    release = "UPDATE dbqueue_message SET lease_token = NULL WHERE id = %s"
    seen: list[str] = []

    def release_elsewhere() -> None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute(release, [released.pk])
        finally:
            connections["default"].close()

    def before_the_delete(execute, sql, params, many, context):
        seen.append(sql.split()[0])
        if sql.startswith("DELETE") and seen.count("DELETE") == 1:
            other = threading.Thread(target=release_elsewhere)
            other.start()
            other.join(timeout=30)
            assert not other.is_alive(), "the copy locked the row it read"
        return execute(sql, params, many, context)

    with connection.execute_wrapper(before_the_delete):
        assert Message.objects.ack_many(messages) == [True, False, True]
    assert seen.count("INSERT") == 2, seen  # the unlocked copy, rolled back, then the locked path's
    assert list(Message.objects.values_list("pk", flat=True)) == [released.pk]
    assert Message.objects.get().lease_token is None
    assert sorted(ArchivedMessage.objects.values_list("message_id", flat=True)) == sorted(
        m.pk for m in messages if m is not released
    )
