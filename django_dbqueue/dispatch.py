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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .conf import get_settings, queue_options
from .handlers import Defer, Handler, Reject, Retry, find_handler
from .models import Message
from .operations import attempts_left

logger = logging.getLogger("django_dbqueue")


class Outcome:
    ACKED = "acked"
    REJECTED = "rejected"
    RETRIED = "retried"
    DEFERRED = "deferred"
    FAILED = "failed"
    UNHANDLED = "unhandled"
    LEASE_LOST = "lease lost"


@dataclass(frozen=True)
class Verdict:
    """What a handler's run decided, not yet written: ``apply()`` records it.

    Kept apart from running the handler so a worker can retry the recording
    through a database outage without running the handler twice.
    """

    outcome: str
    apply: Callable[[], bool]
    result: Any = None  # an ack's handler return value, for workers that ack in batches

    def record(self) -> str:
        return self.outcome if self.apply() else Outcome.LEASE_LOST


def decide(message: Message, *, worker: str = "", handler: Handler | None = None) -> Verdict:
    """Run the handler (``handler`` overrides the registry, as exec mode does)."""
    handler = handler or find_handler(message.queue, message.kind)
    if handler is None:
        return _unhandled(message)
    try:
        result = handler(message)
    except Reject as exc:
        return Verdict(Outcome.REJECTED, partial(message.reject, requeue=False, reason=exc.reason))
    except Retry as exc:
        reason = exc.reason or "retry requested"
        if not attempts_left(message):
            reason = f"{reason}; no attempts left ({message.attempts} made)"
            return Verdict(Outcome.REJECTED, partial(message.reject, requeue=False, reason=reason))
        return Verdict(Outcome.RETRIED, partial(message.reject, delay=exc.delay, reason=reason))
    except Defer as exc:
        return Verdict(Outcome.DEFERRED, partial(message.defer, exc.until, delay=exc.delay))
    except Exception as exc:
        logger.debug("message %s of %s failed: %r", message.pk, message.queue, exc)
        return Verdict(Outcome.FAILED, partial(message.fail, exc))
    return Verdict(Outcome.ACKED, partial(message.ack, worker=worker, result=result), result)


def process(message: Message, *, worker: str = "", handler: Handler | None = None) -> str:
    """Run ``message``'s handler and apply the outcome; returns what happened."""
    return decide(message, worker=worker, handler=handler).record()


def _unhandled(message: Message) -> Verdict:
    reason = f"no handler for queue {message.queue!r}, kind {message.kind!r}"
    if queue_options(message.queue).unhandled == "keep":
        # Leave it for a worker that has the handler; look again after a poll.
        return Verdict(Outcome.UNHANDLED, partial(message.defer, delay=get_settings().max_poll_interval))
    return Verdict(Outcome.UNHANDLED, partial(message.reject, requeue=False, reason=reason))
