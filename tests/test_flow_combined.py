"""Flow-control rules combined: a backlog held back at the head of a queue never hides an eligible message.

docs/flow-control.md, "Combining rules". Each rule below holds back a
backlog longer than a claim's window of candidates, ahead of one message
that every rule lets through; a claim of one message must take it, and the
rules must still hold for what the claim leaves.
"""

import itertools
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

import django_dbqueue
from django_dbqueue.db.clock import db_now
from django_dbqueue.models import FlowGroup, Message, RateSlot
from django_dbqueue.models.flow import EXTRA_CANDIDATES

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "fc-combined"
BACKLOG = EXTRA_CANDIDATES + 5  # more held-back rows than a claim of one reads past what it wants

# Each rule: its settings, and how it holds a backlog back.
RULES = {
    "group": {"GROUP_CONCURRENCY": 1},
    "kind": {"KIND_GROUP_CONCURRENCY": {"solo": 1}},
    "ordered": {"ORDERED": True},
    "rate": {"RATE_LIMIT": "1000/m"},
    "group-rate": {"RATE_LIMIT": "2/m per group"},
}
# Refused by the system check (ORDERED already runs one at a time), or one setting (RATE_LIMIT) given twice.
REFUSED = {("group", "ordered"), ("kind", "ordered"), ("group-rate", "rate")}
ALLOWED_PAIRS = [pair for pair in itertools.combinations(sorted(RULES), 2) if pair not in REFUSED]


def in_flight(messages):
    """Lease ``messages`` for an hour, as another worker's claim would have."""
    Message.objects.filter(pk__in=[m.pk for m in messages]).update(
        lease_token="other-worker", available_at=db_now("default") + timedelta(hours=1), attempts=1
    )


def hold_back(rule):
    """Enqueue a backlog of BACKLOG messages that ``rule`` holds back; returns their ids."""
    if rule == "group":
        in_flight([django_dbqueue.enqueue(QUEUE, {"running": "g"}, group="held-g")])
        return _backlog(group="held-g")
    if rule == "kind":
        in_flight([django_dbqueue.enqueue(QUEUE, {"running": "k"}, group="held-k", kind="solo")])
        return _backlog(group="held-k", kind="solo")
    if rule == "ordered":
        django_dbqueue.enqueue(QUEUE, {"head": "o"}, group="held-o", delay=3600)  # the head is due in an hour
        return _backlog(group="held-o")
    if rule == "group-rate":
        # Many groups with a ready message each, and the messages of no group, have used their period's budget.
        now = db_now("default")
        scopes = [f"held-r{n}" for n in range(BACKLOG)]
        RateSlot.objects.bulk_create(
            [RateSlot(queue=QUEUE, group=scope, slot=n, used_at=now) for scope in [*scopes, ""] for n in range(2)]
        )
        made = [django_dbqueue.enqueue(QUEUE, {"n": scope}, group=scope) for scope in scopes]
        return {m.pk for m in made} | _backlog(group=None)
    return set()  # a rate for the whole queue holds every message or none: nothing to hide behind


def _backlog(**options):
    made = django_dbqueue.enqueue_many(QUEUE, [{"n": n} for n in range(BACKLOG)], **options)
    return {m.pk for m in made}


@pytest.fixture
def rules(settings):
    def configure(*names):
        queue = {}
        for name in names:
            queue.update(RULES[name])
        settings.DBQUEUE = {"QUEUES": {QUEUE: queue}}

    return configure


@pytest.mark.parametrize("pair", [(rule,) for rule in sorted(RULES)] + ALLOWED_PAIRS, ids="+".join)
def test_a_held_back_backlog_does_not_hide_the_eligible_message_behind_it(rules, pair):
    rules(*pair)
    held = set().union(*(hold_back(rule) for rule in pair))
    eligible = django_dbqueue.enqueue(QUEUE, {"eligible": True}, group="free")
    taken = Message.objects.claim(QUEUE, 1)
    assert [m.pk for m in taken] == [eligible.pk]
    # And the rules hold: nothing held back is taken by a larger claim either.
    more = Message.objects.claim(QUEUE, 100)
    assert not {m.pk for m in more} & held, sorted(m.payload for m in more if m.pk in held)


def test_the_refused_pairs_are_refused_by_the_check():
    from django_dbqueue.conf import find_problems

    for a, b in REFUSED:
        if "rate" in a and "rate" in b:
            continue  # one RATE_LIMIT setting: the pair cannot be written
        queue = {**RULES[a], **RULES[b]}
        assert find_problems({"QUEUES": {"q": queue}}), (a, b)


