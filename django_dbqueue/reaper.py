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
4. with ``ARCHIVE_PARTITIONS`` (docs/archive.md), partitions are kept
   created ahead and those older than every queue's ``RETENTION_DAYS`` are
   dropped whole; then archive rows older than their queue's
   ``RETENTION_DAYS`` are deleted, in
   batches of ``REAP_BATCH_SIZE`` so no statement holds locks for long, and
   so are workflows finished longer ago than the default ``RETENTION_DAYS``;
   enqueued workflow steps whose message was archived without settling them
   (a plain SQL consumer) are settled, a batch a pass (docs/workflows.md);
5. on PostgreSQL, the live table and the archive are vacuumed when their
   dead rows pile up (autovacuum off or lagging), the live table's indexes
   are rebuilt once a drained backlog left them large, and the live table
   is analysed when much of it changed, so the claim keeps walking its
   index (see ``db.stats``).

`Reaper.loop` runs a pass every ``REAP_INTERVAL`` seconds for both
``reapqueue --loop`` and ``runqueueworker --reap``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

from django.db import connections
from django.db.models import Q

from . import signals
from .conf import get_settings, queue_options
from .db import transactions
from .db.clock import db_now
from .db.errors import DATABASE_TROUBLE, with_retries
from .db.stats import refresh_statistics, shrink_indexes, vacuum_if_bloated
from .db.transactions import write_transaction
from .models import ArchivedMessage, Message, Outcome, Worker, WorkflowRun, events, flow, workflows
from .models.joins import EDGE_TABLE, STEP_TABLE
from .models.partitions import ArchiveLayout
from .operations import finish
from .progress import NullProgress, Progress

logger = logging.getLogger("django_dbqueue")
LOCK_NAME = "django_dbqueue.reaper"
# After the partition upkeep gave up behind a long transaction on the archive, it waits this long before
# its next try, doubling up to the most (each try holds acks up for as long as it waits for its lock).
UPKEEP_BACKOFF_MIN = 30.0
UPKEEP_BACKOFF_MAX = 900.0


def lock_name(using: str) -> str:
    """The lock one reaper pass holds on database ``using``."""
    return transactions.lock_name(using, LOCK_NAME)


@dataclass
class ReapReport:
    """What one pass did, for the log and ``reapqueue``'s output."""

    stale_workers: int = 0
    released: int = 0
    poison: int = 0
    cancelled: int = 0
    expired: int = 0
    pruned: int = 0
    partitions_created: int = 0
    partitions_dropped: int = 0
    partitions_freed: int = 0
    flow_pruned: int = 0
    workflows_pruned: int = 0
    steps_settled: int = 0
    vacuumed: bool = False
    reindexed: bool = False
    analyzed: bool = False

    @property
    def did_something(self) -> bool:
        return any(asdict(self).values())

    def __str__(self) -> str:
        return (
            f"{self.stale_workers} stale worker(s) removed, {self.released} message(s) released, "
            f"{self.poison} poison message(s) dead-lettered, {self.cancelled} cancelled, {self.expired} expired, "
            f"{self.pruned} archive row(s) pruned"
            + (f", {self.partitions_created} archive partition(s) created" if self.partitions_created else "")
            + (f", {self.partitions_dropped} archive partition(s) dropped" if self.partitions_dropped else "")
            + (f", {self.partitions_freed} retired partition table(s) freed" if self.partitions_freed else "")
            + (f", {self.flow_pruned} flow-control row(s) pruned" if self.flow_pruned else "")
            + (f", {self.workflows_pruned} workflow(s) pruned" if self.workflows_pruned else "")
            + (f", {self.steps_settled} workflow step(s) settled by the sweep" if self.steps_settled else "")
            + (", dead rows vacuumed" if self.vacuumed else "")
            + (", indexes rebuilt" if self.reindexed else "")
            + (", statistics refreshed" if self.analyzed else "")
        )


