"""Atomic handlers (``@handler(..., atomic=True)``): the handler's writes and its ack commit together or not at all."""

import signal
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection, connections, transaction

import django_dbqueue
import django_dbqueue.workflows
from django_dbqueue import Step, Workflow, handlers
from django_dbqueue.exceptions import Cancelled
from django_dbqueue.models import ArchivedMessage, Message
from django_dbqueue.running import HandlerOutcome, decide, process
from tests.support.processes import read_marks, start_worker, wait_for
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)


def claim_one(payload=None, queue="jobs"):
    django_dbqueue.enqueue(queue, payload or {})
    return Message.objects.claim(queue)[0]


def writes(number="o-1", then=None):
    """A handler that saves an order, then does ``then(message)`` (raise, steal the lease...), then returns."""

    def handle(message):
        Order.objects.create(number=number)
        if then is not None:
            then(message)
        return {"order": number}

    return handle


def test_the_write_and_the_ack_commit_together(handler):
    handler("jobs", atomic=True)(writes())
    message = claim_one()
    assert process(message) == HandlerOutcome.ACKED
    assert Order.objects.get().number == "o-1"
    row = ArchivedMessage.objects.acked().get()
    assert row.message_id == message.pk and row.result == {"order": "o-1"}
    assert not Message.objects.exists()


def test_a_handler_that_raises_leaves_no_write_and_is_retried(handler):
    handler("jobs", atomic=True)(writes(then=lambda m: 1 / 0))
    assert process(claim_one()) == HandlerOutcome.FAILED
    assert not Order.objects.exists()
    retried = Message.objects.get()
    assert retried.attempts == 1 and retried.lease_token is None and "ZeroDivisionError" in retried.last_error


def test_the_same_handler_not_atomic_keeps_its_write_when_it_raises(handler):
    handler("jobs")(writes(then=lambda m: 1 / 0))
    assert process(claim_one()) == HandlerOutcome.FAILED
    assert Order.objects.count() == 1  # what atomic=True takes back


def steal_lease(message):
    """Another connection takes the message's lease (as the reaper and another worker would, once it ran out)."""

    def steal():
        try:
            Message.objects.filter(pk=message.pk).update(lease_token="someone-else")
        finally:
            connections.close_all()

    thread = threading.Thread(target=steal)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_lost_lease_rolls_the_write_back(handler):
    if connection.vendor == "sqlite":
        pytest.skip("on SQLite the handler holds the write lock: no other connection can take its lease meanwhile")

    @handler("jobs", atomic=True)
    def handle(message):
        steal_lease(message)
        Order.objects.create(number="o-1")

    assert process(claim_one()) == HandlerOutcome.LEASE_LOST
    assert not Order.objects.exists()
    assert not ArchivedMessage.objects.exists()
    assert Message.objects.get().lease_token == "someone-else"  # the new holder's, untouched


def test_an_ack_the_database_refuses_rolls_the_write_back_and_fails_the_attempt(handler, monkeypatch):
    # The fault: the acknowledgement's statement fails (a lost connection or a deadlock would raise
    # the same OperationalError there); a real one cannot be timed between the handler and its ack.
    def refused(self, **kwargs):
        raise OperationalError("injected: the ack could not be written")

    handler("jobs", atomic=True)(writes())
    monkeypatch.setattr(Message, "ack", refused)
    assert process(claim_one()) == HandlerOutcome.FAILED
    monkeypatch.undo()
    assert not Order.objects.exists()
    failed = Message.objects.get()
    assert failed.attempts == 1 and "injected: the ack could not be written" in failed.last_error


def test_a_lease_that_ran_out_while_it_ran_rolls_the_write_back(handler):
    from datetime import timedelta

    from django.utils import timezone

    @handler("jobs", atomic=True)
    def handle(message):
        Order.objects.create(number="o-1")
        # Its lease ends while it runs (its heartbeat could not extend it, as on SQLite under the write lock).
        Message.objects.filter(pk=message.pk).update(available_at=timezone.now() - timedelta(seconds=5))

    message = claim_one()
    assert process(message) == HandlerOutcome.LEASE_LOST
    assert not Order.objects.exists() and not ArchivedMessage.objects.exists()
    assert Message.objects.get().lease_token == message.lease_token  # the update went with the rollback


def test_a_handler_that_releases_its_own_message_keeps_what_it_did(handler):
    handler("jobs", atomic=True)(writes(then=lambda m: m.release()))
    assert process(claim_one()) == HandlerOutcome.LEASE_LOST  # as for any handler that ends its own lease
    assert Order.objects.count() == 1
    released = Message.objects.get()
    assert released.lease_token is None and not ArchivedMessage.objects.exists()


def test_a_handler_that_acks_its_own_message_keeps_what_it_did(handler):
    handler("jobs", atomic=True)(writes(then=lambda m: m.ack(result="mine")))
    assert process(claim_one()) == HandlerOutcome.LEASE_LOST
    assert Order.objects.count() == 1
    assert ArchivedMessage.objects.acked().get().result == "mine" and not Message.objects.exists()


