"""Running one claimed message through its handler, and deciding its outcome.

This is the heart of a worker, kept apart from threads and polling so that
anything that runs messages (the worker, tests, the demo) shares one set
of rules (formerly ``django_dbqueue.dispatch``):

- the handler returns: ack (its JSON return value is kept as the result);
- it raises ``Reject``: dead letter now; ``Retry``: back after the delay;
  ``Defer``: put off without counting a failure (dead past the queue's
  ``MAX_DEFERRALS``);
- it raises anything else: fail (retry with backoff, dead when attempts run out);
- cancel was asked (``django_dbqueue.cancel``): archived as cancelled, never
  retried, whether it raises ``Cancelled`` or anything else; a handler that
  returns all the same is acked;
- there is no handler: dead letter naming the queue and kind, or, with the
  queue's ``UNHANDLED = "keep"``, back in the queue for a handler to come;
- a workflow step whose rows are gone (an orphan): archived as cancelled,
  never run, with a WARNING;
- an atomic handler (``@handler(..., atomic=True)``) runs in one
  transaction with its ack: its writes commit with the ack, and roll back
  when it raises, when the lease was lost, or when the ack cannot be written.

An ``async def`` handler follows the same rules (`adecide`): a worker runs
it on its event loop (`django_dbqueue.worker.asyncloop`), where a cancel
request or ``--async-timeout`` cancels its task; `decide` and `process`,
outside a worker (tests, the immediate mode), run it to its end on an event
loop of their own.

A handler that has an ``after_record(message, outcome)`` method is told the
outcome once it is written (or ``"lease lost"``, or ``"ack unknown"``), so it
can announce what others can now read (the Tasks backend sends
``task_finished`` this way).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from asgiref.sync import sync_to_async

from . import signals
from .conf import get_settings, queue_options
from .db.transactions import write_transaction
from .exceptions import Cancelled, HandlerTimeout, NotClaimed
from .handlers import Defer, Handler, Reject, Retry, find_handler, is_async, runs_atomic
from .models import Message
from .models.consuming import error_text, finished_as
from .models.workflows import orphan_reason, step_of

logger = logging.getLogger("django_dbqueue")


class HandlerOutcome:
    """What running a message's handler came to, as ``process()`` returns it and the worker logs it.

    Not the archive's `Outcome` (acked, dead,
    expired...): a handler's ``Retry`` is ``"retried"`` here and stays live.
    """

    ACKED = "acked"
    REJECTED = "rejected"
    RETRIED = "retried"
    DEFERRED = "deferred"
    FAILED = "failed"
    UNHANDLED = "unhandled"
    CANCELLED = "cancelled"
    LEASE_LOST = "lease lost"
    # An ack whose reply was lost, on a queue with ARCHIVE off, of a message gone without a trace:
    # whether it was acked cannot be known (docs/reliability.md, "Lost connections").
    ACK_UNKNOWN = "ack unknown"


def written_as(outcome: str, done: bool | None) -> str:
    """What the answer of ``outcome``'s write makes of it: itself, ``"lease lost"`` or ``"ack unknown"``."""
    if done is None:
        return HandlerOutcome.ACK_UNKNOWN
    return outcome if done else HandlerOutcome.LEASE_LOST


@dataclass(frozen=True)
class Verdict:
    """What a handler's run decided, not yet written: ``apply()`` records it.

    Kept apart from running the handler so a worker can retry the recording
    through a database outage without running the handler twice.
    """

    outcome: str
    apply: Callable[[], bool | None]
    result: Any = None  # an ack's handler return value, for workers that ack in batches
    recorded: Callable[[str], None] | None = None  # the handler's after_record, bound to the message
    error: BaseException | str | None = None  # what the handler raised, or the reason given, for the log
    # Written already, in the handler's own transaction (an atomic handler): not an ack for a batch to write.
    committed: bool = False

    def record(self) -> str:
        try:
            done = self.apply()
        except NotClaimed:  # the handler released or failed its own message: the lease is gone
            done = False
        outcome = written_as(self.outcome, done)
        self.written(outcome)
        return outcome

    def written(self, outcome: str) -> None:
        """Tell the handler's ``after_record`` what was written (batched acks call this themselves)."""
        if self.recorded is not None:
            try:
                self.recorded(outcome)
            except Exception:  # the outcome is written; a listener's failure must not undo or repeat it
                logger.exception("after_record of a handler failed (outcome %s)", outcome)


