"""Worker rows: one per running ``runqueueworker``; its heartbeat tells the reaper it is alive.

A pool (``runqueueworker --processes``) has a row for its supervisor, whose
``pool`` holds the pool's state, and one per child, whose ``supervisor``
names the supervisor's row: the admin and ``queuestats`` show the tree.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

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


# Seconds: older than any WORKER_STALE_AFTER (at most a day).
LONG_AGO = 366 * 24 * 3600.0


class WorkerQuerySet(models.QuerySet["Worker"]):
    def register(
        self,
        name: str,
        queues: list[str],
        concurrency: int,
        processed: int = 0,
        failed: int = 0,
        nudge_address: str = "",
        *,
        supervisor: str = "",
        pool: dict[str, Any] | None = None,
    ) -> None:
        """Create the worker's row, or bring it back after the reaper took the worker for dead.

        ``supervisor``: the name of the pool supervisor's row, for a pool's
        child; ``pool``: the pool's state, for a supervisor's own row.
        """
        values = {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "queues": queues,
            "concurrency": concurrency,
            "nudge_address": nudge_address,
            "supervisor": supervisor,
            "pool": pool,
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

    def beat_pool(self, name: str, pool: dict[str, Any]) -> bool:
        """A supervisor says it is alive, with its pool's state; False when its row is gone."""
        return bool(self.filter(name=name).update(last_heartbeat_at=DbNow(), pool=pool))

    def mark_dead(self, names: list[str]) -> int:
        """Rows of workers known to be dead (their supervisor saw them exit): stale at once.

        The reaper's next pass gives their messages back by its usual rules,
        without waiting ``WORKER_STALE_AFTER`` for a heartbeat that cannot come.
        """
        if not names:
            return 0
        return self.filter(name__in=names).update(last_heartbeat_at=DbNow(-LONG_AGO))

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
    """A running ``runqueueworker`` process (or a pool's supervisor); its heartbeat tells the reaper it is alive."""

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
    supervisor = models.CharField(
        max_length=255, blank=True, default="", help_text="A pool's child: the name of its supervisor's row."
    )
    pool = models.JSONField(
        null=True, blank=True, default=None, help_text="A pool's supervisor: the pool's state (its children, scaling)."
    )

    objects = WorkerQuerySet.as_manager()

    class Meta:
        app_label = "django_dbqueue"
        db_table = "dbqueue_worker"
        ordering = ["hostname", "pid"]
        indexes = [models.Index(fields=["last_heartbeat_at"], name="dbqueue_worker_heartbeat")]

    def __str__(self) -> str:
        return self.name

    @property
    def is_supervisor(self) -> bool:
        """Whether this row is a pool's supervisor (it runs no handler; its children do)."""
        return self.pool is not None
