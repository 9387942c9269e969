"""The hot table: live messages (ready, scheduled, in flight), and every statement on it.

A finished message leaves this table for the archive in the same
transaction as its acknowledgement, so the table's size is the backlog.
Each rule of the lifecycle (docs/design.md) is written once, here: what a
state is, what a lease guard matches, when attempts are used up, how a
lease is given back, how a message moves to the archive.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypedDict

from django.db import IntegrityError, models
from django.db.models import Case, Count, F, Min, Q, Value, When
from django.db.models.base import ModelState
from django.db.models.functions import Coalesce

from .. import propagation, signals, validation
from ..conf import database_for, get_settings, queue_options
from ..db.clock import DbNow, db_now, insert_returns_expressions
from ..db.errors import DATABASE_TROUBLE, outcome_unknown, with_retries
from ..db.transactions import short_transaction, write_transaction
from ..exceptions import InvalidOption, NotClaimed, PayloadNotSerializable, UnknownOption
from . import events, flow, landed
from .archive import ArchivedMessage, Outcome
from .consuming import ConsumerActions
from .fields import NameField
from .reporting import HandlerReports
from .statements import (
    MESSAGE_TABLE,
    ack_in_one_statement,
    ack_leased,
    ack_unlocked,
    archive_copies,
    claim_is_one_statement,
    claim_rows,
    delete_locked,
    distinct_leading,
    finish_is_one_statement,
    finish_leased,
    insert_message,
    insert_messages,
    lock_leased,
    statement_chunks,
)


class MessageState(models.TextChoices):
    READY = "ready"
    SCHEDULED = "scheduled"
    IN_FLIGHT = "in_flight", "in flight"


class StateAnnotations(TypedDict):
    """What `MessageQuerySet.with_state` annotates: the row's state, and the database's time (for ages)."""

    current_state: str
    db_now: datetime


def state_filters() -> dict[MessageState, Q]:
    """The one definition of each live state, judged by the database's clock.

    ``ready`` is claimable now (including messages whose lease ran out),
    ``scheduled`` waits for its time, ``in_flight`` is leased to a worker.
    """
    now = DbNow()
    return {
        MessageState.READY: Q(available_at__lte=now),
        MessageState.SCHEDULED: Q(available_at__gt=now, lease_token__isnull=True),
        MessageState.IN_FLIGHT: Q(available_at__gt=now, lease_token__isnull=False),
    }


def lease_held(token: str, ids: Iterable[int]) -> Q:
    """The lease guard, the one definition: rows ``ids`` still carry ``token``, and the lease has not run out.

    A lease that ran out is lost even before another worker claims the
    message: the reaper or a new claim may act on it at any moment.
    """
    return Q(pk__in=list(ids), lease_token=token, available_at__gt=DbNow())


def held_token(message: Message) -> str:
    """The lease token of a claimed message; NotClaimed when it has none."""
    if message.pk is None or not message.lease_token:
        raise NotClaimed(f"message {message.pk} is not claimed (it has no lease token); claim it first")
    return message.lease_token


def exhausted(max_attempts: int) -> Q:
    """Leased, with no attempts left (``max_attempts``: the queue's default for messages that set none)."""
    return Q(lease_token__isnull=False, attempts__gte=Coalesce("max_attempts", Value(max_attempts)))


ENQUEUE_OPTIONS = frozenset(
    {
        "kind",
        "key",
        "group",
        "unique",
        "debounce",
        "delay",
        "run_at",
        "priority",
        "headers",
        "max_attempts",
        "expires_at",
        "using",
    }
)


def default_worker_name() -> str:
    """How a claim names its worker when the caller does not: host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def build_message(queue: str, payload: Any, options: dict[str, Any]) -> tuple[Message, float | None]:
    """Validate one message's options and build it (unsaved). Returns it and its delay.

    The one set of checks every producer's messages pass (enqueue,
    enqueue_many, publish, the outbox, the Tasks backend, schedules, replay,
    request/reply), in one order: option names, queue, kind, headers (after
    the header hooks, so a hook's headers are checked too), key and group,
    payload, priority, attempts, times, then the key's rules (unique window,
    debounce). Nothing is written before all of them pass.
    """
    unknown = set(options) - ENQUEUE_OPTIONS
    if unknown:
        raise UnknownOption(
            f"unknown enqueue option(s) {', '.join(sorted(map(repr, unknown)))}; "
            f"known: {', '.join(sorted(ENQUEUE_OPTIONS))}"
        )
    queue = validation.validate_queue_name(queue)
    kind = validation.validate_kind(options.get("kind", ""))
    headers = message_headers(queue, kind, options.get("headers"))
    key = validation.validate_key(options.get("key"))
    group = validation.validate_key(options.get("group"), "group")
    payload_json = validation.payload_json(payload)
    priority = validation.validate_priority(options.get("priority", 0))
    max_attempts = validation.validate_max_attempts(options.get("max_attempts"))
    delay = options.get("delay")
    seconds = None if delay is None else validation.seconds(delay, "delay")
    run_at = validation.aware_datetime(options.get("run_at"), "run_at")
    if delay is not None and run_at is not None:
        raise InvalidOption("give delay or run_at, not both")
    expires_at = validation.aware_datetime(options.get("expires_at"), "expires_at")
    window, debounce = flow.key_rules(key, options, delay, run_at)
    message = Message.unsaved(
        queue=queue,
        payload=payload,
        kind=kind,
        key=key,
        group=group,
        headers=headers,
        priority=priority,
        max_attempts=max_attempts,
        expires_at=expires_at,
    )
    message.keep_payload_json(payload_json)
    if run_at is not None:
        message.available_at = message.first_available_at = run_at
    message._dbqueue_window, message._dbqueue_debounce = window, debounce
    return message, seconds


def message_headers(queue: str, kind: str, headers: Any) -> dict[str, Any]:
    """A message's headers: the producer's, then each header hook's (trace context), then checked, all of them.

    The hooks run before the check, so a hook cannot slip in a value that
    one database would store and another refuse. With no hooks (the
    default) this costs one test of an empty list.
    """
    if headers is not None and not isinstance(headers, dict):
        raise PayloadNotSerializable(f"headers must be a dict, not {type(headers).__name__}")
    if propagation.hooks:  # trace context and the like (docs/tracing.md)
        headers = propagation.outgoing(queue, kind, dict(headers or {}))
    return validation.validate_headers(headers)


class Claimed(list["Message"]):
    """What a claim leased, in claim order.

    ``retry_in``: when a rate limit held messages back, the seconds until it lets more through.
    """

    retry_in: float | None = None


class MessageQuerySet(models.QuerySet["Message"]):
    """Querysets whose methods name the states of the lifecycle."""

    def chosen_db(self) -> str | None:
        """The alias given to ``using()``, if any: without one, the queue's routing picks the database."""
        return self._db  # type: ignore[attr-defined,no-any-return]  # QuerySet._db is not in django-stubs

    def for_queue(self, queue: str | Iterable[str]) -> MessageQuerySet:
        return self.filter(queue=queue) if isinstance(queue, str) else self.filter(queue__in=list(queue))

    def ready(self) -> MessageQuerySet:
        return self.filter(state_filters()[MessageState.READY])

    def scheduled(self) -> MessageQuerySet:
        return self.filter(state_filters()[MessageState.SCHEDULED])

    def in_flight(self) -> MessageQuerySet:
        return self.filter(state_filters()[MessageState.IN_FLIGHT])

    def in_state(self, state: str) -> MessageQuerySet:
        return self.filter(state_filters()[MessageState(state)])

    def with_state(self) -> MessageQuerySet:
        """Annotate each row's state as ``current_state``, and the database's time as ``db_now`` (for ages)."""
        return self.annotate(
            db_now=DbNow(),
            current_state=Case(
                *(When(match, then=Value(state.value)) for state, match in state_filters().items()),
                output_field=models.CharField(),
            ),
        )

    def expired(self) -> MessageQuerySet:
        return self.filter(expires_at__lte=DbNow())

    def claimable(self, max_attempts: int) -> MessageQuerySet:
        """What a claim may take now: ready, not expired, and not a poison message.

        ``max_attempts`` is the queue's default, for messages that set none. A
        message whose lease expired on its last attempt killed (or outlived)
        its worker: the reaper dead-letters it, nobody claims it again.
        """
        not_expired = Q(expires_at__isnull=True) | Q(expires_at__gt=DbNow())
        return self.ready().filter(not_expired).exclude(exhausted(max_attempts))

    def queue_names(self) -> set[str]:
        """The queues that have live messages, read off the claim index (its first column), not the rows."""
        return set(distinct_leading(self.db, MESSAGE_TABLE, "queue"))

    def any_claimable(self, queues: Iterable[str]) -> bool:
        """Whether a claim on any of ``queues`` would find something now (``--until-empty``'s last look).

        On a queue with group rules, a message they hold back does not count
        (`flow.any_eligible`); one a rate holds back does.
        """
        return any(self._any_claimable(queue) for queue in queues)

    def _any_claimable(self, queue: str) -> bool:
        options = queue_options(queue)
        if options.ordered or options.group_concurrency or options.kind_group_concurrency:
            return flow.any_eligible(self.db, queue, options)
        return self.filter(queue=queue).claimable(options.max_attempts).exists()

    def poison(self, max_attempts: int) -> MessageQuerySet:
        """Messages whose lease ran out on their last attempt: the reaper dead-letters them."""
        return self.ready().filter(exhausted(max_attempts))

    def counts_by_queue(self) -> dict[str, dict[str, int]]:
        """``{queue: {"ready": n, "scheduled": n, "in_flight": n}}`` in one query."""
        match = state_filters()
        rows = self.values("queue").annotate(
            ready=Count("id", filter=match[MessageState.READY]),
            scheduled=Count("id", filter=match[MessageState.SCHEDULED]),
            in_flight=Count("id", filter=match[MessageState.IN_FLIGHT]),
        )
        return {
            row["queue"]: {"ready": row["ready"], "scheduled": row["scheduled"], "in_flight": row["in_flight"]}
            for row in rows.order_by("queue")
        }

    def oldest_ready_age(self, queue: str | Iterable[str] | None = None) -> timedelta | None:
        """How long the oldest ready message has been waiting (None when none is)."""
        qs = self.ready() if queue is None else self.for_queue(queue).ready()
        oldest = qs.aggregate(oldest=Min("available_at"))["oldest"]
        return None if oldest is None else max(db_now(self.db) - oldest, timedelta(0))

    def leased(self, message: Message) -> MessageQuerySet:
        """The queryset that matches ``message`` only while its holder's lease holds (`lease_held`)."""
        return self.filter(lease_held(held_token(message), [message.pk]))

    def give_back(self, *, count_attempt: bool) -> int:
        """Make these leased messages ready again, keeping their place in the queue.

        A message given back (a dead worker's, a shutdown's unstarted ones, an
        operator's release) becomes ready at the time it first became
        available, not at "now", so it does not wait behind the backlog that
        arrived after it. ``count_attempt=False`` (it never ran) gives the
        claim's attempt back too.
        """
        changes: dict[str, Any] = {"lease_token": None, "available_at": F("first_available_at"), "claimed_by": ""}
        if not count_attempt:
            changes["attempts"] = F("attempts") - 1
        return self.filter(lease_token__isnull=False).update(**changes)

    def take_first(self, queue: str) -> Message | None:
        """Remove and return the oldest message of a queue that only its one reader consumes (a reply queue)."""
        found = self.filter(queue=queue).order_by("id").first()
        if found is not None:
            self.filter(pk=found.pk)._raw_delete(self.db)
        return found

    def locate(self, pk: int, **match: Any) -> Message | ArchivedMessage | None:
        """The live message ``pk``, else its newest archive row, else None.

        A message keeps its id in the archive as ``message_id``; ``match``
        narrows both lookups (a queue, a kind).
        """
        validation.message_id(pk)
        live = self.filter(pk=pk, **match).first()
        if live is not None:
            return live
        return ArchivedMessage.objects.using(self.db).filter(message_id=pk, **match).order_by("-id").first()

    # --- producing ---------------------------------------------------------------

    def enqueue(self, queue: str, payload: Any, **options: Any) -> Message:
        """Validate, insert and announce one message; see `django_dbqueue.enqueue`."""
        message, delay = build_message(queue, payload, options)
        using = database_for(queue, options.get("using") or (self.db if self.chosen_db() else None))
        self.insert_into(using, message, delay)
        events.enqueued([message], using)
        return message

    def enqueue_many(self, queue: str, payloads: Iterable[Any], **options: Any) -> list[Message]:
        """Validate, insert and announce many messages in one transaction; see `django_dbqueue.enqueue_many`."""
        options = dict(options)
        queue = validation.validate_queue_name(queue)
        using = database_for(queue, options.get("using") or (self.db if self.chosen_db() else None))
        payloads = list(payloads)
        if options.get("key") is not None and len(payloads) > 1:
            raise InvalidOption(
                "one key for many payloads would keep only the first; give keys one by one with enqueue()"
            )
        if not payloads:
            build_message(queue, {}, options)  # bad options are refused with no payloads too
            return []
        # The options are the same for every payload: checked once, on the first message.
        first, delay = build_message(queue, payloads[0], options)
        headers = options.get("headers") or {}  # checked by build_message, with or without hooks

        def copy(payload: Any) -> Message:
            # Each message its own headers, and its own trace context where hooks add one (docs/tracing.md),
            # checked as build_message checks the first's.
            own = message_headers(queue, first.kind, headers) if propagation.hooks else dict(headers)
            return first.with_payload(payload, own)

        pending = [(first, delay), *((copy(payload), delay) for payload in payloads[1:])]
        return self.using(using).insert_built(pending)

    def insert_built(self, pending: list[tuple[Message, float | None]]) -> list[Message]:
        """Insert built messages (with their delays) and announce the ones this call created."""
        if not pending:
            return []
        result = self.insert_many(pending)
        events.enqueued(result, self.db)
        return result

    def insert(self, message: Message, delay: float | None) -> Message:
        """Insert one built, validated message (its times from the database clock): see `insert_into`."""
        return self.insert_into(self.db, message, delay)

    def insert_into(self, using: str, message: Message, delay: float | None) -> Message:
        """Insert one built, validated message into database ``using`` (its times from the database clock).

        A keyed message whose key is live is not inserted: ``message`` becomes
        the live one and its ``was_created`` is False. Where the INSERT can
        return the times it computed, it does; elsewhere the clock is read
        before the INSERT, never read back after it: a worker may take the
        message the moment it commits (a request's reply), and then there is
        no row left to read. ``using`` is an argument, not ``self.using()``,
        which would copy the queryset for every message.
        """
        scheduled = message.available_at is not None  # run_at was given
        returned = insert_returns_expressions(using)

        def insert() -> bool:
            if message.key is None:  # the common case, in one hand-written statement
                insert_message(using, message, None if scheduled else delay or 0)
                return True
            on = self.using(using)
            now = DbNow() if returned else db_now(using)
            message.created_at = now
            if not scheduled and getattr(message, "_dbqueue_debounce", None) is None:
                later = DbNow(delay or 0) if returned else now + timedelta(seconds=delay or 0)
                message.available_at = message.first_available_at = later
            return on._insert_keyed_one(message, now)

        group = message.group
        if group is not None and flow.takes_turns(using, message.queue):
            unlocked = insert

            def insert() -> bool:
                with write_transaction(using):
                    flow.take_turns(using, message.queue, {group})
                    return unlocked()

        message._dbqueue_created = with_retries(using, insert, what="enqueue")
        return message

    def _insert_keyed_one(self, message: Message, now: datetime | DbNow) -> bool:
        """Insert one keyed message by its key's rules: debounce, a unique window, or plain "until finished".

        The one place those rules are applied, whichever producer built the
        message (one message, or one of a batch inside its transaction).
        ``now``: the database's time as the caller has it.
        """
        debounce = getattr(message, "_dbqueue_debounce", None)
        if debounce is not None:
            return self._debounce(message, debounce, now)
        window = getattr(message, "_dbqueue_window", None)
        if window is not None:
            return self._insert_in_window(message, window)
        return self._insert_or_get(message)

    def _adopt(self, message: Message, live: Message) -> None:
        """Make ``message`` (this call's, unsaved) the live one it ran into: the caller gets what is in the table."""
        message.__dict__.update({k: v for k, v in live.__dict__.items() if k != "_state"})
        message._state.adding = False
        message._state.db = self.db

    def _insert_in_window(self, message: Message, window: float) -> bool:
        """Insert a keyed message unless its key was taken less than its unique window ago (or is live).

        The window's row and the message are written in one transaction: a
        message refused because its key is live does not renew the window.
        Refused, ``message`` becomes the live one, or stays unsaved (``pk``
        None) when the key's message already finished.
        """
        using = self.db
        assert message.key is not None  # key_rules() refuses a window without a key
        try:
            with write_transaction(using):
                if not flow.take_window(using, message.queue, message.key, window):
                    raise _Refused
                if not self._insert_or_get(message):
                    raise _Refused
                flow.note_window_owner(using, message.queue, message.key, message.pk)
                return True
        except _Refused:
            live = self.filter(queue=message.queue, key=message.key).first()
            if live is not None:
                self._adopt(message, live)
            else:
                message.pk = None
            return False

    def _debounce(self, message: Message, seconds: float, now: datetime | DbNow) -> bool:
        """Replace the key's waiting message (live, never run) with this one, due ``seconds`` from now; else insert.

        The last write wins: a locked UPDATE of the waiting row, or, when
        there is none, an INSERT that the unique key decides; a producer that
        loses that race replaces the winner's payload on its next turn. A key
        whose message is running or retrying is left alone: ``message``
        becomes that one (``was_created`` False). ``now``: the database's
        time as `insert` has it (an expression where the INSERT returns
        what it computed, else a reading).
        """
        mine = {f: getattr(message, f) for f in DEBOUNCED}
        waiting = self.filter(queue=message.queue, key=message.key, lease_token__isnull=True, attempts=0)
        due = DbNow(seconds) if isinstance(now, DbNow) else now + timedelta(seconds=seconds)
        for _ in range(10):
            # Replaced in place only within its group: a FIFO group's order is its ids', and a waiting
            # message moved into another group with its old, lower id would jump ahead of that group's
            # head (even one in flight). A move leaves its old row for a new one, last in its new group.
            if waiting.filter(group=message.group).update(**mine, available_at=due, first_available_at=due) == 1:
                live = self.filter(queue=message.queue, key=message.key).first()
                if live is not None:
                    self._adopt(message, live)
                    return False
                continue  # run now, or cancelled, in between: start again
            if self._move_group(waiting, message, mine, due):
                return False
            fresh = Message(queue=message.queue, key=message.key, created_at=message.created_at, **mine)
            fresh.available_at = fresh.first_available_at = due
            created = self._insert_or_get(fresh)
            if created or fresh.lease_token is not None or fresh.attempts > 0:
                self._adopt(message, fresh)
                return created
            # Another producer inserted it first: replace its payload on the next turn.
        raise IntegrityError(f"could not debounce key {message.key!r} in queue {message.queue!r} after 10 tries")

    def _move_group(self, waiting: MessageQuerySet, message: Message, mine: dict[str, Any], due: Any) -> bool:
        """Replace the key's waiting message of another group by a new row (a new id); False when there is none.

        One transaction: the old row is deleted and the new one inserted
        under the same key, so the key never has two messages, nor none.
        """
        using = self.db
        with write_transaction(using):
            old = list(waiting.exclude(group=message.group).select_for_update().values_list("pk", flat=True))
            if not old or self.filter(pk__in=old)._raw_delete(using) != 1:
                return False  # nothing waiting (taken, finished or replaced in between): the caller goes on
            fresh = Message(queue=message.queue, key=message.key, created_at=message.created_at, **mine)
            fresh.available_at = fresh.first_available_at = due
            fresh.save(using=using, force_insert=True)
        self._adopt(message, fresh)
        message._state.adding = False
        return True

    def _insert_or_get(self, message: Message) -> bool:
        """Insert a keyed message unless its key is live; the unique index decides races."""
        using = self.db
        for _ in range(10):
            try:
                with write_transaction(using):
                    message.save(using=using, force_insert=True)
                return True
            except IntegrityError:
                message.pk = None
                live = self.filter(queue=message.queue, key=message.key).first()
                if live is not None:
                    self._adopt(message, live)
                    return False
                # The live one finished between our insert and our read: try again.
        raise IntegrityError(f"could not insert or find key {message.key!r} in queue {message.queue!r}")

    def insert_many(self, pending: list[tuple[Message, float | None]]) -> list[Message]:
        """Insert built messages (with their delays), keyed or not, of one or more queues.

        One transaction, multi-row inserts, retried on the database's weather.
        Returns, in order, each message or, where its key was live, the live one.
        """
        if len(pending) == 1:  # one INSERT that returns its id on every database
            return [self.insert(*pending[0])]
        return with_retries(self.db, lambda: self._insert_many(pending), what="enqueue_many")

    def _insert_many(self, pending: list[tuple[Message, float | None]]) -> list[Message]:
        using = self.db
        batch = get_settings().enqueue_batch_size
        now = db_now(using)
        messages = []
        for message, delay in pending:
            message.created_at = now
            if message.available_at is None:
                message.available_at = message.first_available_at = now + timedelta(seconds=delay or 0)
            messages.append(message)
        with write_transaction(using):
            turns: dict[str, set[str]] = defaultdict(set)
            for message in messages:
                if message.group is not None and flow.takes_turns(using, message.queue):
                    turns[message.queue].add(message.group)
            for queue, groups in sorted(turns.items()):
                flow.take_turns(using, queue, groups)
            plain = [m for m in messages if m.key is None]
            insert_messages(using, plain, batch)
            for message in plain:
                message._dbqueue_created = True
            keyed = [m for m in messages if m.key is not None and not _has_key_rules(m)]
            for message in messages:
                if message.key is not None and _has_key_rules(message):
                    message._dbqueue_created = self._insert_keyed_one(message, now)
            if not keyed:
                return messages
            live = self._insert_keyed(keyed, batch)
            result = []
            for message in messages:
                if message.key is None or _has_key_rules(message):
                    result.append(message)
                    continue
                row = live[(message.queue, message.key)]
                # Ours if the row carries this call's enqueue time and payload.
                row._dbqueue_created = row.created_at == now and row.payload == message.payload
                result.append(row)
            return result

    def _insert_keyed(self, keyed: list[Message], batch: int) -> dict[tuple[str, str | None], Message]:
        """Insert keyed messages whose key is not live; return the live row of every key.

        A live message with one of these keys may finish (and its delete
        commit) between our INSERT, which skipped the key, and our read,
        which then no longer finds it: such keys are inserted again, a
        bounded number of times.
        """
        live: dict[tuple[str, str | None], Message] = {}
        missing = keyed
        for _ in range(10):
            for chunk in statement_chunks(self.db, missing, batch, _json_bytes):
                self.bulk_create(chunk, ignore_conflicts=True)
            by_queue: dict[str, set[str]] = defaultdict(set)
            for message in missing:
                assert message.key is not None  # keyed messages only
                by_queue[message.queue].add(message.key)
            for queue, key_set in sorted(by_queue.items()):
                keys = sorted(key_set)
                for start in range(0, len(keys), batch):
                    for row in self.filter(queue=queue, key__in=keys[start : start + batch]):
                        live[(queue, row.key)] = row
            missing = [m for m in keyed if (m.queue, m.key) not in live]
            if not missing:
                return live
            for message in missing:
                message.pk = None
        raise IntegrityError(
            f"could not insert or find keys {sorted(str(m.key) for m in missing)[:5]} of enqueue_many "
            "after 10 tries: live messages with these keys keep finishing and coming back"
        )

    # --- consuming -------------------------------------------------------------

    def claim(
        self,
        queues: str | Iterable[str],
        limit: int = 1,
        *,
        visibility_timeout: float | timedelta | None = None,
        worker: str | None = None,
    ) -> list[Message]:
        """Lease up to ``limit`` claimable messages of ``queues`` in one short transaction.

        ``SELECT ... FOR UPDATE SKIP LOCKED`` walking the claim index, then one
        UPDATE per lease length; retried on the database's weather. See
        `django_dbqueue.claim`. The list is a `Claimed`: its
        ``retry_in`` says when a rate limit that held messages back lets more through.
        """
        names = validation.validate_queues(queues if isinstance(queues, str) else list(queues))
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidOption(f"limit must be a positive integer, not {limit!r}")
        timeout = (
            None
            if visibility_timeout is None
            else validation.seconds(visibility_timeout, "visibility_timeout", allow_zero=False)
        )
        using = database_for(names, self.db if self.chosen_db() else None)
        worker = worker or default_worker_name()
        manager = self.using(using)
        token = uuid.uuid4().hex
        unsure: list[BaseException] = []

        def run() -> Claimed:
            if unsure:  # the last try lost its connection: did its claim commit?
                leased = manager.claimed_under(token)
                if leased:
                    return leased
            try:
                return manager._claim(names, limit, timeout, worker, token)
            except DATABASE_TROUBLE as exc:
                if outcome_unknown(exc, using):
                    unsure.append(exc)
                raise

        claimed = with_retries(using, run, what="claim")
        events.claimed(claimed, using, worker)
        return claimed

    def claimed_under(self, token: str) -> Claimed:
        """The messages a claim leased under ``token`` whose lease still holds, in the claim index's order.

        A claim whose COMMIT succeeded but whose reply was lost leased them:
        its retry answers with them instead of leasing others.
        """
        rows = self.filter(lease_token=token, available_at__gt=DbNow()).order_by("priority", "first_available_at", "id")
        return Claimed(rows)

    def _claim(self, queues: list[str], limit: int, timeout: float | None, worker: str, token: str) -> Claimed:
        """One transaction (on PostgreSQL one statement per queue): see `statements.claim_rows`."""
        claimed = Claimed()
        controlled = any(queue_options(name).flow_controlled for name in queues)
        # One statement is a transaction of its own; several are wrapped in one.
        alone = len(queues) == 1 and claim_is_one_statement(self.db) and not controlled
        # Rate slots go through the ORM, which needs Django's own transaction.
        begin = write_transaction if any(queue_options(name).rate_limit for name in queues) else short_transaction
        with contextlib.nullcontext() if alone else begin(self.db):
            for name in queues:
                wanted = limit - len(claimed)
                if wanted <= 0:
                    break
                options = queue_options(name)
                seconds = timeout or options.visibility_timeout
                if not options.flow_controlled:
                    claimed += claim_rows(self.db, name, wanted, options.max_attempts, seconds, token, worker)
                    continue
                taken, retry_in = flow.claim_controlled(self.db, name, wanted, options, seconds, token, worker)
                claimed += taken
                if retry_in is not None:
                    claimed.retry_in = retry_in if claimed.retry_in is None else min(claimed.retry_in, retry_in)
        return claimed

    def update_leased(
        self, message: Message, what: str, *, landed_as: tuple[str, int] | None = None, **changes: Any
    ) -> bool:
        """Change a message only while its lease holds; False if the lease was lost.

        ``landed_as``: the worker and attempts that a change giving the lease
        up leaves on the row, by which a try whose reply was lost is known to
        have landed (`landed`); None for a change that can be made twice.
        """
        using = message._state.db or "default"
        on = self.using(using)
        leased = on.leased(message)

        def change() -> bool:
            return bool(leased.update(**changes) == 1)

        def found() -> bool | None:
            if landed_as is None:
                return None
            worker, attempts = landed_as
            return landed.changed(on, message, worker=worker, attempts=attempts) or None

        return with_retries(
            using, lambda: landed.guarded(using, message, change, found, False), what=f"{what} message {message.pk}"
        )

    def extend_leases(self, token: str, ids: list[int], seconds: float) -> int:
        """Push the leases of ``ids`` under ``token`` to ``seconds`` from now; a lease already lost stays lost."""
        return self.filter(lease_held(token, ids)).update(available_at=DbNow(seconds))

    # --- cancel and reports of running messages ------------------------------------

    def request_cancel(self, pk: int) -> bool:
        """Flag message ``pk`` for cancel if it is in flight (its worker stops it); False if it is not in flight.

        A second request keeps the first one's time.
        """
        flagged = self.filter(state_filters()[MessageState.IN_FLIGHT], pk=pk)
        requested_at = Coalesce("cancel_requested_at", DbNow())
        return with_retries(self.db, lambda: flagged.update(cancel_requested_at=requested_at) == 1, what="cancel")

    def cancel_flagged(self, ids: Iterable[int]) -> set[int]:
        """Which of ``ids`` an operator asked to cancel (the heartbeat's question, one query)."""
        return set(self.filter(pk__in=list(ids), cancel_requested_at__isnull=False).values_list("pk", flat=True))

    def reporting(self) -> MessageQuerySet:
        """In-flight messages whose handler reported progress, longest running first (the overview's list)."""
        return self.in_flight().filter(progress__isnull=False).order_by("claimed_at", "id")

    def abandoned_cancels(self) -> MessageQuerySet:
        """Messages flagged for cancel that no worker runs any more (their lease ran out): the reaper's to archive."""
        return self.ready().filter(cancel_requested_at__isnull=False, lease_token__isnull=False)

    def write_report(self, pk: int, token: str, values: Mapping[str, Any]) -> bool:
        """Write a running message's ``progress``/``meta`` while lease ``token`` holds (the heartbeat's write)."""
        return bool(self.filter(lease_held(token, [pk])).update(**values) == 1)

    def release_from(self, worker: str) -> int:
        """Give back every message ``worker`` holds (a dead worker's); the attempt it used counts."""
        return self.filter(claimed_by=worker).give_back(count_attempt=True)

    def run_now(self, pk: int) -> bool:
        """Make a scheduled (or backing-off) message ready now; in-flight ones are left alone."""
        return with_retries(
            self.db,
            lambda: self.filter(pk=pk, lease_token__isnull=True).update(available_at=DbNow()) == 1,
            what="run now",
        )

    # --- finishing ---------------------------------------------------------------

    def finish(
        self, message: Message, outcome: str, match: str = "lease", **row: Any
    ) -> tuple[bool, ArchivedMessage | None]:
        """Delete ``message`` and archive it as ``outcome``, atomically.

        ``match`` picks the row to delete: ``"lease"`` only while the caller's
        lease holds, ``"token"`` while the lease token read earlier is still
        there (even run out: the reaper), ``"id"`` whoever holds it, ``"idle"``
        only while nobody runs it (operators).
        Returns whether it was there to delete, and the archive row written
        (None when archiving is off for an acked message).
        """
        using = message._state.db or "default"
        if match == "lease" and not events.listened(events.signal_of(outcome)):
            return self._finish_quietly(message, outcome, row), None
        guard = {
            "lease": lambda: self.using(using).leased(message),
            "token": lambda: self.using(using).filter(pk=message.pk, lease_token=message.lease_token),
            "id": lambda: self.using(using).filter(pk=message.pk),
            "idle": lambda: self.using(using).filter(pk=message.pk).exclude(state_filters()[MessageState.IN_FLIGHT]),
        }[match]()
        archived: list[ArchivedMessage] = []

        def change() -> bool:
            archived.clear()
            with write_transaction(using):
                # _raw_delete: one DELETE, no collector SELECT (nothing cascades from messages).
                if guard._raw_delete(using) != 1:
                    return False
                if outcome != Outcome.ACKED or queue_options(message.queue).archive:
                    archived.append(ArchivedMessage.from_live(message, outcome, **row))
                    archived[0].save(using=using, force_insert=True)
                return True

        def found() -> bool | None:
            # Message ids are never reused: this id, claim time, outcome and finisher are this call's row.
            if not self.using(using)._finished(message, outcome, row.get("worker")):
                return None
            stored = landed.finished_row(using, message, outcome, row.get("worker"))
            archived[:] = [stored] if stored is not None else []
            return True

        def run() -> bool:
            return landed.guarded(using, message, change, found, False)

        done = with_retries(using, run, what=f"{outcome} message {message.pk}")
        return done, (archived[0] if archived and done else None)

    def _finished(self, message: Message, outcome: str, worker: str | None) -> bool:
        """Whether ``message``'s lease finished it as ``outcome`` (`landed`)."""
        return message.pk in landed.finished(self.db, self, [message], outcome, worker)

    def _finish_quietly(self, message: Message, outcome: str, row: Mapping[str, Any]) -> bool:
        """`finish` under the lease with nobody listening: hand-written, no archive row object built.

        The row written is the one `ArchivedMessage.from_live` makes.
        """
        using = message._state.db or "default"
        held_token(message)
        archived: dict[str, Any] | None = None
        if outcome != Outcome.ACKED or queue_options(message.queue).archive:
            kept, why = validation.storable_result(row.get("result"))
            error = row.get("error")
            error = message.last_error if error is None else error
            if why is not None:
                error = f"{error}\nresult not kept: {why}".strip()
            archived = {
                "finished_by": row.get("worker") or message.claimed_by,
                "last_error": validation.storable_text(error),
                "result": kept,
            }
        one_statement = archived is None or finish_is_one_statement(using)
        on = self.using(using)

        def change() -> bool:
            with contextlib.nullcontext() if one_statement else short_transaction(using):
                return finish_leased(using, message, outcome, archived)

        def found() -> bool | None:
            return on._finished(message, outcome, row.get("worker")) or None

        return with_retries(
            using, lambda: landed.guarded(using, message, change, found, False), what=f"{outcome} message {message.pk}"
        )

    def ack_many(
        self, messages: Iterable[Message], *, worker: str | None = None, results: Mapping[int, Any] | None = None
    ) -> list[bool]:
        """Acknowledge a batch, one transaction per database; per message, whether its lease held."""
        messages = list(messages)
        by_db: dict[str, list[Message]] = defaultdict(list)
        for message in messages:
            by_db[message._state.db or "default"].append(message)
        owned: set[int] = set()
        for using, group in by_db.items():
            acked = self.using(using).ack_batch(group, worker or "", results or {})
            owned |= acked
            if acked and events.listened(signals.message_acked):
                # The rows were copied inside the database: read them back, only for listeners.
                stored = ArchivedMessage.objects.using(using).filter(message_id__in=acked, outcome=Outcome.ACKED)
                rows_by_id = {row.message_id: row for row in stored.order_by("id")}
                for m in group:
                    if m.pk in acked:
                        row = {"result": (results or {}).get(m.pk), "worker": worker}
                        events.finished(m, Outcome.ACKED, rows_by_id.get(m.pk), row)
        return [message.pk in owned for message in messages]

    def ack_batch(self, messages: list[Message], worker: str, results: Mapping[int, Any]) -> set[int]:
        """Acknowledge messages of one database in one transaction; returns the ids whose lease held."""
        using = self.db
        tokens: dict[str, list[int]] = defaultdict(list)
        for message in messages:
            tokens[held_token(message)].append(message.pk)  # refuses a message never claimed
        kept: dict[int, Any] = {}
        notes: dict[int, str] = {}
        for message in messages:
            value, why = validation.storable_result(results.get(message.pk))
            if why is not None:
                notes[message.pk] = validation.storable_text(f"{message.last_error}\nresult not kept: {why}".strip())
            elif value is not None:
                kept[message.pk] = value
        # The archive rows are copied from the live ones: first write what handlers
        # reported since the last heartbeat (nothing, for handlers that do not report).
        for message in messages:
            unreported = message.unreported()
            if unreported is not None:
                count, values = unreported
                pk, token = message.pk, held_token(message)
                with_retries(using, lambda: self.write_report(pk, token, values), what="progress of a batch")  # noqa: B023
                message.reported(count)

        archived = [m.pk for m in messages if queue_options(m.queue).archive]

        def answered(write: Callable[[], set[int]]) -> set[int]:
            # A try whose reply was lost may have acked them: what the database holds answers (.landed).
            with landed.watching(using, messages):
                owned = write()
                missed = [m for m in messages if m.pk not in owned and landed.unsure(m)]
                if missed:
                    owned = owned | landed.finished(using, self, missed, Outcome.ACKED, worker)
            landed.settled(messages)
            return owned

        if ack_in_one_statement(using):
            return with_retries(
                using,
                lambda: answered(lambda: ack_leased(using, tokens, archived, worker, kept, notes)),
                what="ack_many",
            )

        everyone = {m.pk for m in messages}

        def write() -> set[int]:
            # Every lease holds, almost always: acknowledge without locking first; else roll back and lock.
            try:
                with short_transaction(using):
                    if ack_unlocked(using, tokens, archived, worker, kept, notes):
                        return everyone
                    raise _LeaseMoved
            except _LeaseMoved:
                pass
            with short_transaction(using):
                owned = lock_leased(using, tokens)
                if not owned:
                    return owned
                archive_copies(using, [pk for pk in archived if pk in owned], Outcome.ACKED, worker, kept, notes)
                delete_locked(using, owned)
            return owned

        return with_retries(using, lambda: answered(write), what="ack_many")

    def expire_batch(self, limit: int) -> tuple[list[Message], list[ArchivedMessage]]:
        """Archive, as expired, up to ``limit`` messages past ``expires_at`` that nobody holds."""
        using = self.db

        def run() -> tuple[list[Message], list[ArchivedMessage]]:
            with write_transaction(using):
                rows = list(
                    self.select_for_update(skip_locked=True)
                    .filter(expires_at__lte=DbNow())
                    .filter(Q(lease_token__isnull=True) | Q(available_at__lte=DbNow()))
                    .order_by("expires_at")[:limit]
                )
                if not rows:
                    return [], []
                self.filter(pk__in=[m.pk for m in rows])._raw_delete(using)
                archived = [
                    ArchivedMessage.from_live(m, Outcome.EXPIRED, worker="reaper", error=m.last_error) for m in rows
                ]
                ArchivedMessage.objects.using(using).bulk_create(archived)
                return rows, archived

        return with_retries(using, run, what="expiry")