def decide(message: Message, *, worker: str = "", handler: Handler | None = None) -> Verdict:
    """Run the handler (``handler`` overrides the registry, as exec mode does).

    With receivers of ``handler_started``/``handler_finished`` connected
    (metrics, tracing), they hear of the run; without, the cost is one test.
    An ``async def`` handler runs to its end on an event loop of its own
    (asgiref's ``async_to_sync``: its ORM calls come back to this thread);
    a worker runs it on its loop instead (`adecide`).
    """
    handler = handler or find_handler(message.queue, message.kind)
    if handler is None:
        return _unhandled(message)
    if is_async(handler):
        from asgiref.sync import async_to_sync

        return async_to_sync(adecide)(message, worker=worker, handler=handler)
    if not (signals.handler_started.receivers or signals.handler_finished.receivers):
        return _run(message, handler, worker)
    signals.handler_started.send_robust(Message, message=message, worker=worker)
    started = time.perf_counter()
    verdict = _run(message, handler, worker)
    duration = time.perf_counter() - started
    signals.handler_finished.send_robust(
        Message, message=message, worker=worker, outcome=verdict.outcome, duration=duration
    )
    return verdict


async def adecide(
    message: Message, *, worker: str = "", handler: Handler | None = None, timeout: float | None = None
) -> Verdict:
    """`decide` for an ``async def`` handler, awaited on the caller's event loop.

    The task running it may be cancelled (``asyncio`` cancellation at the
    handler's next ``await``): once cancel was asked for the message, that
    ends it as cancelled, as `Cancelled` does a sync handler. Past
    ``timeout`` seconds the handler is cancelled and the attempt fails with
    `HandlerTimeout` (retried, dead when attempts run out). Any other
    cancellation (the worker abandoning it) propagates.
    """
    handler = handler or find_handler(message.queue, message.kind)
    if handler is None:
        return _unhandled(message)
    notify = bool(signals.handler_started.receivers or signals.handler_finished.receivers)
    if notify:
        signals.handler_started.send_robust(Message, message=message, worker=worker)
    started = time.perf_counter()
    verdict = await _arun(message, handler, worker, timeout)
    if notify:
        duration = time.perf_counter() - started
        signals.handler_finished.send_robust(
            Message, message=message, worker=worker, outcome=verdict.outcome, duration=duration
        )
    return verdict


def _verdicts(message: Message, handler: Handler) -> Callable[..., Verdict]:
    after_record = getattr(handler, "after_record", None)
    return partial(Verdict, recorded=partial(after_record, message) if after_record else None)


def _cancelled_before(message: Message, verdict: Callable[..., Verdict], orphaned: str | None) -> Verdict | None:
    """A message not to run: cancel was asked, or it is a workflow step whose rows are gone (``orphaned`` says why)."""
    if message.cancel_requested():  # flagged before it started: read with the claim, or seen by a heartbeat
        return verdict(HandlerOutcome.CANCELLED, partial(message.archive_cancelled, "cancelled before it ran"))
    if orphaned is not None:
        logger.warning("message %s of queue %s: %s", message.pk, message.queue, orphaned)
        return verdict(HandlerOutcome.CANCELLED, partial(message.archive_cancelled, orphaned))
    return None


def _run(message: Message, handler: Handler, worker: str) -> Verdict:
    verdict = _verdicts(message, handler)
    orphaned = orphan_reason(message._state.db or "default", message)
    if (before := _cancelled_before(message, verdict, orphaned)) is not None:
        return before
    if runs_atomic(message.queue, message.kind, handler):
        return _run_atomic(message, handler, worker, verdict)
    try:
        result = _returned(handler(message))
    except Exception as exc:
        return _failed(message, exc, verdict)
    # A handler that finished despite a cancel request did its work: it is acked.
    return verdict(HandlerOutcome.ACKED, partial(message.ack, worker=worker, result=result), result)


