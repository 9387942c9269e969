"""The public queue operations: enqueue, claim, acknowledge, fail, and the rest.

A thin facade over the model layer (`django_dbqueue.models`), which
owns every statement and its rules: input checks that refuse bad values
before anything is written, the lease guard, the database clock, bounded
retries of the database's weather, and the lifecycle signals. These
functions exist so that callers can write ``enqueue(...)`` and
``ack(message)`` without reaching for a manager.

The producers have async twins (`aenqueue`, `aenqueue_many`): the sync
function itself, run by ``sync_to_async(thread_sensitive=True)``, so that
they take the same insert path and share the thread, the connection and
any transaction of the caller's other thread-sensitive sync code.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async

from .models import Message, events
from .models.consuming import backoff_delay, error_text
from .models.messages import ENQUEUE_OPTIONS, build_message, default_worker_name

__all__ = [
    "ENQUEUE_OPTIONS",
    "ack",
    "ack_many",
    "aenqueue",
    "aenqueue_many",
    "attempts_left",
    "backoff_delay",
    "build_message",
    "claim",
    "default_worker_name",
    "defer",
    "enqueue",
    "enqueue_built",
    "enqueue_many",
    "error_text",
    "extend_lease",
    "fail",
    "finish",
    "reject",
    "release",
    "snooze",
]


def enqueue(queue: str, payload: Any, **options: Any) -> Message:
    """Add one message to ``queue`` and return it.

    Options: ``kind``, ``key``, ``delay`` (seconds or timedelta), ``run_at``,
    ``priority`` (smaller first), ``headers``, ``max_attempts``,
    ``expires_at``, ``using``. With a ``key`` already live in the queue,
    nothing is inserted and the live message is returned (its
    ``was_created`` is False).

    Inside the caller's transaction, the message commits or rolls back with it.
    """
    return Message.objects.enqueue(queue, payload, **options)


def enqueue_many(queue: str, payloads: Iterable[Any], **options: Any) -> list[Message]:
    """Add many messages to ``queue`` in multi-row inserts, all in one transaction.

    Takes the options of `enqueue`, the same for every message. Keyed
    messages whose key is live already are not inserted; the live message is
    returned in their place. On MySQL (not MariaDB) the ids of new messages
    are not returned by the database and stay ``None``.
    """
    return Message.objects.enqueue_many(queue, payloads, **options)


async def aenqueue(queue: str, payload: Any, **options: Any) -> Message:
    """`enqueue` from async code (an async view, an ASGI consumer): the same options, checks and errors.

    Runs `enqueue` in Django's thread for sync code (thread-sensitive), on
    that thread's connection: in autocommit the message commits at once.
    """
    return await sync_to_async(enqueue, thread_sensitive=True)(queue, payload, **options)


async def aenqueue_many(queue: str, payloads: Iterable[Any], **options: Any) -> list[Message]:
    """`enqueue_many` from async code, run as `aenqueue` runs `enqueue`: one multi-row insert."""
    return await sync_to_async(enqueue_many, thread_sensitive=True)(queue, payloads, **options)


def enqueue_built(pending: list[tuple[Message, float | None]], using: str) -> list[Message]:
    """Insert messages made by `build_message` (with their delays) and announce them.

    The one path from built messages to rows and ``message_enqueued``:
    ``enqueue_many``, ``publish`` and the outbox all take it.
    """
    return Message.objects.using(using).insert_built(pending)


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
    return Message.objects.claim(queues, limit, visibility_timeout=visibility_timeout, worker=worker)


def ack(message: Message, *, worker: str | None = None, result: Any = None) -> bool | None:
    """Finish ``message`` successfully: archived as acked (unless ARCHIVE is off) and deleted.

    False, changing nothing, if the lease was lost. None when it cannot be
    known: on a queue with ARCHIVE off, after a lost reply, the message is
    gone and nothing says whether this ack took it away (docs/reliability.md).

    ``result`` (the handler's return value) is kept in the archive when it is JSON.
    """
    return message.ack(worker=worker, result=result)


def ack_many(
    messages: Iterable[Message], *, worker: str | None = None, results: Mapping[int, Any] | None = None
) -> list[bool | None]:
    """Acknowledge a batch in one transaction per database; returns, per message, whether its lease held.

    A lease that ran out is refused, exactly as by `ack`, and an answer that
    cannot be known is None, as `ack`'s. ``results`` maps message ids to
    their handlers' return values, kept in the archive.
    """
    return Message.objects.ack_many(messages, worker=worker, results=results)


def fail(message: Message, error: BaseException | str, *, retry: bool = True) -> bool:
    """Record a failed attempt: back in the queue after a backoff, or dead when none are left.

    False, changing nothing, if the lease was lost.
    """
    return message.fail(error, retry=retry)


def reject(message: Message, *, requeue: bool = True, delay: float | timedelta | None = None, reason: str = "") -> bool:
    """Give the message up: back in the queue (after ``delay``), or dead-lettered with ``reason``.

    False, changing nothing, if the lease was lost.
    """
    return message.reject(requeue=requeue, delay=delay, reason=reason)


def snooze(message: Message, *, until: datetime | None = None, delay: float | timedelta | None = None) -> bool:
    """Put the message off to ``until`` or by ``delay`` without using an attempt; False if the lease was lost."""
    return message.snooze(until, delay=delay)


def defer(message: Message, *, until: datetime | None = None, delay: float | timedelta | None = None) -> bool:
    """Deprecated alias of `snooze`."""
    warnings.warn("operations.defer() is deprecated; use snooze()", DeprecationWarning, stacklevel=2)
    return message.snooze(until, delay=delay)


def extend_lease(message: Message, seconds: float | timedelta) -> bool:
    """Push the lease's end to ``seconds`` from now (database clock); False if the lease was lost."""
    return message.extend_lease(seconds)


def release(message: Message) -> bool:
    """Give the message back unprocessed: it keeps its place and the attempt is not counted.

    False, changing nothing, if the lease was lost.
    """
    return message.release()


def attempts_left(message: Message) -> bool:
    """Whether ``message`` may run again after this attempt."""
    return message.attempts_left()


def finish(message: Message, outcome: str, *, match: str = "lease", **row: Any) -> bool | None:
    """Archive ``message`` as ``outcome`` and announce it; False if it was gone (or no longer matched),
    None for an ack whose answer cannot be known (as `ack`'s).

    ``match`` says which row may be finished: ``"lease"`` (the caller's lease,
    still running), ``"token"`` (the lease token as read, even if it ran out:
    the reaper), ``"id"`` (whoever holds it: operators).
    """
    done, archived = Message.objects.using(message._state.db or "default").finish(message, outcome, match, **row)
    if done:
        events.finished(message, outcome, archived, row)
    return done
