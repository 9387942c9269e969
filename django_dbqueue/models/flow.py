"""Flow control per key (docs/flow-control.md): group concurrency, FIFO groups, rate limits, unique windows.

Every rule is decided by the database, never by a read followed by a
write that another process could slip between:

- a group's concurrency limit: a claim locks the group's row in
  `FlowGroup` (``SKIP LOCKED``), then counts the group's messages
  in flight with a fresh read; two claims of one group cannot both count;
- a FIFO group: only a group's oldest live message is claimable, and the
  claim locks that row itself; producers of one group take turns on the
  group's row, so its ids are handed out in commit order;
- a rate limit: each allowed claim takes one of ``count`` rows of
  `RateSlot` that was last used a period ago or more, and stamps it
  with the claim's time; so no period holds more claims than there are slots;
- a unique window: `UniqueWindow` has one row per key, inserted if
  absent or taken over by a locked update once its window has passed.

The state of a group (how many run) is never stored: it is counted from
the leases, so a lease that runs out or a dead worker gives the slot back
with nothing to repair.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connections, models

from .. import validation
from ..conf import QueueOptions, RateLimit, queue_options
from ..db.capabilities import (
    locking_reads_see_newer_rows,
    locks_outer_joined_rows,
    loose_index_scans,
    writes_one_at_a_time,
)
from ..db.clock import DbNow, aware_clock, compile_now
from ..db.sql import ASIDE_INDEX, first_of_group, insert_ignoring, rows_among, skip_locked, use_index
from ..db.transactions import write_transaction
from ..exceptions import InvalidOption
from .fields import NameField
from .protocols import LiveMessage
from .statements import MESSAGE_TABLE, _claimable_where, _message_reader, _statement, lease_rows, message_model

UNTIL_FINISHED = "until-finished"
# How many candidates a controlled claim reads for ``limit`` messages: the
# SELECT already leaves out full groups, but several rows of one group (or of a
# group another claim holds) may come up, so it looks a little further than a plain claim.
EXTRA_CANDIDATES = 10
MAX_CANDIDATES = 1000
# The claim's window: how many claimable rows, in claim order, one round of a controlled claim examines.
# A window holding fewer candidates than wanted has its held-back rows set aside, and the next round reads
# the rows past them; a claim does at most ROUNDS rounds (docs/flow-control.md, "Held-back messages").
# The first round's window is a few times the candidates wanted (almost always enough), the others SCAN.
FIRST_SCAN = 4
MIN_SCAN = 20
SCAN = 1000
ROUNDS = 10
# A set-aside row's priority, the column's largest, which no producer may give: past every claimable row.
SET_ASIDE = validation.SET_ASIDE_PRIORITY
# Per claim: how many set-aside groups it looks at to bring messages back, and how many messages of each.
BRING_BACK_GROUPS = 50
MAX_BACK_PER_GROUP = 10
# Once a process has found no set-aside message in a queue, its claims skip the look for this long, unless
# they set rows aside themselves: the look was a third of a claim's time on PostgreSQL (`bring_back`).
QUIET_ASIDE_SECONDS = 1.0
# The live table's indexes the plan's statements name (MySQL/MariaDB hints).
LEASE_INDEX = "dbqueue_msg_lease"  # (lease_token, available_at): the messages in flight, whatever their queue
CLAIM_INDEX = "dbqueue_msg_claim"  # (queue, priority, available_at, id): the claim order
GROUP_INDEX = "dbqueue_msg_group"  # (queue, group_key, id): a group's messages in order
# Rate slots unused for this long are free anyway (the longest period is an hour): the reaper deletes them.
RATE_SLOT_IDLE = timedelta(hours=2)


class FlowGroup(models.Model):
    """A group that a claim has seen: the row a claim locks while it counts the group's messages in flight."""

    queue = NameField(max_length=64)
    name = NameField(max_length=255)

    class Meta:
        app_label = "django_dbqueue"
        db_table = "dbqueue_group"
        constraints = [models.UniqueConstraint(fields=["queue", "name"], name="dbqueue_group_queue_name")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.name}"


class RateSlot(models.Model):
    """One of a rate limit's ``count`` slots: free again one period after ``used_at``, the claim that took it."""

    queue = NameField(max_length=64)
    group = NameField(max_length=255, blank=True, default="", db_column="group_key", help_text="'': the queue.")
    slot = models.PositiveIntegerField()
    used_at = models.DateTimeField()

    class Meta:
        app_label = "django_dbqueue"
        db_table = "dbqueue_rate_slot"
        indexes = [models.Index(fields=["queue", "group", "used_at"], name="dbqueue_rate_used")]
        constraints = [models.UniqueConstraint(fields=["queue", "group", "slot"], name="dbqueue_rate_queue_slot")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.group or '*'}#{self.slot}"


class UniqueWindow(models.Model):
    """A key taken in a queue until ``until``: enqueue(..., unique=timedelta) inserts no second one before."""

    queue = NameField(max_length=64)
    key = NameField(max_length=255)
    until = models.DateTimeField()
    message_id = models.BigIntegerField(null=True, blank=True, help_text="The message that took the key.")

    class Meta:
        app_label = "django_dbqueue"
        db_table = "dbqueue_unique"
        indexes = [models.Index(fields=["until"], name="dbqueue_unique_until")]
        constraints = [models.UniqueConstraint(fields=["queue", "key"], name="dbqueue_unique_queue_key")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.key}"


# --- producing: unique windows and debounce -------------------------------------------


