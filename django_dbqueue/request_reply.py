"""Request/reply over the queue: ask a handler in another process and wait for its answer.

`request` enqueues the request with a correlation id and the name of
a temporary reply queue (``reply.<correlation id>``) in its headers, then
polls that queue. The handler answers with `reply`. Both messages
expire at the request's deadline, so nothing waits for an answer nobody
wants: a request still queued at its deadline is never claimed, and the
reaper archives late replies as expired. On a timeout the requester also
removes any reply that slipped in. `arequest` is the same from async code:
the same steps, awaited, with ``asyncio.sleep`` between polls.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
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
    pending = Pending.send(
        queue,
        payload,
        timeout=timeout,
        kind=kind,
        headers=headers,
        priority=priority,
        max_attempts=max_attempts,
        using=using,
        poll_interval=poll_interval,
    )
    while (answer := pending.poll()) is None:
        time.sleep(pending.pause())
    return answer.payload


async def arequest(
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
    """`request` from async code: the same arguments, checks, timeout and errors.

    Each step (the enqueue, then each poll) runs in Django's thread for
    sync code, and the waits between polls are ``asyncio.sleep``: neither
    the event loop nor that thread is held while the reply is awaited.
    Cancelled while it waits, it leaves the request to expire at its deadline.
    """
    send = sync_to_async(Pending.send, thread_sensitive=True)
    pending = await send(
        queue,
        payload,
        timeout=timeout,
        kind=kind,
        headers=headers,
        priority=priority,
        max_attempts=max_attempts,
        using=using,
        poll_interval=poll_interval,
    )
    poll = sync_to_async(pending.poll, thread_sensitive=True)
    while (answer := await poll()) is None:
        await asyncio.sleep(pending.pause())
    return answer.payload


class Pending:
    """A request sent and not yet answered: the one waiting logic behind `request` and `arequest`.

    They differ only in how they sleep between polls; each poll is a few
    short statements, never a wait inside the database.
    """

    def __init__(
        self, queue: str, sent: Message, correlation_id: str, using: str, seconds: float, interval: float
    ) -> None:
        self.queue, self.sent, self.correlation_id, self.using = queue, sent, correlation_id, using
        self.seconds, self.interval = seconds, interval
        # Counted from after the database's clock was read (in send), so that when we give
        # up the request has expired there too and no worker can still claim it.
        self.deadline = time.monotonic() + seconds
        self.wait = FIRST_POLL
        self.reply_to = reply_queue_name(self.correlation_id)

    @classmethod
    def send(
        cls,
        queue: str,
        payload: Any,
        *,
        timeout: float | timedelta,
        kind: str,
        headers: dict[str, Any] | None,
        priority: int,
        max_attempts: int | None,
        using: str | None,
        poll_interval: float,
    ) -> Pending:
        """Check the arguments and enqueue the request, expiring at its deadline."""
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
        return cls(queue, sent, correlation_id, using, seconds, interval)

    def poll(self) -> Message | None:
        """The reply if it came, else None; raises `RequestFailed` or, past the deadline, `RequestTimeout`."""
        answer = _take_reply(self.reply_to, self.using)
        if answer is not None:
            return answer
        if time.monotonic() >= self.deadline:
            Message.objects.using(self.using).for_queue(self.reply_to).delete()  # a reply that raced the deadline
            raise RequestTimeout(
                f"no reply to request {self.sent.pk} on queue {self.queue!r} within {self.seconds:g}s "
                f"(correlation id {self.correlation_id})"
            )
        failed = _failed(self.sent, self.using)
        if failed is not None:
            answer = _take_reply(self.reply_to, self.using)  # it may have answered before failing
            if answer is not None:
                return answer
            error = failed.last_error.strip().splitlines()[-1] if failed.last_error.strip() else "no error recorded"
            raise RequestFailed(
                f"request {self.sent.pk} on queue {self.queue!r} was {failed.outcome} without a reply: {error}"
            )
        return None

    def pause(self) -> float:
        """The wait before the next poll: doubling from FIRST_POLL to the poll interval, never past the deadline."""
        pause = min(self.wait, max(self.deadline - time.monotonic(), 0))
        self.wait = min(self.wait * 2, self.interval)
        return pause


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