def _json_bytes(message: Message) -> int:
    """A message's payload and headers as the INSERT writes them (JSON text, non-ASCII escaped), in bytes."""
    return len(message.payload_json()) + (len(json.dumps(message.headers)) if message.headers else 2)


def _has_key_rules(message: Message) -> bool:
    """Whether ``message`` carries a unique window or a debounce, which its key's insert must apply."""
    return (
        getattr(message, "_dbqueue_window", None) is not None or getattr(message, "_dbqueue_debounce", None) is not None
    )


class _Refused(Exception):
    """A unique window refused a message: rolls back what its transaction wrote."""


class _LeaseMoved(Exception):
    """A batch's unlocked acknowledgement found a lease that no longer held: rolls it back."""


# What a debounced enqueue replaces in the waiting message: everything its producer says of it.
DEBOUNCED = ("kind", "group", "payload", "headers", "priority", "max_attempts", "expires_at")

# A message with every field at its default, per model class, that Message.unsaved() copies.
_BLANK: dict[type[Message], Message] = {}

# A named base, so that django-stubs types the manager's queryset methods.
BaseMessageManager = models.Manager.from_queryset(MessageQuerySet)


class MessageManager(BaseMessageManager["Message"]):
    """``Message.objects``: every statement on the live table, also after ``.using(alias)``."""


