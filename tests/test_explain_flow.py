"""Flow control's claim stays index-served (docs/flow-control.md, "Cost").

The statements are the exact ones a claim on each kind of controlled queue
runs, captured while it runs, over a backlog of 1,000 groups with messages
of every group in flight, so that a planner would rather scan if the
indexes did not fit.
"""

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

import django_dbqueue
from django_dbqueue.db.clock import db_now
from django_dbqueue.models import Message, RateSlot

pytestmark = pytest.mark.django_db(transaction=True)

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


def captured_claim(queue):
    """The controlled claim's first statement (its SELECT of candidate rows), as it ran."""
    with CaptureQueriesContext(connection) as queries:
        assert Message.objects.claim(queue, 10)
    selects = [q["sql"] for q in queries.captured_queries if "SKIP LOCKED" in q["sql"] and "ORDER BY" in q["sql"]]
    return selects[0]


@pytest.mark.parametrize("queue", ["fc-groups", "fc-fifo", "fc-rate-group"])
def test_the_controlled_claim_walks_the_claim_index_without_a_sort_or_a_full_scan(backlog, queue):
    sql = captured_claim(queue)
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"EXPLAIN FORMAT=JSON {sql}")
            plan = json.dumps(json.loads(cursor.fetchone()[0]))
            assert '"key": "dbqueue_msg_claim"' in plan, plan
            assert '"access_type": "ALL"' not in plan, plan
            assert "filesort" not in plan, plan
            if queue == "fc-groups":  # the groups at their limit: read off the few messages in flight
                assert '"key": "dbqueue_msg_lease"' in plan, plan
        else:
            cursor.execute(f"EXPLAIN {sql}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "dbqueue_msg_claim" in plan, plan
            assert "Seq Scan on dbqueue_message" not in plan, plan
            # The claim index gives the rows in ORDER BY order: a Sort may only order a subquery's few rows.
            assert "Sort Key: dbqueue_message.priority" not in plan, plan


def test_the_fifo_claims_second_read_of_the_heads_on_mysql_reads_the_group_index(backlog):
    if connection.vendor != "mysql":
        pytest.skip("only MySQL/MariaDB read the heads again (docs/flow-control.md, FIFO groups)")
    with CaptureQueriesContext(connection) as queries:
        assert Message.objects.claim("fc-fifo", 10)
    (sql,) = [q["sql"] for q in queries.captured_queries if "MIN(" in q["sql"]]
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


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["fc-groups", "fc-fifo", "fc-rate-group", "fc-combined"])
def test_a_claim_finds_the_eligible_message_behind_100k_held_back_rows_on_its_indexes(settings, queue):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite takes the whole database's write lock; there is no row-level plan to check")
    # A minute's rate, so that the slots stamped before the backlog is written are still in use at the claim.
    queues = {"fc-combined": COMBINED, "fc-rate-group": {"RATE_LIMIT": "5/m per group"}}
    settings.DBQUEUE = {"QUEUES": {**settings.DBQUEUE.get("QUEUES", {}), **queues}}
    eligible = hold_back_100k(queue)
    with CaptureQueriesContext(connection) as queries:
        taken = Message.objects.claim(queue, 1)
    assert [m.pk for m in taken] == [eligible.pk]
    sql = next(q["sql"] for q in queries.captured_queries if "SKIP LOCKED" in q["sql"] and "ORDER BY" in q["sql"])
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"EXPLAIN FORMAT=JSON {sql}")
            plan = json.dumps(json.loads(cursor.fetchone()[0]))
            assert '"key": "dbqueue_msg_claim"' in plan, plan
            assert '"access_type": "ALL"' not in plan, plan
            assert "filesort" not in plan, plan
        else:
            cursor.execute(f"EXPLAIN {sql}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "dbqueue_msg_claim" in plan, plan
            assert "Seq Scan on dbqueue_message" not in plan, plan
            assert "Sort Key: dbqueue_message.priority" not in plan, plan
