"""The errors queue operations retry, as the real drivers raise them.

A database restart first drops connections, then refuses new ones until it
is up again; both must read as weather (retried), not as a caller's bug.
"""

import logging
import socket
import sqlite3

import pytest
from django.db import DatabaseError, connection
from django.db.utils import OperationalError

from django_dbqueue.db import errors


def closed_port() -> int:
    """A local port nothing listens on: connecting there is refused, as during a restart."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def as_django_error(driver_error: Exception) -> OperationalError:
    """Wrap a driver's error the way Django's backends do (the driver's error as the cause)."""
    wrapped = OperationalError(*driver_error.args)
    wrapped.__cause__ = driver_error
    return wrapped


def test_a_refused_connection_is_retried():
    if connection.vendor == "mysql":
        import MySQLdb

        with pytest.raises(MySQLdb.OperationalError) as caught:
            MySQLdb.connect(host="127.0.0.1", port=closed_port(), user="root", connect_timeout=5)
    elif connection.vendor == "postgresql":
        import psycopg

        with pytest.raises(psycopg.OperationalError) as caught:
            psycopg.connect(host="127.0.0.1", port=closed_port(), user="postgres", connect_timeout=5)
    else:
        pytest.skip("SQLite has no server to refuse a connection")
    assert errors.is_transient(as_django_error(caught.value), "default")


def test_a_locked_sqlite_database_is_retried_and_a_bad_statement_is_not(tmp_path):
    if connection.vendor != "sqlite":
        pytest.skip("the lock error is SQLite's")
    path = tmp_path / "locked.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        other.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.OperationalError) as bad:
        other.execute("INSERT INTO no_such_table VALUES (1)")
    holder.close()
    other.close()
    assert errors.is_transient(as_django_error(locked.value), "default")
    assert not errors.is_transient(as_django_error(bad.value), "default")


@pytest.mark.django_db(transaction=True)
def test_a_galera_node_without_quorum_is_retried_on_a_new_connection():
    """Error 1047 ("WSREP has not yet prepared node for application use") is weather, and its connection is dropped.

    A Galera node cut off from the cluster keeps its connections open and refuses
    every statement on them until it rejoins; only a new connection, which a load
    balancer sends to a node that has quorum, can go on. The error is the driver's
    own, injected here; tests/test_galera.py meets the real one on a partitioned node.
    """
    if connection.vendor != "mysql":
        pytest.skip("error 1047 is MariaDB Galera's")
    import MySQLdb

    refused = as_django_error(MySQLdb.OperationalError(1047, "WSREP has not yet prepared node for application use"))
    assert errors.is_transient(refused, "default")
    assert not errors.outcome_unknown(refused, "default")  # refused before it did anything
    connection.ensure_connection()
    first = connection.connection
    calls = []

    def operation():
        calls.append(connection.connection)
        if len(calls) == 1:
            raise refused
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return cursor.fetchone()[0]

    assert errors.with_retries("default", operation, what="a claim") == 1
    assert len(calls) == 2
    assert connection.connection is not first  # the node's connection was closed, a new one made


@pytest.mark.django_db(transaction=True)
def test_a_galera_node_losing_quorum_under_a_write_is_weather_as_1047():
    """A write or COMMIT on a node that has just lost quorum fails with 1180 naming the Primary Component (seen
    in tests/test_galera.py's partition); nothing was replicated. Any other 1180 stays an error."""
    if connection.vendor != "mysql":
        pytest.skip("MariaDB Galera's errors")
    import MySQLdb

    lost = as_django_error(
        MySQLdb.OperationalError(
            1180,
            "Error while appending streaming replication fragment(provider status: Not connected to Primary Component)",
        )
    )
    assert errors.is_transient(lost, "default") and errors.wrong_node(lost, "default")
    assert not errors.outcome_unknown(lost, "default")
    other = as_django_error(MySQLdb.OperationalError(1180, "Got error 5 during COMMIT"))
    assert not errors.is_transient(other, "default")


def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("the errors of a PostgreSQL failover")


def test_a_refused_multi_host_connection_and_a_read_only_node_are_retried():
    """What a multi-host connection string raises while no node takes writes: every host refusing,
    and the only host up refused by target_session_attrs=read-write (a standby not yet promoted)."""
    postgres_only()
    import psycopg

    params = connection.get_connection_params()
    hosts = {"host": "127.0.0.1,127.0.0.1", "port": f"{closed_port()},{closed_port()}", "connect_timeout": 5}
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(user=params["user"], dbname=params["dbname"], **hosts)
    read_only = {"options": "-c default_transaction_read_only=on", "target_session_attrs": "read-write"}
    with pytest.raises(psycopg.OperationalError) as standby:
        psycopg.connect(**params, **read_only)
    assert "read-only" in str(standby.value)
    for caught in (refused, standby):
        assert errors.is_transient(as_django_error(caught.value), "default")


def test_an_administrator_shutdown_is_retried_as_an_unknown_outcome(django_db_blocker):
    """57P01: what a connection gets when its server stops or pg_auto_failover restarts it (demotion)."""
    postgres_only()
    import psycopg

    with django_db_blocker.unblock(), psycopg.connect(**connection.get_connection_params()) as victim:
        pid = victim.info.backend_pid
        with psycopg.connect(**connection.get_connection_params(), autocommit=True) as killer:
            killer.execute("SELECT pg_terminate_backend(%s)", [pid])
        with pytest.raises(psycopg.OperationalError) as shutdown:
            victim.execute("SELECT 1")
    assert shutdown.value.sqlstate == "57P01"
    error = as_django_error(shutdown.value)
    assert errors.is_transient(error, "default")
    assert errors.outcome_unknown(error, "default")  # a COMMIT cut so may have landed


@pytest.mark.django_db(transaction=True)
def test_a_write_refused_by_a_read_only_node_is_retried_on_a_new_connection(caplog):
    """25006 on a node that takes no writes (a demoted primary; pg_auto_failover's promotion sets
    default_transaction_read_only first): nothing was written, and the retry reconnects, so that a
    multi-host connection string finds the node that takes writes now."""
    postgres_only()
    from django_dbqueue import enqueue
    from django_dbqueue.models import Message

    with connection.cursor() as cursor:
        cursor.execute("SET default_transaction_read_only = on")  # this session only: as on a demoted node
    first = connection.connection
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        message = enqueue("t-ha-read-only", {"n": 1})  # its insert runs through with_retries
    assert [r.getMessage() for r in caplog.records if "read-only transaction" in r.getMessage()]
    assert connection.connection is not first  # reopened: the read-only session is gone
    assert list(Message.objects.filter(queue="t-ha-read-only").values_list("pk", flat=True)) == [message.pk]

    try:
        # The error the first attempt met, as Django raises it.
        with pytest.raises(DatabaseError) as refused, connection.cursor() as cursor:
            cursor.execute("SET default_transaction_read_only = on")
            cursor.execute("CREATE TEMPORARY TABLE refused (x int)")
    finally:
        connection.close()  # the read-only session must not outlive the test
    assert refused.value.__cause__.sqlstate == "25006"
    assert errors.is_transient(refused.value, "default") and not errors.outcome_unknown(refused.value, "default")
