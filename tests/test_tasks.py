"""The backend for Django's Tasks framework: enqueue, run by a worker, results through the framework's API."""

import logging
import subprocess
import sys
import time
from datetime import timedelta
from functools import partial

import pytest
from django.db import transaction
from django.utils import timezone

from django_dbqueue.tasks.compat import FRAMEWORK

if FRAMEWORK is None:
    pytest.skip("needs Django 6's django.tasks or, on Django 5.2, the django-tasks backport", allow_module_level=True)

from asgiref.sync import async_to_sync

from django_dbqueue import control, handlers
from django_dbqueue.exceptions import PayloadNotSerializable, TaskNotCompleted
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.tasks import TASK_KIND, DatabaseQueueBackend, exception_class_path
from django_dbqueue.tasks.compat import (
    InvalidTask,
    InvalidTaskBackend,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from tests.support.processes import ROOT, child_env, start_worker
from tests.testapp import tasks
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)

BACKEND = "django_dbqueue.tasks.DatabaseQueueBackend"
RETRYING = {"backend": "retrying", "queue_name": "t-retry"}  # two attempts


def run(*queues: str, **options) -> ExitStatus:
    """An in-process worker until the queues are empty (one thread: messages run in claim order)."""
    return QueueWorker(WorkerConfig(queues=list(queues or ["t-tasks"]), until_empty=True, **options)).run()


def backend(alias: str = "default") -> DatabaseQueueBackend:
    return task_backends[alias]


# --- enqueue ------------------------------------------------------------------------


def test_enqueue_writes_a_task_message_and_returns_a_ready_result():
    result = tasks.add.using(priority=7).enqueue(2, b=3)
    assert result.status == TaskResultStatus.READY and result.backend == "default"
    assert result.args == [2] and result.kwargs == {"b": 3}
    assert result.enqueued_at is not None and result.started_at is None and result.worker_ids == []
    message = Message.objects.get()
    assert result.id == str(message.pk)
    assert (message.queue, message.kind, message.priority, message.max_attempts) == ("t-tasks", TASK_KIND, -7, 1)
    assert message.payload == {
        "task": "tests.testapp.tasks.add",
        "args": [2],
        "kwargs": {"b": 3},
        "backend": "default",
        "priority": 7,
        "run_after": None,
    }
    again = tasks.add.get_result(result.id)
    assert (
        again.status == TaskResultStatus.READY and again.task.priority == 7 and again.enqueued_at == message.created_at
    )


def test_the_handler_is_registered_for_every_backend_queue_at_startup():
    registered = handlers.registered()
    for queue in ("t-tasks", "t-other", "t-retry"):
        assert registered[(queue, TASK_KIND)] is registered[("t-tasks", TASK_KIND)]
    assert ("t-tasks", None) not in registered  # other kinds in a task queue are not taken over


def test_a_worker_process_runs_the_task_and_the_result_is_successful():
    result = tasks.add.enqueue(2, 3)
    worker = start_worker("t-tasks", "--until-empty")
    _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 0, stderr
    done = tasks.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 5
    assert done.is_finished and done.errors == [] and done.attempts == 1
    assert done.finished_at >= done.started_at >= done.enqueued_at
    row = ArchivedMessage.objects.get(message_id=int(result.id))
    assert row.outcome == Outcome.ACKED and row.result == 5
    assert done.worker_ids == [row.finished_by] and f":{worker.pid}:" in row.finished_by
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5


def test_an_exception_gives_failed_with_the_traceback():
    result = tasks.boom.enqueue("no good")
    assert run() == ExitStatus.OK
    failed = backend().get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED and failed.is_finished and failed.finished_at is not None
    [error] = failed.errors
    assert error.exception_class is ValueError and error.exception_class_path == "builtins.ValueError"
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert "in boom" in error.traceback and error.traceback.rstrip().endswith("ValueError: no good")
    with pytest.raises(ValueError, match="Task failed"):
        _ = failed.return_value
    row = ArchivedMessage.objects.get(message_id=int(result.id))
    assert row.outcome == Outcome.DEAD and row.attempts == 1 and row.last_error == error.traceback


