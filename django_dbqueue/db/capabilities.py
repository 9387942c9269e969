"""What a database can do for the queue: for the system checks (E002, W001) and the hot path's statements."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from django.db import connections

if TYPE_CHECKING:
    from django.db.backends.mysql.base import DatabaseWrapper as MySQLDatabaseWrapper


def lacks_skip_locked(using: str) -> bool:
    """True for a server without ``SELECT ... FOR UPDATE SKIP LOCKED`` (SQLite needs none: one writer)."""
    connection = connections[using]
    return connection.vendor != "sqlite" and not connection.features.has_select_for_update_skip_locked


def writable_ctes(using: str) -> bool:
    """True where a ``WITH`` may hold ``DELETE``/``UPDATE ... RETURNING`` feeding another statement (PostgreSQL).

    There the worker's claim and acknowledgement are one statement each,
    atomic without a transaction around them.
    """
    return connections[using].vendor == "postgresql"


def locks_outer_joined_rows(using: str) -> bool:
    """True where ``SELECT ... LEFT JOIN ... FOR UPDATE SKIP LOCKED`` locks the joined rows too (MySQL/MariaDB).

    PostgreSQL refuses ``FOR UPDATE`` on the nullable side of an outer join.
    """
    return connections[using].vendor == "mysql"


def loose_index_scans(using: str) -> bool:
    """Whether a GROUP BY on an index's next column reads one entry per group (MySQL/MariaDB), not every row."""
    return connections[using].vendor == "mysql"


def writes_one_at_a_time(using: str) -> bool:
    """True where a writing transaction holds the whole database until it ends (SQLite).

    There ids are handed out in commit order, and no statement runs beside another writer's.
    """
    return connections[using].vendor == "sqlite"


def locking_reads_see_newer_rows(using: str) -> bool:
    """True where a locking read returns rows committed after its statement's snapshot (InnoDB: MySQL/MariaDB).

    A sub-select that does not lock reads the snapshot instead, so within
    one ``SELECT ... FOR UPDATE`` the two can disagree about what exists.
    PostgreSQL's locking reads see only the snapshot's rows.
    """
    return connections[using].vendor == "mysql"


def runs_repeatable_read(using: str) -> bool:
    """True for MySQL/MariaDB at REPEATABLE READ, where a claim inside a longer transaction misses new rows."""
    connection = connections[using]
    if connection.vendor != "mysql":
        return False
    # MariaDB names it tx_isolation; MySQL 8 removed that name.
    variable = "tx_isolation" if cast("MySQLDatabaseWrapper", connection).mysql_is_mariadb else "transaction_isolation"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT @@SESSION.{variable}")
        return str(cursor.fetchone()[0]).upper() == "REPEATABLE-READ"


def statement_bytes(using: str) -> int | None:
    """The largest statement the server accepts, in bytes: MySQL's ``max_allowed_packet``; None where unbounded.

    Read once per connection (the session's value is fixed when it opens)
    and kept beside the driver's connection object, so a reconnect reads
    it again. PostgreSQL and SQLite have no such limit a queue would meet.
    """
    connection = connections[using]
    if connection.vendor != "mysql":
        return None
    connection.ensure_connection()
    raw = connection.connection
    kept = getattr(connection, "_dbqueue_packet", None)
    if kept is not None and kept[0] is raw:
        return cast(int, kept[1])
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@max_allowed_packet")
        (size,) = cursor.fetchone()
    connection._dbqueue_packet = (raw, int(size))  # type: ignore[attr-defined]
    return int(size)
