"""The queue on a three-node MariaDB Galera cluster whose nodes are killed and cut off while workers drain.

These run in the ``ha-galera`` tox environment, inside ``scripts/galera-cluster
run``: three real nodes in network namespaces of their own, HAProxy in front
(the test database is reached through it), and real ``runqueueworker``
processes. Each test proves the same promise under another failure: every
message is archived exactly once and acked, nothing stays behind, and the
workers live through it. The figures they print (drain rates, seconds without
progress, messages run twice) are the ones docs/high-availability.md gives.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection

from django_dbqueue import enqueue_many
from django_dbqueue.db import errors
from django_dbqueue.db.clock import db_now
from django_dbqueue.reaper import lock_name as reaper_lock_name
from tests.support.processes import LoggedCommands, read_marks, retried, start_command, wait_for

pytestmark = [pytest.mark.galera, pytest.mark.django_db(transaction=True)]

QUEUE = "w-ok"  # tests/testapp/queues.py: marks "done" for each message it runs


@dataclass
class Cluster:
    """The cluster `scripts/galera-cluster run` started: its nodes and the script that kills and cuts them."""

    nodes: list[str]
    script: str

    def __call__(self, *args: object) -> None:
        subprocess.run([self.script, *map(str, args)], check=True, timeout=300)

    def url(self, node: int) -> str:
        """A URL straight to node ``node`` (1-based), past HAProxy."""
        return f"mysql://root@{self.nodes[node - 1]}/test"

    def connect(self, node: int):
        """A driver connection of its own to the test database on node ``node``, with causal reads.

        ``wsrep_sync_wait = 1``: a read first waits until the node applied every
        write the cluster committed before it (a node applies others' writes
        after they commit, so a plain read may not see them yet).
        """
        import MySQLdb

        host, port = self.nodes[node - 1].split(":")
        db = MySQLdb.connect(
            host=host, port=int(port), user="root", database=connection.settings_dict["NAME"], connect_timeout=5
        )
        try:
            db.cursor().execute("SET SESSION wsrep_sync_wait = 1")
        except Exception:
            db.close()
            raise
        return db

    def query(self, node: int, sql: str) -> list[tuple]:
        """``sql`` on the test database of node ``node``, on a connection of its own."""
        db = self.connect(node)
        try:
            cursor = db.cursor()
            cursor.execute(sql)
            return list(cursor.fetchall())
        finally:
            db.close()


@pytest.fixture
def cluster(transactional_db):  # torn down before the test database is emptied
    if connection.vendor != "mysql" or not os.environ.get("DBQUEUE_GALERA_NODES"):
        pytest.skip("needs the cluster of scripts/galera-cluster: tox -e ha-galera")
    cluster = Cluster(os.environ["DBQUEUE_GALERA_NODES"].split(","), os.environ["DBQUEUE_GALERA_SCRIPT"])
    yield cluster
    # Whatever a test did to a node, the next one starts with three nodes Synced.
    for node in (1, 2, 3):
        try:
            cluster.query(node, "SELECT 1")
        except Exception:
            status = subprocess.run([cluster.script, "status"], capture_output=True, text=True).stdout
            line = next(line for line in status.splitlines() if line.startswith(f"node {node} "))
            cluster("restart" if "not running" in line else "heal", node)
    connection.close()  # HAProxy cut it if its node went: the cleanup opens a new one


@pytest.fixture
def workers(tmp_path):
    commands = LoggedCommands(tmp_path)
    yield commands
    commands.close()


@dataclass
class Progress:
    """Samples the archive's row count on one node every 0.1 s, from another thread, for the stalls."""

    cluster: Cluster
    node: int
    samples: list[tuple[float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Progress:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                count = self.cluster.query(self.node, "SELECT COUNT(*) FROM dbqueue_archive")[0][0]
            except Exception:
                continue  # a node being cut off answers late or not at all: the gap shows in the samples
            self.samples.append((time.monotonic(), count))

    def archived(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def longest_stall(self, since: float) -> float:
        """The longest time after ``since`` in which the count did not grow, until it last grew."""
        increases = [t for (_, before), (t, n) in itertools.pairwise(self.samples) if n > before]
        times = [since] + [t for t in increases if t > since]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def writing_node() -> int:
    """The node HAProxy sends the test's connection to, which takes the writes."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@wsrep_node_name")
        return int(cursor.fetchone()[0].removeprefix("node"))


def produce(count: int) -> None:
    for start in range(0, count, 1000):
        enqueue_many(QUEUE, [{"n": n} for n in range(start, min(start + 1000, count))])


def start_workers(workers: LoggedCommands, urls: list[str], marks: Path) -> list[subprocess.Popen[bytes]]:
    # A claim whose commit's answer was lost leaves its batch leased to nobody
    # until the lease ends: a 20 s lease brings it back well within the test.
    args = (QUEUE, "--concurrency", "2", "--batch-size", "20", "--visibility-timeout", "20")
    return [workers.start(*args, marks=marks, DATABASE_URL=url) for url in urls]


def assert_each_acked_once(cluster: Cluster, count: int, marks: Path) -> int:
    """Every message archived once, acked, none left live; how many ran more than once (at least once allows it)."""
    rows = cluster.query(
        2, "SELECT COUNT(*), COUNT(DISTINCT message_id), COALESCE(SUM(outcome = 'acked'), 0) FROM dbqueue_archive"
    )[0]
    assert (rows[0], rows[1], int(rows[2])) == (count, count, count)
    assert cluster.query(2, "SELECT COUNT(*) FROM dbqueue_message")[0][0] == 0
    done = [pk for event, pk, _ in read_marks(marks) if event == "done"]
    assert len(set(done)) == count
    return len(done) - count


def drain(cluster, workers, urls, count, marks, progress_node=2) -> tuple[float, list]:
    """Start workers on ``urls``, wait until ``count`` messages are archived; the seconds it took and the workers."""
    with Progress(cluster, progress_node) as progress:
        started = time.monotonic()
        processes = start_workers(workers, urls, marks)
        wait_for(lambda: progress.archived() >= count, timeout=240, interval=0.2, what=f"{count} messages archived")
    return time.monotonic() - started, processes


def stop_workers(workers: LoggedCommands, processes) -> str:
    """SIGTERM each worker, which must still be running; their output, joined."""
    for process in processes:
        assert process.poll() is None, f"a worker died:\n{workers.output(process)[-4000:]}"
        process.terminate()
    logs = []
    for process in processes:
        status, output = workers.finish(process)
        assert status == 0, output[-4000:]
        logs.append(output)
    return "\n".join(logs)


def conflicts(log: str) -> int:
    """How many of the workers' retries were Galera's certification conflicts (error 1213 at COMMIT)."""
    return sum("1213" in line for line in retried(log))


@pytest.mark.slow
def test_single_writer_rides_over_the_writing_node_killed_and_rejoining(cluster, workers, tmp_path):
    """Workers through HAProxy drain 20,000 messages while the node taking the writes is SIGKILLed and rejoins."""
    count, marks = 20_000, tmp_path / "marks"
    produce(count)
    writer = writing_node()
    with Progress(cluster, 3 if writer != 3 else 2) as progress:
        started = time.monotonic()
        processes = start_workers(workers, [os.environ["DATABASE_URL"]] * 2, marks)
        wait_for(lambda: progress.archived() >= count // 4, timeout=120, interval=0.2, what="a quarter archived")
        killed_at = time.monotonic()
        cluster("kill", writer)
        resumed = progress.archived() + 2000
        wait_for(lambda: progress.archived() >= resumed, timeout=120, interval=0.2, what="progress on the others")
        cluster("restart", writer)  # recovers its position and rejoins by IST while the drain goes on
        wait_for(lambda: progress.archived() >= count, timeout=240, interval=0.2, what="every message archived")
        elapsed = time.monotonic() - started
    log = stop_workers(workers, processes)
    stall = progress.longest_stall(killed_at)
    twice = assert_each_acked_once(cluster, count, marks)
    assert retried(log)  # the lost connections were weather: logged, retried, survived
    print(
        f"single writer, node {writer} killed: {stall:.1f} s without progress, {twice} message(s) run twice; "
        f"{count} messages in {elapsed:.0f} s, kill and rejoin included"
    )


def test_skip_locked_is_local_to_a_node_and_certification_refuses_the_second_claim(cluster):
    """Two nodes lock and lease the same message at once; the second COMMIT fails with 1213, a transient error.

    The claim's statements (its lock and its lease, docs/databases.md), in two
    transactions held open on nodes 1 and 2: SKIP LOCKED skips nothing on
    node 2, since node 1's row lock is not replicated, and both pick the
    message. Galera certifies the first COMMIT and refuses the second: one
    lease, and a retry for the loser.
    """
    import MySQLdb

    (message,) = enqueue_many(QUEUE, [{"n": 1}])
    claim = (
        "SELECT id FROM dbqueue_message WHERE queue = %s AND available_at <= NOW(6) "
        "ORDER BY priority, available_at, id LIMIT 1 FOR UPDATE SKIP LOCKED"
    )
    lease = "UPDATE dbqueue_message SET lease_token = %s, available_at = NOW(6) + INTERVAL 60 SECOND WHERE id = %s"
    first, second = cluster.connect(1), cluster.connect(2)
    try:
        picked = []
        for db in (first, second):
            db.autocommit(False)
            cursor = db.cursor()
            cursor.execute(claim, [QUEUE])
            picked.append(cursor.fetchone()[0])
        assert picked == [message.pk, message.pk]  # node 2 did not see node 1's lock
        for token, db in (("first", first), ("second", second)):
            db.cursor().execute(lease, [token, message.pk])
        first.commit()
        with pytest.raises(MySQLdb.OperationalError) as lost:
            second.cursor().execute("SELECT 1")  # node 1's write set may abort it before its COMMIT
            second.commit()
    finally:
        first.close()
        second.close()
    assert errors.mysql_code(lost.value) == 1213
    assert errors.is_transient(as_django(lost.value), "default")
    assert cluster.query(2, f"SELECT lease_token FROM dbqueue_message WHERE id = {message.pk}") == [("first",)]


@pytest.mark.slow
def test_multi_writer_conflicts_cost_retries_not_messages(cluster, workers, tmp_path):
    """Workers straight to the three nodes claim the same rows; certification conflicts are retried, nothing doubles.

    SKIP LOCKED skips rows locked on the worker's own node only: two nodes
    claim the same message, and the second to commit loses certification
    (1213). The same drain through HAProxy, one node taking the writes, is
    the baseline measured in the same run.
    """
    count = 5_000
    produce(count)
    single, processes = drain(cluster, workers, [os.environ["DATABASE_URL"]] * 3, count, tmp_path / "single")
    single_log = stop_workers(workers, processes)
    assert_each_acked_once(cluster, count, tmp_path / "single")
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM dbqueue_archive")
    produce(count)
    multi, processes = drain(cluster, workers, [cluster.url(n) for n in (1, 2, 3)], count, tmp_path / "multi")
    log = stop_workers(workers, processes)
    twice = assert_each_acked_once(cluster, count, tmp_path / "multi")
    print(
        f"{count} messages, 3 workers x 2 threads: single writer through HAProxy {count / single:.0f}/s "
        f"({conflicts(single_log)} conflicts), one worker per node {count / multi:.0f}/s "
        f"({conflicts(log)} conflicts retried), {single / multi:.2f} times the single writer's rate; "
        f"{twice} message(s) run twice"
    )


def drain_through_a_cut(cluster, workers, tmp_path, cut: str, during=None):
    """Drain 3,000 messages through HAProxy, cutting the writing node (``partition`` or ``isolate``) after a quarter.

    ``during(node)`` runs while the node is cut off; it returns what the test
    asserts on. Returns that, and the seconds without progress after the cut.
    """
    count, marks = 3_000, tmp_path / "marks"
    produce(count)
    writer = writing_node()
    with Progress(cluster, 3 if writer != 3 else 2) as progress:
        processes = start_workers(workers, [os.environ["DATABASE_URL"]] * 2, marks)
        wait_for(lambda: progress.archived() >= count // 4, timeout=120, interval=0.2, what="a quarter archived")
        cut_at = time.monotonic()
        cluster(cut, writer)
        seen = during(writer) if during else None
        wait_for(lambda: progress.archived() >= count, timeout=180, interval=0.2, what="every message archived")
    log = stop_workers(workers, processes)
    cluster("heal", writer)
    twice = assert_each_acked_once(cluster, count, marks)
    assert retried(log)  # the workers met the cut as weather and went on
    stall = progress.longest_stall(cut_at)
    print(f"node {writer} ({cut}): {stall:.1f} s without progress, {twice} message(s) run twice")
    return seen


def test_a_partitioned_node_refuses_with_1047_and_the_workers_go_on_through_the_others(cluster, workers, tmp_path):
    """The writing node is cut off from its peers mid-drain: it refuses with 1047, HAProxy moves the workers on."""

    def refused(node):
        return wait_for(lambda: refusal(cluster, node), timeout=60, interval=0.5, what="the node to refuse")

    error = drain_through_a_cut(cluster, workers, tmp_path, "partition", refused)
    assert errors.mysql_code(error) == 1047 and "WSREP has not yet prepared node" in str(error)
    assert errors.is_transient(as_django(error), "default")


def test_an_isolated_node_loses_its_connections_and_the_workers_go_on_through_the_others(cluster, workers, tmp_path):
    """The writing node's link goes down mid-drain: no answer, no reset; HAProxy's checks fail and it cuts them."""
    drain_through_a_cut(cluster, workers, tmp_path, "isolate")


def test_the_reapers_lock_is_local_to_a_node_and_reapers_racing_archive_each_message_once(cluster):
    """The reaper's lock (GET_LOCK) keeps out a reaper on its own node only; reapers on two others race, safely.

    Galera does not replicate GET_LOCK: with the lock held on node 1, a reaper
    there does nothing, while reapers on nodes 2 and 3 both take it and pass
    over the same expired messages at once. Certification lets one archive
    each message and turns the other's attempt into 1213, retried: nothing is
    archived twice and no reaper fails.
    """
    count = 3_000
    for start in range(0, count, 1000):
        expires_at = db_now("default") + timedelta(seconds=2)
        enqueue_many(QUEUE, [{"n": n} for n in range(start, start + 1000)], expires_at=expires_at)
    time.sleep(3)
    holder = cluster.connect(1)
    try:
        cursor = holder.cursor()
        cursor.execute("SELECT GET_LOCK(%s, 0)", [reaper_lock_name("default")])
        assert cursor.fetchone()[0] == 1
        reapers = [start_command("reapqueue", DATABASE_URL=cluster.url(n)) for n in (1, 2, 3)]
        outputs = [reaper.communicate(timeout=180) for reaper in reapers]
    finally:
        holder.close()
    for reaper, (_, stderr) in zip(reapers, outputs, strict=True):
        assert reaper.returncode == 0, stderr[-4000:]
    stdouts = [stdout.strip() for stdout, _ in outputs]
    assert stdouts[0] == "another reaper holds the lock; nothing done"
    assert "another reaper" not in stdouts[1] and "another reaper" not in stdouts[2]
    rows = cluster.query(
        2, "SELECT COUNT(*), COUNT(DISTINCT message_id), COALESCE(SUM(outcome = 'expired'), 0) FROM dbqueue_archive"
    )[0]
    assert (rows[0], rows[1], int(rows[2])) == (count, count, count)
    assert cluster.query(2, "SELECT COUNT(*) FROM dbqueue_message")[0][0] == 0
    conflicts_retried = sum(stderr.count("1213") for _, stderr in outputs)
    print(f"reapers on nodes 2 and 3 at once: {stdouts[1:]}, {conflicts_retried} conflict(s) retried")


def test_every_table_is_innodb_with_a_primary_key(cluster):
    """Galera replicates InnoDB rows by primary key: a table without one, or of another engine, replicates badly."""
    tables = cluster.query(
        1,
        "SELECT t.table_name, t.engine, c.constraint_name FROM information_schema.tables t "
        "LEFT JOIN information_schema.table_constraints c ON c.table_schema = t.table_schema "
        "AND c.table_name = t.table_name AND c.constraint_type = 'PRIMARY KEY' "
        "WHERE t.table_schema = DATABASE() AND t.table_type = 'BASE TABLE'",
    )
    assert any(name == "dbqueue_message" for name, _, _ in tables)
    assert [(name, engine, key) for name, engine, key in tables if engine != "InnoDB" or key is None] == []


def refusal(cluster: Cluster, node: int) -> Exception | None:
    """The error node ``node`` answers a query with, once it refuses (None while it still answers)."""
    import MySQLdb

    try:
        cluster.query(node, "SELECT COUNT(*) FROM dbqueue_message")
    except MySQLdb.OperationalError as exc:
        return exc if errors.mysql_code(exc) == 1047 else None
    return None


def as_django(driver_error: Exception) -> Exception:
    from django.db.utils import OperationalError

    wrapped = OperationalError(*driver_error.args)
    wrapped.__cause__ = driver_error
    return wrapped
