"""Flow control in one process: group limits, FIFO groups, rate limits, unique windows, debounce (docs/flow-control.md).

The queues' settings are in tests/settings.py (``fc-*``). The races between
processes are in tests/test_flow_processes.py.
"""

import contextlib
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

import django_dbqueue
from django_dbqueue.conf import find_problems, parse_rate_limit
from django_dbqueue.exceptions import ImproperlyConfiguredQueue, InvalidOption
from django_dbqueue.models import ArchivedMessage, FlowGroup, Message, RateSlot, UniqueWindow
from django_dbqueue.models.flow import prune
from tests.support.processes import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def claim(queue, limit=50, **options):
    return Message.objects.claim(queue, limit, **options)


# --- group concurrency -----------------------------------------------------------------


def test_a_claim_takes_at_most_the_limit_of_each_group_and_skips_saturated_groups():
    for n in range(6):
        django_dbqueue.enqueue("fc-groups", {"n": n}, group="a")
    django_dbqueue.enqueue("fc-groups", {"n": 6}, group="b")
    django_dbqueue.enqueue("fc-groups", {"n": 7})  # in no group: no limit
    first = claim("fc-groups")
    assert sorted((m.group or "", m.payload["n"]) for m in first) == [("", 7), ("a", 0), ("a", 1), ("b", 6)]
    # Group a is full: the next claim finds its waiting messages and skips them.
    assert claim("fc-groups") == []
    first[0].ack()
    again = claim("fc-groups")
    assert [(m.group, m.payload["n"]) for m in again] == [("a", 2)]


def test_a_group_under_its_limit_is_not_blocked_by_a_saturated_group_ahead_of_it():
    """Head-of-line: 200 waiting messages of a full group come first; a claim still finds group b's."""
    django_dbqueue.enqueue_many("fc-groups", [{"n": n} for n in range(202)], group="a")
    django_dbqueue.enqueue("fc-groups", {"n": "b"}, group="b")
    assert len(claim("fc-groups", 2)) == 2  # group a is full now
    taken = claim("fc-groups", 5)
    assert [(m.group, m.payload["n"]) for m in taken] == [("b", "b")]


def test_a_lease_that_runs_out_gives_the_group_slot_back():
    for n in range(3):
        django_dbqueue.enqueue("fc-groups", {"n": n}, group="a")
    held = claim("fc-groups", visibility_timeout=0.5)
    assert len(held) == 2
    assert claim("fc-groups") == []
    time.sleep(0.7)
    # Both leases ran out: the group has room for two again (a lease that ran out does not keep its place).
    assert len(claim("fc-groups")) == 2


def test_a_kind_with_its_own_limit_counts_its_own_messages_of_the_group():
    for n in range(3):
        django_dbqueue.enqueue("fc-groups", {"n": n}, group="a", kind="solo")
    for n in range(3):
        django_dbqueue.enqueue("fc-groups", {"n": n}, group="a", kind="other")
    taken = claim("fc-groups")
    assert sorted((m.kind, m.payload["n"]) for m in taken) == [("other", 0), ("other", 1), ("solo", 0)]
    # The group is full for the other kinds; a solo message still runs once the running one is done.
    next(m for m in taken if m.kind == "solo").ack()
    assert [(m.kind, m.payload["n"]) for m in claim("fc-groups")] == [("solo", 1)]


def test_a_failed_message_frees_its_slot_while_it_backs_off():
    for n in range(3):
        django_dbqueue.enqueue("fc-groups", {"n": n}, group="a")
    first, _second = claim("fc-groups")
    assert first.fail("boom")
    assert [m.payload["n"] for m in claim("fc-groups")] == [2]


# --- FIFO groups -------------------------------------------------------------------------


