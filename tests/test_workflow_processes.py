"""Workflows run by real worker processes: the fan-in race, a 1,000-step fan-out, a worker killed mid-step.

Outcomes are counted (each step enqueued once, the join run once, nothing
left waiting), never timed; the time bounds are generous. The kill test
runs ``DBQUEUE_WORKFLOW_KILL_TRIALS`` trials (3 by default; 50 for the
issue's manual run, docs/workflows.md).
"""

import os
import random
import signal
import time
from collections import Counter

import pytest

from django_dbqueue import Step, Workflow
from django_dbqueue.models import ArchivedMessage, Message, Worker, WorkflowRun
from django_dbqueue.worker import ExitStatus
from tests.support.processes import read_marks, start_worker, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def step_runs(marks) -> Counter:
    """How many times each (workflow, step) ran to its end, from the handlers' marks."""
    return Counter(event for event, _, _ in read_marks(marks) if event.startswith("step:"))


def messages_of(run_id: int) -> Counter:
    """How many distinct messages each step of workflow ``run_id`` had (live or archived): 1 each, never 2."""
    ids: dict[str, set[int]] = {}
    for model, id_field in ((Message, "pk"), (ArchivedMessage, "message_id")):
        for headers, pk in model.objects.values_list("headers", id_field):
            ref = headers.get("dbqueue_step")
            if ref and ref[0] == run_id:
                ids.setdefault(ref[1], set()).add(pk)
    return Counter({name: len(pks) for name, pks in ids.items()})


def finished(*runs):
    return WorkflowRun.objects.filter(pk__in=[r.pk for r in runs], state=WorkflowRun.FINISHED).count() == len(runs)


def stop(workers):
    # Each worker is up (its row written, its signal handlers set) before it is asked to stop.
    wait_for(lambda: Worker.objects.count() >= len(workers), timeout=120, what="the workers to register")
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == ExitStatus.OK, err[-3000:]


def test_diamonds_run_each_join_once_after_both_parents_under_four_workers(tmp_path):
    marks = tmp_path / "marks"
    # The four workers are up and idle before the diamonds arrive: one that started first could otherwise
    # drain them all alone (seen on SQLite once steps got cheaper), and the race would not be run.
    workers = [start_worker("wf-p", "--max-runtime", "300", "--poll-interval", "0.05", marks=marks) for _ in range(4)]
    runs = []
    try:
        wait_for(lambda: Worker.objects.count() >= len(workers), timeout=120, what="the workers to register")
        for n in range(15):
            workflow = Workflow(f"diamond-{n}")
            workflow.add("a", "wf-p", {"sleep": 0.01})
            workflow.group(Step("b", "wf-p", {"sleep": 0.01}), Step("c", "wf-p", {"sleep": 0.01}), after=["a"])
            workflow.add("d", "wf-p", after=["b", "c"])
            runs.append(workflow.enqueue())
        wait_for(lambda: finished(*runs), timeout=240, what="every diamond to finish")
    finally:
        stop(workers)
    ran = step_runs(marks)
    for run in runs:
        assert {s: ran[f"step:{run.pk}:{s}"] for s in "abcd"} == dict.fromkeys("abcd", 1)
        assert messages_of(run.pk) == dict.fromkeys("abcd", 1)
        assert WorkflowRun.objects.get(pk=run.pk).outcome == "succeeded"
        rows = {
            r.headers["dbqueue_step"][1]: r
            for r in ArchivedMessage.objects.filter(queue="wf-p")
            if r.headers["dbqueue_step"][0] == run.pk
        }
        assert rows["d"].claimed_at >= max(rows["b"].finished_at, rows["c"].finished_at)
    # Several processes finished the work: the race was run, not avoided.
    assert len({pid for _, _, pid in read_marks(marks)}) > 1


def test_a_thousand_step_fan_out_runs_its_join_once(tmp_path):
    marks = tmp_path / "marks"
    workflow = Workflow("fan")
    workflow.add("start", "wf-p")
    fan = workflow.group(*(Step(f"s{n}", "wf-p") for n in range(1000)), after=["start"])
    workflow.add("join", "wf-p", after=fan)
    run = workflow.enqueue()
    workers = [
        start_worker("wf-p", "--max-runtime", "400", "--poll-interval", "0.05", "--batch-size", "20", marks=marks)
        for _ in range(4)
    ]
    try:
        wait_for(lambda: finished(run), timeout=360, what="the fan-out to finish")
    finally:
        stop(workers)
    ran = step_runs(marks)
    assert ran[f"step:{run.pk}:join"] == 1
    assert sum(n for event, n in ran.items() if event.startswith(f"step:{run.pk}:s") and event[-1].isdigit()) == 1000
    assert messages_of(run.pk)["join"] == 1
    assert WorkflowRun.objects.get(pk=run.pk).outcome == "succeeded"


def test_a_worker_killed_while_running_a_parent_never_loses_nor_doubles_the_child(tmp_path):
    trials = int(os.environ.get("DBQUEUE_WORKFLOW_KILL_TRIALS", "3"))
    rng = random.Random(31)
    for trial in range(trials):
        marks = tmp_path / f"marks{trial}"
        workflow = Workflow(f"kill-{trial}")
        workflow.add("a", "wf-kill-a", {"sleep": rng.uniform(0, 0.05)}, max_attempts=10)
        workflow.add("b", "wf-kill-b", after=["a"])
        victim = start_worker("wf-kill-a", "--visibility-timeout", "2", "--poll-interval", "0.02", marks=marks)
        time.sleep(1.0)  # the worker is up and polling before the workflow exists
        run = workflow.enqueue()
        wait_for(
            lambda: not Message.objects.filter(queue="wf-kill-a", lease_token__isnull=True).exists(),
            timeout=60,
            what="a claimed",
        )
        time.sleep(rng.uniform(0, 0.12))  # before, during or after the handler and its ack
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=30)
        rescuer = start_worker("wf-kill-a", "wf-kill-b", "--max-runtime", "120", "--poll-interval", "0.05", marks=marks)
        try:
            wait_for(lambda: finished(run), timeout=90, what=f"trial {trial}'s workflow to finish")  # noqa: B023
        finally:
            stop([rescuer])
        assert messages_of(run.pk) == {"a": 1, "b": 1}, f"trial {trial}"
        assert step_runs(marks)[f"step:{run.pk}:b"] == 1, f"trial {trial}"
        assert WorkflowRun.objects.get(pk=run.pk).outcome == "succeeded"
