"""Incremental runs: only the hours that new archive rows touch, then a watermark moves on.

The watermark (a ``Watermark`` row per job, in the database read) holds the
last archived row processed, by ``(finished_at, id)``, and when that run
began. A run looks at archive rows that finished after the watermark less
the *settle* margin (so that a row committed late, with a ``finished_at``
older than rows committed before it, is still seen), and at live messages
created since the last run began, less the same margin. The hours those rows
touch (their ``finished_at`` and ``created_at`` hours) are recomputed in
full, so their figures are exactly what a full recompute gives; no other
hour can have changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import DateTimeField, QuerySet
from django.db.models.functions import Trunc
from django.utils import timezone

from ...models import ArchivedMessage, Message
from .job import AnalyticsJob, JobResult
from .models import Watermark

QUEUEANALYTICS = "queueanalytics"
DEFAULT_SETTLE = timedelta(minutes=5)
# More separate stretches of hours than this are recomputed as one window from the first to the last.
MAX_RANGES = 50


@dataclass(frozen=True)
class Mark:
    """A position in the archive: rows are ordered by ``(finished_at, id)``."""

    finished_at: datetime
    id: int


def read_watermark(name: str, using: str) -> Watermark | None:
    return Watermark.objects.using(using).filter(name=name).first()


def save_watermark(name: str, using: str, mark: Mark, run_at: datetime, rows: int) -> None:
    with transaction.atomic(using=using):
        Watermark.objects.using(using).update_or_create(
            name=name,
            defaults={"finished_at": mark.finished_at, "last_id": mark.id, "run_at": run_at, "rows": rows},
        )


def last_archived(using: str) -> Mark | None:
    """The archive's last row by ``(finished_at, id)`` (the ``finished_at, id`` index, read backwards)."""
    row = ArchivedMessage.objects.using(using).order_by("-finished_at", "-id").values_list("finished_at", "id").first()
    return None if row is None else Mark(row[0], row[1])


def _hours(queryset: QuerySet[ArchivedMessage] | QuerySet[Message], column: str) -> set[datetime]:
    trunc = Trunc(column, "hour", output_field=DateTimeField(), tzinfo=UTC)
    return {
        hour.astimezone(UTC) for hour in queryset.annotate(h=trunc).order_by().values_list("h", flat=True).distinct()
    }


def touched_hours(using: str, archive_since: datetime | None, live_since: datetime | None) -> set[datetime]:
    """Hours (UTC) of the ``finished_at`` and ``created_at`` of archive rows finished from ``archive_since``
    and of the ``created_at`` of live messages created from ``live_since`` (None: all of them)."""
    archive = ArchivedMessage.objects.using(using).all()
    live = Message.objects.using(using).all()
    if archive_since is not None:
        archive = archive.filter(finished_at__gte=archive_since)
    if live_since is not None:
        live = live.filter(created_at__gte=live_since)
    return _hours(archive, "finished_at") | _hours(archive, "created_at") | _hours(live, "created_at")


@dataclass(frozen=True)
class IncrementalResult:
    hours: int  # hours recomputed
    job: JobResult | None  # None when nothing was new
    watermark: Mark | None
    seconds: float


def run_incremental(
    job: AnalyticsJob, *, settle: timedelta = DEFAULT_SETTLE, name: str = QUEUEANALYTICS
) -> IncrementalResult:
    """Recompute the hours that rows new since ``job``'s last incremental run touched (``since``/``until`` unused)."""
    started = time.perf_counter()
    if settle < timedelta(0):
        raise ValueError("settle must not be negative")
    run_at = timezone.now()
    # Read before the data: a row committed while the job runs is after this mark, so the next run sees it.
    mark = last_archived(job.using)
    previous = read_watermark(name, job.using)
    if previous is None:
        hours = touched_hours(job.using, None, None)
    else:
        hours = touched_hours(job.using, previous.finished_at - settle, previous.run_at - settle)
    result = None
    if hours:
        job.since, job.until = min(hours), max(hours) + timedelta(hours=1)
        # Many separate stretches (a first run over a sparse archive): one window from the first to the last.
        job.hours = frozenset(hours) if len(_stretches(hours)) <= MAX_RANGES else None
        result = job.run()
    if mark is not None:
        save_watermark(name, job.using, mark, run_at, result.rows_read if result else 0)
    return IncrementalResult(len(hours), result, mark, time.perf_counter() - started)


def _stretches(hours: set[datetime]) -> list[datetime]:
    """The first hour of each stretch of consecutive hours."""
    return [hour for hour in hours if hour - timedelta(hours=1) not in hours]
