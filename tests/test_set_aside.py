"""Held-back messages are set aside and brought back (docs/flow-control.md, "Held-back messages are set aside").

The claim's windows are made tiny here (a message or two), so that a
backlog of a dozen rows behaves as one of a hundred thousand does with
the real sizes: the claim sets held-back rows aside to reach past them,
and brings them back, at their own place, when the rules let them through.
"""

import time

import pytest

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message, flow
from django_dbqueue.validation import SET_ASIDE_PRIORITY

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    for name, value in {"EXTRA_CANDIDATES": 0, "FIRST_SCAN": 1, "MIN_SCAN": 1, "SCAN": 3}.items():
        monkeypatch.setattr(flow, name, value)


def set_aside(queue):
    return Message.objects.filter(queue=queue, held_priority__isnull=False)


def drain_one_at_a_time(queue, limit=50):
    """Claim one message at a time and ack it, until none is left; the ids in the order they ran."""
    ran = []
    for _ in range(limit):
        claimed = Message.objects.claim(queue, 1)
        if not claimed:
            break
        (message,) = claimed
        ran.append(message.pk)
        assert message.ack()
    return ran


def test_a_fifo_backlog_is_set_aside_and_comes_back_in_order():
    head = django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="g")
    backlog = [django_dbqueue.enqueue("fc-fifo", {"n": n}, group="g", priority=n % 3) for n in range(1, 12)]
    other = django_dbqueue.enqueue("fc-fifo", {"other": True}, group="h", priority=5)
    (running,) = Message.objects.claim("fc-fifo", 1)
    assert running.pk == head.pk
    # The group's later messages fill the windows; the claims set them aside and reach the other group.
    taken = []
    for _ in range(6):
        taken = Message.objects.claim("fc-fifo", 1)
        if taken:
            break
    assert [m.pk for m in taken] == [other.pk]
    # The window that reached the other group held the last of the backlog too: enough candidates, no set-aside.
    aside = set(set_aside("fc-fifo").values_list("pk", flat=True))
    assert aside <= {m.pk for m in backlog} and len(aside) >= len(backlog) - 2, aside
    for row in set_aside("fc-fifo"):
        assert row.priority == SET_ASIDE_PRIORITY
        assert row.held_priority == next(m.priority for m in backlog if m.pk == row.pk)
    assert Message.objects.filter(pk__in=[m.pk for m in backlog]).ready().count() == len(backlog)
    # Once the head is done, each claim brings back the group's next message: the group runs in order.
    assert running.ack() and taken[0].ack()
    ran = drain_one_at_a_time("fc-fifo")
    assert ran == [m.pk for m in backlog]
    assert not Message.objects.filter(queue="fc-fifo").exists()


def test_a_group_at_its_limit_is_set_aside_and_its_messages_get_their_own_priority_back(settings):
    first = [django_dbqueue.enqueue("fc-groups", {"n": n}, group="g") for n in range(2)]
    running = Message.objects.claim("fc-groups", 2)
    assert {m.pk for m in running} == {m.pk for m in first}
    backlog = [django_dbqueue.enqueue("fc-groups", {"n": n}, group="g", priority=-n) for n in range(8)]
    other = django_dbqueue.enqueue("fc-groups", {"other": True}, group="h", priority=3)
    taken = []
    for _ in range(6):
        taken = Message.objects.claim("fc-groups", 1)
        if taken:
            break
    assert [m.pk for m in taken] == [other.pk]
    assert set_aside("fc-groups").count() >= len(backlog) - 2
    # Nothing of the group can run while its two are in flight: claims bring none of it back.
    assert Message.objects.claim("fc-groups", 5) == []
    assert set_aside("fc-groups").count() == len(backlog)  # that claim set the rest aside
    for message in running:
        assert message.ack()
    claimed = Message.objects.claim("fc-groups", 5)
    assert len(claimed) == 2  # the group's limit
    # They come back with their own priority, and in their group's claim order: the smallest priority first.
    assert [m.priority for m in claimed] == [-7, -6]
    assert all(m.held_priority is None for m in Message.objects.filter(pk__in=[m.pk for m in claimed]))


def test_a_set_aside_message_can_be_cancelled_and_is_archived_with_its_own_priority():
    django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="g")
    Message.objects.claim("fc-fifo", 1)
    later = [django_dbqueue.enqueue("fc-fifo", {"n": n}, group="g", priority=7) for n in range(1, 6)]
    for _ in range(3):
        Message.objects.claim("fc-fifo", 1)
    assert set_aside("fc-fifo").filter(pk=later[1].pk).exists()
    django_dbqueue.cancel(later[1].pk)
    row = ArchivedMessage.objects.get(message_id=later[1].pk)
    assert (row.outcome, row.priority) == ("cancelled", 7)


