"""Everything that differs between MySQL/MariaDB, PostgreSQL and SQLite.

The rest of django-dbqueue is plain ORM; when a database needs its own SQL
or its own handling, the difference lives here and only here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import django
from django.db import connections, transaction
from django.db.models import DateTimeField, Func
from django.db.models.sql import Query
from django.utils import timezone
from django.utils.dateparse import parse_datetime

MYSQL_TRANSIENT_CODES = {
    1205,  # lock wait timeout exceeded
    1213,  # deadlock found when trying to get lock
    2006,  # server has gone away
    2013,  # lost connection during query
    2002,  # can't connect (MariaDB Connector/C says so for TCP too)
    2003,  # can't connect (server restarting)
    1927,  # MariaDB: connection was killed
    4031,  # MariaDB: client disconnected by the server (inactivity)
}
POSTGRES_TRANSIENT_SQLSTATES = {"40001", "40P01", "57P01", "57P02", "57P03", "08000", "08003", "08006", "08001"}


class DbNow(Func):
    """The database server's current time, in UTC (DESIGN decision 5).

    Django's ``Now()`` renders ``CURRENT_TIMESTAMP`` on MySQL, which is in the
    session's time zone; we store UTC, so MySQL gets ``UTC_TIMESTAMP``.
    """

    template = "CURRENT_TIMESTAMP"
    output_field = DateTimeField()

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.seconds = float(seconds)

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        if self.seconds:
            return "(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)", [round(self.seconds * 1_000_000)]
        return "UTC_TIMESTAMP(6)", []

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        # STATEMENT_TIMESTAMP(), not NOW(): NOW() is frozen at the transaction's start.
        if self.seconds:
            return "(STATEMENT_TIMESTAMP() + make_interval(secs => %s))", [self.seconds]
        return "STATEMENT_TIMESTAMP()", []

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        # Django stores datetimes in SQLite as UTC text with six fractional
        # digits; SQLite's clock has three. Pad, so that text compares like
        # with like: a time Django wrote in this very millisecond is not later than now.
        if self.seconds:
            return "(STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s) || '000')", [f"{self.seconds:+.6f} seconds"]
        return "(STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now') || '000')", []


def db_now(using: str) -> datetime:
    """Read the database server's clock (one query), as an aware UTC datetime."""
    connection = connections[using]
    sql, params = Query(None).get_compiler(connection=connection).compile(DbNow())
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql}", params)
        value = cursor.fetchone()[0]
    if isinstance(value, str):
        value = parse_datetime(value)
    if timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return value


def insert_returns_expressions(using: str) -> bool:
    """Whether an INSERT hands back the values the database computed for it (``DbNow()``).

    Django 6 asks for them with RETURNING where the database has it
    (PostgreSQL, MariaDB, SQLite); Django 5.2 and MySQL do not.
    """
    return django.VERSION >= (6, 0) and connections[using].features.can_return_columns_from_insert


def vendor(using: str) -> str:
    return connections[using].vendor


def can_skip_locked(using: str) -> bool:
    connection = connections[using]
    return connection.vendor == "sqlite" or connection.features.has_select_for_update_skip_locked


@contextlib.contextmanager
def write_transaction(using: str) -> Iterator[None]:
    """A short transaction that reads and then writes (claim, ack, archive, replay).

    MySQL and PostgreSQL lock the rows they pick with ``SKIP LOCKED``. SQLite
    has no row locks: there the transaction takes the database's write lock
    at ``BEGIN IMMEDIATE``, so writers queue up on the lock (with the
    connection's timeout) instead of reading first and then failing to
    upgrade to a write lock ("database is locked"). Inside an outer
    transaction the outer one decides.
    """
    connection = connections[using]
    if connection.vendor != "sqlite" or connection.in_atomic_block:
        with transaction.atomic(using=using):
            yield
        return
    connection.ensure_connection()
    previous = connection.transaction_mode
    connection.transaction_mode = "IMMEDIATE"
    try:
        with transaction.atomic(using=using):
            connection.transaction_mode = previous
            yield
    finally:
        connection.transaction_mode = previous


def is_transient(exc: BaseException, using: str) -> bool:
    """Whether an error is weather (deadlock, lost connection) worth retrying."""
    kind = vendor(using)
    cause = exc.__cause__ or exc
    if kind == "mysql":
        code = cause.args[0] if cause.args and isinstance(cause.args[0], int) else None
        return code in MYSQL_TRANSIENT_CODES
    if kind == "postgresql":
        sqlstate = getattr(cause, "sqlstate", None)
        if sqlstate in POSTGRES_TRANSIENT_SQLSTATES:
            return True
        text = str(cause).lower()  # psycopg gives no SQLSTATE for errors on the client's side of the socket
        return "connection failed" in text or ("connection" in text and ("closed" in text or "lost" in text))
    if kind == "sqlite":
        return "database is locked" in str(cause)
    return False


