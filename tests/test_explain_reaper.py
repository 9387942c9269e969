"""The reaper's and the admin's queries stay index-served on a big table (issue 15).

300,000 live and 1,000,000 archived rows, loaded with one INSERT ... SELECT
each (MariaDB's sequence engine, PostgreSQL's generate_series). Every
SELECT the reaper's steps send, and the admin's exact searches, is run
through EXPLAIN; none may read a queue table in full.
"""

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_dbqueue.db.clock import DbNow
from django_dbqueue.models import ArchivedMessage, Message, Worker
from django_dbqueue.reaper import Reaper
from tests.support.factories import WorkerFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LIVE, ARCHIVED = 300_000, 1_000_000
# The tables that grow with the backlog and the history (the worker table holds one row per process).
GROWING = ("dbqueue_message", "dbqueue_archive")

FILL = {
    "mysql": [
        # Ready messages in 10 queues; every 1,000th leased by a worker that died, some on their last attempt.
        """INSERT INTO dbqueue_message (queue, kind, `key`, payload, headers, priority, available_at,
               first_available_at, created_at, lease_token, claimed_by, attempts)
           SELECT CONCAT('q', seq % 10), '', CONCAT('k', seq), '{{}}', '{{}}', 0,
               UTC_TIMESTAMP(6) - INTERVAL (seq % 1000) SECOND, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR,
               UTC_TIMESTAMP(6) - INTERVAL 1 HOUR,
               IF(seq % 1000 = 0, MD5(seq), NULL), IF(seq % 1000 = 0, 'host:1:dead', ''),
               IF(seq % 1000 = 0, IF(seq % 2000 = 0, 5, 1), 0)
           FROM seq_1_to_{live}""",
        """INSERT INTO dbqueue_archive (message_id, queue, kind, `key`, payload, headers, priority, created_at,
               first_available_at, claimed_at, finished_at, attempts, outcome, finished_by, last_error,
               replayed_by)
           SELECT seq, CONCAT('q', seq % 10), '', CONCAT('a', seq), '{{}}', '{{}}', 0,
               UTC_TIMESTAMP(6) - INTERVAL (seq % 1728000) SECOND, UTC_TIMESTAMP(6) - INTERVAL (seq % 1728000) SECOND,
               UTC_TIMESTAMP(6) - INTERVAL (seq % 1728000) SECOND, UTC_TIMESTAMP(6) - INTERVAL (seq % 1728000) SECOND,
               1, IF(seq % 50 = 0, 'dead', 'acked'), 'w', '', ''
           FROM seq_1_to_{archived}""",
        "ANALYZE TABLE dbqueue_message, dbqueue_archive, dbqueue_worker",
    ],
    "postgresql": [
        """INSERT INTO dbqueue_message (queue, kind, key, payload, headers, priority, available_at,
               first_available_at, created_at, lease_token, claimed_by, attempts)
           SELECT 'q' || (seq % 10), '', 'k' || seq, '{{}}', '{{}}', 0,
               now() - make_interval(secs => seq % 1000), now() - interval '1 hour', now() - interval '1 hour',
               CASE WHEN seq % 1000 = 0 THEN md5(seq::text) END,
               CASE WHEN seq % 1000 = 0 THEN 'host:1:dead' ELSE '' END,
               CASE WHEN seq % 2000 = 0 THEN 5 WHEN seq % 1000 = 0 THEN 1 ELSE 0 END
           FROM generate_series(1, {live}) AS seq""",
        """INSERT INTO dbqueue_archive (message_id, queue, kind, key, payload, headers, priority, created_at,
               first_available_at, claimed_at, finished_at, attempts, outcome, finished_by, last_error,
               replayed_by)
           SELECT seq, 'q' || (seq % 10), '', 'a' || seq, '{{}}', '{{}}', 0,
               now() - make_interval(secs => seq % 1728000), now() - make_interval(secs => seq % 1728000),
               now() - make_interval(secs => seq % 1728000), now() - make_interval(secs => seq % 1728000),
               1, CASE WHEN seq % 50 = 0 THEN 'dead' ELSE 'acked' END, 'w', '', ''
           FROM generate_series(1, {archived}) AS seq""",
        "ANALYZE dbqueue_message",
        "ANALYZE dbqueue_archive",
        "ANALYZE dbqueue_worker",
    ],
}


