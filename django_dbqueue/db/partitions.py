"""Range partitions of a table by a time column: the MariaDB/MySQL and PostgreSQL DDL.

The archive may be partitioned by its finish time (docs/archive.md) so that
retention drops whole partitions instead of deleting rows. Both servers
need the partition column in every unique key, so a partitioned table's
primary key is ``(id, column)``. Each layout keeps a catch-all for rows
past its last range (MariaDB/MySQL: a ``MAXVALUE`` partition; PostgreSQL:
the ``DEFAULT`` partition), so no write ever meets a missing partition.
On MariaDB/MySQL the lowest range takes everything older than its upper
bound; on PostgreSQL it does until older ranges are retired, and then a
row older than the lowest range's floor goes to the default partition.

A table is converted by building the other layout beside it, swapping
the two names in one step and copying the old rows behind
(`create_like`, `swap`, `copy_ids`); the callers (``models.partitions``)
decide which table and when. SQLite has no partitions: every function
here refuses it with `PartitioningUnsupported`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, connections, transaction

from ..exceptions import DbQueueError
from .errors import is_lock_timeout

# On MariaDB/MySQL the new table's id counter starts this far past the old
# one's highest id, for the rows written to the old table between reading
# that id and the rename (a rename cannot hold a lock across both steps).
ID_GAP = 1_000_000

# How long the reaper's partition DDL (creation ahead, drops) waits for the
# table's lock. A DDL statement waiting for it holds up every later write to
# the table behind it (PostgreSQL's lock queue, MySQL's metadata locks), so
# behind a long transaction on the archive (an analytics read, an open
# shell) an unbounded wait would stall every ack; bounded, the upkeep gives
# up and the next pass tries again.
UPKEEP_LOCK_WAIT_SECONDS = 1.0


class PartitioningUnsupported(DbQueueError):
    """The database has no table partitions (SQLite)."""


class LockNotFree(DbQueueError):
    """Partition DDL gave up waiting for its table's lock (a long transaction holds it); that statement did nothing."""


@dataclass(frozen=True)
class Range:
    """One partition to create: ``label`` names it (``20261126``), rows up to ``upper`` (exclusive, UTC) go in."""

    label: str
    upper: datetime


@dataclass(frozen=True)
class Partition:
    """One partition as the database has it; ``upper`` is None for the catch-all, ``rows`` the planner's estimate."""

    name: str
    upper: datetime | None
    rows: int


def _vendor(using: str) -> str:
    vendor = connections[using].vendor
    if vendor not in ("mysql", "postgresql"):
        raise PartitioningUnsupported(
            f"database {using!r} is {connections[using].display_name}, which has no table partitions; "
            "ARCHIVE_PARTITIONS works on MariaDB/MySQL and PostgreSQL (docs/archive.md)"
        )
    return vendor


def require(using: str) -> None:
    """Raise `PartitioningUnsupported`, naming the database, unless it has table partitions."""
    _vendor(using)


def supported(using: str) -> bool:
    return connections[using].vendor in ("mysql", "postgresql")


def _qn(using: str, name: str) -> str:
    return connections[using].ops.quote_name(name)


def _literal(moment: datetime) -> str:
    """A UTC timestamp as a SQL literal both servers read (the connections run in UTC)."""
    return "'" + moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") + "'"


def partition_name(table: str, label: str) -> str:
    """The partition's name: ``p20261126`` on MariaDB/MySQL (names are per table), a table of its own on PostgreSQL."""
    return f"{table}_p{label}"


def exists(using: str, table: str) -> bool:
    return table in connections[using].introspection.table_names()


def is_partitioned(using: str, table: str) -> bool:
    if not supported(using):
        return False
    with connections[using].cursor() as cursor:
        if _vendor(using) == "mysql":
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() "
                "AND TABLE_NAME = %s AND PARTITION_NAME IS NOT NULL",
                [table],
            )
            return bool(cursor.fetchone()[0])
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [table])
        row = cursor.fetchone()
        return row is not None and row[0] == "p"


_PG_BOUND = re.compile(r"TO \('([^']+)'\)")