@pytest.mark.parametrize(("options", "queue", "runs"), [({}, "t-tasks", 1), (RETRYING, "t-retry", 2)])
def test_the_frameworks_log_of_a_failed_task_has_its_error_and_traceback(caplog, options, queue, runs):
    """The framework logs task_finished with the exception being handled (django.tasks: sys.exc_info(),
    django-tasks: logger.exception), so the signal is sent inside a handler of the task's exception."""
    logger = "django.tasks" if FRAMEWORK == "django.tasks" else "django_tasks"
    result = tasks.boom.using(**options).enqueue("no good")
    with caplog.at_level(logging.INFO, logger=logger):
        run(queue)
    finished = [r for r in caplog.records if r.name == logger and f"id={result.id} " in r.getMessage()]
    finished = [r for r in finished if "state=" in r.getMessage() and "RUNNING" not in r.getMessage()]
    assert len(finished) == runs  # a retry's READY, then the last attempt's FAILED
    [failed] = [record for record in finished if "FAILED" in record.getMessage()]
    assert failed.exc_info is not None and isinstance(failed.exc_info[1], ValueError)
    # django.tasks passes the exception on with a retry's READY too; django-tasks only with FAILED.
    assert all(record.exc_info is None or isinstance(record.exc_info[1], ValueError) for record in finished)
    assert "NoneType: None" not in caplog.text
    assert "raise ValueError(text)" in caplog.text and "ValueError: no good" in caplog.text
    assert sys.exc_info() == (None, None, None)  # nothing left being handled


def test_a_chained_exception_of_a_project_class_is_named_by_its_module_path():
    result = tasks.chained.enqueue("wrapped")
    run()
    [error] = backend().get_result(result.id).errors
    assert error.exception_class is tasks.TaskBoom
    assert "KeyError: 'missing'" in error.traceback and "TaskBoom: wrapped" in error.traceback


def test_sys_exit_and_a_non_json_return_value_fail_the_task_not_the_worker():
    exits = tasks.exits.enqueue()
    nan = tasks.returns_nan.enqueue()
    ok = tasks.add.enqueue(1, 1)
    assert run() == ExitStatus.OK
    assert backend().get_result(exits.id).errors[0].exception_class is SystemExit
    nan_error = backend().get_result(nan.id).errors[0]
    assert nan_error.exception_class is ValueError and "Out of range float values" in nan_error.traceback
    assert backend().get_result(ok.id).return_value == 2


def test_takes_context_and_async_tasks():
    context = tasks.context_info.enqueue()
    coroutine = async_to_sync(tasks.async_add.aenqueue)(20, 22)
    run()
    assert backend().get_result(context.id).return_value == {"id": context.id, "attempt": 1, "status": "RUNNING"}
    assert async_to_sync(tasks.async_add.aget_result)(coroutine.id).return_value == 42


