"""Fragments of hand-written SQL that differ per database.

The model layer writes a few hot-path statements by hand (multi-row
inserts, archive copies); the pieces of them that a database spells its
own way come from here.
"""

from __future__ import annotations

from collections.abc import Callable
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


def array_columns(using: str, types: list[str]) -> str:
    """PostgreSQL: ``SELECT * FROM unnest(%s::type[], ...)``, the rows of an INSERT given one array per column.

    Elsewhere '': the INSERT lists its rows. (Django's own bulk_create does the same on PostgreSQL.)
    """
    if connections[using].vendor != "postgresql":
        return ""
    return "SELECT * FROM unnest(" + ", ".join(f"%s::{t}[]" for t in types) + ")"


def insert_returns_ids(using: str) -> bool:
    """Whether a multi-row INSERT can return the ids it made (RETURNING; not MySQL itself)."""
    return bool(connections[using].features.can_return_rows_from_bulk_insert)


def quoter(using: str) -> Callable[[Any], str] | None:
    """Where the driver quotes parameters into the statement's text itself (MySQLdb), a function quoting as it does.

    A multi-row INSERT whose rows share most of their values then writes
    each shared value once into its text, instead of having it quoted again
    for every row: the driver's quoting was a third of ``enqueue_many``'s
    time on MariaDB. The text is ready for the driver's ``%`` formatting.
    Elsewhere None: PostgreSQL gets arrays, SQLite binds natively.
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
