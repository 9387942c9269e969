"""The join's statements, written by hand: every step's acknowledgement runs them.

A chain step's ack ran seven ORM statements after the archive's, and
compiling them (filters, lookups, the compiler) cost more than the server
took to run them: about half of the ack, in a profile of one worker
draining a chain. These are the common ones, one per call and fixed per
database; the rare paths (a failed dependency, a step whose rows are gone,
a workflow's last step) stay in the ORM in `workflows`, whose models' Meta
use the tables' names below.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.apps import apps
from django.db import connections

from ..db import cursors
from ..db.clock import compile_now
from ..db.sql import for_update_of, json_param, locks_in_sort_order
from .statements import loaded, row_reader

WORKFLOW_TABLE = "dbqueue_workflow"
STEP_TABLE = "dbqueue_workflow_step"
EDGE_TABLE = "dbqueue_workflow_edge"


def _marks(values: Sequence[Any]) -> str:
    return ", ".join(["%s"] * len(values))


def _rowcount(cursor: Any) -> int:
    return int(cursor.rowcount)


def _rows(cursor: Any) -> list[Any]:
    return list(cursor.fetchall())


def finish_steps(
    using: str,
    state: str,
    workflow_id: int,
    steps: Sequence[tuple[str, int]],
    outcome: str,
    reason: str,
    result: Any = None,
    note: str = "",
) -> cursors.Later[int]:
    """Set workflow ``workflow_id``'s ``steps`` (name, message id) that are in ``state`` as those messages to
    ``outcome``, with ``reason``, ``result`` (kept: a JSON value, or None for SQL NULL) and its ``note``;
    answers the rows changed (held back in a `cursors.grouping` block). A step in another state is left.

    Found by the (state, message id) index: a planner left to choose may intersect the workflow's steps
    with every enqueued one. Each row must then be the step its message names: a step whose waiting
    message another step's debounce took over holds the same id, and did not run (the reaper's sweep
    cancels it). That test is a ``CASE`` of the row's message id, which no index serves, so it cannot draw
    the planner away from the message ids.
    """
    qn = connections[using].ops.quote_name
    now, _ = compile_now(using)
    value = "NULL" if result is None else json_param(using)
    params: list[Any] = [outcome] + ([] if result is None else [json.dumps(result)])
    ids = [int(message_id) for _, message_id in steps]  # integers in the text (`note_enqueued`); names are parameters
    workflows = " ".join(f"WHEN {message_id} THEN {int(workflow_id)}" for message_id in ids)
    names = " ".join(f"WHEN {message_id} THEN %s" for message_id in ids)
    return cursors.later(
        using,
        f"UPDATE {qn(STEP_TABLE)} SET {qn('state')} = %s, {qn('result')} = {value}, {qn('result_note')} = %s, "
        f"{qn('reason')} = %s, {qn('finished_at')} = {now} "
        f"WHERE {qn('state')} = %s AND {qn('message_id')} IN ({', '.join(map(str, ids))}) "
        f"AND {qn('workflow_id')} = CASE {qn('message_id')} {workflows} END "
        f"AND {qn('name')} = CASE {qn('message_id')} {names} END",
        [*params, note, reason, state, *(name for name, _ in steps)],
        _rowcount,
    )


def lock_children(using: str, workflow_id: int, parents: Sequence[str]) -> cursors.Later[list[tuple[str, str, Any]]]:
    """(parent, ignore, child step) of every edge out of ``parents``, the child steps locked (``FOR UPDATE``
    where the database has it), as `WorkflowStep` instances: one statement, by the edges' (workflow,
    parent) index and the steps' (workflow, name) unique index.

    PostgreSQL locks the steps alone (``OF``), in position order (its
    locks follow the sort). MySQL and MariaDB lock as they read, the edge
    rows too (nothing updates an edge): a parent's children in its edges'
    order, so two batches of parents that share children in another order
    may deadlock, and the acknowledgement's transaction is retried. The
    rows are put in position order here, after the statement: on MySQL
    and MariaDB a sort in the statement orders no lock, and it went through
    a temporary table on disk for the steps' JSON columns, most of the
    statement's time (about 0.25 ms of a chain step's 2.6 on MariaDB). A
    child with several of ``parents`` comes once per edge. Held back in a
    `cursors.grouping` block, to go out with the parents' own statements.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    model = apps.get_model("django_dbqueue", "WorkflowStep")
    columns, build = row_reader(using, model, loaded(model))
    step, edge = qn(STEP_TABLE), qn(EDGE_TABLE)
    lock = for_update_of(using, STEP_TABLE)

    def read(cursor: Any) -> list[tuple[str, str, Any]]:
        found = [(row[-2], row[-1], build(row)) for row in cursor.fetchall()]
        found.sort(key=lambda edge_row: edge_row[2].position)  # stable: the statement's order where it sorted
        return found

    return cursors.later(
        using,
        f"SELECT {columns}, {edge}.{qn('parent')}, {edge}.{qn('ignore')} FROM {edge} INNER JOIN {step} "
        f"ON {step}.{qn('workflow_id')} = {edge}.{qn('workflow_id')} AND {step}.{qn('name')} = {edge}.{qn('child')} "
        f"WHERE {edge}.{qn('workflow_id')} = %s AND {edge}.{qn('parent')} IN ({_marks(parents)})"
        + (f" ORDER BY {step}.{qn('position')}" if locks_in_sort_order(using) else "")
        + lock,
        [workflow_id, *parents],
        read,
    )


