"""Workflows with the rest: keyed workflows and steps, schedules, the outbox, flow control, orphaned steps.

Driven in one process with the statements real workers run (claim, ack,
the reaper); the join under real worker processes is
tests/test_workflow_processes.py.
"""

import time
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_dbqueue
from django_dbqueue import Step, Workflow, outbox, running
from django_dbqueue import workflows as builder
from django_dbqueue.exceptions import InvalidOption
from django_dbqueue.models import ArchivedMessage, Message, Outcome, WorkflowEdge, WorkflowRun, WorkflowStep, joins
from django_dbqueue.models.workflows import check_steps, orphan_reason
from django_dbqueue.reaper import Reaper
from django_dbqueue.schedules.scheduler import Scheduler
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from tests.support.schedules import Clock, at
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)

Q = "wfc"


def steps_of(run: WorkflowRun) -> dict[str, str]:
    return dict(WorkflowStep.objects.filter(workflow=run).values_list("name", "state"))


# --- a key per workflow ------------------------------------------------------------------------


def test_a_workflow_key_enqueues_once_and_returns_the_holder():
    first = Workflow("report", key="report-2026-11-26")
    first.add("fetch", Q)
    run = first.enqueue()
    again = Workflow("report", key="report-2026-11-26")
    again.add("fetch", Q)
    again.add("mail", Q, after=["fetch"])
    held = again.enqueue()
    assert (held.pk, held.was_created, run.was_created) == (run.pk, False, True)
    assert (WorkflowRun.objects.count(), WorkflowStep.objects.count(), Message.objects.count()) == (1, 1, 1)


def test_a_held_key_inside_a_transaction_leaves_the_callers_writes_alone():
    first = Workflow("a", key="k")
    first.add("x", Q)
    first.enqueue()
    with transaction.atomic():
        django_dbqueue.enqueue(Q, {"mine": True})
        second = Workflow("a", key="k")
        second.add("x", Q)
        assert second.enqueue().was_created is False
    assert Message.objects.filter(payload={"mine": True}).count() == 1


def test_a_bad_workflow_key_is_refused():
    with pytest.raises(InvalidOption, match="workflow key must be a non-empty string"):
        Workflow("a", key="")


# --- a schedule fires a workflow -----------------------------------------------------------------


def nightly_workflow(message):
    workflow = Workflow("nightly")
    workflow.chain(Step("fetch", Q, {"slot": message.headers["schedule_slot"]}), Step("mail", Q))
    return workflow


def test_a_schedule_starts_one_workflow_per_slot_however_often_its_message_runs(schedules, handler):
    start = handler("wfc-nightly")(builder.starts_workflow(nightly_workflow))
    django_dbqueue.schedule(every=60, name="nightly")(start)
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    schedulers = [Scheduler(clock=clock, name=f"s{n}") for n in range(3)]
    schedulers[0].run_once()
    clock.advance(31)
    for scheduler in schedulers:  # three schedulers, one slot: one message
        scheduler.run_once()
    [message] = django_dbqueue.claim("wfc-nightly")
    # The handler runs at least once: a second run of the same message (its lease lost) starts nothing new.
    assert start(message) == start(message)
    message.ack()
    run = WorkflowRun.objects.get()
    assert (run.name, run.key) == ("nightly", "schedule:nightly@2026-05-01T10:01:00+00:00")
    [fetch] = Message.objects.filter(queue=Q)
    assert fetch.payload == {"slot": "2026-05-01T10:01:00+00:00"}

    clock.advance(60)  # the next slot starts the next workflow
    schedulers[1].run_once()
    [message] = django_dbqueue.claim("wfc-nightly")
    start(message)
    assert sorted(WorkflowRun.objects.values_list("key", flat=True)) == [
        "schedule:nightly@2026-05-01T10:01:00+00:00",
        "schedule:nightly@2026-05-01T10:02:00+00:00",
    ]


def test_starts_workflow_keys_a_plain_message_by_its_id_and_refuses_what_is_no_workflow():
    start = builder.starts_workflow(lambda message: None)
    message = django_dbqueue.enqueue("wfc-start", {})
    assert start(message) is None and not WorkflowRun.objects.exists()  # None: nothing to start

    def build(message):
        workflow = Workflow("w")
        workflow.add("a", Q)
        return workflow

    assert builder.starts_workflow(build)(message) == WorkflowRun.objects.get(key=f"message:{message.pk}").pk
    with pytest.raises(InvalidOption, match="returned 'nope', not a Workflow"):
        builder.starts_workflow(lambda message: "nope")(message)


