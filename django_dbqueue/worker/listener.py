"""PostgreSQL: wake an idle consumer when a message lands in one of the worker's queues.

The trigger of migration 0002 sends ``NOTIFY`` per INSERT statement and
queue; :func:`django_dbqueue.db.notify.notifications` listens on a
connection of its own. Elsewhere there is nothing to listen to, and
consumers poll. A listener that fails (the server restarting, say) logs,
waits a second and listens again; polling goes on meanwhile.
"""

from __future__ import annotations

import logging
import threading

from ..db import notify

logger = logging.getLogger("django_dbqueue")


class Listener:
    def __init__(self, *, name: str, queues: list[str], using: str) -> None:
        self.name = name
        self.queues = set(queues)
        self.using = using

    def available(self) -> bool:
        """Whether this database sends notifications (PostgreSQL)."""
        return notify.can_listen(self.using)

    def run(self, stopping: threading.Event, wake: threading.Event) -> None:
        """Set ``wake`` on each notification for one of our queues, until ``stopping``."""
        while not stopping.is_set():
            try:
                for queue in notify.notifications(self.using, stopping.is_set):
                    if queue in self.queues:
                        wake.set()
            except ImportError:
                logger.warning("worker %s: LISTEN needs psycopg 3; polling instead", self.name)
                return
            except Exception as exc:  # the database restarting, say: polling still works
                logger.warning("worker %s: listener failed (%s); reconnecting", self.name, exc)
                stopping.wait(1.0)
