"""Lifecycle signals: sent in order, with the right arguments, only once a change is durable."""

import logging
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

import django_dbqueue
from django_dbqueue import control, signals
from django_dbqueue.models import ArchivedMessage, Message, Outcome, events
from django_dbqueue.reaper import Reaper

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def heard():
    """Every signal's events, in the order they were sent, as (name, kwargs)."""
    events = []
    receivers = {}
    for name, signal in signals.SIGNALS.items():

        def receiver(sender, name=name, **kwargs):
            assert sender is Message
            events.append((name, kwargs))

        receivers[name] = receiver
        signal.connect(receiver, weak=False, dispatch_uid=f"test-heard-{name}")
    yield events
    for name, signal in signals.SIGNALS.items():
        signal.disconnect(dispatch_uid=f"test-heard-{name}")


def names(events):
    return [name for name, _ in events]


def test_a_message_s_whole_life_in_order(settings, heard):
    settings.DBQUEUE = {**settings.DBQUEUE, "BACKOFF_BASE": 0}
    sent = django_dbqueue.enqueue("s", {"n": 1}, kind="k", max_attempts=2)
    [first] = django_dbqueue.claim("s", worker="w1")
    assert first.fail("boom once")
    [second] = django_dbqueue.claim("s", worker="w2")
    assert second.fail(ValueError("boom twice"))
    dead = ArchivedMessage.objects.dead().get()
    replayed = control.replay(dead, by="ops")
    [third] = django_dbqueue.claim("s", worker="w3")
    assert third.ack(result={"ok": True})

    assert names(heard) == [
        "enqueued",
        "claimed",
        "failed",
        "claimed",
        "dead_lettered",
        "replayed",
        "claimed",
        "acked",
    ]
    (_, enqueued), (_, claimed), (_, failed), (_, claimed2), (_, died), (_, replay), (_, claimed3), (_, acked) = heard
    assert enqueued["message"].pk == sent.pk and enqueued["queue"] == "s" and enqueued["using"] == "default"
    assert claimed["message"].pk == sent.pk and claimed["worker"] == "w1" and claimed["message"].attempts == 1
    assert failed["message"].pk == sent.pk and failed["error"] == "boom once" and failed["delay"] == 0
    assert claimed2["worker"] == "w2" and claimed2["message"].attempts == 2
    assert died["message"].pk == sent.pk and "ValueError: boom twice" in died["error"]
    assert died["archived"] == dead and died["archived"].outcome == Outcome.DEAD
    assert replay["message"].pk == replayed.pk and replay["archived"].pk == dead.pk and replay["by"] == "ops"
    assert replay["archived"].replayed_as == replayed.pk and replay["archived"].replayed_at is not None
    assert claimed3["message"].pk == replayed.pk
    assert acked["message"].pk == replayed.pk and acked["result"] == {"ok": True} and acked["worker"] == "w3"
    archived = acked["archived"]
    assert archived.outcome == Outcome.ACKED and archived.message_id == replayed.pk and archived.replay_of == dead.pk
    assert archived.finished_at <= timezone.now() + timedelta(minutes=1)  # a datetime the database stored


def test_expired_cancelled_and_rejected(heard):
    stale = django_dbqueue.enqueue("s", {"n": 1}, expires_at=timezone.now() - timedelta(seconds=1))
    unwanted = django_dbqueue.enqueue("s", {"n": 2}, priority=-1)
    assert control.cancel(unwanted, by="ops")
    assert Reaper().run_once().expired == 1
    django_dbqueue.enqueue("s", {"n": 3})
    [message] = django_dbqueue.claim("s")
    message.reject(delay=60, reason="later")
    assert control.run_now(Message.objects.get())
    [message] = django_dbqueue.claim("s")
    message.reject(requeue=False, reason="never")

    assert names(heard) == [
        "enqueued",
        "enqueued",
        "cancelled",
        "expired",
        "enqueued",
        "claimed",
        "failed",
        "claimed",
        "dead_lettered",
    ]
    cancelled, expired, failed, dead = heard[2][1], heard[3][1], heard[6][1], heard[8][1]
    assert cancelled["message"].pk == unwanted.pk and cancelled["by"] == "ops"
    assert cancelled["archived"].outcome == Outcome.CANCELLED
    assert expired["message"].pk == stale.pk and expired["archived"].outcome == Outcome.EXPIRED
    assert expired["archived"].message_id == stale.pk and expired["archived"].pk is not None
    assert (failed["error"], failed["delay"]) == ("later", 60)
    assert dead["error"] == "never" and dead["archived"].last_error == "never"


