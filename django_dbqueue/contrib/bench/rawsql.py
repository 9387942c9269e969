"""The queue protocol written directly against the database driver, without the ORM.

This is the benchmark's ceiling: the same claim (``FOR UPDATE SKIP LOCKED``,
a lease token, ``available_at`` pushed to the lease's end), the same
acknowledgement (archive and delete, guarded by the token) and the same
multi-row INSERT, with nothing in between. It is deliberately kept out of
`django_dbqueue.vendor`: no production code path uses it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.db import connections
from django.db.models import QuerySet

NOW = {
    "mysql": "UTC_TIMESTAMP(6)",
    "postgresql": "STATEMENT_TIMESTAMP()",
    "sqlite": "STRFTIME('%Y-%m-%d %H:%M:%f', 'now')",
}
LATER = {
    "mysql": "UTC_TIMESTAMP(6) + INTERVAL 300 SECOND",
    "postgresql": "STATEMENT_TIMESTAMP() + INTERVAL '300 seconds'",
    "sqlite": "STRFTIME('%Y-%m-%d %H:%M:%f', 'now', '+300 seconds')",
}
# The table the writing handler inserts into, one row per message (created and dropped by the phase).
WRITE_TABLE = "queuebench_write"
ARCHIVE_COLUMNS = (
    "message_id, queue, kind, {key}, payload, headers, priority, created_at, first_available_at, claimed_at, "
    "finished_at, expires_at, attempts, max_attempts, outcome, finished_by, last_error, replay_of, replayed_by"
)
ARCHIVE_SELECT = (
    "id, queue, kind, {key}, payload, headers, priority, created_at, first_available_at, claimed_at, "
    "{now}, expires_at, attempts, max_attempts, 'acked', claimed_by, last_error, replay_of, ''"
)

# A message claimed and finished in one transaction: claimed now, by the worker given, on its next attempt.
ARCHIVE_SELECT_AT_ONCE = (
    "id, queue, kind, {key}, payload, headers, priority, created_at, first_available_at, {now}, "
    "{now}, expires_at, attempts + 1, max_attempts, 'acked', {p}, last_error, replay_of, ''"
)


class RawProtocol:
    """One connection's worth of raw-SQL queue operations."""

    def __init__(self, using: str = "default") -> None:
        self.connection = connections[using]
        self.connection.ensure_connection()
        self.vendor = self.connection.vendor
        self.raw = self.connection.connection
        self.placeholder = "?" if self.vendor == "sqlite" else "%s"
        self.key = "`key`" if self.vendor == "mysql" else '"key"'
        self.now = NOW[self.vendor]
        # Django keeps connections in autocommit mode; transactions here are explicit BEGIN/COMMIT.

    def _begin(self, cursor: Any) -> None:
        cursor.execute("BEGIN IMMEDIATE" if self.vendor == "sqlite" else "BEGIN")

    def _in(self, count: int) -> str:
        return ", ".join([self.placeholder] * count)

    def insert_many(self, queue: str, payloads: list[Any], *, one_by_one: bool = False) -> None:
        """Multi-row INSERT (or one statement per row), in one transaction."""
        p = self.placeholder
        row = f"({p}, {p}, {p}, 0, {self.now}, {self.now}, {self.now})"
        head = (
            "INSERT INTO dbqueue_message (queue, payload, headers, priority, available_at, first_available_at, "
            "created_at) VALUES "
        )
        cursor = self.raw.cursor()
        if one_by_one:
            for payload in payloads:
                cursor.execute(head + row, [queue, json.dumps(payload), "{}"])
            return
        self._begin(cursor)
        for start in range(0, len(payloads), 500):
            chunk = payloads[start : start + 500]
            params: list[Any] = []
            for payload in chunk:
                params += [queue, json.dumps(payload), "{}"]
            cursor.execute(head + ", ".join([row] * len(chunk)), params)
        cursor.execute("COMMIT")

    def _lock_ready(self, cursor: Any, queue: str, limit: int) -> list[int]:
        """The ids of up to ``limit`` ready messages of ``queue``, locked (SKIP LOCKED) in claim order."""
        lock = "" if self.vendor == "sqlite" else " FOR UPDATE SKIP LOCKED"
        cursor.execute(
            f"SELECT id FROM dbqueue_message WHERE queue = {self.placeholder} AND available_at <= {self.now} "
            f"ORDER BY priority, available_at, id LIMIT {int(limit)}{lock}",
            [queue],
        )
        return [row[0] for row in cursor.fetchall()]

    def claim(self, queue: str, limit: int, worker: str) -> tuple[str, list[int]]:
        p = self.placeholder
        cursor = self.raw.cursor()
        self._begin(cursor)
        ids = self._lock_ready(cursor, queue, limit)
        token = uuid.uuid4().hex
        if ids:
            cursor.execute(
                f"UPDATE dbqueue_message SET lease_token = {p}, available_at = {LATER[self.vendor]}, "
                f"claimed_at = {self.now}, claimed_by = {p}, attempts = attempts + 1 "
                f"WHERE id IN ({self._in(len(ids))})",
                [token, worker, *ids],
            )
        cursor.execute("COMMIT")
        return token, ids

    def run_one(self, queue: str, worker: str, job: Any) -> bool:
        """Claim one message, run ``job(id)``, archive and delete it: one transaction, one commit.

        The loop a careful user writes by hand for database-only jobs (the
        job's writes commit with the acknowledgement, or not at all); the
        ``peers`` phase's baseline. False when nothing was ready.
        """
        p = self.placeholder
        cursor = self.raw.cursor()
        self._begin(cursor)
        ids = self._lock_ready(cursor, queue, 1)
        if not ids:
            cursor.execute("COMMIT")
            return False
        pk = ids[0]
        job(pk)
        cursor.execute(
            f"INSERT INTO dbqueue_archive ({ARCHIVE_COLUMNS.format(key=self.key)}) "
            f"SELECT {ARCHIVE_SELECT_AT_ONCE.format(key=self.key, now=self.now, p=p)} "
            f"FROM dbqueue_message WHERE id = {p}",
            [worker, pk],
        )
        cursor.execute(f"DELETE FROM dbqueue_message WHERE id = {p}", [pk])
        cursor.execute("COMMIT")
        return True

    def ack(self, token: str, ids: list[int]) -> int:
        """Archive and delete the messages still leased with ``token``."""
        p = self.placeholder
        cursor = self.raw.cursor()
        self._begin(cursor)
        match = f"FROM dbqueue_message WHERE id IN ({self._in(len(ids))}) AND lease_token = {p}"
        cursor.execute(
            f"INSERT INTO dbqueue_archive ({ARCHIVE_COLUMNS.format(key=self.key)}) "
            f"SELECT {ARCHIVE_SELECT.format(key=self.key, now=self.now)} {match}",
            [*ids, token],
        )
        cursor.execute(f"DELETE {match}", [*ids, token])
        deleted: int = cursor.rowcount
        cursor.execute("COMMIT")
        return deleted

    def close(self) -> None:
        self.connection.close()


