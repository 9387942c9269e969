"""DatabaseQueueBackend: the ``TASKS`` backend that writes tasks as django-dbqueue messages.

A task is enqueued in the caller's transaction as a message of kind
``django.task`` in the queue its ``queue_name`` names; the framework's
priority (-100..100, larger runs sooner) is stored negated, since a
smaller message priority runs sooner. The backend registers the task
handler (`execution`) for its queues, and reads results through
`results`. See docs/tasks.md.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ParamSpec, TypeVar

from django.core.checks import CheckMessage
from django.core.checks import Warning as CheckWarning
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from .. import handlers
from ..conf import database_for, find_problems, queue_options, raw_setting, task_backend_options, task_backend_problems
from ..exceptions import InvalidOption
from ..models import Message
from ..operations import enqueue
from ..schedules.registry import TaskMessage, register_task_builder
from ..schedules.spec import ScheduleSpec
from ..validation import queue_name_problem
from .compat import (
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    InvalidTaskBackend,
    Task,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_enqueued,
)
from .execution import TaskHandler
from .results import TASK_KIND, find_result, task_result

P = ParamSpec("P")
R = TypeVar("R")


class DatabaseQueueBackend(BaseTaskBackend):
    """Tasks stored as django-dbqueue messages and run by ``runqueueworker``."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        problems = task_backend_problems(params)
        if problems:
            raise InvalidTaskBackend(f"TASKS[{alias!r}]: " + "; ".join(problems))
        super().__init__(alias, params)
        self.queue_names = sorted(self.queues)
        self.max_attempts = task_backend_options(params).max_attempts
        register(self.queue_names)

    @property
    def database(self) -> str:
        """The database alias all of this backend's queues live on (DBQUEUE's per-queue DATABASE)."""
        return database_for(self.queue_names)

    def enqueue(self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]) -> TaskResult[P, R]:
        """Write the task as a message, in the caller's transaction; returns its READY result.

        ``task_enqueued`` is sent once that transaction commits (at once in
        autocommit); a rolled-back enqueue sends nothing and leaves nothing.
        """
        queue, payload, options = self.task_message(task, args, kwargs)
        message = enqueue(queue, payload, **options)
        return self.announce(task, message)

    def task_message(
        self, task: Task[..., Any], args: list[Any], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """The message that stands for ``task`` called with ``args`` and ``kwargs``: queue, payload, options."""
        self.validate_task(task)
        payload = {
            "task": task.module_path,
            "args": normalize_json(args),
            "kwargs": normalize_json(kwargs),
            "backend": self.alias,
            "priority": task.priority,
            "run_after": task.run_after.isoformat() if task.run_after else None,
        }
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):  # allowed by the framework when USE_TZ is False
            run_at = timezone.make_aware(run_at)
        options = {
            "kind": TASK_KIND,
            "priority": -task.priority,
            "run_at": run_at,
            "max_attempts": self.max_attempts,
            "using": self.database,
        }
        return task.queue_name, payload, options

    def announce(self, task: Task[P, R], message: Message) -> TaskResult[P, R]:
        """The task's READY result; ``task_enqueued`` goes out once the message's transaction commits."""
        result = task_result(message, TaskResultStatus.READY, alias=self.alias, task=task)
        transaction.on_commit(partial(task_enqueued.send, type(self), task_result=result), using=self.database)
        return result

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """The task's state now: from the live table if it is there, else from the archive."""
        return find_result(result_id, alias=self.alias, using=self.database, queues=self.queue_names)

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        messages = list(super().check(**kwargs))
        if find_problems(raw_setting()):
            return messages  # django_dbqueue.E001 reports those
        for queue in self.queue_names:
            if not queue_options(queue).archive:
                messages.append(
                    CheckWarning(
                        f"TASKS[{self.alias!r}] serves queue {queue!r}, whose DBQUEUE ARCHIVE is False: "
                        "a successful task's result is deleted with it, so get_result() cannot find it",
                        hint="Keep ARCHIVE on for task queues (RETENTION_DAYS bounds the archive). See docs/tasks.md.",
                        id="django_dbqueue.W002",
                    )
                )
        return messages


# One handler for every task queue: a worker runs whichever backend's tasks it claims.
HANDLER = TaskHandler(DatabaseQueueBackend)


def register(queues: list[str]) -> None:
    """Register the task handler for ``django.task`` messages of ``queues`` (other kinds stay their own)."""
    for queue in queues:
        handlers.handler(queue, kind=TASK_KIND)(HANDLER)


def register_task_queues() -> None:
    """Register the task handler for the queues of every TASKS backend of ours (called at startup).

    So ``runqueueworker`` serves task queues without the backends having
    been used in its process. Bad entries are skipped here; the framework's
    checks and the backend's first use report them.
    """
    for params in task_backends.settings.values():
        try:
            backend_class = import_string(params["BACKEND"])
        except Exception:  # a broken entry must not stop every manage.py command; its first use reports it
            continue
        if not (isinstance(backend_class, type) and issubclass(backend_class, DatabaseQueueBackend)):
            continue
        queues = params.get("QUEUES", [DEFAULT_TASK_QUEUE_NAME])
        if isinstance(queues, list | tuple | set | frozenset):
            register([name for name in queues if queue_name_problem(name) is None])


def scheduled_task_message(spec: ScheduleSpec) -> TaskMessage:
    """What a schedule's slot sends for a task (``@schedule`` on a ``@task``): see docs/schedules.md."""
    assert spec.task is not None  # a task schedule
    task = import_string(spec.task)
    if not isinstance(task, Task):
        raise InvalidOption(f"schedule {spec.name!r}: {spec.task!r} is a {type(task).__name__}, not a task")
    backend = task.get_backend()
    if not isinstance(backend, DatabaseQueueBackend):
        raise InvalidOption(
            f"schedule {spec.name!r}: task {spec.task!r} runs on TASKS[{task.backend!r}], a "
            f"{type(backend).__name__}; a scheduled task needs a DatabaseQueueBackend"
        )
    queue, payload, options = backend.task_message(task, spec.args, spec.kwargs)
    options.pop("using")  # the scheduler writes on the queue's database, the backend's own
    return queue, payload, options, lambda message: backend.announce(task, message)


register_task_builder(scheduled_task_message)