def _moment(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def partitions(using: str, table: str) -> list[Partition]:
    """The table's partitions, lowest first, the catch-all last (empty for a plain table)."""
    vendor = _vendor(using)
    with connections[using].cursor() as cursor:
        if vendor == "mysql":
            cursor.execute(
                "SELECT PARTITION_NAME, PARTITION_DESCRIPTION, TABLE_ROWS FROM information_schema.PARTITIONS "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND PARTITION_NAME IS NOT NULL "
                "ORDER BY PARTITION_ORDINAL_POSITION",
                [table],
            )
            found = [
                Partition(name, None if bound == "MAXVALUE" else _moment(bound.strip("'")), int(rows or 0))
                for name, bound, rows in cursor.fetchall()
            ]
        else:
            cursor.execute(
                "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), c.reltuples FROM pg_inherits i "
                "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
                [table],
            )
            found = []
            for name, bound, rows in cursor.fetchall():
                upper = _PG_BOUND.search(bound)
                found.append(Partition(name, _moment(upper.group(1)) if upper else None, max(0, int(rows))))
    far = datetime.max.replace(tzinfo=UTC)
    return sorted(found, key=lambda partition: partition.upper or far)


def _band(using: str, column: str, below: datetime | None, at_least: datetime | None = None) -> str:
    """A WHERE clause for ``at_least <= column < below`` (either bound left out when None)."""
    qc = _qn(using, column)
    bounds = ([f"{qc} >= {_literal(at_least)}"] if at_least is not None else []) + (
        [f"{qc} < {_literal(below)}"] if below is not None else []
    )
    return f" WHERE {' AND '.join(bounds)}" if bounds else ""


def has_rows(
    using: str,
    table: str,
    partition: str,
    below: datetime | None = None,
    column: str = "",
    at_least: datetime | None = None,
) -> bool:
    """Whether ``partition`` of ``table`` holds a row (one whose ``column`` is in [``at_least``, ``below``))."""
    vendor = _vendor(using)
    source = f"{_qn(using, table)} PARTITION ({_qn(using, partition)})" if vendor == "mysql" else _qn(using, partition)
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {source}{_band(using, column, below, at_least)} LIMIT 1")
        return cursor.fetchone() is not None


def _mysql_ranges(using: str, ranges: Sequence[Range]) -> str:
    parts = [f"PARTITION {_qn(using, 'p' + r.label)} VALUES LESS THAN ({_literal(r.upper)})" for r in ranges] + [
        "PARTITION pmax VALUES LESS THAN (MAXVALUE)"
    ]
    return ", ".join(parts)


def _pg_partition(using: str, table: str, prefix: str, lower: datetime | None, r: Range) -> str:
    start = "MINVALUE" if lower is None else _literal(lower)
    return (
        f"CREATE TABLE {_qn(using, partition_name(prefix, r.label))} PARTITION OF {_qn(using, table)} "
        f"FOR VALUES FROM ({start}) TO ({_literal(r.upper)})"
    )


def _pg_create_ranges(
    cursor: Any, using: str, table: str, prefix: str, lower: datetime | None, ranges: Sequence[Range]
) -> None:
    """Each range a partition of its own, from the one before (``lower`` first; None: from MINVALUE)."""
    for r in ranges:
        cursor.execute(_pg_partition(using, table, prefix, lower, r))
        lower = r.upper


def _pg_indexes(using: str, table: str) -> list[tuple[str, str]]:
    """(name, definition) of the table's indexes other than its primary key."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s) AND NOT i.indisprimary ORDER BY c.relname",
            [table],
        )
        return list(cursor.fetchall())


def temporary_index_name(name: str, mark: str) -> str:
    """An index's name while two tables hold the same indexes (PostgreSQL's index names are per schema)."""
    return f"{name[: 63 - len(mark) - 1]}_{mark}"


def create_like(
    using: str, source: str, target: str, *, column: str, ranges: Sequence[Range] | None, prefix: str
) -> None:
    """Create ``target`` empty with ``source``'s columns and indexes, partitioned by ``ranges`` or plain when None.

    Partitioned: primary key ``(id, column)``, the ranges (the lowest takes
    everything older) and a catch-all; PostgreSQL's partitions are named
    after ``prefix``. Plain: primary key ``id``. On PostgreSQL the indexes
    get temporary names (`temporary_index_name` with ``new``) until `swap`.
    """
    vendor = _vendor(using)
    qs, qt, qc = _qn(using, source), _qn(using, target), _qn(using, column)
    with transaction.atomic(using), connections[using].cursor() as cursor:
        if vendor == "mysql":
            cursor.execute(f"CREATE TABLE {qt} LIKE {qs}")
            if ranges is None:
                if is_partitioned(using, source):
                    cursor.execute(f"ALTER TABLE {qt} REMOVE PARTITIONING")
                cursor.execute(f"ALTER TABLE {qt} DROP PRIMARY KEY, ADD PRIMARY KEY (id)")
            else:
                if not is_partitioned(using, source):
                    cursor.execute(f"ALTER TABLE {qt} DROP PRIMARY KEY, ADD PRIMARY KEY (id, {qc})")
                cursor.execute(f"ALTER TABLE {qt} PARTITION BY RANGE COLUMNS({qc}) ({_mysql_ranges(using, ranges)})")
            return
        indexes = _pg_indexes(using, source)
        if ranges is None:
            cursor.execute(f"CREATE TABLE {qt} (LIKE {qs} INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMMENTS)")
            cursor.execute(f"ALTER TABLE {qt} ALTER id DROP DEFAULT")
            cursor.execute(f"ALTER TABLE {qt} ALTER id ADD GENERATED BY DEFAULT AS IDENTITY")
            cursor.execute(f"ALTER TABLE {qt} ADD PRIMARY KEY (id)")
        else:
            cursor.execute(
                f"CREATE TABLE {qt} (LIKE {qs} INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMMENTS) "
                f"PARTITION BY RANGE ({qc})"
            )
            sequence = _qn(using, f"{target}_id_seq")
            cursor.execute(f"ALTER TABLE {qt} ALTER id DROP DEFAULT")  # the source's, when it was partitioned
            cursor.execute(f"CREATE SEQUENCE {sequence} OWNED BY {qt}.id")
            cursor.execute(f"ALTER TABLE {qt} ALTER id SET DEFAULT nextval('{sequence}')")
            cursor.execute(f"ALTER TABLE {qt} ADD PRIMARY KEY (id, {qc})")
            _pg_create_ranges(cursor, using, target, prefix, None, ranges)
            cursor.execute(f"CREATE TABLE {_qn(using, prefix + '_default')} PARTITION OF {qt} DEFAULT")
        for name, definition in indexes:
            # "CREATE INDEX name ON [ONLY] public.source USING ...": same index, other name and table.
            columns = definition.split(" USING ", 1)[1]
            cursor.execute(f"CREATE INDEX {_qn(using, temporary_index_name(name, 'new'))} ON {qt} USING {columns}")


def _id_sequence(cursor: Any, using: str, table: str) -> str:
    cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
    return str(cursor.fetchone()[0])


def swap(using: str, table: str, new: str, old: str) -> None:
    """Rename ``table`` to ``old`` and ``new`` to ``table`` in one step; new ids continue past the old ones.

    From then on every write goes to the new table. PostgreSQL: one
    transaction under an exclusive lock, so the id sequence continues
    exactly, and the index names move with the tables. MariaDB/MySQL: one
    ``RENAME TABLE``; the new counter starts `ID_GAP` past the highest id.
    """
    vendor = _vendor(using)
    qt, qn_new, qold = _qn(using, table), _qn(using, new), _qn(using, old)
    with transaction.atomic(using), connections[using].cursor() as cursor:
        if vendor == "mysql":
            cursor.execute(f"SELECT COALESCE(MAX(id), 0) FROM {qt}")
            cursor.execute(f"ALTER TABLE {qn_new} AUTO_INCREMENT = {int(cursor.fetchone()[0]) + ID_GAP}")
            cursor.execute(f"RENAME TABLE {qt} TO {qold}, {qn_new} TO {qt}")
            return
        cursor.execute(f"LOCK TABLE {qt} IN ACCESS EXCLUSIVE MODE")
        current = _id_sequence(cursor, using, table)
        cursor.execute("SELECT nextval(%s)", [current])
        following = cursor.fetchone()[0]
        cursor.execute("SELECT setval(%s, %s)", [_id_sequence(cursor, using, new), following])
        for name, _ in _pg_indexes(using, table):
            cursor.execute(f"ALTER INDEX {_qn(using, name)} RENAME TO {_qn(using, temporary_index_name(name, 'old'))}")
        for name, _ in _pg_indexes(using, new):
            final = name.removesuffix("_new")
            cursor.execute(f"ALTER INDEX {_qn(using, name)} RENAME TO {_qn(using, final)}")
        primary = f"{table}_pkey"
        cursor.execute(f"ALTER TABLE {qt} RENAME CONSTRAINT {_qn(using, primary)} TO {_qn(using, old + '_pkey')}")
        cursor.execute(f"ALTER TABLE {qt} RENAME TO {qold}")
        cursor.execute(f"ALTER TABLE {qn_new} RENAME CONSTRAINT {_qn(using, new + '_pkey')} TO {_qn(using, primary)}")
        cursor.execute(f"ALTER TABLE {qn_new} RENAME TO {qt}")
        _pg_name_partition_indexes(using, table)


def _pg_name_partition_indexes(using: str, table: str) -> None:
    """Name each partition's index after the table's index it belongs to: ``dbqueue_arc_key_p20261126``.

    PostgreSQL names them after the partition's columns; named after the
    parent, a plan that names a partition's index says which one it is.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT child.relname, parent.relname, part.relname FROM pg_inherits parts "
            "JOIN pg_class part ON part.oid = parts.inhrelid "
            "JOIN pg_index x ON x.indrelid = part.oid "
            "JOIN pg_class child ON child.oid = x.indexrelid "
            "JOIN pg_inherits up ON up.inhrelid = child.oid "
            "JOIN pg_class parent ON parent.oid = up.inhparent "
            "WHERE parts.inhparent = to_regclass(%s)",
            [table],
        )
        for child, parent, part in cursor.fetchall():
            wanted = f"{parent}_{part.removeprefix(table + '_')}"[:63]
            if child != wanted:
                cursor.execute(f"ALTER INDEX {_qn(using, child)} RENAME TO {_qn(using, wanted)}")