def create_write_table(using: str = "default") -> None:
    """The writing handler's table, empty (no primary key: the same plain INSERT on every database)."""
    drop_write_table(using)
    with connections[using].cursor() as cursor:
        cursor.execute(f"CREATE TABLE {WRITE_TABLE} (message_id BIGINT NOT NULL)")


def drop_write_table(using: str = "default") -> None:
    with connections[using].cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {WRITE_TABLE}")


def count_written(using: str = "default") -> int:
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {WRITE_TABLE}")
        return int(cursor.fetchone()[0])


def table_size(using: str, table: str) -> dict[str, int | None]:
    """Bytes of ``table`` and of its indexes, from the database's own statistics (None where it keeps none).

    PostgreSQL: ``pg_relation_size`` and ``pg_indexes_size`` (pages on disk,
    dead tuples included until a vacuum frees them) and the dead-tuple count
    from ``pg_stat_user_tables``. MySQL/MariaDB: ``information_schema.TABLES``
    after ``ANALYZE TABLE`` (InnoDB otherwise reports stale figures). SQLite
    keeps no per-table figure without the optional dbstat table: None.
    """
    connection = connections[using]
    quoted = connection.ops.quote_name(table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_relation_size(%s), pg_indexes_size(%s), "
                "(SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s)",
                [table, table, table],
            )
            data, index, dead = cursor.fetchone()
            return {"table_bytes": int(data), "index_bytes": int(index), "dead_rows": dead}
        if connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {quoted}")
            cursor.fetchall()
            cursor.execute(
                "SELECT DATA_LENGTH, INDEX_LENGTH, DATA_FREE FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                [table],
            )
            data, index, free = cursor.fetchone()
            return {"table_bytes": int(data), "index_bytes": int(index), "free_bytes": int(free)}
    return {"table_bytes": None, "index_bytes": None}


