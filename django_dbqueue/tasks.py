"""A backend for Django's Tasks framework that keeps tasks in django-dbqueue.

::

    TASKS = {
        "default": {
            "BACKEND": "django_dbqueue.tasks.DatabaseQueueBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"MAX_ATTEMPTS": 1},
        }
    }

A task is a message of kind ``django.task`` in the queue its ``queue_name``
names, written in the caller's transaction. ``runqueueworker`` runs it
through the handler this module registers for that kind in each of the
backend's queues. The result id is the message id: ``get_result`` reads the
live table (READY, RUNNING), then the archive (SUCCESSFUL, FAILED). The
framework's priority (-100..100, larger runs sooner) is stored negated,
since a smaller message priority runs sooner. See docs/tasks.md.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

from django.core.checks import CheckMessage
from django.core.checks import Warning as CheckWarning
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.module_loading import import_string

from . import handlers, taskframework
from .conf import database_for, find_problems, queue_options, raw_setting, task_backend_options, task_backend_problems
from .exceptions import TaskNotCompleted
from .models import ArchivedMessage, Message, MessageState, Outcome
from .operations import backoff_delay, enqueue, error_text
from .validation import queue_name_problem

if taskframework.FRAMEWORK is None:
    raise ImportError(
        "django_dbqueue.tasks needs Django's Tasks framework: Django 6.0 or later, "
        "or on Django 5.2 the django-tasks backport (pip install 'django-dbqueue[tasks]')"
    )

from .taskframework import (  # imported only once the framework is known to be there
    DEFAULT_TASK_BACKEND_ALIAS,
    DEFAULT_TASK_QUEUE_NAME,
    TASK_MAX_PRIORITY,
    TASK_MIN_PRIORITY,
    BaseTaskBackend,
    InvalidTaskBackend,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)

__all__ = ["TASK_KIND", "DatabaseQueueBackend", "TaskHandler", "exception_class_path", "register_task_queues"]

TASK_KIND = "django.task"
NOT_COMPLETED = f"{TaskNotCompleted.__module__}.{TaskNotCompleted.__qualname__}"
_EXCEPTION_NAME = re.compile(r"[A-Za-z_][\w.]*")


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
        _register(self.queue_names)

    @property
    def database(self) -> str:
        """The database alias all of this backend's queues live on (DBQUEUE's per-queue DATABASE)."""
        return database_for(self.queue_names)

    # --- producing -------------------------------------------------------------

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Write the task as a message, in the caller's transaction; returns its READY result.

        ``task_enqueued`` is sent once that transaction commits (at once in
        autocommit); a rolled-back enqueue sends nothing and leaves nothing.
        """
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
        message = enqueue(
            task.queue_name,
            payload,
            kind=TASK_KIND,
            priority=-task.priority,
            run_at=run_at,
            max_attempts=self.max_attempts,
            using=self.database,
        )
        result = self._result(task, message, TaskResultStatus.READY)
        transaction.on_commit(partial(task_enqueued.send, type(self), task_result=result), using=self.database)
        return result

    # --- results ---------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult:
        """The task's state now: from the live table if it is there, else from the archive."""
        pk = _message_id(result_id)
        if pk is not None:
            # Live first: a task finishing meanwhile is archived in the same
            # transaction that deletes it, so a miss here finds it below.
            found = (
                Message.objects.using(self.database).with_state().locate(pk, kind=TASK_KIND, queue__in=self.queue_names)
            )
            if isinstance(found, Message):
                running = found.current_state == MessageState.IN_FLIGHT
                return self._result(None, found, TaskResultStatus.RUNNING if running else TaskResultStatus.READY)
            if found is not None:
                return self._archived_result(found)
        raise TaskResultDoesNotExist(
            f"no task result with id {result_id!r} in queues {', '.join(self.queue_names)} "
            f"of backend {self.alias!r} (finished tasks are kept for their queue's RETENTION_DAYS, "
            "successful ones only where ARCHIVE is on)"
        )

    def _task(self, message: Message | ArchivedMessage) -> Task:
        """The Task a message holds, as it was enqueued (a plain-SQL producer may leave out all but "task")."""
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
            priority = max(TASK_MIN_PRIORITY, min(TASK_MAX_PRIORITY, -message.priority))
        return task.using(
            priority=priority,
            queue_name=message.queue,
            run_after=parse_datetime(run_after) if run_after else None,
            backend=self.alias,
        )

    def _result(self, task: Task | None, message: Message | ArchivedMessage, status: str, **fields: Any) -> TaskResult:
        payload = message.payload
        live = isinstance(message, Message)
        started = message.claimed_at if message.attempts else None
        values = {
            "task": task if task is not None else self._task(message),
            "id": str(message.pk if live else message.message_id),
            "status": status,
            "enqueued_at": message.created_at,
            # Only the last claim's time is kept: started_at is the latest attempt's start.
            "started_at": started,
            "finished_at": None,
            "last_attempted_at": started,
            "args": payload.get("args", []),
            "kwargs": payload.get("kwargs", {}),
            "backend": self.alias,
            "errors": [_error(message.last_error)] if message.last_error else [],
            "worker_ids": _worker_ids(message.claimed_by if live else "", message.attempts),
        }
        values.update(fields)
        return TaskResult(**values)

    def _archived_result(self, row: ArchivedMessage) -> TaskResult:
        if row.outcome == Outcome.ACKED:
            result = self._result(
                None,
                row,
                TaskResultStatus.SUCCESSFUL,
                finished_at=row.finished_at,
                worker_ids=_worker_ids(row.finished_by, row.attempts),
            )
            object.__setattr__(result, "_return_value", row.result)
            return result
        # Dead by the task's own exception keeps its traceback; anything else
        # (cancelled, expired, its worker died on the last attempt) did not complete.
        by_handler = row.outcome == Outcome.DEAD and row.finished_by != "reaper"
        reason = row.last_error or f"the task was {row.outcome}"
        error = _error(reason) if by_handler else TaskError(exception_class_path=NOT_COMPLETED, traceback=reason)
        return self._result(
            None,
            row,
            TaskResultStatus.FAILED,
            finished_at=row.finished_at,
            errors=[error],
            worker_ids=_worker_ids(row.finished_by if by_handler else "", row.attempts),
        )

    # --- running ---------------------------------------------------------------

    def run(self, message: Message) -> Any:
        """Run the claimed task message's function; the handler registered for ``django.task``.

        Returns the task's JSON return value (dispatch acks with it); a task
        that raises is retried while it has attempts left, else dead (FAILED)
        with its traceback.
        """
        task = self._task(message)
        result = self._result(task, message, TaskResultStatus.RUNNING)
        task_started.send(type(self), task_result=result)
        try:
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
            else:
                value = task.call(*result.args, **result.kwargs)
            # What a JSON column will give back, refusing NaN and infinity.
            value = json.loads(json.dumps(normalize_json(value), allow_nan=False))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit in a task fails the task, not the worker
            error = TaskError(exception_class_path=_class_path(type(exc)), traceback=error_text(exc))
            retry = message.attempts_left()
            result.errors.append(error)
            object.__setattr__(result, "status", TaskResultStatus.READY if retry else TaskResultStatus.FAILED)
            if not retry:
                object.__setattr__(result, "finished_at", timezone.now())
            message._dbqueue_task_result = result
            if retry:
                raise handlers.Retry(delay=backoff_delay(message), reason=error.traceback) from None
            raise handlers.Reject(error.traceback) from None
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "finished_at", timezone.now())
        object.__setattr__(result, "_return_value", value)
        message._dbqueue_task_result = result
        return value

    # --- checks ----------------------------------------------------------------

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