@pytest.fixture
def big_tables(settings):
    if connection.vendor not in FILL:
        pytest.skip("SQLite has no planner choices worth proving here (one writer, no row locks)")
    # Pruning by queue: two queues with their own retention, the rest by the default.
    settings.DBQUEUE = {"QUEUES": {"q1": {"RETENTION_DAYS": 10}, "q2": {"RETENTION_DAYS": 5}}}
    with connection.cursor() as cursor:
        for sql in FILL[connection.vendor]:
            if sql.startswith("ANALYZE") and not WorkerFactory._meta.model.objects.exists():
                WorkerFactory.create_batch(50)  # alive: their heartbeats are fresh when the reaper looks
                WorkerFactory(stale=True, name="host:1:dead")
            cursor.execute(sql.format(live=LIVE, archived=ARCHIVED))
            if sql.startswith("ANALYZE TABLE"):
                cursor.fetchall()
    yield
    # The test flush DELETEs rows; a million deleted rows leave InnoDB's row
    # estimates off for the next tests (the paginator's): start them empty.
    with connection.cursor() as cursor:
        for table in GROWING:
            cursor.execute(f"TRUNCATE TABLE {table}")


def full_scans(sql: str) -> list[str]:
    """The growing tables this statement reads in full, per EXPLAIN."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"EXPLAIN FORMAT=JSON {sql}")
            plan = json.loads(cursor.fetchone()[0])
            found = []

            def walk(node):
                if isinstance(node, dict):
                    table = node.get("table_name")
                    if table in GROWING and node.get("access_type") == "ALL":
                        found.append(f"{table}: {json.dumps(node)[:300]}")
                    for value in node.values():
                        walk(value)
                elif isinstance(node, list):
                    for value in node:
                        walk(value)

            walk(plan)
            return found
        cursor.execute(f"EXPLAIN {sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        return [line for line in plan.splitlines() if any(f"Seq Scan on {table} " in line for table in GROWING)]


def explain_all(run) -> dict[str, list[str]]:
    """Run ``run`` while capturing its SELECTs; EXPLAIN each as it was sent and collect full scans."""
    problems = {}
    with CaptureQueriesContext(connection) as captured:
        run()
    for query in captured.captured_queries:
        sql = query["sql"]
        if not (sql.lstrip().upper().startswith("SELECT") and "dbqueue_" in sql):
            continue
        # CaptureQueriesContext keeps the SQL with its parameters interpolated: EXPLAIN it as is.
        scans = full_scans(sql)
        if scans:
            problems[sql[:300]] = scans
    return problems


def test_the_admins_exact_searches_and_the_reaper_read_no_queue_table_in_full(big_tables, admin_client):
    # One test, one load of the tables (about 20 s on each server): the admin's reads first, as they
    # change nothing, then a reaper's pass, which releases, dead-letters and prunes.
    problems = {}
    for url in (
        "/admin/django_dbqueue/message/?q=k12345",
        "/admin/django_dbqueue/message/?q=12345",
        "/admin/django_dbqueue/archivedmessage/?q=a54321",
        "/admin/django_dbqueue/archivedmessage/?q=54321",
        "/admin/django_dbqueue/deadletter/?q=a500",
        "/admin/django_dbqueue/message/?queue=q3&kind=",
        "/admin/django_dbqueue/message/",
    ):
        found = explain_all(lambda url=url: admin_client.get(url))
        problems.update(found)
    assert admin_client.get("/admin/django_dbqueue/message/?q=k12345").context["cl"].result_count == 1
    assert Message.objects.filter(key="k12345").exists() and ArchivedMessage.objects.filter(key="a54321").exists()
    assert not problems, json.dumps(problems, indent=1)

    # The admin's reads and their EXPLAINs can take longer than WORKER_STALE_AFTER on a loaded
    # machine: the fifty live workers beat again now, as live workers would have meanwhile.
    Worker.objects.exclude(name="host:1:dead").update(last_heartbeat_at=DbNow())
    reaper = Reaper()
    report = {}

    def one_pass():
        report["pass"] = reaper.run_once()

    problems = explain_all(one_pass)
    assert report["pass"].stale_workers == 1 and report["pass"].released == 150, report["pass"]
    assert report["pass"].poison == 150, report["pass"]  # the dead worker's last attempts
    assert report["pass"].pruned > 0, report["pass"]  # q1 and q2 keep fewer days than the archive holds
    assert not problems, json.dumps(problems, indent=1)
