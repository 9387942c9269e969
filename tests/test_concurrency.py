"""Real OS processes racing on a real database: nothing lost, nothing twice."""

import time
from collections import Counter

import pytest
from django.db import connection

from django_dbqueue.models import ArchivedMessage, Message
from tests.support.processes import results, start

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CONSUMERS, PRODUCERS = 8, 2


def test_8_consumers_and_2_producers_move_20000_messages_exactly_once():
    # SQLite has one writer at a time: the same race, a smaller load.
    total = 4000 if connection.vendor == "sqlite" else 20000
    per_producer = total // PRODUCERS
    consumers = [start("consume", "race", total, 25, 540) for _ in range(CONSUMERS)]
    producers = [start("produce", "race", n * per_producer, per_producer, 100) for n in range(PRODUCERS)]
    assert [r["produced"] for r in results(producers)] == [per_producer] * PRODUCERS
    acked = [pk for r in results(consumers) for pk in r["acked"]]
    counts = Counter(acked)
    assert len(counts) == total and max(counts.values()) == 1  # every message acked, none twice
    assert Message.objects.filter(queue="race").count() == 0
    archive = ArchivedMessage.objects.filter(queue="race")
    assert archive.count() == total
    assert sorted(row["n"] for row in archive.values_list("payload", flat=True)) == list(range(total))


def test_8_processes_enqueue_the_same_key_and_one_message_results():
    start_at = time.time() + 3  # all children are up and connected by then
    racers = [start("dedup", "dedup", "same-key", start_at) for _ in range(8)]
    outcomes = results(racers)
    assert sum(o["created"] for o in outcomes) == 1
    assert len({o["id"] for o in outcomes}) == 1
    assert Message.objects.filter(queue="dedup", key="same-key").count() == 1
