"""Flow control's claim stays index-served and bounded (docs/flow-control.md, "Cost").

The statements are the exact ones a claim on each kind of controlled queue
runs, captured while it runs, over a backlog of 1,000 groups with messages
of every group in flight, so that a planner would rather scan if the
indexes did not fit. Then, behind 100,000 held-back rows, the rows a claim
examines are counted by the database itself: they do not grow with the
backlog, once a few claims have set it aside.
"""

import json

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

import django_dbqueue
from django_dbqueue.db.clock import db_now
from django_dbqueue.models import Message, RateSlot, flow

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

GROUPS, PER_GROUP = 1000, 4


@pytest.fixture
def backlog():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite takes the whole database's write lock; there is no row-level plan to check")
    for queue in ("fc-groups", "fc-fifo", "fc-rate-group", "other"):
        payloads = [{"n": n} for n in range(PER_GROUP)]
        for g in range(GROUPS):
            django_dbqueue.enqueue_many(queue, payloads, group=f"g{g}")
        claimed = 0
        while queue != "other" and claimed < 200:  # a claim reads only a little past what it wants
            taken = len(Message.objects.claim(queue, 200 - claimed))
            assert taken
            claimed += taken
    with connection.cursor() as cursor:
        for table in ("dbqueue_message", "dbqueue_group", "dbqueue_rate_slot"):
            cursor.execute(f"ANALYZE TABLE {table}" if connection.vendor == "mysql" else f"ANALYZE {table}")
            if connection.vendor == "mysql":
                cursor.fetchall()


def is_claim(sql):
    """Whether ``sql`` is the controlled claim's SELECT of candidates (it reads whole rows, locked)."""
    return "SKIP LOCKED" in sql and "payload" in sql and sql.startswith("SELECT")


def captured_claim(queue):
    """The controlled claim's first statement (its SELECT of candidate rows), as it ran."""
    with CaptureQueriesContext(connection) as queries:
        assert Message.objects.claim(queue, 10)
    selects = [q["sql"] for q in queries.captured_queries if is_claim(q["sql"])]
    return selects[0]


def tables_in(plan):
    """Every table access of a MySQL/MariaDB JSON plan: (table name, access type, key)."""
    found = []
    if isinstance(plan, dict):
        if "table_name" in plan:
            found.append((plan["table_name"], plan.get("access_type"), plan.get("key")))
        for value in plan.values():
            found += tables_in(value)
    elif isinstance(plan, list):
        for value in plan:
            found += tables_in(value)
    return found


def assert_window_plan(sql):
    """The claim's window is read on the claim index, its rows by primary key; the table is never scanned."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"EXPLAIN FORMAT=JSON {sql}")
            plan = json.loads(cursor.fetchone()[0])
            accesses = tables_in(plan)
            live = [a for a in accesses if not a[0].startswith("<")]  # <derived2>, <subquery3>: the window's rows
            assert ("dbqueue_message", "ref", "dbqueue_msg_claim") in live or (
                "dbqueue_message",
                "range",
                "dbqueue_msg_claim",
            ) in live, accesses
            assert ("dbqueue_message", "eq_ref", "PRIMARY") in live, accesses
            assert all(access != "ALL" for _, access, _ in live), accesses
        else:
            cursor.execute(f"EXPLAIN {sql}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "dbqueue_msg_claim" in plan, plan
            assert "Seq Scan on dbqueue_message" not in plan, plan


def test_the_controlled_claims_window_is_read_on_the_claim_index_and_its_rows_by_primary_key(backlog):
    # Each rule's claim, on one backlog (about 7 s to load on each server).
    for queue in ("fc-groups", "fc-fifo", "fc-rate-group"):
        assert_window_plan(captured_claim(queue))
    if connection.vendor == "mysql":
        assert_fifo_heads_read_on_the_group_index()


def assert_fifo_heads_read_on_the_group_index():
    """MySQL/MariaDB read a FIFO claim's heads again (docs/flow-control.md, FIFO groups): on the group index."""
    with CaptureQueriesContext(connection) as queries:
        assert Message.objects.claim("fc-fifo", 10)
    (sql,) = [q["sql"] for q in queries.captured_queries if "MIN(" in q["sql"] and "GROUP BY" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN FORMAT=JSON {sql}")
        plan = json.dumps(json.loads(cursor.fetchone()[0]))
    assert '"key": "dbqueue_msg_group"' in plan, plan
    assert '"access_type": "ALL"' not in plan, plan


# --- a backlog of 100,000 held-back rows ahead of one eligible message ------------------------------------

HELD_BACK = 100_000
# Every rule at once, each holding a backlog back: the SELECT carries all their filters (docs/flow-control.md).
COMBINED = {"GROUP_CONCURRENCY": 1, "KIND_GROUP_CONCURRENCY": {"solo": 1}, "RATE_LIMIT": "2/m per group"}


def held_back(queue, template, copies):
    """``copies`` more rows like message ``template``, in one INSERT ... SELECT (ten digits joined five times)."""
    digits = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
    joins = " CROSS JOIN ".join(f"({digits}) d{n}" for n in range(5))
    columns = "queue, kind, group_key, payload, headers, priority, available_at, first_available_at, created_at"
    copied = ", ".join(f"m.{c}" for c in columns.split(", "))
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO dbqueue_message ({columns}) SELECT {copied} FROM dbqueue_message m CROSS JOIN {joins} "
            "WHERE m.id = %s AND d0.d * 10000 + d1.d * 1000 + d2.d * 100 + d3.d * 10 + d4.d < %s",
            [template.pk, copies],
        )


