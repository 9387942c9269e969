"""A worker's claim in the transaction that acknowledges workflow steps (`Claiming.ack_then_claim`).

A chain's next step exists only once its parent's ack commits. The claim
that follows in the acknowledging transaction takes it there, through the
claim plan itself: the model-level tests check what it takes (and what it
leaves), the fault test a try that failed after claiming, and the worker
tests that a worker runs a chain without a claim of its own per step. A
reply lost at each statement of it: tests/test_lost_replies.py.
"""

from __future__ import annotations

import threading

import pytest
from django.db import OperationalError, connection

import django_dbqueue
from django_dbqueue import Step, Workflow
from django_dbqueue.models import ArchivedMessage, Message, MessageQuerySet, Outcome, WorkflowStep
from django_dbqueue.models.claiming import _ClaimAfterAck
from django_dbqueue.models.workflows import STEP_PRESENT
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from django_dbqueue.worker.consumer import Consumer

pytestmark = pytest.mark.django_db(transaction=True)

Q = "wf-next"
OTHER = "wf-next-other"
WORKER = "w-next"


def chain(*names: str, queue: str = Q, name: str = "next") -> Workflow:
    workflow = Workflow(name)
    workflow.chain(*(Step(n, queue, {"step": n}) for n in names))
    return workflow


def step_name(message: Message) -> str:
    return message.headers["dbqueue_step"][1]


def root_of(queue: str = Q) -> Message:
    (root,) = django_dbqueue.claim(queue, 1, worker=WORKER)
    return root


def ack_then_claim(messages: list[Message], queues: list[str], limit: int = 1):
    return Message.objects.ack_then_claim(messages, queues, limit, worker=WORKER, visibility_timeout=300)


def leased_once(message: Message) -> None:
    row = Message.objects.get(pk=message.pk)
    assert (row.lease_token, row.claimed_by, row.attempts) == (message.lease_token, WORKER, 1)


def test_the_released_step_is_leased_to_the_acknowledging_worker_in_the_same_transaction():
    chain("a", "b", "c").enqueue()
    answers, taken = ack_then_claim([root_of()], [Q])
    assert answers == [True]
    assert [step_name(m) for m in taken] == ["b"]
    (b,) = taken
    leased_once(b)
    assert b.__dict__[STEP_PRESENT] is True  # no lookup of its row before it runs
    step = WorkflowStep.objects.get(name="b")
    assert (step.state, step.message_id) == ("enqueued", b.pk)
    assert ArchivedMessage.objects.filter(outcome=Outcome.ACKED).count() == 1
    answers, taken = ack_then_claim(taken, [Q])
    assert answers == [True] and [step_name(m) for m in taken] == ["c"]
    answers, taken = ack_then_claim(taken, [Q])  # the last step releases nothing: no claim
    assert answers == [True] and taken == []
    assert not Message.objects.exists()


def test_no_claim_when_the_acks_release_nothing_even_with_messages_ready():
    django_dbqueue.enqueue_many(Q, [{"n": n} for n in range(3)])
    (plain,) = django_dbqueue.claim(Q, 1, worker=WORKER)
    answers, taken = ack_then_claim([plain], [Q], 5)
    assert answers == [True] and taken == []
    assert Message.objects.filter(lease_token__isnull=True).count() == 2


def test_a_step_released_on_a_queue_the_worker_does_not_serve_is_left_ready_for_others():
    workflow = Workflow("next")
    workflow.add("a", Q, {})
    workflow.add("b", OTHER, {}, after=["a"])
    workflow.enqueue()
    django_dbqueue.enqueue(Q, {"plain": True})
    answers, taken = ack_then_claim([root_of()], [Q], 5)
    assert answers == [True] and taken == []  # nothing released on Q: the plain message is not taken either
    (b,) = Message.objects.filter(queue=OTHER)
    assert b.lease_token is None
    assert [step_name(m) for m in django_dbqueue.claim(OTHER, 5)] == ["b"]


def test_the_claim_is_the_claim_plan_a_higher_priority_message_comes_first():
    chain("a", "b").enqueue()
    root = root_of()
    urgent = django_dbqueue.enqueue(Q, {"urgent": True}, priority=-10)
    answers, taken = ack_then_claim([root], [Q], 1)
    assert answers == [True] and [m.pk for m in taken] == [urgent.pk]
    (b,) = Message.objects.filter(lease_token__isnull=True)
    assert step_name(b) == "b"  # released, ready, left for the next claim


def test_a_fan_out_gives_the_worker_at_most_its_limit():
    workflow = Workflow("next")
    workflow.add("root", Q, {})
    workflow.group(*(Step(f"s{n}", Q, {}) for n in range(5)), after=["root"])
    workflow.enqueue()
    answers, taken = ack_then_claim([root_of()], [Q], 3)
    assert answers == [True] and len(taken) == 3
    for message in taken:
        leased_once(message)
    assert Message.objects.filter(lease_token__isnull=True).count() == 2


