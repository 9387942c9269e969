"""A worker survives its MariaDB server restarting mid-run, and nothing is lost."""

import os
import time

import pytest
from django.db import connection

from tests.support.mariadb_server import MariaDBServer, find
from tests.support.processes import retried, start, start_command, wait_for

MESSAGES = 3000
pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    if connection.vendor != "mysql":
        pytest.skip("the restart test runs in the MariaDB environments")
    if find("mariadbd") is None or find("mariadb-install-db") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the database restart test: mariadbd is missing")
        pytest.skip("mariadbd is not installed")
    server = MariaDBServer(tmp_path)
    server.start()
    server.execute("CREATE DATABASE queue CHARACTER SET utf8mb4")
    yield server
    server.stop()


def on_private_server(server) -> dict[str, str]:
    """Environment that points a child process at the private server."""
    return {"DATABASE_URL": server.url, "DBQUEUE_TEST_DATABASE_NAME": "queue"}


def archived(server, sql="SELECT COUNT(*) FROM dbqueue_archive"):
    try:
        return server.execute(sql, "queue")[0][0]
    except Exception:
        return None  # the server is down


def test_worker_survives_a_database_restart(server):
    migrate = start_command("migrate", "--noinput", **on_private_server(server))
    assert migrate.wait(timeout=120) == 0, migrate.stderr.read()
    produce = start("produce", "w-ok", 0, MESSAGES, 500, **on_private_server(server))
    assert produce.wait(timeout=120) == 0, produce.stderr.read()
    # A claim that committed just as the server went down, its answer lost,
    # leaves its batch leased to nobody until the lease ends: a short lease
    # brings such a batch back well within the wait below.
    worker = start_command(
        "runqueueworker",
        "w-ok",
        "--concurrency",
        "4",
        "--batch-size",
        "10",
        "--visibility-timeout",
        "20",
        **on_private_server(server),
    )
    try:
        wait_for(lambda: (archived(server) or 0) >= MESSAGES // 4, timeout=120, what="a quarter to be acked")
        server.stop()
        time.sleep(3)
        server.start()
        wait_for(lambda: archived(server) == MESSAGES, timeout=240, interval=0.5, what="every message to be acked")
        assert worker.poll() is None, "the worker died with the database"
    finally:
        worker.terminate()
        _, log = worker.communicate(timeout=60)
        print("worker's log:", log)  # shown by pytest when the test failed
    assert retried(log)  # it noticed, logged and carried on
    assert server.execute("SELECT COUNT(*) FROM dbqueue_message", "queue")[0][0] == 0
    rows = server.execute(
        "SELECT COUNT(*), COUNT(DISTINCT message_id), SUM(outcome = 'acked') FROM dbqueue_archive", "queue"
    )[0]
    assert (rows[0], rows[1], int(rows[2])) == (MESSAGES, MESSAGES, MESSAGES)  # each acked exactly once
