"""Statements the ORM cannot express, kept for the hot path: archive rows copied in the database.

Acknowledging a batch used to read each message into Python and write an
archive row back through ``bulk_create``. ``INSERT ... SELECT`` copies the
rows inside the database instead: one statement however large the batch,
and no Python object per row. Vendor differences (JSON parameters, the
clock, RETURNING) come from `django_dbqueue.db`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from django.apps import apps
from django.db import connections
from django.db.models.base import ModelState

from .. import validation
from ..db import cursors
from ..db.capabilities import statement_bytes, writable_ctes
from ..db.clock import aware_clock, compile_now, db_now, now_plus_seconds
from ..db.sql import array_columns, insert_returns_ids, inserts_arrays, json_param, quoter
from .protocols import LiveMessage

# The tables' names: a documented contract (docs/table-layout.md); the models' Meta use these.
MESSAGE_TABLE = "dbqueue_message"
ARCHIVE_TABLE = "dbqueue_archive"

# What a producer says of a message: the first columns of both lists below.
ENQUEUED = ("queue", "kind", "key", "group_key", "payload", "headers", "priority")


def message_model() -> type[LiveMessage]:
    """The live model, from the app registry: the modules below `messages` reach it here, never by importing it."""
    return apps.get_model("django_dbqueue", "Message")


def attribute(column: str) -> str:
    """The model attribute of one of these columns (they are the same but for ``group_key``, the field ``group``)."""
    return "group" if column == "group_key" else column


# Columns an archive row takes unchanged from the live row.
COPIED = (
    *ENQUEUED,
    "created_at",
    "first_available_at",
    "claimed_at",
    "expires_at",
    "attempts",
    "max_attempts",
    "deferrals",
    "last_error",
    "replay_of",
    "progress",
    "meta",
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
    storable (`storable_result`); ``errors``
    replaces ``last_error`` for some ids (a note that a result was not kept).
    The caller deletes the live rows in the same transaction.
    """
    if not ids:
        return 0
    sql, params = _archive_copy_sql(using, ids, outcome, worker, results, errors, MESSAGE_TABLE)
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        written: int = cursor.rowcount
        return written


def _archive_copy_sql(
    using: str,
    ids: list[int],
    outcome: str,
    worker: str,
    results: Mapping[int, Any],
    errors: Mapping[int, str] | None,
    source: str,
    guard: tuple[str, list[Any]] | None = None,
) -> tuple[str, list[Any]]:
    """The ``INSERT ... SELECT`` of `archive_copies`: rows ``ids`` of ``source`` (that match ``guard``)."""
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
        f"FROM {qn(source)} WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))})"
    )
    params = [*error_params, *now_params, outcome, *([worker] if worker else []), *result_params, *ids]
    if guard is not None:
        sql += f" AND {guard[0]}"
        params += guard[1]
    return sql, params


def ack_in_one_statement(using: str) -> bool:
    """Whether `ack_leased` acknowledges a batch in one statement here (PostgreSQL)."""
    return writable_ctes(using)


def _lease_match(using: str, leases: Mapping[str, list[int]]) -> tuple[str, list[Any]]:
    """The lease guard (``lease_held``) of several tokens' messages, as SQL and parameters."""
    qn = connections[using].ops.quote_name
    now, _ = compile_now(using)
    match, params = [], []
    for token, ids in leases.items():
        match.append(f"({qn('id')} IN ({', '.join(['%s'] * len(ids))}) AND {qn('lease_token')} = %s)")
        params += [*ids, token]
    return f"({' OR '.join(match)}) AND {qn('available_at')} > {now}", params


def lock_leased(using: str, leases: Mapping[str, list[int]]) -> set[int]:
    """Lock the messages whose lease holds (``SELECT ... FOR UPDATE``, inside the caller's transaction); their ids."""
    connection = connections[using]
    qn = connection.ops.quote_name
    where, params = _lease_match(using, leases)
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {qn('id')} FROM {qn(MESSAGE_TABLE)} WHERE {where}{lock}", params)
        return {row[0] for row in cursor.fetchall()}


