"""The async producers: aenqueue, aenqueue_many, apublish, arequest, acancel, and the Tasks backend's.

Called from async views through Django's AsyncClient (tests/testapp/views.py),
inside ``transaction.atomic`` as Django allows it (opened in sync code that
``sync_to_async`` runs), answered by a real worker process, and gathered by
the hundred. The tests are sync and drive the event loop with
``async_to_sync``, so that thread-sensitive code runs in the test's own
thread, on its connection, as in a sync Django test; the concurrency test
uses ``asyncio.run`` and a thread per simulated request, as an ASGI server does.
"""

import asyncio
import contextlib
import signal
import time

import pytest
from asgiref.sync import ThreadSensitiveContext, async_to_sync, sync_to_async
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connection, connections, transaction
from django.test import AsyncClient

import django_dbqueue
from django_dbqueue.exceptions import RequestFailed, RequestTimeout
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.tasks.compat import FRAMEWORK
from django_dbqueue.worker import ExitStatus
from tests.support.processes import start_worker

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "queues"])


def post(path: str, data: dict | None = None):
    """POST ``data`` as JSON to an async view through AsyncClient, from this sync test."""
    return async_to_sync(AsyncClient().post)(path, data or {}, content_type="application/json")


def committed(queue: str) -> int:
    """Messages of ``queue`` that another connection (the ``queues`` alias) sees: committed ones only."""
    return Message.objects.using("queues").filter(queue=queue).count()


# --- each producer from an async view ------------------------------------------------


def test_aenqueue_in_an_async_view_takes_enqueues_options():
    first = post("/async/enqueue", {"queue": "ap-view", "payload": {"n": 1}, "options": {"kind": "k", "key": "one"}})
    again = post("/async/enqueue", {"queue": "ap-view", "payload": {"n": 2}, "options": {"kind": "k", "key": "one"}})
    options = {"delay": 3600, "priority": -5}
    later = post("/async/enqueue", {"queue": "ap-view", "payload": {"n": 3}, "options": options})
    assert first.json()["created"] and not again.json()["created"]
    assert again.json()["id"] == first.json()["id"]  # the key was live: the live message, nothing inserted
    one = Message.objects.get(pk=first.json()["id"])
    assert (one.queue, one.kind, one.key, one.payload) == ("ap-view", "k", "one", {"n": 1})
    delayed = Message.objects.get(pk=later.json()["id"])
    assert delayed.priority == -5 and delayed.available_at > one.available_at
    assert committed("ap-view") == 2


def test_aenqueue_many_apublish_and_acancel_in_async_views():
    ids = post("/async/enqueue-many", {"queue": "ap-many", "payloads": [{"n": n} for n in range(5)]}).json()["ids"]
    rows = Message.objects.filter(queue="ap-many").order_by("pk")
    assert [row.payload for row in rows] == [{"n": n} for n in range(5)]
    if connection.vendor != "mysql" or connection.mysql_is_mariadb:  # MySQL returns no ids (docs/api.md)
        assert ids == [row.pk for row in rows]

    copies = post("/async/publish", {"topic": "t-orders", "payload": {"order": 7}}).json()["copies"]
    assert sorted(copies) == ["t-email", "t-invoicing"]  # the TOPICS setting's subscribers
    for queue in copies:
        assert Message.objects.get(queue=queue).headers["topic"] == "t-orders"

    target = rows[0].pk
    assert post(f"/async/cancel/{target}").json() == {"result": "archived"}
    assert post(f"/async/cancel/{target}").json() == {"result": ""}  # GONE: falsy, as cancel()'s
    archived = ArchivedMessage.objects.get(message_id=target)
    assert archived.outcome == Outcome.CANCELLED and archived.last_error == "cancelled by async view"


def test_sync_enqueue_in_an_async_view_is_refused_by_django():
    """Why the async twins exist: Django refuses the database from inside an event loop."""

    async def view_body():
        django_dbqueue.enqueue("ap-view", {})

    with pytest.raises(SynchronousOnlyOperation):
        async_to_sync(view_body)()
    assert not Message.objects.exists()


def test_an_async_view_without_a_transaction_commits_the_message_at_once():
    with pytest.raises(RuntimeError, match="the view failed after its enqueue"):
        post("/async/enqueue-then-fail")
    assert committed("ap-view") == 1  # autocommit: the failed view's message stays


# --- transactions ---------------------------------------------------------------------


class Rollback(Exception):
    pass


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "rolled-back"])
def test_async_producers_inside_an_atomic_block_opened_in_sync_code(commit):
    """``atomic`` opened in sync code run by ``sync_to_async``; the awaited producers inside join its transaction."""
    seen_inside = []

    def in_a_transaction():
        with transaction.atomic():
            async_to_sync(django_dbqueue.aenqueue)("ap-atomic", {"n": 1})
            async_to_sync(django_dbqueue.aenqueue_many)("ap-atomic", [{"n": 2}, {"n": 3}])
            async_to_sync(django_dbqueue.apublish)("t-orders", {"n": 4})
            # Inside: this connection sees its writes, another one does not.
            seen_inside.append((Message.objects.count(), Message.objects.using("queues").count()))
            if not commit:
                raise Rollback

    async def view_body():
        with contextlib.suppress(Rollback):
            await sync_to_async(in_a_transaction, thread_sensitive=True)()

    async_to_sync(view_body)()
    assert seen_inside == [(5, 0)]
    expected = {"ap-atomic": 3, "t-email": 1, "t-invoicing": 1} if commit else {}
    counted = {q: committed(q) for q in ["ap-atomic", "t-email", "t-invoicing"]}
    assert {q: n for q, n in counted.items() if n} == expected


