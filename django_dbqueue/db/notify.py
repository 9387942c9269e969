"""Waking idle workers when messages arrive.

PostgreSQL has ``LISTEN/NOTIFY``: a statement-level trigger (installed by
migration 0002, whose SQL is frozen there) notifies once per INSERT
statement and queue, delivered at commit, so a worker never wakes for a
message it cannot see yet. Plain-SQL producers trigger it too. Other
databases have no such thing: their workers poll.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from django.db import connections

NOTIFY_CHANNEL = "dbqueue"


def can_listen(using: str) -> bool:
    """Whether workers of this database can wait for notifications instead of polling."""
    return connections[using].vendor == "postgresql"


def notifications(using: str, stop: Callable[[], bool], timeout: float = 1.0) -> Iterator[str | None]:
    """On PostgreSQL, yield the queue name of each NOTIFY (None every ``timeout`` seconds).

    Uses its own connection in autocommit, never Django's: LISTEN must not sit
    inside the claim transactions. Elsewhere it returns at once (workers poll).
    """
    connection = connections[using]
    if not can_listen(using):
        return
    import psycopg

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        while not stop():
            got = False
            for notify in listener.notifies(timeout=timeout, stop_after=1):
                got = True
                yield notify.payload
            if not got:
                yield None
