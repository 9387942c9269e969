"""Fragments of hand-written SQL that differ per database.

The model layer writes a few hot-path statements by hand (multi-row
inserts, archive copies); the pieces of them that a database spells its
own way come from here.
"""

from __future__ import annotations

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
