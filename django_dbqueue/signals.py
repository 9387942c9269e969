"""Signals sent as messages move through their lifecycle.

Connect receivers the usual Django way::

    from django.dispatch import receiver
    from django_dbqueue.signals import message_dead_lettered

    @receiver(message_dead_lettered)
    def page_someone(sender, message, archived, error, **kwargs): ...

Every signal is sent with ``sender`` = `Message`
and the keyword arguments ``message``, ``queue`` and ``using`` (the database
alias), plus the ones listed beside each signal below.

A signal is sent only once its change is durable: right after the
operation's own transaction commits, or, when the operation ran inside the
caller's ``transaction.atomic()``, through ``transaction.on_commit`` (so a
receiver never hears of a change that was rolled back). A receiver that
raises is logged (logger ``django_dbqueue``) and does not stop the other
receivers nor the operation, which has committed already.

With no receiver connected, the cost on the claim and ack paths is one
attribute test (see `django_dbqueue.models.events.listened`).
"""

from __future__ import annotations

from django.dispatch import Signal

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

# Signals of the running of handlers and of the reaper, for metrics and
# tracing (docs/metrics.md). Sent in the process that does the work, at
# once (no transaction to wait for), only when a receiver is connected.

#: A handler is about to run ``message`` (sender: Message). Extra: ``worker``.
handler_started = Signal()
#: A handler returned or raised (sender: Message); its outcome is not written yet.
#: Extra: ``worker``, ``outcome`` (a HandlerOutcome), ``duration`` (seconds).
handler_finished = Signal()
#: A reaper pass that held the lock (sender: the Reaper class). Extra: ``report``
#: (a ReapReport: stale_workers, released, poison, expired, pruned), ``using``.
reaper_passed = Signal()
#: A workflow finished (sender: WorkflowRun), once the transaction that finished it
#: committed. Extra: ``workflow`` (its id), ``name``, ``outcome`` (``succeeded``,
#: ``failed``, ``cancelled``), ``using``.
workflow_finished = Signal()

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