def _returned(result: Any) -> Any:
    """A sync handler's return value; refused (TypeError) when it is something to await, never awaited."""
    if inspect.isawaitable(result):  # not an ``async def``, yet it returned one: never awaited, never acked
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"the handler returned {type(result).__name__} to await; declare it with async def")
    return result


class _AckRefused(Exception):
    """Raised inside an atomic handler's transaction to roll it back: the ack answered ``answer``, not True."""

    def __init__(self, answer: bool | None) -> None:
        super().__init__(answer)
        self.answer = answer


def _run_atomic(message: Message, handler: Handler, worker: str, verdict: Callable[..., Verdict]) -> Verdict:
    """Run an atomic handler and ack its message in one transaction on the message's database.

    Committed, the verdict is written already (`Verdict.committed`). Rolled
    back, nothing the handler wrote there stays: when it raised, or the ack
    or the commit failed (a failed attempt, retried after its backoff), or
    the lease was lost (written as "lease lost"). A handler that ended its
    own message (release, fail, ack...) is committed as it is, and written
    as "lease lost", as any handler's. The transaction is the queue's write
    transaction: on SQLite it takes the write lock at its start.
    """
    using = message._state.db or "default"
    token = message.lease_token
    ran = False  # the body ran to its end: an error from here on is the commit's, or an on_commit hook's
    ended_itself = False
    try:
        with write_transaction(using):
            result = _returned(handler(message))
            ended_itself = message.lease_token is None or finished_as(message) is not None
            if not ended_itself:
                answer = message.ack(worker=worker, result=result)
                if answer is not True:
                    raise _AckRefused(answer)
            ran = True
    except _AckRefused as refused:
        return verdict(HandlerOutcome.ACKED, partial(_answered, refused.answer), committed=True)
    except Exception as exc:
        if not (ran and not ended_itself and _acked_before(using, message, token)):
            return _failed(message, exc, verdict)
        # Committed, then a hook registered with transaction.on_commit() raised: the ack stands.
        logger.error(
            "message %s: acked with its handler's writes, then an on_commit hook raised", message.pk, exc_info=exc
        )
    if ended_itself:
        return verdict(HandlerOutcome.ACKED, partial(_answered, False), committed=True)
    return verdict(HandlerOutcome.ACKED, partial(_answered, True), result, committed=True)


def _acked_before(using: str, message: Message, token: str | None) -> bool:
    """After an error at an atomic handler's commit: whether its ack was committed all the same (its leased
    row is gone). Unknown (the connection is gone too) counts as not: the attempt then fails, and a
    retry that finds the row gone is written as "lease lost"."""
    try:
        return not Message.objects.using(using).filter(pk=message.pk, lease_token=token).exists()
    except Exception:
        return False


def _answered(answer: bool | None) -> bool | None:
    """A verdict's ``apply`` once its write is done: the answer that write had."""
    return answer


async def _arun(message: Message, handler: Handler, worker: str, timeout: float | None) -> Verdict:
    verdict = _verdicts(message, handler)
    orphaned = None
    if step_of(message) is not None:  # a step: its rows are read on asgiref's thread, as the async ORM's are
        orphaned = await sync_to_async(orphan_reason, thread_sensitive=True)(message._state.db or "default", message)
    if (before := _cancelled_before(message, verdict, orphaned)) is not None:
        return before
    running: Awaitable[Any] = handler(message)
    try:
        async with asyncio.timeout(timeout) as limit:
            result = await running
    except asyncio.CancelledError as exc:
        if not message.cancel_requested():
            raise  # not ours to decide: the worker abandons it
        reason = "cancelled while it ran (asyncio cancellation at the handler's next await)"
        return verdict(HandlerOutcome.CANCELLED, partial(message.archive_cancelled, reason), error=str(exc) or None)
    except Exception as exc:
        if isinstance(exc, TimeoutError) and limit.expired() and not message.cancel_requested():
            error = HandlerTimeout(f"the handler ran longer than {timeout:g}s and was cancelled")
            error.__cause__ = exc
            return verdict(HandlerOutcome.FAILED, partial(message.fail, error), error=error)
        return _failed(message, exc, verdict)
    return verdict(HandlerOutcome.ACKED, partial(message.ack, worker=worker, result=result), result)


