"""Every error django-dbqueue raises on purpose.

Each exception names the problem in its message. The input errors
(``InvalidQueueName``, ``PayloadNotSerializable``, ``InvalidOption``,
``UnknownOption``, ``NotClaimed``, ``DuplicateKey``, ``AlreadyReplayed``,
``ImproperlyConfiguredQueue``) are raised before anything is written, so
catching one means the database is unchanged. The others report on work
that did run: a command that failed, a request that got no reply, a task
that did not complete.
"""

from __future__ import annotations


class DbQueueError(Exception):
    """Base class of every error raised by django-dbqueue."""


class InvalidQueueName(DbQueueError, ValueError):
    """A queue (or topic) name is empty, too long or has characters outside the allowed set."""


class PayloadNotSerializable(DbQueueError, TypeError):
    """A payload or headers value cannot be stored as JSON."""


class InvalidOption(DbQueueError, ValueError):
    """An option has a value of the wrong type or out of range."""


class UnknownOption(DbQueueError, TypeError):
    """An option name that django-dbqueue does not know (often a typo)."""


class LeaseLost(DbQueueError):
    """The message's lease expired or was taken over: the change was not made.

    For callers who prefer an exception: no function of django-dbqueue
    raises it; the consumer operations return ``False`` instead, so a worker
    can carry on.
    """


class Cancelled(DbQueueError):
    """Raised in a handler by ``message.checkpoint()`` or ``set_progress()`` once the message's cancel was asked.

    Let it propagate: the worker archives the message as cancelled and
    never retries it (docs/cancel-progress.md).
    """


class HandlerTimeout(DbQueueError, TimeoutError):
    """An ``async def`` handler ran longer than the worker's ``--async-timeout`` and was cancelled.

    The attempt fails with it: retried with backoff, dead when attempts run
    out, as exec mode's ``--exec-timeout`` (docs/workers.md, "Async handlers").
    """


class NotClaimed(DbQueueError):
    """An operation that needs a claimed message was called on one that is not."""


class ImproperlyConfiguredQueue(DbQueueError):
    """The DBQUEUE setting is invalid (system checks report the same)."""


class DuplicateKey(DbQueueError):
    """A message with this key is live in the queue already, where a new one was required."""


class AlreadyReplayed(DbQueueError):
    """This archived message was replayed before; pass ``force=True`` to replay it again."""


class CommandFailed(DbQueueError):
    """An exec-mode command (``runqueueworker --exec``) exited with a non-zero status."""


class RequestTimeout(DbQueueError, TimeoutError):
    """``request()`` got no reply within its timeout."""


class RequestFailed(DbQueueError):
    """``request()``'s message was dead-lettered, cancelled or expired without a reply."""


class TaskNotCompleted(DbQueueError):
    """A Tasks-framework task that failed without raising: cancelled, expired, or its worker died.

    ``django_dbqueue.tasks`` reports it as the error class of such a FAILED
    result; the error's traceback field holds the reason.
    """