def hold_back_100k(queue):
    """A group that ``queue``'s rules hold back, with 100,000 ready messages, and one message they let through."""
    from tests.test_flow_combined import in_flight

    kind = "solo" if queue == "fc-combined" else ""
    if queue == "fc-fifo":
        django_dbqueue.enqueue(queue, {"head": True}, group="held", delay=3600)
    elif queue in ("fc-groups", "fc-combined"):
        in_flight([django_dbqueue.enqueue(queue, {"running": n}, group="held", kind=kind) for n in range(2)])
    if queue in ("fc-rate-group", "fc-combined"):
        now = db_now("default")
        RateSlot.objects.bulk_create([RateSlot(queue=queue, group="held", slot=n, used_at=now) for n in range(5)])
    template = django_dbqueue.enqueue(queue, {"held": True}, group="held", kind=kind)
    held_back(queue, template, HELD_BACK - 1)
    eligible = django_dbqueue.enqueue(queue, {"eligible": True}, group="free")
    with connection.cursor() as cursor:
        for table in ("dbqueue_message", "dbqueue_group", "dbqueue_rate_slot"):
            cursor.execute(f"ANALYZE TABLE {table}" if connection.vendor == "mysql" else f"ANALYZE {table}")
            if connection.vendor == "mysql":
                cursor.fetchall()
    return eligible


def rows_read(action):
    """Run ``action``; the rows the database read for it, by its own counters, and what ``action`` returned.

    MySQL/MariaDB: the session's Handler_read_* counters (every index entry
    and row read, temporary tables included). PostgreSQL: the live table's
    tuples read by sequential and index scans in the transaction
    (pg_stat_xact_user_tables), the action running inside it.
    """
    if connection.vendor == "mysql":

        def count():
            with connection.cursor() as cursor:
                cursor.execute("SHOW SESSION STATUS LIKE 'Handler_read%%'")
                return sum(int(value) for name, value in cursor.fetchall() if name != "Handler_read_retry")

        before = count()
        result = action()
        return count() - before, result
    sql = (
        "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
        "WHERE relname = 'dbqueue_message'"
    )
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql)
        before = cursor.fetchone()[0]
        result = action()
        cursor.execute(sql)
        return cursor.fetchone()[0] - before, result


# Once the backlog is set aside, a claim of one examines at most two windows' worth of rows, each read by
# the candidates' statement and the set-aside one (an index entry and a row each): the rows held back that a
# claim already satisfied left in place are set aside by the next ones. A bound in SCAN, not in the backlog.
BOUNDED = 8 * flow.SCAN


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["fc-groups", "fc-fifo", "fc-rate-group", "fc-combined"])
def test_a_claim_behind_100k_held_back_rows_examines_a_bounded_number_of_rows(settings, queue):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite takes the whole database's write lock; there is no row-level plan to check")
    # A minute's rate, so that the slots stamped before the backlog is written are still in use at the claim.
    queues = {"fc-combined": COMBINED, "fc-rate-group": {"RATE_LIMIT": "5/m per group"}}
    settings.DBQUEUE = {"QUEUES": {**settings.DBQUEUE.get("QUEUES", {}), **queues}}
    eligible = hold_back_100k(queue)
    # The first claims meet the backlog: each examines at most ROUNDS windows and sets their rows aside.
    sweep = flow.ROUNDS * flow.SCAN
    claims, taken = 0, []
    while not taken:
        claims += 1
        assert claims <= HELD_BACK // sweep + 2, "the claims did not reach past the held-back backlog"
        with CaptureQueriesContext(connection) as queries:
            read, taken = rows_read(lambda: Message.objects.claim(queue, 1))
        assert read <= 8 * sweep, f"claim {claims} read {read} rows"
        assert taken == [] or [m.pk for m in taken] == [eligible.pk]
    claim_sql = next(q["sql"] for q in queries.captured_queries if is_claim(q["sql"]))
    assert_window_plan(claim_sql)
    held = Message.objects.filter(queue=queue, group="held")
    assert held.filter(held_priority__isnull=False).count() >= HELD_BACK - sweep, "the backlog was not set aside"
    # From then on a claim reads a few hundred rows, whatever the backlog: not the 100,000.
    for n in range(3):
        another = django_dbqueue.enqueue(queue, {"eligible": n}, group=f"free-{n}")
        read, taken = rows_read(lambda: Message.objects.claim(queue, 1))
        assert [m.pk for m in taken] == [another.pk]
        assert read <= BOUNDED, f"a claim read {read} rows behind a backlog set aside"
    # Nothing was lost: every held-back row is still there, and ready (a set-aside message waits for a rule).
    assert held.ready().count() == HELD_BACK
