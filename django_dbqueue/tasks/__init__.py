"""A backend for Django's Tasks framework that keeps tasks in django-dbqueue.

::

    TASKS = {
        "default": {
            "BACKEND": "django_dbqueue.tasks.DatabaseQueueBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"MAX_ATTEMPTS": 1},
        }
    }

A task is a message of kind ``django.task``, written in the caller's
transaction; ``runqueueworker`` runs it through the handler registered for
that kind in each of the backend's queues. The parts:

- ``compat``: the framework, from ``django.tasks`` or the Django 5.2 backport;
- ``backend``: `DatabaseQueueBackend` (enqueue, validation, checks);
- ``results``: task messages and archive rows read back as ``TaskResult``;
- ``execution``: `TaskHandler`, running a task message in a worker;
- ``chaining``: tasks as the steps of a workflow (`task_step`, `parent_results`, `step_results`).

Without the framework this package still imports (``compat.FRAMEWORK`` is
None), and asking it for the backend raises an ImportError that says what
to install. See docs/tasks.md.
"""

from typing import Any

from .compat import FRAMEWORK, NOT_INSTALLED

__all__ = ["TASK_KIND", "DatabaseQueueBackend", "TaskHandler", "exception_class_path", "register_task_queues"]

if FRAMEWORK is not None:
    from .backend import DatabaseQueueBackend, register_task_queues
    from .execution import TaskHandler
    from .results import TASK_KIND, exception_class_path
else:

    def __getattr__(name: str) -> Any:
        if name in __all__:
            raise ImportError(NOT_INSTALLED)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
