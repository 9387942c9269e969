"""Schedules' tables: a row per declared schedule, and a row per slot decided; every statement on them.

The run table's unique ``(schedule, slot)`` is what makes a slot fire once.
Every scheduler that finds a slot due inserts the message and the slot's
run row in one transaction; the database lets exactly one of those
transactions commit, and the others roll back, message and all. The
schedule row holds what operators switch (enabled) and how far the slots
are decided (``covered_until``), so a restart knows what it missed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, models
from django.db.models import Max, OuterRef, Subquery

from ..db.clock import DbNow
from ..db.errors import with_retries
from ..db.transactions import write_transaction
from . import events
from .fields import NameField
from .messages import Message

if TYPE_CHECKING:
    from ..schedules.spec import ScheduleSpec

SCHEDULE_TABLE = "dbqueue_schedule"
RUN_TABLE = "dbqueue_schedule_run"


class ScheduleTrigger(models.TextChoices):
    """Why a run happened."""

    SCHEDULED = "scheduled", "scheduled"  # its slot came (on time, within the schedule's grace)
    CATCH_UP = "catch-up", "catch-up"  # a slot missed while no scheduler ran, fired by the catch-up policy
    MANUAL = "manual", "run now"  # an operator's "run now"


@dataclass
class Fired:
    """What one firing did: the run row written and the message sent (None when skipped)."""

    run_id: int
    slot: datetime
    trigger: str
    message: Message | None
    still_running: int | None = None  # skipped: the id of the previous run's message, still live


def describe(spec: ScheduleSpec) -> dict[str, Any]:
    """The columns a schedule row copies from its declaration (for operators; the code stays the truth)."""
    return {"queue": spec.queue, "kind": spec.kind, "timing": spec.describe()[:200], "origin": spec.origin[:255]}


class ScheduleQuerySet(models.QuerySet["Schedule"]):
    def declare(self, specs: Iterable[ScheduleSpec], now: datetime) -> dict[str, Schedule]:
        """The rows of these schedules, created as of ``now`` where missing (so nothing before counts as missed)."""
        specs = list(specs)
        names = [spec.name for spec in specs]
        rows = {row.name: row for row in self.filter(name__in=names)}
        missing = [
            Schedule(name=spec.name, created_at=now, covered_until=now, **describe(spec))
            for spec in specs
            if spec.name not in rows
        ]
        if missing:
            # Several processes may start at once: the first insert wins, the others change nothing.
            with_retries(self.db, lambda: self.bulk_create(missing, ignore_conflicts=True), what="schedule rows")
            rows = {row.name: row for row in self.filter(name__in=names)}
        for spec in specs:
            row = rows[spec.name]
            changes = {key: value for key, value in describe(spec).items() if getattr(row, key) != value}
            if changes:
                self.filter(name=row.name).update(**changes)
                for key, value in changes.items():
                    setattr(row, key, value)
        return rows

    def set_enabled(self, name: str, enabled: bool, by: str = "") -> bool:
        """Switch a schedule on or off; False if there is no such row.

        Switching on starts its slots afresh from now: what fell due while it
        was off is not caught up.
        """
        rows = self.filter(name=name)
        changes: dict[str, Any] = {"enabled": enabled, "changed_by": by, "changed_at": DbNow()}
        if enabled:
            rows.filter(enabled=False).update(**changes, covered_until=DbNow())
        return bool(with_retries(self.db, lambda: rows.update(**changes), what=f"switch schedule {name}"))

    def lock(self, name: str) -> bool:
        """Lock schedule ``name``'s row until the transaction ends (every firing of it takes this turn first)."""
        return bool(list(self.select_for_update().filter(name=name).values_list("name", flat=True)))

    def advance(self, name: str, until: datetime) -> None:
        """Mark the slots up to ``until`` decided (the ones a catch-up policy passed over)."""
        rows = self.filter(name=name, covered_until__lt=until)
        with_retries(self.db, lambda: rows.update(covered_until=until), what=f"advance schedule {name}")

    def last_runs(self) -> dict[str, ScheduleRun]:
        """Each schedule's newest run, by schedule name (by slot: one index lookup per schedule)."""
        # In one chain with its annotate(), so that django-stubs knows the annotated name.
        newest = ScheduleRun.objects.filter(schedule=OuterRef("pk")).order_by("-slot").values("pk")[:1]
        found = self.annotate(last_run_id=Subquery(newest)).values_list("last_run_id", flat=True)
        ids = [pk for pk in found if pk is not None]
        return {run.schedule_id: run for run in ScheduleRun.objects.using(self.db).filter(pk__in=ids)}


class Schedule(models.Model):
    """A schedule some code or setting declared: its on/off switch and how far its slots are decided.

    A row whose schedule is no longer declared anywhere is *orphaned*: shown
    to operators, never fired.
    """

    name = NameField(max_length=100, primary_key=True)
    enabled = models.BooleanField(default=True)
    queue = NameField(max_length=64, blank=True, default="")
    kind = NameField(max_length=100, blank=True, default="")
    timing = models.CharField(max_length=200, blank=True, default="", help_text="When it fires, as declared.")
    origin = models.CharField(max_length=255, blank=True, default="", help_text="Where it was declared.")
    created_at = models.DateTimeField(help_text="When a scheduler first saw it; no slot before counts as missed.")
    covered_until = models.DateTimeField(help_text="Slots up to this time are decided: fired, skipped or passed over.")
    changed_at = models.DateTimeField(null=True, blank=True)
    changed_by = models.CharField(max_length=150, blank=True, default="")

    objects = ScheduleQuerySet.as_manager()

    class Meta:
        app_label = "django_dbqueue"
        db_table = SCHEDULE_TABLE
        ordering = ["name"]
        permissions = [
            ("toggle_schedule", "Can enable and disable schedules"),
            ("run_schedule", "Can run a schedule now"),
        ]

    def __str__(self) -> str:
        return self.name