# A table and its partitions, if any (pg_partition_tree lists nothing for a plain table).
TREE = "SELECT CAST(%s AS regclass) AS relid UNION SELECT relid FROM pg_partition_tree(%s)"


def archive_garbage(using: str, table: str) -> dict[str, int | None]:
    """What a retention pass leaves for the server to clean up, from its own statistics.

    InnoDB: the history list length (undo records not yet purged, server
    wide, from ``information_schema.INNODB_METRICS``). PostgreSQL: the dead
    tuples of the table and its partitions (``pg_stat_user_tables``).
    """
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT `COUNT` FROM information_schema.INNODB_METRICS WHERE NAME = 'trx_rseg_history_len'")
            row = cursor.fetchone()
            return {"innodb_history_list_length": None if row is None else int(row[0])}
        if connection.vendor == "postgresql":
            cursor.execute(
                f"SELECT COALESCE(SUM(s.n_dead_tup), 0) FROM ({TREE}) t "
                "JOIN pg_stat_user_tables s ON s.relid = t.relid",
                [table, table],
            )
            return {"dead_tuples": int(cursor.fetchone()[0])}
    return {}


def archive_bytes(using: str, table: str) -> int | None:
    """Bytes on disk of ``table`` with its indexes, all its partitions summed (None on SQLite)."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"SELECT SUM(pg_total_relation_size(relid)) FROM ({TREE}) t", [table, table])
            return int(cursor.fetchone()[0] or 0)
        if connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {connection.ops.quote_name(table)}")
            cursor.fetchall()
            cursor.execute(
                "SELECT SUM(DATA_LENGTH + INDEX_LENGTH) FROM information_schema.PARTITIONS "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                [table],
            )
            return int(cursor.fetchone()[0] or 0)
    return None


def truncate(using: str, table: str) -> None:
    """Empty ``table`` at once (the benchmark's own history, which nobody else's rows share)."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute(f"DELETE FROM {connection.ops.quote_name(table)}")
        else:
            cursor.execute(f"TRUNCATE TABLE {connection.ops.quote_name(table)}")


def named_from(rows: QuerySet[Any], prefix: str) -> QuerySet[Any]:
    """The rows whose queue starts with ``prefix``, found through the index on the queue.

    Django's ``startswith`` is ``LIKE BINARY`` on MySQL/MariaDB: the cast
    makes it a byte-string comparison that the queue's index does not
    serve, and at 50,000,000 archived rows the benchmark's clean-up read
    the whole archive for over a minute. There a range on the name comes
    first; the column's binary collation orders by code point, so every
    name with the prefix lies in it. PostgreSQL keeps the ``LIKE`` alone:
    its index serves the prefix under the C collation.
    """
    if connections[rows.db].vendor == "mysql":
        rows = rows.filter(queue__gte=prefix, queue__lt=prefix[:-1] + chr(ord(prefix[-1]) + 1))
    return rows.filter(queue__startswith=prefix)
