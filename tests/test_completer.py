"""The worker's completer: acks written beside the consumers, together when they wait, never waited for in vain.

The worker runs in this process so that the model layer's writes can be
held on cue. The first two tests hold the first acknowledgement until the
consumers have done what the completer is for (claimed again, handed over
more), with a generous bound: where a consumer waited for its own acks,
the hold would run out and the first test fail; where the completer wrote
each handover alone, the second. The third crashes the completer.
"""

import logging
import threading
import time

import pytest
from django.db import DataError

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message, MessageQuerySet, Outcome, Worker
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from django_dbqueue.worker.completer import Completer

pytestmark = pytest.mark.django_db(transaction=True)

BOUND = 30  # seconds a held write waits for what it waits for


def run(**options) -> ExitStatus:
    return QueueWorker(WorkerConfig(queues=["w-ok"], until_empty=True, max_runtime=120, **options)).run()


def acked_once(sent) -> bool:
    rows = list(ArchivedMessage.objects.values_list("message_id", "outcome"))
    return sorted(rows) == sorted((m.pk, Outcome.ACKED) for m in sent) and not Message.objects.exists()


def test_a_consumer_claims_its_next_batch_while_its_last_acks_are_written(monkeypatch):
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(4)])
    real_claim, real_ack_many, real_hand_over = MessageQuerySet.claim, MessageQuerySet.ack_many, Completer.hand_over
    handed, written, claimed_meanwhile = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def hand_over(self, *args, **kwargs):
        handover = real_hand_over(self, *args, **kwargs)
        handed.set()
        return handover

    def claim(self, *args, **kwargs):
        if handed.is_set() and not written.is_set():
            claimed_meanwhile.set()
        return real_claim(self, *args, **kwargs)

    def ack_many(self, messages, **kwargs):
        if not seen:
            seen.append(claimed_meanwhile.wait(BOUND))  # the first batch's acks, held until the next claim starts
            written.set()
        return real_ack_many(self, messages, **kwargs)

    monkeypatch.setattr(Completer, "hand_over", hand_over)
    monkeypatch.setattr(MessageQuerySet, "claim", claim)
    monkeypatch.setattr(MessageQuerySet, "ack_many", ack_many)
    assert run(batch_size=2) == ExitStatus.OK
    assert seen == [True]
    assert acked_once(sent)


@pytest.mark.parametrize("refused", [False, True], ids=["written", "refused-together"])
def test_handovers_that_wait_are_written_together_or_each_alone(monkeypatch, caplog, refused):
    """Three consumers: while the first write is held, the others hand theirs over; what waits goes in one write.

    ``refused``: that write fails for good (a value one batch holds); each
    handover is then written alone, and every message is still acked once.
    """
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(9)])
    real_ack_many, real_hand_over = MessageQuerySet.ack_many, Completer.hand_over
    calls: list[list[int]] = []
    refusals: list[list[int]] = []
    handed = threading.Semaphore(0)

    def hand_over(self, *args, **kwargs):
        handover = real_hand_over(self, *args, **kwargs)
        handed.release()
        return handover

    def ack_many(self, messages, **kwargs):
        messages = list(messages)
        calls.append([m.pk for m in messages])
        if len(calls) == 1:
            for _ in range(3):  # one handover of each consumer
                assert handed.acquire(timeout=BOUND)
        if refused and len(messages) > 1 and not refusals:
            refusals.append(calls[-1])
            raise DataError("value too long for the column (a stand-in)")
        return real_ack_many(self, messages, **kwargs)

    monkeypatch.setattr(Completer, "hand_over", hand_over)
    monkeypatch.setattr(MessageQuerySet, "ack_many", ack_many)
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        assert run(concurrency=3, batch_size=1) == ExitStatus.OK
    merged = next(n for n, call in enumerate(calls) if len(call) > 1)  # handovers that waited, in one write
    assert merged <= 1
    if refused:
        # Each of them again, alone, and each alone goes through.
        again = calls[merged + 1 : merged + 1 + len(calls[merged])]
        assert refusals == [calls[merged]] and [len(c) for c in again] == [1] * len(calls[merged])
        assert sorted(pk for c in again for pk in c) == sorted(calls[merged])
    assert "one by one" not in caplog.text
    assert acked_once(sent)


def test_a_crashed_completer_stops_the_worker_and_no_consumer_waits_for_it(monkeypatch, caplog):
    """A bug in the completer's thread: the worker exits with an error at once; the acks' leases will expire."""

    def write(self, handovers):
        raise ZeroDivisionError("completer bug")

    monkeypatch.setattr(Completer, "write", write)
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(3)])
    worker = QueueWorker(WorkerConfig(queues=["w-ok"], until_empty=True, max_runtime=120))
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        assert worker.run() == ExitStatus.ERROR
    assert time.monotonic() - started < 60  # not the max runtime: nobody waited for the dead thread
    assert "thread dbqueue-completer crashed; the worker stops" in caplog.text
    assert "ZeroDivisionError: completer bug" in caplog.text
    # The message the consumer ran stays leased (its ack was not written); the worker's row stays for the reaper.
    held = set(Message.objects.in_flight().values_list("pk", flat=True))
    assert held and held <= {m.pk for m in sent}
    assert not ArchivedMessage.objects.exists()
    assert Worker.objects.filter(name=worker.name).exists()