# --- the outbox: a workflow enqueued on a model save ----------------------------------------------


class Rollback(Exception):
    pass


@pytest.fixture
def order_workflow():
    """A workflow rule on Order's saves (keyed by the order), disconnected after the test."""

    def fulfil(order):
        if order.total <= 0:
            return None
        workflow = Workflow("fulfil", key=f"order-{order.pk}")
        workflow.chain(Step("reserve", Q, {"order": order.number}), Step("ship", Q))
        return workflow

    rule = outbox.enqueue_workflow_on_save(Order, fulfil, when="created")
    yield rule
    rule.disconnect()


def test_a_rolled_back_save_writes_no_workflow_and_a_committed_one_writes_it_once(order_workflow):
    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(number="W-1", total=5)
        assert WorkflowRun.objects.count() == 1  # written inside the save's transaction
        raise Rollback
    assert (WorkflowRun.objects.count(), WorkflowStep.objects.count(), Message.objects.count()) == (0, 0, 0)

    with transaction.atomic():
        order = Order.objects.create(number="W-2", total=5)
    run = WorkflowRun.objects.get()
    assert (run.name, run.key, steps_of(run)) == (
        "fulfil",
        f"order-{order.pk}",
        {"reserve": "enqueued", "ship": "waiting"},
    )
    assert Message.objects.get().payload == {"order": "W-2"}
    order.save()  # an update: the rule is for creations
    Order.objects.create(number="W-3", total=0)  # the callable returns None: no workflow
    assert WorkflowRun.objects.count() == 1


def test_enqueue_saved_applies_a_workflow_rule_to_bulk_created_rows(order_workflow):
    with transaction.atomic():
        orders = Order.objects.bulk_create([Order(number=f"B-{n}", total=1) for n in range(3)])
        outbox.enqueue_saved(orders, created=True)
    assert WorkflowRun.objects.count() == 3
    with transaction.atomic():
        outbox.enqueue_saved(orders, created=True)  # the same orders again: their keys hold
    assert WorkflowRun.objects.count() == 3


def test_a_workflow_rule_that_returns_no_workflow_is_refused_by_name():
    rule = outbox.enqueue_workflow_on_save(Order, lambda order: "nope", name="bad")
    try:
        with pytest.raises(InvalidOption, match=r"workflow rule 'bad' on testapp\.Order returned 'nope'"):
            Order.objects.create(number="X-1", total=1)
    finally:
        rule.disconnect()
    with pytest.raises(InvalidOption, match="workflow must be a callable"):
        outbox.enqueue_workflow_on_save(Order, "fulfil")


# --- orphaned steps ---------------------------------------------------------------------------------


def delete_workflow_rows():
    """The fault injected: a workflow's rows deleted behind its steps' backs (by hand, a restore)."""
    WorkflowEdge.objects.all().delete()
    WorkflowStep.objects.all().delete()
    WorkflowRun.objects.all().delete()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_orphaned_step_is_reported_and_never_run(handler, caplog, kind):
    ran = []
    if kind == "sync":
        handler(Q)(lambda message: ran.append(message.pk))
    else:

        @handler(Q)
        async def record(message):
            ran.append(message.pk)

    run = django_dbqueue.workflows.chain("orphan", Step("a", Q), Step("b", Q)).enqueue()
    delete_workflow_rows()
    [message] = django_dbqueue.claim(Q)
    assert running.process(message, worker="w") == "cancelled"
    assert ran == []
    archived = ArchivedMessage.objects.get(message_id=message.pk)
    assert archived.outcome == Outcome.CANCELLED
    assert archived.last_error.startswith(f"orphaned workflow step: the rows of step 'a' of workflow {run.pk} are gone")
    assert f"message {message.pk} of queue {Q}: orphaned workflow step" in caplog.text
    assert not Message.objects.exists()  # nothing after it was enqueued


def test_a_step_with_its_rows_runs_as_before(handler):
    ran = []
    handler(Q)(lambda message: ran.append(message.pk))
    django_dbqueue.workflows.chain("kept", Step("a", Q)).enqueue()
    [message] = django_dbqueue.claim(Q)
    assert running.process(message, worker="w") == "acked"
    assert ran == [message.pk]


