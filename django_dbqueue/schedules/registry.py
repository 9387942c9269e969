"""Declared schedules: ``@django_dbqueue.schedule`` in code and ``DBQUEUE["SCHEDULES"]`` in settings.

::

    @django_dbqueue.schedule("0 7 * * MON-FRI", timezone="Europe/Berlin")
    @django_dbqueue.handler("reports", kind="daily-digest")
    def daily_digest(message): ...

A decorator records the declaration and returns its target unchanged.
Declarations are checked when they are read (`declared`), once every
app's ``queues.py`` has registered its handlers: so ``@schedule`` can take
its queue and kind from the ``@handler`` below it, and a bad field is a
system check error (``django_dbqueue.E003``) naming the schedule and the
field, never a traceback at import.

A schedule's name is its identity in the database: keep it stable. By
default it is the decorated object's import path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.utils.module_loading import import_string

from .. import handlers
from ..conf import get_settings, queue_options, raw_setting, schedule_specs, schedule_timezone
from ..exceptions import ImproperlyConfiguredQueue
from .spec import ScheduleSpec, build_spec

if TYPE_CHECKING:
    from ..models import Message

T = TypeVar("T")

# What django_dbqueue.tasks gives the scheduler for a task schedule: the
# message's queue, payload and enqueue options, and a callable run with the
# inserted message once its transaction commits (the task_enqueued signal).
# queue, payload, options, and what to call with the message once it commits.
TaskMessage = tuple[str, Any, dict[str, Any], "Callable[[Message], object] | None"]
TaskMessageBuilder = Callable[[ScheduleSpec], TaskMessage]


@dataclass
class Declaration:
    name: str
    values: dict[str, Any]
    target: Any  # the decorated handler or task (None when declared without one)
    origin: str


_declared: dict[str, Declaration] = {}
_conflicts: list[str] = []
_task_builder: TaskMessageBuilder | None = None


def schedule(
    cron: str | None = None,
    *,
    every: timedelta | float | None = None,
    name: str | None = None,
    queue: str | None = None,
    kind: str | None = None,
    payload: Any = None,
    timezone: str | None = None,
    catch_up: str | None = None,
    catch_up_limit: int | None = None,
    grace: timedelta | float | None = None,
    skip_if_running: bool = False,
    priority: int = 0,
    headers: dict[str, Any] | None = None,
    max_attempts: int | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> Callable[[T], T]:
    """Declare that a message goes out at every slot of ``cron`` (or ``every`` interval).

    On a ``@handler`` function, ``queue`` and ``kind`` default to the
    handler's; on a Tasks-framework ``@task``, the task itself is enqueued
    (with ``args`` and ``kwargs``). See docs/schedules.md for every field.
    """
    given = {
        "cron": cron,
        "every": every,
        "queue": queue,
        "kind": kind,
        "payload": payload,
        "timezone": timezone,
        "catch_up": catch_up,
        "catch_up_limit": catch_up_limit,
        "grace": grace,
        "headers": headers,
        "max_attempts": max_attempts,
        "args": args,
        "kwargs": kwargs,
    }
    values = {key: value for key, value in given.items() if value is not None}
    values["skip_if_running"] = skip_if_running
    values["priority"] = priority

    def declare(target: T) -> T:
        origin = _path(target)
        key = name or origin
        existing = _declared.get(key)
        if existing is not None and existing.origin != origin:
            _conflicts.append(f"schedule {key!r} is declared twice, by {existing.origin} and {origin}; give name=")
        _declared[key] = Declaration(key, dict(values), target, origin)
        return target

    return declare


def declared() -> tuple[dict[str, ScheduleSpec], list[str]]:
    """Every valid schedule by name, and a sentence for each problem (settings' own are E001's)."""
    try:
        from_settings = get_settings().schedules
    except ImproperlyConfiguredQueue:  # E001 reports the setting's problems; the valid entries still count
        raw = raw_setting()
        from_settings = schedule_specs(raw.get("SCHEDULES", {}) if isinstance(raw, dict) else {})[0]
    specs = {name: _with_task_queue(spec) for name, spec in from_settings.items()}
    problems = list(_conflicts)
    for name, declaration in _declared.items():
        where = f"schedule {name!r}" + ("" if declaration.origin == name else f" (declared on {declaration.origin})")
        if name in specs:
            problems.append(f"{where} is also declared in DBQUEUE['SCHEDULES']; give one of them another name")
            continue
        values, found = _resolve(declaration)
        spec, bad = build_spec(name, values, default_timezone=schedule_timezone(), origin=declaration.origin)
        found += [f"{field} {why}" for field, why in bad]
        if found:
            problems += [f"{where}: {why}" for why in found]
        elif spec is not None:
            specs[name] = _with_task_queue(spec, declaration.target)
    for name, spec in list(specs.items()):
        if spec.task and not spec.queue:
            problems.append(f"schedule {name!r}: task {spec.task!r} cannot be imported, or is not a @task")
            del specs[name]
    return specs, problems


def schedules_for(using: str) -> list[ScheduleSpec]:
    """The schedules whose queue lives on database ``using``; raises ImproperlyConfiguredQueue on any problem."""
    specs, problems = declared()
    if problems:
        raise ImproperlyConfiguredQueue("; ".join(problems))
    return [spec for _, spec in sorted(specs.items()) if queue_options(spec.queue).database == using]


def register_task_builder(builder: TaskMessageBuilder) -> None:
    """Called by django_dbqueue.tasks: how a task schedule becomes a message (the layers point down)."""
    global _task_builder
    _task_builder = builder


def task_message(spec: ScheduleSpec) -> TaskMessage:
    if _task_builder is None:
        raise ImproperlyConfiguredQueue(
            f"schedule {spec.name!r} runs task {spec.task!r}, but no TASKS backend of django-dbqueue is set up"
        )
    return _task_builder(spec)


def forget(name: str) -> None:
    """Drop a code declaration (tests; a schedule's rows stay, and it shows as orphaned)."""
    _declared.pop(name, None)


def snapshot() -> tuple[dict[str, Declaration], list[str]]:
    """The code declarations, to put back with `restore` (tests)."""
    return dict(_declared), list(_conflicts)


def restore(state: tuple[dict[str, Declaration], list[str]]) -> None:
    _declared.clear()
    _declared.update(state[0])
    _conflicts[:] = state[1]


# --- helpers -------------------------------------------------------------------


def _is_task(target: Any) -> bool:
    """A Tasks framework task (Django 6's or the django-tasks backport's), known by its shape.

    The framework's adapter lives in django_dbqueue.tasks, above this layer.
    """
    return all(hasattr(target, name) for name in ("module_path", "queue_name", "get_backend", "enqueue"))


def _path(target: Any) -> str:
    if _is_task(target):
        path: str = target.module_path
        return path
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def _resolve(declaration: Declaration) -> tuple[dict[str, Any], list[str]]:
    """Fill in what the target implies: a task's path, or a handler's queue and kind."""
    values = dict(declaration.values)
    target = declaration.target
    if _is_task(target):
        values.setdefault("task", target.module_path)
        return values, []
    if "queue" in values or target is None:
        return values, []
    places = [(queue, kind) for (queue, kind), function in handlers.registered().items() if function is target]
    if len(places) > 1:
        return values, [f"queue is missing and {declaration.origin} handles several queues; give queue= and kind="]
    if places:
        values["queue"] = places[0][0]
        values.setdefault("kind", places[0][1] or "")
    return values, []


def _with_task_queue(spec: ScheduleSpec, target: Any = None) -> ScheduleSpec:
    """A task schedule's queue is its task's ``queue_name``: the database it lives on is the scheduler's."""
    if not spec.task or spec.queue:
        return spec
    task = target if _is_task(target) else None
    if task is None:
        try:
            task = import_string(spec.task)
        except (ImportError, ValueError):
            return spec
    if not _is_task(task):
        return spec
    return replace(spec, queue=task.queue_name)
