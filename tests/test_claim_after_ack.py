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
from django.db import OperationalError, connection, connections

import django_dbqueue
from django_dbqueue import Step, Workflow
from django_dbqueue.db import transactions
from django_dbqueue.exceptions import InvalidOption
from django_dbqueue.models import ArchivedMessage, Message, MessageQuerySet, Outcome, WorkflowStep
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


def lost_reply() -> OperationalError:
    """The error of a connection lost before the server's answer came, raised as Django raises it."""
    if connection.vendor == "mysql":
        import MySQLdb

        error = OperationalError(2013, "Lost connection to server during query")
        error.__cause__ = MySQLdb.OperationalError(2013, "Lost connection to server during query")
    else:
        import psycopg

        error = OperationalError("server closed the connection unexpectedly")
        error.__cause__ = psycopg.OperationalError("server closed the connection unexpectedly")
    return error


def test_a_commit_whose_reply_was_lost_is_answered_by_the_leases_it_made(monkeypatch):
    """Fault: the acknowledging transaction committed (ack and claim), then its reply was lost; the retry
    finds the acks done and claims nothing itself. What the caller gets is what the database leased, once."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no connection to lose")
    chain("a", "b").enqueue()
    root = root_of()
    # The acknowledging transaction is short_transaction's, whose COMMIT may go out with the claim's UPDATE,
    # where it begins its own (MySQL, psycopg 3); else Django's atomic().
    begins_itself = transactions._begins_itself(connections["default"])
    owner, name = (transactions, "_commit") if begins_itself else (connection, "commit")
    real_commit = getattr(owner, name)
    lost: list[bool] = []

    def commit(*args):
        real_commit(*args)
        if not lost:
            lost.append(True)
            raise lost_reply()

    monkeypatch.setattr(owner, name, commit)
    answers, taken = ack_then_claim([root], [Q])
    assert lost == [True]
    assert answers == [True]
    assert [step_name(m) for m in taken] == ["b"]
    leased_once(taken[0])
    assert ArchivedMessage.objects.count() == 1 and Message.objects.count() == 1


def test_a_call_told_again_answers_by_what_an_earlier_call_with_its_token_leased():
    """The completer's own retry of a whole call (its writer waits out weather) passes the same token:
    a claim that an earlier call committed is found, not lost."""
    chain("a", "b").enqueue()
    root = root_of()
    answers, first = Message.objects.ack_then_claim([root], [Q], 1, worker=WORKER, token="t-again")
    assert answers == [True] and [step_name(m) for m in first] == ["b"]
    answers, again = Message.objects.ack_then_claim([root], [Q], 1, worker=WORKER, token="t-again", again=True)
    assert answers == [True]  # answered from the archive: acked once, by the earlier call, not "lease lost"
    assert [m.pk for m in again] == [first[0].pk]  # its lease is answered, not claimed twice
    leased_once(again[0])


@pytest.mark.parametrize(("option", "value"), [("limit", 0), ("visibility_timeout", -1)])
def test_a_bad_limit_or_lease_is_refused_before_anything_is_written(option, value):
    chain("a", "b").enqueue()
    root = root_of()
    options = {"limit": 1, "visibility_timeout": 30, option: value}
    with pytest.raises(InvalidOption, match=option):
        Message.objects.ack_then_claim([root], [Q], options.pop("limit"), worker=WORKER, **options)
    assert ArchivedMessage.objects.count() == 0 and Message.objects.get(pk=root.pk).lease_token == root.lease_token


# --- the worker ---------------------------------------------------------------------------


BOUND = 30  # seconds a held write waits for what it waits for


@pytest.mark.parametrize("batch_size", [1, None], ids=["batch-1", "adaptive"])
def test_a_worker_runs_a_chain_without_a_claim_of_its_own_per_step(monkeypatch, batch_size):
    """Every step after the root is taken by the claim in its parent's acknowledging transaction. Once
    that claim took one, the worker waits for its acks instead of claiming beside them: while steps are
    left, its own claims are the root's and the one beside the root's ack (held until it returned:
    nothing was ready then). Each step runs once, in order."""
    names = [f"s{n:02}" for n in range(12)]
    chain(*names).enqueue()
    ran: list[str] = []
    own_claims: list[tuple[int, int]] = []  # (steps run by then, messages taken)
    real_claim, real_ack_then_claim = Consumer.claim, MessageQuerySet.ack_then_claim
    beside_root = threading.Event()
    held: list[bool] = []

    def claim(self, wanted=None):
        before = len(ran)
        claimed = real_claim(self, wanted)
        own_claims.append((before, len(claimed)))
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
    # Once every step ran, the worker looks again before it stops (the batch watch may make that twice).
    assert [claim for claim in own_claims if claim[0] < len(names)] == [(0, 1), (1, 0)]
    assert sum(taken for _, taken in own_claims) == 1
    assert ArchivedMessage.objects.filter(outcome=Outcome.ACKED).count() == len(names)
    assert not Message.objects.exists()


def test_an_async_handlers_chain_runs_to_its_end():
    """The async handlers' consumer claims for its loop's free slots itself: no claim in its acks."""
    names = [f"s{n}" for n in range(5)]
    chain(*names).enqueue()
    ran: list[str] = []

    async def handler(message):
        ran.append(step_name(message))

    config = WorkerConfig(queues=[Q], handler=handler, until_empty=True, max_runtime=120)
    assert QueueWorker(config).run() == ExitStatus.OK
    assert ran == names
    assert not Message.objects.exists()


def test_max_messages_counts_what_the_claim_in_the_acks_took(monkeypatch):
    """A root releasing 20 steps, batches of 10, --max-messages 10: ten messages run, no more; the
    steps left are given back, unleased. A claim of the consumer's own is held until the acks' claim
    has committed: one made beside it, not counting what it took, would take 9 more."""
    workflow = Workflow("next")
    workflow.add("root", Q, {})
    workflow.group(*(Step(f"s{n:02}", Q, {}) for n in range(20)), after=["root"])
    workflow.enqueue()
    real_claim, real_ack_then_claim = MessageQuerySet.claim, MessageQuerySet.ack_then_claim
    acks_written = threading.Event()
    claims: list[int] = []

    def ack_then_claim(self, *args, **kwargs):
        answer = real_ack_then_claim(self, *args, **kwargs)
        acks_written.set()
        return answer

    def claim(self, *args, **kwargs):
        # After the root's: the statement waits for the root's acks and their claim (its size is set by then).
        if claims:
            assert acks_written.wait(BOUND)
        claimed = real_claim(self, *args, **kwargs)
        claims.append(len(claimed))
        return claimed

    ran: list[str] = []
    monkeypatch.setattr(MessageQuerySet, "ack_then_claim", ack_then_claim)
    monkeypatch.setattr(MessageQuerySet, "claim", claim)
    config = WorkerConfig(queues=[Q], handler=lambda m: ran.append(step_name(m)), batch_size=10, max_messages=10)
    QueueWorker(config).run()
    assert len(ran) == 10 and ran[0] == "root"
    assert ArchivedMessage.objects.count() == 10
    assert Message.objects.count() == 11
    assert not Message.objects.filter(lease_token__isnull=False).exists()


@pytest.mark.parametrize("queue", ["fc-groups", "fc-fifo", "fc-rate"])
def test_a_chain_on_a_queue_under_flow_rules_is_claimed_by_the_worker_not_in_its_acks(monkeypatch, queue):
    """Flow rules' claims take locks of their own (group counts, FIFO heads, rate buckets): the acks of
    such a queue's steps claim nothing, whichever rule it is."""
    names = ["a", "b", "c"]
    chain(*names, queue=queue).enqueue()
    calls = []
    real = MessageQuerySet.ack_then_claim

    def spy(self, *args, **kwargs):
        calls.append(args)
        return real(self, *args, **kwargs)

    ran: list[str] = []
    monkeypatch.setattr(MessageQuerySet, "ack_then_claim", spy)
    config = WorkerConfig(queues=[queue], handler=lambda m: ran.append(step_name(m)), until_empty=True, max_runtime=120)
    assert QueueWorker(config).run() == ExitStatus.OK
    assert ran == names and calls == []