def two_workflows_one_orphaned():
    """A group of three steps with their rows, and a one-step workflow whose rows are deleted (the fault)."""
    kept = Workflow("kept")
    kept.group(*(Step(f"k{n}", Q) for n in range(3)))
    kept.enqueue()
    gone = django_dbqueue.workflows.chain("gone", Step("g", Q)).enqueue()
    WorkflowStep.objects.filter(workflow=gone).delete()
    WorkflowRun.objects.filter(pk=gone.pk).delete()
    return gone


def test_a_claimed_batch_looks_up_its_steps_rows_in_one_statement():
    two_workflows_one_orphaned()
    django_dbqueue.enqueue(Q, {"plain": True})
    claimed = django_dbqueue.claim(Q, 10)
    with CaptureQueriesContext(connection) as lookups:
        check_steps("default", claimed)
    assert len(lookups.captured_queries) == 1
    with CaptureQueriesContext(connection) as none:
        reasons = {m.headers.get("dbqueue_step", ["-", "plain"])[1]: orphan_reason("default", m) for m in claimed}
    assert none.captured_queries == []  # each step's answer came with its batch
    assert {name for name, reason in reasons.items() if reason} == {"g"}
    assert reasons["g"].startswith("orphaned workflow step: the rows of step 'g'")


@pytest.mark.parametrize("lookup_fails", [False, True])
def test_a_worker_runs_a_batchs_present_steps_and_never_its_orphan(handler, monkeypatch, lookup_fails):
    ran = []
    handler(Q)(lambda message: ran.append(message.headers["dbqueue_step"][1]))
    gone = two_workflows_one_orphaned()
    if lookup_fails:  # the fault: the batch's lookup fails; each step then looks its own row up before it runs
        real, calls = joins.present_steps, []

        def flaky(using, refs):
            calls.append(len(refs))
            if len(calls) == 1:
                raise OperationalError(2013, "Lost connection to server during query (injected)")
            return real(using, refs)

        monkeypatch.setattr(joins, "present_steps", flaky)
    status = QueueWorker(WorkerConfig(queues=[Q], batch_size=10, until_empty=True, max_runtime=60)).run()
    assert status == ExitStatus.OK
    assert sorted(ran) == ["k0", "k1", "k2"]
    outcomes = dict(ArchivedMessage.objects.filter(queue=Q).values_list("headers__dbqueue_step__1", "outcome"))
    assert outcomes == {"k0": "acked", "k1": "acked", "k2": "acked", "g": "cancelled"}
    assert WorkflowRun.objects.get(name="kept").state == WorkflowRun.FINISHED
    assert not WorkflowRun.objects.filter(pk=gone.pk).exists()
    if lookup_fails:
        assert calls[0] == 4 and calls[1:] == [1, 1, 1, 1]  # the batch's lookup, then one per step


# --- flow control: steps in a FIFO group, on a rate-limited queue -------------------------------------


def step_name(message):
    return message.headers["dbqueue_step"][1]


def test_steps_in_a_fifo_group_run_one_at_a_time_in_order_and_the_workflow_finishes(settings):
    settings.DBQUEUE = {"QUEUES": {"wfc-ledger": {"ORDERED": True}}}
    workflow = Workflow("ledger")
    entries = [Step(f"entry-{n}", "wfc-ledger", {"n": n}, group="account:7") for n in range(5)]
    workflow.chord(entries, Step("close", "wfc-ledger", {}, group="account:7"))
    run = workflow.enqueue()
    other = django_dbqueue.enqueue("wfc-ledger", {"other": True}, group="account:8")  # another group runs beside
    order = []
    while True:
        claimed = django_dbqueue.claim("wfc-ledger", 10)
        grouped = [m for m in claimed if m.pk != other.pk]
        if not claimed:
            break
        assert len(grouped) <= 1, f"two messages of one FIFO group claimed at once: {[step_name(m) for m in grouped]}"
        for message in claimed:
            if message.pk != other.pk:
                order.append(step_name(message))
            message.ack()
    assert order == [f"entry-{n}" for n in range(5)] + ["close"]
    run.refresh_from_db()
    assert (run.state, run.outcome) == ("finished", "succeeded")