def test_atomic_cannot_be_opened_in_async_code():
    """What the docs say Django allows: no ``atomic`` block in async code itself."""

    async def view_body():
        with transaction.atomic():
            await django_dbqueue.aenqueue("ap-atomic", {})

    with pytest.raises(SynchronousOnlyOperation):
        async_to_sync(view_body)()
    assert not Message.objects.exists()


def test_arequest_inside_an_atomic_block_is_refused_as_request_is():
    def in_a_transaction():
        with transaction.atomic():
            async_to_sync(django_dbqueue.arequest)("rr-echo", {}, timeout=5)

    async def view_body():
        await sync_to_async(in_a_transaction, thread_sensitive=True)()

    with pytest.raises(django_dbqueue.InvalidOption, match=r"runs inside transaction\.atomic"):
        async_to_sync(view_body)()
    assert not Message.objects.exists()


# --- bad input: the sync twin's exception, nothing written -----------------------------

BAD_CALLS = {
    "queue name": ("enqueue", ("no spaces allowed", {}), {}),
    "payload": ("enqueue", ("ap-bad", {"when": object()}), {}),
    "option": ("enqueue", ("ap-bad", {}), {"colour": "red"}),
    "delay": ("enqueue", ("ap-bad", {}), {"delay": -1}),
    "many": ("enqueue_many", ("ap-bad", [{"n": 1}, {"n": {1, 2}}]), {}),
    "topic": ("publish", ("", {}), {}),
    "publish option": ("publish", ("t-orders", {}), {"queue": "x"}),
    "timeout": ("request", ("rr-echo", {}), {"timeout": 0}),
    "message id": ("cancel", ("seven",), {}),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_raises_what_the_sync_twin_raises(name, archive_and_live_counts):
    function, args, kwargs = BAD_CALLS[name]
    with pytest.raises(Exception) as sync_error:
        getattr(django_dbqueue, function)(*args, **kwargs)
    with pytest.raises(Exception) as async_error:
        async_to_sync(getattr(django_dbqueue, f"a{function}"))(*args, **kwargs)
    assert isinstance(sync_error.value, django_dbqueue.DbQueueError | TypeError | ValueError), sync_error.value
    assert type(async_error.value) is type(sync_error.value)
    assert str(async_error.value) == str(sync_error.value)
    assert archive_and_live_counts() == (0, 0)


# --- arequest ---------------------------------------------------------------------------


@pytest.fixture
def answering_worker():
    """A worker process serving queue 'rr-echo', whose handler replies (tests/testapp/queues.py)."""
    worker = start_worker("rr-echo", "--max-runtime", "120", "-v3")
    yield worker
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    print("worker's log (a line per message):", err)  # shown by pytest when the test failed
    assert worker.returncode == ExitStatus.OK, err


def test_arequest_answered_by_a_worker_process(answering_worker):
    async def ask():
        return await asyncio.gather(*(django_dbqueue.arequest("rr-echo", {"n": n}, timeout=60) for n in range(3)))

    answers = async_to_sync(ask)()
    assert [a["echo"] for a in answers] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert {a["pid"] for a in answers} == {answering_worker.pid}
    through_a_view = post("/async/request", {"queue": "rr-echo", "payload": {"n": 9}, "timeout": 60}).json()
    assert through_a_view["answer"]["echo"] == {"n": 9}
    with pytest.raises(RequestFailed, match="was dead without a reply: cannot answer that"):
        async_to_sync(django_dbqueue.arequest)("rr-echo", {"action": "reject"}, timeout=60)


def test_arequest_times_out_as_request_does():
    started = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"no reply to request \d+ on queue 'rr-echo' within 0\.3s"):
        async_to_sync(django_dbqueue.arequest)("rr-echo", {"n": 1}, timeout=0.3)
    assert time.monotonic() - started >= 0.3
    sent = Message.objects.get(queue="rr-echo")
    assert sent.expires_at is not None  # expires with its deadline, as request()'s
    assert not Message.objects.filter(queue__startswith="reply.").exists()


def test_arequest_leaves_the_thread_for_sync_code_free_while_it_waits():
    """The reply comes from code that needs the same thread-sensitive thread (and connection) meanwhile.

    Were the wait a blocking call on that thread, the answer could not be
    claimed before the 60 s timeout, and the request would time out.
    """

    async def answer_from_the_same_loop():
        deadline = time.monotonic() + 60
        while not (claimed := await sync_to_async(django_dbqueue.claim)("ap-rr")):
            assert time.monotonic() < deadline, "the request never became claimable"
            await asyncio.sleep(0.01)
        await sync_to_async(django_dbqueue.reply)(claimed[0], {"answered": "here"})
        await sync_to_async(claimed[0].ack)()

    async def both():
        return await asyncio.gather(django_dbqueue.arequest("ap-rr", {"q": 1}, timeout=60), answer_from_the_same_loop())

    answer, _ = async_to_sync(both)()
    assert answer == {"answered": "here"}
    assert ArchivedMessage.objects.get(queue="ap-rr").outcome == Outcome.ACKED


