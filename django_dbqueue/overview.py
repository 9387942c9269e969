"""The queues at a glance: what the admin's overview page and ``manage.py queuestats`` show.

One `build_overview` call reads every figure (a handful of grouped
queries, times by the database's clock); the page and the command only
format it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Sum
from django.db.models.functions import TruncHour

from . import handlers
from .conf import get_settings
from .db.clock import db_now
from .models import ArchivedMessage, Message, Outcome, QueueStat, QueueState, Worker, WorkflowRun, flow
from .schedules.status import ScheduleStatus

HOURS = 24
RUNNING_SHOWN = 20  # in-flight messages with progress listed, longest running first
WORKFLOWS_SHOWN = 20  # workflows in progress listed, oldest first
GROUPS_SHOWN = 10  # groups of a flow-controlled queue listed, most in flight first


@dataclass
class QueueSummary:
    name: str
    ready: int = 0
    scheduled: int = 0
    in_flight: int = 0
    dead: int = 0
    oldest_ready_age: timedelta | None = None
    paused: bool = False
    acked_per_hour: list[int] = field(default_factory=lambda: [0] * HOURS)
    dead_per_hour: list[int] = field(default_factory=lambda: [0] * HOURS)


@dataclass
class WorkerSummary:
    name: str
    hostname: str
    pid: int
    queues: list[str]
    started_at: datetime
    last_heartbeat_at: datetime
    silent_for: timedelta
    stale: bool
    processed: int
    failed: int
    supervisor: str = ""  # a pool's child: its supervisor's name
    pool: dict[str, Any] | None = None  # a pool's supervisor: its state (worker/supervisor.py, pool_state)
    depth: int = 0  # 1 for a child listed under its supervisor

    @property
    def pool_text(self) -> str:
        """A supervisor's pool in a few words: ``2 processes (target 2, 1 to 4), 1 restarted: grew to 2 ...``."""
        pool = self.pool or {}
        bounds = f", {pool['min']} to {pool['max']}" if pool.get("min") is not None else ""
        counts = ", ".join(
            f"{pool[key]} {key}" for key in ("restarted", "recycled", "grown", "shrunk") if pool.get(key)
        )
        text = f"{pool.get('processes', 0)} processes (target {pool.get('target', 0)}{bounds})"
        text += f", {counts}" if counts else ""
        return text + (f"; last decision: {pool['decision']}" if pool.get("decision") else "")


@dataclass
class RunningSummary:
    """An in-flight message whose handler reported progress (``message.set_progress``)."""

    id: int
    queue: str
    kind: str
    worker: str
    running_for: timedelta
    done: float
    total: float | None
    note: str
    cancel_requested: bool

    @property
    def percent(self) -> int | None:
        return progress_percent(self.done, self.total)


@dataclass
class GroupSummary:
    """One group of a flow-controlled queue: its messages in flight and the most it may have."""

    name: str
    in_flight: int
    limit: int | None


@dataclass
class FlowSummary:
    """A queue under flow control (docs/flow-control.md): its rules, its busiest groups, its rate's use."""

    queue: str
    rules: str
    groups: list[GroupSummary] = field(default_factory=list)
    rate_used: int | None = None  # claims in the current period, when the queue has a rate limit
    rate_limit: str = ""


@dataclass
class WorkflowSummary:
    """A workflow in progress (docs/workflows.md): its steps still open and those that failed."""

    id: int
    name: str
    open_steps: int
    failed_steps: int
    running_for: timedelta


