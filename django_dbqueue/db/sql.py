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


def insert_returns_ids(using: str) -> bool:
    """Whether a multi-row INSERT can return the ids it made (RETURNING; not MySQL itself)."""
    return bool(connections[using].features.can_return_rows_from_bulk_insert)