def lost_connection(using: str) -> bool:
    """Whether the connection is unusable and must be reopened before a retry."""
    connection = connections[using]
    if connection.connection is None:
        return False
    try:
        return not connection.is_usable()
    except Exception:
        return True


@contextlib.contextmanager
def try_lock(using: str, name: str) -> Iterator[bool]:
    """A session-level lock that at most one process holds; yields whether we got it.

    MySQL's ``GET_LOCK`` and PostgreSQL's advisory locks are released when the
    holder's connection drops, so a reaper that dies frees the lock. SQLite
    has a single writer anyway: there every caller gets it.
    """
    connection = connections[using]
    if connection.vendor == "sqlite":
        yield True
        return
    acquire, release = {
        "mysql": ("SELECT GET_LOCK(%s, 0)", "SELECT RELEASE_LOCK(%s)"),
        "postgresql": ("SELECT pg_try_advisory_lock(hashtext(%s))", "SELECT pg_advisory_unlock(hashtext(%s))"),
    }[connection.vendor]
    with connection.cursor() as cursor:
        cursor.execute(acquire, [name])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        if held and connection.connection is not None:
            with contextlib.suppress(Exception), connection.cursor() as cursor:
                cursor.execute(release, [name])


# PostgreSQL wakes idle workers when messages arrive: a statement-level
# trigger notifies once per INSERT statement and queue (NOTIFY is delivered
# at commit, so a worker never wakes for a message it cannot see yet). Plain
# SQL producers trigger it too.
NOTIFY_CHANNEL = "dbqueue"
NOTIFY_TRIGGER_SQL = f"""
CREATE OR REPLACE FUNCTION dbqueue_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{NOTIFY_CHANNEL}', queue) FROM (SELECT DISTINCT queue FROM new_rows) AS queues;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS dbqueue_notify ON dbqueue_message;
CREATE TRIGGER dbqueue_notify AFTER INSERT ON dbqueue_message
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION dbqueue_notify();
"""
DROP_NOTIFY_TRIGGER_SQL = """
DROP TRIGGER IF EXISTS dbqueue_notify ON dbqueue_message;
DROP FUNCTION IF EXISTS dbqueue_notify();
"""


def install_notify_trigger(using: str) -> None:
    if vendor(using) == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute(NOTIFY_TRIGGER_SQL)


def drop_notify_trigger(using: str) -> None:
    if vendor(using) == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute(DROP_NOTIFY_TRIGGER_SQL)


def notifications(using: str, stop: Callable[[], bool], timeout: float = 1.0) -> Iterator[str | None]:
    """On PostgreSQL, yield the queue name of each NOTIFY (None every ``timeout`` seconds).

    Uses its own connection in autocommit, never Django's: LISTEN must not sit
    inside the claim transactions. Elsewhere it returns at once (workers poll).
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return
    import psycopg

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        while not stop():
            got = False
            for notify in listener.notifies(timeout=timeout, stop_after=1):
                got = True
                yield notify.payload
            if not got:
                yield None


def json_param(using: str) -> str:
    """A placeholder for a JSON text parameter stored into a JSON column from hand-written SQL."""
    return "CAST(%s AS jsonb)" if vendor(using) == "postgresql" else "%s"


def refresh_statistics(using: str, table: str, *, force: bool = False) -> bool:
    """On PostgreSQL, ANALYZE ``table`` when much of it changed since its last analysis.

    A queue table empties and refills fast. With statistics from when it was
    empty the planner sorts the whole backlog for every claim instead of
    walking the claim index (seen: 400 ms instead of 0.1 ms per claim with
    240,000 ready rows). Autovacuum fixes that within a minute when it is on;
    the reaper makes sure of it when it is off or lagging. MySQL's InnoDB
    recalculates its statistics by itself. Returns whether it analysed.
    """
    if vendor(using) != "postgresql":
        return False
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT n_mod_since_analyze, n_live_tup FROM pg_stat_user_tables WHERE relname = %s", [table])
        row = cursor.fetchone()
        if not force and (row is None or row[0] < max(1000, 0.1 * row[1])):
            return False
        cursor.execute(f"ANALYZE {connections[using].ops.quote_name(table)}")
    return True


def estimated_row_count(using: str, table: str) -> int | None:
    """The planner's idea of how many rows ``table`` holds, read without counting them.

    ``COUNT(*)`` reads a whole InnoDB table (a million-row archive: seconds);
    the statistics answer at once, roughly. MySQL/MariaDB keep
    ``information_schema.TABLES.TABLE_ROWS``, PostgreSQL ``pg_class.reltuples``
    (-1 before the first ANALYZE). None where there is no estimate (SQLite,
    or a table never analysed): the caller counts.
    """
    queries = {
        "mysql": "SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
        "postgresql": "SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)",
    }
    sql = queries.get(vendor(using))
    if sql is None:
        return None
    with connections[using].cursor() as cursor:
        cursor.execute(sql, [table])
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] < 0:
        return None
    return int(row[0])