@dataclass
class Overview:
    now: datetime
    hours: list[datetime]  # the start of each of the last HOURS hours, oldest first
    per_hour_source: str  # "hourly analytics" (QueueStat rows) or "archive"
    queues: list[QueueSummary]
    workers: list[WorkerSummary]
    running: list[RunningSummary] = field(default_factory=list)
    flow: list[FlowSummary] = field(default_factory=list)
    workflows: list[WorkflowSummary] = field(default_factory=list)  # the oldest WORKFLOWS_SHOWN in progress
    workflows_running: int = 0

    def as_json(self) -> dict[str, Any]:
        """Plain JSON types: times as ISO 8601, ages in seconds."""

        def plain(value: Any) -> Any:
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, timedelta):
                return round(value.total_seconds(), 3)
            if isinstance(value, dict):
                return {key: plain(item) for key, item in value.items()}
            if isinstance(value, list):
                return [plain(item) for item in value]
            return value

        result: dict[str, Any] = plain(asdict(self))
        return result


def build_overview(using: str | None = None) -> Overview:
    """Read the overview of every queue the project knows on database ``using``."""
    dbq = get_settings()
    using = using or dbq.defaults.database
    now = db_now(using)
    first_hour = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=HOURS - 1)
    hours = [first_hour + timedelta(hours=n) for n in range(HOURS)]

    queues: dict[str, QueueSummary] = {}

    def queue(name: str) -> QueueSummary:
        return queues.setdefault(name, QueueSummary(name))

    # Queues the project declares (settings, handlers) show even when empty.
    for name in [*dbq.queues, *(q for q, _ in handlers.registered())]:
        if dbq.for_queue(name).database == using:
            queue(name)
    for name, counts in Message.objects.using(using).counts_by_queue().items():
        summary = queue(name)
        summary.ready, summary.scheduled, summary.in_flight = counts["ready"], counts["scheduled"], counts["in_flight"]
        if summary.ready:
            summary.oldest_ready_age = Message.objects.using(using).oldest_ready_age(name)
    dead = ArchivedMessage.objects.using(using).dead().values("queue").annotate(n=Count("id")).order_by()
    for row in dead:
        queue(row["queue"]).dead = row["n"]
    for name in QueueState.objects.using(using).paused_names():
        queue(name).paused = True

    source = _per_hour(using, first_hour, hours, queue)
    workers = as_tree(
        [_worker(row, now, dbq.worker_stale_after) for row in Worker.objects.using(using).order_by("name")]
    )
    running = [_running(row, now) for row in Message.objects.using(using).reporting()[:RUNNING_SHOWN]]
    controlled = [name for name in sorted(queues) if dbq.for_queue(name).flow_controlled]
    flows = [_flow(using, name) for name in controlled]
    in_progress = WorkflowRun.objects.using(using).in_progress()
    workflows = [
        WorkflowSummary(w.pk, w.name, w.open_steps, w.failed_steps, now - w.created_at)
        for w in in_progress[:WORKFLOWS_SHOWN]
    ]
    count = len(workflows) if len(workflows) < WORKFLOWS_SHOWN else in_progress.count()
    overview = Overview(now, hours, source, [queues[name] for name in sorted(queues)], workers, running, flows)
    overview.workflows, overview.workflows_running = workflows, count
    return overview


def _flow(using: str, queue: str) -> FlowSummary:
    options = get_settings().for_queue(queue)
    rules = []
    if options.ordered:
        rules.append("ordered: one at a time per group")
    if options.group_concurrency:
        rules.append(f"{options.group_concurrency} per group")
    rules += [f"{limit} per group of kind {kind}" for kind, limit in sorted(options.kind_group_concurrency.items())]
    rate = options.rate_limit
    if rate is not None:
        rules.append(f"rate {rate}")
    summary = FlowSummary(queue, "; ".join(rules), rate_limit="" if rate is None else str(rate))
    limit = 1 if options.ordered else options.group_concurrency
    summary.groups = [GroupSummary(name, n, limit) for name, n in flow.busiest_groups(using, queue, GROUPS_SHOWN)]
    if rate is not None:
        summary.rate_used = flow.rate_use(using, queue, rate)
    return summary


