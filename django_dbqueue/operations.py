"""The queue operations: enqueue, claim, acknowledge, fail, and the rest.

Every state change of an in-flight message is guarded by its lease token
(``WHERE id = ? AND lease_token = ?``): a worker whose lease ran out and was
taken over changes nothing, and the operation returns ``False``. Times come
from the database's clock (:class:`~django_dbqueue.vendor.DbNow`). Each
operation is one short transaction, retried on deadlocks and dropped
connections (:mod:`django_dbqueue.transient`).
"""

from __future__ import annotations

import os
import random
import socket
import traceback
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError
from django.db.models import F, Q

from . import signals, validation
from .conf import get_settings, queue_options
from .exceptions import InvalidOption, NotClaimed, UnknownOption
from .models import ArchivedMessage, Message, Outcome
from .sql import archive_copies, insert_messages
from .transient import with_retries
from .vendor import DbNow, db_now, insert_returns_expressions, write_transaction

ENQUEUE_OPTIONS = frozenset(
    {"kind", "key", "delay", "run_at", "priority", "headers", "max_attempts", "expires_at", "using"}
)


def default_worker_name() -> str:
    """How a claim names its worker when the caller does not: host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


# --- producing -------------------------------------------------------------


def build_message(queue: str, payload: Any, options: dict[str, Any]) -> tuple[Message, float | None]:
    """Validate one message's options and build it (unsaved). Returns it and its delay."""
    unknown = set(options) - ENQUEUE_OPTIONS
    if unknown:
        raise UnknownOption(
            f"unknown enqueue option(s) {', '.join(sorted(map(repr, unknown)))}; "
            f"known: {', '.join(sorted(ENQUEUE_OPTIONS))}"
        )
    delay = options.get("delay")
    run_at = validation.aware_datetime(options.get("run_at"), "run_at")
    if delay is not None and run_at is not None:
        raise InvalidOption("give delay or run_at, not both")
    message = Message(
        queue=validation.validate_queue_name(queue),
        payload=validation.validate_payload(payload),
        kind=validation.validate_kind(options.get("kind", "")),
        key=validation.validate_key(options.get("key")),
        headers=validation.validate_headers(options.get("headers")),
        priority=validation.validate_priority(options.get("priority", 0)),
        max_attempts=validation.validate_max_attempts(options.get("max_attempts")),
        expires_at=validation.aware_datetime(options.get("expires_at"), "expires_at"),
    )
    if run_at is not None:
        message.available_at = message.first_available_at = run_at
    return message, None if delay is None else validation.seconds(delay, "delay")


def _database(queue: str, using: str | None) -> str:
    return using or queue_options(queue).database


def enqueue(queue: str, payload: Any, **options: Any) -> Message:
    """Add one message to ``queue`` and return it.

    Options: ``kind``, ``key``, ``delay`` (seconds or timedelta), ``run_at``,
    ``priority`` (smaller first), ``headers``, ``max_attempts``,
    ``expires_at``, ``using``. With a ``key`` already live in the queue,
    nothing is inserted and the live message is returned (its
    ``was_created`` is False).

    Inside the caller's transaction, the message commits or rolls back with it.
    """
    message, delay = build_message(queue, payload, options)
    using = _database(queue, options.get("using"))
    insert_message(message, delay, using)
    announce_enqueued([message], using)
    return message


def announce_enqueued(messages: list[Message], using: str) -> None:
    """Send ``message_enqueued`` for each message this call inserted (after commit)."""
    if signals.listened(signals.message_enqueued):
        events = [{"message": m, "queue": m.queue} for m in messages if m.was_created]
        signals.send(signals.message_enqueued, using, events)


