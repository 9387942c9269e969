"""Tasks of Django's Tasks framework that tests/test_tasks.py enqueues (see TASKS in tests/settings.py)."""

import sys

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task

from tests.testapp.models import Order


class TaskBoom(Exception):
    """A project's own exception class, so the error names a module path."""


@task(queue_name="t-tasks")
def add(a, b):
    return a + b


@task(queue_name="t-tasks")
def echo(value):
    return value


@task(queue_name="t-tasks")
def boom(text):
    raise ValueError(text)


@task(queue_name="t-tasks")
def chained(text):
    try:
        {}["missing"]
    except KeyError as exc:
        raise TaskBoom(text) from exc


@task(queue_name="t-tasks")
def returns_nan():
    return float("nan")


@task(queue_name="t-tasks")
def exits():
    sys.exit(3)


@task(queue_name="t-tasks")
def make_order(number):
    return Order.objects.create(number=number).pk


@task(queue_name="t-tasks", takes_context=True)
def context_info(context):
    return {"id": context.task_result.id, "attempt": context.attempt, "status": str(context.task_result.status)}


@task(queue_name="t-tasks")
async def async_add(a, b):
    return a + b


@task(backend="retrying", queue_name="t-retry", takes_context=True)
def flaky(context, failures):
    """Fails its first ``failures`` attempts."""
    if context.attempt <= failures:
        raise RuntimeError(f"attempt {context.attempt} fails")
    return context.attempt


@task(queue_name="t-tasks", takes_context=True)
def total(context):
    """A workflow's last step: the sum of its parents' return values (tests/test_workflow_tasks.py)."""
    from django_dbqueue.tasks.chaining import parent_results

    return sum(parent_results(context).values())
