"""Operators' controls: replay and purge dead letters, cancel, run now, release, pause.

Unlike the consumer operations these act on a message by id, whoever holds
its lease: they are for people fixing a queue (the admin, scripts), and each
is one short transaction that changes nothing when its precondition fails.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from asgiref.sync import sync_to_async

from . import signals, validation
from .db.errors import with_retries
from .exceptions import DbQueueError, InvalidOption
from .models import ArchivedMessage, Message, Outcome, QueueState, events, workflows
from .operations import build_message, finish


def replay(archived: ArchivedMessage, *, by: str = "", payload: Any = None, force: bool = False) -> Message:
    """Enqueue a dead (or expired, cancelled) message again as a new ready message.

    Attempts start from zero. The archived row records when, by whom, and as
    which message it was replayed; a second replay of the same row is refused
    unless ``force``. ``payload`` replaces the original (edit and replay).
    """
    if not isinstance(archived, ArchivedMessage):
        raise InvalidOption(f"replay() takes an archived message (an ArchivedMessage), not {archived!r}")
    using = archived._state.db or "default"
    new_payload = archived.payload if payload is None else validation.validate_payload(payload)

    def build(row: ArchivedMessage) -> Message:
        options = {
            "kind": row.kind,
            "key": row.key,
            "group": row.group,
            "headers": row.headers,
            "priority": row.priority,
        }
        message, _ = build_message(row.queue, new_payload, {**options, "max_attempts": row.max_attempts})
        return message

    def then(row: ArchivedMessage, message: Message) -> None:
        # A workflow step's message: the step and what its failure cancelled go on (docs/workflows.md).
        workflows.reopen(using, row.headers, row.message_id, message.pk)

    message = ArchivedMessage.objects.using(using).replay(archived.pk, build, by=by, force=force, then=then)
    archived.replayed_by, archived.replayed_as = by, message.pk
    if events.listened(signals.message_replayed):
        archived.refresh_from_db(using=using)
        event = {"message": message, "queue": message.queue, "archived": archived, "by": by}
        events.send(signals.message_replayed, using, [event])
    return message


CANCEL_ROUNDS = 3


class CancelResult(enum.StrEnum):
    """What `cancel` did. Truthy when it archived or flagged the message, falsy when it was gone."""

    ARCHIVED = "archived"  # it was not running: archived as cancelled at once
    REQUESTED = "requested"  # it runs: flagged, its worker stops it and archives it as cancelled
    GONE = ""  # finished (or cancelled) already


def cancel(message: Message | int, *, by: str = "", using: str = "default") -> CancelResult:
    """Cancel a live message: archived at once if it is not running, else flagged for its worker to stop.

    ``message`` is a Message or its id (on ``using``). A running message's
    worker sees the flag at its next heartbeat; the handler learns it at its
    next ``message.checkpoint()`` or ``set_progress()`` (``--exec``: the
    command's process group is stopped), and the message is archived as
    cancelled, never retried. A flagged message whose worker died is
    archived as cancelled by the reaper (docs/cancel-progress.md).
    """
    if isinstance(message, Message):
        using, pk = message._state.db or using, message.pk
    else:
        pk = validation.message_id(message)
    manager = Message.objects.using(using)
    error = f"cancelled by {by}" if by else "cancelled"
    # A message claimed (or given back) between the two statements is caught on the next round.
    for _ in range(CANCEL_ROUNDS):
        if manager.request_cancel(pk):
            return CancelResult.REQUESTED
        live = with_retries(using, manager.filter(pk=pk).first, what=f"cancel message {pk}")
        if live is None:
            return CancelResult.GONE
        if finish(live, Outcome.CANCELLED, match="idle", worker=by, error=error):
            return CancelResult.ARCHIVED
    raise DbQueueError(f"message {pk} changed state {CANCEL_ROUNDS} times while it was being cancelled; try again")


async def acancel(message: Message | int, *, by: str = "", using: str = "default") -> CancelResult:
    """`cancel` from async code: `cancel` itself, in Django's thread for sync code (as `aenqueue`)."""
    return await sync_to_async(cancel, thread_sensitive=True)(message, by=by, using=using)


def run_now(message: Message) -> bool:
    """Make a scheduled (or backing-off) message ready now. In-flight messages are left alone."""
    _live(message, "run_now")
    return Message.objects.using(message._state.db or "default").run_now(message.pk)


def release_lease(message: Message) -> bool:
    """Take an in-flight message back from its worker: ready again in its place, under a new claim later."""
    _live(message, "release_lease")
    using = message._state.db or "default"
    return Message.objects.using(using).filter(pk=message.pk).give_back(count_attempt=True) == 1


def _live(message: Any, what: str) -> None:
    """Refuse anything but a saved live message: an id alone would say nothing of its database."""
    if not isinstance(message, Message):
        raise InvalidOption(f"{what}() takes a live message (a Message), not {message!r}")
    validation.message_id(message.pk)


def set_paused(queue: str, paused: bool, *, by: str = "", using: str = "default") -> QueueState:
    """Pause or resume a queue; workers stop claiming from a paused queue."""
    validation.validate_queue_name(queue)
    return QueueState.objects.using(using).set_paused(queue, paused, by)


def purge(ids: Iterable[int], *, using: str = "default") -> int:
    """Delete dead letters for good; returns how many went.

    Only dead rows: acked, expired and cancelled history is the reaper's to
    prune (RETENTION_DAYS), so a purge never loses it by a wrong selection.
    """
    return ArchivedMessage.objects.using(using).purge_dead(ids)
