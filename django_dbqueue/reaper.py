"""The reaper: housekeeping that no single worker owns.

Each pass, under a database lock so that only one reaper acts at a time:

1. workers whose heartbeat is older than ``WORKER_STALE_AFTER`` are taken
   for dead: their in-flight messages are ready again at once (sooner than
   their visibility timeout), or dead-lettered when that was their last
   attempt, and their rows are removed;
2. messages whose lease expired on their last attempt are dead-lettered
   (poison messages that kill the worker running them are never claimed
   again, see the claim's filter);
3. messages past ``expires_at`` that nobody holds are archived as expired;
4. archive rows older than their queue's ``RETENTION_DAYS`` are deleted, in
   batches of ``REAP_BATCH_SIZE`` so no statement holds locks for long;
5. on PostgreSQL, the live table is analysed when much of it changed, so the
   claim keeps walking its index (see ``vendor.refresh_statistics``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import timedelta

from django.db import connections
from django.db.models import Q

from . import signals
from .conf import get_settings, queue_options
from .models import ArchivedMessage, Message, Outcome, Worker
from .operations import archive_row
from .transient import with_retries
from .vendor import DbNow, db_now, refresh_statistics, try_lock, write_transaction

logger = logging.getLogger("django_dbqueue")
LOCK_NAME = "django_dbqueue.reaper"


@dataclass
class ReapReport:
    """What one pass did, for the log and ``reapqueue``'s output."""

    stale_workers: int = 0
    released: int = 0
    poison: int = 0
    expired: int = 0
    pruned: int = 0
    analyzed: bool = False

    @property
    def did_something(self) -> bool:
        return any(asdict(self).values())

    def __str__(self) -> str:
        return (
            f"{self.stale_workers} stale worker(s) removed, {self.released} message(s) released, "
            f"{self.poison} poison message(s) dead-lettered, {self.expired} expired, "
            f"{self.pruned} archive row(s) pruned" + (", statistics refreshed" if self.analyzed else "")
        )


def lock_name(using: str) -> str:
    """MySQL's lock names are server-wide: name the database, so reapers of different
    databases on one server do not skip each other's passes."""
    return f"{LOCK_NAME}:{connections[using].settings_dict['NAME']}"[:64]


class Reaper:
    def __init__(self, using: str = "default", batch_size: int | None = None) -> None:
        self.using = using
        self.batch_size = batch_size or get_settings().reap_batch_size

    def run_once(self) -> ReapReport | None:
        """One pass; None when another reaper holds the lock."""
        with try_lock(self.using, lock_name(self.using)) as held:
            if not held:
                return None
            report = ReapReport()
            self.release_stale_workers(report)
            report.poison += self.dead_letter_poison()
            report.expired += self.expire()
            report.pruned += self.prune()
            report.analyzed = refresh_statistics(self.using, Message._meta.db_table)
            return report

    # --- the steps -------------------------------------------------------------

    def release_stale_workers(self, report: ReapReport) -> None:
        stale_after = get_settings().worker_stale_after
        stale = list(
            Worker.objects.using(self.using)
            .filter(last_heartbeat_at__lt=DbNow(-stale_after))
            .values_list("name", flat=True)
        )
        for name in stale:
            held = Message.objects.using(self.using).filter(claimed_by=name, lease_token__isnull=False)
            for message in held:
                if message.attempts >= (message.max_attempts or queue_options(message.queue).max_attempts):
                    report.poison += self._dead(message, f"worker {name} stopped answering during its last attempt")
            report.released += with_retries(
                self.using,
                lambda name=name: (
                    Message.objects.using(self.using)
                    .filter(claimed_by=name, lease_token__isnull=False)
                    .update(lease_token=None, available_at=DbNow(), claimed_by="")
                ),
                what="release of a stale worker's messages",
            )
            Worker.objects.using(self.using).filter(name=name, last_heartbeat_at__lt=DbNow(-stale_after)).delete()
            logger.warning("reaper: worker %s stopped answering; its messages are back in the queue", name)
        report.stale_workers += len(stale)

    def dead_letter_poison(self) -> int:
        """Dead-letter messages whose lease ran out on their last attempt."""
        done = 0
        messages = Message.objects.using(self.using)
        queues = messages.filter(lease_token__isnull=False, available_at__lte=DbNow()).values_list("queue", flat=True)
        for queue in sorted(set(queues)):
            # Each queue by its own MAX_ATTEMPTS default, in SQL, so a crowd of ordinary
            # expired leases cannot hide the poison ones from a batch.
            poison = messages.filter(queue=queue).poison(queue_options(queue).max_attempts)
            for message in poison.order_by("id")[: self.batch_size]:
                reason = f"lease expired on attempt {message.attempts}: the worker died running it"
                done += self._dead(message, reason)
        return done

    def _dead(self, message: Message, reason: str) -> int:
        """Archive one held message as dead, only if nobody changed it since we read it."""
        from .operations import _finish

        message.last_error = f"{message.last_error}\n{reason}".strip()
        leased = Message.objects.using(self.using).filter(pk=message.pk, lease_token=message.lease_token)
        return int(_finish(message, Outcome.DEAD, leased=leased, worker="reaper", error=message.last_error))

    def expire(self) -> int:
        """Archive, as expired, messages past ``expires_at`` that no worker holds."""
        total = 0
        while True:
            messages, rows = with_retries(self.using, self._expire_batch, what="expiry")
            total += len(messages)
            if messages and signals.listened(signals.message_expired):
                archived = signals.settle(rows, self.using)
                events = [
                    {"message": m, "queue": m.queue, "archived": a} for m, a in zip(messages, archived, strict=True)
                ]
                signals.send(signals.message_expired, self.using, events)
            if len(messages) < self.batch_size:
                return total

    def _expire_batch(self) -> tuple[list[Message], list[ArchivedMessage]]:
        with write_transaction(self.using):
            rows = list(
                Message.objects.using(self.using)
                .select_for_update(skip_locked=True)
                .filter(expires_at__lte=DbNow())
                .filter(Q(lease_token__isnull=True) | Q(available_at__lte=DbNow()))
                .order_by("expires_at")[: self.batch_size]
            )
            if not rows:
                return [], []
            Message.objects.using(self.using).filter(pk__in=[m.pk for m in rows])._raw_delete(self.using)
            archived = [archive_row(m, Outcome.EXPIRED, worker="reaper", error=m.last_error) for m in rows]
            ArchivedMessage.objects.using(self.using).bulk_create(archived)
            return rows, archived

    def prune(self) -> int:
        """Delete archive rows past their queue's retention, a batch at a time."""
        dbq = get_settings()
        now = db_now(self.using)
        total = 0
        configured = dict(dbq.queues)
        # Each configured queue by its own retention; all others by the default.
        targets = [(Q(queue=name), options.retention_days) for name, options in configured.items()]
        targets.append((~Q(queue__in=list(configured)), dbq.defaults.retention_days))
        for match, days in targets:
            if days is None:
                continue
            old = ArchivedMessage.objects.using(self.using).filter(match, finished_at__lt=now - timedelta(days=days))
            while True:
                ids = list(old.order_by("finished_at").values_list("pk", flat=True)[: self.batch_size])
                if not ids:
                    break
                total += with_retries(
                    self.using,
                    lambda ids=ids: (
                        ArchivedMessage.objects.using(self.using).filter(pk__in=ids)._raw_delete(self.using)
                    ),
                    what="archive pruning",
                )
        return total