# --- many at once -----------------------------------------------------------------------


def test_many_aenqueue_gathered_in_one_context_all_land_once():
    async def gathered():
        return await asyncio.gather(*(django_dbqueue.aenqueue("ap-many", {"n": n}) for n in range(200)))

    messages = async_to_sync(gathered)()
    assert len({message.pk for message in messages}) == 200
    assert sorted(p["n"] for p in Message.objects.filter(queue="ap-many").values_list("payload", flat=True)) == list(
        range(200)
    )


def test_many_aenqueue_from_concurrent_requests_all_land_once():
    """8 simulated ASGI requests (each its own thread and connection, as Django's ASGI handler gives), 25 each.

    Every fifth message carries the one key "same": one of them is inserted
    and all of those calls return it; every other message lands exactly once.
    """

    async def one_request(first: int):
        async with ThreadSensitiveContext():
            try:
                return await asyncio.gather(
                    *(
                        django_dbqueue.aenqueue("ap-many", {"n": n}, **({"key": "same"} if n % 5 == 0 else {}))
                        for n in range(first, first + 25)
                    )
                )
            finally:
                await sync_to_async(connections.close_all)()

    async def requests():
        return await asyncio.gather(*(one_request(25 * i) for i in range(8)))

    results = [message for batch in asyncio.run(requests()) for message in batch]  # results[n]: the call for n
    keyed = [message for n, message in enumerate(results) if n % 5 == 0]
    unkeyed = {n: message for n, message in enumerate(results) if n % 5}
    assert len({message.pk for message in keyed}) == 1 and sum(m.was_created for m in keyed) == 1
    assert len({message.pk for message in unkeyed.values()}) == 160
    assert all(message.payload == {"n": n} for n, message in unkeyed.items())
    rows = Message.objects.filter(queue="ap-many")
    assert rows.count() == 161 and rows.filter(key="same").count() == 1
    assert sorted(row.payload["n"] for row in rows.exclude(key="same")) == sorted(unkeyed)


# --- Django's Tasks framework -----------------------------------------------------------

needs_tasks = pytest.mark.skipif(
    FRAMEWORK is None, reason="needs Django 6's django.tasks or, on Django 5.2, the django-tasks backport"
)


@needs_tasks
def test_task_aenqueue_and_aget_result_in_async_views():
    from django_dbqueue.worker import QueueWorker, WorkerConfig

    enqueued = post("/async/task", {"a": 2, "b": 3}).json()
    assert enqueued["status"] == "READY"
    message = Message.objects.get(queue="t-tasks")
    assert str(message.pk) == enqueued["id"] and message.payload["args"] == [2, 3]
    read = async_to_sync(AsyncClient().get)(f"/async/task/{enqueued['id']}").json()
    assert read == {"status": "READY", "return_value": None}
    assert QueueWorker(WorkerConfig(queues=["t-tasks"], until_empty=True)).run() == ExitStatus.OK
    read = async_to_sync(AsyncClient().get)(f"/async/task/{enqueued['id']}").json()
    assert read == {"status": "SUCCESSFUL", "return_value": 5}


@needs_tasks
@pytest.mark.parametrize("commit", [True, False], ids=["committed", "rolled-back"])
def test_the_backends_aenqueue_in_an_atomic_block_and_aget_result(commit):
    """The backend's aenqueue/aget_result (BaseTaskBackend's: its sync methods through sync_to_async)."""
    from django_dbqueue.tasks.compat import TaskResultDoesNotExist, TaskResultStatus, task_backends, task_enqueued
    from tests.testapp import tasks

    backend = task_backends["default"]
    sent = []

    def on_enqueued(sender, task_result, **kwargs):
        sent.append(task_result.id)

    def in_a_transaction():
        with transaction.atomic():
            result = async_to_sync(backend.aenqueue)(tasks.add, [1], {"b": 2})
            assert sent == []  # task_enqueued waits for the commit
            if not commit:
                raise Rollback(result.id)
            return result

    async def view_body():
        try:
            return await sync_to_async(in_a_transaction, thread_sensitive=True)()
        except Rollback as rolled_back:
            return rolled_back.args[0]

    task_enqueued.connect(on_enqueued)
    try:
        outcome = async_to_sync(view_body)()
    finally:
        task_enqueued.disconnect(on_enqueued)
    if commit:
        assert sent == [outcome.id] and committed("t-tasks") == 1
        found = async_to_sync(backend.aget_result)(outcome.id)
        assert found.id == outcome.id and found.status == TaskResultStatus.READY
    else:
        assert sent == [] and committed("t-tasks") == 0
        with pytest.raises(TaskResultDoesNotExist):
            async_to_sync(backend.aget_result)(outcome)
