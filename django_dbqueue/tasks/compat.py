"""Django's Tasks framework, wherever it is installed.

Django 6.0 and later ship it as ``django.tasks``; on Django 5.2 the
``django-tasks`` backport (0.12 or later) provides the same API as
``django_tasks``, with two exceptions spelled differently. Everything
django-dbqueue uses from the framework is imported here, under one set of
names, so the rest of the code does not care which one it got. When neither
is installed ``FRAMEWORK`` is None, and importing any other name raises an
ImportError that says what to install.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

NOT_INSTALLED = (
    "django_dbqueue.tasks needs Django's Tasks framework: Django 6.0 or later, "
    "or on Django 5.2 the django-tasks backport (pip install 'django-dbqueue[tasks]')"
)


def installed() -> str | None:
    """The importable framework's package name, or None (Django 5.2 without the backport)."""
    if find_spec("django.tasks") is not None:
        return "django.tasks"
    if find_spec("django_tasks") is not None:
        return "django_tasks"
    return None


FRAMEWORK = installed()

# Type checkers read Django's own module (django-stubs types it); the backport's names match.
if TYPE_CHECKING or FRAMEWORK == "django.tasks":
    from django.tasks import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, TaskError
    from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
elif FRAMEWORK == "django_tasks":
    from django_tasks import task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        TASK_MAX_PRIORITY,
        TASK_MIN_PRIORITY,
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django_tasks.exceptions import InvalidTaskBackendError as InvalidTaskBackend
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

__all__ = [
    "DEFAULT_TASK_BACKEND_ALIAS",
    "DEFAULT_TASK_QUEUE_NAME",
    "FRAMEWORK",
    "NOT_INSTALLED",
    "TASK_MAX_PRIORITY",
    "TASK_MIN_PRIORITY",
    "BaseTaskBackend",
    "InvalidTask",
    "InvalidTaskBackend",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "installed",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]


if FRAMEWORK is None:

    def __getattr__(name: str) -> Any:
        """``from .compat import Task`` without a framework: say what to install, not "cannot import name"."""
        if name in __all__:
            raise ImportError(NOT_INSTALLED)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