def key_rules(key: str | None, options: dict[str, Any], delay: Any, run_at: Any) -> tuple[float | None, float | None]:
    """Check enqueue's ``unique`` and ``debounce``; returns the unique window and the debounce, in seconds."""
    unique = options.get("unique", UNTIL_FINISHED)
    debounce = options.get("debounce")
    window = None
    if unique != UNTIL_FINISHED:
        if isinstance(unique, str) or unique is None:
            raise InvalidOption(f'unique must be "until-finished" or a timedelta (a window), not {unique!r}')
        window = validation.seconds(unique, "unique", allow_zero=False)
    seconds = None if debounce is None else validation.seconds(debounce, "debounce", allow_zero=False)
    if (window is not None or seconds is not None) and key is None:
        raise InvalidOption("unique windows and debounce work on a key: give key= as well")
    if window is not None and seconds is not None:
        raise InvalidOption("give unique=timedelta or debounce, not both: a debounced key is replaced, not refused")
    if seconds is not None and (delay is not None or run_at is not None):
        raise InvalidOption("debounce sets when the message runs (now plus the debounce): leave out delay and run_at")
    return window, seconds


def take_window(using: str, queue: str, key: str, seconds: float) -> bool:
    """Take ``key`` in ``queue`` for ``seconds`` from now: insert its row if absent, else take it over if passed.

    Returns False when the key's window is still open. Inside the caller's
    transaction: the row is locked until it commits.
    """
    windows = UniqueWindow.objects.using(using)
    try:
        with write_transaction(using):
            windows.create(queue=queue, key=key, until=DbNow(seconds))
        return True
    except IntegrityError:
        # The row exists: a locked update takes it only if its window passed (re-checked after any wait).
        return windows.filter(queue=queue, key=key, until__lte=DbNow()).update(until=DbNow(seconds)) == 1


def note_window_owner(using: str, queue: str, key: str, message_id: int) -> None:
    UniqueWindow.objects.using(using).filter(queue=queue, key=key).update(message_id=message_id)


# --- producing: FIFO groups take turns ---------------------------------------------------


def takes_turns(using: str, queue: str) -> bool:
    """Whether producers of a group of ``queue`` take turns (`take_turns`): ordered queues, not on SQLite."""
    return queue_options(queue).ordered and not writes_one_at_a_time(using)


def take_turns(using: str, queue: str, groups: set[str]) -> None:
    """Hold the rows of ``groups`` of an ordered ``queue`` until the producer's transaction ends.

    A FIFO group's order is its ids'. Two producers whose transactions
    overlap would otherwise get ids in the order they inserted but commit
    in either order; a claim between the two commits would take the later
    id for the group's head, and the earlier would then run beside it once
    committed. Holding the group's row from before the INSERT until the
    commit makes the group's ids come in commit order.

    A plain ``SELECT ... FOR UPDATE`` by the unique key locks a row that
    exists and nothing else; only a group's first producer (or the first
    after the reaper pruned its row) inserts it, and holds the new row.
    An upsert would be one statement, but on InnoDB its duplicate check
    locks the gap before the row too, and made producers of other groups
    wait. The rows are taken in sorted order, so producers of several
    groups at once do not deadlock each other.
    """
    names = sorted(groups)
    for start in range(0, len(names), 500):
        chunk = names[start : start + 500]
        locked = _locked_groups(using, queue, chunk, lock="wait")
        missing = [g for g in chunk if g not in locked]
        if missing:
            _insert_groups(using, queue, missing)
            _locked_groups(using, queue, missing, lock="wait")  # those another producer inserted first


# --- consuming: the controlled claim ------------------------------------------------------


def _plan(using: str, queue: str, options: QueueOptions, *, probe: bool = False) -> tuple[str, list[Any]]:
    """The rules' part of the plan for ``queue``: its name (for `_plan_sql`) and the rules' parameters.

    One filter per rule the queue sets, all of them in each statement, so
    that a row any rule holds back is never a candidate: FIFO heads
    (``ordered``), the kinds with limits of their own (``kinds<N>``), the
    group limit of the other kinds (``limit<N>``, N the kinds it leaves
    to their own limits), a rate per group (``rated``). ``probe``: the
    ``--until-empty`` look, which leaves rates out (a rate holds a
    message back for one period at most) and locks nothing.
    """
    parts: list[str] = []
    params: list[Any] = []
    if options.ordered:
        parts.append("ordered")
        params.append(queue)
    own = sorted(options.kind_group_concurrency)
    if own:
        parts.append(f"kinds{len(own)}")
        params += [*own, queue, *own]
        for kind in own:
            params += [kind, options.kind_group_concurrency[kind]]
    if options.group_concurrency:
        parts.append(f"limit{len(own)}")
        params += [*own, queue, *own, options.group_concurrency]
    rate = options.rate_limit
    if rate is not None and rate.per_group and not probe:
        parts.append("rated")
        params += [queue, *compile_now(using, -rate.seconds)[1], rate.count]
    return "-".join(parts) or "plain", params