def test_steps_on_a_rate_limited_queue_keep_to_the_rate_and_the_workflow_finishes(settings):
    settings.DBQUEUE = {"QUEUES": {"wfc-api": {"RATE_LIMIT": "3/s"}}}
    workflow = Workflow("calls")
    workflow.chord([Step(f"call-{n}", "wfc-api", {"n": n}) for n in range(8)], Step("sum", "wfc-api", {}))
    run = workflow.enqueue()
    claimed_at = []
    deadline = time.monotonic() + 60
    while WorkflowRun.objects.get(pk=run.pk).state == WorkflowRun.RUNNING:
        assert time.monotonic() < deadline, "the workflow did not finish in 60 s"
        for message in django_dbqueue.claim("wfc-api", 10):
            claimed_at.append(message.claimed_at)
            message.ack()
        time.sleep(0.05)
    assert len(claimed_at) == 9
    for start in claimed_at:  # no one-second window holds more than 3 claims (the database's clock)
        within = [t for t in claimed_at if start <= t < start + timedelta(seconds=1)]
        assert len(within) <= 3, f"{len(within)} claims within a second from {start}"
    assert WorkflowRun.objects.get(pk=run.pk).outcome == "succeeded"


# --- keyed steps ------------------------------------------------------------------------------------


def status_of(run):
    return {s["name"]: (s["state"], s["reason"]) for s in Workflow.status(run.pk)["steps"]}


def claim_step(name):
    claimed = django_dbqueue.claim(Q, 100)
    mine = [m for m in claimed if (m.headers or {}).get("dbqueue_step", [None, None])[1] == name]
    for other in claimed:
        if other not in mine:
            other.release()
    assert len(mine) == 1, [m.headers for m in claimed]
    return mine[0]


def test_a_keyed_step_is_enqueued_with_its_key_and_runs_as_any_step():
    workflow = Workflow("keyed")
    workflow.chain(Step("a", Q, {}, key="report:7"), Step("b", Q))
    run = workflow.enqueue()
    assert Message.objects.get().key == "report:7"
    claim_step("a").ack()
    claim_step("b").ack()
    run.refresh_from_db()
    assert run.outcome == "succeeded"


def test_a_step_whose_key_is_live_is_cancelled_naming_the_message_and_its_dependents_follow():
    holder = django_dbqueue.enqueue(Q, {"someone": "else"}, key="report:7")
    workflow = Workflow("keyed")
    workflow.chain(Step("a", Q, {}, key="report:7"), Step("b", Q), Step("c", Q))
    run = workflow.enqueue()
    assert status_of(run) == {
        "a": ("cancelled", f"not enqueued: key 'report:7' is held by live message {holder.pk}"),
        "b": ("cancelled", "dependency 'a' ended cancelled"),
        "c": ("cancelled", "dependency 'a' ended cancelled"),
    }
    run.refresh_from_db()
    assert (run.state, run.outcome) == ("finished", "failed")
    assert list(Message.objects.values_list("pk", flat=True)) == [holder.pk]  # the holder untouched


def test_ignore_cancelled_lets_the_steps_after_a_refused_key_run():
    django_dbqueue.enqueue(Q, {}, key="k")
    workflow = Workflow("keyed")
    workflow.add("a", Q, {}, key="k")
    workflow.add("b", Q, {}, after=["a"], ignore_cancelled=True)
    run = workflow.enqueue()
    assert status_of(run)["b"] == ("enqueued", "")


def test_a_step_released_by_its_parent_meets_its_key_when_it_becomes_ready():
    workflow = Workflow("later")
    workflow.chain(Step("a", Q), Step("b", Q, {}, key="k"), Step("c", Q))
    run = workflow.enqueue()
    holder = django_dbqueue.enqueue(Q, {}, key="k")  # taken while b waits
    claim_step("a").ack()
    assert status_of(run)["b"] == ("cancelled", f"not enqueued: key 'k' is held by live message {holder.pk}")
    assert status_of(run)["c"] == ("cancelled", "dependency 'b' ended cancelled")
    run.refresh_from_db()
    assert (run.state, run.outcome, run.open_steps) == ("finished", "failed", 0)


def test_two_steps_of_one_workflow_with_one_key_the_first_declared_runs():
    workflow = Workflow("twins")
    workflow.group(Step("a", Q, {}, key="k"), Step("b", Q, {}, key="k"), Step("c", Q))
    run = workflow.enqueue()
    a = Message.objects.get(key="k")
    assert a.headers["dbqueue_step"][1] == "a"
    assert status_of(run)["b"] == ("cancelled", f"not enqueued: key 'k' is held by live message {a.pk}")
    assert status_of(run)["c"] == ("enqueued", "")