class Reaper:
    """``progress``: where the pruning reports its progress (``reapqueue`` on a terminal); silent by default."""

    def __init__(self, using: str = "default", batch_size: int | None = None, progress: Progress | None = None) -> None:
        self.using = using
        self.batch_size = batch_size or get_settings().reap_batch_size
        self.progress = progress or NullProgress()
        self._told_plain = False  # the warning that the setting asks for partitions the archive lacks: once
        # After the partition upkeep met a long transaction on the archive: not tried again before then.
        self._upkeep_after = 0.0
        self._upkeep_backoff = 0.0

    def run_once(self) -> ReapReport | None:
        """One pass; None when another reaper holds the lock."""
        with transactions.try_lock(self.using, lock_name(self.using)) as held:
            if not held:
                return None
            report = ReapReport()
            self.release_stale_workers(report)
            report.cancelled += self.cancel_abandoned()
            report.poison += self.dead_letter_poison()
            report.expired += self.expire()
            self.keep_partitions(report)
            report.pruned += self.prune()
            report.flow_pruned += self.prune_flow_control()
            report.steps_settled += self.settle_steps()
            report.workflows_pruned += self.prune_workflows()
            tables = (Message._meta.db_table, ArchivedMessage._meta.db_table)
            report.vacuumed = any([vacuum_if_bloated(self.using, table) for table in tables])  # both, always
            report.reindexed = shrink_indexes(self.using, Message._meta.db_table)
            planned = (Message._meta.db_table, STEP_TABLE, EDGE_TABLE)
            report.analyzed = any([refresh_statistics(self.using, table) for table in planned])  # each, always
        if signals.reaper_passed.receivers:  # metrics (docs/metrics.md)
            signals.reaper_passed.send_robust(Reaper, report=report, using=self.using)
        return report

    def loop(
        self,
        stop: threading.Event,
        interval: float | None = None,
        on_report: Callable[[ReapReport], object] | None = None,
    ) -> None:
        """A pass now and every ``interval`` seconds (``REAP_INTERVAL``) until ``stop`` is set.

        Each pass that did something goes to ``on_report`` (by default, the
        log at INFO). A pass that fails, for any reason, does not end the
        loop: database trouble that outlasted its retries is logged in one
        line, anything else with its traceback, and the next pass tries
        again after the interval.
        """
        interval = get_settings().reap_interval if interval is None else interval
        on_report = on_report or (lambda report: logger.info("reaper: %s", report))
        try:
            while not stop.is_set():
                try:
                    report = self.run_once()
                    if report is not None and report.did_something:
                        on_report(report)
                except DATABASE_TROUBLE as exc:
                    logger.warning("reaper: a pass failed (%s); trying again in %gs", exc, interval)
                    connections[self.using].close()
                except Exception:
                    logger.exception("reaper: a pass failed; trying again in %gs", interval)
                    connections[self.using].close()
                stop.wait(interval)
        finally:
            connections.close_all()

    # --- the steps -------------------------------------------------------------

    def release_stale_workers(self, report: ReapReport) -> None:
        """Give back the messages of workers whose heartbeat went silent, one worker per transaction.

        The worker's row is locked and checked stale again inside the
        transaction: a worker whose heartbeat returns meanwhile keeps its claims.
        """
        stale_after = get_settings().worker_stale_after
        for name in list(Worker.objects.using(self.using).stale(stale_after).values_list("name", flat=True)):
            release = functools.partial(self._release_worker, name, stale_after)
            counts = with_retries(self.using, release, what="release of a stale worker")
            if counts is None:
                continue  # it came back
            poison, cancelled, released = counts
            report.poison += poison
            report.cancelled += cancelled
            report.released += released
            report.stale_workers += 1
            logger.warning("reaper: worker %s stopped answering; its messages are back in the queue", name)

    def _release_worker(self, name: str, stale_after: float) -> tuple[int, int, int] | None:
        """(poison, cancelled, released) of a stale worker's messages; None if it came back."""
        with write_transaction(self.using):
            if not Worker.objects.using(self.using).lock_if_stale(name, stale_after):
                return None
            poison = cancelled = 0
            for message in Message.objects.using(self.using).filter(claimed_by=name, lease_token__isnull=False):
                if message.cancel_requested():
                    cancelled += self._cancelled(message, f"worker {name} stopped answering")
                elif not message.attempts_left():
                    poison += self._dead(message, f"worker {name} stopped answering during its last attempt")
            released = Message.objects.using(self.using).release_from(name)
            Worker.objects.using(self.using).unregister(name)
            return poison, cancelled, released

    def cancel_abandoned(self) -> int:
        """Archive as cancelled the messages flagged for cancel whose lease ran out: nobody will stop them now."""
        done = 0
        for message in Message.objects.using(self.using).abandoned_cancels().order_by("id")[: self.batch_size]:
            done += self._cancelled(message, f"its lease ran out on attempt {message.attempts}")
        return done

    def _cancelled(self, message: Message, why: str) -> int:
        """Archive one flagged message as cancelled, only if nobody changed its lease since we read it."""
        reason = f"cancelled while it ran; {why} before it stopped"
        return 1 if finish(message, Outcome.CANCELLED, match="token", worker="reaper", error=reason) else 0

    def dead_letter_poison(self) -> int:
        """Dead-letter messages whose lease ran out on their last attempt."""
        done = 0
        messages = Message.objects.using(self.using)
        queues = messages.filter(lease_token__isnull=False).ready().values_list("queue", flat=True)
        for queue in sorted(set(queues)):
            # Each queue by its own MAX_ATTEMPTS default, in SQL, so a crowd of ordinary
            # expired leases cannot hide the poison ones from a batch.
            poison = messages.filter(queue=queue).poison(queue_options(queue).max_attempts)
            for message in poison.order_by("id")[: self.batch_size]:
                reason = f"lease expired on attempt {message.attempts}: the worker died running it"
                done += self._dead(message, reason)
        return done

    def _dead(self, message: Message, reason: str) -> int:
        """Archive one held message as dead, only if nobody changed its lease since we read it."""
        message.last_error = f"{message.last_error}\n{reason}".strip()
        return 1 if finish(message, Outcome.DEAD, match="token", worker="reaper", error=message.last_error) else 0

    def expire(self) -> int:
        """Archive, as expired, messages past ``expires_at`` that no worker holds."""
        total = 0
        while True:
            messages, rows = Message.objects.using(self.using).expire_batch(self.batch_size)
            total += len(messages)
            if messages and events.listened(signals.message_expired):
                archived = events.settle(rows, self.using)
                for message, row in zip(messages, archived, strict=True):
                    events.finished(message, Outcome.EXPIRED, row, {})
            if len(messages) < self.batch_size:
                return total

    def prune_flow_control(self) -> int:
        """Delete passed unique windows, groups with no live message and idle rate slots (docs/flow-control.md)."""
        total = 0
        while True:
            deleted = with_retries(self.using, lambda: flow.prune(self.using, self.batch_size), what="flow pruning")
            total += deleted
            if deleted < self.batch_size:
                return total

    def settle_steps(self) -> int:
        """Settle up to a batch of enqueued workflow steps whose message is archived but the step is not."""
        return workflows.sweep(self.using, ArchivedMessage.objects.using(self.using), self.batch_size)

    def prune_workflows(self) -> int:
        """Delete workflows finished longer ago than the default RETENTION_DAYS (the archive's), with their steps."""
        days = get_settings().defaults.retention_days
        if days is None:
            return 0
        before = db_now(self.using) - timedelta(days=days)
        return WorkflowRun.objects.using(self.using).prune(before, self.batch_size)

    def keep_partitions(self, report: ReapReport) -> None:
        """With ARCHIVE_PARTITIONS: partitions created ahead, and those past every queue's retention dropped whole.

        A partition goes only when all its rows are past the longest
        ``RETENTION_DAYS`` of any queue (the default's included: it covers
        the queues not configured); a queue that keeps its rows for ever
        (None) keeps every partition. The row pruning that follows takes the
        rest (queues with a shorter retention, the partition that straddles
        the cut-off).
        """
        dbq = get_settings()
        granularity = dbq.archive_partitions
        if granularity is None or time.monotonic() < self._upkeep_after:
            return
        days = [dbq.defaults.retention_days, *(options.retention_days for options in dbq.queues.values())]
        longest = None if any(day is None for day in days) else max(d for d in days if d is not None)
        before = None if longest is None else db_now(self.using) - timedelta(days=longest)
        done = ArchiveLayout(self.using).upkeep(granularity, before)
        if done.plain and not self._told_plain:
            self._told_plain = True
            logger.warning(
                "reaper: ARCHIVE_PARTITIONS is %r but the archive on %r is one plain table; "
                "convert it with manage.py partitionarchive (docs/archive.md)",
                granularity,
                self.using,
            )
        if done.waited:
            # Each try holds acks up for as long as it waits: not every pass while the transaction lasts.
            self._upkeep_backoff = min(UPKEEP_BACKOFF_MAX, max(UPKEEP_BACKOFF_MIN, 2 * self._upkeep_backoff))
            self._upkeep_after = time.monotonic() + self._upkeep_backoff
        else:
            self._upkeep_backoff = 0.0
        for step in done.waited:
            logger.warning(
                "reaper: archive partitions on %r: %s; tried again in %d s", self.using, step, self._upkeep_backoff
            )
        report.partitions_created += len(done.created)
        report.partitions_dropped += len(done.dropped)
        report.partitions_freed += len(done.swept)

    def prune(self) -> int:
        """Delete archive rows past their queue's retention, a batch at a time."""
        dbq = get_settings()
        now = db_now(self.using)
        configured = dict(dbq.queues)
        # Each configured queue by its own retention; all others by the default.
        retention = [(Q(queue=name), options.retention_days) for name, options in configured.items()]
        retention.append((~Q(queue__in=list(configured)), dbq.defaults.retention_days))
        targets = [(match, now - timedelta(days=days)) for match, days in retention if days is not None]
        archive = ArchivedMessage.objects.using(self.using)
        progress = self.progress
        if progress.active:  # counting what is to go costs a query per target: only when someone watches
            total = sum(archive.prunable(match, before).count() for match, before in targets)
            if total:
                progress.start("pruning the archive", total=total)
        try:
            return sum(
                archive.prune(match, before, self.batch_size, on_batch=progress.advance) for match, before in targets
            )
        finally:
            progress.finish(keep=False)  # the pass's report says how many went
