"""``@schedule`` on a Tasks framework ``@task``: each slot enqueues the task on its DatabaseQueueBackend."""

import pytest
from django.core import checks
from django.test import override_settings

import django_dbqueue
from django_dbqueue.tasks.compat import FRAMEWORK

if FRAMEWORK is None:
    pytest.skip("needs Django 6's django.tasks or, on Django 5.2, the django-tasks backport", allow_module_level=True)

from django_dbqueue.models import Message
from django_dbqueue.running import process
from django_dbqueue.schedules.registry import declared
from django_dbqueue.schedules.scheduler import Scheduler
from django_dbqueue.tasks import TASK_KIND
from django_dbqueue.tasks.compat import TaskResultStatus, task_backends, task_enqueued
from tests.support.schedules import Clock, at
from tests.testapp import tasks

pytestmark = pytest.mark.django_db


def fire_once(clock):
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    clock.advance(60)
    return scheduler.run_once()


def test_a_scheduled_task_is_enqueued_on_its_backend_and_runs(schedules, django_capture_on_commit_callbacks):
    django_dbqueue.schedule(every=60, name="adder", args=[2, 3])(tasks.add)
    announced = []
    task_enqueued.connect(lambda sender, task_result, **kw: announced.append(task_result), weak=False, dispatch_uid="t")
    try:
        with django_capture_on_commit_callbacks(execute=True):
            report = fire_once(Clock(at(2026, 5, 1, 10, 0, 30)))
    finally:
        task_enqueued.disconnect(dispatch_uid="t")
    [(_, fired)] = report.fired
    message = Message.objects.get(pk=fired.message.pk)
    assert (message.queue, message.kind) == ("t-tasks", TASK_KIND)
    assert message.payload["task"] == "tests.testapp.tasks.add" and message.payload["args"] == [2, 3]
    assert message.headers["schedule"] == "adder" and message.headers["schedule_slot"] == "2026-05-01T10:01:00+00:00"
    assert [r.id for r in announced] == [str(message.pk)]
    [claimed] = django_dbqueue.claim("t-tasks")
    assert process(claimed) == "acked"
    result = task_backends["default"].get_result(str(message.pk))
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 5)


def test_a_task_schedule_from_settings():
    with override_settings(
        DBQUEUE={"SCHEDULES": {"echoes": {"EVERY": 60, "TASK": "tests.testapp.tasks.echo", "KWARGS": {"value": "hi"}}}}
    ):
        specs, problems = declared()
        assert problems == [] and specs["echoes"].queue == "t-tasks"
        fire_once(Clock(at(2026, 5, 1, 10, 0, 30)))
    [message] = Message.objects.filter(queue="t-tasks")
    assert message.payload["kwargs"] == {"value": "hi"}


def test_a_task_that_cannot_be_imported_is_a_check_error():
    with override_settings(DBQUEUE={"SCHEDULES": {"lost": {"EVERY": 60, "TASK": "tests.testapp.tasks.nope"}}}):
        errors = [e.msg for e in checks.run_checks(databases=[]) if e.id == "django_dbqueue.E003"]
    assert errors == ["schedule 'lost': task 'tests.testapp.tasks.nope' cannot be imported, or is not a @task"]


def test_a_task_schedule_takes_no_queue_or_payload(schedules):
    django_dbqueue.schedule(every=60, name="odd", queue="elsewhere", payload={"a": 1})(tasks.add)
    problems = declared()[1]
    assert any("schedule 'odd'" in p and "queue is the task's own" in p for p in problems)