def test_a_claim_of_one_skips_a_group_another_claim_is_deciding_for(rules):
    """Group a's row is locked by a concurrent claim: a claim of one message takes group b's instead of nothing."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: its one writer serializes claims")
    rules("group")
    first = django_dbqueue.enqueue(QUEUE, {"n": "a"}, group="a")
    django_dbqueue.enqueue(QUEUE, {"n": "b"}, group="b")
    FlowGroup.objects.create(queue=QUEUE, name="a")
    made, opened, release = {}, threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                made["held"] = list(FlowGroup.objects.select_for_update().filter(queue=QUEUE, name="a"))
                opened.set()
                release.wait(60)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(30)
        taken = Message.objects.claim(QUEUE, 1)
    finally:
        release.set()
        holder.join(60)
    assert [m.payload["n"] for m in taken] == ["b"]
    assert [m.pk for m in Message.objects.claim(QUEUE, 1)] == [first.pk]


# --- --until-empty: which held-back messages leave a queue empty ---------------------------------------


def run_until_empty(queue):
    """Run a worker in this process until it finds the queue empty; returns its exit status and its seconds."""
    from django_dbqueue.worker import QueueWorker, WorkerConfig

    started = time.monotonic()
    status = QueueWorker(WorkerConfig(queues=[queue], until_empty=True, max_runtime=60)).run()
    return status, time.monotonic() - started


def test_until_empty_leaves_a_fifo_group_whose_head_is_due_later():
    """The head is due in an hour: its group waits for it, as a scheduled message waits, and the worker exits."""
    from django_dbqueue.worker import ExitStatus

    django_dbqueue.enqueue("fc-fifo", {"n": "head"}, group="a", delay=3600)
    django_dbqueue.enqueue_many("fc-fifo", [{"n": n} for n in range(3)], group="a")
    django_dbqueue.enqueue_many("fc-fifo", [{"n": n} for n in range(2)], group="b")
    status, seconds = run_until_empty("fc-fifo")
    assert status == ExitStatus.OK
    assert seconds < 30, "the worker polled for the held-back group until --max-runtime"
    assert sorted(Message.objects.values_list("group", flat=True)) == ["a"] * 4


def test_until_empty_leaves_a_group_at_its_limit_in_flight_elsewhere(rules):
    from django_dbqueue.worker import ExitStatus

    rules("group", "kind")
    in_flight([django_dbqueue.enqueue(QUEUE, {"running": "g"}, group="a")])
    in_flight([django_dbqueue.enqueue(QUEUE, {"running": "k"}, group="b", kind="solo")])
    django_dbqueue.enqueue_many(QUEUE, [{"n": n} for n in range(3)], group="a")
    django_dbqueue.enqueue_many(QUEUE, [{"n": n} for n in range(3)], group="b", kind="solo")
    assert not Message.objects.any_claimable([QUEUE])
    django_dbqueue.enqueue(QUEUE, {"n": "b"}, group="b")  # another kind of group b: room for it
    assert Message.objects.any_claimable([QUEUE])
    status, seconds = run_until_empty(QUEUE)
    assert status == ExitStatus.OK and seconds < 30
    assert Message.objects.filter(payload__n="b").count() == 0
    assert Message.objects.count() == 8


def test_until_empty_waits_for_a_rate_limit_to_let_the_rest_through():
    """A rate holds a message back for one period at most: the worker waits for it, and drains the queue."""
    from django_dbqueue.worker import ExitStatus

    django_dbqueue.enqueue_many("fc-rate-group", [{"n": n} for n in range(12)], group="a")  # 5/s per group
    status, _ = run_until_empty("fc-rate-group")
    assert status == ExitStatus.OK
    assert not Message.objects.exists()


@pytest.mark.parametrize(
    "limits", [{}, {"GROUP_CONCURRENCY": 2}, {"KIND_GROUP_CONCURRENCY": {"solo": 2}}], ids=["rate", "group", "kind"]
)
def test_a_claim_goes_past_a_group_whose_rate_is_spent_to_the_next_groups(settings, limits):
    """docs/flow-control.md, "Rate limits": a claim of N whose first candidates share a group with one slot
    left takes that one, then the next groups' messages, in claim order; each group's slot is used once."""
    settings.DBQUEUE = {"QUEUES": {QUEUE: {"RATE_LIMIT": "1/m per group", **limits}}}
    kind = "solo" if "KIND_GROUP_CONCURRENCY" in limits else ""
    made = {
        name: django_dbqueue.enqueue(QUEUE, {"n": name}, group=name[0], kind=kind)
        for name in ["a1", "a2", "a3", "b1", "c1"]
    }
    claimed = django_dbqueue.claim(QUEUE, 3)
    assert [m.payload["n"] for m in claimed] == ["a1", "b1", "c1"]
    assert {m.pk for m in claimed} == {made[n].pk for n in ("a1", "b1", "c1")}
    recent = db_now("default") - timedelta(seconds=30)
    assert sorted(RateSlot.objects.filter(queue=QUEUE, used_at__gt=recent).values_list("group", flat=True)) == [
        "a",
        "b",
        "c",
    ]
    assert django_dbqueue.claim(QUEUE, 3) == []  # every group's minute is spent
