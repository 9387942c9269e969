"""PostgreSQL with automatic failover: real workers drain while the primary is killed.

Runs in tox env ha-postgres (docs/high-availability.md), which starts a
pg_auto_failover cluster with `scripts/pg-cluster` and points the default
database at both nodes (``host=a,b``, ``target_session_attrs=read-write``),
and a second database, "direct", at the system's PostgreSQL. The primary is
killed (SIGKILL of its keeper and all its postgres processes) while workers
drain; the secondary is promoted and the same worker processes go on by
themselves. The figures printed (seconds without progress, messages run
twice, drain rates) are the ones docs/high-availability.md gives.
"""

from __future__ import annotations

import collections
import itertools
import json
import subprocess
import sys
import time

import pytest
from django.conf import settings
from django.db import connection, connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_dbqueue import enqueue, enqueue_many
from django_dbqueue.models import ArchivedMessage, Message
from tests.support.admin_helpers import changelist, post_action, staff, user_messages
from tests.support.factories import ArchivedMessageFactory
from tests.support.processes import ROOT, LoggedCommands, child_env, read_marks, retried, wait_for

pytestmark = [pytest.mark.ha_postgres, pytest.mark.slow]

CLUSTER = ROOT / "scripts" / "pg-cluster"
MESSAGES = 3000  # on the cluster, 20 ms each: the drain lasts well past the kill
DIRECT = 4000  # on the other server, 10 ms each: they outlast the failover
WORKERS, CONCURRENCY, BATCH = 2, 4, 10
# A lease longer than the failover (a shorter one ends before the acks held through it can be
# written, and the messages run again); a poll only every 30 s, so that a quick wake-up is a NOTIFY's.
VISIBILITY, POLL = 15, 30


@pytest.fixture
def cluster():
    """The cluster the ha-postgres env started; a clear failure when run without it."""
    if (
        connection.vendor != "postgresql"
        or "," not in str(connection.settings_dict["HOST"])
        or "direct" not in connections
    ):
        pytest.fail(
            "the high-availability tests need the cluster: run them with `tox -e ha-postgres` "
            "(docs/high-availability.md), which starts it with scripts/pg-cluster"
        )
    return CLUSTER


def settled(query):
    """``query()`` on the cluster, or None while it fails over (the connection is reopened next time)."""
    try:
        return query()
    except Exception:
        connections.close_all()
        return None