class ScheduleRunQuerySet(models.QuerySet["ScheduleRun"]):
    def fire(
        self,
        name: str,
        slot: datetime,
        trigger: str,
        message: Message,
        *,
        skip_if_running: bool = False,
        advance: bool = True,
        fired_by: str = "",
    ) -> Fired | None:
        """Send ``message`` (built, unsaved) for this slot of schedule ``name``, unless another process did.

        One transaction: the message, the run row (whose unique key refuses a
        second firing of the slot) and, with ``advance``, the schedule's
        ``covered_until``. Returns None when the slot was fired already.
        With ``skip_if_running``, a slot whose previous run's message is still
        live is recorded as skipped and sends nothing.

        The transaction first locks the schedule's row, so the firings of one
        schedule take their turns there. Without it, MySQL/MariaDB deadlocked
        competing schedulers (error 1213, retried): inserting the run row
        checks its foreign key with a shared lock on the schedule's row, two
        firers of one slot both held that lock while one waited for the
        other's run row, and the ``covered_until`` update needs it exclusively.
        """
        using = self.db
        live_messages = Message.objects.using(using)

        def run() -> Fired | None:
            message.pk, message._state.adding = None, True  # afresh on a retry after the database's weather
            with write_transaction(using):
                Schedule.objects.using(using).lock(name)
                if self.filter(schedule_id=name, slot=slot).exists():
                    return None  # fired by another process, which held the lock before us
                live = None
                if skip_if_running:
                    previous = (
                        self.filter(schedule_id=name, message_id__isnull=False)
                        .order_by("-slot")
                        .values_list("message_id", flat=True)
                        .first()
                    )
                    if previous is not None and live_messages.filter(pk=previous).exists():
                        live = previous
                sent = None
                if live is None:
                    sent = live_messages.insert(message, None)
                row = ScheduleRun(
                    schedule_id=name,
                    slot=slot,
                    trigger=trigger,
                    fired_at=DbNow(),
                    fired_by=fired_by[:255],
                    message_id=sent.pk if sent is not None else None,
                    skipped_because=live,
                )
                row.save(using=using, force_insert=True)
                if advance:
                    Schedule.objects.using(using).filter(name=name, covered_until__lt=slot).update(covered_until=slot)
                return Fired(row.pk, slot, trigger, sent, live)

        try:
            fired = with_retries(using, run, what=f"schedule {name} slot {slot.isoformat()}")
        except IntegrityError:
            if self.filter(schedule_id=name, slot=slot).exists():
                return None  # another process fired this slot: its transaction won
            raise
        if fired is not None and fired.message is not None:
            events.enqueued([fired.message], using)
        return fired

    def prune(self, before: datetime, batch_size: int) -> int:
        """Delete runs whose slot is before ``before``, keeping each schedule's newest, a batch at a time."""
        total = 0
        for name, newest in self.values_list("schedule_id").annotate(newest=Max("slot")).order_by():
            old = self.filter(schedule_id=name, slot__lt=min(before, newest))
            while True:
                ids = list(old.order_by("slot").values_list("pk", flat=True)[:batch_size])
                if not ids:
                    break
                delete = partial(self.filter(pk__in=ids)._raw_delete, self.db)
                total += with_retries(self.db, delete, what="schedule run pruning")
        return total


class ScheduleRun(models.Model):
    """One decided slot of a schedule: the message it sent, or why it sent none."""

    id = models.BigAutoField(primary_key=True)
    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="runs")
    slot = models.DateTimeField(help_text="The time the slot stands for (UTC); in the message's schedule_slot header.")
    trigger = models.CharField(max_length=16, choices=ScheduleTrigger.choices)
    fired_at = models.DateTimeField(help_text="When it was decided (database clock).")
    fired_by = models.CharField(max_length=255, blank=True, default="", help_text="The process that fired it.")
    message_id = models.BigIntegerField(null=True, blank=True, help_text="The message it sent; empty when skipped.")
    skipped_because = models.BigIntegerField(
        null=True, blank=True, help_text="Skipped: the previous run's message, still live (skip_if_running)."
    )

    objects = ScheduleRunQuerySet.as_manager()

    class Meta:
        app_label = "django_dbqueue"
        db_table = RUN_TABLE
        ordering = ["-slot"]
        constraints = [
            # The exactly-once rule: one run per slot of a schedule, whoever tries.
            models.UniqueConstraint(fields=["schedule", "slot"], name="dbqueue_run_schedule_slot"),
        ]

    def __str__(self) -> str:
        return f"{self.schedule_id} @ {self.slot:%Y-%m-%d %H:%M:%S}"