def test_an_on_commit_hook_that_raises_after_the_commit_leaves_the_message_acked(handler, caplog):
    def hook_fails(message):
        transaction.on_commit(lambda: 1 / 0)  # runs after the commit; Django lets its error out

    handler("jobs", atomic=True)(writes(then=hook_fails))
    assert process(claim_one()) == HandlerOutcome.ACKED
    assert Order.objects.count() == 1 and ArchivedMessage.objects.acked().count() == 1
    assert not Message.objects.exists()
    assert "then an on_commit hook raised" in caplog.text


def test_on_sqlite_the_transaction_takes_the_write_lock_at_its_start(handler):
    # A deferred BEGIN would read a snapshot that a write committed meanwhile makes impossible to upgrade
    # ("database is locked" at once, whatever the timeout): the write lock is taken at the start instead.
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one write lock")
    import sqlite3

    answers = []

    def another_writer(message):
        Order.objects.count()  # a read first
        other = sqlite3.connect(connections["default"].settings_dict["NAME"], timeout=0, isolation_level=None)
        try:
            other.execute("INSERT INTO testapp_order (number, total) VALUES ('theirs', 0)")
            answers.append("wrote")
        except sqlite3.OperationalError as exc:
            answers.append(str(exc))
        finally:
            other.close()
        Order.objects.create(number="mine")

    handler("jobs", atomic=True)(another_writer)
    assert process(claim_one()) == HandlerOutcome.ACKED
    assert answers == ["database is locked"]
    assert list(Order.objects.values_list("number", flat=True)) == ["mine"]


def test_cancelled_rolls_back_and_archives_cancelled(handler):
    def cancel(message):
        raise Cancelled("stop")

    handler("jobs", atomic=True)(writes(then=cancel))
    assert process(claim_one()) == HandlerOutcome.CANCELLED
    assert not Order.objects.exists()
    assert ArchivedMessage.objects.get().outcome == "cancelled"


def test_control_exceptions_keep_their_meaning(handler):
    def retry(message):
        raise django_dbqueue.Retry(delay=600)

    handler("jobs", atomic=True)(writes(then=retry))
    assert process(claim_one()) == HandlerOutcome.RETRIED
    assert not Order.objects.exists()


def test_the_verdict_is_written_already_not_left_for_a_batch(handler):
    handler("jobs", atomic=True)(writes())
    verdict = decide(claim_one())
    assert verdict.outcome == HandlerOutcome.ACKED and verdict.committed
    assert ArchivedMessage.objects.acked().count() == 1
    assert verdict.record() == HandlerOutcome.ACKED  # recording it again writes nothing
    assert ArchivedMessage.objects.count() == 1


def test_only_the_atomic_registration_runs_atomic(handler):
    handler("jobs", kind="a", atomic=True)(writes("o-a", then=lambda m: 1 / 0))
    handler("jobs")(writes("o-any", then=lambda m: 1 / 0))
    django_dbqueue.enqueue("jobs", {}, kind="a")
    django_dbqueue.enqueue("jobs", {}, kind="b")
    for message in Message.objects.claim("jobs", 2):
        process(message)
    assert list(Order.objects.values_list("number", flat=True)) == ["o-any"]
    assert handlers.is_atomic("jobs", "a") and not handlers.is_atomic("jobs", None)


def test_an_async_atomic_handler_is_refused(handler):
    async def handle(message):
        return None

    with pytest.raises(ImproperlyConfigured, match="is async: an atomic handler must be a plain function"):
        handler("jobs", atomic=True)(handle)
    assert handlers.find_handler("jobs", "") is None


def test_atomic_must_be_a_bool():
    with pytest.raises(ImproperlyConfigured, match="atomic must be True or False, not 'yes'"):
        handlers.handler("jobs", atomic="yes")


def orders_per_message() -> dict[int, int]:
    counts: dict[int, int] = {}
    for number in Order.objects.values_list("number", flat=True):
        pk = int(number.split(":")[0])
        counts[pk] = counts.get(pk, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["at-atomic", "at-plain"])
