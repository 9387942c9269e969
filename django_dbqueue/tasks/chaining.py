"""Chaining ``@task`` functions of Django's Tasks framework as a workflow (docs/tasks.md).

`task_step` makes a workflow `Step` of a task and its arguments: the
step's message is the one ``task.enqueue()`` would write (kind
``django.task``, the task's queue, priority and ``run_after``, the
backend's ``MAX_ATTEMPTS``), written once the step is ready, and run by
the backend's task handler like any task. Results flow as the backend's:
a task declared ``takes_context=True`` reads its parents' return values
with `parent_results`, and `step_results` gives every step's ``TaskResult``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..exceptions import InvalidOption
from ..models import Message, WorkflowRun
from ..workflows import Step
from .backend import DatabaseQueueBackend
from .compat import Task, TaskContext, TaskResult, task_backends


def _backend(alias: str) -> DatabaseQueueBackend:
    backend = task_backends[alias]
    if not isinstance(backend, DatabaseQueueBackend):
        raise InvalidOption(f"TASKS[{alias!r}] is a {type(backend).__name__}; a task step needs a DatabaseQueueBackend")
    return backend


def task_step(name: str, task: Task[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Step:
    """A workflow step that runs ``task(*args, **kwargs)`` on its backend (a `DatabaseQueueBackend`).

    For `Workflow.chain`, ``group`` and ``chord``; the task's options
    (``task.using(priority=..., queue_name=..., run_after=...)``) are the
    step's. Its arguments are checked as ``enqueue()`` checks them.
    """
    if not isinstance(task, Task):
        raise InvalidOption(f"step {name!r}: {task!r} is not a task: decorate the function with @task")
    queue, payload, options = _backend(task.backend).task_message(task, list(args), dict(kwargs or {}))
    options.pop("using")  # every step lives on the workflow's database, which is the backend's
    return Step(name, queue, payload, **options)


def parent_results(context: TaskContext[..., Any]) -> dict[str, Any]:
    """In a task run as a step (``takes_context=True``): step name -> return value of each step it waits for.

    In the order of its dependencies (a chord's body: its group's order);
    see `Message.parent_results` for the bounds.
    """
    result = context.task_result
    message = Message.objects.using(_backend(result.backend).database).get(pk=int(result.id))
    return message.parent_results()


def step_results(workflow_id: int, *, backend: str = "default") -> dict[str, TaskResult[..., Any] | None]:
    """Step name -> its task's ``TaskResult`` (None while the step waits), in declaration order."""
    tasks = _backend(backend)
    status = WorkflowRun.objects.using(tasks.database).status(workflow_id)
    return {
        step["name"]: tasks.get_result(str(step["message_id"])) if step["message_id"] is not None else None
        for step in status["steps"]
    }
