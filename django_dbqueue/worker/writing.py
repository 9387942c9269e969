"""Writing what must not be lost through database trouble: retried until written.

Once a handler has run, its outcome (one message's, or a batch's acks)
must be written: running the handler again because the database was away
would be a needless duplicate. So the write is retried, with a growing
pause of up to 5 seconds, until it is written. It stops only when the
``give_up`` event is set (the worker abandoned its handlers at the end of
the grace period) or after ``attempts`` tries, if given; then the lease
expires and the message runs again: at least once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from django.db import connections

from ..db.errors import DATABASE_TROUBLE, backoff

logger = logging.getLogger("django_dbqueue")
T = TypeVar("T")


class GaveUp(Exception):
    """A write was not retried further (the worker is past its grace period, or the bound ran out)."""


class Writer:
    """Retries one thread's writes through database trouble on ``using`` (one per thread: it closes the connection)."""

    def __init__(self, using: str, worker: str, give_up: threading.Event) -> None:
        self.using = using
        self.worker = worker
        self.give_up = give_up

    def until_written(self, write: Callable[[], T], what: str, *, attempts: int | None = None) -> T:
        """``write()``, retried on database trouble until it succeeds; raises :class:`GaveUp` otherwise.

        Checked before each retry: the ``give_up`` event (its wait ends
        at once when it is set), and ``attempts``, a bound on the tries.
        Anything but database trouble propagates at once.
        """
        attempt = 0
        while True:
            try:
                return write()
            except DATABASE_TROUBLE as exc:
                attempt += 1
                if attempts is not None and attempt >= attempts:
                    raise GaveUp(f"{what}: gave up after {attempt} attempt(s)") from exc
                self.pause(what, exc, attempt)
                if self.give_up.is_set():
                    raise GaveUp(f"{what}: gave up, the worker is exiting") from exc

    def pause(self, what: str, exc: BaseException, attempt: int = 1) -> None:
        """Log the trouble, drop the broken connection, and wait a backoff (cut short by ``give_up``)."""
        logger.warning("worker %s: %s failed (%s); retrying", self.worker, what, first_line(exc))
        connections[self.using].close()
        self.give_up.wait(backoff(min(attempt + 3, 8), cap=5.0))


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
