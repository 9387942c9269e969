"""Every schedule a database knows, at a glance: what the admin's list and ``queuestats`` show.

One `schedule_statuses` call reads the rows, each schedule's newest
run and where that run's message is now (live, or archived with its
outcome) in a few queries, and works out the next slot by the database's
clock. A row that no code or setting declares any more is *orphaned*.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from ..conf import get_settings
from ..db.clock import db_now
from ..models import ArchivedMessage, Message, Schedule, ScheduleRun
from .registry import declared


@dataclass
class ScheduleStatus:
    name: str
    timing: str
    queue: str
    kind: str
    enabled: bool
    orphaned: bool  # no declaration any more: never fired
    next_slot: datetime | None  # None: disabled, orphaned, or no slot to come
    last_slot: datetime | None = None
    last_trigger: str = ""
    last_fired_at: datetime | None = None
    last_message_id: int | None = None
    last_outcome: str = ""  # "ready", "in_flight"... while live; "acked", "dead"... archived; "skipped"; "" none yet

    @property
    def state(self) -> str:
        return "orphaned" if self.orphaned else ("enabled" if self.enabled else "disabled")

    def as_json(self) -> dict[str, Any]:
        return {
            key: value.isoformat() if isinstance(value, datetime) else value
            for key, value in {**asdict(self), "state": self.state}.items()
        }


def schedule_statuses(using: str | None = None, rows: Any = None) -> list[ScheduleStatus]:
    """The status of each schedule row on database ``using`` (or of ``rows``, a Schedule queryset), by name."""
    using = using or get_settings().defaults.database
    specs = declared()[0]
    rows = list(rows if rows is not None else Schedule.objects.using(using).all())
    now = db_now(using)
    last_runs = Schedule.objects.using(using).filter(pk__in=[row.pk for row in rows]).last_runs()
    outcomes = message_outcomes(using, [run.message_id for run in last_runs.values() if run.message_id])
    statuses = []
    for row in sorted(rows, key=lambda row: row.name):
        spec = specs.get(row.name)
        next_slot = None
        if spec is not None and row.enabled:
            next_slot = spec.timing.next_after(max(now, row.covered_until))
        status = ScheduleStatus(
            name=row.name,
            timing=spec.describe() if spec is not None else row.timing,
            queue=row.queue,
            kind=row.kind,
            enabled=row.enabled,
            orphaned=spec is None,
            next_slot=next_slot,
        )
        run: ScheduleRun | None = last_runs.get(row.name)
        if run is not None:
            status.last_slot, status.last_trigger, status.last_fired_at = run.slot, run.trigger, run.fired_at
            status.last_message_id = run.message_id
            status.last_outcome = outcomes.get(run.message_id, "gone") if run.message_id else "skipped"
        statuses.append(status)
    return statuses


def message_outcomes(using: str, ids: list[int]) -> dict[int, str]:
    """Where each message is now: its live state, else its newest archive outcome (two queries)."""
    if not ids:
        return {}
    live = Message.objects.using(using).filter(pk__in=ids).with_state()
    # django-stubs checks the names against Message's fields; it cannot see what with_state() annotates.
    found = dict(live.values_list("pk", "current_state"))  # type: ignore[misc]
    archived = ArchivedMessage.objects.using(using).filter(message_id__in=[pk for pk in ids if pk not in found])
    for message_id, outcome in archived.order_by("id").values_list("message_id", "outcome"):
        found[message_id] = outcome  # the newest row wins
    return found