class Message(ConsumerActions, HandlerReports, models.Model):
    """A live message: ready, scheduled or in flight."""

    id = models.BigAutoField(primary_key=True)
    queue = NameField(max_length=64)
    kind = NameField(max_length=100, blank=True, default="", db_default="")
    key = NameField(max_length=255, null=True, blank=True)  # NULL keys never collide
    # GROUP is a reserved word in SQL: the column is group_key, so plain SQL need not quote it.
    group = NameField(  # NULL: in no group
        max_length=255, null=True, blank=True, db_column="group_key", help_text="Flow control's group (a customer)."
    )
    payload = models.JSONField()
    headers = models.JSONField(default=dict, blank=True)
    priority = models.SmallIntegerField(default=0, db_default=0, help_text="Smaller runs first.")
    available_at = models.DateTimeField(help_text="Claimable from this time; a claim pushes it to the lease's end.")
    first_available_at = models.DateTimeField(help_text="When it first became available; retries keep it.")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    lease_token = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001 (NULL: not leased)
    claimed_by = models.CharField(max_length=255, blank=True, default="", db_default="")
    claimed_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, db_default=0)
    max_attempts = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Empty: the queue's MAX_ATTEMPTS setting."
    )
    deferrals = models.PositiveIntegerField(
        default=0, db_default=0, help_text="Times it was put off (Defer, snooze); capped by MAX_DEFERRALS."
    )
    last_error = models.TextField(blank=True, default="", db_default="")
    replay_of = models.BigIntegerField(null=True, blank=True, help_text="The archived (dead) message this one replays.")
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="When cancel() flagged it while it ran; its worker stops it cooperatively."
    )
    # Written by the worker's heartbeat from set_progress()/update_meta(); NULL until the handler reports.
    progress = models.JSONField(null=True, blank=True, help_text="The handler's last report: done, total, note.")
    meta = models.JSONField(null=True, blank=True, help_text="What the handler recorded with update_meta().")

    objects = MessageManager()

    # Not columns. Set by enqueue (was_created), and by the querysets that
    # annotate them (with_state(), the claim); absent otherwise.
    _dbqueue_created: bool
    # Set by build_message from enqueue's unique= and debounce= (seconds), for insert().
    _dbqueue_window: float | None
    _dbqueue_debounce: float | None

    class Meta:
        app_label = "django_dbqueue"
        db_table = MESSAGE_TABLE
        ordering = ["priority", "available_at", "id"]
        indexes = [
            # Serves the claim: WHERE queue = ? AND available_at <= now
            # ORDER BY priority, available_at, id, walked in index order.
            models.Index(fields=["queue", "priority", "available_at", "id"], name="dbqueue_msg_claim"),
            models.Index(fields=["expires_at"], name="dbqueue_msg_expires"),
            # The reaper: leases that ran out (poison messages), and a dead worker's claims.
            models.Index(fields=["lease_token", "available_at"], name="dbqueue_msg_lease"),
            models.Index(fields=["claimed_by"], name="dbqueue_msg_claimed_by"),
            # The admin's exact search by key, in every queue.
            models.Index(fields=["key"], name="dbqueue_msg_key"),
            # Flow control: a group's oldest message (FIFO groups), a group's rows.
            models.Index(fields=["queue", "group", "id"], name="dbqueue_msg_group"),
        ]
        constraints = [
            # NULL keys never collide, so only keyed messages are deduplicated.
            models.UniqueConstraint(fields=["queue", "key"], name="dbqueue_msg_queue_key"),
        ]
        permissions = [("cancel_message", "Can cancel, run now and release live messages")]

    def __str__(self) -> str:
        # storable_text: NUL visible, as a plain SQL producer may store it in a kind
        return validation.storable_text(f"{self.queue}#{self.pk}" + (f" ({self.kind})" if self.kind else ""))

    @classmethod
    def _without_init(cls, fields: Iterable[tuple[str, Any]], db: str | None = None) -> Message:
        """An instance holding ``fields``, made without Model.__init__: loaded from ``db``, or new when None.

        Model.__init__ was a sixth of a single enqueue's Python time and more
        than half of turning a claimed row into a message (4.4 µs a row against
        1.9); Django's ``pre_init``/``post_init`` are not sent (docs/signals.md).
        """
        message = cls.__new__(cls)
        message.__dict__.update(fields)
        state = message._state = ModelState()
        if db is not None:
            state.adding = False
            state.db = db
        return message

    @classmethod
    def unsaved(cls, **fields: Any) -> Message:
        """A new unsaved message with ``fields``, the others at their defaults: what ``Message(**fields)`` builds.

        Copies the attributes of a blank message made once. ``headers``, the
        one default that is a new object each time, gets its own.
        """
        blank = _BLANK.get(cls)
        if blank is None:
            blank = _BLANK[cls] = cls()
        message = cls._without_init(blank.__dict__.items())
        message.headers = {}
        for name, value in fields.items():
            setattr(message, name, value)
        return message

    @classmethod
    def from_row(cls, using: str, names: list[str], values: list[Any]) -> Message:
        """A message read from database ``using``, its fields ``names`` set to ``values`` (already converted)."""
        return cls._without_init(zip(names, values, strict=True), using)

    def with_payload(self, payload: Any, headers: dict[str, Any]) -> Message:
        """A new unsaved message like this unsaved one, with ``payload`` (validated) and ``headers``.

        Copying the attributes skips Model.__init__, which was a quarter of
        ``enqueue_many``'s time for messages whose other fields are all equal.
        """
        copy = Message.__new__(Message)
        copy.__dict__.update(self.__dict__)
        copy._state = ModelState()
        copy.payload = payload
        copy.keep_payload_json(validation.payload_json(payload))
        copy.headers = headers
        return copy

    def keep_payload_json(self, text: str) -> None:
        """Keep the payload's JSON text that validation made, for the INSERT (see `payload_json`)."""
        self._dbqueue_payload_json = (self.payload, text)

    def payload_json(self) -> str:
        """The payload as the JSON text an INSERT writes: validation's text while the payload is the one it checked."""
        kept: tuple[Any, str] | None = self.__dict__.get("_dbqueue_payload_json")
        if kept is not None and kept[0] is self.payload:
            return kept[1]
        return json.dumps(self.payload)

    @property
    def was_created(self) -> bool:
        """After ``enqueue``: True if the call inserted this message, False if it found its key live."""
        return getattr(self, "_dbqueue_created", False)

    def max_attempts_allowed(self) -> int:
        """The message's own MAX_ATTEMPTS, else its queue's."""
        return self.max_attempts or queue_options(self.queue).max_attempts

    def attempts_left(self) -> bool:
        """Whether another attempt is allowed after this one.

        The one rule for "attempts used up", in Python; `exhausted` is
        the same rule in SQL, for the claim and the reaper.
        """
        return self.attempts < self.max_attempts_allowed()

    def deferral_refused(self) -> str | None:
        """Why one more deferral would pass the queue's MAX_DEFERRALS (the dead letter's reason), else None."""
        cap = queue_options(self.queue).max_deferrals
        if self.deferrals < cap:
            return None
        return f"deferred {self.deferrals} times; the queue's MAX_DEFERRALS is {cap}"

    def defer(self, until: datetime | None = None, *, delay: float | timedelta | None = None) -> bool:
        """Deprecated alias of `snooze` (``defer`` is also the name of Django's ``QuerySet.defer``)."""
        warnings.warn("Message.defer() is deprecated; use Message.snooze()", DeprecationWarning, stacklevel=2)
        return self.snooze(until, delay=delay)
