"""Nudging idle workers once an enqueue commits, where the database cannot notify them.

On MySQL/MariaDB and SQLite a worker would otherwise find a new message
only at its next poll (up to ``MAX_POLL_INTERVAL``). After the enqueue's
transaction commits, the producer sends the queue's name to the workers
that serve it (their addresses read from the worker rows at most once per
``REFRESH`` seconds per process). Best effort: an error never reaches the
enqueue, and a lost nudge only means the worker finds the message at its
next poll (docs/workers.md, "Waking idle workers").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from ..conf import get_settings
from ..db import notify
from ..db.transactions import after_commit
from .workers import Worker

logger = logging.getLogger("django_dbqueue")

REFRESH = 1.0  # seconds a process keeps the workers' addresses before reading them again

_known: dict[str, tuple[float, dict[str, list[str]]]] = {}
_lock = threading.Lock()


def after_enqueue(using: str, queues: Iterable[str]) -> None:
    """Nudge the workers of ``queues`` once the current transaction on ``using`` commits (at once in autocommit)."""
    names = set(queues)
    if not names or notify.can_listen(using) or get_settings().nudge_host is None:
        return
    after_commit(using, lambda: send(using, names))


def send(using: str, queues: set[str]) -> None:
    """One datagram per queue and worker address; never raises."""
    try:
        targets = addresses(using)
        for queue in queues:
            for address in targets.get(queue, ()):
                notify.nudge(address, queue)
    except Exception as exc:  # the enqueue is committed; a nudge that cannot go is not its failure
        logger.debug("could not nudge the workers of %s: %s", sorted(queues), exc)


def addresses(using: str) -> dict[str, list[str]]:
    """The workers' nudge addresses by queue, read at most once per REFRESH seconds."""
    now = time.monotonic()
    with _lock:
        read_at, targets = _known.get(using, (float("-inf"), {}))
    if now - read_at < REFRESH:
        return targets
    targets = Worker.objects.using(using).nudge_addresses()
    with _lock:
        _known[using] = (now, targets)
    return targets


def forget() -> None:
    """Read the addresses afresh at the next enqueue (tests, and a worker that just registered here)."""
    with _lock:
        _known.clear()
