"""What the database's planner knows: statistics kept fresh, row counts estimated."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import EmptyResultSet
from django.db import OperationalError, connections, transaction
from django.db.models import QuerySet

# How long an ANALYZE on a producer's behalf waits for its table's lock (another ANALYZE, a VACUUM, a migration).
ANALYZE_LOCK_TIMEOUT_MS = 200


def analyze_now(using: str, table: str, *, lock_timeout_ms: int = ANALYZE_LOCK_TIMEOUT_MS) -> bool:
    """On PostgreSQL and outside a transaction, ANALYZE ``table`` at once, waiting at most ``lock_timeout_ms``
    for its lock; returns whether it did. Raises what the database raises (a lock timeout among them)."""
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    with transaction.atomic(using=using), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}")
        cursor.execute(f"ANALYZE {connection.ops.quote_name(table)}")
    return True


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


# Dead rows that make a VACUUM worth it: this many at least, and this share of the live ones.
VACUUM_MIN_DEAD = 10_000
VACUUM_DEAD_SHARE = 0.2


def vacuum_if_bloated(using: str, table: str, *, min_dead: int = VACUUM_MIN_DEAD) -> bool:
    """On PostgreSQL, VACUUM ``table`` when its dead rows pile up; returns whether it did.

    Every message leaves dead row versions behind (its claim's UPDATE, its
    DELETE). Autovacuum reclaims them when it is on and keeping up; where it
    is off or lagging, a queue table and its indexes grow with every message
    ever sent and the claim slows down (seen: the last tenth of a 200,000
    message soak drained at a tenth of the first's rate). A plain VACUUM
    takes no lock that blocks claims or inserts, makes the space reusable,
    and gives back the empty pages at the table's end. It cannot run inside
    a transaction: skipped there. MySQL's InnoDB purges by itself.
    """
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    with connection.cursor() as cursor:
        # A partitioned table (the archive with ARCHIVE_PARTITIONS) keeps its figures in its partitions;
        # a VACUUM of the table vacuums each of them.
        cursor.execute(
            "SELECT CAST(SUM(n_dead_tup) AS bigint), CAST(SUM(n_live_tup) AS bigint) "
            "FROM pg_stat_user_tables WHERE relid IN "
            "(SELECT CAST(%s AS regclass) UNION SELECT relid FROM pg_partition_tree(%s))",
            [table, table],
        )
        row = cursor.fetchone()
        if row is None or row[0] is None or row[0] < max(min_dead, VACUUM_DEAD_SHARE * row[1]):
            return False
        cursor.execute(f"VACUUM (ANALYZE) {connection.ops.quote_name(table)}")
    return True


# An almost empty table whose indexes are this large was bloated by a backlog since drained.
SHRINK_MAX_LIVE = 1_000
SHRINK_MIN_INDEX_BYTES = 8 * 1024 * 1024
SHRINK_LOCK_TIMEOUT_MS = 500


def shrink_indexes(
    using: str,
    table: str,
    *,
    max_live: int = SHRINK_MAX_LIVE,
    min_bytes: int = SHRINK_MIN_INDEX_BYTES,
    lock_timeout_ms: int = SHRINK_LOCK_TIMEOUT_MS,
) -> bool:
    """On PostgreSQL, rebuild ``table``'s indexes once a drained backlog left them large; returns whether it did.

    VACUUM lets a B-tree reuse its emptied pages but never gives them back:
    after a backlog of a million messages the live table's indexes keep
    tens of megabytes for a table of a few rows. With at most ``max_live``
    rows left, ``REINDEX TABLE`` takes milliseconds, but it blocks writers
    meanwhile: it waits for its lock at most ``lock_timeout_ms`` (a long
    transaction on the table: skipped, tried again next pass), inside a
    transaction of its own. Skipped inside the caller's transaction.
    """
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT s.n_live_tup, pg_indexes_size(s.relid) FROM pg_stat_user_tables s WHERE s.relname = %s", [table]
        )
        row = cursor.fetchone()
    if row is None or row[0] > max_live or row[1] < min_bytes:
        return False
    try:
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}")
            cursor.execute(f"REINDEX TABLE {connection.ops.quote_name(table)}")
    except OperationalError:  # the lock was not free in time; the next pass tries again
        return False
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
        "mysql": "SELECT TABLE_ROWS FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %(t)s",
        # A partitioned table's own figure is never kept up (autovacuum analyses its partitions only):
        # the sum of its partitions', or a plain table's own. -1: never analysed.
        "postgresql": "SELECT CASE WHEN bool_and(c.reltuples < 0) THEN NULL ELSE sum(greatest(c.reltuples, 0)) END "
        "FROM pg_class c WHERE (c.oid = to_regclass(%(t)s) AND c.relkind = 'r') "
        "OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass(%(t)s)) WHERE isleaf)",
    }
    connection = connections[using]
    sql = queries.get(connection.vendor)
    if sql is None:
        return None
    with connection.cursor() as cursor:
        cursor.execute(sql, {"t": table})
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] < 0:
        return None
    return int(row[0])


def estimated_match_count(rows: QuerySet[Any]) -> int | None:
    """The planner's idea of how many rows a filtered queryset matches: an ``EXPLAIN``, no row read.

    PostgreSQL: the plan's top row estimate. MySQL/MariaDB: the ``rows``
    column of a one-table plan that reads an index range (the rows it
    expects to examine there), or of a scan chosen over an indexed
    condition, times its ``filtered`` share; None for a scan over a
    condition on no index, whose ``rows`` is the whole table's. None too
    for SQLite, a plan of several tables, a queryset that matches nothing
    by construction. An estimate
    may be far off either way, so the caller checks it (`EstimatingPaginator`).
    """
    connection = connections[rows.db]
    if connection.vendor not in ("mysql", "postgresql"):
        return None
    try:
        sql, params = rows.order_by().query.get_compiler(rows.db).as_sql()
    except EmptyResultSet:
        return None
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            return int(plan[0]["Plan"]["Plan Rows"])
        # MariaDB gives the share of the rows read that match (``filtered``) with EXTENDED; MySQL 8 always.
        extended = "EXTENDED " if getattr(connection, "mysql_is_mariadb", False) else ""
        cursor.execute(f"EXPLAIN {extended}{sql}", params)
        steps = cursor.fetchall()
        names = [column[0].lower() for column in cursor.description]
    if len(steps) != 1 or not {"rows", "type", "possible_keys"} <= set(names):  # several tables, or another format
        return None
    step = dict(zip(names, steps[0], strict=True))
    if step["rows"] is None:
        return None
    if step["type"] in ("ALL", "index"):
        # A scan reads the whole table. Over a condition on no index the planner knows nothing of the
        # matches; over an indexed one it scans because most rows match, and ``filtered`` says how many.
        if not step["possible_keys"]:
            return None
        return int(int(step["rows"]) * float(step.get("filtered") or 100) / 100)
    return int(step["rows"])


@contextmanager
def without_jit(using: str) -> Iterator[None]:
    """PostgreSQL: the block's statements run in a transaction that does not JIT-compile them.

    The planner costs a list's ``EXPLAIN`` and capped count by the table
    they could read (10 million rows: far past ``jit_above_cost``), so the
    server compiles statements that read a thousand rows: measured here,
    1.4 ms of a 2 ms ``EXPLAIN``. Inside the caller's transaction the
    setting lasts until that transaction ends. Elsewhere: nothing.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        yield
        return
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
        yield