def test_an_ordered_queue_runs_one_message_of_a_group_at_a_time_in_enqueue_order():
    for n in range(3):
        django_dbqueue.enqueue("fc-fifo", {"n": n}, group="a", priority=-n)  # priority does not reorder a group
    django_dbqueue.enqueue("fc-fifo", {"n": "b0"}, group="b")
    taken = claim("fc-fifo")
    assert sorted(str(m.payload["n"]) for m in taken) == ["0", "b0"]
    assert claim("fc-fifo") == []
    done = {m.payload["n"]: m for m in taken}
    # A retrying message holds its group: nothing of group a runs while it backs off.
    assert done[0].fail("boom")
    assert claim("fc-fifo") == []
    time.sleep(0.5)
    retried = claim("fc-fifo")
    assert [m.payload["n"] for m in retried] == [0]
    retried[0].ack()
    assert [m.payload["n"] for m in claim("fc-fifo")] == [1]


def test_a_dead_message_lets_its_group_go_on():
    django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="a")
    django_dbqueue.enqueue("fc-fifo", {"n": 1}, group="a")
    (first,) = claim("fc-fifo")
    assert first.fail("bad", retry=False)
    assert [m.payload["n"] for m in claim("fc-fifo")] == [1]


# --- rate limits --------------------------------------------------------------------------


def test_a_rate_limit_lets_no_more_claims_through_in_a_period_and_says_when_to_come_back():
    django_dbqueue.enqueue_many("fc-rate-slow", [{"n": n} for n in range(5)])
    first = claim("fc-rate-slow", 2)
    second = claim("fc-rate-slow", 5)
    assert (len(first), len(second)) == (2, 1)
    held = claim("fc-rate-slow", 5)
    assert held == [] and held.retry_in is not None and 55 < held.retry_in <= 60
    # Held back is not an attempt.
    assert sorted(Message.objects.filter(queue="fc-rate-slow").values_list("attempts", flat=True)) == [0, 0, 1, 1, 1]
    assert RateSlot.objects.filter(queue="fc-rate-slow").count() == 3


@pytest.mark.parametrize("used", [(0, 1, 2), (3, 4, 5), (0, 4, 5)], ids=["kept", "retired", "both"])
def test_a_lowered_rate_limit_counts_the_claims_already_made_in_its_period(settings, used):
    """6/m lowered to 3/m after 3 claims: none more this minute, whichever slots those claims took.

    Which of its free slots a claim takes is the database's choice; the
    test gives the claims' stamps to the slots named by ``used``.
    """
    settings.DBQUEUE = {"QUEUES": {"fc-rate-slow": {"RATE_LIMIT": "6/m"}}}
    django_dbqueue.enqueue_many("fc-rate-slow", [{"n": n} for n in range(8)])
    assert len(claim("fc-rate-slow", 3)) == 3  # 6 slots made, 3 of them used
    slots = RateSlot.objects.filter(queue="fc-rate-slow")
    assert slots.count() == 6
    stamps = sorted(slots.values_list("used_at", flat=True))  # 3 old ones, then the claims' 3
    for slot, used_at in zip([n for n in range(6) if n not in used] + list(used), stamps, strict=True):
        slots.filter(slot=slot).update(used_at=used_at)
    settings.DBQUEUE = {"QUEUES": {"fc-rate-slow": {"RATE_LIMIT": "3/m"}}}
    held = claim("fc-rate-slow", 8)  # 3 claims in this minute already
    assert held == [] and held.retry_in is not None and held.retry_in > 55
    assert slots.count() == 6  # the slots past the new limit are not taken, and count until they age out


def test_a_rate_limit_per_group_counts_each_group_alone():
    for group in ("a", "b"):
        django_dbqueue.enqueue_many("fc-rate-group", [{"n": n} for n in range(8)], group=group)
    taken = claim("fc-rate-group", 50)
    counts = {g: sum(1 for m in taken if m.group == g) for g in ("a", "b")}
    assert counts == {"a": 5, "b": 5}
    assert claim("fc-rate-group", 50) == []
    time.sleep(1.1)
    assert len(claim("fc-rate-group", 50)) == 6


