import pytest

import django_dbqueue
from django_dbqueue import control
from django_dbqueue.exceptions import AlreadyReplayed, DuplicateKey, InvalidOption, PayloadNotSerializable
from django_dbqueue.models import ArchivedMessage, Message, Outcome, QueueState
from tests.support.factories import ArchivedMessageFactory

pytestmark = pytest.mark.django_db(transaction=True)


def dead_letter(**fields):
    django_dbqueue.enqueue("q", {"n": 1}, kind="k", headers={"h": 1}, priority=3, **fields)
    [message] = Message.objects.claim("q")
    message.fail("boom", retry=False)
    return ArchivedMessage.objects.dead().get()


def test_replay_makes_a_new_ready_message_and_records_it():
    dead = dead_letter()
    new = control.replay(dead, by="ops")
    stored = Message.objects.ready().get()
    assert stored.pk == new.pk and stored.attempts == 0 and stored.replay_of == dead.pk
    assert (stored.payload, stored.kind, stored.headers, stored.priority) == ({"n": 1}, "k", {"h": 1}, 3)
    dead.refresh_from_db()
    assert dead.replayed_as == new.pk and dead.replayed_by == "ops" and dead.replayed_at is not None
    # The replay's own archive row links back to the dead one.
    [claimed] = Message.objects.claim("q")
    claimed.ack()
    assert ArchivedMessage.objects.acked().get().replay_of == dead.pk


def test_second_replay_is_refused_unless_forced():
    dead = dead_letter()
    control.replay(dead)
    with pytest.raises(AlreadyReplayed, match="force=True"):
        control.replay(dead)
    assert Message.objects.count() == 1
    control.replay(dead, force=True)
    assert Message.objects.count() == 2


def test_edit_and_replay_validates_the_new_payload():
    dead = dead_letter()
    with pytest.raises(PayloadNotSerializable):
        control.replay(dead, payload={"bad": {1, 2}})
    assert not Message.objects.exists()
    assert control.replay(dead, payload={"n": 2}).payload == {"n": 2}


def test_replay_of_acked_is_refused_and_of_live_key_is_a_conflict():
    acked = ArchivedMessageFactory(outcome=Outcome.ACKED)
    with pytest.raises(InvalidOption, match="acked"):
        control.replay(acked)
    dead = dead_letter(key="order-7")
    django_dbqueue.enqueue("q", {}, key="order-7")
    with pytest.raises(DuplicateKey, match="order-7"):
        control.replay(dead)
    dead.refresh_from_db()
    assert dead.replayed_at is None and Message.objects.count() == 1


def test_cancel_run_now_release_and_pause():
    scheduled = django_dbqueue.enqueue("q", {}, delay=3600)
    assert control.run_now(scheduled)
    assert Message.objects.ready().filter(pk=scheduled.pk).exists()
    [claimed] = Message.objects.claim("q")
    assert not control.run_now(claimed)  # in flight: left alone
    assert control.release_lease(claimed)
    assert claimed.ack() is False  # the worker lost it
    assert control.cancel(Message.objects.get(), by="ops") == control.CancelResult.ARCHIVED
    row = ArchivedMessage.objects.get()
    assert row.outcome == Outcome.CANCELLED and row.finished_by == "ops"
    assert control.cancel(claimed) == control.CancelResult.GONE and not control.cancel(claimed)
    control.set_paused("q", True, by="ops")
    assert QueueState.objects.paused_names() == {"q"}
    control.set_paused("q", False)
    assert QueueState.objects.paused_names() == set()


def test_purge_deletes_only_the_dead_rows_named():
    dead, other_dead = ArchivedMessageFactory(dead=True), ArchivedMessageFactory(dead=True)
    acked = ArchivedMessageFactory(outcome=Outcome.ACKED)
    assert control.purge([dead.pk, acked.pk]) == 1
    assert set(ArchivedMessage.objects.values_list("pk", flat=True)) == {other_dead.pk, acked.pk}
    assert control.purge([]) == 0
