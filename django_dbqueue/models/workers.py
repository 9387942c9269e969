"""Worker rows: one per running ``runqueueworker``; its heartbeat tells the reaper it is alive."""

from __future__ import annotations

import ipaddress
import os
import socket

from django.db import models

from ..db.clock import DbNow
from ..db.errors import with_retries
from ..db.transactions import write_transaction


def is_loopback(address: str) -> bool:
    """Whether a nudge address (``host:port``) is on the loopback interface."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class WorkerQuerySet(models.QuerySet["Worker"]):
    def register(
        self,
        name: str,
        queues: list[str],
        concurrency: int,
        processed: int = 0,
        failed: int = 0,
        nudge_address: str = "",
    ) -> None:
        """Create the worker's row, or bring it back after the reaper took the worker for dead."""
        values = {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "queues": queues,
            "concurrency": concurrency,
            "nudge_address": nudge_address,
            "last_heartbeat_at": DbNow(),
        }

        def run() -> None:
            # update_or_create reads, then writes: on SQLite that needs the write lock from the start.
            with write_transaction(self.db):
                self.update_or_create(
                    name=name,
                    defaults={**values, "processed": processed, "failed": failed},
                    create_defaults={**values, "started_at": DbNow()},
                )

        with_retries(self.db, run, what="worker registration")

    def beat(self, name: str, processed: int, failed: int) -> bool:
        """Say the worker is alive; False when its row is gone (the reaper took it for dead)."""
        return bool(self.filter(name=name).update(last_heartbeat_at=DbNow(), processed=processed, failed=failed))

    def stale(self, after: float) -> WorkerQuerySet:
        """Workers whose last heartbeat is older than ``after`` seconds, by the database clock."""
        return self.filter(last_heartbeat_at__lt=DbNow(-after))

    def lock_if_stale(self, name: str, after: float) -> bool:
        """Lock worker ``name``'s row if it is still stale; call inside a transaction.

        A heartbeat that arrives meanwhile waits for the caller's commit (and
        then finds no row, and registers again).
        """
        return self.select_for_update().stale(after).filter(name=name).exists()

    def nudge_addresses(self) -> dict[str, list[str]]:
        """``{queue: [address]}`` of the workers that take nudges (docs/workers.md, "Waking idle workers").

        A loopback address reaches only the producer's own host: workers of
        other hosts that bound one are left out.
        """
        here = socket.gethostname()
        targets: dict[str, list[str]] = {}
        for hostname, queues, address in self.exclude(nudge_address="").values_list(
            "hostname", "queues", "nudge_address"
        ):
            if hostname != here and is_loopback(address):
                continue
            for queue in queues:
                targets.setdefault(queue, []).append(address)
        return targets

    def unregister(self, name: str) -> None:
        self.filter(name=name).delete()


class Worker(models.Model):
    """A running ``runqueueworker`` process; its heartbeat tells the reaper it is alive."""

    name = models.CharField(max_length=255, unique=True, help_text="hostname:pid:random, as written in claimed_by.")
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveSmallIntegerField(default=1)
    started_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()
    processed = models.PositiveBigIntegerField(default=0)
    failed = models.PositiveBigIntegerField(default=0)
    nudge_address = models.CharField(
        max_length=64, blank=True, default="", help_text="Where an enqueue nudges it awake (not on PostgreSQL)."
    )

    objects = WorkerQuerySet.as_manager()

    class Meta:
        app_label = "django_dbqueue"
        db_table = "dbqueue_worker"
        ordering = ["hostname", "pid"]
        indexes = [models.Index(fields=["last_heartbeat_at"], name="dbqueue_worker_heartbeat")]

    def __str__(self) -> str:
        return self.name