def insert_message(message: Message, delay: float | None, using: str) -> Message:
    """Insert a built message (see :func:`enqueue`), its times from the database clock.

    Where the INSERT can return the times it computed, it does; elsewhere the
    clock is read before the INSERT, never read back after it: a worker may
    take the message the moment it commits (a request's reply), and then
    there is no row left to read.
    """
    scheduled = message.available_at is not None  # run_at was given
    returned = insert_returns_expressions(using)

    def insert() -> bool:
        now = DbNow() if returned else db_now(using)
        message.created_at = now
        if not scheduled:
            later = DbNow(delay or 0) if returned else now + timedelta(seconds=delay or 0)
            message.available_at = message.first_available_at = later
        if message.key is None:
            message.save(using=using, force_insert=True)
            return True
        return _insert_or_get(message, using)

    message._dbqueue_created = with_retries(using, insert, what="enqueue")
    return message


def _insert_or_get(message: Message, using: str) -> bool:
    """Insert a keyed message unless its key is live; the unique index decides races.

    Returns whether this call inserted it. Otherwise ``message`` becomes the
    live message with that key.
    """
    for _ in range(10):
        try:
            with write_transaction(using):
                message.save(using=using, force_insert=True)
            return True
        except IntegrityError:
            message.pk = None
            live = Message.objects.using(using).filter(queue=message.queue, key=message.key).first()
            if live is not None:
                message.__dict__.update({k: v for k, v in live.__dict__.items() if k != "_state"})
                message._state.adding = False
                message._state.db = using
                return False
            # The live one finished between our insert and our read: try again.
    raise IntegrityError(f"could not insert or find key {message.key!r} in queue {message.queue!r}")


def enqueue_many(queue: str, payloads: Iterable[Any], **options: Any) -> list[Message]:
    """Add many messages to ``queue`` in multi-row inserts, all in one transaction.

    Takes the options of :func:`enqueue`, the same for every message. Keyed
    messages whose key is live already are not inserted; the live message is
    returned in their place. On MySQL (not MariaDB) the ids of new messages
    are not returned by the database and stay ``None``.
    """
    options = dict(options)
    using = _database(queue, options.get("using"))
    payloads = list(payloads)
    if options.get("key") is not None and len(payloads) > 1:
        raise InvalidOption("one key for many payloads would keep only the first; give keys one by one with enqueue()")
    messages = []
    delay = None
    for payload in payloads:
        message, delay = build_message(queue, payload, options)
        messages.append(message)
    if not messages:
        return []
    result = insert_many([(message, delay) for message in messages], using)
    announce_enqueued(result, using)
    return result


def insert_many(pending: list[tuple[Message, float | None]], using: str) -> list[Message]:
    """Insert built messages (with their delays), keyed or not, of one or more queues.

    One transaction, multi-row inserts, retried on the database's weather.
    Returns, in order, each message or, where its key was live, the live one.
    """
    if len(pending) == 1:  # one INSERT that returns its id on every database
        return [insert_message(*pending[0], using)]
    return with_retries(using, lambda: _insert_many(pending, using), what="enqueue_many")


def _insert_many(pending: list[tuple[Message, float | None]], using: str) -> list[Message]:
    batch = get_settings().enqueue_batch_size
    now = db_now(using)
    messages = []
    for message, delay in pending:
        message.created_at = now
        if message.available_at is None:
            message.available_at = message.first_available_at = now + timedelta(seconds=delay or 0)
        messages.append(message)
    with write_transaction(using):
        plain = [m for m in messages if m.key is None]
        insert_messages(using, plain, batch)
        for message in plain:
            message._dbqueue_created = True
        keyed = [m for m in messages if m.key is not None]
        if not keyed:
            return messages
        Message.objects.using(using).bulk_create(keyed, batch_size=batch, ignore_conflicts=True)
        live = {}
        by_queue: dict[str, set[str]] = defaultdict(set)
        for message in keyed:
            by_queue[message.queue].add(message.key)
        for queue, key_set in sorted(by_queue.items()):
            keys = sorted(key_set)
            for start in range(0, len(keys), batch):
                for row in Message.objects.using(using).filter(queue=queue, key__in=keys[start : start + batch]):
                    live[(queue, row.key)] = row
        result = []
        for message in messages:
            if message.key is None:
                result.append(message)
                continue
            row = live[(message.queue, message.key)]
            # Ours if the row carries this call's enqueue time and payload.
            row._dbqueue_created = row.created_at == now and row.payload == message.payload
            result.append(row)
        return result