def take_pending(using: str, step_ids: Sequence[int], settled: int) -> None:
    """Take ``settled`` dependencies off the pending count of the (locked) steps ``step_ids`` (held back in a
    `cursors.grouping` block: nothing is read)."""
    qn = connections[using].ops.quote_name
    cursors.later(
        using,
        f"UPDATE {qn(STEP_TABLE)} SET {qn('pending')} = {qn('pending')} - %s WHERE {qn('id')} IN ({_marks(step_ids)})",
        [settled, *step_ids],
    )


def count_closed(using: str, workflow_id: int, closed: int, failed: int) -> bool:
    """Count ``closed`` steps as settled (``failed`` of them not acked) if that leaves one open; whether it did."""
    qn = connections[using].ops.quote_name
    changed = cursors.run(
        using,
        f"UPDATE {qn(WORKFLOW_TABLE)} SET {qn('open_steps')} = {qn('open_steps')} - %s, "
        f"{qn('failed_steps')} = {qn('failed_steps')} + %s WHERE {qn('id')} = %s AND {qn('open_steps')} > %s",
        [closed, failed, workflow_id, closed],
        _rowcount,
    )
    return changed > 0


def note_enqueued(using: str, state: str, pairs: Sequence[tuple[int, int]]) -> None:
    """Set steps to ``state`` as their messages: (step id, message id) pairs, a CASE per chunk of rows.

    ``bulk_update`` builds an expression per row and field: for the 10,000
    children of a fan-out that was a minute of Python in the parent's ack.
    The ids are written into the text as integers (``int()`` refuses
    anything else): thousands of parameters cost the driver more than the
    statement costs the server. Held back in a `cursors.grouping` block:
    nothing is read.
    """
    qn = connections[using].ops.quote_name
    for start in range(0, len(pairs), 1000):
        chunk = [(int(step), int(message)) for step, message in pairs[start : start + 1000]]
        cases = " ".join(f"WHEN {step} THEN {message}" for step, message in chunk)
        cursors.later(
            using,
            f"UPDATE {qn(STEP_TABLE)} SET {qn('state')} = %s, {qn('pending')} = 0, "
            f"{qn('message_id')} = CASE {qn('id')} {cases} END "
            f"WHERE {qn('id')} IN ({', '.join(str(step) for step, _ in chunk)})",
            [state],
        )


def present_steps(using: str, refs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Which of the (workflow id, step name) pairs ``refs`` have their step row, in one statement by the steps'
    unique (workflow, name) index: a condition per workflow, its names in a list."""
    if not refs:
        return set()
    qn = connections[using].ops.quote_name
    names: dict[int, list[str]] = {}
    for workflow_id, name in sorted(refs):
        names.setdefault(workflow_id, []).append(name)
    where = " OR ".join(f"({qn('workflow_id')} = %s AND {qn('name')} IN ({_marks(n)}))" for n in names.values())
    rows = cursors.run(
        using,
        f"SELECT {qn('workflow_id')}, {qn('name')} FROM {qn(STEP_TABLE)} WHERE {where}",
        [value for workflow_id, n in names.items() for value in (workflow_id, *n)],
        _rows,
    )
    return {(workflow_id, name) for workflow_id, name in rows} & refs
