"""The heartbeat: the worker's row, the leases of what it holds, and the periodic summary.

Each beat extends the lease of every message in the ledger (claimed,
running or waiting for its ack), so long work is not delivered twice,
writes what handlers reported since the last beat (progress, meta) and
tells them which of their messages an operator asked to cancel, and
writes the worker's row, so the reaper knows it is alive. Beats go on
through the shutdown grace (until ``finished``): running handlers keep
their leases. Every ``LOG_INTERVAL`` it logs the rate and the queues' depth.
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import connections

from ..conf import get_settings, queue_options
from ..db.errors import DATABASE_TROUBLE
from ..models import Message
from ..models import Worker as WorkerRow
from .ledger import Counts, Ledger
from .writing import first_line

logger = logging.getLogger("django_dbqueue")


class Heartbeat:
    """Owns the worker's row in ``dbqueue_worker`` and keeps the worker's leases."""

    def __init__(
        self,
        *,
        name: str,
        queues: list[str],
        using: str,
        concurrency: int,
        visibility_timeout: float | None,
        ledger: Ledger,
        supervisor: str = "",
    ) -> None:
        self.name = name
        self.supervisor = supervisor
        self.queues = queues
        self.using = using
        self.concurrency = concurrency
        self.visibility_timeout = visibility_timeout
        self.ledger = ledger
        self.nudge_address = ""  # the worker's wake-up socket, where producers nudge it (worker/listener.py)

    def lease_seconds(self, queue: str) -> float:
        """The lease a claim of ``queue`` gets: --visibility-timeout, else the queue's VISIBILITY_TIMEOUT."""
        return self.visibility_timeout or queue_options(queue).visibility_timeout

    def interval(self) -> float:
        """HEARTBEAT_INTERVAL, or less: often enough that the shortest lease is renewed well before it ends."""
        return min(get_settings().heartbeat_interval, min(map(self.lease_seconds, self.queues)) / 3)

    def run(self, finished: threading.Event) -> None:
        """Beat every interval until ``finished``; database trouble is logged and tried again next beat."""
        interval, log_interval = self.interval(), get_settings().log_interval
        last_log, last_counts = time.monotonic(), Counts(0, 0)
        while not finished.wait(interval):
            try:
                self.beat()
                elapsed = time.monotonic() - last_log
                if elapsed >= log_interval:
                    last_log, last_counts = time.monotonic(), self.log_summary(last_counts, elapsed)
            except DATABASE_TROUBLE as exc:
                logger.warning("worker %s: heartbeat failed (%s)", self.name, first_line(exc))
                connections[self.using].close()
        connections.close_all()

    def beat(self) -> None:
        """Say we are alive and keep the leases of everything we hold."""
        held = self.ledger.leases()
        for (token, seconds), ids in self.held_leases(held).items():
            Message.objects.using(self.using).extend_leases(token, ids, seconds)
        self.exchange_reports(held)
        counts = self.ledger.counts()
        if not WorkerRow.objects.using(self.using).beat(self.name, counts.processed, counts.failed):
            # the reaper took us for dead (a long pause); say we are back
            self.register()

    def exchange_reports(self, held: list[Message]) -> None:
        """Write what handlers reported since the last beat, and flag the messages whose cancel was asked.

        One statement per message that reported, one query for the cancel
        flags of all the others; none when the worker holds nothing.
        """
        messages = Message.objects.using(self.using)
        listening = []
        for message in held:
            token = message.lease_token  # read once: the handler's own release may clear it meanwhile
            if not token:
                continue
            unreported = message.unreported()
            if unreported is not None:
                count, values = unreported
                messages.write_report(message.pk, token, values)
                message.reported(count)
            if not message.cancel_requested():
                listening.append(message)
        if listening:
            flagged = messages.cancel_flagged(message.pk for message in listening)
            for message in listening:
                if message.pk in flagged:
                    message.heard_cancel()

    def held_leases(self, held: list[Message]) -> dict[tuple[str, float], list[int]]:
        """What the worker holds, as {(lease token, lease seconds): [ids]}."""
        groups: dict[tuple[str, float], list[int]] = {}
        for message in held:
            if message.lease_token:
                groups.setdefault((message.lease_token, self.lease_seconds(message.queue)), []).append(message.pk)
        return groups

    def log_summary(self, last: Counts, interval: float) -> Counts:
        counts = self.ledger.counts()
        by_queue = Message.objects.using(self.using).for_queue(self.queues).counts_by_queue()
        depth = {queue: c["ready"] + c["scheduled"] for queue, c in by_queue.items()}
        logger.info(
            "worker %s: %.1f messages/s, %d failed in the last %.0fs; depth %s",
            self.name,
            (counts.processed - last.processed) / interval,
            counts.failed - last.failed,
            interval,
            depth,
        )
        return counts

    def register(self) -> None:
        counts = self.ledger.counts()
        WorkerRow.objects.using(self.using).register(
            self.name,
            self.queues,
            self.concurrency,
            counts.processed,
            counts.failed,
            self.nudge_address,
            supervisor=self.supervisor,
        )

    def unregister(self) -> None:
        """Remove the row; if the database refuses, the reaper removes it once it is stale."""
        try:
            WorkerRow.objects.using(self.using).unregister(self.name)
        except DATABASE_TROUBLE as exc:
            logger.warning("worker %s: could not remove its row (%s); the reaper will", self.name, exc)
