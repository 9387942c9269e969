"""The scheduler: turns due slots into messages, once per slot however many processes run it.

A pass (`Scheduler.run_once`) reads the database's clock, makes sure
each declared schedule has its row, plans each enabled schedule's due
slots (`policy`) and fires each in its own transaction
(`ScheduleRun.objects.fire`).
Any number of schedulers may run passes at once: the run table's unique
``(schedule, slot)`` lets one firing of a slot commit, and the others find
it taken. "Now" is always the database's, so hosts with skewed clocks agree
on which slots are due.

`Scheduler.loop` repeats passes until its stop event is set, sleeping
until the next slot (at most ``SCHEDULER_INTERVAL``), and weathers a
database that goes away. ``runqueueworker`` runs it in a thread;
``runqueueschedules`` runs it alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connections

from ..conf import get_settings
from ..db.clock import db_now
from ..db.errors import DATABASE_TROUBLE, backoff
from ..db.transactions import lock_name, try_lock
from ..exceptions import DbQueueError, InvalidOption
from ..models import Fired, Message, Schedule, ScheduleRun, ScheduleTrigger
from ..models.messages import build_message
from . import registry
from .policy import plan
from .spec import SCHEDULE_HEADER, SLOT_HEADER, TRIGGER_HEADER, ScheduleSpec

logger = logging.getLogger("django_dbqueue")

PRUNE_EVERY = 3600.0  # seconds between prunings of old run rows, per process
PRUNE_BATCH = 1000
PRUNE_LOCK = "django_dbqueue.schedule-prune"


@dataclass
class PassReport:
    """What one pass did, for the log, ``runqueueschedules --once`` and tests."""

    now: datetime
    fired: list[tuple[str, Fired]] = field(default_factory=list)
    taken: int = 0  # due slots another process fired first
    missed: dict[str, int] = field(default_factory=dict)  # slots the catch-up policy passed over, per schedule
    next_slot: datetime | None = None  # the earliest slot still to come, over enabled schedules

    def __str__(self) -> str:
        lines = []
        for name, fired in self.fired:
            what = (
                f"message {fired.message.pk}"
                if fired.message is not None
                else f"nothing: message {fired.still_running} of its previous run is still live"
            )
            lines.append(f"{name}: slot {fired.slot.isoformat()} ({fired.trigger}) sent {what}")
        for name, count in sorted(self.missed.items()):
            lines.append(f"{name}: passed over {count} missed slot(s)")
        if self.taken:
            lines.append(f"{self.taken} due slot(s) fired by another process")
        if not lines:
            lines.append("nothing due")
        if self.next_slot is not None:
            lines.append(f"next slot at {self.next_slot.isoformat()}")
        return "\n".join(lines)


def scheduled_message(
    spec: ScheduleSpec, slot: datetime, trigger: str
) -> tuple[Message, Callable[[Message], object] | None]:
    """The message a slot sends (unsaved), with the slot in its headers; and what to call once it commits."""
    headers = {**spec.headers, SCHEDULE_HEADER: spec.name, SLOT_HEADER: slot.isoformat(), TRIGGER_HEADER: trigger}
    if spec.task:
        queue, payload, options, announce = registry.task_message(spec)
        options = {**options, "headers": {**options.get("headers", {}), **headers}}
        return build_message(queue, payload, options)[0], announce
    options = {"kind": spec.kind, "headers": headers, "priority": spec.priority, "max_attempts": spec.max_attempts}
    return build_message(spec.queue, spec.payload, options)[0], None


class Scheduler:
    """Fires the schedules whose queues live on database ``using``.

    ``clock`` returns "now"; it is the database's clock unless a test passes
    another.
    """

    def __init__(
        self,
        using: str | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
        name: str | None = None,
    ) -> None:
        self.using = using or get_settings().defaults.database
        self.clock = clock or (lambda: db_now(self.using))
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._pruned_at: float | None = None

    def schedules(self) -> list[ScheduleSpec]:
        """This database's declared schedules; raises ImproperlyConfiguredQueue if any declaration is bad."""
        return registry.schedules_for(self.using)

    # --- one pass ----------------------------------------------------------------

    def run_once(self) -> PassReport:
        specs = self.schedules()
        now = self.clock()
        report = PassReport(now=now)
        if not specs:
            return report
        rows = Schedule.objects.using(self.using).declare(specs, now)
        upcoming = []
        for spec in specs:
            row = rows[spec.name]
            if not row.enabled:
                continue
            covered = self._run_schedule(spec, row.covered_until, now, report)
            upcoming.append(spec.timing.next_after(max(now, covered)))
        report.next_slot = min((slot for slot in upcoming if slot is not None), default=None)
        return report

    def _run_schedule(self, spec: ScheduleSpec, covered_until: datetime, now: datetime, report: PassReport) -> datetime:
        """Fire what is due for one schedule; returns the time up to which its slots are now decided."""
        decided = plan(
            spec.timing,
            covered_until,
            now,
            grace=spec.grace,
            catch_up=spec.catch_up,
            limit=spec.catch_up_limit,
        )
        if decided.covered_until is None:
            return covered_until
        runs = ScheduleRun.objects.using(self.using)
        for slot, trigger in decided.fire:
            message, announce = scheduled_message(spec, slot, trigger)
            fired = runs.fire(
                spec.name, slot, trigger, message, skip_if_running=spec.skip_if_running, fired_by=self.name
            )
            if fired is None:
                report.taken += 1
                continue
            report.fired.append((spec.name, fired))
            if fired.message is None:
                logger.info(
                    "schedule %s: slot %s skipped, message %s of its previous run is still live",
                    spec.name,
                    slot.isoformat(),
                    fired.still_running,
                )
                continue
            logger.info(
                "schedule %s: slot %s (%s) sent message %s", spec.name, slot.isoformat(), trigger, fired.message.pk
            )
            if announce is not None:
                announce(fired.message)
        if decided.missed:
            report.missed[spec.name] = decided.missed
            logger.warning(
                "schedule %s: %s%d slot(s) missed while no scheduler ran, passed over (catch_up=%r)",
                spec.name,
                "at least " if decided.missed_more else "",
                decided.missed,
                spec.catch_up,
            )
        if not decided.fire or decided.fire[-1][0] < decided.covered_until:
            Schedule.objects.using(self.using).advance(spec.name, decided.covered_until)
        return decided.covered_until

    # --- by hand -------------------------------------------------------------------

    def run_now(self, name: str, *, by: str = "") -> Fired | None:
        """Send schedule ``name``'s message now, off its slots (an operator's "run now").

        Its slots are unchanged, and ``skip_if_running`` does not apply: the
        operator asked. Raises InvalidOption for a schedule that is not
        declared (orphaned): there is nothing to send.
        """
        spec = next((spec for spec in self.schedules() if spec.name == name), None)
        if spec is None:
            raise InvalidOption(f"schedule {name!r} is not declared on database {self.using!r}; nothing to send")
        now = self.clock()
        Schedule.objects.using(self.using).declare([spec], now)
        message, announce = scheduled_message(spec, now, ScheduleTrigger.MANUAL)
        fired = ScheduleRun.objects.using(self.using).fire(
            name, now, ScheduleTrigger.MANUAL, message, advance=False, fired_by=by or self.name
        )
        if fired is not None and fired.message is not None:
            logger.info("schedule %s: run now by %s sent message %s", name, by or self.name, fired.message.pk)
            if announce is not None:
                announce(fired.message)
        return fired

    # --- housekeeping ----------------------------------------------------------------

    def prune(self, now: datetime) -> int:
        """Delete run rows past ``SCHEDULE_RETENTION_DAYS`` (each schedule's newest stays); one process at a time."""
        days = get_settings().schedule_retention_days
        if days is None:
            return 0
        with try_lock(self.using, lock_name(self.using, PRUNE_LOCK)) as held:
            if not held:
                return 0
            return ScheduleRun.objects.using(self.using).prune(now - timedelta(days=days), PRUNE_BATCH)

    # --- the loop ----------------------------------------------------------------------

    def loop(self, stop: threading.Event, *, max_runtime: float | None = None) -> None:
        """Run passes until ``stop`` is set (or ``max_runtime`` seconds passed), surviving database outages."""
        interval = get_settings().scheduler_interval
        started = time.monotonic()
        trouble = 0
        logger.info("scheduler %s firing schedules on database %r", self.name, self.using)
        try:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    report = self.run_once()
                    self._prune_now_and_then(report.now)
                    trouble = 0
                    wait = interval
                    if report.next_slot is not None:
                        # Wake just after the next slot (the database's time), less this pass's own time.
                        until = (report.next_slot - report.now).total_seconds() - (time.monotonic() - began)
                        wait = min(interval, max(until + 0.005, 0.01))
                except DATABASE_TROUBLE as exc:
                    trouble += 1
                    logger.warning("scheduler %s: pass failed (%s); retrying", self.name, _first_line(exc))
                    connections[self.using].close()
                    wait = backoff(min(trouble + 3, 8), cap=5.0)
                except DbQueueError as exc:  # a bad declaration: the system checks say the same
                    logger.error("scheduler %s stops: %s", self.name, exc)
                    return
                if max_runtime is not None:
                    left = max_runtime - (time.monotonic() - started)
                    if left <= 0:
                        return
                    wait = min(wait, left)
                stop.wait(wait)
        finally:
            connections[self.using].close()
            logger.info("scheduler %s stopped", self.name)

    def _prune_now_and_then(self, now: datetime) -> None:
        if self._pruned_at is not None and time.monotonic() - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = time.monotonic()
        pruned = self.prune(now)
        if pruned:
            logger.info("scheduler %s pruned %d old schedule run(s)", self.name, pruned)


def run_now(name: str, *, using: str | None = None, by: str = "") -> Fired | None:
    """Send schedule ``name``'s message now (see `Scheduler.run_now`)."""
    return Scheduler(using).run_now(name, by=by)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
