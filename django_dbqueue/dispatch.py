"""Run one claimed message through its handler and record the outcome.

This is the heart of a worker, kept apart from threads and polling so that
anything that runs messages (the worker, tests, the demo) shares one set
of rules:

- the handler returns: ack (its JSON return value is kept as the result);
- it raises ``Reject``: dead letter now; ``Retry``: back after the delay;
  ``Defer``: put off without counting a failure;
- it raises anything else: fail (retry with backoff, dead when attempts run out);
- there is no handler: dead letter naming the queue and kind, or, with the
  queue's ``UNHANDLED = "keep"``, back in the queue for a handler to come.
"""

from __future__ import annotations

import logging

from .conf import get_settings, queue_options
from .handlers import Defer, Reject, Retry, find_handler
from .models import Message

logger = logging.getLogger("django_dbqueue")


class Outcome:
    ACKED = "acked"
    REJECTED = "rejected"
    RETRIED = "retried"
    DEFERRED = "deferred"
    FAILED = "failed"
    UNHANDLED = "unhandled"
    LEASE_LOST = "lease lost"


def process(message: Message, *, worker: str = "") -> str:
    """Run ``message``'s handler and apply the outcome; returns what happened."""
    handler = find_handler(message.queue, message.kind)
    if handler is None:
        return _unhandled(message)
    try:
        result = handler(message)
    except Reject as exc:
        return _applied(message.reject(requeue=False, reason=exc.reason), Outcome.REJECTED)
    except Retry as exc:
        return _applied(message.reject(delay=exc.delay, reason=exc.reason or "retry requested"), Outcome.RETRIED)
    except Defer as exc:
        return _applied(message.defer(exc.until, delay=exc.delay), Outcome.DEFERRED)
    except Exception as exc:
        logger.debug("message %s of %s failed: %r", message.pk, message.queue, exc)
        return _applied(message.fail(exc), Outcome.FAILED)
    return _applied(message.ack(worker=worker, result=result), Outcome.ACKED)


def _unhandled(message: Message) -> str:
    reason = f"no handler for queue {message.queue!r}, kind {message.kind!r}"
    if queue_options(message.queue).unhandled == "keep":
        # Leave it for a worker that has the handler; look again after a poll.
        return _applied(message.defer(delay=get_settings().max_poll_interval), Outcome.UNHANDLED)
    return _applied(message.reject(requeue=False, reason=reason), Outcome.UNHANDLED)


def _applied(done: bool, outcome: str) -> str:
    return outcome if done else Outcome.LEASE_LOST
