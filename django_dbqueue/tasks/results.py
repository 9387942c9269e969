"""Task messages read back as the framework's objects: the Task a message holds, its TaskResult.

A task is a message of kind ``django.task`` whose payload names the task
(``"task"``, an import path) and holds its ``args``, ``kwargs``, backend
alias, priority and ``run_after`` (a plain-SQL producer may give only
``"task"``). The result id is the message id: a live message is READY or
RUNNING, an archive row SUCCESSFUL or FAILED.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast, overload

from django.utils.dateparse import parse_datetime
from django.utils.module_loading import import_string

from ..exceptions import TaskNotCompleted
from ..models import ArchivedMessage, Message, MessageState, Outcome
from .compat import (
    TASK_MAX_PRIORITY,
    TASK_MIN_PRIORITY,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
)

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations

    from ..models.messages import StateAnnotations

P = ParamSpec("P")
R = TypeVar("R")

TASK_KIND = "django.task"
NOT_COMPLETED = f"{TaskNotCompleted.__module__}.{TaskNotCompleted.__qualname__}"
_EXCEPTION_NAME = re.compile(r"[A-Za-z_][\w.]*")


def task_of(message: Message | ArchivedMessage, alias: str) -> Task[..., Any]:
    """The Task a message holds, as it was enqueued through backend ``alias``."""
    payload = message.payload
    path = payload.get("task")
    try:
        task = import_string(path)
    except (ImportError, TypeError, ValueError) as exc:
        raise ValueError(f"task {path!r} cannot be imported: {exc}") from exc
    if not isinstance(task, Task):
        raise ValueError(f"{path!r} is a {type(task).__name__}, not a task: decorate the function with @task")
    run_after = payload.get("run_after")
    priority = payload.get("priority")
    if priority is None:  # the message's own, in the framework's sense and range
        own = getattr(message, "held_priority", None)  # a live message flow control set aside keeps its own there
        own = message.priority if own is None else own
        priority = max(TASK_MIN_PRIORITY, min(TASK_MAX_PRIORITY, -own))
    return task.using(
        priority=priority,
        queue_name=message.queue,
        run_after=parse_datetime(run_after) if run_after else None,
        backend=alias,
    )


@overload
def task_result(
    message: Message | ArchivedMessage, status: str, *, alias: str, task: Task[P, R], **fields: Any
) -> TaskResult[P, R]: ...
@overload
def task_result(
    message: Message | ArchivedMessage, status: str, *, alias: str, task: None = None, **fields: Any
) -> TaskResult[..., Any]: ...
def task_result(
    message: Message | ArchivedMessage,
    status: str,
    *,
    alias: str,
    task: Task[..., Any] | None = None,
    **fields: Any,
) -> TaskResult[..., Any]:
    """The TaskResult of a live message or archive row in ``status`` (``fields`` override what it says)."""
    payload = message.payload
    started = message.claimed_at if message.attempts else None
    values = {
        "task": task if task is not None else task_of(message, alias),
        "id": str(message.pk if isinstance(message, Message) else message.message_id),
        "status": status,
        "enqueued_at": message.created_at,
        # Only the last claim's time is kept: started_at is the latest attempt's start.
        "started_at": started,
        "finished_at": None,
        "last_attempted_at": started,
        "args": payload.get("args", []),
        "kwargs": payload.get("kwargs", {}),
        "backend": alias,
        "errors": [task_error(message.last_error)] if message.last_error else [],
        "worker_ids": worker_ids(message.claimed_by if isinstance(message, Message) else "", message.attempts),
    }
    values.update(fields)
    return TaskResult(**values)


def live_result(message: WithAnnotations[Message, StateAnnotations], alias: str) -> TaskResult[..., Any]:
    """READY, or RUNNING while a worker holds it (``message`` read through ``with_state()``)."""
    running = message.current_state == MessageState.IN_FLIGHT
    return task_result(message, TaskResultStatus.RUNNING if running else TaskResultStatus.READY, alias=alias)


def archived_result(row: ArchivedMessage, alias: str) -> TaskResult[..., Any]:
    """SUCCESSFUL with its return value, or FAILED with why."""
    if row.outcome == Outcome.ACKED:
        result = task_result(
            row,
            TaskResultStatus.SUCCESSFUL,
            alias=alias,
            finished_at=row.finished_at,
            worker_ids=worker_ids(row.finished_by, row.attempts),
        )
        object.__setattr__(result, "_return_value", row.result)
        return result
    # Dead by the task's own exception keeps its traceback; anything else
    # (cancelled, expired, its worker died on the last attempt) did not complete.
    by_handler = row.outcome == Outcome.DEAD and row.finished_by != "reaper"
    reason = row.last_error or f"the task was {row.outcome}"
    error = task_error(reason) if by_handler else TaskError(exception_class_path=NOT_COMPLETED, traceback=reason)
    return task_result(
        row,
        TaskResultStatus.FAILED,
        alias=alias,
        finished_at=row.finished_at,
        errors=[error],
        worker_ids=worker_ids(row.finished_by if by_handler else "", row.attempts),
    )


def find_result(result_id: Any, *, alias: str, using: str, queues: list[str]) -> TaskResult[..., Any]:
    """The task's state now: from the live table if it is there, else from the archive."""
    pk = message_id(result_id)
    if pk is not None:
        # Live first: a task finishing meanwhile is archived in the same
        # transaction that deletes it, so a miss there finds it in the archive.
        found = Message.objects.using(using).with_state().locate(pk, kind=TASK_KIND, queue__in=queues)
        if isinstance(found, Message):  # read through with_state()
            return live_result(cast("WithAnnotations[Message, StateAnnotations]", found), alias)
        if found is not None:
            return archived_result(found, alias)
    raise TaskResultDoesNotExist(
        f"no task result with id {result_id!r} in queues {', '.join(queues)} "
        f"of backend {alias!r} (finished tasks are kept for their queue's RETENTION_DAYS, "
        "successful ones only where ARCHIVE is on)"
    )


def message_id(result_id: Any) -> int | None:
    """The message id a result id names, or None when it cannot name one."""
    text = str(result_id).strip()
    return int(text) if text.isascii() and text.isdigit() else None


def worker_ids(last: str, attempts: int) -> list[str]:
    """One entry per attempt: only the last attempt's worker is known; earlier ones are ''."""
    return [""] * (attempts - 1) + [last] if attempts else []


def class_path(exception_class: type[BaseException]) -> str:
    return f"{exception_class.__module__}.{exception_class.__qualname__}"


def task_error(text: str) -> TaskError:
    """A TaskError from a stored traceback, naming the exception Python's traceback ends with."""
    return TaskError(exception_class_path=exception_class_path(text) or NOT_COMPLETED, traceback=text)


def exception_class_path(text: str) -> str | None:
    """The import path of the exception a formatted traceback ends with, or None if it is not one.

    The last ``Traceback (most recent call last):`` block belongs to the
    exception that was raised last; its first unindented line names it
    (module-qualified unless it is a builtin).
    """
    lines = text.splitlines()
    starts = [index for index, line in enumerate(lines) if line == "Traceback (most recent call last):"]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line and not line[0].isspace():
            name = line.split(":", 1)[0].strip()
            if not _EXCEPTION_NAME.fullmatch(name):
                return None
            return name if "." in name else f"builtins.{name}"
    return None