def test_a_steps_unique_window_refuses_it_after_the_keys_message_finished():
    first = Workflow("w1")
    first.add("a", Q, {}, key="daily", unique=timedelta(minutes=10))
    one = first.enqueue()
    claim_step("a").ack()  # finished: only the window holds the key now
    second = Workflow("w2")
    second.add("a", Q, {}, key="daily", unique=timedelta(minutes=10))
    two = second.enqueue()
    assert status_of(one)["a"][0] == "acked"
    assert status_of(two)["a"] == ("cancelled", "not enqueued: key 'daily' was taken less than its unique window ago")


def test_a_debounced_step_replaces_the_keys_waiting_message_and_that_message_runs_it():
    waiting = django_dbqueue.enqueue(Q, {"old": True}, key="reindex", debounce=timedelta(seconds=30))
    workflow = Workflow("debounced")
    workflow.chain(Step("a", Q, {"new": True}, key="reindex", debounce=timedelta(seconds=30)), Step("b", Q))
    run = workflow.enqueue()
    [message] = Message.objects.all()
    assert message.pk == waiting.pk and message.payload == {"new": True}  # the last write wins
    assert Workflow.status(run.pk)["steps"][0]["message_id"] == waiting.pk
    assert django_dbqueue.claim(Q) == []  # due 30 s after the last enqueue
    Message.objects.filter(pk=message.pk).update(available_at=timezone.now() - timedelta(seconds=1))
    claim_step("a").ack()
    claim_step("b").ack()
    run.refresh_from_db()
    assert run.outcome == "succeeded"


def test_a_debounced_step_whose_keys_message_runs_is_cancelled():
    django_dbqueue.enqueue(Q, {}, key="reindex", debounce=timedelta(seconds=30))
    Message.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    [running_one] = django_dbqueue.claim(Q)
    workflow = Workflow("debounced")
    workflow.add("a", Q, {}, key="reindex", debounce=timedelta(seconds=30))
    run = workflow.enqueue()
    assert status_of(run)["a"] == ("cancelled", f"not enqueued: key 'reindex' is held by live message {running_one.pk}")


def test_a_steps_message_replaced_by_another_producers_debounce_is_cancelled_by_the_reaper():
    workflow = Workflow("replaced")
    workflow.chain(Step("a", Q, {}, key="k", debounce=timedelta(seconds=30)), Step("b", Q))
    run = workflow.enqueue()
    django_dbqueue.enqueue(Q, {"plain": True}, key="k", debounce=timedelta(seconds=30))  # replaces a's message
    Message.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    [message] = django_dbqueue.claim(Q)
    assert message.payload == {"plain": True} and "dbqueue_step" not in message.headers
    message.ack()  # it ran as the other producer's
    assert status_of(run)["a"][0] == "enqueued"
    assert Reaper().run_once().steps_settled == 1
    state, reason = status_of(run)["a"]
    assert (state, reason) == (
        "cancelled",
        f"its message {message.pk} ran as another's: an enqueue with debounce on its key replaced it",
    )
    assert status_of(run)["b"] == ("cancelled", "dependency 'a' ended cancelled")
    run.refresh_from_db()
    assert (run.state, run.outcome) == ("finished", "failed")


@pytest.mark.parametrize("where", ["another workflow", "the same workflow"])
def test_a_steps_message_taken_over_by_another_steps_debounce_is_cancelled_by_the_reaper(where):
    """The message runs the step whose debounce replaced it; the step it was made for did not run. Its
    workflow used to be marked by the message's id alone: that step acked, its dependents waiting for ever."""
    first = Workflow("first")
    first.chain(Step("a", Q, {"n": 1}, key="k", debounce=timedelta(seconds=30)), Step("b", Q))
    if where == "another workflow":
        one = first.enqueue()
        second = Workflow("second")
        second.add("a", Q, {"n": 2}, key="k", debounce=timedelta(seconds=30))
        two = second.enqueue()
    else:
        first.add("c", Q, {"n": 2}, key="k", debounce=timedelta(seconds=30))
        one = two = first.enqueue()
    [message] = Message.objects.all()
    taker = "a" if where == "another workflow" else "c"
    assert message.payload == {"n": 2} and message.headers["dbqueue_step"] == [two.pk, taker]
    Message.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    claim_step(taker).ack()
    assert status_of(two)[taker][0] == "acked"
    assert status_of(one)["a"][0] == "enqueued"  # not run: the reaper's sweep settles it
    assert Reaper().run_once().steps_settled == 1
    assert status_of(one)["a"] == (
        "cancelled",
        f"its message {message.pk} ran as another's: an enqueue with debounce on its key replaced it",
    )
    assert status_of(one)["b"] == ("cancelled", "dependency 'a' ended cancelled")
    for run in {one, two}:
        run.refresh_from_db()
        assert run.state == "finished"
    assert one.outcome == "failed"