def server_port():
    """The port of the node the default database's connection reached."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT inet_server_port()")
        return cursor.fetchone()[0]


def read_acks(path):
    """``(queue, id, pid, time)`` per ack a worker saw committed (tests/testapp/queues.py's record_ack)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        queue, pk, pid, at = line.split()
        rows.append((queue, int(pk), int(pid), float(at)))
    return rows


def longest_gap(times):
    """The longest time between two acks, and when it began."""
    times = sorted(times)
    gaps = [(later - earlier, earlier) for earlier, later in itertools.pairwise(times)]
    return max(gaps)


@pytest.mark.django_db(transaction=True, databases=["default", "direct"])
def test_workers_ride_over_a_failover_and_the_other_server_keeps_flowing(cluster, tmp_path):
    enqueue_many("ha-drain", [{"n": n, "sleep": 0.02} for n in range(MESSAGES)])
    enqueue_many("ha-direct", [{"n": n, "sleep": 0.01} for n in range(DIRECT)])
    marks, acks = tmp_path / "marks", tmp_path / "acks"
    workers = LoggedCommands(tmp_path)
    options = ["--concurrency", CONCURRENCY, "--batch-size", BATCH, "--visibility-timeout", VISIBILITY]
    # A poll only every 30 s: a message enqueued while they idle is picked up
    # within seconds only if a NOTIFY woke them.
    polling = ["--poll-interval", POLL, "--max-poll-interval", POLL]
    try:
        drainers = [
            workers.start("ha-drain", *options, *polling, marks=marks, DBQUEUE_TEST_ACKS=str(acks))
            for _ in range(WORKERS)
        ]
        # Its own marks: ids on the two servers overlap.
        other = workers.start(
            "ha-direct", "--concurrency", 2, marks=tmp_path / "marks-direct", DBQUEUE_TEST_ACKS=str(acks)
        )

        def drained():
            return [a for a in read_acks(acks) if a[0] == "ha-drain"]

        wait_for(lambda: len(drained()) >= MESSAGES // 20, timeout=120, interval=0.1, what="the drain to start")
        primary = server_port()
        kill_started = time.time()
        killed = subprocess.run([cluster, "kill", "primary"], capture_output=True, text=True, timeout=60)
        killed_at = time.time()
        assert killed.returncode == 0, killed.stderr
        connections.close_all()
        wait_for(
            lambda: settled(lambda: ArchivedMessage.objects.filter(queue="ha-drain").count() == MESSAGES),
            timeout=180,
            interval=0.5,
            what="every message on the cluster to be acked",
        )

        assert server_port() != primary  # the secondary took over
        # Wake-ups resume on the new primary: the workers idle, polling every 30 s.
        time.sleep(2)
        woken = enqueue("ha-drain", {"n": "after"})
        enqueued_at = time.time()
        wait_for(lambda: woken.pk in {a[1] for a in drained()}, timeout=60, interval=0.05, what="the late message")
        wake_latency = time.time() - enqueued_at
        for worker in (*drainers, other):
            assert worker.poll() is None, f"a worker died with the primary:\n{workers.output(worker)[-4000:]}"
        for worker in (*drainers, other):
            worker.terminate()
        logs = [workers.finish(worker)[1] for worker in drainers]
    finally:
        workers.close()

    # Nothing lost, nothing archived twice: each message acked exactly once.
    assert not Message.objects.filter(queue="ha-drain").exists()
    archived = list(ArchivedMessage.objects.filter(queue="ha-drain").values_list("message_id", "outcome"))
    assert len(archived) == MESSAGES + 1
    assert len({pk for pk, _ in archived}) == MESSAGES + 1
    assert {outcome for _, outcome in archived} == {"acked"}
    # An ack a worker saw committed survived the failover: it is in the archive of the new
    # primary, and its message never ran again to be acked a second time.
    acked = collections.Counter(pk for queue, pk, _, _ in read_acks(acks) if queue == "ha-drain")
    assert set(acked) <= {pk for pk, _ in archived}
    assert max(acked.values()) == 1
    # At least once: a message runs twice only when the reply of its ack (or of its claim) was lost.
    runs = collections.Counter(pk for event, pk, _ in read_marks(marks) if event == "done")
    twice = sorted(pk for pk, count in runs.items() if count > 1 and pk in dict(archived))
    assert len(twice) <= WORKERS * CONCURRENCY * BATCH, twice
    assert any(retried(log) for log in logs)  # they met the failover, and said so

    times = sorted(at for queue, _, _, at in read_acks(acks) if queue == "ha-drain" and at < enqueued_at)
    assert len([at for at in times if at > killed_at]) >= MESSAGES // 4  # the kill came mid-drain
    # The failover's stall: the longest pause in the acks that began while the kill ran (the
    # primary died at some moment of it; the kill takes seconds on a loaded machine).
    gap, gap_from = max(
        (later - earlier, earlier)
        for earlier, later in itertools.pairwise(times)
        if kill_started - 1 <= earlier <= killed_at + 1
    )
    assert gap >= 1, f"no stall while the primary was killed ({gap:.2f} s): was it killed?"
    # The longest stall may come later: a claim whose reply the failover cut leaves its batch
    # leased until the lease ends, and no NOTIFY says so: until the next poll (30 s here).
    longest, _ = longest_gap(times)
    assert longest <= gap + VISIBILITY + POLL + 5
    # The other server's queue flowed while the cluster had none: acks inside the gap.
    direct = [at for queue, _, _, at in read_acks(acks) if queue == "ha-direct"]
    during = [at for at in direct if gap_from < at < gap_from + gap]
    assert len(during) >= gap * 2, f"{len(during)} acks on the other server in the cluster's {gap:.1f} s gap"
    assert wake_latency < 10, f"the late message took {wake_latency:.1f} s: no NOTIFY woke the workers"
    rate = len(times) / (max(times) - min(times))
    print(
        f"\nFAILOVER: {gap:.1f} s without an ack on the cluster (longest stall {longest:.1f} s); "
        f"{len(twice)} of {MESSAGES} messages ran twice "
        f"({len(acked)} acks seen committed, all kept); drain {rate:.0f}/s across the failover with "
        f"{WORKERS}x{CONCURRENCY} consumers; other server {len(during)} acks during the gap; "
        f"a wake-up after it came in {wake_latency:.2f} s"
    )


@pytest.fixture
def pgbouncer():
    """PgBouncer's alias; afterwards its server connections to the test database are closed (its
    admin console's KILL), so that the test run can drop it; the test's own connection goes first."""
    if "bouncer" not in connections:
        pytest.fail("needs DBQUEUE_PGBOUNCER_URL: run with `tox -e ha-postgres`")
    yield "bouncer"
    bouncer = connections["bouncer"]
    bouncer.close()
    settings = bouncer.settings_dict
    console = [
        "psql",
        "-X",
        "-q",
        "-h",
        settings["HOST"],
        "-p",
        str(settings["PORT"]),
        "-U",
        "postgres",
        "-d",
        "pgbouncer",
    ]
    subprocess.run(
        [*console, "-c", f"KILL {settings['NAME']}", "-c", f"RESUME {settings['NAME']}"],
        capture_output=True,
        timeout=30,
        check=True,
    )


@pytest.mark.django_db(transaction=True, databases=["default", "direct", "bouncer"])
def test_producers_workers_and_the_reaper_through_pgbouncer_in_transaction_pooling(pgbouncer, tmp_path):
    """PgBouncer in transaction pooling (scripts/pg-cluster, in front of the local server): producers,
    a worker and the reaper go through it; the worker LISTENs on the direct connection that
    POOLED_DATABASES names, so that a NOTIFY still wakes it."""
    with connections["bouncer"].cursor() as cursor:  # the pooler, not the server: another port
        cursor.execute("SELECT inet_server_port()")
        assert cursor.fetchone()[0] != int(connections["bouncer"].settings_dict["PORT"])
    enqueue_many("ha-bouncer", [{"n": n} for n in range(MESSAGES // 10)])
    acks = tmp_path / "acks"
    workers = LoggedCommands(tmp_path)
    pooled = {"POOLED_DATABASES": {"bouncer": "direct"}}
    try:
        worker = workers.start(
            "ha-bouncer",
            "--concurrency",
            CONCURRENCY,
            "--poll-interval",
            30,
            "--max-poll-interval",
            30,
            DBQUEUE_TEST_SETTINGS=json.dumps(pooled),
            DBQUEUE_TEST_ACKS=str(acks),
        )
        archive = ArchivedMessage.objects.using("bouncer").filter(queue="ha-bouncer")
        wait_for(lambda: archive.count() == MESSAGES // 10, timeout=120, interval=0.2, what="the drain")
        time.sleep(2)  # idle now: only a NOTIFY, heard on the direct connection, wakes it within 30 s
        woken = enqueue("ha-bouncer", {"n": "after"})
        enqueued_at = time.time()
        wait_for(lambda: woken.pk in {a[1] for a in read_acks(acks)}, timeout=60, interval=0.05, what="a wake-up")
        wake_latency = time.time() - enqueued_at
        reaper = subprocess.run(
            [sys.executable, "-m", "django", "reapqueue", "--database", "bouncer"],
            cwd=ROOT,
            env=child_env(DBQUEUE_TEST_SETTINGS=json.dumps(pooled)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert reaper.returncode == 0, reaper.stderr
        worker.terminate()
        status, log = workers.finish(worker)
    finally:
        workers.close()
    assert status == 0, log
    assert "ERROR" not in log and "prepared statement" not in log, log
    assert archive.count() == MESSAGES // 10 + 1
    assert set(archive.values_list("outcome", flat=True)) == {"acked"}
    assert wake_latency < 10, f"the message enqueued while the worker idled took {wake_latency:.1f} s"
    print(f"\nPGBOUNCER: a wake-up through the direct LISTEN connection came in {wake_latency:.2f} s")


class _EverythingThroughTheBouncer:
    """A router for a project whose only database sits behind PgBouncer: every read and write goes there."""

    def db_for_read(self, model, **hints):
        return "bouncer"

    def db_for_write(self, model, **hints):
        return "bouncer"

    def allow_relation(self, *objects, **hints):
        return True


@pytest.mark.django_db(transaction=True, databases=["default", "direct", "bouncer"])
def test_the_admin_through_pgbouncer_in_transaction_pooling(pgbouncer, client):
    """The operators' admin on a database behind PgBouncer (transaction pooling), the queues' database
    and, through a router, every model's: the login's session, every list page, a message's page and a
    replay. Each page is asked for more times than psycopg's
    prepare threshold (5): a statement psycopg prepared on one server connection and ran on another
    would fail here (Django binds on the client by default, and so prepares nothing; check W005 warns
    when server-side binding is turned on without prepare_threshold=None)."""
    behind = {**settings.DBQUEUE, "DATABASE": "bouncer", "POOLED_DATABASES": {"bouncer": "direct"}}
    with override_settings(DATABASE_ROUTERS=[_EverythingThroughTheBouncer()], DBQUEUE=behind):
        views = ("view_message", "view_archivedmessage", "view_deadletter", "view_queuestate", "view_workflowrun")
        client.force_login(staff("ops", *views, "replay_archivedmessage"))
        live = enqueue("ha-bouncer", {"n": "live"})
        dead = ArchivedMessageFactory(dead=True, queue="ha-bouncer", payload={"n": "dead"}, message_id=10**12)
        pages = [changelist(model) for model in ("queuestate", "message", "archivedmessage", "deadletter")]
        pages += [changelist("workflowrun"), reverse("admin:django_dbqueue_message_change", args=[live.pk])]
        with CaptureQueriesContext(connections["bouncer"]) as pooled, CaptureQueriesContext(connection) as other:
            for _ in range(7):
                for page in pages:
                    response = client.get(page)
                    assert response.status_code == 200, (page, response.status_code)
        assert len(pooled) >= 7 * len(pages), "the pages read through the pooler"
        assert not other.captured_queries, [q["sql"] for q in other.captured_queries]  # and only there
        assert str(live.pk) in client.get(changelist("message")).content.decode()
        response = post_action(client, "deadletter", "replay", [dead.pk])
        assert "1 replayed." in user_messages(response)
    replayed = Message.objects.using("bouncer").get(replay_of=dead.pk)
    assert replayed.payload == {"n": "dead"}
    assert Message.objects.using("direct").filter(pk=replayed.pk).exists()  # through the pooler, on the server
