"""A schedule's declaration as checked data: when it fires, what it sends, how it catches up.

Declarations come from ``@django_dbqueue.schedule`` and from
``DBQUEUE["SCHEDULES"]``; both are turned into a `ScheduleSpec` by
`build_spec`, which names every bad field instead of raising, so the
system checks can report them all (E001 for the setting, E003 for code).
This module sits at the bottom of the layers beside ``conf`` and
``validation``: it reads no setting and touches no table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import validation
from ..exceptions import DbQueueError
from ..validation import (
    MAX_DELAY_SECONDS,
    PRIORITY_RANGE,
    json_problem,
    json_size_problem,
    queue_name_problem,
    validate_headers,
    validate_kind,
)
from .policy import CATCH_UP_POLICIES, LATEST
from .timing import Cron, Interval, Timing, cron_problem, timezone_problem

NAME_MAX_LENGTH = 100
CATCH_UP_LIMIT_MAX = 1000
DEFAULT_CATCH_UP_LIMIT = 10
GRACE_CAP = 60.0  # seconds: the default grace is the shorter of this and the interval

# The fields a declaration may give (the decorator's keyword arguments; the
# setting's keys are the same in capitals). ``task``, ``args`` and ``kwargs``
# are for Django Tasks framework tasks (see docs/schedules.md).
FIELDS = (
    "cron",
    "every",
    "timezone",
    "queue",
    "kind",
    "payload",
    "headers",
    "priority",
    "max_attempts",
    "catch_up",
    "catch_up_limit",
    "grace",
    "skip_if_running",
    "task",
    "args",
    "kwargs",
)
# Headers every scheduled message carries (they replace a declaration's own of the same name).
SCHEDULE_HEADER, SLOT_HEADER, TRIGGER_HEADER = "schedule", "schedule_slot", "schedule_trigger"


@dataclass(frozen=True)
class ScheduleSpec:
    """One valid schedule: its name is its identity (the key of its rows), keep it stable."""

    name: str
    timing: Timing
    queue: str
    kind: str = ""
    payload: Any = field(default_factory=dict)
    headers: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    max_attempts: int | None = None
    catch_up: str = LATEST
    catch_up_limit: int = DEFAULT_CATCH_UP_LIMIT
    grace: timedelta = timedelta(seconds=GRACE_CAP)
    skip_if_running: bool = False
    task: str | None = None  # the import path of a Tasks framework task, run with args and kwargs
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # where it was declared: "settings", or the decorated object's import path

    def describe(self) -> str:
        return self.timing.describe()


def name_problem(name: Any) -> str | None:
    return validation.name_problem(name, "schedule", NAME_MAX_LENGTH)


def _seconds(value: Any) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def build_spec(
    name: str, values: dict[str, Any], *, default_timezone: str, origin: str = ""
) -> tuple[ScheduleSpec | None, list[tuple[str, str]]]:
    """Check a declaration; returns the spec (None if invalid) and ``(field, why)`` for each problem.

    ``values`` uses the lowercase field names. A task's queue is filled in
    later, once the task can be imported (see the registry); until then
    ``queue`` may be missing when ``task`` is given.
    """
    problems: list[tuple[str, str]] = []

    def bad(name: str, why: str) -> None:
        problems.append((name, why))

    if (why := name_problem(name)) is not None:
        bad("name", why)
    for key in values:
        if key not in FIELDS:
            bad(key, f"is not a schedule field; known: {', '.join(FIELDS)}")

    cron, every = values.get("cron"), values.get("every")
    timing: Timing | None = None
    zone = values.get("timezone") or default_timezone
    if (zone_problem := timezone_problem(zone)) is not None:
        bad("timezone", zone_problem)
    if (cron is None) == (every is None):
        bad("cron", "give exactly one of cron (an expression such as '*/5 * * * *') and every (an interval)")
    elif cron is not None:
        if (why := cron_problem(cron)) is not None:
            bad("cron", why)
        elif zone_problem is None:
            timing = Cron(cron.strip(), zone)
    else:
        seconds = _seconds(every)
        if seconds is None or not 1 <= seconds <= MAX_DELAY_SECONDS or seconds != int(seconds):
            bad("every", f"must be a whole number of seconds (1 to ten years) or a timedelta, not {every!r}")
        else:
            timing = Interval(int(seconds))

    task = values.get("task")
    queue = values.get("queue")
    if task is not None:
        if not isinstance(task, str) or not task:
            bad("task", f"must be the import path of a task, such as 'shop.tasks.cleanup', not {task!r}")
        for other in ("queue", "kind", "payload"):
            if values.get(other) is not None:
                bad(other, "is the task's own: a task schedule sends the task (give args and kwargs instead)")
        args, kwargs = values.get("args") or [], values.get("kwargs") or {}
        if not isinstance(args, list | tuple):
            bad("args", f"must be a list, not {type(args).__name__}")
        elif (why := json_problem(list(args), "args")) is not None:
            bad("args", why)
        if not isinstance(kwargs, dict):
            bad("kwargs", f"must be a dict, not {type(kwargs).__name__}")
        elif (why := json_problem(kwargs, "kwargs")) is not None:
            bad("kwargs", why)
    else:
        for other in ("args", "kwargs"):
            if values.get(other) is not None:
                bad(other, "only applies to a task schedule (give payload instead)")
        if queue is None:
            bad("queue", "is missing: name the queue the messages go to (or put @schedule above @handler)")
        elif (why := queue_name_problem(queue)) is not None:
            bad("queue", why)
    kind = values.get("kind") or ""
    headers = values.get("headers") or {}
    for key, check in (("kind", validate_kind), ("headers", validate_headers)):
        try:
            check(values.get(key))
        except DbQueueError as exc:
            if values.get(key) is not None:
                bad(key, str(exc))
    payload = values.get("payload")
    payload = {} if payload is None else payload
    if (why := json_problem(payload, "payload") or json_size_problem(payload, "payload")) is not None:
        bad("payload", why)
    priority = values.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in PRIORITY_RANGE:
        bad("priority", f"must be an integer from -32768 to 32767 (smaller runs first), not {priority!r}")
    max_attempts = values.get("max_attempts")
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 1 <= max_attempts <= 32767
    ):
        bad("max_attempts", f"must be an integer from 1 to 32767 or None, not {max_attempts!r}")
    catch_up = values.get("catch_up") or LATEST
    if catch_up not in CATCH_UP_POLICIES:
        bad("catch_up", f"must be one of {', '.join(map(repr, CATCH_UP_POLICIES))}, not {catch_up!r}")
    limit = values.get("catch_up_limit")
    limit = DEFAULT_CATCH_UP_LIMIT if limit is None else limit
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= CATCH_UP_LIMIT_MAX:
        bad("catch_up_limit", f"must be an integer from 1 to {CATCH_UP_LIMIT_MAX}, not {limit!r}")
    grace = values.get("grace")
    grace_seconds: float | None
    if grace is None:
        grace_seconds = min(GRACE_CAP, timing.seconds) if isinstance(timing, Interval) else GRACE_CAP
    else:
        grace_seconds = _seconds(grace)
        if grace_seconds is None or not 0 <= grace_seconds <= MAX_DELAY_SECONDS:
            bad("grace", f"must be a number of seconds (0 to ten years) or a timedelta, not {grace!r}")
    skip = values.get("skip_if_running", False)
    if not isinstance(skip, bool):
        bad("skip_if_running", f"must be True or False, not {skip!r}")

    if problems or timing is None:
        return None, problems
    spec = ScheduleSpec(
        name=name,
        timing=timing,
        queue=queue or "",
        kind=kind,
        payload=payload,
        headers=dict(headers),
        priority=priority,
        max_attempts=max_attempts,
        catch_up=catch_up,
        catch_up_limit=limit,
        grace=timedelta(seconds=grace_seconds or 0),
        skip_if_running=skip,
        task=task,
        args=list(values.get("args") or []),
        kwargs=dict(values.get("kwargs") or {}),
        origin=origin,
    )
    return spec, []