def ack_unlocked(
    using: str,
    leases: Mapping[str, list[int]],
    archived: list[int],
    worker: str,
    results: Mapping[int, Any],
    errors: Mapping[int, str],
    moved: type[Exception],
) -> cursors.Later[None]:
    """Archive ``archived`` and delete every message of ``leases`` by the lease guard, with no lock taken first.

    For MySQL, MariaDB and SQLite, inside the caller's transaction: the
    ``INSERT ... SELECT`` and then the ``DELETE``, both guarded, one round
    trip fewer than locking the rows first (`lock_leased`). Under READ
    COMMITTED the copy's read locks nothing, so a lease may be lost between
    the two statements; but a lease that did not hold for the copy cannot
    hold for the delete, so the rows deleted are a subset of those copied,
    and equal counts mean equal sets. Both are held back (`cursors.later`):
    the answer raises ``moved`` unless every lease held, and the caller
    then rolls back and takes the locking path, which tells which ones did.
    """
    qn = connections[using].ops.quote_name
    guard = _lease_match(using, leases)
    if archived:
        sql, params = _archive_copy_sql(using, archived, "acked", worker, results, errors, MESSAGE_TABLE, guard)
        cursors.later(using, sql, params, _counted(len(archived), moved))
    expected = sum(len(ids) for ids in leases.values())
    delete = f"DELETE FROM {qn(MESSAGE_TABLE)} WHERE {guard[0]}"
    return cursors.later(using, delete, guard[1], _counted(expected, moved))


def _counted(expected: int, moved: type[Exception]) -> Callable[[Any], None]:
    """A statement's answer that raises ``moved`` unless it changed ``expected`` rows."""

    def check(cursor: Any) -> None:
        if cursor.rowcount != expected:
            raise moved(f"{cursor.rowcount} rows changed of {expected}")

    return check


def delete_locked(using: str, ids: set[int]) -> None:
    """Delete the messages ``ids``, locked by `lock_leased` in the caller's transaction.

    Written by hand: the ORM's DELETE compiled its filter anew for every batch.
    """
    qn = connections[using].ops.quote_name
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {qn(MESSAGE_TABLE)} WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))})", list(ids)
        )


def ack_leased(
    using: str,
    leases: Mapping[str, list[int]],
    archived: list[int],
    worker: str,
    results: Mapping[int, Any],
    errors: Mapping[int, str],
    read: Callable[[Any], set[int]] | None = None,
) -> cursors.Later[set[int]]:
    """PostgreSQL: delete the messages whose lease holds and archive those of ``archived``, in one statement.

    ``leases`` maps each lease token to its message ids. The ``DELETE ...
    RETURNING`` feeds the archive's ``INSERT`` in a ``WITH``: the copy is of
    exactly the rows deleted, with no lock taken first and nothing able to
    slip in between. Answers the ids whose lease held (``read`` makes the
    answer of the cursor: it may refuse it); held back (`cursors.later`)
    inside a `cursors.grouping` block.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    where, params = _lease_match(using, leases)
    gone = f"DELETE FROM {qn(MESSAGE_TABLE)} WHERE {where} RETURNING {qn(MESSAGE_TABLE)}.*"
    sql = f"WITH gone AS ({gone}) "
    if archived:
        copy_sql, copy_params = _archive_copy_sql(using, archived, "acked", worker, results, errors, "gone")
        sql += f", copied AS ({copy_sql}) "
        params += copy_params
    return cursors.later(using, sql + f"SELECT {qn('id')} FROM gone", params, read or _ids)


def _ids(cursor: Any) -> set[int]:
    return {row[0] for row in cursor.fetchall()}


# Columns a producer's INSERT fills; the rest take their database defaults.
INSERTED = (
    *ENQUEUED,
    "available_at",
    "first_available_at",
    "created_at",
    "expires_at",
    "max_attempts",
    "replay_of",
)


def inserted_values(m: LiveMessage, adapt: Callable[[Any], Any]) -> list[Any]:
    """One message's parameters for the columns of `INSERTED`, in order (``adapt``: for the times)."""
    return [
        m.queue,
        m.kind,
        m.key,
        m.group,
        m.payload_json(),
        headers_json(m),
        m.priority,
        adapt(m.available_at),
        adapt(m.first_available_at),
        adapt(m.created_at),
        adapt(m.expires_at),
        m.max_attempts,
        m.replay_of,
    ]


CLOCKED = ("available_at", "first_available_at", "created_at")
PAYLOAD = INSERTED.index("payload")
HEADERS = INSERTED.index("headers")
AVAILABLE_AT = INSERTED.index("available_at")
CREATED_AT = INSERTED.index("created_at")
COLUMNS = range(len(INSERTED))
assert INSERTED[AVAILABLE_AT : CREATED_AT + 1] == CLOCKED  # insert_message() relies on the order