def transient_error() -> OperationalError:
    """An error the queue retries on this database, raised as Django raises it."""
    if connection.vendor == "mysql":
        import MySQLdb

        error = OperationalError(1213, "Deadlock found when trying to get lock")
        error.__cause__ = MySQLdb.OperationalError(1213, "Deadlock found when trying to get lock")
    elif connection.vendor == "postgresql":
        import psycopg

        error = OperationalError("deadlock detected")
        error.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected")
    else:
        error = OperationalError("database is locked")
        error.__cause__ = __import__("sqlite3").OperationalError("database is locked")
    return error


def test_a_try_that_failed_after_its_claim_is_answered_by_the_leases_that_hold(monkeypatch):
    """Fault: the first try's transaction fails after its claim (a deadlock); it rolls back and is retried.
    What the caller gets is what the database leased, once."""
    chain("a", "b").enqueue()
    root = root_of()
    real = _ClaimAfterAck.released
    failures = []

    def released(self, using, messages):
        real(self, using, messages)
        if not failures:
            failures.append(self.claims[using][:])
            raise transient_error()

    monkeypatch.setattr(_ClaimAfterAck, "released", released)
    answers, taken = ack_then_claim([root], [Q])
    assert [step_name(m) for m in failures[0]] == ["b"]  # the failed try had claimed b
    assert answers == [True]
    assert [step_name(m) for m in taken] == ["b"]
    leased_once(taken[0])
    assert ArchivedMessage.objects.count() == 1 and Message.objects.count() == 1


# --- the worker ---------------------------------------------------------------------------


BOUND = 30  # seconds a held write waits for what it waits for


@pytest.mark.parametrize("batch_size", [1, None], ids=["batch-1", "adaptive"])
def test_a_worker_runs_a_chain_without_a_claim_of_its_own_per_step(monkeypatch, batch_size):
    """Every step after the root is taken by the claim in its parent's acknowledging transaction. Once
    that claim took one, the worker waits for its acks instead of claiming beside them: its own claims are
    the root's, the one beside the root's ack (held until it returned: nothing was ready then), and the
    last look before it stops. Each step runs once, in order."""
    names = [f"s{n:02}" for n in range(12)]
    chain(*names).enqueue()
    ran: list[str] = []
    own_claims: list[int] = []
    real_claim, real_ack_then_claim = Consumer.claim, MessageQuerySet.ack_then_claim
    beside_root = threading.Event()
    held: list[bool] = []

    def claim(self, wanted=None):
        claimed = real_claim(self, wanted)
        own_claims.append(len(claimed))
        if len(own_claims) == 2:
            beside_root.set()
        return claimed

    def ack_then_claim(self, *args, **kwargs):
        if not held:  # the root's ack waits for the claim beside it, which then finds nothing
            held.append(beside_root.wait(BOUND))
        return real_ack_then_claim(self, *args, **kwargs)

    def handler(message):
        ran.append(step_name(message))

    monkeypatch.setattr(Consumer, "claim", claim)
    monkeypatch.setattr(MessageQuerySet, "ack_then_claim", ack_then_claim)
    config = WorkerConfig(queues=[Q], handler=handler, until_empty=True, max_runtime=120, batch_size=batch_size)
    assert QueueWorker(config).run() == ExitStatus.OK
    assert held == [True]
    assert ran == names
    assert own_claims == [1, 0, 0]
    assert ArchivedMessage.objects.filter(outcome=Outcome.ACKED).count() == len(names)
    assert not Message.objects.exists()


def test_a_stopping_worker_claims_nothing_in_its_last_acks_transaction(monkeypatch):
    """A worker told to stop while a step runs writes its ack without a claim: the next step is left ready."""
    chain("a", "b").enqueue()
    calls = []
    real = MessageQuerySet.ack_then_claim

    def ack_then_claim_spy(self, *args, **kwargs):
        calls.append(args)
        return real(self, *args, **kwargs)

    worker = QueueWorker(WorkerConfig(queues=[Q], handler=lambda m: worker.stop_gracefully("test"), max_runtime=60))
    monkeypatch.setattr(MessageQuerySet, "ack_then_claim", ack_then_claim_spy)
    assert worker.run() == ExitStatus.OK
    assert calls == []
    (b,) = Message.objects.all()
    assert step_name(b) == "b" and b.lease_token is None


def test_a_chain_steps_ack_reads_its_edges_and_locks_its_child_in_one_statement():
    """The join's read of the acked step's edges and the lock of its children are one statement (and the
    step's ack with its claim one transaction): the chain's cost is counted in round trips."""
    from django.test.utils import CaptureQueriesContext

    chain("a", "b").enqueue()
    root = root_of()
    with CaptureQueriesContext(connection) as ack:
        answers, taken = ack_then_claim([root], [Q])
    assert answers == [True] and len(taken) == 1
    edges = [q["sql"] for q in ack.captured_queries if "dbqueue_workflow_edge" in q["sql"]]
    assert len(edges) == 1
    assert "dbqueue_workflow_step" in edges[0]
    if connection.features.has_select_for_update:
        assert "FOR UPDATE" in edges[0]