def _running(message: Message, now: datetime) -> RunningSummary:
    progress = message.progress if isinstance(message.progress, dict) else {}
    return RunningSummary(
        id=message.pk,
        queue=message.queue,
        kind=message.kind,
        worker=message.claimed_by,
        running_for=now - (message.claimed_at or now),
        done=progress.get("done", 0),
        total=progress.get("total"),
        note=str(progress.get("note", "")),
        cancel_requested=message.cancel_requested_at is not None,
    )


def progress_percent(done: Any, total: Any) -> int | None:
    """Percent done, when the total is known and positive (the stored values are read defensively)."""
    if not isinstance(done, int | float) or not isinstance(total, int | float) or total <= 0:
        return None
    return max(0, min(100, int(done * 100 / total)))


def format_progress(progress: Any) -> str:
    """A progress report as text: ``3 of 10 (30%), copying rows``; empty when there is none."""
    if not isinstance(progress, dict) or "done" not in progress:
        return ""
    done, total, note = progress.get("done"), progress.get("total"), progress.get("note") or ""
    text = f"{done:g}" if isinstance(done, int | float) else str(done)
    if isinstance(total, int | float):
        text += f" of {total:g} ({progress_percent(done, total)}%)"
    return f"{text}, {note}" if note else text


def _per_hour(using: str, first_hour: datetime, hours: list[datetime], queue: Any) -> str:
    """Fill acked and dead per hour: from the hourly analytics when there are any, else from the archive."""
    slot = {hour: n for n, hour in enumerate(hours)}
    stats = (
        QueueStat.objects.using(using)
        .filter(hour__gte=first_hour)
        .values("queue", "hour")
        .annotate(acked_n=Sum("acked"), dead_n=Sum("dead"))
        .order_by()
    )
    rows = [(row["queue"], row["hour"], row["acked_n"], row["dead_n"]) for row in stats]
    source = "hourly analytics"
    if not rows:
        source = "archive"
        finished = (
            ArchivedMessage.objects.using(using)
            .filter(finished_at__gte=first_hour, outcome__in=[Outcome.ACKED, Outcome.DEAD])
            .annotate(hour=TruncHour("finished_at"))
            .values("queue", "hour", "outcome")
            .annotate(n=Count("id"))
            .order_by()
        )
        for row in finished:
            acked = row["n"] if row["outcome"] == Outcome.ACKED else 0
            rows.append((row["queue"], row["hour"], acked, row["n"] - acked))
    for name, hour, acked, dead in rows:
        if hour in slot:
            summary = queue(name)
            summary.acked_per_hour[slot[hour]] += acked
            summary.dead_per_hour[slot[hour]] += dead
    return source


def as_tree(workers: list[WorkerSummary]) -> list[WorkerSummary]:
    """Each pool's supervisor followed by its children (``depth`` 1); a child whose supervisor's row is gone
    stands alone."""
    supervisors = {w.name for w in workers if w.pool is not None}
    children: dict[str, list[WorkerSummary]] = {}
    for w in workers:
        if w.supervisor in supervisors:
            w.depth = 1
            children.setdefault(w.supervisor, []).append(w)
    ordered = []
    for w in workers:
        if w.depth == 0:
            ordered += [w, *children.get(w.name, [])]
    return ordered


def _worker(row: Worker, now: datetime, stale_after: float) -> WorkerSummary:
    silent_for = max(now - row.last_heartbeat_at, timedelta(0))
    return WorkerSummary(
        name=row.name,
        hostname=row.hostname,
        pid=row.pid,
        queues=list(row.queues),
        started_at=row.started_at,
        last_heartbeat_at=row.last_heartbeat_at,
        silent_for=silent_for,
        # The reaper's rule: silent for longer than WORKER_STALE_AFTER.
        stale=silent_for.total_seconds() > stale_after,
        processed=row.processed,
        failed=row.failed,
        supervisor=row.supervisor,
        pool=row.pool,
    )


