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
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from ..conf import get_settings
from ..db import notify
from ..db.transactions import after_commit
from .workers import Worker

logger = logging.getLogger("django_dbqueue")

REFRESH = 1.0  # seconds a process keeps the workers' addresses before reading them again

_known: dict[str, tuple[float, dict[str, list[str]]]] = {}
_NEVER: tuple[float, dict[str, list[str]]] = (float("-inf"), {})
_lock = threading.Lock()


_nudging: dict[str, bool] = {}  # by database alias: whether its producers nudge (settings and vendor decide)


def after_enqueue(using: str, queues: Iterable[str]) -> None:
    """Nudge the workers of ``queues`` once the current transaction on ``using`` commits (at once in autocommit)."""
    nudging = _nudging.get(using)
    if nudging is None:  # decided once per alias (and again when settings change): every enqueue asks
        nudging = _nudging[using] = not notify.can_listen(using) and get_settings().nudge_host is not None
    if not nudging:
        return
    names = set(queues)
    if names:
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
    read_at, targets = _known.get(using, _NEVER)  # one dict read: no lock needed to see a whole entry
    if now - read_at < REFRESH:
        return targets
    targets = Worker.objects.using(using).nudge_addresses()
    with _lock:
        _known[using] = (now, targets)
    return targets


def forget() -> None:
    """Read the addresses, and whether to nudge at all, afresh at the next enqueue (tests, a worker that just
    registered here, changed settings)."""
    with _lock:
        _known.clear()
        _nudging.clear()


@receiver(setting_changed)
def _settings_changed(setting: str, **kwargs: Any) -> None:
    if setting in ("DBQUEUE", "DATABASES"):
        forget()