def test_rate_limits_are_parsed_and_bad_ones_named():
    rate = parse_rate_limit("5/s per group")
    assert (rate.count, rate.seconds, rate.per_group, str(rate)) == (5, 1.0, True, "5/s per group")
    assert str(parse_rate_limit(" 20 / m ")) == "20/m"
    for bad in ("100", "100/d", "0/s", "-1/s", 100, "1/s per customer", "100001/s"):
        with pytest.raises(InvalidOption):
            parse_rate_limit(bad)
    problems = find_problems({"QUEUES": {"q": {"RATE_LIMIT": "fast"}, "o": {"ORDERED": True, "GROUP_CONCURRENCY": 2}}})
    assert any("['q']['RATE_LIMIT'] must be a rate" in p for p in problems)
    assert any("['o'] sets ORDERED with GROUP_CONCURRENCY" in p for p in problems)
    assert any("GROUP_CONCURRENCY'] must be >= 1" in p for p in find_problems({"GROUP_CONCURRENCY": 0}))


# --- unique windows and debounce --------------------------------------------------------


def test_a_unique_window_refuses_the_key_until_it_passes_even_after_the_first_finished():
    first = django_dbqueue.enqueue("emails", {"n": 1}, key="k", unique=timedelta(seconds=1))
    assert first.was_created
    (claimed,) = claim("emails")
    claimed.ack()
    again = django_dbqueue.enqueue("emails", {"n": 2}, key="k", unique=timedelta(seconds=1))
    assert not again.was_created and again.pk is None
    assert UniqueWindow.objects.get(queue="emails", key="k").message_id == first.pk
    time.sleep(1.1)
    later = django_dbqueue.enqueue("emails", {"n": 3}, key="k", unique=timedelta(seconds=1))
    assert later.was_created and later.payload == {"n": 3}


def test_a_unique_window_returns_the_live_message_and_a_refusal_does_not_renew_the_window():
    live = django_dbqueue.enqueue("emails", {"n": 1}, key="k")  # until-finished: no window row
    again = django_dbqueue.enqueue("emails", {"n": 2}, key="k", unique=timedelta(minutes=10))
    assert (again.was_created, again.pk, again.payload) == (False, live.pk, {"n": 1})
    assert not UniqueWindow.objects.exists()  # rolled back with the refused insert


def test_debounce_replaces_the_waiting_message_and_pushes_its_time():
    first = django_dbqueue.enqueue("emails", {"v": 1}, key="k", debounce=timedelta(seconds=30), headers={"h": 1})
    time.sleep(0.02)  # SQLite's clock counts milliseconds: two calls in one would get the same time
    second = django_dbqueue.enqueue("emails", {"v": 2}, key="k", debounce=timedelta(seconds=30))
    assert first.was_created and not second.was_created and second.pk == first.pk
    stored = Message.objects.get(pk=first.pk)
    assert stored.payload == {"v": 2} and stored.headers == {}
    assert stored.available_at > first.available_at
    assert Message.objects.filter(queue="emails").count() == 1


def test_debounce_leaves_a_running_message_alone():
    first = django_dbqueue.enqueue("emails", {"v": 1}, key="k", debounce=0.01)
    time.sleep(0.05)
    assert len(claim("emails")) == 1
    again = django_dbqueue.enqueue("emails", {"v": 2}, key="k", debounce=30)
    assert (again.was_created, again.pk) == (False, first.pk)
    assert Message.objects.get(pk=first.pk).payload == {"v": 1}


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"unique": timedelta(seconds=5)}, "give key="),
        ({"debounce": 5}, "give key="),
        ({"key": "k", "unique": "forever"}, "unique must be"),
        ({"key": "k", "unique": timedelta(0)}, "unique must be > 0"),
        ({"key": "k", "debounce": 5, "delay": 3}, "leave out delay"),
        ({"key": "k", "debounce": 5, "unique": 5}, "not both"),
        ({"group": ""}, "group must be a non-empty string"),
        ({"group": "x" * 256}, "group is 256 characters"),
    ],
)
def test_bad_flow_options_are_refused_and_nothing_is_written(options, problem, archive_and_live_counts):
    with pytest.raises(InvalidOption, match=problem):
        django_dbqueue.enqueue("emails", {}, **options)
    assert archive_and_live_counts() == (0, 0)


# --- the reaper's part and the archive --------------------------------------------------