def test_cancelling_a_workflow_leaves_alone_the_message_another_workflows_step_took_over():
    first = Workflow("first")
    first.chain(Step("a", Q, {"n": 1}, key="k", debounce=timedelta(seconds=30)), Step("b", Q))
    one = first.enqueue()
    second = Workflow("second")
    second.add("a", Q, {"n": 2}, key="k", debounce=timedelta(seconds=30))
    two = second.enqueue()
    [message] = Message.objects.all()  # the second's a runs it
    assert Workflow.cancel(one.pk, by="ops") == 0
    assert Message.objects.get().pk == message.pk and not Message.objects.get().cancel_requested_at
    assert status_of(one)["b"] == ("cancelled", "workflow cancelled by ops")
    Message.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    claim_step("a").ack()
    assert Reaper().run_once().steps_settled == 1  # the first's a: its message ran as the second's
    for run, outcome in ((one, "cancelled"), (two, "succeeded")):
        run.refresh_from_db()
        assert (run.state, run.outcome) == ("finished", outcome)


def test_a_batch_marks_each_step_as_its_own_message_only():
    """Step a's message was taken over by c's debounce (both hold its id); d holds another. Marking (a, d's
    message) and (c, the taken message) must mark c alone: not a by c's message, nor d by a's name."""
    workflow = Workflow("pairs")
    workflow.add("a", Q, {}, key="k", debounce=timedelta(seconds=30))
    workflow.add("c", Q, {}, key="k", debounce=timedelta(seconds=30))
    workflow.add("d", Q, {})
    run = workflow.enqueue()
    steps = {s.name: s.message_id for s in WorkflowStep.objects.filter(workflow=run)}
    assert steps["a"] == steps["c"] != steps["d"]
    changed = joins.finish_steps(
        connection.alias, "enqueued", run.pk, [("a", steps["d"]), ("c", steps["c"])], Outcome.ACKED, ""
    ).get()
    assert changed == 1
    assert {n: s for n, (s, _) in status_of(run).items()} == {"a": "enqueued", "c": "acked", "d": "enqueued"}


def test_a_steps_message_moved_to_another_group_by_a_debounce_is_cancelled_by_the_reaper():
    workflow = Workflow("moved")
    workflow.add("a", Q, {}, key="k", group="g1", debounce=timedelta(seconds=30))
    run = workflow.enqueue()
    moved = django_dbqueue.enqueue(Q, {}, key="k", group="g2", debounce=timedelta(seconds=30))  # a new row
    assert not Message.objects.filter(headers__has_key="dbqueue_step").exists()
    assert Reaper().run_once().steps_settled == 1
    assert status_of(run)["a"][0] == "cancelled"
    assert "left the queue without an archive row" in status_of(run)["a"][1]
    assert Message.objects.get().pk == moved.pk


def test_keyed_steps_in_a_fifo_group_take_their_turn_behind_the_groups_earlier_message(settings):
    settings.DBQUEUE = {"QUEUES": {"wfc-ledger": {"ORDERED": True}}}
    earlier = django_dbqueue.enqueue("wfc-ledger", {"first": True}, group="acct")
    workflow = Workflow("ledger")
    workflow.group(
        Step("x", "wfc-ledger", {}, key="entry:x", group="acct"),
        Step("y", "wfc-ledger", {}, key="entry:y", group="acct"),
    )
    run = workflow.enqueue()
    order = []
    for _ in range(5):
        claimed = django_dbqueue.claim("wfc-ledger", 10)
        if not claimed:
            break
        assert len(claimed) == 1
        order.append("earlier" if claimed[0].pk == earlier.pk else claimed[0].headers["dbqueue_step"][1])
        assert claimed[0].key in (None, "entry:x", "entry:y")
        claimed[0].ack()
    assert order == ["earlier", "x", "y"]
    run.refresh_from_db()
    assert run.outcome == "succeeded"
