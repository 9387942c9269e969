"""Bounded retries for the database's weather: deadlocks and dropped connections.

MySQL may pick any transaction as a deadlock victim, and a database restart
drops every connection. On a MariaDB Galera cluster a transaction that lost
certification to another node's at COMMIT fails as a deadlock (1213), and a
node cut off from the cluster's quorum refuses every statement (1047) until
it rejoins: a new connection, through a load balancer, reaches another node.
A PostgreSQL failover drops connections (57P01), refuses new ones for a few
seconds, and may leave a connection on a node that takes no writes (25006):
a new connection through a multi-host string (``target_session_attrs=read-write``)
finds the new primary.
None of these is a bug in the caller, so queue statements run through
`with_retries`, which retries them a bounded number of times with jittered
backoff. Inside a caller's own transaction nothing is
retried: the caller's work is gone with the error and only the caller can
redo it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import DatabaseError, InterfaceError, connections

logger = logging.getLogger("django_dbqueue")
T = TypeVar("T")

MYSQL_TRANSIENT_CODES = {
    1053,  # server shutdown in progress (restarting)
    1205,  # lock wait timeout exceeded
    1213,  # deadlock found when trying to get lock
    2006,  # server has gone away
    2013,  # lost connection during query
    2002,  # can't connect (MariaDB Connector/C says so for TCP too)
    2003,  # can't connect (server restarting)
    1927,  # MariaDB: connection was killed
    4031,  # MariaDB: client disconnected by the server (inactivity)
    1047,  # Galera: "WSREP has not yet prepared node for application use" (the node has no quorum)
}
POSTGRES_TRANSIENT_SQLSTATES = {
    "40001",  # serialization failure
    "40P01",  # deadlock detected
    "57P01",  # admin shutdown: the server stopping, or a failover restarting it
    "57P02",  # crash shutdown
    "57P03",  # cannot connect now: starting up
    "08000",  # connection exception
    "08003",  # connection does not exist
    "08006",  # connection failure
    "08001",  # cannot connect (refused)
    "25006",  # read-only transaction: a primary demoted under us, or one being promoted (pg_auto_failover)
}
# Errors after which the connection is of no more use, although it is open: the node it
# reaches left the cluster (Galera), or takes no writes (PostgreSQL).
MYSQL_RECONNECT_CODES = {1047}
POSTGRES_RECONNECT_SQLSTATES = {"25006"}

# What a database that went away raises, for the loops that must outlive it
# (workers, reapers): Django's DatabaseError, and its sibling InterfaceError,
# which a driver raises on a connection it already closed (mysqlclient's
# "(0, '')" after a server restart).
DATABASE_TROUBLE = (DatabaseError, InterfaceError)


def mysql_code(cause: BaseException) -> int | None:
    """The MySQL/MariaDB error number a driver error carries (its first argument), if any.

    A Galera node that loses the cluster's quorum while a transaction writes
    fails the write or its COMMIT with 1180 ("... Not connected to Primary
    Component"): nothing was replicated, and the node refuses everything
    after with 1047. Counted as 1047, which it is in all but its number; any
    other 1180 (an engine's error during COMMIT) keeps its own.
    """
    code = cause.args[0] if cause.args and isinstance(cause.args[0], int) else None
    if code == 1180 and "Primary Component" in str(cause.args[-1]):
        return 1047
    return code


def is_transient(exc: BaseException, using: str) -> bool:
    """Whether an error is weather that can pass (deadlock, lock wait, lost connection, server restarting).

    Anything else (a data or integrity error, a packet too large, an
    OverflowError, a bug) is permanent: trying the same write again gives
    the same error.
    """
    if isinstance(exc, InterfaceError):
        return True  # the driver's connection is closed already: a new one may work
    if not isinstance(exc, DatabaseError):
        return False
    kind = connections[using].vendor
    cause = exc.__cause__ or exc
    if kind == "mysql":
        return mysql_code(cause) in MYSQL_TRANSIENT_CODES
    if kind == "postgresql":
        sqlstate = getattr(cause, "sqlstate", None)
        if sqlstate in POSTGRES_TRANSIENT_SQLSTATES:
            return True
        text = str(cause).lower()  # psycopg gives no SQLSTATE for errors on the client's side of the socket
        return "connection failed" in text or ("connection" in text and ("closed" in text or "lost" in text))
    if kind == "sqlite":
        return "database is locked" in str(cause)
    return False


def is_lock_timeout(exc: BaseException, using: str) -> bool:
    """Whether a statement gave up waiting for a lock (MySQL 1205, PostgreSQL 55P03): nothing it did stays."""
    if not isinstance(exc, DatabaseError):
        return False
    cause = exc.__cause__ or exc
    if connections[using].vendor == "mysql":
        return mysql_code(cause) == 1205
    return getattr(cause, "sqlstate", None) == "55P03"


# Errors the server answered with: the statement failed and its transaction was rolled back.
# Any other transient error may have lost the connection after the server did the work.
MYSQL_ANSWERED_CODES = {1047, 1053, 1205, 1213, 2002, 2003}
POSTGRES_ANSWERED_SQLSTATES = {"40001", "40P01", "57P03", "08001", "25006"}


def outcome_unknown(exc: BaseException, using: str) -> bool:
    """Whether a failed statement may have done its work unseen: the connection went before the answer came.

    A COMMIT whose reply is lost committed or not; the client cannot tell.
    A deadlock, a lock wait timeout or a refused connection is an answer:
    nothing was done. SQLite has no connection to lose.
    """
    if isinstance(exc, InterfaceError):
        return True
    if not is_transient(exc, using):
        return False
    kind = connections[using].vendor
    cause = exc.__cause__ or exc
    if kind == "mysql":
        return mysql_code(cause) not in MYSQL_ANSWERED_CODES
    if kind == "postgresql":
        return getattr(cause, "sqlstate", None) not in POSTGRES_ANSWERED_SQLSTATES
    return False


def wrong_node(exc: BaseException, using: str) -> bool:
    """Whether the server refused the statement as a node that cannot take it now (a Galera node
    without quorum, a read-only PostgreSQL node), so that only a new connection can go on."""
    cause = exc.__cause__ or exc
    kind = connections[using].vendor
    if kind == "mysql":
        return mysql_code(cause) in MYSQL_RECONNECT_CODES
    if kind == "postgresql":
        return getattr(cause, "sqlstate", None) in POSTGRES_RECONNECT_SQLSTATES
    return False


def lost_connection(using: str, exc: BaseException | None = None) -> bool:
    """Whether the connection is unusable and must be reopened before a retry (``exc`` said so, or a ping)."""
    connection = connections[using]
    if connection.connection is None:
        return False
    if exc is not None and wrong_node(exc, using):
        return True
    try:
        return not connection.is_usable()
    except Exception:
        return True


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0) -> float:
    """Full-jitter exponential backoff: up to base * 2**attempt, at most cap."""
    return random.uniform(0, min(cap, base * 2 ** min(attempt, 30)))


def with_retries(using: str, operation: Callable[[], T], *, what: str = "queue operation") -> T:
    """Run ``operation``, retrying transient errors up to ``TRANSIENT_RETRIES`` times."""
    from ..conf import get_settings

    attempt = 0
    while True:
        try:
            return operation()
        except DatabaseError as exc:  # the connection and the setting are looked up here: every enqueue passes by
            connection = connections[using]
            retries = get_settings().transient_retries
            if connection.in_atomic_block or attempt >= retries or not is_transient(exc, using):
                raise
            attempt += 1
            logger.warning("%s on %r hit %s; retry %d of %d", what, using, exc, attempt, retries)
            if lost_connection(using, exc):
                connection.close()
            time.sleep(backoff(attempt))