def columns(using: str, table: str) -> list[str]:
    with connections[using].cursor() as cursor:
        return [c.name for c in connections[using].introspection.get_table_description(cursor, table)]


def copy_ids(using: str, source: str, target: str, names: Iterable[str], after: int, up_to: int) -> int:
    """Copy the rows of ``source`` with ``after < id <= up_to`` into ``target`` (ids kept); one statement, atomic."""
    listed = ", ".join(_qn(using, name) for name in names)
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {_qn(using, target)} ({listed}) SELECT {listed} FROM {_qn(using, source)} "
            "WHERE id > %s AND id <= %s",
            [after, up_to],
        )
        return int(cursor.rowcount)


def chunk_end(using: str, table: str, after: int, size: int) -> int | None:
    """The id that ends the next chunk of ``size`` rows of ``table`` after id ``after`` (None: no row is left).

    Chunks count rows, not ids: ids have gaps (a conversion on MariaDB/MySQL leaves one of `ID_GAP`).
    """
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"SELECT MAX(id) FROM (SELECT id FROM {_qn(using, table)} WHERE id > %s ORDER BY id LIMIT %s) chunk",
            [after, size],
        )
        end = cursor.fetchone()[0]
        return None if end is None else int(end)


def id_bounds(using: str, table: str, below: int | None = None) -> tuple[int, int]:
    """(smallest, highest) id of ``table`` (of its ids up to ``below``, when given); (0, 0) when there is none."""
    where = "" if below is None else f" WHERE id <= {int(below)}"
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT COALESCE(MIN(id), 0), COALESCE(MAX(id), 0) FROM {_qn(using, table)}{where}")
        low, high = cursor.fetchone()
        return int(low), int(high)