def insert_message(using: str, message: LiveMessage, delay: float | None) -> None:
    """INSERT one unsaved, validated message, its times by the database's clock; sets its id and times.

    ``delay``: seconds from now until it is due, or None when its
    ``available_at`` is set (``run_at``). Where an INSERT can return what it
    computed (RETURNING), the clock is written into the statement and its
    times are read back with the id; elsewhere (MySQL) the clock is read
    first, never after: a worker may take the message the moment it
    commits. Hand-written because ``Model.save()`` compiled the statement
    anew on every call, about half of a single enqueue's Python time.
    """
    connection = connections[using]
    returning = connection.features.can_return_columns_from_insert
    if not returning:
        now = message.created_at = db_now(using)
        if delay is not None:
            message.available_at = message.first_available_at = now + timedelta(seconds=delay)
    if returning and delay == 0 and is_plain(message):  # most messages: two parameters, not ten
        sql = _statement(using, "insert-plain", 1, _insert_sql)
        message.pk, created_at = cursors.run_on(connection, sql, (message.queue, message.payload_json()), _fetchone)
        message.created_at = message.available_at = message.first_available_at = aware_clock(created_at)
        message._state.adding = False
        message._state.db = using
        return
    values = inserted_values(message, connection.ops.adapt_datetimefield_value)
    if returning:
        timing = "at" if delay is None else "later" if delay else "now"
        sql = _statement(using, f"insert-{timing}", 1, _insert_sql)
        clock = compile_now(using, delay)[1] if delay else []  # the delay's parameter, if any
        params = [
            *values[:AVAILABLE_AT],
            *([values[AVAILABLE_AT], values[AVAILABLE_AT + 1]] if delay is None else clock + clock),
            *values[CREATED_AT + 1 :],
        ]
    else:
        sql, params = _statement(using, "insert-values", 1, _insert_sql), values
    row = cursors.run_on(connection, sql, params, _fetchone if returning else _lastrowid)
    if returning and delay == 0:  # three times from one clock reading, which a statement takes once
        message.pk, created_at = row
        message.created_at = message.available_at = message.first_available_at = aware_clock(created_at)
    elif returning:
        message.pk, *times = row
        for column, value in zip(CLOCKED, times, strict=True):
            setattr(message, column, aware_clock(value))
    else:
        message.pk = row
    message._state.adding = False
    message._state.db = using


# What `insert-plain` writes, as SQL, for the columns a plain message leaves at their defaults.
PLAIN_SQL = {
    "kind": "''",
    "key": "NULL",
    "group_key": "NULL",
    "headers": "'{}'",
    "priority": "0",
    "expires_at": "NULL",
    "max_attempts": "NULL",
    "replay_of": "NULL",
}
_PLAIN = ("", None, None, 0, None, None, None)  # kind, key, group, priority, expires_at, max_attempts, replay_of


def is_plain(m: LiveMessage) -> bool:
    """Whether ``m`` has only a queue and a payload: every column of `PLAIN_SQL` at its default."""
    return not m.headers and (m.kind, m.key, m.group, m.priority, m.expires_at, m.max_attempts, m.replay_of) == _PLAIN


def _fetchone(cursor: Any) -> Any:
    return cursor.fetchone()


def _lastrowid(cursor: Any) -> Any:
    return cursor.lastrowid


def _insert_sql(using: str, name: str, size: int) -> str:
    """The INSERT of `insert_message`: ``insert-values`` (every value a parameter, MySQL) or,
    RETURNING its id and times, ``insert-now``, ``insert-plain`` (insert-now of a message with only a
    queue and a payload), ``insert-later`` (a delay, one parameter per time) and ``insert-at``
    (``available_at`` given), with ``created_at`` from the database's clock."""
    qn = connections[using].ops.quote_name
    json_sql = json_param(using)
    cells = {c: json_sql if c in ("payload", "headers") else "%s" for c in INSERTED}
    if name == "insert-plain":  # insert-now with only the queue and the payload as parameters
        cells.update(PLAIN_SQL)
        name = "insert-now"
    if name != "insert-values":
        cells["created_at"] = compile_now(using)[0]
        if name != "insert-at":
            # Any non-zero delay writes the same SQL, its amount a parameter.
            cells["available_at"] = cells["first_available_at"] = compile_now(
                using, 1.0 if name == "insert-later" else 0
            )[0]
    sql = (
        f"INSERT INTO {qn(MESSAGE_TABLE)} ({', '.join(qn(c) for c in INSERTED)}) "
        f"VALUES ({', '.join(cells[c] for c in INSERTED)})"
    )
    if name != "insert-values":
        # insert-now writes one clock expression three times, which the statement evaluates once: one is enough.
        returned = ("id", "created_at") if name == "insert-now" else ("id", *CLOCKED)
        sql += f" RETURNING {', '.join(qn(c) for c in returned)}"
    return sql