def test_a_task_runs_again_while_it_has_attempts_left():
    # The "retrying" backend has MAX_ATTEMPTS 2; its queue's BACKOFF_BASE is 0.
    recovers = tasks.flaky.enqueue(failures=1)
    gives_up = tasks.flaky.enqueue(failures=5)
    assert run("t-retry") == ExitStatus.OK
    done = tasks.flaky.get_result(recovers.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 2 and done.attempts == 2
    assert len(done.worker_ids) == 2 and done.worker_ids[0] == ""  # only the last attempt's worker is kept
    assert done.errors[0].exception_class is RuntimeError and "attempt 1 fails" in done.errors[0].traceback
    failed = tasks.flaky.get_result(gives_up.id)
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 2
    assert "attempt 2 fails" in failed.errors[0].traceback


def test_a_failed_attempt_with_attempts_left_reads_as_ready_with_its_error(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": {"t-retry": {"BACKOFF_BASE": 3600}}}
    result = tasks.flaky.enqueue(failures=1)
    run("t-retry")
    waiting = tasks.flaky.get_result(result.id)
    assert waiting.status == TaskResultStatus.READY and waiting.attempts == 1 and not waiting.is_finished
    assert waiting.errors[0].exception_class is RuntimeError
    with pytest.raises(ValueError, match="not finished"):
        _ = waiting.return_value


def test_a_running_task_reads_as_running():
    result = tasks.add.enqueue(1, 2)
    [message] = Message.objects.claim("t-tasks", worker="host:1:abc")
    running = backend().get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING and running.worker_ids == ["host:1:abc"]
    assert running.started_at == message.claimed_at


# --- priority, run_after, queues ------------------------------------------------------


def test_higher_framework_priority_runs_first():
    ids = {priority: tasks.echo.using(priority=priority).enqueue(priority).id for priority in (-50, 0, 90, 10)}
    assert dict(Message.objects.values_list("payload__priority", "priority")) == {-50: 50, 0: 0, 90: -90, 10: -10}
    assert run(batch_size=1, concurrency=1) == ExitStatus.OK
    ran = list(ArchivedMessage.objects.order_by("id").values_list("message_id", flat=True))
    assert ran == [int(ids[p]) for p in (90, 10, 0, -50)]


def test_priority_out_of_the_framework_range_is_refused(archive_and_live_counts):
    with pytest.raises(InvalidTask, match="priority"):
        tasks.echo.using(priority=101)
    assert archive_and_live_counts() == (0, 0)


def test_run_after_becomes_the_messages_run_at():
    later = timezone.now().replace(microsecond=0) + timedelta(hours=1)
    result = tasks.add.using(run_after=later).enqueue(1, 1)
    message = Message.objects.get()
    assert message.available_at == later and message.payload["run_after"] == later.isoformat()
    run()  # nothing is due
    waiting = backend().get_result(result.id)
    assert waiting.status == TaskResultStatus.READY and waiting.task.run_after == later
    assert control.run_now(message)
    run()
    assert backend().get_result(result.id).return_value == 2


def test_queue_names_are_validated():
    with pytest.raises(InvalidTask, match="Queue 'elsewhere' is not valid"):
        tasks.echo.using(queue_name="elsewhere")
    moved = tasks.echo.using(queue_name="t-other").enqueue("x")
    assert Message.objects.get(pk=int(moved.id)).queue == "t-other"
    with pytest.raises(
        InvalidTaskBackend, match=r"TASKS\['bad'\]: QUEUES has a bad queue name: queue name 'no spaces!'"
    ):
        DatabaseQueueBackend("bad", {"BACKEND": BACKEND, "QUEUES": ["ok", "no spaces!"]})
    with pytest.raises(InvalidTaskBackend, match="QUEUES must be a non-empty list"):
        DatabaseQueueBackend("bad", {"BACKEND": BACKEND, "QUEUES": []})
    with pytest.raises(InvalidTaskBackend, match="QUEUES must be a non-empty list"):
        DatabaseQueueBackend("bad", {"BACKEND": BACKEND, "QUEUES": "emails"})


def test_backend_options_are_validated():
    def make(**params):
        return DatabaseQueueBackend("bad", {"BACKEND": BACKEND, "QUEUES": ["q"], **params})

    assert make(OPTIONS={"MAX_ATTEMPTS": 3}).max_attempts == 3
    with pytest.raises(InvalidTaskBackend, match=r"OPTIONS has an unknown key 'RETRIES' \(known keys: MAX_ATTEMPTS"):
        make(OPTIONS={"RETRIES": 3})
    with pytest.raises(InvalidTaskBackend, match=r"OPTIONS\['MAX_ATTEMPTS'\] must be >= 1, not 0"):
        make(OPTIONS={"MAX_ATTEMPTS": 0})
    with pytest.raises(InvalidTaskBackend, match=r"must be <= 32767"):
        make(OPTIONS={"MAX_ATTEMPTS": 40000})
    for params in ({"OPTIONS": {"ENQUEUE_ON_COMMIT": True}}, {"ENQUEUE_ON_COMMIT": False}):
        with pytest.raises(InvalidTaskBackend, match="commits or rolls back with it; to enqueue only after a commit"):
            make(**params)


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_backends_queues_must_share_a_database(settings):
    settings.DATABASES = {**settings.DATABASES, "other": settings.DATABASES["default"]}
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": {"far": {"DATABASE": "other"}}}
    with pytest.raises(InvalidTaskBackend, match=r"QUEUES must all live on one database.*'far': 'other'"):
        DatabaseQueueBackend("split", {"BACKEND": BACKEND, "QUEUES": ["near", "far"]})


def test_arguments_that_are_not_json_are_refused_and_nothing_is_written(archive_and_live_counts):
    with pytest.raises(TypeError, match="Unsupported type"):
        tasks.echo.enqueue(timezone.now())
    with pytest.raises(PayloadNotSerializable, match="has a key 1 of type int"):
        tasks.echo.enqueue({1: "one"})
    assert archive_and_live_counts() == (0, 0)


def test_archive_off_for_a_task_queue_is_warned_about(settings):
    assert backend().check() == []
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": {"t-other": {"ARCHIVE": False}}}
    [warning] = backend().check()
    assert warning.id == "django_dbqueue.W002" and "'t-other'" in warning.msg


# --- transactions, signals, results that are not there ---------------------------------


def test_enqueue_commits_or_rolls_back_with_the_callers_transaction():
    seen = []
    receiver = partial(lambda seen, sender, task_result, **kw: seen.append(task_result.id), seen)
    task_enqueued.connect(receiver, weak=False)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            Order.objects.create(number="A-1")
            rolled_back = tasks.make_order.enqueue("A-2")
            assert seen == []  # told only once committed
            raise RuntimeError("roll back")
        assert (Order.objects.count(), Message.objects.count(), seen) == (0, 0, [])
        with pytest.raises(TaskResultDoesNotExist):
            backend().get_result(rolled_back.id)
        with transaction.atomic():
            Order.objects.create(number="B-1")
            kept = tasks.make_order.enqueue("B-2")
            transaction.on_commit(partial(tasks.make_order.enqueue, "B-3"))  # the framework's documented way
            assert seen == [] and Message.objects.count() == 1
        assert seen[0] == kept.id and len(seen) == 2 and Message.objects.count() == 2
    finally:
        task_enqueued.disconnect(receiver)
    run()
    assert set(Order.objects.values_list("number", flat=True)) == {"B-1", "B-2", "B-3"}


def test_each_tasks_signals_come_in_order_and_task_finished_follows_its_recorded_outcome():
    events = []

    def on_started(sender, task_result, **kwargs):
        events.append(("started", task_result.id, task_result.status))

    def on_finished(sender, task_result, **kwargs):
        stored = task_backends[task_result.backend].get_result(task_result.id).status
        events.append(("finished", task_result.id, task_result.status, stored))

    task_started.connect(on_started)
    task_finished.connect(on_finished)
    try:
        ok, bad = tasks.add.enqueue(1, 2), tasks.boom.enqueue("x")
        run(batch_size=1, concurrency=1)
    finally:
        task_started.disconnect(on_started)
        task_finished.disconnect(on_finished)
    # Each task's signals in order. A success is written by the completer while the next task starts,
    # so the first task's task_finished may come after the second's task_started (docs/tasks.md).
    assert [e for e in events if e[1] == ok.id] == [
        ("started", ok.id, TaskResultStatus.RUNNING),
        ("finished", ok.id, TaskResultStatus.SUCCESSFUL, TaskResultStatus.SUCCESSFUL),
    ]
    assert [e for e in events if e[1] == bad.id] == [
        ("started", bad.id, TaskResultStatus.RUNNING),
        ("finished", bad.id, TaskResultStatus.FAILED, TaskResultStatus.FAILED),
    ]
    assert [e[1] for e in events if e[0] == "started"] == [ok.id, bad.id]


def test_task_finished_says_ready_for_an_attempt_that_will_be_retried():
    statuses = []

    def on_finished(sender, task_result, **kwargs):
        statuses.append((task_result.status, task_result.attempts, len(task_result.errors)))

    task_finished.connect(on_finished)
    try:
        tasks.flaky.enqueue(failures=1)
        run("t-retry")
    finally:
        task_finished.disconnect(on_finished)
    assert statuses == [(TaskResultStatus.READY, 1, 1), (TaskResultStatus.SUCCESSFUL, 2, 1)]


def test_a_task_whose_worker_died_on_its_last_attempt_is_failed_as_not_completed():
    from django_dbqueue.reaper import Reaper

    result = tasks.add.enqueue(1, 1)
    Message.objects.claim("t-tasks", visibility_timeout=0.1, worker="gone:1:abc")  # then the worker "dies"
    time.sleep(0.3)
    assert Reaper(using="default").run_once().poison == 1
    failed = backend().get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 1
    assert failed.errors[0].exception_class is TaskNotCompleted
    assert "the worker died running it" in failed.errors[0].traceback


def test_unknown_ids_and_results_of_other_tasks():
    for bad in ("abc", "", "-1", "999999999", "1.5"):
        with pytest.raises(TaskResultDoesNotExist, match="no task result with id"):
            backend().get_result(bad)
    result = tasks.add.enqueue(1, 1)
    with pytest.raises(TaskResultDoesNotExist):
        backend("retrying").get_result(result.id)  # not one of its queues
    with pytest.raises(TaskResultMismatch):
        tasks.echo.get_result(result.id)


def test_a_cancelled_task_is_failed_as_not_completed():
    result = tasks.add.enqueue(1, 1)
    assert control.cancel(Message.objects.get(), by="ops")
    failed = backend().get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED and failed.started_at is None
    assert failed.errors[0].exception_class is TaskNotCompleted and failed.errors[0].traceback == "cancelled by ops"


def test_a_task_whose_module_is_gone_fails_with_the_import_error():
    payload = {"task": "tests.testapp.gone.task", "args": []}
    message = Message.objects.enqueue("t-tasks", payload, kind=TASK_KIND, max_attempts=1)
    run()
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.DEAD and "task 'tests.testapp.gone.task' cannot be imported" in row.last_error


def test_a_plain_sql_style_payload_with_only_the_task_path_runs():
    message = Message.objects.enqueue("t-tasks", {"task": "tests.testapp.tasks.add", "args": [4, 5]}, kind=TASK_KIND)
    run()
    done = backend().get_result(str(message.pk))
    assert done.return_value == 9 and done.task.priority == 0 and done.backend == "default"


def test_exception_class_path_reads_the_last_traceback():
    assert exception_class_path("cancelled by ops") is None
    text = (
        "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nKeyError: 'x'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "a.py", line 3, in f\n'
        "app.errors.Boom: two\nlines: of message\n"
    )
    assert exception_class_path(text) == "app.errors.Boom"
    assert exception_class_path('Traceback (most recent call last):\n  File "a.py"\nValueError\n') == (
        "builtins.ValueError"
    )


WITHOUT_FRAMEWORK = """
import importlib.util

found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *rest: None if name in ("django.tasks", "django_tasks") else found(name, *rest)

import django

django.setup()  # the app starts without the framework: it registers no task handler

import django_dbqueue.tasks as tasks_package
from django.utils.module_loading import import_string

assert tasks_package.FRAMEWORK is None
for attempt in (
    lambda: import_string("django_dbqueue.tasks.DatabaseQueueBackend"),
    lambda: __import__("django_dbqueue.tasks.backend"),
):
    try:
        attempt()
    except ImportError as exc:
        print(exc)
"""


def test_without_the_framework_the_backend_says_what_to_install():
    """Django 5.2 without the backport: the package imports, the backend's import names what to install."""
    child = subprocess.run(
        [sys.executable, "-c", WITHOUT_FRAMEWORK], capture_output=True, text=True, cwd=ROOT, env=child_env()
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert len(lines) == 2 and all("pip install 'django-dbqueue[tasks]'" in line for line in lines), lines
