"""Producing: the checks every producer's messages pass, and the one insert path.

`build_unsaved` validates and builds (`messages.build_message` for
`Message`); `Inserting` writes, one message or a batch, applying a key's
rules (until finished, unique window, debounce) and a FIFO group's turn.
The model is reached through ``self.model``: this module sits below
`messages` and never imports it (it annotates with `protocols`).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from itertools import groupby
from typing import Any, Self

from django.db import IntegrityError

from .. import propagation, validation
from ..conf import database_for, get_settings
from ..db.clock import DbNow, db_now, insert_returns_expressions
from ..db.errors import with_retries
from ..db.transactions import write_transaction
from ..exceptions import InvalidOption, PayloadNotSerializable, UnknownOption
from . import events, flow
from .protocols import Live, LiveMessage
from .statements import headers_json, insert_alike, insert_message, insert_messages, statement_chunks
from .states import StateReads

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


def build_unsaved(model: type[Live], queue: str, payload: Any, options: dict[str, Any]) -> tuple[Live, float | None]:
    """Validate one message's options and build it (unsaved), a ``model``. Returns it and its delay.

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
    message = model.unsaved(
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


class Inserting(StateReads[Live]):
    """The insert path of every producer (enqueue, enqueue_many, publish, the outbox, Tasks, schedules, replay)."""

    def enqueue(self, queue: str, payload: Any, **options: Any) -> Live:
        """Validate, insert and announce one message; see `django_dbqueue.enqueue`."""
        message, delay = build_unsaved(self.model, queue, payload, options)
        using = database_for(queue, options.get("using") or (self.db if self.chosen_db() else None))
        self.insert_into(using, message, delay)
        events.enqueued([message], using)
        return message

    def enqueue_many(self, queue: str, payloads: Iterable[Any], **options: Any) -> list[Live]:
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
            build_unsaved(self.model, queue, {}, options)  # bad options are refused with no payloads too
            return []
        # The options are the same for every payload: checked once, on the first message.
        first, delay = build_unsaved(self.model, queue, payloads[0], options)
        if len(payloads) == 1:
            return self.using(using).insert_built([(first, delay)])
        headers = options.get("headers") or {}  # checked by build_unsaved, with or without hooks
        # Each message its own trace context where hooks add one (docs/tracing.md), checked as the first's:
        # the hooks are user code, run once per message, never while a statement is in flight.
        own = [message_headers(queue, first.kind, headers) for _ in payloads[1:]] if propagation.hooks else None
        on, rest = self.using(using), payloads[1:]
        result = with_retries(using, lambda: on._insert_alike(first, delay, rest, own), what="enqueue_many")
        events.enqueued(result, using)
        return result

    def insert_built(self, pending: list[tuple[Live, float | None]]) -> list[Live]:
        """Insert built messages (with their delays) and announce the ones this call created."""
        if not pending:
            return []
        result = self.insert_many(pending)
        events.enqueued(result, self.db)
        return result

    def insert(self, message: Live, delay: float | None) -> Live:
        """Insert one built, validated message (its times from the database clock): see `insert_into`."""
        return self.insert_into(self.db, message, delay)

    def insert_into(self, using: str, message: Live, delay: float | None) -> Live:
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

        def insert() -> bool:
            if message.key is None:  # the common case, in one hand-written statement
                insert_message(using, message, None if scheduled else delay or 0)
                return True
            on = self.using(using)
            returned = insert_returns_expressions(using)
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

    def _insert_keyed_one(self, message: LiveMessage, now: datetime | DbNow) -> bool:
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

    def _adopt(self, message: LiveMessage, live: LiveMessage) -> None:
        """Make ``message`` (this call's, unsaved) the live one it ran into: the caller gets what is in the table."""
        message.__dict__.update({k: v for k, v in live.__dict__.items() if k != "_state"})
        message._state.adding = False
        message._state.db = self.db

    def _insert_in_window(self, message: LiveMessage, window: float) -> bool:
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

    def _debounce(self, message: LiveMessage, seconds: float, now: datetime | DbNow) -> bool:
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
            if (
                waiting.filter(group=message.group).update(
                    **mine, available_at=due, first_available_at=due, held_priority=None
                )
                == 1
            ):
                live = self.filter(queue=message.queue, key=message.key).first()
                if live is not None:
                    self._adopt(message, live)
                    return False
                continue  # run now, or cancelled, in between: start again
            if self._move_group(waiting, message, mine, due):
                return False
            fresh = self.model(queue=message.queue, key=message.key, created_at=message.created_at, **mine)
            fresh.available_at = fresh.first_available_at = due
            created = self._insert_or_get(fresh)
            if created or fresh.lease_token is not None or fresh.attempts > 0:
                self._adopt(message, fresh)
                return created
            # Another producer inserted it first: replace its payload on the next turn.
        raise IntegrityError(f"could not debounce key {message.key!r} in queue {message.queue!r} after 10 tries")

    def _move_group(self, waiting: Self, message: LiveMessage, mine: dict[str, Any], due: Any) -> bool:
        """Replace the key's waiting message of another group by a new row (a new id); False when there is none.

        One transaction: the old row is deleted and the new one inserted
        under the same key, so the key never has two messages, nor none.
        """
        using = self.db
        with write_transaction(using):
            old = list(waiting.exclude(group=message.group).select_for_update().values_list("pk", flat=True))
            if not old or self.filter(pk__in=old)._raw_delete(using) != 1:
                return False  # nothing waiting (taken, finished or replaced in between): the caller goes on
            fresh = self.model(queue=message.queue, key=message.key, created_at=message.created_at, **mine)
            fresh.available_at = fresh.first_available_at = due
            fresh.save(using=using, force_insert=True)
        self._adopt(message, fresh)
        message._state.adding = False
        return True

    def _insert_or_get(self, message: LiveMessage) -> bool:
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

    def insert_many(self, pending: list[tuple[Live, float | None]]) -> list[Live]:
        """Insert built messages (with their delays), keyed or not, of one or more queues.

        One transaction, multi-row inserts, retried on the database's weather.
        Returns, in order, each message or, where its key was live, the live one.
        """
        if len(pending) == 1:  # one INSERT that returns its id on every database
            return [self.insert(*pending[0])]
        # A keyed message that ran into its key's live one becomes that one (`_adopt`): each try starts
        # again from the messages as built, or a retry would insert a copy of another producer's message.
        keyed = [message for message, _ in pending if message.key is not None]
        built = [(dict(message.__dict__), copy.copy(message._state)) for message in keyed]

        def attempt() -> list[Live]:
            for message, (fields, state) in zip(keyed, built, strict=True):
                message.__dict__.clear()
                message.__dict__.update(fields)
                message._state = copy.copy(state)
            return self._insert_many(pending)

        return with_retries(self.db, attempt, what="enqueue_many")

    def _insert_alike(
        self, first: Live, delay: float | None, payloads: list[Any], own_headers: list[dict[str, Any]] | None
    ) -> list[Live]:
        """``enqueue_many``'s insert, in one transaction: ``first`` (unkeyed) and a copy of it for each of
        ``payloads``, checked as they are written (`insert_alike`)."""
        using = self.db
        _timed(first, db_now(using), delay, {})
        with write_transaction(using):
            if first.group is not None and flow.takes_turns(using, first.queue):
                flow.take_turns(using, first.queue, {first.group})
            messages = insert_alike(using, first, payloads, get_settings().enqueue_batch_size, own_headers)
        for message in messages:
            message._dbqueue_created = True
        return messages  # type: ignore[return-value]  # copies of ``first``, a Live

    def _insert_many(self, pending: list[tuple[Live, float | None]]) -> list[Live]:
        """`insert_many` in one transaction: the messages written in the order given.

        The order is the ids' order, which a FIFO group runs by and which
        decides which of two messages with one key takes it; so the messages
        go in runs of alike ones (unkeyed, keyed, keyed with rules), each run
        written at once, one run after the other.
        """
        using = self.db
        batch = get_settings().enqueue_batch_size
        now = db_now(using)
        due: dict[float | None, datetime] = {}  # by delay: the messages of one call mostly share one
        turns: dict[str, set[str]] = defaultdict(set)
        for message, delay in pending:  # one pass over what may be many thousands
            _timed(message, now, delay, due)
            if message.group is not None and flow.takes_turns(using, message.queue):
                turns[message.queue].add(message.group)
        result: list[Live] = []
        taken: set[tuple[str, str]] = set()  # keys a message of this call created
        with write_transaction(using):
            for queue, groups in sorted(turns.items()):
                flow.take_turns(using, queue, groups)
            for alike, run in groupby((message for message, _ in pending), key=_insert_rule):
                messages = list(run)
                if alike == "plain":
                    insert_messages(using, messages, batch)
                    for message in messages:
                        message._dbqueue_created = True
                    result += messages
                elif alike == "ruled":
                    for message in messages:
                        message._dbqueue_created = self._insert_keyed_one(message, now)
                        if message._dbqueue_created:
                            taken.add((message.queue, message.key))  # type: ignore[arg-type]  # keyed
                    result += messages
                else:
                    result += self._insert_keyed_run(messages, batch, now, taken)
        return result

    def _insert_keyed_run(
        self, messages: list[Live], batch: int, now: datetime, taken: set[tuple[str, str]]
    ) -> list[Live]:
        """Insert keyed messages (no rules) whose key is not live; return, for each, its key's live row.

        A row is this call's (``was_created``) if it carries this call's
        enqueue time and the message's payload, for the first message of its
        key only: the others ran into it. ``taken``: the keys of the call's
        messages created so far, updated.
        """
        live = self._insert_keyed(messages, batch)
        result = []
        for message in messages:
            assert message.key is not None  # keyed messages only
            name = (message.queue, message.key)
            row = live[name]
            if name not in taken and row.created_at == now and row.payload == message.payload:
                taken.add(name)
                row._dbqueue_created = True
                result.append(row)
            else:  # the key's live message, another's or an earlier one of this call
                self._adopt(message, row)
                message._dbqueue_created = False
                result.append(message)
        return result

    def _insert_keyed(self, keyed: list[Live], batch: int) -> dict[tuple[str, str | None], Live]:
        """Insert keyed messages whose key is not live; return the live row of every key.

        A live message with one of these keys may finish (and its delete
        commit) between our INSERT, which skipped the key, and our read,
        which then no longer finds it: such keys are inserted again, a
        bounded number of times.
        """
        live: dict[tuple[str, str | None], Live] = {}
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


def _timed(message: LiveMessage, now: datetime, delay: float | None, due: dict[float | None, datetime]) -> None:
    """Set an unsaved message's enqueue time to ``now``, and its due time ``delay`` later unless it has one
    (``run_at``); ``due``: the due times of the call so far, by delay (its messages mostly share one)."""
    message.created_at = now
    if message.available_at is None:
        if delay not in due:
            due[delay] = now + timedelta(seconds=delay or 0)
        message.available_at = message.first_available_at = due[delay]


def _json_bytes(message: LiveMessage) -> int:
    """A message's payload and headers as the INSERT writes them (JSON text, non-ASCII escaped), in bytes."""
    return len(message.payload_json()) + len(headers_json(message))


def _insert_rule(message: LiveMessage) -> str:
    """How `Inserting._insert_many` writes ``message``: "plain" (no key), "keyed", or "ruled" (a key with a
    unique window or a debounce, applied one message at a time)."""
    if message.key is None:
        return "plain"
    return "ruled" if _has_key_rules(message) else "keyed"


def _has_key_rules(message: LiveMessage) -> bool:
    """Whether ``message`` carries a unique window or a debounce, which its key's insert must apply."""
    return (
        getattr(message, "_dbqueue_window", None) is not None or getattr(message, "_dbqueue_debounce", None) is not None
    )


class _Refused(Exception):
    """A unique window refused a message: rolls back what its transaction wrote."""


# What a debounced enqueue replaces in the waiting message: everything its producer says of it.
DEBOUNCED = ("kind", "group", "payload", "headers", "priority", "max_attempts", "expires_at")