# A row's bytes in a statement besides its payload and headers, at most: its names (queue, kind,
# key, group: 674 characters of up to 4 bytes, escaped) and its numbers and times; and the
# statement's own text. MySQL's escaping at most doubles a value (quotes, backslashes).
ROW_BYTES = 6 * 1024
STATEMENT_BYTES = 4 * 1024
Item = TypeVar("Item")


def statement_chunks(
    using: str, items: Iterable[Item], per_statement: int, json_bytes: Callable[[Item], int]
) -> Iterator[list[Item]]:
    """``items`` in runs of at most ``per_statement`` rows whose statement fits the server's packet.

    ``json_bytes``: an item's payload and headers, as JSON text. Only
    MySQL/MariaDB bound a statement (``max_allowed_packet``): twenty
    payloads near the 1 MB limit are one statement on PostgreSQL, and
    error 1153 on MariaDB if sent as one. Each row is counted at its worst
    (escaping doubles it) plus ``ROW_BYTES``, so a run never passes.
    ``items`` is read as the runs are: a generator's next run is made when
    the caller asks for it.
    """
    limit = statement_bytes(using)
    budget = None if limit is None else limit - STATEMENT_BYTES
    run: list[Item] = []
    used = 0
    for item in items:
        size = 0 if budget is None else 2 * json_bytes(item) + ROW_BYTES
        if run and (len(run) >= per_statement or (budget is not None and used + size > budget)):
            yield run
            run, used = [], 0
        run.append(item)
        used += size
    if run:
        yield run


def row_json_bytes(row: list[Any]) -> int:
    """A row of ``inserted_values``: its payload's and headers' JSON text, in bytes (ASCII: escaped)."""
    return len(row[PAYLOAD]) + len(row[HEADERS])


def insert_messages(using: str, messages: Sequence[LiveMessage], batch_size: int) -> None:
    """Multi-row INSERT of unsaved, validated messages; sets their ids where the database returns them.

    ``bulk_create`` prepares every field of every row through the ORM, which
    made ``enqueue_many`` several times slower than the INSERT itself. The
    values here are already validated, so they only need adapting.
    """
    if messages:
        adapt = _adapter(using)
        rows = [inserted_values(m, adapt) for m in messages]
        _insert_rows(using, rows, COLUMNS, batch_size, lambda start, end: messages[start:end])


def insert_alike(
    using: str,
    first: LiveMessage,
    payloads: Sequence[Any],
    batch_size: int,
    own_headers: Sequence[dict[str, Any]] | None = None,
) -> list[LiveMessage]:
    """Multi-row INSERT of ``first`` (unsaved, validated) and of a copy of it for each of ``payloads``: the messages.

    ``enqueue_many``'s messages differ only in their payloads and, where
    header hooks add to them, their headers (``own_headers``, one per
    payload, checked). Each payload is checked, its row written and its
    copy of ``first`` made (`with_payload`) while the server runs the
    statement before (`cursors.Pipeline`; elsewhere, once it has run): on
    every database the payloads after the first statement's are checked
    after the statement before them was sent, and one that fails raises
    inside the caller's transaction, which then commits nothing. Nothing
    here runs code of the caller's while a statement is in flight.
    """
    template = inserted_values(first, _adapter(using))
    blank = first.with_payload(first.payload, first.headers, template[PAYLOAD])  # made once, copied for each
    texts: list[str] = []

    def rows() -> Iterator[list[Any]]:
        yield template
        for i, payload in enumerate(payloads):
            row = template.copy()
            row[PAYLOAD] = text = validation.payload_json(payload)
            texts.append(text)
            if own_headers is not None:
                row[HEADERS] = headers_text(own_headers[i])
            yield row

    messages = [first]

    def made(start: int, end: int) -> list[LiveMessage]:
        for i in range(max(start, 1) - 1, end - 1):  # row 0 is ``first``
            own = own_headers[i] if own_headers is not None else dict(first.headers)
            messages.append(blank.with_payload(payloads[i], own, texts[i]))
        return messages[start:end]

    _insert_rows(using, rows(), (PAYLOAD, HEADERS), batch_size, made)
    return messages