def test_the_archive_keeps_the_group_and_the_reaper_prunes_what_flow_control_left():
    message = django_dbqueue.enqueue("fc-groups", {"n": 1}, group="a", key="k", unique=0.2)
    (claimed,) = claim("fc-groups")
    claimed.ack()
    assert ArchivedMessage.objects.get(message_id=message.pk).group == "a"
    assert FlowGroup.objects.filter(queue="fc-groups", name="a").exists()
    time.sleep(0.3)
    assert prune("default", 100) == 2  # the window passed, the group has no live message
    assert not FlowGroup.objects.exists() and not UniqueWindow.objects.exists()


def test_bad_settings_stop_the_claim_with_their_names(settings):
    settings.DBQUEUE = {"QUEUES": {"q": {"RATE_LIMIT": "many"}}}
    with pytest.raises(ImproperlyConfiguredQueue, match="RATE_LIMIT"):
        claim("q")


def test_the_claim_reads_the_vendor_sql_it_expects():
    """A smoke check that each vendor accepts the four candidate statements."""
    for queue in ("fc-groups", "fc-fifo", "fc-rate", "fc-rate-group"):
        django_dbqueue.enqueue(queue, {}, group="g")
        assert len(claim(queue)) == 1, (queue, connection.vendor)


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no row locks: its one writer serializes claims")
def test_a_locked_head_is_skipped_and_the_message_behind_it_is_not_taken_for_the_head():
    """The FIFO rule reads the group's oldest message without locking it, so a claim holding it hides nothing."""
    head = django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="a")
    django_dbqueue.enqueue("fc-fifo", {"n": 1}, group="a")
    with held_open(lambda: list(Message.objects.select_for_update().filter(pk=head.pk))):
        assert claim("fc-fifo") == []
    assert [m.payload["n"] for m in claim("fc-fifo")] == [0]


def statements_waiting(table):
    """How many sessions wait for a lock in a statement on ``table`` (MySQL/PostgreSQL; not this session's own)."""
    pattern = f"%{table}%"
    with connections["default"].cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s "
                "AND pid <> pg_backend_pid()",
                [pattern],
            )
        else:  # a statement shows in the process list while it runs, and these run only as long as they wait
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND = 'Query' AND INFO LIKE %s "
                "AND ID <> CONNECTION_ID()",
                [pattern],
            )
        return cursor.fetchone()[0]


@pytest.fixture
def unpurged_group_rows():
    """MySQL/MariaDB: rows of ``dbqueue_group`` deleted and not yet purged, as the reaper's prune leaves them.

    InnoDB's checks of a unique key lock the gaps beside such rows, which
    made producers of other groups wait on a busy server, where purge lags.
    A snapshot held open on a connection of its own keeps purge from
    removing them while the test runs.
    """
    if connection.vendor != "mysql":
        yield
        return
    holder = connections.create_connection("default")
    try:
        with holder.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            cursor.execute("SELECT COUNT(*) FROM dbqueue_group")
        for name in ("a", "b", "empty", "held"):
            FlowGroup.objects.create(queue="fc-fifo", name=name)
        FlowGroup.objects.all().delete()
        yield
    finally:
        holder.close()


@contextlib.contextmanager
def held_open(action):
    """Run ``action`` in a transaction on another thread, and keep that transaction open until the block ends.

    Yields a dict whose ``"result"`` is what ``action`` returned.
    """
    made, opened, release = {}, threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                made["result"] = action()
                opened.set()
                release.wait(60)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(30)
        yield made
    finally:
        release.set()
        holder.join(60)


