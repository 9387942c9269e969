"""Operators' controls: replay and purge dead letters, cancel, run now, release, pause.

Unlike the consumer operations these act on a message by id, whoever holds
its lease: they are for people fixing a queue (the admin, scripts), and each
is one short transaction that changes nothing when its precondition fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import signals, validation
from .models import ArchivedMessage, Message, Outcome, QueueState, events
from .operations import build_message, finish


def replay(archived: ArchivedMessage, *, by: str = "", payload: Any = None, force: bool = False) -> Message:
    """Enqueue a dead (or expired, cancelled) message again as a new ready message.

    Attempts start from zero. The archived row records when, by whom, and as
    which message it was replayed; a second replay of the same row is refused
    unless ``force``. ``payload`` replaces the original (edit and replay).
    """
    using = archived._state.db or "default"
    new_payload = archived.payload if payload is None else validation.validate_payload(payload)

    def build(row: ArchivedMessage) -> Message:
        options = {"kind": row.kind, "key": row.key, "headers": row.headers, "priority": row.priority}
        message, _ = build_message(row.queue, new_payload, {**options, "max_attempts": row.max_attempts})
        return message

    message = ArchivedMessage.objects.using(using).replay(archived.pk, build, by=by, force=force)
    archived.replayed_by, archived.replayed_as = by, message.pk
    if events.listened(signals.message_replayed):
        archived.refresh_from_db(using=using)
        event = {"message": message, "queue": message.queue, "archived": archived, "by": by}
        events.send(signals.message_replayed, using, [event])
    return message


def cancel(message: Message, *, by: str = "") -> bool:
    """Archive a live message as cancelled, whoever holds it. False if it was gone already.

    A worker still running it will find its lease lost when it acknowledges.
    """
    return finish(message, Outcome.CANCELLED, match="id", worker=by, error=f"cancelled by {by}" if by else "cancelled")


def run_now(message: Message) -> bool:
    """Make a scheduled (or backing-off) message ready now. In-flight messages are left alone."""
    return Message.objects.using(message._state.db or "default").run_now(message.pk)


def release_lease(message: Message) -> bool:
    """Take an in-flight message back from its worker: ready again in its place, under a new claim later."""
    using = message._state.db or "default"
    return Message.objects.using(using).filter(pk=message.pk).give_back(count_attempt=True) == 1


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
