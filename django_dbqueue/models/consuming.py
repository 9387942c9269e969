"""What a consumer does with a message it claimed: acknowledge, fail, reject, snooze, extend, release.

Each is one guarded statement: it changes the message only while the
caller's lease holds (``WHERE id = ? AND lease_token = ? AND available_at
> now``) and returns False, changing nothing, when the lease was lost. A
late acknowledgement from a worker whose lease ran out is refused the same
way, whether or not someone else claimed the message since.
"""

from __future__ import annotations

import random
import traceback
from datetime import datetime, timedelta
from typing import Any

from django.db.models import F

from .. import validation
from ..conf import queue_options
from ..db.clock import DbNow
from ..db.errors import with_retries
from ..exceptions import InvalidOption
from . import events, landed
from .archive import ArchivedMessage, Outcome
from .protocols import LiveMessage


def error_text(error: BaseException | str) -> str:
    """An exception as its traceback, or a string, made storable on every database."""
    if isinstance(error, BaseException):
        return validation.storable_text("".join(traceback.format_exception(error)))
    return validation.storable_text(str(error))


def backoff_delay(message: LiveMessage) -> float:
    """Seconds before retry number ``attempts``: exponential, capped, with jitter."""
    options = queue_options(message.queue)
    exponent = min(max(message.attempts - 1, 0), 64)  # 2**64 seconds is past any cap already
    delay = min(options.backoff_max, options.backoff_base * 2**exponent)
    return delay * (1 + random.uniform(-options.backoff_jitter, options.backoff_jitter)) if delay else 0.0


def _finish(message: LiveMessage, outcome: str, **row: Any) -> bool | None:
    """Archive ``message`` as ``outcome`` while its holder's lease holds; its signal when that is done.

    None: an ack whose answer cannot be known (`Finishing.finish`).
    """
    # The manager's methods are typed on the queryset (`finishing.Finishing.finish`), not on the protocol.
    finished: tuple[bool | None, ArchivedMessage | None] = (
        type(message).objects.using(message._state.db or "default").finish(message, outcome, **row)
    )
    done, archived = finished
    if done:
        message.__dict__[FINISHED] = outcome
        events.finished(message, outcome, archived, row)
    return done


# Where a message instance keeps the outcome its lease holder finished it with (`finished_as`).
FINISHED = "_dbqueue_finished_as"


def finished_as(message: LiveMessage) -> str | None:
    """The outcome this instance's holder archived it with (ack, dead letter, cancel), else None."""
    return message.__dict__.get(FINISHED)


def _archive(message: LiveMessage, outcome: str, **row: Any) -> bool:
    """`_finish` as an outcome that is always archived (not acked): its answer is never unknown."""
    return bool(_finish(message, outcome, **row))


