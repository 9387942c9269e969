"""Request/reply over the queue: ask a handler in another process and wait for its answer.

`request` enqueues the request with a correlation id and the name of
a temporary reply queue (``reply.<correlation id>``) in its headers, then
polls that queue. The handler answers with `reply`. Both messages
expire at the request's deadline, so nothing waits for an answer nobody
wants: a request still queued at its deadline is never claimed, and the
reaper archives late replies as expired. On a timeout the requester also
removes any reply that slipped in.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

from django.db import connections

from . import validation
from .conf import database_for
from .db.clock import db_now
from .exceptions import InvalidOption, RequestFailed, RequestTimeout
from .models import ArchivedMessage, Message, Outcome
from .operations import enqueue

REPLY_QUEUE_PREFIX = "reply."
FIRST_POLL = 0.005  # seconds; waits double from here up to poll_interval


def reply_queue_name(correlation_id: str) -> str:
    return f"{REPLY_QUEUE_PREFIX}{correlation_id}"


def request(
    queue: str,
    payload: Any,
    *,
    timeout: float | timedelta = 30.0,
    kind: str = "",
    headers: dict[str, Any] | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    using: str | None = None,
    poll_interval: float = 0.2,
) -> Any:
    """Enqueue ``payload`` on ``queue`` and wait up to ``timeout`` for the handler's reply payload.

    Raises `RequestTimeout` when no reply came in time, and
    `RequestFailed` as soon as the request is dead-lettered (or
    cancelled, or expired) without one. Must not run inside
    ``transaction.atomic()``: the request would stay invisible to workers
    until the caller commits.
    """
    seconds = validation.seconds(timeout, "timeout", allow_zero=False)
    interval = validation.seconds(poll_interval, "poll_interval", allow_zero=False)
    using = database_for(validation.validate_queue_name(queue), using)
    if connections[using].in_atomic_block:
        raise InvalidOption(
            "request() waits for another process to answer, but it runs inside transaction.atomic(): "
            "the request would not be visible to workers until the transaction commits"
        )
    correlation_id = uuid.uuid4().hex
    reply_to = reply_queue_name(correlation_id)
    headers = {**validation.validate_headers(headers), "correlation_id": correlation_id, "reply_to": reply_to}
    expires_at = db_now(using) + timedelta(seconds=seconds)
    # Counted from after the database's clock was read, so that when we give
    # up the request has expired there too and no worker can still claim it.
    deadline = time.monotonic() + seconds
    sent = enqueue(
        queue,
        payload,
        kind=kind,
        headers=headers,
        priority=priority,
        max_attempts=max_attempts,
        expires_at=expires_at,
        using=using,
    )
    wait = FIRST_POLL
    while True:
        answer = _take_reply(reply_to, using)
        if answer is not None:
            return answer.payload
        if time.monotonic() >= deadline:
            break
        failed = _failed(sent, using)
        if failed is not None:
            answer = _take_reply(reply_to, using)  # it may have answered before failing
            if answer is not None:
                return answer.payload
            error = failed.last_error.strip().splitlines()[-1] if failed.last_error.strip() else "no error recorded"
            raise RequestFailed(f"request {sent.pk} on queue {queue!r} was {failed.outcome} without a reply: {error}")
        time.sleep(min(wait, max(deadline - time.monotonic(), 0)))
        wait = min(wait * 2, interval)
    Message.objects.using(using).for_queue(reply_to).delete()  # a reply that raced the deadline
    raise RequestTimeout(
        f"no reply to request {sent.pk} on queue {queue!r} within {seconds:g}s (correlation id {correlation_id})"
    )


def _take_reply(reply_to: str, using: str) -> Message | None:
    """Take the reply off its queue, if it came. Only this requester reads the queue: no lock needed."""
    return Message.objects.using(using).take_first(reply_to)


def _failed(sent: Message, using: str) -> ArchivedMessage | None:
    """The request's archive row if it finished other than acked (dead, cancelled, expired)."""
    row = Message.objects.using(using).locate(sent.pk)
    # Live, or acked (the reply is on its way, or the handler answers some other way): keep waiting.
    return row if isinstance(row, ArchivedMessage) and row.outcome != Outcome.ACKED else None


def reply(message: Message, payload: Any, *, headers: dict[str, Any] | None = None) -> Message:
    """Answer a message sent with `request`; call it from the handler.

    The reply goes to the requester's reply queue, keyed by the correlation
    id (a handler that runs twice answers once while the first answer is
    unread), and expires with the request.
    """
    reply_to = (message.headers or {}).get("reply_to")
    correlation_id = (message.headers or {}).get("correlation_id")
    if not (isinstance(reply_to, str) and isinstance(correlation_id, str)):
        raise InvalidOption(
            f"message {message.pk} of queue {message.queue!r} has no reply_to and correlation_id headers: "
            "only messages sent with request() can be replied to"
        )
    if reply_to != reply_queue_name(correlation_id):
        # Headers come from whoever produced the message: a reply goes only
        # to the private queue request() made for it, never to a queue a
        # header happens to name.
        raise InvalidOption(
            f"message {message.pk} names {reply_to!r} as its reply_to, which is not the reply queue "
            f"request() makes for its correlation id ({reply_queue_name(correlation_id)!r}); not replying"
        )
    headers = {**validation.validate_headers(headers), "correlation_id": correlation_id, "in_reply_to": message.pk}
    return enqueue(
        reply_to,
        payload,
        key=correlation_id,
        headers=headers,
        expires_at=message.expires_at,
        using=message._state.db,
    )