def _rules_sql(using: str, rules: str) -> str:
    """The rules' filters (see `_plan`) on a row of the live table, as one condition; parameters: the plan's.

    ``ordered`` keeps a row only if no earlier message of its group exists:
    its id is at most the group's first (a sub-select per row on the group
    index; ``id = MIN(id)`` made PostgreSQL sort every ready row). ``kinds<N>`` and
    ``limit<N>`` leave out the groups (per kind with a limit of its own)
    that have their limit in flight, read off the few messages in flight.
    ``rated`` leaves out the groups (and, as ``''``, the messages of no
    group) whose period already holds ``count`` uses of their slots. What
    decides is the check under the group's lock, and the rate slots' lock,
    that follow; the filters spare the claim the rows it cannot take.
    """
    qn = connections[using].ops.quote_name
    t, g, i, q, k = qn(MESSAGE_TABLE), qn("group_key"), qn("id"), qn("queue"), qn("kind")
    now, _ = compile_now(using)
    # The messages in flight are few: read them through the lease index. Given (queue, group, id),
    # MariaDB read every message of the queue once its statistics lagged behind the backlog.
    running = (
        f"FROM {t} b{use_index(using, LEASE_INDEX)} WHERE b.{q} = %s AND b.{qn('lease_token')} IS NOT NULL "
        f"AND b.{qn('available_at')} > {now} AND b.{g} IS NOT NULL"
    )
    conditions = []
    for part in rules.split("-"):
        if part == "ordered":
            # No earlier message of the group: its first id by the group index, one entry read (with NOT
            # EXISTS, PostgreSQL scanned the table for a big group's elders; given the choice, both databases
            # walked the primary key for a small group's first under one big group: `first_of_group`).
            first = first_of_group(using, MESSAGE_TABLE, GROUP_INDEX, t)
            conditions.append(f"({t}.{g} IS NULL OR {t}.{i} <= COALESCE(({first}), {t}.{i}))")
        elif part.startswith("kinds"):
            kinds = ", ".join(["%s"] * int(part.removeprefix("kinds")))
            limits = " ".join(["WHEN %s THEN %s"] * int(part.removeprefix("kinds")))
            conditions.append(
                f"({t}.{g} IS NULL OR {t}.{k} NOT IN ({kinds}) OR ({t}.{g}, {t}.{k}) NOT IN "
                f"(SELECT b.{g}, b.{k} {running} AND b.{k} IN ({kinds}) "
                f"GROUP BY b.{g}, b.{k} HAVING COUNT(*) >= CASE b.{k} {limits} END))"
            )
        elif part.startswith("limit"):
            # The kinds with limits of their own count apart: here they are neither counted nor left out.
            own = int(part.removeprefix("limit"))
            kinds = ", ".join(["%s"] * own)
            mine, theirs = (f"{t}.{k} IN ({kinds}) OR ", f" AND b.{k} NOT IN ({kinds})") if own else ("", "")
            conditions.append(
                f"({t}.{g} IS NULL OR {mine}{t}.{g} NOT IN (SELECT b.{g} {running}{theirs} "
                f"GROUP BY b.{g} HAVING COUNT(*) >= %s))"
            )
        elif part == "rated":
            s, used = qn(RateSlot._meta.db_table), qn("used_at")
            period_ago, _ = compile_now(using, -1.0)  # the SQL's shape; the period is a parameter
            # A scope with `count` uses in the period has no free slot left: the slots left from a higher
            # limit count too (take_slots), and a scope's slots are made all at once.
            conditions.append(
                f"COALESCE({t}.{g}, '') NOT IN (SELECT r.{g} FROM {s} r WHERE r.{q} = %s "
                f"AND r.{used} > {period_ago} GROUP BY r.{g} HAVING COUNT(*) >= %s)"
            )
    return " AND ".join(conditions) or "1 = 1"