def test_a_worker_killed_after_the_write_runs_it_again_with_one_write_only_when_atomic(queue, tmp_path):
    """SIGKILL a real worker while its handler sleeps after writing (tests/testapp/queues.py, `write_order`).

    Atomic, the killed transaction took the write with it: one order per
    message once another worker ran it again. Not atomic, the write was
    committed on its own: the message ran twice, and so did its write.
    """
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue(queue, {"sleep": 30})
    quick = [django_dbqueue.enqueue(queue, {}) for _ in range(20)]
    victim = start_worker(queue, "--visibility-timeout", "2", "--poll-interval", "0.05", marks=marks)
    try:
        wait_for(lambda: any(e == "wrote" and pk == slow.pk for e, pk, _ in read_marks(marks)), what="the slow write")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=30)
    Message.objects.filter(pk=slow.pk).update(payload={})  # its next run is quick
    # The console's settings (no LOGGING of the tests'): the worker's banner on stderr.
    console = {"DJANGO_SETTINGS_MODULE": "tests.settings_console"}
    rescuer = start_worker(queue, "--max-runtime", "120", "--poll-interval", "0.05", marks=marks, **console)
    try:
        wait_for(lambda: ArchivedMessage.objects.filter(queue=queue).count() == 21, timeout=90, what="all 21 acked")
    finally:
        rescuer.send_signal(signal.SIGTERM)
        _, err = rescuer.communicate(timeout=60)
    # The banner says which handlers run atomic.
    shown = "tests.testapp.queues.write_order" + (" (atomic)" if queue == "at-atomic" else "")
    assert f"  queues       {queue}  {shown}\n" in err
    assert "lease lost" not in err  # an atomic ack is not handed to the completer to be written again
    assert ArchivedMessage.objects.acked().filter(queue=queue).count() == 21
    ran = sum(1 for event, pk, _ in read_marks(marks) if event == "wrote" and pk == slow.pk)
    assert ran == 2  # it ran twice either way: at least once delivery
    counts = orders_per_message()
    assert set(counts) == {slow.pk, *(m.pk for m in quick)}
    expected = 1 if queue == "at-atomic" else 2
    assert counts[slow.pk] == expected
    assert all(counts[m.pk] == 1 for m in quick)


# --- with the rest: workflows, FIFO groups, the immediate mode ------------------------------


def step_writes(message):
    """A workflow step's handler: an order named after the step; fails when its payload says so."""
    Order.objects.create(number=message.headers["dbqueue_step"][1])
    if message.payload.get("fail"):
        raise ValueError("step failed")
    return message.payload


def test_a_workflow_step_acked_atomically_readies_the_next_one(handler):
    handler("at-wf", atomic=True)(step_writes)
    run = django_dbqueue.workflows.chain("c", Step("a", "at-wf", {"n": 1}), Step("b", "at-wf")).enqueue()
    (a,) = Message.objects.claim("at-wf")
    assert process(a) == HandlerOutcome.ACKED
    (b,) = Message.objects.claim("at-wf")  # ready in the transaction that acked a
    assert b.parent_results() == {"a": {"n": 1}}
    assert process(b) == HandlerOutcome.ACKED
    assert sorted(Order.objects.values_list("number", flat=True)) == ["a", "b"]
    assert Workflow.status(run.pk)["outcome"] == "succeeded"


def test_a_workflow_step_that_fails_for_good_leaves_no_write_and_cancels_the_rest(handler):
    handler("at-wf", atomic=True)(step_writes)
    run = django_dbqueue.workflows.chain("c", Step("a", "at-wf", {"fail": True}, max_attempts=1), Step("b", "at-wf"))
    run = run.enqueue()
    (a,) = Message.objects.claim("at-wf")
    assert process(a) == HandlerOutcome.FAILED
    assert not Order.objects.exists() and not Message.objects.exists()
    status = Workflow.status(run.pk)
    assert [s["state"] for s in status["steps"]] == ["dead", "cancelled"]


def test_a_fifo_groups_next_message_is_claimable_once_the_atomic_ack_commits(handler, settings):
    settings.DBQUEUE = {
        **settings.DBQUEUE,
        "QUEUES": {**settings.DBQUEUE.get("QUEUES", {}), "at-fifo": {"ORDERED": True}},
    }
    handler("at-fifo", atomic=True)(writes_numbered)
    for n in range(2):
        django_dbqueue.enqueue("at-fifo", {"n": n}, group="g")
    (first,) = Message.objects.claim("at-fifo", 10)
    assert Message.objects.claim("at-fifo", 10) == []  # the group's turn is the first's
    assert process(first) == HandlerOutcome.ACKED
    (second,) = Message.objects.claim("at-fifo", 10)
    assert second.payload == {"n": 1}
    process(second)
    assert list(Order.objects.order_by("id").values_list("number", flat=True)) == ["n0", "n1"]


def writes_numbered(message):
    Order.objects.create(number=f"n{message.payload['n']}")
    if message.attempts < message.payload.get("succeed_on", 1):
        raise ValueError(f"attempt {message.attempts} fails")


def test_the_immediate_mode_runs_atomic_handlers_with_their_rollbacks(handler, settings):
    settings.DBQUEUE = {"MODE": "immediate", "QUEUES": {"at-now": {"BACKOFF_BASE": 0}}}
    handler("at-now", atomic=True)(writes_numbered)
    django_dbqueue.enqueue("at-now", {"n": 7, "succeed_on": 3}, max_attempts=5)
    row = ArchivedMessage.objects.get(queue="at-now")
    assert (row.outcome, row.attempts) == ("acked", 3)
    assert list(Order.objects.values_list("number", flat=True)) == ["n7"]  # two failed attempts left nothing
