"""Operators' controls: replay and purge dead letters, cancel, run now, release, pause.

Unlike the consumer operations these act on a message by id, whoever holds
its lease: they are for people fixing a queue (the admin, scripts), and each
is one short transaction that changes nothing when its precondition fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import signals, validation
from .exceptions import AlreadyReplayed, DuplicateKey, InvalidOption
from .models import ArchivedMessage, Message, Outcome, QueueState
from .operations import _finish, build_message, insert_message
from .transient import with_retries
from .vendor import DbNow, write_transaction

REPLAYABLE = {Outcome.DEAD, Outcome.EXPIRED, Outcome.CANCELLED}


def replay(archived: ArchivedMessage, *, by: str = "", payload: Any = None, force: bool = False) -> Message:
    """Enqueue a dead (or expired, cancelled) message again as a new ready message.

    Attempts start from zero. The archived row records when, by whom, and as
    which message it was replayed; a second replay of the same row is refused
    unless ``force``. ``payload`` replaces the original (edit and replay).
    """
    using = archived._state.db or "default"
    new_payload = archived.payload if payload is None else validation.validate_payload(payload)

    def run() -> Message:
        with write_transaction(using):
            row = ArchivedMessage.objects.using(using).select_for_update().get(pk=archived.pk)
            if row.outcome not in REPLAYABLE and not force:
                raise InvalidOption(
                    f"archived message {row.pk} is {row.outcome}; only dead, expired or cancelled messages "
                    "are replayed (force=True to replay anyway)"
                )
            if row.replayed_at is not None and not force:
                raise AlreadyReplayed(
                    f"archived message {row.pk} was replayed at {row.replayed_at:%Y-%m-%d %H:%M:%S} "
                    f"by {row.replayed_by or 'someone'} as message {row.replayed_as}; force=True replays it again"
                )
            message, _ = build_message(
                row.queue,
                new_payload,
                {
                    "kind": row.kind,
                    "key": row.key,
                    "headers": row.headers,
                    "priority": row.priority,
                    "max_attempts": row.max_attempts,
                },
            )
            message.replay_of = row.pk
            insert_message(message, None, using)
            if not message.was_created:
                raise DuplicateKey(
                    f"key {row.key!r} is live in queue {row.queue!r} as message {message.pk}; "
                    "finish or cancel that one before replaying"
                )
            ArchivedMessage.objects.using(using).filter(pk=row.pk).update(
                replayed_at=DbNow(), replayed_by=by, replayed_as=message.pk
            )
            archived.replayed_by, archived.replayed_as = by, message.pk
            return message

    message = with_retries(using, run, what=f"replay of archived message {archived.pk}")
    if signals.listened(signals.message_replayed):
        archived.refresh_from_db(using=using)
        event = {"message": message, "queue": message.queue, "archived": archived, "by": by}
        signals.send(signals.message_replayed, using, [event])
    return message


def cancel(message: Message, *, by: str = "") -> bool:
    """Archive a live message as cancelled, whoever holds it. False if it was gone already.

    A worker still running it will find its lease lost when it acknowledges.
    """
    using = message._state.db or "default"
    return _finish(
        message,
        Outcome.CANCELLED,
        leased=Message.objects.using(using).filter(pk=message.pk),
        worker=by,
        error=f"cancelled by {by}" if by else "cancelled",
    )


def run_now(message: Message) -> bool:
    """Make a scheduled (or backing-off) message ready now. In-flight messages are left alone."""
    using = message._state.db or "default"
    return with_retries(
        using,
        lambda: (
            Message.objects.using(using).filter(pk=message.pk, lease_token__isnull=True).update(available_at=DbNow())
            == 1
        ),
        what="run now",
    )


def release_lease(message: Message) -> bool:
    """Take an in-flight message back from its worker: ready now, under a new claim later."""
    using = message._state.db or "default"
    return with_retries(
        using,
        lambda: (
            Message.objects.using(using)
            .filter(pk=message.pk, lease_token__isnull=False)
            .update(lease_token=None, available_at=DbNow(), claimed_by="")
            == 1
        ),
        what="release lease",
    )


def set_paused(queue: str, paused: bool, *, by: str = "", using: str = "default") -> QueueState:
    """Pause or resume a queue; workers stop claiming from a paused queue."""
    validation.validate_queue_name(queue)

    def run() -> QueueState:
        with write_transaction(using):
            return QueueState.objects.using(using).update_or_create(
                queue=queue, defaults={"paused": paused, "changed_by": by}
            )[0]

    return with_retries(using, run, what="pause")


def purge(ids: Iterable[int], *, using: str = "default") -> int:
    """Delete dead letters for good; returns how many went.

    Only dead rows: acked, expired and cancelled history is the reaper's to
    prune (RETENTION_DAYS), so a purge never loses it by a wrong selection.
    """
    ids = list(ids)
    return with_retries(
        using,
        lambda: ArchivedMessage.objects.using(using).filter(pk__in=ids, outcome=Outcome.DEAD).delete()[0],
        what="purge",
    )
