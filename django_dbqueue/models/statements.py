"""Statements the ORM cannot express, kept for the hot path: archive rows copied in the database.

Acknowledging a batch used to read each message into Python and write an
archive row back through ``bulk_create``. ``INSERT ... SELECT`` copies the
rows inside the database instead: one statement however large the batch,
and no Python object per row. Vendor differences (JSON parameters, the
clock, RETURNING) come from :mod:`django_dbqueue.db`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.db import connections

from ..db.clock import compile_now
from ..db.sql import insert_returns_ids, json_param

if TYPE_CHECKING:
    from .messages import Message

# The tables' names: a documented contract (docs/table-layout.md); the models' Meta use these.
MESSAGE_TABLE = "dbqueue_message"
ARCHIVE_TABLE = "dbqueue_archive"

# Columns an archive row takes unchanged from the live row.
COPIED = (
    "queue",
    "kind",
    "key",
    "payload",
    "headers",
    "priority",
    "created_at",
    "first_available_at",
    "claimed_at",
    "expires_at",
    "attempts",
    "max_attempts",
    "last_error",
    "replay_of",
)


def archive_copies(
    using: str,
    ids: list[int],
    outcome: str,
    worker: str,
    results: Mapping[int, Any],
    errors: Mapping[int, str] | None = None,
) -> int:
    """Copy live messages ``ids`` into the archive as ``outcome``; returns the rows written.

    ``results`` holds handlers' return values by message id, already made
    storable (:func:`~django_dbqueue.validation.storable_result`); ``errors``
    replaces ``last_error`` for some ids (a note that a result was not kept).
    The caller deletes the live rows in the same transaction.
    """
    if not ids:
        return 0
    connection = connections[using]
    qn = connection.ops.quote_name
    now_sql, now_params = compile_now(using)
    columns = ", ".join(qn(c) for c in COPIED)
    copied = columns
    error_params: list[Any] = []
    errors = {pk: text for pk, text in (errors or {}).items() if pk in ids}
    if errors:
        cases = " ".join("WHEN %s THEN %s" for _ in errors)
        copied = ", ".join(f"CASE {qn('id')} {cases} ELSE {qn(c)} END" if c == "last_error" else qn(c) for c in COPIED)
        for pk, text in errors.items():
            error_params += [pk, text]
    finished_by = "%s" if worker else qn("claimed_by")
    result_sql, result_params = "NULL", []
    kept = {pk: r for pk, r in results.items() if pk in ids and r is not None}
    if kept:
        cases = " ".join(f"WHEN %s THEN {json_param(using)}" for _ in kept)
        result_sql = f"CASE {qn('id')} {cases} ELSE NULL END"
        for pk, value in kept.items():
            result_params += [pk, json.dumps(value)]
    sql = (
        f"INSERT INTO {qn(ARCHIVE_TABLE)} "
        f"({qn('message_id')}, {columns}, {qn('finished_at')}, {qn('outcome')}, {qn('finished_by')}, "
        f"{qn('result')}, {qn('replayed_by')}) "
        f"SELECT {qn('id')}, {copied}, {now_sql}, %s, {finished_by}, {result_sql}, '' "
        f"FROM {qn(MESSAGE_TABLE)} WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))})"
    )
    params = [*error_params, *now_params, outcome, *([worker] if worker else []), *result_params, *ids]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        written: int = cursor.rowcount
        return written


# Columns a producer's INSERT fills; the rest take their database defaults.
INSERTED = (
    "queue",
    "kind",
    "key",
    "payload",
    "headers",
    "priority",
    "available_at",
    "first_available_at",
    "created_at",
    "expires_at",
    "max_attempts",
)


def insert_messages(using: str, messages: list[Message], batch_size: int) -> None:
    """Multi-row INSERT of unsaved, validated messages; sets their ids where the database returns them.

    ``bulk_create`` prepares every field of every row through the ORM, which
    made ``enqueue_many`` several times slower than the INSERT itself. The
    values here are already validated, so they only need adapting.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    json_sql = json_param(using)
    row_sql = "(" + ", ".join(json_sql if c in ("payload", "headers") else "%s" for c in INSERTED) + ")"
    returning = insert_returns_ids(using)
    per_statement = batch_size
    if connection.features.max_query_params:
        per_statement = max(1, min(batch_size, connection.features.max_query_params // len(INSERTED)))
    head = f"INSERT INTO {qn(MESSAGE_TABLE)} ({', '.join(qn(c) for c in INSERTED)}) VALUES "
    with connection.cursor() as cursor:
        for start in range(0, len(messages), per_statement):
            chunk = messages[start : start + per_statement]
            params: list[Any] = []
            for m in chunk:
                params += [
                    m.queue,
                    m.kind,
                    m.key,
                    json.dumps(m.payload),
                    json.dumps(m.headers),
                    m.priority,
                    adapt(m.available_at),
                    adapt(m.first_available_at),
                    adapt(m.created_at),
                    adapt(m.expires_at),
                    m.max_attempts,
                ]
            sql = head + ", ".join([row_sql] * len(chunk)) + (f" RETURNING {qn('id')}" if returning else "")
            cursor.execute(sql, params)
            if returning:
                for message, (pk,) in zip(chunk, cursor.fetchall(), strict=True):
                    message.pk = pk
    for message in messages:
        message._state.adding = False
        message._state.db = using


def distinct_leading(using: str, table: str, column: str) -> list[str]:
    """The distinct values of ``column``, the first column of an index of ``table``, by a skip scan.

    One index lookup per distinct value (a recursive query of MIN(column)
    > the previous value), where ``SELECT DISTINCT`` would read every row
    on PostgreSQL. Recursive CTEs run on every supported database.
    """
    qn = connections[using].ops.quote_name
    t, c = qn(table), qn(column)
    sql = (
        f"WITH RECURSIVE found (v) AS (SELECT MIN({c}) FROM {t} "
        f"UNION ALL SELECT (SELECT MIN({c}) FROM {t} WHERE {c} > found.v) FROM found WHERE found.v IS NOT NULL) "
        "SELECT v FROM found WHERE v IS NOT NULL"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]