def oldest(using: str, table: str, column: str) -> datetime | None:
    """The smallest ``column`` of ``table`` (UTC), None when it is empty."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT MIN({_qn(using, column)}) FROM {_qn(using, table)}")
        value = cursor.fetchone()[0]
    if value is None:
        return None
    return _moment(value.isoformat()) if isinstance(value, datetime) else _moment(str(value))


def count_after(using: str, table: str, after: int) -> int:
    """How many rows of ``table`` have an id above ``after``."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {_qn(using, table)} WHERE id > %s", [after])
        return int(cursor.fetchone()[0])


def drop_table(using: str, table: str) -> None:
    _vendor(using)
    with connections[using].cursor() as cursor:
        cursor.execute(f"DROP TABLE {_qn(using, table)}")


def drop_old(using: str, table: str, old: str) -> None:
    """Drop ``old`` once its rows are copied; on PostgreSQL ``table``'s id sequence takes back its usual name."""
    with transaction.atomic(using), connections[using].cursor() as cursor:
        drop_table(using, old)
        if _vendor(using) == "postgresql":
            usual = f"{table}_id_seq"
            sequence = _id_sequence(cursor, using, table)
            if sequence.rsplit(".", 1)[-1].strip('"') != usual:
                cursor.execute(f"ALTER SEQUENCE {sequence} RENAME TO {_qn(using, usual)}")