def _plan_sql(using: str, name: str, size: int) -> str:
    """The plan's statements, by ``name`` = ``<what>[@<window>]-<rules>``; ``size``: the LIMIT of what it returns.

    ``claim``: the candidates, locked, in claim order: the rows of the
    claim's window (the first ``window`` claimable rows in claim order, read
    on the claim index, set-aside ones left out) that every rule lets through. The window bounds
    the rows a claim examines whatever the backlog: a held-back row in it
    is set aside (``aside``), so that the next window reaches past it.
    Parameters: queue and max_attempts twice, then the rules'.
    ``claim+groups`` (MySQL/MariaDB): each row's group row comes along,
    locked by the same statement, or NULL (no row yet, or held by another
    claim); this spares the claim a statement.
    ``aside``: the window's rows that a rule holds back and no claim holds,
    locked. Same parameters.
    ``probe``: whether any message passes, locking nothing. Parameters:
    queue and max_attempts, then the rules'.
    ``back<n>``: of ``n`` set-aside groups (parameters: queue, then each name)
    and of the messages of no group (queue), the oldest ``size`` set-aside
    messages each that the rules let through now, locked. Then the rules'.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    what, _, rules = name.partition("-")
    what, _, scan = what.partition("@")
    t, g, i, q = qn(MESSAGE_TABLE), qn("group_key"), qn("id"), qn("queue")
    now, _ = compile_now(using)
    claimable = _claimable_where(using)
    passes = _rules_sql(using, rules)
    p = qn("priority")
    order = f"{t}.{p}, {t}.{qn('available_at')}, {t}.{i}"
    if what == "probe":  # set-aside messages are claimable as they stand, only last
        return f"SELECT 1 FROM {t} WHERE {claimable} AND {passes} LIMIT 1"
    # The few rows chosen first are read from the live table by primary key (`rows_among`).
    lock = skip_locked(using, MESSAGE_TABLE)
    if what.startswith("back"):
        free = f"{t}.{q} = %s"
        # A group's first in its claim order (the set-aside index's order), a FIFO group's first by id, on the
        # group index (its elders are few: the one running, one retrying); ``priority + 0`` keeps PostgreSQL
        # off the partial set-aside index there, which it would read whole to sort by id.
        own = f"{t}.{qn('held_priority')}, {t}.{qn('available_at')}, {t}.{i}"
        aside, by_id = f"{t}.{p} = {SET_ASIDE}", f"{t}.{p} + 0 = {SET_ASIDE}"
        fifo = "ordered" in rules.split("-")
        group = ("= %s", GROUP_INDEX, by_id, f"{t}.{i}") if fifo else ("= %s", ASIDE_INDEX, aside, own)
        scopes = [group] * int(what.removeprefix("back")) + [("IS NULL", ASIDE_INDEX, aside, own)]
        oldest = " UNION ALL ".join(
            f"SELECT b{n}.{i} FROM (SELECT {t}.{i} FROM {t}{use_index(using, index)} WHERE {free} AND {marked} "
            f"AND {t}.{g} {scope} ORDER BY {by} LIMIT {int(size)}) b{n}"
            for n, (scope, index, marked, by) in enumerate(scopes)
        )
        first, source, among = rows_among(using, MESSAGE_TABLE, oldest)
        return f"SELECT {first}{t}.{i} FROM {source} WHERE {among} AND {passes}{lock}"
    window = (
        f"SELECT {t}.{i} FROM {t}{use_index(using, CLAIM_INDEX)} WHERE {claimable} AND {t}.{p} < {SET_ASIDE} "
        f"ORDER BY {order} LIMIT {int(scan or 0)}"
    )
    first, source, among = rows_among(using, MESSAGE_TABLE, window)
    if what == "aside":
        return f"SELECT {first}{t}.{i} FROM {source} WHERE {among} AND {claimable} AND NOT ({passes}){lock}"
    columns, _ = _message_reader(using)
    if what == "claim+groups":
        fg = qn(FlowGroup._meta.db_table)
        source += f" LEFT JOIN {fg} fg ON fg.{q} = {t}.{q} AND fg.{qn('name')} = {t}.{g}"
        columns += f", fg.{qn('name')}"
    return (
        f"SELECT {first}{columns}, {now} FROM {source} WHERE {among} AND {claimable} AND {passes} "
        f"ORDER BY {order} LIMIT {int(size)}{lock}"
    )


def any_eligible(using: str, queue: str, options: QueueOptions) -> bool:
    """Whether a claim could take a message of ``queue`` now but for its rate: the ``--until-empty`` look.

    A message that a group rule holds back (its group's elder waits or
    runs, its group has its limit in flight elsewhere) leaves the queue
    empty: it waits for something that is not this worker's to do, as a
    scheduled message does. A rate holds messages back for one period at
    most, and the worker waits that long. A set-aside message that the
    rules would let through counts: a claim brings it back.
    """
    rules, params = _plan(using, queue, options, probe=True)
    with connections[using].cursor() as cursor:
        cursor.execute(_statement(using, f"probe-{rules}", 1, _plan_sql), [queue, options.max_attempts, *params])
        return cursor.fetchone() is not None


def claim_controlled(
    using: str, queue: str, limit: int, options: QueueOptions, seconds: float, token: str, worker: str
) -> tuple[list[LiveMessage], float | None]:
    """Lease up to ``limit`` messages of a flow-controlled ``queue``, inside the caller's transaction.

    Returns them in claim order, and the seconds after which the worker
    should claim again if it got nothing: when the rate limit held messages
    back, until its next slot is free; 0 when the claim set rows aside and
    stopped before it reached past them (`ROUNDS`).

    First, set-aside messages that the rules now let through come back
    (`bring_back`). Then each round reads the claim's window; when it
    finds fewer candidates than wanted, the window's held-back rows are set
    aside, and the next round's window reaches past them.
    """
    window = min(limit + EXTRA_CANDIDATES, MAX_CANDIDATES)
    rules, params = _plan(using, queue, options)
    joined = bool(options.group_concurrency or options.kind_group_concurrency) and locks_outer_joined_rows(using)
    held = rules != "plain"  # a queue-wide rate holds back no row in particular: nothing to set aside
    if held:
        bring_back(using, queue, options, rules, params)
    claim = f"claim{'+groups' if joined else ''}"
    arguments = [queue, options.max_attempts, queue, options.max_attempts, *params]
    retry_in = None
    for n in range(ROUNDS):
        scan = SCAN if n else max(FIRST_SCAN * window, MIN_SCAN)
        with connections[using].cursor() as cursor:
            cursor.execute(_statement(using, f"{claim}@{scan}-{rules}", window, _plan_sql), arguments)
            rows = cursor.fetchall()
        if len(rows) >= limit or not held or not set_aside(using, queue, rules, scan, arguments):
            break
    else:
        retry_in = 0.0  # this claim stopped setting rows aside: the next one goes on at once
    if not rows:
        rate = options.rate_limit
        if rate is not None and rate.per_group:  # the filter left out the groups whose rate is used up
            retry_in = _next_slot_in(using, queue, rate) if retry_in is None else retry_in
        return [], retry_in
    clock = aware_clock(rows[0][-1])
    group_of = {row[0]: _group(row) for row in rows}
    if options.ordered and locking_reads_see_newer_rows(using):
        rows = heads_only(using, queue, rows, group_of)
    lease = (seconds, token, worker)
    return _within_rules(using, queue, rows, group_of, clock, limit, options, joined, lease, retry_in)


def _within_rules(
    using: str,
    queue: str,
    rows: list[Any],
    group_of: dict[int, str | None],
    clock: datetime,
    limit: int,
    options: QueueOptions,
    joined: bool,
    lease: tuple[float, str, str],
    retry_in: float | None,
) -> tuple[list[LiveMessage], float | None]:
    """Lease up to ``limit`` of the candidates ``rows`` (their groups: ``group_of``) that the group limits,
    then the rate, let through; ``clock``: the claim's; ``lease``: its seconds, token and worker.

    Each round asks the groups' locks and the rate's slots for as many
    rows as the claim still wants, in claim order, and leases what they
    let through. On a per-group rate, a round whose rows' groups had too
    few slots left is followed by one over the candidates of the groups
    that had enough: one busy group does not stop the claim short, and no
    round asks for more slots than the messages the claim still wants.
    """
    kind_of = {row[0]: _kind(row) for row in rows}
    order = {row[0]: n for n, row in enumerate(rows)}
    rate = options.rate_limit
    grouped = options.group_concurrency or options.kind_group_concurrency
    locked = {row[-2] for row in rows if row[-2] is not None} if joined else set()
    leased: list[LiveMessage] = []
    for _ in range(len(rows)):  # each round leases a row or spends a scope, or is the last
        wanted = limit - len(leased)
        if grouped:
            chosen = _within_group_limits(using, queue, rows, options, group_of, kind_of, clock, wanted, locked)
        else:
            chosen = rows[:wanted]
        spent: set[str] = set()
        if rate is not None and chosen:
            chosen, rate_in, spent = _within_rate(using, queue, chosen, rate, group_of, clock)
            retry_in = rate_in if retry_in is None or rate_in is None else min(retry_in, rate_in)
        leased += lease_rows(using, chosen, *lease)
        if len(leased) >= limit or not spent or rate is None or not rate.per_group:
            break
        done = {row[0] for row in chosen}
        rows = [row for row in rows if row[0] not in done and (group_of[row[0]] or "") not in spent]
        if not rows:
            break
    leased.sort(key=lambda message: order[message.pk])
    return leased, retry_in


# --- held-back messages set aside, and brought back ---------------------------------------------


def set_aside(using: str, queue: str, rules: str, scan: int, arguments: list[Any]) -> int:
    """Set aside the claim window's rows that a rule holds back; how many.

    A set-aside row takes the priority `SET_ASIDE`, its own kept in
    ``held_priority``: the claim index then holds it past every claimable
    row, where no window reads, and `bring_back` gives it back its
    priority, and so its place in the claim order. A lease that ran out
    (a dead worker's) is set aside with its token, which no longer holds:
    its attempts still count, and the reaper still finds a poison message.
    Rows another claim holds stay where they are.
    """
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(_statement(using, f"aside@{scan}-{rules}", 0, _plan_sql), arguments)
        ids = [row[0] for row in cursor.fetchall()]
        if ids:
            cursor.execute(_move_sql(using, len(ids), back=False), ids)
            _QUIET.pop((using, queue), None)
    return len(ids)


def _move_sql(using: str, count: int, *, back: bool) -> str:
    """Set ``count`` rows aside (``back=False``) or bring them back, by id; only rows in the other state move."""
    qn = connections[using].ops.quote_name
    p, kept = qn("priority"), qn("held_priority")
    if back:
        change, was = f"{p} = {kept}, {kept} = NULL", f"{kept} IS NOT NULL"
    else:
        change, was = f"{kept} = {p}, {p} = {SET_ASIDE}", f"{kept} IS NULL"
    ids = ", ".join(["%s"] * count)
    return f"UPDATE {qn(MESSAGE_TABLE)} SET {change} WHERE {qn('id')} IN ({ids}) AND {was}"


def bring_back(using: str, queue: str, options: QueueOptions, rules: str, params: list[Any]) -> int:
    """Make claimable again the set-aside messages of ``queue`` that the rules now let through; how many.

    Looks at up to `BRING_BACK_GROUPS` set-aside groups per claim, taking
    turns through them (`_set_aside_groups`), and at the messages of no
    group; of each, the oldest few (`_back_per_group`). One that comes
    back takes its place in the claim order again: ``available_at``
    becomes ``first_available_at``, as for a message given back early.

    A process that found none set aside looks again after
    `QUIET_ASIDE_SECONDS`, or at its next claim once it set rows aside
    itself: messages another process set aside may wait that much longer
    to come back, and the common claim, with none, saves a statement.
    """
    if _QUIET.get((using, queue), 0.0) > time.monotonic():
        return 0
    groups = _set_aside_groups(using, queue)
    if groups is None:
        _QUIET[(using, queue)] = time.monotonic() + QUIET_ASIDE_SECONDS
        return 0
    connection = connections[using]
    sql = _statement(using, f"back{len(groups)}-{rules}", _back_per_group(options), _plan_sql)
    with connection.cursor() as cursor:
        cursor.execute(sql, [*(value for group in groups for value in (queue, group)), queue, *params])
        ids = [row[0] for row in cursor.fetchall()]
        if ids:
            cursor.execute(_move_sql(using, len(ids), back=True), ids)
    return len(ids)


def _back_per_group(options: QueueOptions) -> int:
    """How many of a set-aside group's oldest messages a claim looks at: as many as the group may run at once.

    One for a FIFO group (only its head may run). Else the group limit of
    the kinds without one of their own (`MAX_BACK_PER_GROUP` where there
    is none) plus each kind's own limit, as those count apart; at most the
    per-group rate's count, and at most `MAX_BACK_PER_GROUP`.
    """
    if options.ordered:
        return 1
    at_once = (options.group_concurrency or MAX_BACK_PER_GROUP) + sum(options.kind_group_concurrency.values())
    if options.rate_limit is not None and options.rate_limit.per_group:
        at_once = min(at_once, options.rate_limit.count)
    return max(1, min(at_once, MAX_BACK_PER_GROUP))


def _set_aside_groups(using: str, queue: str) -> list[str] | None:
    """The next `BRING_BACK_GROUPS` groups of ``queue`` with set-aside messages, after the last ones looked at.

    None when no message of ``queue`` is set aside (one probe of the
    set-aside index, the usual answer). A skip scan, one index lookup per
    group however many messages each has set aside (`_skip_scan_sql`).
    Each process takes its own turns: the groups after the last one it
    looked at, then from the first again.
    """
    after = _TURNS.get((using, queue))
    sql = _statement(using, f"groups-{'after' if after is not None else 'first'}", 0, _skip_scan_sql)
    with connections[using].cursor() as cursor:
        again = [queue] if loose_index_scans(using) else [queue, queue]  # the recursive query names it twice more
        cursor.execute(sql, [queue, *([after] if after is not None else []), *again])
        found = [row[0] for row in cursor.fetchall()]
    groups = [v for v in found if v is not None]
    if len(groups) < BRING_BACK_GROUPS:
        _TURNS.pop((using, queue), None)
    else:
        _TURNS[(using, queue)] = groups[-1]
    if not found and after is not None:
        return _set_aside_groups(using, queue)  # the turn came round: from the first group again
    return groups if found else None


def _skip_scan_sql(using: str, name: str, size: int) -> str:
    """`_set_aside_groups`' statement: up to `BRING_BACK_GROUPS` groups in order, then NULL if no group's are set aside.

    MySQL/MariaDB read one index entry per group for a GROUP BY on a
    prefix of the index (a loose index scan); elsewhere a recursive query
    looks up each next group (on MariaDB that lookup, naming the previous
    group, read the whole range instead).
    """
    qn = connections[using].ops.quote_name
    t, g = qn(MESSAGE_TABLE), qn("group_key")
    table = f"{t}{use_index(using, ASIDE_INDEX)}"
    mine = f"{qn('queue')} = %s AND {qn('priority')} = {SET_ASIDE}"
    first = f"{g} > %s" if name.endswith("-after") else f"{g} IS NOT NULL"
    none = f"SELECT NULL FROM (SELECT 1 AS one) x WHERE EXISTS (SELECT 1 FROM {table} WHERE {mine} AND {g} IS NULL)"
    if loose_index_scans(using):
        return (
            f"SELECT v FROM (SELECT {g} AS v FROM {table} WHERE {mine} AND {first} "
            f"GROUP BY {qn('queue')}, {qn('priority')}, {g} ORDER BY {g} LIMIT {BRING_BACK_GROUPS}) found "
            f"UNION ALL {none}"
        )
    return (
        f"WITH RECURSIVE found (v, n) AS (SELECT (SELECT {g} FROM {table} WHERE {mine} AND {first} "
        f"ORDER BY {g} LIMIT 1), 1 UNION ALL SELECT (SELECT {g} FROM {table} WHERE {mine} AND {g} > found.v "
        f"ORDER BY {g} LIMIT 1), found.n + 1 FROM found WHERE found.v IS NOT NULL AND found.n < {BRING_BACK_GROUPS}) "
        f"SELECT v FROM found WHERE v IS NOT NULL UNION ALL {none}"
    )


# The last set-aside group each queue's claims looked at in this process (`_set_aside_groups`).
_TURNS: dict[tuple[str, str], str] = {}
# Until when this process's claims of a queue skip looking for set-aside messages (`bring_back`).
_QUIET: dict[tuple[str, str], float] = {}


def heads_only(using: str, queue: str, rows: list[Any], group_of: dict[int, str | None]) -> list[Any]:
    """The rows that are their group's oldest live message, by a read in a statement of its own.

    MySQL/MariaDB: the candidates' locking read returns the newest
    committed rows, while its sub-select of the head reads the statement's snapshot,
    which may be older. A message committed after the snapshot could then
    pass for its group's head, its elder having committed after the
    snapshot too. A new statement's snapshot holds every row the locking
    read returned, and so, producers taking turns, each one's elders.
    """
    groups = sorted({group for group in group_of.values() if group is not None})
    if not groups:
        return rows
    connection = connections[using]
    qn = connection.ops.quote_name
    g, i = qn("group_key"), qn("id")
    sql = (
        f"SELECT {g}, MIN({i}) FROM {qn(MESSAGE_TABLE)} WHERE {qn('queue')} = %s "
        f"AND {g} IN ({', '.join(['%s'] * len(groups))}) GROUP BY {g}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [queue, *groups])
        head = dict(cursor.fetchall())
    return [row for row in rows if group_of[row[0]] is None or head.get(group_of[row[0]]) == row[0]]


@functools.cache
def _field_index(name: str) -> int:
    """Where field ``name`` is in a claim's row (the live table's columns in model order)."""
    return [f.attname for f in message_model()._meta.concrete_fields].index(name)


def _group(row: Any) -> str | None:
    group: str | None = row[_field_index("group")]
    return group


def _kind(row: Any) -> str:
    kind: str = row[_field_index("kind")]
    return kind


def _within_group_limits(
    using: str,
    queue: str,
    rows: list[Any],
    options: QueueOptions,
    group_of: dict[int, str | None],
    kind_of: dict[int, str],
    clock: datetime,
    limit: int,
    locked: set[str],
) -> list[Any]:
    """The rows, in claim order, that keep every group within its limit: counted under the groups' locks.

    ``locked``: groups whose rows the candidates' SELECT locked already.
    The others are locked as the claim needs them, in claim order: first
    as many as it wants messages, then, for each group another claim held
    (skipped), the next one. So a group left alone stays free for a
    concurrent claim, and a claim of one message that meets a group held
    by another claim takes the next group's message instead of nothing.
    """
    met = list(dict.fromkeys(group for row in rows if (group := group_of[row[0]]) is not None))
    tried = set(locked)
    running = in_flight(using, queue, sorted(locked), clock) if locked else Counter()
    while True:
        taken, halted = _fitting(rows, options, group_of, kind_of, limit, locked, tried, running)
        untried = [group for group in met if group not in tried]
        if len(taken) >= limit or not halted or not untried:
            return taken
        batch = untried[: limit - len(taken)]
        tried.update(batch)
        fresh = lock_groups(using, queue, sorted(batch))
        if fresh:
            locked = locked | fresh
            running = running + in_flight(using, queue, sorted(fresh), clock)


def _fitting(
    rows: list[Any],
    options: QueueOptions,
    group_of: dict[int, str | None],
    kind_of: dict[int, str],
    limit: int,
    locked: set[str],
    tried: set[str],
    running: Counter[tuple[str, str | None]],
) -> tuple[list[Any], bool]:
    """The rows that fit their groups' limits, in claim order, up to the first row of a group not yet tried.

    Returns them, and whether such a row stopped the walk.
    """
    counts = Counter(running)
    overridden = options.kind_group_concurrency
    taken: list[Any] = []
    for row in rows:
        if len(taken) >= limit:
            break
        group = group_of[row[0]]
        if group is None:
            taken.append(row)
            continue
        if group not in tried:
            return taken, True
        if group not in locked:
            continue  # another claim is deciding for this group right now
        kind = kind_of[row[0]]
        bucket = (group, kind if kind in overridden else None)
        allowed = options.group_limit(kind)
        if allowed is None or counts[bucket] < allowed:
            counts[bucket] += 1
            taken.append(row)
    return taken, False


def lock_groups(using: str, queue: str, groups: list[str]) -> set[str]:
    """Lock the rows of ``groups`` (created where missing), skipping those another claim holds; the ones locked.

    Hand-written, not the ORM: it runs in the claim's short transaction,
    which on MySQL and psycopg 3 is not one of Django's (`short_transaction`).
    """
    if not groups:
        return set()
    locked = _locked_groups(using, queue, groups)
    missing = [g for g in groups if g not in locked]
    if missing:
        # Groups another claim holds are skipped; new groups (or ones the reaper pruned) get their row.
        # Asking first (a plain read) spares an INSERT that would wait for another claim's lock.
        held = _existing_groups(using, queue, missing)
        missing = [g for g in missing if g not in held]
    if missing:
        _insert_groups(using, queue, missing)
        locked |= _locked_groups(using, queue, missing)
    return locked


def _insert_groups(using: str, queue: str, groups: list[str]) -> None:
    """Insert the rows of ``groups``, skipping those that exist (another process may insert them first)."""
    table = FlowGroup._meta.db_table
    with connections[using].cursor() as cursor:
        for start in range(0, len(groups), 500):
            chunk = groups[start : start + 500]
            sql = insert_ignoring(using, table, ["queue", "name"], len(chunk))
            cursor.execute(sql, [value for g in chunk for value in (queue, g)])


def _existing_groups(using: str, queue: str, groups: list[str]) -> set[str]:
    return _locked_groups(using, queue, groups, lock="")


def _locked_groups(using: str, queue: str, groups: list[str], *, lock: str = "skip") -> set[str]:
    """The names of ``groups`` that have a row; ``lock``: "skip" rows held elsewhere, "wait" for them, "" no lock."""
    connection = connections[using]
    qn = connection.ops.quote_name
    lock_sql = ""
    if lock and connection.features.has_select_for_update:
        skip = lock == "skip" and connection.features.has_select_for_update_skip_locked
        lock_sql = " FOR UPDATE SKIP LOCKED" if skip else " FOR UPDATE"
    names = ", ".join(["%s"] * len(groups))
    table = qn(FlowGroup._meta.db_table)
    sql = f"SELECT {qn('name')} FROM {table} WHERE {qn('queue')} = %s AND {qn('name')} IN ({names}){lock_sql}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [queue, *groups])
        return {row[0] for row in cursor.fetchall()}


def in_flight(using: str, queue: str, groups: list[str], clock: datetime) -> Counter[tuple[str, str | None]]:
    """Messages in flight per (group, kind) and per (group, None) for kinds without a limit of their own.

    A fresh read (a new statement, after the groups' locks were taken):
    it sees every lease that a claim of these groups committed.
    """
    connection = connections[using]
    qn = connection.ops.quote_name
    overridden = queue_options(queue).kind_group_concurrency
    g, k = qn("group_key"), qn("kind")
    sql = (
        f"SELECT {g}, {k}, COUNT(*) FROM {qn(MESSAGE_TABLE)}{use_index(using, LEASE_INDEX)} WHERE {qn('queue')} = %s "
        f"AND {g} IN ({', '.join(['%s'] * len(groups))}) AND {qn('lease_token')} IS NOT NULL "
        f"AND {qn('available_at')} > %s GROUP BY {g}, {k}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [queue, *groups, connection.ops.adapt_datetimefield_value(clock)])
        rows = cursor.fetchall()
    counts: Counter[tuple[str, str | None]] = Counter()
    for group, kind, n in rows:
        counts[(group, kind if kind in overridden else None)] += n
    return counts


def _within_rate(
    using: str, queue: str, rows: list[Any], rate: RateLimit, group_of: dict[int, str | None], clock: datetime
) -> tuple[list[Any], float | None, set[str]]:
    """The rows, in claim order, that free rate slots allow; the slots are stamped with the claim's time.

    Also returns when to claim again if some were held back, and the
    scopes (groups, or ``""``) that had fewer free slots than rows.
    """
    wanted: Counter[str] = Counter((group_of[row[0]] or "") if rate.per_group else "" for row in rows)
    slots = take_slots(using, queue, wanted, rate, clock)
    taken, left = [], Counter({scope: len(ids) for scope, ids in slots.items()})
    for row in rows:
        scope = (group_of[row[0]] or "") if rate.per_group else ""
        if left[scope] > 0:
            left[scope] -= 1
            taken.append(row)
    used = [pk for ids in slots.values() for pk in ids]
    if used:
        RateSlot.objects.using(using).filter(pk__in=used).update(used_at=clock)
    retry_in = None
    held = [scope for scope, n in wanted.items() if len(slots.get(scope, [])) < n]
    if held:
        # The next claim can go once the oldest use in the period ages out, whatever its slot's number.
        since = clock - timedelta(seconds=rate.seconds)
        counted = RateSlot.objects.using(using).filter(queue=queue, group__in=held, used_at__gt=since)
        oldest = counted.aggregate(m=models.Min("used_at"))
        if oldest["m"] is not None:
            retry_in = max(0.0, (oldest["m"] + timedelta(seconds=rate.seconds) - clock).total_seconds())
    return taken, retry_in, set(held)


def _next_slot_in(using: str, queue: str, rate: RateLimit) -> float | None:
    """Seconds until the oldest use of ``queue``'s rate slots in the period ages out (None: no use in it).

    When a per-group rate held back every candidate, that is the earliest a
    slot of some group frees; the worker claims again then instead of
    waiting its idle pause.
    """
    qn = connections[using].ops.quote_name
    period_ago, period = compile_now(using, -rate.seconds)
    now, _ = compile_now(using)
    sql = (
        f"SELECT MIN({qn('used_at')}), {now} FROM {qn(RateSlot._meta.db_table)} "
        f"WHERE {qn('queue')} = %s AND {qn('used_at')} > {period_ago}"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(sql, [queue, *period])
        oldest, clock = cursor.fetchone()
    if oldest is None:
        return None
    oldest = aware_clock(oldest)
    return max(0.0, (oldest + timedelta(seconds=rate.seconds) - aware_clock(clock)).total_seconds())


def take_slots(using: str, queue: str, wanted: Counter[str], rate: RateLimit, clock: datetime) -> dict[str, list[int]]:
    """Lock up to ``wanted[scope]`` free slots of each scope (a group, or '' for the queue); their ids by scope.

    A slot is free when its last claim is a period or more before ``clock``.
    A scope that has fewer rows than the rate's count gets the missing ones
    (free) first.

    Slots numbered ``count`` and up are left from a higher RATE_LIMIT: no
    claim takes them any more, but their uses in the period still count.
    Each such use costs the scope one of its free slots, so the lowered
    limit holds at once: the free slots, less those uses, are what the
    period has left.
    """
    free_before = clock - timedelta(seconds=rate.seconds)
    scopes = sorted(wanted)
    rows = RateSlot.objects.using(using).filter(queue=queue, group__in=scopes)
    retired = Counter(dict(_counts(rows.filter(slot__gte=rate.count, used_at__gt=free_before))))
    asked = Counter({s: wanted[s] + retired[s] for s in scopes})
    slots = rows.filter(slot__lt=rate.count)
    found = _free_slots(slots, free_before, asked[scopes[0]] if len(scopes) == 1 else None)
    short = [s for s in scopes if len(found.get(s, [])) < asked[s]]
    if short:
        have = dict(_counts(slots.filter(group__in=short)))
        missing = [s for s in short if have.get(s, 0) < rate.count]
        if missing:
            new_at = free_before - timedelta(seconds=1)
            RateSlot.objects.using(using).bulk_create(
                [RateSlot(queue=queue, group=s, slot=n, used_at=new_at) for s in missing for n in range(rate.count)],
                ignore_conflicts=True,
            )
            again = _free_slots(slots.filter(group__in=missing).exclude(pk__in=_ids(found)), free_before)
            for scope, ids in again.items():
                found.setdefault(scope, []).extend(ids)
    return {scope: ids[: max(0, min(wanted[scope], len(ids) - retired[scope]))] for scope, ids in found.items()}


def _counts(slots: models.QuerySet[RateSlot]) -> list[tuple[str, int]]:
    """How many of ``slots`` each scope has."""
    return list(slots.values_list("group").annotate(n=models.Count("id")).order_by())


def _free_slots(
    slots: models.QuerySet[RateSlot], free_before: datetime, most: int | None = None
) -> dict[str, list[int]]:
    """Lock free slots (``most`` of them at most: one scope) and return their ids by scope.

    Several scopes (groups) are locked whole: one statement cannot stop at
    so many per group; the claim uses what it needs, and commits at once.
    """
    found: dict[str, list[int]] = defaultdict(list)
    rows = slots.select_for_update(skip_locked=True).filter(used_at__lte=free_before).order_by("used_at")
    if most is not None:
        rows = rows[:most]
    for pk, scope in rows.values_list("pk", "group"):
        found[scope].append(pk)
    return found


def _ids(found: dict[str, list[int]]) -> list[int]:
    return [pk for ids in found.values() for pk in ids]


# --- the reaper and the overview ------------------------------------------------------------


def prune(using: str, batch_size: int) -> int:
    """Delete passed unique windows, groups without live messages, and rate slots long idle; rows deleted."""
    now = DbNow()
    live = message_model().objects.using(using).filter(queue=models.OuterRef("queue"), group=models.OuterRef("name"))
    # A group row is only a handle to lock: deleting one that just got a message again is harmless (the next
    # claim or producer inserts it again), so its lock and delete need not repeat the sub-select.
    return (
        _delete_unlocked(UniqueWindow.objects.using(using).filter(until__lte=now), batch_size)
        + _delete_unlocked(FlowGroup.objects.using(using).filter(~models.Exists(live)), batch_size, recheck=False)
        + _delete_unlocked(
            RateSlot.objects.using(using).filter(used_at__lt=DbNow(-RATE_SLOT_IDLE.total_seconds())), batch_size
        )
    )


def _delete_unlocked(rows: models.QuerySet[Any], batch_size: int, *, recheck: bool = True) -> int:
    """Delete up to ``batch_size`` of ``rows``, leaving those another transaction holds to a later pass.

    A producer of a FIFO group holds the group's row until its own
    transaction commits, however long that is, and its message is not yet
    visible: the group looks empty. Waiting for that lock would stall the
    reaper (on PostgreSQL without end). So the rows are found by a plain
    read, then locked by primary key with ``SKIP LOCKED`` (and, with
    ``recheck``, still matching ``rows``) and deleted; no statement that
    locks reads another table.
    """
    using = rows.db
    ids = list(rows.values_list("pk", flat=True)[:batch_size])
    if not ids:
        return 0
    target = rows if recheck else rows.model._default_manager.using(using)
    with write_transaction(using):
        free = list(target.filter(pk__in=ids).select_for_update(skip_locked=True).values_list("pk", flat=True))
        return target.model._default_manager.using(using).filter(pk__in=free).delete()[0] if free else 0


def busiest_groups(using: str, queue: str, top: int = 10) -> list[tuple[str, int]]:
    """The groups of ``queue`` with the most messages in flight, most first (the overview's list)."""
    rows = (
        message_model()
        .objects.using(using)
        .filter(queue=queue, group__isnull=False)
        .in_flight()
        .values_list("group")
        .annotate(n=models.Count("id"))
        .order_by("-n", "group")[:top]
    )
    return [(group, n) for group, n in rows]


def rate_use(using: str, queue: str, rate: RateLimit) -> int:
    """Claims of ``queue`` in the current period, by the slots stamped within it (all groups together)."""
    since = DbNow(-rate.seconds)
    return RateSlot.objects.using(using).filter(queue=queue, used_at__gt=since).count()