def test_weather_while_reading_the_pauses_sends_the_acks_without_a_claim(monkeypatch):
    """Fault: the paused queues cannot be read when the acks are handed over (a failover): the acks go
    alone, the consumer claims after them, and the chain runs to its end."""
    from django_dbqueue.worker.consumer import PausedQueues

    names = [f"s{n}" for n in range(4)]
    chain(*names).enqueue()
    real_names = PausedQueues.names
    failed: list[int] = []

    def names_or_weather(self):
        if not failed and len(ran) == 2:  # at the hand-over of the second step's ack
            failed.append(1)
            raise OperationalError("server closed the connection unexpectedly")
        return real_names(self)

    ran: list[str] = []
    monkeypatch.setattr(PausedQueues, "names", names_or_weather)
    config = WorkerConfig(queues=[Q], handler=lambda m: ran.append(step_name(m)), until_empty=True, max_runtime=120)
    assert QueueWorker(config).run() == ExitStatus.OK
    assert failed == [1]
    assert ran == names
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


def test_an_error_after_the_acks_committed_still_hands_over_what_their_claim_took(monkeypatch):
    """Fault: the acks and their claim committed, then something after them failed for good (the read-back
    for message_acked's listeners, say). The completer reads back what the claim's token leased: the next
    step runs, once, instead of waiting out its lease."""
    from django.db import DataError

    names = ["a", "b", "c"]
    chain(*names).enqueue()
    real = MessageQuerySet.ack_then_claim
    failed: list[int] = []

    def then_fail(self, *args, **kwargs):
        answer = real(self, *args, **kwargs)
        if not failed:
            failed.append(len(answer[1]))
            raise DataError("after the commit")
        return answer

    ran: list[str] = []
    monkeypatch.setattr(MessageQuerySet, "ack_then_claim", then_fail)
    config = WorkerConfig(queues=[Q], handler=lambda m: ran.append(step_name(m)), until_empty=True, max_runtime=120)
    assert QueueWorker(config).run() == ExitStatus.OK
    assert failed == [1]  # the first call's claim took b
    assert ran == names
    assert ArchivedMessage.objects.filter(outcome=Outcome.ACKED).count() == 3
    assert not Message.objects.exists()


def test_a_step_on_a_queue_named_in_another_case_is_not_claimed_in_the_acks():
    """Queue names are compared exactly on every database (docs/design.md, decision 9): a step on
    'WF-NEXT' released by an ack on 'wf-next' is not taken by a claim for 'wf-next', and the one after
    it, back on 'wf-next', waits for it."""
    workflow = Workflow("cases")
    workflow.chain(Step("a", Q, {}), Step("b", Q.upper(), {}), Step("c", Q, {}))
    workflow.enqueue()
    answers, taken = ack_then_claim([root_of()], [Q])
    assert answers == [True] and taken == []
    (b,) = Message.objects.filter(queue=Q.upper())
    assert b.lease_token is None and step_name(b) == "b"
    assert not Message.objects.filter(queue=Q).exists()
    (b,) = django_dbqueue.claim(Q.upper(), 1, worker=WORKER)
    answers, taken = ack_then_claim([b], [Q, Q.upper()])
    assert answers == [True] and [(m.queue, step_name(m)) for m in taken] == [(Q, "c")]
