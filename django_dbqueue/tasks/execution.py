"""Running a task message in a worker: the handler of ``django.task`` messages.

The task's function runs with the framework's signals around it:
``task_started`` before, ``task_finished`` once the outcome is written
(from ``after_record``), so a receiver's ``get_result()`` already sees it.
For a task that raised, ``task_finished`` is sent with that exception
being handled, as the framework's own backends send it: its receivers
(the framework logs a failure with ``logger.exception`` or
``sys.exc_info()``) see the task's error and traceback, not ``NoneType: None``.
A task that raises is retried while it has attempts left, else dead
(FAILED) with its traceback; ``SystemExit`` in a task fails the task, not
the worker.
"""

from __future__ import annotations

import json
from typing import Any

from django.utils import timezone

from .. import handlers
from ..models import Message
from ..operations import backoff_delay, error_text
from ..running import HandlerOutcome as Recorded
from .compat import (
    DEFAULT_TASK_BACKEND_ALIAS,
    BaseTaskBackend,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_finished,
    task_started,
)
from .results import class_path, task_of, task_result

# Where a run leaves its TaskResult, and the exception the task raised, on the message, for after_record.
RESULT = "_dbqueue_task_result"
RAISED = "_dbqueue_task_raised"


def run_task(message: Message, backend: BaseTaskBackend) -> Any:
    """Run the claimed task message's function; returns its JSON return value (the ack's result).

    The result the run ends with is kept on the message for ``after_record``
    to announce. Raises ``Retry`` or ``Reject`` for a task that raised.
    """
    task = task_of(message, backend.alias)
    result = task_result(message, TaskResultStatus.RUNNING, alias=backend.alias, task=task)
    task_started.send(type(backend), task_result=result)
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
        error = TaskError(exception_class_path=class_path(type(exc)), traceback=error_text(exc))
        retry = message.attempts_left()
        result.errors.append(error)
        object.__setattr__(result, "status", TaskResultStatus.READY if retry else TaskResultStatus.FAILED)
        if not retry:
            object.__setattr__(result, "finished_at", timezone.now())
        vars(message)[RESULT] = result
        vars(message)[RAISED] = exc
        if retry:
            raise handlers.Retry(delay=backoff_delay(message), reason=error.traceback) from None
        raise handlers.Reject(error.traceback) from None
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    vars(message)[RESULT] = result
    return value


class TaskHandler:
    """The handler of ``django.task`` messages: runs the task, then announces the outcome.

    ``backend_class`` is the backend a message's ``TASKS`` alias must name
    (a task enqueued elsewhere is not run by whatever backend holds the alias now).
    """

    def __init__(self, backend_class: type) -> None:
        self.backend_class = backend_class

    def __call__(self, message: Message) -> Any:
        alias = message.payload.get("backend") or DEFAULT_TASK_BACKEND_ALIAS
        backend = task_backends[alias]
        if not isinstance(backend, self.backend_class):
            raise TypeError(f"TASKS[{alias!r}] is a {type(backend).__name__}, not a {self.backend_class.__name__}")
        return run_task(message, backend)

    def after_record(self, message: Message, outcome: str) -> None:
        result: TaskResult[..., Any] | None = vars(message).get(RESULT)
        if result is None or outcome == Recorded.LEASE_LOST:
            return  # never started, or another worker or the reaper has it now
        sender = type(result.task.get_backend())
        raised: BaseException | None = vars(message).pop(RAISED, None)
        if raised is None:
            task_finished.send(sender, task_result=result)
            return
        try:  # the receivers run while the task's exception is being handled, traceback and all
            raise raised
        except BaseException:
            task_finished.send(sender, task_result=result)

    def __repr__(self) -> str:
        return "django_dbqueue.tasks.TaskHandler"
