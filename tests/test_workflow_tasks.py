"""Tasks of Django's Tasks framework chained as a workflow: task steps, results flowing as the backend's."""

import pytest
from django.db import transaction

from django_dbqueue.tasks.compat import FRAMEWORK

if FRAMEWORK is None:
    pytest.skip("needs Django 6's django.tasks or, on Django 5.2, the django-tasks backport", allow_module_level=True)

from django_dbqueue import Workflow
from django_dbqueue.exceptions import InvalidOption
from django_dbqueue.models import Message, WorkflowRun
from django_dbqueue.tasks import TASK_KIND
from django_dbqueue.tasks.chaining import step_results, task_step
from django_dbqueue.tasks.compat import TaskResultStatus, task_finished
from django_dbqueue.worker import QueueWorker, WorkerConfig
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def run_worker() -> None:
    """An in-process worker on the tasks' queue until it is empty (each step enqueued as its parents finish)."""
    QueueWorker(WorkerConfig(queues=["t-tasks"], until_empty=True)).run()


def test_a_chord_of_tasks_runs_with_its_parents_results_and_each_step_is_a_task_result():
    finished = []
    receiver = lambda sender, task_result, **kwargs: finished.append(task_result.task.name)  # noqa: E731
    task_finished.connect(receiver)
    try:
        workflow = Workflow("sums")
        workflow.chord(
            [task_step("two", tasks.add, [1, 1]), task_step("nine", tasks.add.using(priority=5), [4], {"b": 5})],
            task_step("total", tasks.total),
        )
        run = workflow.enqueue()
        [first, second] = Message.objects.order_by("id")
        assert (first.kind, first.queue, second.priority) == (TASK_KIND, "t-tasks", -5)  # the task's own options
        assert second.payload["kwargs"] == {"b": 5}
        results = step_results(run.pk)
        assert results["total"] is None  # waiting: no message yet
        assert results["two"].status == TaskResultStatus.READY
        run_worker()
    finally:
        task_finished.disconnect(receiver)
    results = step_results(run.pk)
    assert {name: (r.status, r.return_value) for name, r in results.items()} == {
        "two": (TaskResultStatus.SUCCESSFUL, 2),
        "nine": (TaskResultStatus.SUCCESSFUL, 9),
        "total": (TaskResultStatus.SUCCESSFUL, 11),
    }
    assert sorted(finished) == ["add", "add", "total"]  # the framework's signal for every step
    run.refresh_from_db()
    assert (run.state, run.outcome) == ("finished", "succeeded")


def test_a_failed_task_step_cancels_the_steps_after_it():
    workflow = Workflow("fails")
    workflow.chain(task_step("boom", tasks.boom, ["no"]), task_step("after", tasks.echo, [1]))
    run = workflow.enqueue()
    run_worker()
    results = step_results(run.pk)
    assert results["boom"].status == TaskResultStatus.FAILED
    assert results["after"] is None
    assert Workflow.status(run.pk)["steps"][1]["reason"] == "dependency 'boom' ended dead"


def test_a_task_workflow_enqueued_in_a_rolled_back_transaction_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        workflow = Workflow("gone")
        workflow.group(task_step("two", tasks.add, [1, 1]))
        workflow.enqueue()
        assert Message.objects.count() == 1
        raise RuntimeError
    assert not WorkflowRun.objects.exists() and not Message.objects.exists()


def test_task_steps_refuse_what_enqueue_refuses():
    with pytest.raises(InvalidOption, match="is not a task"):
        task_step("x", len)
    with pytest.raises(TypeError, match="Unsupported type"):  # the framework's own check, as in enqueue()
        task_step("x", tasks.echo, [object()])
