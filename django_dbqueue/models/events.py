"""Sending the lifecycle signals (defined in `django_dbqueue.signals`) once a change is durable.

Every statement that moves a message announces it through here, so the
rule "after commit, never for a rollback, free when nobody listens" is
written once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.dispatch import Signal

from .. import signals
from ..db.transactions import after_commit
from . import wakeups
from .archive import ArchivedMessage, Outcome
from .protocols import LiveMessage
from .statements import message_model

logger = logging.getLogger("django_dbqueue")


def _sender() -> type:
    return message_model()


def listened(signal: Signal) -> bool:
    """Whether any receiver is connected: callers skip building events when none is."""
    return bool(signal.receivers) and signal.has_listeners(_sender())


def send(signal: Signal, using: str, events: list[dict[str, Any]]) -> None:
    """Send ``signal`` once per event, now or, inside a transaction, when it commits."""
    if not events or not listened(signal):
        return
    after_commit(using, lambda: _deliver(signal, using, events))


def _deliver(signal: Signal, using: str, events: list[dict[str, Any]]) -> None:
    sender = _sender()
    for event in events:
        for receiver, response in signal.send_robust(sender=sender, using=using, **event):
            if isinstance(response, Exception):
                logger.error(
                    "receiver %s of django_dbqueue signal %s raised; the queue operation stands",
                    getattr(receiver, "__qualname__", receiver),
                    _name(signal),
                    exc_info=response,
                )


def _name(signal: Signal) -> str:
    return next((f"message_{name}" for name, known in signals.SIGNALS.items() if known is signal), repr(signal))


def settle(rows: list[ArchivedMessage], using: str) -> list[ArchivedMessage]:
    """Archive rows as stored: times the database computed are read back (one query).

    Only called when a receiver listens, so the hot path never pays for it.
    """
    if not rows or not any(_unsettled(row) for row in rows):
        return rows
    stored: dict[tuple[int, str], ArchivedMessage] = {}
    found = ArchivedMessage.objects.using(using).filter(message_id__in=[row.message_id for row in rows])
    for row in found.order_by("id"):
        stored[(row.message_id, row.outcome)] = row  # the newest row wins
    return [stored.get((row.message_id, row.outcome), row) for row in rows]


def _unsettled(row: ArchivedMessage) -> bool:
    return row.pk is None or any(
        hasattr(getattr(row, name), "resolve_expression") for name in ("finished_at", "created_at")
    )


def enqueued(messages: Sequence[LiveMessage], using: str) -> None:
    """``message_enqueued`` for each message the call inserted (not for a live key found); workers nudged."""
    wakeups.after_enqueue(using, (m.queue for m in messages if m.was_created))
    if listened(signals.message_enqueued):
        send(signals.message_enqueued, using, [{"message": m, "queue": m.queue} for m in messages if m.was_created])


def claimed(messages: Sequence[LiveMessage], using: str, worker: str) -> None:
    if messages and listened(signals.message_claimed):
        send(signals.message_claimed, using, [{"message": m, "queue": m.queue, "worker": worker} for m in messages])


def failed(message: LiveMessage, error: str, delay: float) -> None:
    if listened(signals.message_failed):
        event = {"message": message, "queue": message.queue, "error": error, "delay": delay}
        send(signals.message_failed, message._state.db or "default", [event])


def signal_of(outcome: str) -> Signal:
    """The signal a message finishing with ``outcome`` (acked, dead, expired, cancelled) sends."""
    by_outcome: dict[str, Signal] = {
        Outcome.ACKED: signals.message_acked,
        Outcome.DEAD: signals.message_dead_lettered,
        Outcome.EXPIRED: signals.message_expired,
        Outcome.CANCELLED: signals.message_cancelled,
    }
    return by_outcome[outcome]


def finished(message: LiveMessage, outcome: str, archived: ArchivedMessage | None, row: dict[str, Any]) -> None:
    """The signal of ``outcome`` (acked, dead, expired, cancelled) for one message."""
    signal = signal_of(outcome)
    if not listened(signal):
        return
    using = message._state.db or "default"
    event: dict[str, Any] = {
        "message": message,
        "queue": message.queue,
        "archived": settle([archived], using)[0] if archived else None,
    }
    if outcome == Outcome.ACKED:
        event.update(result=row.get("result"), worker=row.get("worker") or message.claimed_by)
    elif outcome == Outcome.DEAD:
        event["error"] = message.last_error if row.get("error") is None else row["error"]
    elif outcome == Outcome.CANCELLED:
        event["by"] = row.get("worker", "")
    send(signal, using, [event])