def test_until_empty_waits_for_a_set_aside_message_the_rules_let_through():
    """`any_claimable` sees set-aside messages as the claim would: held back, no; let through, yes."""
    django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="g")
    (head,) = Message.objects.claim("fc-fifo", 1)
    for n in range(1, 6):
        django_dbqueue.enqueue("fc-fifo", {"n": n}, group="g")
    for _ in range(3):
        assert Message.objects.claim("fc-fifo", 1) == []
    assert set_aside("fc-fifo").exists()
    assert not Message.objects.any_claimable(["fc-fifo"])  # the head runs: the rest waits for it
    assert head.ack()
    assert Message.objects.any_claimable(["fc-fifo"])


def test_a_claim_that_a_per_group_rate_holds_back_says_when_the_next_slot_frees(settings):
    settings.DBQUEUE = {"QUEUES": {"rate-q": {"RATE_LIMIT": "2/m per group"}}}
    django_dbqueue.enqueue_many("rate-q", [{"n": n} for n in range(4)], group="g")
    assert len(Message.objects.claim("rate-q", 2)) == 2
    held = Message.objects.claim("rate-q", 1)
    assert held == []
    assert held.retry_in is not None and 50 < held.retry_in <= 60, held.retry_in


def test_a_process_that_found_none_set_aside_skips_the_look_for_a_while_then_brings_back_what_another_set_aside(
    monkeypatch,
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setattr(flow, "QUIET_ASIDE_SECONDS", 0.5)
    flow._QUIET.clear()
    head = django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="g")
    later = django_dbqueue.enqueue("fc-fifo", {"n": 1}, group="g")

    def looks(queries):  # the look for set-aside messages reads those of SET_ASIDE_PRIORITY (the window: below it)
        return any(f"= {SET_ASIDE_PRIORITY}" in q["sql"] for q in queries)

    with CaptureQueriesContext(connection) as queries:
        (running,) = Message.objects.claim("fc-fifo", 1)  # looks, finds none set aside: quiet from here
    assert looks(queries)
    assert running.pk == head.pk and running.ack()
    # Another process sets the group's next message aside (its head was still running there).
    Message.objects.filter(pk=later.pk).update(held_priority=0, priority=SET_ASIDE_PRIORITY)
    with CaptureQueriesContext(connection) as queries:
        assert Message.objects.claim("fc-fifo", 1) == []
    assert not looks(queries)
    # Past the quiet time, a claim looks again and brings it back, at its own priority.
    taken = []
    for _ in range(50):
        taken = Message.objects.claim("fc-fifo", 1)
        if taken:
            break
        time.sleep(0.05)
    assert [m.pk for m in taken] == [later.pk]
    assert taken[0].priority == 0 and taken[0].held_priority is None


def test_a_priority_of_32767_is_refused():
    from django_dbqueue.exceptions import InvalidOption

    with pytest.raises(InvalidOption, match="from -32768 to 32766"):
        django_dbqueue.enqueue("fc-fifo", {}, priority=SET_ASIDE_PRIORITY)
    assert not Message.objects.exists()


def test_the_migration_back_gives_set_aside_messages_their_own_priority():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="g")
    Message.objects.claim("fc-fifo", 1)
    later = django_dbqueue.enqueue("fc-fifo", {"n": 1}, group="g", priority=4)
    assert Message.objects.claim("fc-fifo", 1) == []
    assert set_aside("fc-fifo").filter(pk=later.pk).exists()
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("django_dbqueue", "0012_worker_pool")])
        with connection.cursor() as cursor:
            cursor.execute("SELECT priority FROM dbqueue_message WHERE id = %s", [later.pk])
            assert cursor.fetchone()[0] == 4
            indexes = connection.introspection.get_constraints(cursor, "dbqueue_message")
            assert "dbqueue_msg_aside" not in indexes
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes("django_dbqueue"))
    with connection.cursor() as cursor:
        assert "dbqueue_msg_aside" in connection.introspection.get_constraints(cursor, "dbqueue_message")
    assert Message.objects.get(pk=later.pk).priority == 4


def test_groups_whose_names_differ_only_in_case_or_a_trailing_space_are_set_aside_and_brought_back_apart():
    names = ["Acme", "acme", "acme "]
    sent = {name: [django_dbqueue.enqueue("fc-fifo", {"n": n}, group=name).pk for n in range(4)] for name in names}
    ran = {name: [] for name in names}
    for _ in range(20):
        # Claim until nothing more may run: the windows are tiny, so the claims set rows aside to reach each head.
        running = []
        for _ in range(12):
            running += Message.objects.claim("fc-fifo", 1)
        if not running:
            break
        groups = [m.group for m in running]
        assert len(groups) == len(set(groups)), f"two messages of one group ran at once: {groups}"
        if not any(ran.values()):
            assert sorted(groups) == sorted(names)
            assert set(set_aside("fc-fifo").values_list("group", flat=True)) == set(names)
        for message in running:
            ran[message.group].append(message.pk)
            assert message.ack()
    assert ran == sent
    assert not Message.objects.filter(queue="fc-fifo").exists()