def _adapter(using: str) -> Callable[[Any], Any]:
    """``adapt_datetimefield_value`` of ``using``, each value adapted once (a call's messages share their times)."""
    adapt = connections[using].ops.adapt_datetimefield_value
    adapted: dict[Any, Any] = {}

    def adapter(value: Any) -> Any:
        if value not in adapted:
            adapted[value] = adapt(value)
        return adapted[value]

    return adapter


def _insert_rows(
    using: str,
    rows: Iterable[list[Any]],
    varying: Sequence[int],
    batch_size: int,
    made: Callable[[int, int], Sequence[LiveMessage]],
) -> None:
    """Multi-row INSERTs of ``rows`` (`inserted_values`), in statements that fit; ids set where returned.

    ``varying``: the columns whose values may differ from row to row (the
    others are the first row's). ``made(start, end)``: the messages of rows
    ``start`` to ``end``, asked for once their statement is sent, so that
    their making overlaps the server's work on it where the driver allows.
    A column every row of a statement shares (the queue, the times) is sent
    once, not once per row.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    json_sql = json_param(using)
    cells = [json_sql if c in ("payload", "headers") else "%s" for c in INSERTED]
    quote = quoter(using)
    shares = quote is not None or inserts_arrays(using)  # SQLite binds every value of every row
    returning = f" RETURNING {qn('id')}" if insert_returns_ids(using) else ""
    per_statement = batch_size
    if connection.features.max_query_params:
        per_statement = max(1, min(batch_size, connection.features.max_query_params // len(INSERTED)))
    head = f"INSERT INTO {qn(MESSAGE_TABLE)} ({', '.join(qn(c) for c in INSERTED)}) "
    model = message_model()
    types = [str(model._meta.get_field(attribute(c)).db_type(connection)) for c in INSERTED]
    pk_name = model._meta.pk.attname
    done = 0
    sent: Sequence[LiveMessage] = ()

    def saved(chunk: Sequence[LiveMessage], ids: list[Any]) -> None:
        if returning:
            for message, (pk,) in zip(chunk, ids, strict=True):
                message.__dict__[pk_name] = pk  # the field's value, as ``message.pk = pk`` sets it
        for message in chunk:
            message._state.adding = False
            message._state.db = using

    with cursors.Pipeline(using) as pipeline:
        for chunk_rows in statement_chunks(using, rows, per_statement, row_json_bytes):
            first = chunk_rows[0]
            shared = [
                shares and i != PAYLOAD and (i not in varying or all(row[i] == first[i] for row in chunk_rows))
                for i in COLUMNS
            ]
            kept = [i for i in COLUMNS if not shared[i]]
            arrays = array_columns(using, types, shared)
            if arrays:
                # One value per shared column and one array per other column, whatever the rows: the
                # driver prepares them in no time (with one placeholder per value, that was half the cost).
                sql = head + arrays
                params = [first[i] for i in COLUMNS if shared[i]] + [[row[i] for row in chunk_rows] for i in kept]
            else:
                # A shared column's value is quoted once, into the statement's text (MySQLdb quotes it so).
                row_sql = ", ".join(quote(first[i]) if shared[i] and quote else cells[i] for i in COLUMNS)
                sql = head + "VALUES " + ", ".join([f"({row_sql})"] * len(chunk_rows))
                params = [row[i] for row in chunk_rows for i in kept]
            if sent:
                saved(sent, pipeline.take())
            pipeline.send(sql + returning, params)
            sent = made(done, done + len(chunk_rows))
            done += len(chunk_rows)
        if sent:
            saved(sent, pipeline.take())


def headers_json(message: LiveMessage) -> str:
    """A message's headers as the JSON text an INSERT stores."""
    return headers_text(message.headers)


def headers_text(headers: dict[str, Any]) -> str:
    """Headers (checked) as the JSON text an INSERT stores."""
    return json.dumps(headers) if headers else "{}"