# --- consuming -------------------------------------------------------------


def claim(
    queues: str | Iterable[str],
    limit: int = 1,
    *,
    visibility_timeout: float | timedelta | None = None,
    worker: str | None = None,
) -> list[Message]:
    """Lease up to ``limit`` ready messages from ``queues``, in one short transaction.

    Queues listed first are served first; inside a queue, smaller priority
    first, then oldest. Each claimed message gets a fresh lease token, its
    ``available_at`` moves to the end of the lease, and ``attempts`` grows by
    one. Nothing is held open after this returns.
    """
    names = validation.validate_queues(queues if isinstance(queues, str) else list(queues))
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidOption(f"limit must be a positive integer, not {limit!r}")
    timeout = (
        None
        if visibility_timeout is None
        else validation.seconds(visibility_timeout, "visibility_timeout", allow_zero=False)
    )
    databases = {queue_options(name).database for name in names}
    if len(databases) > 1:
        raise InvalidOption(
            f"queues {names} live on different databases ({sorted(databases)}); claim from each separately"
        )
    using = databases.pop()
    worker = worker or default_worker_name()
    claimed = with_retries(using, lambda: _claim(names, limit, timeout, worker, using), what="claim")
    if claimed and signals.listened(signals.message_claimed):
        events = [{"message": m, "queue": m.queue, "worker": worker} for m in claimed]
        signals.send(signals.message_claimed, using, events)
    return claimed


def _claim(names: list[str], limit: int, timeout: float | None, worker: str, using: str) -> list[Message]:
    claimed: list[Message] = []
    with write_transaction(using):
        for name in names:
            wanted = limit - len(claimed)
            if wanted <= 0:
                break
            claimed += list(
                Message.objects.using(using)
                .select_for_update(skip_locked=True)
                .filter(queue=name)
                .claimable(queue_options(name).max_attempts)
                .annotate(db_now=DbNow())
                .order_by("priority", "available_at", "id")[:wanted]
            )
        if not claimed:
            return []
        now = claimed[0].db_now
        token = uuid.uuid4().hex
        by_timeout: dict[float, list[int]] = defaultdict(list)
        for message in claimed:
            by_timeout[timeout or queue_options(message.queue).visibility_timeout].append(message.pk)
        for seconds, ids in by_timeout.items():
            Message.objects.using(using).filter(pk__in=ids).update(
                lease_token=token,
                available_at=now + timedelta(seconds=seconds),
                claimed_at=now,
                claimed_by=worker,
                attempts=F("attempts") + 1,
            )
    for message in claimed:
        seconds = timeout or queue_options(message.queue).visibility_timeout
        message.lease_token = token
        message.available_at = now + timedelta(seconds=seconds)
        message.claimed_at = now
        message.claimed_by = worker
        message.attempts += 1
    return claimed


def _leased(message: Message) -> Any:
    """The queryset that matches ``message`` only while we hold its lease."""
    if message.pk is None or not message.lease_token:
        raise NotClaimed(f"message {message.pk} is not claimed (it has no lease token); claim it first")
    # A lease that ran out is lost even before another worker claims the message:
    # the reaper or a new claim may act on it at any moment.
    return Message.objects.using(message._state.db).filter(
        pk=message.pk, lease_token=message.lease_token, available_at__gt=DbNow()
    )


