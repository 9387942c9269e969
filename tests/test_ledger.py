"""The worker's in-flight ledger, without a database: unsaved messages, real threads."""

import itertools
import threading

import pytest

from django_dbqueue.models import Message
from django_dbqueue.worker import Ledger


def messages(*ids):
    return [Message(pk=pk, queue="q", lease_token=f"token-{pk}") for pk in ids]


def pks(items):
    return sorted(message.pk for message in items)


def test_a_message_goes_from_claimed_to_running_to_finished_and_is_counted():
    ledger = Ledger()
    ledger.claimed("a", messages(1, 2, 3))
    assert ledger.in_hand() == 3 and ledger.running() == []
    first = ledger.start("a")
    assert first.pk == 1 and pks(ledger.running()) == [1] and ledger.in_hand() == 3
    assert ledger.finish("a", ok=True).pk == 1
    assert ledger.start("a").pk == 2
    ledger.finish("a", ok=False)
    assert ledger.start("a").pk == 3
    ledger.finish("a")  # nothing written: not counted
    assert ledger.start("a") is None
    assert ledger.counts() == (1, 1) and ledger.counts().total == 2
    assert ledger.is_empty()


def test_dead_letters_are_counted_among_the_failed_and_apart():
    ledger = Ledger()
    ledger.claimed("a", messages(1, 2, 3))
    for ok, dead in ((False, True), (False, False), (True, True)):  # an ok message is never dead
        ledger.start("a")
        ledger.finish("a", ok=ok, dead=dead)
    assert ledger.counts() == (1, 2) and ledger.dead() == 1


def test_finish_is_a_no_op_once_the_running_message_is_gone():
    ledger = Ledger()
    ledger.claimed("a", messages(1))
    ledger.start("a")
    ledger.finish("a", ok=True)
    assert ledger.finish("a", ok=True) is None  # a second finish (the consumer's finally) counts nothing
    assert ledger.counts() == (1, 0)


def test_a_slot_runs_one_message_at_a_time():
    ledger = Ledger()
    ledger.claimed("a", messages(1, 2))
    ledger.start("a")
    with pytest.raises(RuntimeError, match="already runs message 1"):
        ledger.start("a")


def test_acks_wait_for_the_batch_and_count_lost_leases_as_failed():
    ledger = Ledger()
    ledger.claimed("a", messages(1, 2, 3))
    for note in ("v1", "v2"):
        ledger.start("a")
        ledger.await_ack("a", note)
    assert [(m.pk, note) for m, note in ledger.unacked("a")] == [(1, "v1"), (2, "v2")]
    assert ledger.in_hand() == 3 and ledger.running() == []
    assert ledger.counts().total == 0 and ledger.handled() == 2  # run, not written yet (a pool child's limit)
    ledger.start("a")  # the third runs while the first two wait
    ledger.await_ack("a", "v3")
    ledger.acked("a", [True, False])  # the first two were written; the second's lease was lost
    assert [m.pk for m, _ in ledger.unacked("a")] == [3]
    assert ledger.counts() == (1, 1) and ledger.handled() == 3
    ledger.acked("a", [True])
    assert ledger.counts() == (2, 1) and ledger.is_empty() and ledger.handled() == 3


def test_await_ack_needs_a_running_message_and_acked_no_more_than_wait():
    ledger = Ledger()
    with pytest.raises(RuntimeError, match="runs no message"):
        ledger.await_ack("a")
    ledger.claimed("a", messages(1))
    ledger.start("a")
    ledger.await_ack("a")
    with pytest.raises(RuntimeError, match="1 unacked"):
        ledger.acked("a", [True, True])


def test_unacked_is_a_copy():
    ledger = Ledger()
    ledger.claimed("a", messages(1))
    ledger.start("a")
    ledger.await_ack("a")
    ledger.unacked("a").clear()
    assert len(ledger.unacked("a")) == 1


def test_leases_are_everything_held_in_every_slot():
    ledger = Ledger()
    ledger.claimed("a", messages(1, 2))
    ledger.claimed("b", messages(3, 4))
    ledger.start("a")  # 1 runs
    ledger.start("b")
    ledger.await_ack("b")  # 3 waits for its ack
    assert pks(ledger.leases()) == [1, 2, 3, 4]
    assert ledger.unacked("a") == [] and len(ledger.unacked("b")) == 1