def test_batches_send_one_event_per_message(heard):
    messages = django_dbqueue.enqueue_many("s", [{"n": n} for n in range(3)])
    django_dbqueue.enqueue("s", {"dup": 1}, key="once")
    django_dbqueue.enqueue("s", {"dup": 2}, key="once")  # found live: nothing inserted, no event
    claimed = django_dbqueue.claim("s", 10, worker="batch")
    assert django_dbqueue.ack_many(claimed) == [True] * 4

    assert names(heard) == ["enqueued"] * 4 + ["claimed"] * 4 + ["acked"] * 4
    assert [e["message"].payload for _, e in heard[:4]] == [{"n": 0}, {"n": 1}, {"n": 2}, {"dup": 1}]
    acked = [e for name, e in heard if name == "acked"]
    assert {e["message"].pk for e in acked} >= {m.pk for m in messages if m.pk}
    assert all(e["archived"].message_id == e["message"].pk and e["worker"] == "batch" for e in acked)


def test_ack_on_a_queue_without_archive_has_no_archived_row(heard):
    django_dbqueue.enqueue("no-archive", {})
    [message] = django_dbqueue.claim("no-archive")
    message.ack()
    assert heard[-1][0] == "acked" and heard[-1][1]["archived"] is None


def test_inside_a_transaction_signals_wait_for_the_commit(heard):
    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        django_dbqueue.enqueue("s", {"n": 1})
        assert heard == []
        raise Rollback
    assert heard == [] and not Message.objects.exists()

    with transaction.atomic():
        kept = django_dbqueue.enqueue("s", {"n": 2})
        assert heard == []  # not durable yet
    assert names(heard) == ["enqueued"] and heard[0][1]["message"].pk == kept.pk


def test_a_receiver_that_raises_is_logged_and_the_operation_stands(heard, caplog):
    def broken(sender, **kwargs):
        raise RuntimeError("receiver bug")

    signals.message_acked.connect(broken, dispatch_uid="test-broken")
    try:
        django_dbqueue.enqueue("s", {})
        [message] = django_dbqueue.claim("s")
        with caplog.at_level(logging.ERROR, logger="django_dbqueue"):
            assert message.ack() is True
    finally:
        signals.message_acked.disconnect(dispatch_uid="test-broken")
    assert ArchivedMessage.objects.acked().count() == 1
    assert "acked" in names(heard)  # the other receiver heard it
    assert "receiver" in caplog.text and "message_acked" in caplog.text and "receiver bug" in caplog.text


def test_without_receivers_no_event_is_built(monkeypatch, settings):
    """The hot path's promise: no receiver, no events built, no archive rows read back."""
    assert not any(events.listened(signal) for signal in signals.SIGNALS.values())

    def forbidden(*args, **kwargs):
        raise AssertionError("signal work done with no receiver connected")

    monkeypatch.setattr(events, "_deliver", forbidden)
    monkeypatch.setattr(events, "settle", forbidden)
    settings.DBQUEUE = {**settings.DBQUEUE, "BACKOFF_BASE": 0}
    django_dbqueue.enqueue_many("s", [{"n": n} for n in range(3)])
    django_dbqueue.enqueue("s", {}, expires_at=timezone.now() - timedelta(seconds=1))
    first, second, third = django_dbqueue.claim("s", 3)
    first.ack()
    second.fail("x")
    third.reject(requeue=False)
    django_dbqueue.ack_many(django_dbqueue.claim("s", 3))
    Reaper().run_once()
    control.replay(ArchivedMessage.objects.dead().get())
    assert Message.objects.count() == 1