class TaskHandler:
    """The handler of ``django.task`` messages: runs the task, then announces the outcome.

    ``task_finished`` is sent from ``after_record``, once the outcome is
    written, so a receiver's ``get_result()`` already sees it.
    """

    def __call__(self, message: Message) -> Any:
        alias = message.payload.get("backend") or DEFAULT_TASK_BACKEND_ALIAS
        backend = task_backends[alias]
        if not isinstance(backend, DatabaseQueueBackend):
            raise TypeError(f"TASKS[{alias!r}] is a {type(backend).__name__}, not a DatabaseQueueBackend")
        return backend.run(message)

    def after_record(self, message: Message, outcome: str) -> None:
        from .dispatch import Outcome as Recorded

        result = getattr(message, "_dbqueue_task_result", None)
        if result is None or outcome == Recorded.LEASE_LOST:
            return  # never started, or another worker or the reaper has it now
        task_finished.send(type(result.task.get_backend()), task_result=result)

    def __repr__(self) -> str:
        return "django_dbqueue.tasks.TaskHandler"


_handler = TaskHandler()


def _register(queues: list[str]) -> None:
    for queue in queues:
        handlers.handler(queue, kind=TASK_KIND)(_handler)


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
            _register([name for name in queues if queue_name_problem(name) is None])


def _message_id(result_id: Any) -> int | None:
    text = str(result_id).strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _worker_ids(last: str, attempts: int) -> list[str]:
    """One entry per attempt: only the last attempt's worker is known; earlier ones are ''."""
    return [""] * (attempts - 1) + [last] if attempts else []


def _class_path(exception_class: type[BaseException]) -> str:
    return f"{exception_class.__module__}.{exception_class.__qualname__}"


def _error(text: str) -> TaskError:
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
