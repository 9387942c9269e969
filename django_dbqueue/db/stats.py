"""What the database's planner knows: statistics kept fresh, row counts estimated."""

from __future__ import annotations

from django.db import connections


def refresh_statistics(using: str, table: str, *, force: bool = False) -> bool:
    """On PostgreSQL, ANALYZE ``table`` when much of it changed since its last analysis.

    A queue table empties and refills fast. With statistics from when it was
    empty the planner sorts the whole backlog for every claim instead of
    walking the claim index (seen: 400 ms instead of 0.1 ms per claim with
    240,000 ready rows). Autovacuum fixes that within a minute when it is on;
    the reaper makes sure of it when it is off or lagging. MySQL's InnoDB
    recalculates its statistics by itself. Returns whether it analysed.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT n_mod_since_analyze, n_live_tup FROM pg_stat_user_tables WHERE relname = %s", [table])
        row = cursor.fetchone()
        if not force and (row is None or row[0] < max(1000, 0.1 * row[1])):
            return False
        cursor.execute(f"ANALYZE {connection.ops.quote_name(table)}")
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
    connection = connections[using]
    sql = queries.get(connection.vendor)
    if sql is None:
        return None
    with connection.cursor() as cursor:
        cursor.execute(sql, [table])
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] < 0:
        return None
    return int(row[0])
