"""Signals sent as messages move through their lifecycle.

Connect receivers the usual Django way::

    from django.dispatch import receiver
    from django_dbqueue.signals import message_dead_lettered

    @receiver(message_dead_lettered)
    def page_someone(sender, message, archived, error, **kwargs): ...

Every signal is sent with ``sender`` = :class:`~django_dbqueue.models.Message`
and the keyword arguments ``message``, ``queue`` and ``using`` (the database
alias), plus the ones listed beside each signal below.

A signal is sent only once its change is durable: right after the
operation's own transaction commits, or, when the operation ran inside the
caller's ``transaction.atomic()``, through ``transaction.on_commit`` (so a
receiver never hears of a change that was rolled back). A receiver that
raises is logged (logger ``django_dbqueue``) and does not stop the other
receivers nor the operation, which has committed already.

With no receiver connected, the cost on the claim and ack paths is one
attribute test (see :func:`listened`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.dispatch import Signal

if TYPE_CHECKING:
    from .models import ArchivedMessage

logger = logging.getLogger("django_dbqueue")

#: A message was inserted (``enqueue``, ``enqueue_many``, ``publish``, ``request``,
#: ``reply``, the outbox). Not sent when a deduplication key found a live message.
message_enqueued = Signal()
#: A worker leased the message. Extra: ``worker``.
message_claimed = Signal()
#: The message was acknowledged. Extra: ``archived`` (the archive row, or None
#: when the queue's ARCHIVE is off), ``result``, ``worker``.
message_acked = Signal()
#: An attempt failed and the message goes back to the queue for another one
#: (``fail()`` with attempts left, ``reject(requeue=True)``, a handler's ``Retry``).
#: Extra: ``error`` (text), ``delay`` (seconds until it is ready again).
message_failed = Signal()
#: The message was archived as dead. Extra: ``archived``, ``error``.
message_dead_lettered = Signal()
#: The reaper archived the message as expired. Extra: ``archived``.
message_expired = Signal()
#: A dead (expired, cancelled) message was replayed as ``message``, a new
#: live message. Extra: ``archived`` (the replayed row), ``by``.
message_replayed = Signal()
#: An operator cancelled a live message. Extra: ``archived``, ``by``.
message_cancelled = Signal()

SIGNALS = {
    "enqueued": message_enqueued,
    "claimed": message_claimed,
    "acked": message_acked,
    "failed": message_failed,
    "dead_lettered": message_dead_lettered,
    "expired": message_expired,
    "replayed": message_replayed,
    "cancelled": message_cancelled,
}


def _sender() -> type:
    from .models import Message

    return Message


def listened(signal: Signal) -> bool:
    """Whether any receiver is connected: callers skip building events when none is."""
    return bool(signal.receivers) and signal.has_listeners(_sender())


def send(signal: Signal, using: str, events: list[dict[str, Any]]) -> None:
    """Send ``signal`` once per event, now or, inside a transaction, when it commits."""
    if not events or not listened(signal):
        return
    if connections[using].in_atomic_block:
        transaction.on_commit(lambda: _deliver(signal, using, events), using=using)
    else:
        _deliver(signal, using, events)


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
    return next((f"message_{name}" for name, known in SIGNALS.items() if known is signal), repr(signal))


def settle(rows: list[ArchivedMessage], using: str) -> list[ArchivedMessage]:
    """Archive rows as stored: times the database computed are read back (one query).

    Only called when a receiver listens, so the hot path never pays for it.
    """
    if not rows or not any(_unsettled(row) for row in rows):
        return rows
    from .models import ArchivedMessage

    stored: dict[tuple[int, str], ArchivedMessage] = {}
    found = ArchivedMessage.objects.using(using).filter(message_id__in=[row.message_id for row in rows])
    for row in found.order_by("id"):
        stored[(row.message_id, row.outcome)] = row  # the newest row wins
    return [stored.get((row.message_id, row.outcome), row) for row in rows]


def _unsettled(row: ArchivedMessage) -> bool:
    return row.pk is None or any(
        hasattr(getattr(row, name), "resolve_expression") for name in ("finished_at", "created_at")
    )