def _failed(message: Message, exc: Exception, verdict: Callable[..., Verdict]) -> Verdict:
    """What a handler that raised ``exc`` comes to: cancelled once cancel was asked, else `_raised`."""
    if isinstance(exc, Cancelled) or message.cancel_requested():
        # Whatever the handler raised once cancel was asked, it is cancelled: never retried.
        if isinstance(exc, Cancelled):
            reason = f"cancelled while it ran: {exc}"
        else:
            reason = f"cancelled while it ran; the handler then raised:\n{error_text(exc)}"
        return verdict(HandlerOutcome.CANCELLED, partial(message.archive_cancelled, reason))
    return _raised(message, exc, verdict)


def _raised(message: Message, exc: Exception, verdict: Callable[..., Verdict]) -> Verdict:
    """The outcome of a handler that raised ``exc`` (not a cancel)."""
    if isinstance(exc, Reject):
        reason = exc.reason
        return verdict(HandlerOutcome.REJECTED, partial(message.reject, requeue=False, reason=reason), error=reason)
    if isinstance(exc, Retry):
        reason = exc.reason or "retry requested"
        if not message.attempts_left():
            reason = f"{reason}; no attempts left ({message.attempts} made)"
            rejected = partial(message.reject, requeue=False, reason=reason)
            return verdict(HandlerOutcome.REJECTED, rejected, error=reason)
        return verdict(HandlerOutcome.RETRIED, partial(message.reject, delay=exc.delay, reason=reason), error=reason)
    if isinstance(exc, Defer):
        refused = message.deferral_refused()
        if refused is not None:  # past the queue's MAX_DEFERRALS: dead, as a Retry with no attempts left
            rejected = partial(message.reject, requeue=False, reason=refused)
            return verdict(HandlerOutcome.REJECTED, rejected, error=refused)
        return verdict(HandlerOutcome.DEFERRED, partial(message.snooze, exc.until, delay=exc.delay))
    return verdict(HandlerOutcome.FAILED, partial(message.fail, exc), error=exc)


def ends_dead(message: Message, outcome: str) -> bool:
    """Whether ``outcome``, written for ``message``, dead-lettered it (for the worker's log and counts)."""
    if outcome == HandlerOutcome.REJECTED:
        return True
    if outcome == HandlerOutcome.FAILED:
        return not message.attempts_left()
    if outcome == HandlerOutcome.UNHANDLED:
        return queue_options(message.queue).unhandled != "keep"
    return False


def process(message: Message, *, worker: str = "", handler: Handler | None = None) -> str:
    """Run ``message``'s handler and apply the outcome; returns what happened.

    A failure is logged here at DEBUG: the worker, which calls `decide` itself, logs its own line instead.
    """
    verdict = decide(message, worker=worker, handler=handler)
    if verdict.outcome == HandlerOutcome.FAILED:
        logger.debug("message %s of %s failed: %r", message.pk, message.queue, verdict.error)
    return verdict.record()


def _unhandled(message: Message) -> Verdict:
    reason = f"no handler for queue {message.queue!r}, kind {message.kind!r}"
    if queue_options(message.queue).unhandled == "keep":
        # Leave it for a worker that has the handler; look again after a poll.
        return Verdict(
            HandlerOutcome.UNHANDLED, partial(message.snooze, delay=get_settings().max_poll_interval, count=False)
        )
    return Verdict(HandlerOutcome.UNHANDLED, partial(message.reject, requeue=False, reason=reason), error=reason)
