"""Writing what must not be lost through database trouble: weather waited out, permanent errors never retried.

Once a handler has run, its outcome (one message's, or a batch's acks)
must be written: running the handler again because the database was away
would be a needless duplicate. So a write that fails for weather, an
error that can pass (`is_transient`: a
deadlock, a lock wait timeout, a lost connection, a server restarting), is
retried with a growing pause of up to 5 seconds until it is written. It
stops only when the ``give_up`` event is set (the worker is past the grace
period of its stop: the lease then expires and the message runs again,
at least once).

Any other error is permanent: the same write would fail the same way for
ever, while the heartbeat kept extending the lease. It is raised at once,
for the consumer to record something else (see ``Consumer.record``). One
permanent error looks like weather: a statement larger than MySQL's
``max_allowed_packet`` makes the server drop the connection ("server has
gone away"). A write whose connection is dropped ``DROPPED_LIMIT`` times in
a row while the server answers a new connection at once is taken for that,
and raised as `DroppedWrite`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from django.db import connections

from ..db.errors import backoff, is_transient, lost_connection
from ..running import HandlerOutcome

if TYPE_CHECKING:
    from ..models import Message

logger = logging.getLogger("django_dbqueue")
T = TypeVar("T")

# How often in a row the server may drop the connection on one write, while
# answering a new connection at once, before the write is taken for the cause.
DROPPED_LIMIT = 5


class GaveUp(Exception):
    """A write was not retried further: the worker is past its grace period, or the bound ran out."""


class DroppedWrite(Exception):
    """The server drops the connection on this write every time while answering others: never retried."""


class Writer:
    """Retries one thread's writes through database weather on ``using`` (one per thread: it closes the connection)."""

    def __init__(self, using: str, worker: str, give_up: threading.Event) -> None:
        self.using = using
        self.worker = worker
        self.give_up = give_up

    def until_written(self, write: Callable[[], T], what: str, *, attempts: int | None = None) -> T:
        """``write()``, retried through errors that can pass until it succeeds.

        Raises `GaveUp` when ``give_up`` is set (checked after each
        failed try; its wait ends at once then) or after ``attempts`` tries,
        if given. A permanent error propagates at once, unchanged, or as
        `DroppedWrite` (see the module's docstring).
        """
        attempt = dropped = 0
        while True:
            try:
                return write()
            except Exception as exc:
                if not is_transient(exc, self.using):
                    raise
                attempt += 1
                if attempts is not None and attempt >= attempts:
                    raise GaveUp(f"{what}: gave up after {attempt} attempt(s)") from exc
                if self.give_up.is_set():
                    raise GaveUp(f"{what}: gave up, the worker is exiting") from exc
                dropped = dropped + 1 if self._dropped_while_up() else 0
                if dropped >= DROPPED_LIMIT:
                    raise DroppedWrite(
                        f"{what}: the server dropped the connection {dropped} times on this write while it "
                        f"answered new connections (a statement larger than it accepts?); last: {first_line(exc)}"
                    ) from exc
                self.pause(what, exc, attempt)
                if self.give_up.is_set():
                    raise GaveUp(f"{what}: gave up, the worker is exiting") from exc

    def pause(self, what: str, exc: BaseException, attempt: int = 1) -> None:
        """Log the trouble, drop the broken connection, and wait a backoff (cut short by ``give_up``)."""
        logger.warning("worker %s: %s failed (%s); retrying", self.worker, what, first_line(exc))
        connections[self.using].close()
        self.give_up.wait(backoff(min(attempt + 3, 8), cap=5.0))

    def _dropped_while_up(self) -> bool:
        """Whether the last error lost the connection although the server answers a new one at once."""
        connection = connections[self.using]
        if not lost_connection(self.using):
            return False
        connection.close()
        try:
            connection.ensure_connection()
        except Exception:
            return False  # the server is away: an outage, waited out
        return True


def warn_unwritten(worker: str, message: Message, wanted: str, outcome: str) -> None:
    """Log, once, that ``message``'s outcome ``wanted`` was not written (``outcome``: lease lost) or that
    whether it was cannot be known (ack unknown)."""
    if outcome == HandlerOutcome.ACK_UNKNOWN:
        logger.warning(
            "worker %s: message %s: the reply of its ack was lost and the message is gone; its queue keeps no "
            "archive (ARCHIVE off), so whether this ack or something else took it away cannot be known",
            worker,
            message.pk,
        )
        return
    logger.warning(
        "worker %s: message %s: lease lost before its outcome (%s) was written; it is not recorded",
        worker,
        message.pk,
        wanted,
    )


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
