"""The errors queue operations retry, as the real drivers raise them.

A database restart first drops connections, then refuses new ones until it
is up again; both must read as weather (retried), not as a caller's bug.
"""

import socket
import sqlite3

import pytest
from django.db import connection
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
