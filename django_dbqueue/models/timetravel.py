"""Moving live messages through time, for tests of delayed and scheduled work.

The queue judges every time by the database server's clock (``db.clock``),
which a test cannot move. Moving the messages' own times back by the same
amount is equivalent for the queue: a message delayed by an hour, moved
back an hour, is due now, and a lease or an ``expires_at`` runs out as it
would have.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.db.models import F

from ..db.clock import DbNow
from .messages import Message

# Every time column of a live message; NULLs (no claim, no expiry) stay NULL.
TIMES = ("available_at", "first_available_at", "created_at", "claimed_at", "expires_at")


def shift_back(using: str, amount: timedelta, queues: Iterable[str] | None = None) -> int:
    """Move every time of the live messages (of ``queues``) ``amount`` earlier; returns how many rows moved."""
    rows = Message.objects.using(using)
    if queues is not None:
        rows = rows.filter(queue__in=list(queues))
    return rows.update(**{column: F(column) - amount for column in TIMES})


def make_ready(using: str, queues: Iterable[str] | None = None) -> int:
    """Make every scheduled (delayed, backing off, deferred) message that nobody holds ready now."""
    rows = Message.objects.using(using).scheduled()
    if queues is not None:
        rows = rows.filter(queue__in=list(queues))
    return rows.update(available_at=DbNow())