def distinct_leading(using: str, table: str, column: str, limit: int | None = None) -> list[str]:
    """The distinct values of ``column`` (the first ``limit``, in order), the first column of an index of ``table``,
    by a skip scan.

    One index lookup per distinct value (a recursive query of MIN(column)
    > the previous value), where ``SELECT DISTINCT`` would read every row
    on PostgreSQL. Recursive CTEs run on every supported database.
    """
    qn = connections[using].ops.quote_name
    t, c = qn(table), qn(column)
    more = "" if limit is None else f" AND found.n < {int(limit)}"
    sql = (
        f"WITH RECURSIVE found (v, n) AS (SELECT MIN({c}), 1 FROM {t} "
        f"UNION ALL SELECT (SELECT MIN({c}) FROM {t} WHERE {c} > found.v), found.n + 1 FROM found "
        f"WHERE found.v IS NOT NULL{more}) "
        "SELECT v FROM found WHERE v IS NOT NULL"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


# --- the worker's hot path: claim and finish in hand-written SQL ------------------------
#
# The ORM compiled the same claim and acknowledgement for every message and
# built instances through its full machinery: in a profile of one worker that
# was most of the Python time per message. These statements are fixed per
# database and per batch size; rows become messages through the same
# converters the ORM applies.


def _message_reader(using: str) -> tuple[str, Any]:
    """The live table's columns as a SELECT list, and a function turning one row of them into a Message."""
    model = message_model()
    return row_reader(using, model, model.from_row)


M = TypeVar("M")


def without_init(cls: type[M], fields: Iterable[tuple[str, Any]], db: str | None = None) -> M:
    """An instance of model ``cls`` holding ``fields``, made without Model.__init__: loaded from ``db``, or
    new when None.

    Model.__init__ was a sixth of a single enqueue's Python time and more
    than half of turning a claimed row into a message (4.4 µs a row against
    1.9); a workflow step's row read by the join, 9.5 µs against 3.6 (the
    root of a 10,000-step fan-out reads 9,998). Django's
    ``pre_init``/``post_init`` are not sent (docs/signals.md).
    """
    instance = cls.__new__(cls)
    instance.__dict__.update(fields)
    state = instance._state = ModelState()  # type: ignore[attr-defined]
    if db is not None:
        state.adding = False
        state.db = db
    return instance


def loaded(cls: type[M]) -> Callable[[str, list[str], list[Any]], M]:
    """`row_reader`'s ``make`` for model ``cls``: `without_init`, loaded from the database read."""

    def make(using: str, names: list[str], values: list[Any]) -> M:
        return without_init(cls, zip(names, values, strict=True), using)

    return make


def row_reader(using: str, model: Any, make: Callable[[str, list[str], list[Any]], Any]) -> tuple[str, Any]:
    """``model``'s columns as a SELECT list, and a function turning one row of them into an instance:
    ``make(using, attribute names, values)`` after the converters the ORM applies. Written once per alias and model."""
    connection = connections[using]
    key = (connection.alias, model._meta.label)
    cached = _READERS.get(key)
    if cached is not None:
        return cached
    qn = connection.ops.quote_name
    table = model._meta.db_table
    fields = model._meta.concrete_fields
    names = [f.attname for f in fields]
    columns = [f.get_col(table) for f in fields]
    converters = [
        (i, [*connection.ops.get_db_converters(col), *col.get_db_converters(connection)], col)
        for i, col in enumerate(columns)
    ]
    converters = [(i, funcs, col) for i, funcs, col in converters if funcs]

    def build(row: Any) -> Any:
        values = list(row[: len(names)])
        for i, funcs, col in converters:
            for convert in funcs:
                values[i] = convert(values[i], col, connection)
        return make(using, names, values)

    reader = (", ".join(f"{qn(table)}.{qn(str(f.column))}" for f in fields), build)
    _READERS[key] = reader
    return reader


_READERS: dict[tuple[str, str], tuple[str, Any]] = {}


def _claimable_where(using: str) -> str:
    """The claim's WHERE (``MessageQuerySet.claimable`` written out): params queue, then max_attempts."""
    qn = connections[using].ops.quote_name
    now, _ = compile_now(using)
    t = qn(MESSAGE_TABLE)
    return (
        f"{t}.{qn('queue')} = %s AND {t}.{qn('available_at')} <= {now} "
        f"AND ({t}.{qn('expires_at')} IS NULL OR {t}.{qn('expires_at')} > {now}) "
        f"AND NOT ({t}.{qn('lease_token')} IS NOT NULL "
        f"AND {t}.{qn('attempts')} >= COALESCE({t}.{qn('max_attempts')}, %s))"
    )


_STATEMENTS: dict[tuple[str, str, int], str] = {}


def _statement(using: str, name: str, size: int, make: Any) -> str:
    """The hot path's SQL ``name`` for ``size`` rows, written once per database alias: ``make(using, name, size)``."""
    key = (using, name, size)  # an alias names one connection's settings: no lookup of the connection
    sql = _STATEMENTS.get(key)
    if sql is None:
        sql = _STATEMENTS[key] = make(using, name, size)
    return sql


def _claim_sql(using: str, name: str, limit: int) -> str:
    """PostgreSQL: the whole claim, parameters queue, max_attempts, token, seconds, worker; elsewhere its SELECT."""
    connection = connections[using]
    qn = connection.ops.quote_name
    columns, _ = _message_reader(using)
    t = qn(MESSAGE_TABLE)
    order = f"{qn('priority')}, {qn('available_at')}, {qn('id')}"
    where = _claimable_where(using)
    if writable_ctes(using):
        return (
            f"WITH picked AS MATERIALIZED (SELECT {qn('id')}, {qn('available_at')} AS was_available FROM {t} "
            f"WHERE {where} ORDER BY {order} LIMIT {int(limit)} FOR UPDATE SKIP LOCKED) "
            f"UPDATE {t} SET {qn('lease_token')} = %s, "
            f"{qn('available_at')} = {now_plus_seconds(using)}, "
            f"{qn('claimed_at')} = {compile_now(using)[0]}, {qn('claimed_by')} = %s, "
            f"{qn('attempts')} = {t}.{qn('attempts')} + 1 "
            f"FROM picked WHERE {t}.{qn('id')} = picked.{qn('id')} "
            f"RETURNING {columns}, picked.was_available"
        )
    now, now_params = compile_now(using)
    if now_params:
        raise ValueError("the clock's SQL takes no parameters")
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    return f"SELECT {columns}, {now} FROM {t} WHERE {where} ORDER BY {order} LIMIT {int(limit)}{lock}"


def _lease_sql(using: str, name: str, count: int) -> str:
    """The claim's UPDATE of ``count`` rows (not PostgreSQL): token, available_at, claimed_at, worker, ids."""
    qn = connections[using].ops.quote_name
    return (
        f"UPDATE {qn(MESSAGE_TABLE)} SET {qn('lease_token')} = %s, {qn('available_at')} = %s, "
        f"{qn('claimed_at')} = %s, {qn('claimed_by')} = %s, {qn('attempts')} = {qn('attempts')} + 1 "
        f"WHERE {qn('id')} IN ({', '.join(['%s'] * count)})"
    )


def claim_is_one_statement(using: str) -> bool:
    """Whether `claim_rows` is a single statement here, atomic without a transaction around it."""
    return writable_ctes(using)


def claim_rows(
    using: str, queue: str, limit: int, max_attempts: int, seconds: float, token: str, worker: str
) -> list[LiveMessage]:
    """Lease up to ``limit`` claimable messages of ``queue`` for ``seconds``; returns them in claim order.

    PostgreSQL: one statement (``UPDATE ... FROM`` a ``SELECT ... FOR UPDATE
    SKIP LOCKED`` in a ``WITH``), atomic without a transaction of its own.
    Elsewhere: the SELECT and the UPDATE, and the caller runs them in one
    transaction (`short_transaction`).
    """
    connection = connections[using]
    _, build = _message_reader(using)
    if writable_ctes(using):
        sql = _statement(using, "claim", limit, _claim_sql)
        rows = cursors.run_on(connection, sql, [queue, max_attempts, token, seconds, worker], _all_rows)
        # RETURNING keeps no order: back to the claim's (priority, availability before the claim, id).
        pairs = [(build(row), row[-1]) for row in rows]
        pairs.sort(key=lambda pair: (pair[0].priority, pair[1], pair[0].pk))
        return [message for message, _ in pairs]
    rows = cursors.run_on(connection, _statement(using, "claim", limit, _claim_sql), [queue, max_attempts], _all_rows)
    return lease_rows(using, rows, seconds, token, worker)


def _all_rows(cursor: Any) -> list[Any]:
    return list(cursor.fetchall())


def lease_rows(using: str, rows: list[Any], seconds: float, token: str, worker: str) -> list[LiveMessage]:
    """Lease rows a claim's SELECT locked (its columns, then the clock it read): one UPDATE; their messages.

    The claim's clock is the lease's start (``claimed_at``) and, plus
    ``seconds``, its end. Runs inside the caller's transaction.
    """
    if not rows:
        return []
    connection = connections[using]
    _, build = _message_reader(using)
    adapt = connection.ops.adapt_datetimefield_value
    clock = aware_clock(rows[0][-1])
    until = clock + timedelta(seconds=seconds)
    ids = [row[0] for row in rows]
    # Nothing to read: it goes out with the COMMIT where the transaction is `short_transaction`'s.
    sql = _statement(using, "lease", len(ids), _lease_sql)
    cursors.later(using, sql, [token, adapt(until), adapt(clock), worker, *ids])
    messages = [build(row) for row in rows]
    for message in messages:
        message.lease_token = token
        message.available_at = until
        message.claimed_at = clock
        message.claimed_by = worker
        message.attempts += 1
    return messages


# The archive row of finish_leased(): the live row's copied columns, then what finishing adds.
ARCHIVED = ("message_id", *COPIED, "outcome", "finished_by", "result")
JSON_COLUMNS = ("payload", "headers", "result", "progress", "meta")


def finish_is_one_statement(using: str) -> bool:
    """Whether `finish_leased` is a single statement here, atomic without a transaction around it."""
    return writable_ctes(using)


def finish_leased(using: str, message: LiveMessage, outcome: str, row: Mapping[str, Any] | None) -> bool:
    """Delete ``message`` while its holder's lease holds and, with ``row``, archive it; whether the lease held.

    ``row`` holds the archive row's values that do not come from the
    message (``outcome``, ``finished_by``, ``last_error``, ``result``, already
    storable); the rest come from ``message``, as
    `ArchivedMessage.from_live` takes them. PostgreSQL: one statement,
    the archive ``INSERT`` fed by a ``DELETE ... RETURNING`` in a ``WITH``.
    Elsewhere: the ``DELETE``, then the ``INSERT`` if it deleted a row; the
    caller runs them in one transaction.
    """
    connection = connections[using]
    guard_params = [message.pk, message.lease_token]
    if row is None:
        with connection.cursor() as cursor:
            cursor.execute(_statement(using, "delete-leased", 1, _finish_sql), guard_params)
            return bool(cursor.rowcount == 1)
    adapt = connection.ops.adapt_datetimefield_value
    result = row["result"]
    values: dict[str, Any] = {column: getattr(message, attribute(column)) for column in COPIED}
    for column in ("created_at", "first_available_at", "claimed_at", "expires_at"):
        values[column] = adapt(values[column])
    values.update(
        message_id=message.pk,
        payload=json.dumps(message.payload),
        headers=json.dumps(message.headers),
        outcome=outcome,
        finished_by=row["finished_by"],
        last_error=row["last_error"],
        result=None if result is None else json.dumps(result),
        progress=None if message.progress is None else json.dumps(message.progress),
        meta=None if message.meta is None else json.dumps(message.meta),
    )
    params = [values[c] for c in ARCHIVED]
    with connection.cursor() as cursor:
        if writable_ctes(using):
            cursor.execute(_statement(using, "finish", 1, _finish_sql), [*guard_params, *params])
            return bool(cursor.rowcount == 1)
        cursor.execute(_statement(using, "delete-leased", 1, _finish_sql), guard_params)
        if cursor.rowcount != 1:
            return False
        cursor.execute(_statement(using, "archive", 1, _finish_sql), params)
        return True


def _finish_sql(using: str, name: str, size: int) -> str:
    """The statements of `finish_leased`: ``delete-leased``, ``archive`` (values), ``finish`` (PostgreSQL)."""
    connection = connections[using]
    qn = connection.ops.quote_name
    now, _ = compile_now(using)
    guard = f"{qn('id')} = %s AND {qn('lease_token')} = %s AND {qn('available_at')} > {now}"
    delete = f"DELETE FROM {qn(MESSAGE_TABLE)} WHERE {guard}"
    json_sql = json_param(using)
    placeholders = ", ".join(json_sql if c in JSON_COLUMNS else "%s" for c in ARCHIVED)
    names = ", ".join(qn(c) for c in ARCHIVED)
    insert = f"INSERT INTO {qn(ARCHIVE_TABLE)} ({names}, {qn('finished_at')}, {qn('replayed_by')}) "
    return {
        "delete-leased": lambda: delete,
        "archive": lambda: f"{insert}VALUES ({placeholders}, {now}, '')",
        "finish": lambda: (
            f"WITH gone AS ({delete} RETURNING {qn('id')}) {insert}SELECT {placeholders}, {now}, '' FROM gone"
        ),
    }[name]()