def open_enqueue(queue, group):
    """A producer in another thread enqueues into ``group`` and keeps its transaction open until the block ends."""
    return held_open(lambda: django_dbqueue.enqueue(queue, {"n": "first"}, group=group))


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has one writer: the second producer waits anyway")
@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
def test_producers_of_one_fifo_group_take_turns_so_its_ids_come_in_commit_order(many, unpurged_group_rows):
    """Else the second producer commits first, a claim takes it for the head, and the first runs beside it."""
    made = {}

    def second_producer():
        try:
            if many:
                made["second"], made["third"] = django_dbqueue.enqueue_many(
                    "fc-fifo", [{"n": "second"}, {"n": "third"}, {"n": "fourth"}], group="a"
                )[:2]
            else:
                made["second"] = django_dbqueue.enqueue("fc-fifo", {"n": "second"}, group="a")
        finally:
            connections.close_all()

    second = threading.Thread(target=second_producer)
    try:
        with open_enqueue("fc-fifo", "a") as first:
            django_dbqueue.enqueue("fc-fifo", {"n": "other"}, group="b")  # another group does not wait
            second.start()
            # It waits on the group's row: locking it (MySQL/MariaDB), or inserting it (PostgreSQL).
            wait_for(lambda: statements_waiting("dbqueue_group") or not second.is_alive(), timeout=30, what="it")
            assert second.is_alive(), "the second producer of group a did not wait for the first one's commit"
            assert [m.payload["n"] for m in claim("fc-fifo")] == ["other"]
    finally:
        second.join(30)
    assert first["result"].pk < made["second"].pk
    for n in ("first", "second", "third", "fourth") if many else ("first", "second"):
        (message,) = claim("fc-fifo")
        assert message.payload["n"] == n
        assert message.ack()


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has one writer: producers need no turns")
def test_one_insert_into_several_fifo_groups_locks_their_rows_in_one_statement():
    """Messages of five groups in one insert (as publish and the outbox make): one locking read, not one per group."""
    from django.test.utils import CaptureQueriesContext

    from django_dbqueue.operations import build_message, enqueue_built

    groups = [f"g{n}" for n in range(5)]
    for name in groups:  # rows left by earlier messages of these groups
        FlowGroup.objects.create(queue="fc-fifo", name=name)
    pending = [build_message("fc-fifo", {"n": name}, {"group": name}) for name in groups]
    with CaptureQueriesContext(connection) as captured:
        made = enqueue_built(pending, "default")
    assert sorted(m.group for m in made) == groups
    locks = [q["sql"] for q in captured.captured_queries if "dbqueue_group" in q["sql"] and "FOR UPDATE" in q["sql"]]
    assert len(locks) == 1, locks


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has one writer: a producer holds it all")
def test_the_reaper_skips_a_group_whose_producer_holds_it_and_prunes_the_rest(unpurged_group_rows):
    """The held group looks empty (its message is not committed): waiting for it would stall the reaper."""
    for name in ("empty", "held"):  # rows left by earlier messages of these groups
        FlowGroup.objects.create(queue="fc-fifo", name=name)
    pruned = []

    def reap():
        try:
            pruned.append(prune("default", 100))
        finally:
            connections.close_all()

    with open_enqueue("fc-fifo", "held"):
        reaper = threading.Thread(target=reap)
        reaper.start()
        reaper.join(20)
        assert not reaper.is_alive(), "the reaper waited for the producer's transaction"
    reaper.join(60)
    assert pruned == [1]
    assert list(FlowGroup.objects.values_list("name", flat=True)) == ["held"]
    assert Message.objects.get().group == "held"


@pytest.mark.skipif("connection.vendor != 'mysql'", reason="only InnoDB's locking read outruns its sub-select")
def test_a_claim_on_mysql_takes_only_group_heads_even_when_its_sub_select_misses_their_elders():
    """MySQL/MariaDB: the claim's locking read returns the newest rows, its sub-select of the head an older snapshot.

    A message whose elder committed after that snapshot passes for the
    head. That interleaving falls inside one statement and cannot be timed
    from a test, so the sub-select is made to miss every elder instead (it is
    pointed at a queue with nothing in it); the claim's recheck must still
    leave the second message of the group alone.
    """
    django_dbqueue.enqueue("fc-fifo", {"n": 0}, group="a")
    django_dbqueue.enqueue("fc-fifo", {"n": 1}, group="a")
    django_dbqueue.enqueue("fc-fifo", {"n": "loose"})
    missed = []

    def stale_sub_select(execute, sql, params, many, context):
        if "ORDER BY h." in sql:  # the sub-select of the group's head
            missed.append(sql)
            params = [*params[:-1], "fc-nothing-here"]
        return execute(sql, params, many, context)

    with connection.execute_wrapper(stale_sub_select):
        taken = claim("fc-fifo")
    assert missed
    assert sorted(str(m.payload["n"]) for m in taken) == ["0", "loose"]