def error_text(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        return "".join(traceback.format_exception(error))
    return str(error)


def archive_row(
    message: Message, outcome: str, *, worker: str = "", error: str | None = None, result: Any = None
) -> ArchivedMessage:
    """The archive row for ``message`` finishing with ``outcome`` (unsaved)."""
    return ArchivedMessage(
        message_id=message.pk,
        queue=message.queue,
        kind=message.kind,
        key=message.key,
        payload=message.payload,
        headers=message.headers,
        priority=message.priority,
        created_at=message.created_at,
        first_available_at=message.first_available_at,
        claimed_at=message.claimed_at,
        finished_at=DbNow(),
        expires_at=message.expires_at,
        attempts=message.attempts,
        max_attempts=message.max_attempts,
        outcome=outcome,
        finished_by=worker or message.claimed_by,
        last_error=message.last_error if error is None else error,
        result=result if validation.json_problem(result, "result") is None else None,
        replay_of=message.replay_of,
    )


def _finish(message: Message, outcome: str, *, leased: Any = None, **row: Any) -> bool:
    """Delete a message and archive it, atomically. False if it was not there to delete.

    ``leased`` defaults to "only while we hold the lease"; operators' actions
    pass a queryset matching the message by id alone.
    """
    leased = _leased(message) if leased is None else leased
    using = message._state.db
    archived: list[ArchivedMessage] = []

    def run() -> bool:
        archived.clear()
        with write_transaction(using):
            # _raw_delete: one DELETE, no collector SELECT (nothing cascades from messages).
            if leased._raw_delete(using) != 1:
                return False
            if outcome != Outcome.ACKED or queue_options(message.queue).archive:
                archived.append(archive_row(message, outcome, **row))
                archived[0].save(using=using, force_insert=True)
            return True

    done = with_retries(using, run, what=f"{outcome} message {message.pk}")
    if done:
        _announce_finished(message, outcome, archived[0] if archived else None, using, row)
    return done


FINISH_SIGNALS = {
    Outcome.ACKED: signals.message_acked,
    Outcome.DEAD: signals.message_dead_lettered,
    Outcome.EXPIRED: signals.message_expired,
    Outcome.CANCELLED: signals.message_cancelled,
}


def _announce_finished(
    message: Message, outcome: str, archived: ArchivedMessage | None, using: str, row: dict[str, Any]
) -> None:
    signal = FINISH_SIGNALS[outcome]
    if not signals.listened(signal):
        return
    event: dict[str, Any] = {
        "message": message,
        "queue": message.queue,
        "archived": signals.settle([archived], using)[0] if archived else None,
    }
    if outcome == Outcome.ACKED:
        event.update(result=row.get("result"), worker=row.get("worker") or message.claimed_by)
    elif outcome == Outcome.DEAD:
        event["error"] = message.last_error if row.get("error") is None else row["error"]
    elif outcome == Outcome.CANCELLED:
        event["by"] = row.get("worker", "")
    signals.send(signal, using, [event])


def ack(message: Message, *, worker: str | None = None, result: Any = None) -> bool:
    """Finish ``message`` successfully: archived as acked (unless archiving is off) and deleted.

    ``result`` (the handler's return value) is kept in the archive when it is JSON.
    """
    return _finish(message, Outcome.ACKED, worker=worker or "", result=result)


def ack_many(
    messages: Iterable[Message], *, worker: str | None = None, results: Mapping[int, Any] | None = None
) -> list[bool]:
    """Acknowledge a batch in one transaction; returns, per message, whether its lease still held.

    ``results`` maps message ids to their handlers' return values, kept in the archive.
    """
    messages = list(messages)
    by_db: dict[str, list[Message]] = defaultdict(list)
    for message in messages:
        _leased(message)
        by_db[message._state.db].append(message)
    owned: set[int] = set()
    for using, group in by_db.items():
        acked = with_retries(
            using,
            lambda using=using, group=group: _ack_group(group, worker or "", results or {}, using),
            what="ack_many",
        )
        owned |= acked
        if acked and signals.listened(signals.message_acked):
            # The rows were copied inside the database: read them back, only for listeners.
            stored = ArchivedMessage.objects.using(using).filter(message_id__in=acked, outcome=Outcome.ACKED)
            rows_by_id = {row.message_id: row for row in stored.order_by("id")}
            events = [
                {
                    "message": m,
                    "queue": m.queue,
                    "archived": rows_by_id.get(m.pk),
                    "result": (results or {}).get(m.pk),
                    "worker": worker or m.claimed_by,
                }
                for m in group
                if m.pk in acked
            ]
            signals.send(signals.message_acked, using, events)
    return [message.pk in owned for message in messages]


def _ack_group(messages: list[Message], worker: str, results: Mapping[int, Any], using: str) -> set[int]:
    tokens: dict[str, list[int]] = defaultdict(list)
    for message in messages:
        tokens[message.lease_token].append(message.pk)
    match = Q()
    for token, ids in tokens.items():
        match |= Q(lease_token=token, pk__in=ids)
    with write_transaction(using):
        owned = set(Message.objects.using(using).select_for_update().filter(match).values_list("pk", flat=True))
        if not owned:
            return owned
        archived = [m.pk for m in messages if m.pk in owned and queue_options(m.queue).archive]
        archive_copies(using, archived, Outcome.ACKED, worker, results)
        Message.objects.using(using).filter(pk__in=owned)._raw_delete(using)
    return owned


def _update_leased(message: Message, what: str, **changes: Any) -> bool:
    using = message._state.db
    leased = _leased(message)
    return with_retries(using, lambda: leased.update(**changes) == 1, what=f"{what} message {message.pk}")


def backoff_delay(message: Message) -> float:
    """Seconds before retry number ``attempts``: exponential, capped, with jitter."""
    options = queue_options(message.queue)
    delay = min(options.backoff_max, options.backoff_base * 2 ** max(message.attempts - 1, 0))
    return delay * (1 + random.uniform(-options.backoff_jitter, options.backoff_jitter)) if delay else 0.0


def attempts_left(message: Message) -> bool:
    return message.attempts < (message.max_attempts or queue_options(message.queue).max_attempts)


def fail(message: Message, error: BaseException | str, *, retry: bool = True) -> bool:
    """Record a failed attempt: back in the queue after a backoff, or dead when none are left."""
    text = error_text(error)
    if retry and attempts_left(message):
        delay = backoff_delay(message)
        if _update_leased(message, "fail", lease_token=None, available_at=DbNow(delay), last_error=text):
            message.lease_token = None
            message.last_error = text
            _announce_failed(message, text, delay)
            return True
        return False
    message.last_error = text
    return _finish(message, Outcome.DEAD, error=text)


def reject(message: Message, *, requeue: bool = True, delay: float | timedelta | None = None, reason: str = "") -> bool:
    """Give the message up: back in the queue (after ``delay``), or dead-lettered with ``reason``."""
    seconds = validation.seconds(delay or 0, "delay")
    if not requeue:
        return _finish(message, Outcome.DEAD, error=reason or "rejected")
    changes: dict[str, Any] = {"lease_token": None, "available_at": DbNow(seconds)}
    if reason:
        changes["last_error"] = reason
    done = _update_leased(message, "reject", **changes)
    if done:
        _announce_failed(message, reason or message.last_error, seconds)
    return done


def _announce_failed(message: Message, error: str, delay: float) -> None:
    if signals.listened(signals.message_failed):
        event = {"message": message, "queue": message.queue, "error": error, "delay": delay}
        signals.send(signals.message_failed, message._state.db, [event])


def defer(message: Message, *, until: datetime | None = None, delay: float | timedelta | None = None) -> bool:
    """Put the message off to a later time without counting the attempt as a failure."""
    if (until is None) == (delay is None):
        raise InvalidOption("defer needs exactly one of until or delay")
    when = validation.aware_datetime(until, "until") if until is not None else DbNow(validation.seconds(delay, "delay"))
    return _update_leased(message, "defer", lease_token=None, available_at=when, attempts=F("attempts") - 1)


def extend_lease(message: Message, seconds: float | timedelta) -> bool:
    """Push the lease's end to ``seconds`` from now (database clock). False if the lease was lost."""
    amount = validation.seconds(seconds, "seconds", allow_zero=False)
    return _update_leased(message, "extend lease of", available_at=DbNow(amount))


def release(message: Message) -> bool:
    """Give the message back unprocessed: ready at once, and the claim's attempt is not counted."""
    done = _update_leased(
        message, "release", lease_token=None, available_at=DbNow(), claimed_by="", attempts=F("attempts") - 1
    )
    if done:
        message.lease_token = None
    return done
