"""Fragments of hand-written SQL that differ per database.

The model layer writes a few hot-path statements by hand (multi-row
inserts, archive copies); the pieces of them that a database spells its
own way come from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections


def json_param(using: str) -> str:
    """A placeholder for a JSON text parameter stored into a JSON column from hand-written SQL."""
    return "CAST(%s AS jsonb)" if connections[using].vendor == "postgresql" else "%s"


def insert_ignoring(using: str, table: str, columns: list[str], rows: int) -> str:
    """A multi-row INSERT of ``rows`` rows that skips rows a unique index refuses (Django's words for each database)."""
    from django.db.models.constants import OnConflict

    ops = connections[using].ops
    qn = ops.quote_name
    values = ", ".join(["(" + ", ".join(["%s"] * len(columns)) + ")"] * rows)
    head = ops.insert_statement(on_conflict=OnConflict.IGNORE)
    tail = ops.on_conflict_suffix_sql([], OnConflict.IGNORE, [], [])
    return f"{head} {qn(table)} ({', '.join(qn(c) for c in columns)}) VALUES {values} {tail}".rstrip()


def use_index(using: str, index: str) -> str:
    """A hint after a table's name (and alias) to read it through ``index``: MySQL/MariaDB only, else ''.

    For the few statements whose best index MariaDB's optimizer misjudges
    when the table's statistics lag behind a fast-changing backlog.
    """
    return f" FORCE INDEX ({connections[using].ops.quote_name(index)})" if connections[using].vendor == "mysql" else ""


def rows_among(using: str, table: str, ids: str) -> tuple[str, str, str]:
    """How a statement reads the rows of ``table`` whose ids a small SELECT (``ids``, with its LIMIT) picks first.

    Returns the keyword after SELECT, the FROM clause and the WHERE
    condition. Each database has a form whose plan starts from the few ids
    and looks each row up by primary key, where others made the optimizer
    walk the large table instead: MySQL/MariaDB join the ids (a derived
    table) first (``STRAIGHT_JOIN``; with ``IN``, MariaDB may walk the
    table and look each row up in the ids); PostgreSQL reads them into an
    array first (with a join or ``IN``, it hashed the ids and scanned the
    table); SQLite takes ``IN`` as a list.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    t, i = qn(table), qn("id")
    if connection.vendor == "mysql":
        return "STRAIGHT_JOIN ", f"({ids}) picked JOIN {t} ON {t}.{i} = picked.{i}", "1 = 1"
    if connection.vendor == "postgresql":
        return "", t, f"{t}.{i} = ANY(ARRAY({ids}))"
    return "", t, f"{t}.{i} IN ({ids})"


def first_of_group(using: str, table: str, index: str, row: str) -> str:
    """A sub-select of the first id of row ``row``'s group in its queue (parameter: the queue), read on ``index``.

    ``index`` is ``(queue, group_key, id)``. The group comes from the outer
    row, so the sub-select is planned once for every group. With one group
    holding most of the queue, PostgreSQL then walked the primary key in id
    order for any group, reading the big group's rows before a small
    group's first: there the sub-select asks for the first index entry at
    or after ``(queue, group)``, an order only ``index`` has, and keeps its
    id if it is that group's. MySQL/MariaDB are told the index (`use_index`).
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    t, q, g, i = qn(table), qn("queue"), qn("group_key"), qn("id")
    if connection.vendor == "postgresql":
        return (
            f"SELECT CASE WHEN h.{q} = {row}.{q} AND h.{g} = {row}.{g} THEN h.{i} END FROM {t} h "
            f"WHERE (h.{q}, h.{g}) >= (%s, {row}.{g}) ORDER BY h.{q}, h.{g}, h.{i} LIMIT 1"
        )
    hint = use_index(using, index)
    return f"SELECT h.{i} FROM {t} h{hint} WHERE h.{q} = %s AND h.{g} = {row}.{g} ORDER BY h.{i} LIMIT 1"


def skip_locked(using: str, table: str) -> str:
    """``FOR UPDATE SKIP LOCKED`` of ``table``'s rows only, in a statement that may read others ('' on SQLite):
    `for_update_of`, skipping what others locked."""
    return for_update_of(using, table, skip_locked=True)


def locks_in_sort_order(using: str) -> bool:
    """Whether a locking SELECT takes its row locks in its ORDER BY's order: PostgreSQL's do; MySQL/MariaDB
    lock rows as they read them, whatever the sort, and SQLite locks no rows."""
    return connections[using].vendor == "postgresql"


def for_update_of(using: str, table: str, *, skip_locked: bool = False) -> str:
    """``FOR UPDATE`` of ``table``'s rows only, in a statement that may read others ('' on SQLite).

    PostgreSQL names the table (``OF``): its lock would otherwise reach the
    other tables' rows as well; it takes its locks in the statement's sort
    order. MySQL/MariaDB lock the rows of the tables they read, as they read
    them.
    """
    connection = connections[using]
    features = connection.features
    if not (features.has_select_for_update_skip_locked if skip_locked else features.has_select_for_update):
        return ""
    lock = f" FOR UPDATE OF {connection.ops.quote_name(table)}" if connection.vendor == "postgresql" else " FOR UPDATE"
    return lock + (" SKIP LOCKED" if skip_locked else "")


def array_columns(using: str, types: list[str], shared: Sequence[bool]) -> str:
    """PostgreSQL: the rows of an INSERT given one array per column that varies and one value per column that doesn't.

    ``SELECT CAST(%s AS type), u.c1, ... FROM unnest(%s::type[], ...) AS u(c1, ...)``
    (``CAST``, not ``%s::type``: a client-side bound -32768 would read
    ``-32768::smallint``, the minus applied after the cast, out of range):
    the shared values' placeholders come first (in column order), then the
    arrays'. A shared column sent as one value instead of an array of
    copies: the driver adapts each element of an array on its own, which
    was most of a batch's time when every row but the payload is alike.
    Elsewhere '': the INSERT lists its rows. (Django's own bulk_create sends
    one array per column on PostgreSQL.)
    """
    if not inserts_arrays(using):
        return ""
    varying = [i for i, same in enumerate(shared) if not same]
    if not varying:  # unnest() gives the rows' count: it needs an array
        raise ValueError("array_columns needs at least one column that varies")
    selected = ", ".join(f"u.c{i}" if i in varying else f"CAST(%s AS {t})" for i, t in enumerate(types))
    arrays = ", ".join(f"%s::{types[i]}[]" for i in varying)
    return f"SELECT {selected} FROM unnest({arrays}) AS u({', '.join(f'c{i}' for i in varying)})"


def inserts_arrays(using: str) -> bool:
    """Whether a multi-row INSERT takes its rows as arrays (`array_columns`): PostgreSQL."""
    return connections[using].vendor == "postgresql"


def insert_returns_ids(using: str) -> bool:
    """Whether a multi-row INSERT can return the ids it made (RETURNING; not MySQL itself)."""
    return bool(connections[using].features.can_return_rows_from_bulk_insert)


def quoter(using: str) -> Callable[[Any], str] | None:
    """Where the driver quotes parameters into the statement's text itself (MySQLdb), a function quoting as it does.

    A multi-row INSERT whose rows share most of their values then writes
    each shared value once into its text, instead of having it quoted again
    for every row: the driver's quoting was a third of ``enqueue_many``'s
    time on MariaDB. The text is ready for the driver's ``%`` formatting.
    Elsewhere None: PostgreSQL gets arrays and typed values (`array_columns`), SQLite binds natively.
    """
    connection = connections[using]
    if connection.vendor != "mysql":
        return None
    connection.ensure_connection()
    driver = connection.connection

    def quote(value: Any) -> str:
        text = driver.literal(value)
        return (text.decode(driver.encoding) if isinstance(text, bytes) else text).replace("%", "%%")

    return quote


# The index of set-aside messages (flow control): the groups that have some, and a group's set-aside messages
# in their claim order (their own priority, then availability and id). Where partial indexes exist it holds
# only those rows; MySQL/MariaDB have none, so there it holds every row, by priority first, so that the
# set-aside ones of a queue (the largest priority) are one range.
ASIDE_INDEX = "dbqueue_msg_aside"


def aside_index_sql(connection: Any, priority: int) -> tuple[str, str]:
    """The statements that create and drop `ASIDE_INDEX` on the live table (``priority``: a set-aside message's)."""
    qn = connection.ops.quote_name
    table, name = qn("dbqueue_message"), qn(ASIDE_INDEX)
    q, g, p = qn("queue"), qn("group_key"), qn("priority")
    order = ", ".join(qn(c) for c in ("held_priority", "available_at", "id"))
    if connection.vendor == "mysql":
        return f"CREATE INDEX {name} ON {table} ({q}, {p}, {g}, {order})", f"DROP INDEX {name} ON {table}"
    return f"CREATE INDEX {name} ON {table} ({q}, {g}, {order}) WHERE {p} = {int(priority)}", f"DROP INDEX {name}"