def add_ranges(
    using: str, table: str, column: str, ranges: Sequence[Range], *, prefix: str, lock_wait: float | None = None
) -> None:
    """Add ``ranges`` (each above the table's last range) before the catch-all.

    Rows the catch-all holds below a new range's upper bound move into it:
    MariaDB/MySQL's ``REORGANIZE PARTITION`` rewrites the catch-all (cheap
    when it is empty, which creation ahead keeps it); PostgreSQL detaches
    its default partition, moves those rows and attaches it again, in one
    transaction (writes wait for it). Only rows from the last range's upper
    bound on can be there to move: PostgreSQL refuses the default partition
    a row that a range takes. Older rows it holds (below the lowest range's
    floor once older ranges are retired: a clock set back, an import) stay
    there, as no range takes them, and row pruning removes them with their
    age. ``lock_wait``: see `waiting_at_most`.
    """
    if not ranges:
        return
    vendor = _vendor(using)
    qt = _qn(using, table)
    with transaction.atomic(using), connections[using].cursor() as cursor, waiting_at_most(using, cursor, lock_wait):
        if vendor == "mysql":
            cursor.execute(f"ALTER TABLE {qt} REORGANIZE PARTITION pmax INTO ({_mysql_ranges(using, ranges)})")
            return
        existing = [p for p in partitions(using, table) if p.upper is not None]
        lower = existing[-1].upper if existing else None
        default = prefix + "_default"
        qd = _qn(using, default)
        if has_rows(using, table, default, ranges[-1].upper, column, at_least=lower):
            cursor.execute(f"ALTER TABLE {qt} DETACH PARTITION {qd}")
            _pg_create_ranges(cursor, using, table, prefix, lower, ranges)
            listed = ", ".join(_qn(using, name) for name in columns(using, default))
            band = _band(using, column, ranges[-1].upper, lower)
            cursor.execute(f"INSERT INTO {qt} ({listed}) SELECT {listed} FROM {qd}{band}")
            cursor.execute(f"DELETE FROM {qd}{band}")
            cursor.execute(f"ALTER TABLE {qt} ATTACH PARTITION {qd} DEFAULT")
        else:
            _pg_create_ranges(cursor, using, table, prefix, lower, ranges)
        _pg_name_partition_indexes(using, table)


def drop_partitions(using: str, table: str, names: Sequence[str], *, lock_wait: float | None = None) -> None:
    """Drop whole partitions, their rows with them, now: `detach_partitions`, then their tables."""
    _drop_tables(using, detach_partitions(using, table, names, lock_wait=lock_wait), lock_wait)


def detach_partitions(using: str, table: str, names: Sequence[str], *, lock_wait: float | None = None) -> list[str]:
    """Take whole partitions out of ``table``, their rows with them, as tables of their own for `drop_detached`.

    No row is deleted one by one, and ``table``'s lock is held for a
    catalog change only, however many rows the partitions hold:
    PostgreSQL's ``DETACH PARTITION`` (all in one transaction), MariaDB's
    ``CONVERT PARTITION ... TO TABLE`` (10.7 on; a statement each, so a
    pass stopped halfway leaves the ones done detached). Freeing their
    files takes time in proportion to their size, and a server does it
    with the dropped table's locks held (on PostgreSQL 0.5 s for 30 days of
    a 10-million-row archive here): done on the detached tables, it holds
    up no ack. MySQL, which cannot take a partition out without copying
    it, drops it in place (``DROP PARTITION``). Returns the tables left
    to drop. ``lock_wait``: see `waiting_at_most`.
    """
    if not names:
        return []
    qt = _qn(using, table)
    if _vendor(using) == "postgresql":
        statements = [f"ALTER TABLE {qt} DETACH PARTITION {_qn(using, name)}" for name in names]
        tables = list(names)
    elif retires_to_tables(using):
        tables = [f"{table}_{name}" for name in names]
        statements = [
            f"ALTER TABLE {qt} CONVERT PARTITION {_qn(using, name)} TO TABLE {_qn(using, new)}"
            for name, new in zip(names, tables, strict=True)
        ]
    else:
        statements = [f"ALTER TABLE {qt} DROP PARTITION {', '.join(_qn(using, n) for n in names)}"]
        tables = []
    with transaction.atomic(using), connections[using].cursor() as cursor, waiting_at_most(using, cursor, lock_wait):
        for sql in statements:
            cursor.execute(sql)
    return tables