class ConsumerActions:
    """Mixed into `Message`: the lease holder's operations.

    Each method's ``self`` is a `Message`; what they use of it is `LiveMessage`.
    """

    # The columns written, declared for the type checker (else mypy takes
    # ``self.lease_token = None`` for an attribute of this class, typed None).
    lease_token: str | None
    last_error: str
    deferrals: int
    # Seconds until the retry that this instance's `fail` scheduled (for the worker's line), else None.
    retry_in: float | None = None

    def ack(self: LiveMessage, *, worker: str | None = None, result: Any = None) -> bool | None:
        """Finish successfully: archived as acked (unless the queue's ARCHIVE is off) and deleted.

        ``result`` (the handler's return value) is kept in the archive when it is JSON.
        True: acked; False: the lease was lost. None: unknown, only on a queue
        with ARCHIVE off, after a lost reply, when the message is gone and
        nothing in the database says whether this ack took it away
        (docs/reliability.md, "Lost connections").
        """
        return _finish(self, Outcome.ACKED, worker=worker or "", result=result)

    def archive_cancelled(self: LiveMessage, reason: str = "cancelled while it ran") -> bool:
        """Archive as cancelled under the caller's lease: its handler stopped for a cancel request."""
        return _archive(self, Outcome.CANCELLED, error=validation.storable_text(reason))

    def fail(self: LiveMessage, error: BaseException | str, *, retry: bool = True) -> bool:
        """Record a failed attempt: back in the queue after a backoff, or dead when none are left."""
        text = error_text(error)
        if retry and self.attempts_left():
            delay = backoff_delay(self)
            changes = {"lease_token": None, "available_at": DbNow(delay), "last_error": text}
            landed_as = (self.claimed_by, self.attempts)
            done: bool = type(self).objects.update_leased(self, "fail", landed_as=landed_as, **changes)
            if done:
                self.lease_token = None
                self.last_error = text
                self.retry_in = delay
                events.failed(self, text, delay)
                return True
            return False
        self.last_error = text
        return _archive(self, Outcome.DEAD, error=text)

    def reject(
        self: LiveMessage, *, requeue: bool = True, delay: float | timedelta | None = None, reason: str = ""
    ) -> bool:
        """Give the message up: back in the queue (after ``delay``), or dead-lettered with ``reason``.

        A requeue on the message's last attempt dead-letters it instead: no
        message runs more often than its attempts allow.
        """
        seconds = validation.seconds(delay or 0, "delay")
        reason = validation.storable_text(str(reason))
        if not requeue:
            return _archive(self, Outcome.DEAD, error=reason or "rejected")
        if not self.attempts_left():
            why = f"rejected for a requeue on its last attempt ({self.attempts} of {self.max_attempts_allowed()})"
            return _archive(self, Outcome.DEAD, error=f"{reason}\n{why}".strip())
        changes: dict[str, Any] = {"lease_token": None, "available_at": DbNow(seconds)}
        if reason:
            changes["last_error"] = reason
        landed_as = (self.claimed_by, self.attempts)
        done: bool = type(self).objects.update_leased(self, "reject", landed_as=landed_as, **changes)
        if done:
            self.lease_token = None
            events.failed(self, reason or self.last_error, seconds)
        return done

    def snooze(
        self: LiveMessage, until: datetime | None = None, *, delay: float | timedelta | None = None, count: bool = True
    ) -> bool:
        """Put the message off to a later time without using an attempt.

        Each snooze counts as a deferral; past the queue's ``MAX_DEFERRALS``
        the message is dead-lettered instead, with a reason that says so, so a
        handler that always defers cannot keep it for ever. ``count=False`` is
        for the queue's own waiting (``UNHANDLED = "keep"``), which is no
        handler's decision.
        """
        if (until is None) == (delay is None):
            raise InvalidOption("snooze needs exactly one of until or delay")
        when = (
            validation.aware_datetime(until, "until")
            if until is not None
            else DbNow(validation.seconds(delay, "delay"))
        )
        changes: dict[str, Any] = {"lease_token": None, "available_at": when, "attempts": F("attempts") - 1}
        if count:
            refused = self.deferral_refused()
            if refused is not None:
                return _archive(self, Outcome.DEAD, error=refused)
            changes["deferrals"] = F("deferrals") + 1
        landed_as = (self.claimed_by, self.attempts - 1)
        done: bool = type(self).objects.update_leased(self, "snooze", landed_as=landed_as, **changes)
        if done:
            self.lease_token = None
            if count:
                self.deferrals += 1
        return done

    def extend_lease(self: LiveMessage, seconds: float | timedelta) -> bool:
        """Push the lease's end to ``seconds`` from now (database clock). False if the lease was lost."""
        amount = validation.seconds(seconds, "seconds", allow_zero=False)
        done: bool = type(self).objects.update_leased(self, "extend lease of", available_at=DbNow(amount))
        return done

    def release(self: LiveMessage) -> bool:
        """Give the message back unprocessed: it keeps its place, and the claim's attempt is not counted."""
        using = self._state.db or "default"
        live = type(self).objects.using(using)
        leased = live.leased(self)

        def change() -> bool:
            return bool(leased.give_back(count_attempt=False) == 1)

        def found() -> bool:
            # A give-back empties the worker and, here, gives the claim's attempt back.
            return landed.changed(live, self, worker="", attempts=self.attempts - 1)

        done = with_retries(using, lambda: landed.guarded(using, self, change, found, False), what=f"release {self.pk}")
        if done:
            self.lease_token = None
        return done