def format_age(age: timedelta | None) -> str:
    """``3d 4h``, ``2h 5m``, ``4m 10s``, ``12s``: short enough for a table cell."""
    if age is None:
        return "-"
    seconds = int(age.total_seconds())
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {seconds}s"
    return f"{seconds}s"


def aligned(table: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """The rows of ``table`` as lines, each column padded to its widest cell, two spaces between."""
    widths = [max(len(row[n]) for row in table) for n in range(len(table[0]))]
    return [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table
    ]


def as_table(overview: Overview) -> str:
    """The overview as plain text for a terminal."""
    lines = [
        f"Queues at {overview.now:%Y-%m-%d %H:%M:%S} UTC "
        f"(acked and dead over the last 24 hours, from the {overview.per_hour_source})",
        "",
    ]
    header = ("queue", "ready", "scheduled", "in flight", "dead", "oldest ready", "acked/24h", "dead/24h", "")
    table = [header]
    for q in overview.queues:
        table.append(
            (
                q.name,
                str(q.ready),
                str(q.scheduled),
                str(q.in_flight),
                str(q.dead),
                format_age(q.oldest_ready_age),
                str(sum(q.acked_per_hour)),
                str(sum(q.dead_per_hour)),
                "paused" if q.paused else "",
            )
        )
    if len(table) == 1:
        lines.append("no queues yet")
    else:
        lines += aligned(table)
    if overview.flow:
        lines += ["", "Flow control"]
        for f in overview.flow:
            rate = f" ({f.rate_used} claim(s) in the current period)" if f.rate_used is not None else ""
            lines.append(f"  {f.queue}: {f.rules}{rate}")
            for g in f.groups:
                limit = "" if g.limit is None else f" of {g.limit}"
                lines.append(f"    group {g.name}: {g.in_flight}{limit} in flight")
    lines += ["", f"Workers ({len(overview.workers)})"]
    for w in overview.workers:
        flag = "  STALE" if w.stale else ""
        heartbeat = f"last heartbeat {format_age(w.silent_for)} ago"
        if w.pool is not None:
            lines.append(f"  {w.name}  pool of {w.pool_text}  queues {', '.join(w.queues)}  {heartbeat}{flag}")
            continue
        indent = "    " if w.depth else "  "
        lines.append(
            f"{indent}{w.name}  queues {', '.join(w.queues)}  {heartbeat}  "
            f"processed {w.processed}, failed {w.failed}{flag}"
        )
    if overview.workflows:
        lines += ["", f"Workflows in progress ({overview.workflows_running})"]
        for run in overview.workflows:
            failed = f", {run.failed_steps} failed" if run.failed_steps else ""
            age = format_age(run.running_for)
            lines.append(f"  #{run.id} {run.name}  {run.open_steps} step(s) open{failed}  for {age}")
    if overview.running:
        lines += ["", f"Running with progress ({len(overview.running)})"]
        for r in overview.running:
            progress = format_progress({"done": r.done, "total": r.total, "note": r.note})
            flag = "  CANCEL REQUESTED" if r.cancel_requested else ""
            lines.append(f"  #{r.id} {r.queue}/{r.kind or '-'}  {progress}  for {format_age(r.running_for)}{flag}")
    return "\n".join(lines)


def schedules_table(statuses: list[ScheduleStatus]) -> str:
    """The schedules as plain text for a terminal (``queuestats``), one aligned column per field."""
    rows = []
    for status in statuses:
        when = f"next {status.next_slot:%Y-%m-%d %H:%M:%S}" if status.next_slot is not None else "never"
        last = "no run yet"
        if status.last_slot is not None:
            sent = f"message {status.last_message_id} {status.last_outcome}" if status.last_message_id else "skipped"
            last = f"last {status.last_slot:%Y-%m-%d %H:%M:%S} ({status.last_trigger}): {sent}"
        rows.append((status.name, status.timing, f"-> {status.queue}", when, last, status.state.upper()))
    return "\n".join(["", f"Schedules ({len(statuses)})", *aligned(rows, indent="  ")])