def retires_to_tables(using: str) -> bool:
    """Whether a partition taken out of its table becomes a table of its own (PostgreSQL; MariaDB 10.7 on).

    MySQL cannot take a partition out without copying it: there it is
    dropped in place, and no retired table is ever left.
    """
    return _vendor(using) == "postgresql" or _converts(using)


def _converts(using: str) -> bool:
    """Whether the server can turn a partition into a table of its own without copying it (MariaDB 10.7 on)."""
    connection: Any = connections[using]
    return bool(connection.mysql_is_mariadb and connection.mysql_version >= (10, 7))


def detached(using: str, table: str) -> list[str]:
    """The tables named as ``table``'s detached partitions (``dbqueue_archive_p20261126``), oldest first.

    PostgreSQL's partitions are such tables while attached too: only those
    attached to no table, in ``table``'s own schema, count. Empty where a
    retired partition never becomes a table (`retires_to_tables`): such a
    name is then someone else's table.
    """
    if not retires_to_tables(using):
        return []
    pattern = f"^{re.escape(table)}_p[0-9]{{8}}$"
    with connections[using].cursor() as cursor:
        if _vendor(using) == "postgresql":
            cursor.execute(
                "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r' "
                "AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%s)) "
                "AND c.relname ~ %s AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid) "
                "ORDER BY c.relname",
                [table, pattern],
            )
        else:
            cursor.execute(
                "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() "
                "AND TABLE_NAME REGEXP %s ORDER BY TABLE_NAME",
                [pattern],
            )
        return [row[0] for row in cursor.fetchall()]


def drop_detached(using: str, table: str, *, limit: int | None = None, lock_wait: float | None = None) -> list[str]:
    """Drop ``table``'s detached partitions, the oldest ``limit`` of them (None: all); their names.

    They are out of every read of ``table`` already, and dropping them
    takes none of its locks: what it costs the queue is the server's work
    freeing their files.
    """
    names = detached(using, table)[:limit]
    _drop_tables(using, names, lock_wait)
    return names


def _drop_tables(using: str, names: Sequence[str], lock_wait: float | None) -> None:
    if not names:
        return
    with transaction.atomic(using), connections[using].cursor() as cursor, waiting_at_most(using, cursor, lock_wait):
        cursor.execute(f"DROP TABLE {', '.join(_qn(using, n) for n in names)}")


@contextmanager
def waiting_at_most(using: str, cursor: Any, seconds: float | None) -> Iterator[None]:
    """Inside a transaction: the DDL run in the block waits at most ``seconds`` for its locks (None: unbounded).

    Raises `LockNotFree` when it gave up; the transaction is then rolled
    back by the caller's ``atomic`` (PostgreSQL), or the statement that
    waited was not run (MySQL's DDL, where the ones before it stay done).
    MySQL's bound is whole seconds, at least one, set on the session and
    restored afterwards. Meant for the reaper's own transactions: inside a
    caller's, PostgreSQL's ``SET LOCAL`` would last until that one ends.
    """
    if seconds is None:
        yield
        return
    restore = None
    if _vendor(using) == "postgresql":
        cursor.execute(f"SET LOCAL lock_timeout = {max(1, int(seconds * 1000))}")
    else:
        cursor.execute("SELECT @@SESSION.lock_wait_timeout")
        restore = int(cursor.fetchone()[0])
        cursor.execute(f"SET SESSION lock_wait_timeout = {max(1, math.ceil(seconds))}")
    try:
        yield
    except DatabaseError as exc:
        if is_lock_timeout(exc, using):
            raise LockNotFree(
                f"a transaction on the table held its lock for more than {seconds:g} s; the statement was not run"
            ) from exc
        raise
    finally:
        if restore is not None:
            with suppress(DatabaseError):  # a lost connection: its own error is the one to see
                cursor.execute(f"SET SESSION lock_wait_timeout = {restore}")
