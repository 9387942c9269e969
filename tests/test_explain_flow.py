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
from django_dbqueue.models import Message

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
