"""Waking an idle consumer when a message lands in one of the worker's queues.

PostgreSQL: the trigger of migration 0002 sends ``NOTIFY`` per INSERT
statement and queue; `django_dbqueue.db.notify.notifications`
listens on a connection of its own. A listener that fails (the server
restarting, say) logs, waits a second and listens again.

Elsewhere, with ``NUDGE_HOST`` set: a UDP socket whose address the worker
row carries; producers send it the queue's name after their enqueue
commits (`django_dbqueue.models.wakeups`). Without either, consumers
only poll; with them, polling goes on too, as the fallback.
"""

from __future__ import annotations

import logging
import threading

from ..db import notify

logger = logging.getLogger("django_dbqueue")


class Listener:
    def __init__(self, *, name: str, queues: list[str], using: str, nudge_host: str | None = None) -> None:
        self.name = name
        self.queues = set(queues)
        self.using = using
        self.nudge_host = nudge_host
        self.receiver: notify.NudgeReceiver | None = None

    def open(self) -> str:
        """Bind the nudge socket where there is no NOTIFY; its address for the worker row ("" when none)."""
        if notify.can_listen(self.using) or self.nudge_host is None:
            return ""
        try:
            self.receiver = notify.NudgeReceiver(self.nudge_host)
        except OSError as exc:
            logger.warning("worker %s: cannot take nudges on %s (%s); polling only", self.name, self.nudge_host, exc)
            return ""
        return self.receiver.address

    def available(self) -> bool:
        """Whether something can wake this worker: PostgreSQL's notifications, or an open nudge socket."""
        return notify.can_listen(self.using) or self.receiver is not None

    def run(self, stopping: threading.Event, wake: threading.Event) -> None:
        """Set ``wake`` on each notification or nudge for one of our queues, until ``stopping``."""
        if self.receiver is not None:
            self.receiver.run(stopping.is_set, lambda queue: self._heard(queue, wake))
            return
        while not stopping.is_set():
            try:
                for queue in notify.notifications(self.using, stopping.is_set):
                    self._heard(queue, wake)
            except ImportError:
                logger.warning("worker %s: LISTEN needs psycopg 3; polling instead", self.name)
                return
            except Exception as exc:  # the database restarting, say: polling still works
                logger.warning("worker %s: listener failed (%s); reconnecting", self.name, exc)
                stopping.wait(1.0)

    def _heard(self, queue: str | None, wake: threading.Event) -> None:
        if queue in self.queues:
            wake.set()