def test_take_unstarted_gives_back_only_what_no_slot_started():
    ledger = Ledger()
    ledger.claimed("a", messages(1, 2))
    ledger.claimed("b", messages(3))
    ledger.start("a")
    assert pks(ledger.take_unstarted()) == [2, 3]
    assert ledger.take_unstarted() == []
    assert ledger.start("b") is None  # taken back: never started
    assert pks(ledger.leases()) == [1] and pks(ledger.running()) == [1]


def test_room_keeps_claims_within_the_limit_counting_what_is_in_hand():
    ledger = Ledger()
    assert ledger.room(5, None) == 5
    assert ledger.room(5, 3) == 3
    ledger.claimed("a", messages(1, 2))
    assert ledger.room(5, 3) == 1  # two in hand
    ledger.start("a")
    ledger.finish("a", ok=False)
    assert ledger.room(5, 3) == 1  # one done, one in hand
    ledger.start("a")
    ledger.finish("a", ok=True)
    ledger.claimed("a", messages(3))
    assert ledger.room(5, 3) == 0
    assert ledger.room(5, 2) == 0  # past the limit: never negative


def test_threads_moving_messages_while_others_take_them_back_lose_nothing_and_count_each_once():
    """Consumers claim, run and ack; a shutdown thread takes unstarted messages back meanwhile.

    Every message ends exactly once: counted by its consumer, or taken back.
    """
    ledger = Ledger()
    per_slot, batch = 2000, 7
    taken: list[Message] = []
    ended: dict[int, list[int]] = {slot: [] for slot in range(4)}  # per consumer: what it finished or acked
    done = threading.Event()

    def consume(slot):
        ids = iter(range(slot * per_slot, (slot + 1) * per_slot))
        while True:
            claimed = [Message(pk=pk, queue="q") for pk in itertools.islice(ids, batch)]
            if not claimed:
                return
            ledger.claimed(slot, claimed)
            while (message := ledger.start(slot)) is not None:
                if message.pk % 3:
                    ledger.finish(slot, ok=message.pk % 2 == 0)
                    ended[slot].append(message.pk)
                else:
                    ledger.await_ack(slot, message.pk)
            waiting = ledger.unacked(slot)
            ledger.acked(slot, [note % 2 == 0 for _, note in waiting])
            ended[slot] += [note for _, note in waiting]

    def take_back():
        while not done.is_set():
            taken.extend(ledger.take_unstarted())
            ledger.leases()  # the heartbeat reads meanwhile

    slots = [threading.Thread(target=consume, args=(slot,)) for slot in range(4)]
    taker = threading.Thread(target=take_back)
    taker.start()
    for thread in slots:
        thread.start()
    for thread in slots:
        thread.join(timeout=60)
    done.set()
    taker.join(timeout=60)
    taken.extend(ledger.take_unstarted())
    finished = [pk for pks in ended.values() for pk in pks]
    back = [m.pk for m in taken]
    assert sorted(finished + back) == list(range(4 * per_slot))  # each message once: ended or taken back
    assert ledger.counts() == (sum(pk % 2 == 0 for pk in finished), sum(pk % 2 == 1 for pk in finished))
    assert ledger.is_empty() and ledger.leases() == []


def test_a_claim_under_way_counts_as_held_and_a_closed_ledger_refuses_claims():
    """--until-empty decides with the ledger closed: no claim under way, none may start (docs/workers.md)."""
    ledger = Ledger()
    with ledger.claiming("a") as allowed:
        assert allowed and not ledger.is_empty()  # committed rows not handed over yet are held
        assert not ledger.close_if_empty()
        ledger.claimed("a", messages(1))
    assert not ledger.is_empty() and not ledger.close_if_empty()
    ledger.start("a")
    ledger.finish("a", ok=True)
    assert ledger.is_empty() and ledger.close_if_empty()
    assert not ledger.close_if_empty()  # closed already: one thread decides
    with ledger.claiming("b") as allowed:
        assert not allowed and ledger.is_empty()
    ledger.reopen()
    with ledger.claiming("b") as allowed:
        assert allowed
    assert ledger.is_empty()  # the claim found nothing
