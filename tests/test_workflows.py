"""Workflows in one process: the builder's checks, the join, the policies, results, cancel, replay, the reaper.

The same statements real workers run (claim, ack, fail, the reaper), driven
step by step so that each state in between can be looked at. Real worker
processes: tests/test_workflow_processes.py.
"""

import threading
import time
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_dbqueue
import django_dbqueue.signals
from django_dbqueue import Dep, Step, Workflow
from django_dbqueue import workflows as builder
from django_dbqueue.control import cancel, replay
from django_dbqueue.exceptions import InvalidOption, PayloadNotSerializable, UnknownOption
from django_dbqueue.models import (
    ArchivedMessage,
    Message,
    Outcome,
    WorkflowEdge,
    WorkflowRun,
    WorkflowStep,
    joins,
)
from django_dbqueue.models import workflows as table
from django_dbqueue.reaper import Reaper

pytestmark = pytest.mark.django_db(transaction=True)

Q = "wf"


def take(name: str) -> Message:
    """Claim the ready message of step ``name`` (failing when it is not the one ready)."""
    claimed = django_dbqueue.claim(Q, 100)
    mine = [m for m in claimed if m.headers["dbqueue_step"][1] == name]
    for other in claimed:
        if other not in mine:
            other.release()
    assert len(mine) == 1, f"{name} not ready; ready: {[m.headers['dbqueue_step'][1] for m in claimed]}"
    return mine[0]


def ready() -> list[str]:
    return sorted(m.headers["dbqueue_step"][1] for m in Message.objects.filter(queue=Q, lease_token__isnull=True))


def nothing_written():
    return (
        WorkflowRun.objects.count()
        + WorkflowStep.objects.count()
        + WorkflowEdge.objects.count()
        + Message.objects.count()
    )


# --- the builder's checks ------------------------------------------------------------------


def bad(*build):
    workflow = Workflow("bad")
    for step in build:
        step(workflow)
    return workflow


@pytest.mark.parametrize(
    ("workflow", "error", "says"),
    [
        (lambda: bad(), InvalidOption, "has no steps"),
        (lambda: bad(lambda w: w.add("a", Q), lambda w: w.add("a", Q)), InvalidOption, "two steps are named 'a'"),
        (lambda: bad(lambda w: w.add("a", Q, after=["nope"])), InvalidOption, "'nope', which is no step"),
        (lambda: bad(lambda w: w.add("a", Q, after=["a"])), InvalidOption, "cycle"),
        (
            lambda: bad(
                lambda w: w.add("x", Q), lambda w: w.add("a", Q, after=["b"]), lambda w: w.add("b", Q, after=["a"])
            ),
            InvalidOption,
            "'a', 'b' depend on each other in a cycle",
        ),
        (lambda: bad(lambda w: w.add("a", Q, priority="high")), InvalidOption, "step 'a'"),
        (lambda: bad(lambda w: w.add("a", Q, colour="red")), UnknownOption, "unknown enqueue option"),
        (lambda: bad(lambda w: w.add("a", Q, {"x": object()})), PayloadNotSerializable, "step 'a'"),
        (lambda: bad(lambda w: w.add("a", "bad queue name!")), Exception, "step 'a'"),
        (
            lambda: bad(lambda w: w.add("a", Q, debounce=30)),
            InvalidOption,
            "step 'a': unique windows and debounce work on a key",
        ),
        (lambda: bad(lambda w: w.add("a", Q, using="default")), InvalidOption, "give using= to Workflow.enqueue()"),
        (lambda: bad(lambda w: w.add("", Q)), InvalidOption, "step name must be a non-empty string"),
        (lambda: bad(lambda w: w.add("a", Q, after=["a", "a"])), InvalidOption, "twice"),
        (lambda: bad(lambda w: w.add("s", Workflow("empty"))), InvalidOption, "empty workflow"),
    ],
)
def test_each_invalid_declaration_is_refused_and_nothing_is_written(workflow, error, says):
    with pytest.raises(error, match=says.replace("(", r"\(").replace(")", r"\)")):
        workflow().enqueue()
    assert nothing_written() == 0


def test_more_steps_than_the_maximum_is_refused(monkeypatch):
    monkeypatch.setattr(builder, "MAX_STEPS", 3)
    workflow = Workflow("big")
    workflow.group(*(Step(f"s{n}", Q) for n in range(4)))
    with pytest.raises(InvalidOption, match="has 4 steps; the limit is 3"):
        workflow.enqueue()
    assert nothing_written() == 0


def test_a_workflow_enqueued_in_a_rolled_back_transaction_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        django_dbqueue.workflows.chain("c", Step("a", Q), Step("b", Q)).enqueue()
        raise RuntimeError("roll back")
    assert nothing_written() == 0


# --- the join -------------------------------------------------------------------------------


def test_a_chain_runs_in_order_and_results_flow_down():
    run = django_dbqueue.workflows.chain("c", Step("a", Q, {"n": 1}), Step("b", Q), Step("c", Q)).enqueue()
    assert ready() == ["a"]
    take("a").ack(result={"from": "a"})
    assert ready() == ["b"]
    b = take("b")
    assert b.parent_results() == {"a": {"from": "a"}}
    b.ack(result=2)
    c = take("c")
    assert c.parent_results() == {"b": 2}
    c.ack()
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("finished", "succeeded")
    assert status["counts"]["acked"] == 3
    assert [s["state"] for s in status["steps"]] == ["acked"] * 3


def test_step_names_that_differ_only_in_case_are_different_steps():
    # MySQL compares text case-insensitively unless the column says otherwise: "a" and "A" must
    # still be two steps, each released by its own parent, each result under its own name.
    run = django_dbqueue.workflows.chain("case", Step("a", Q), Step("A", Q), Step("b", Q)).enqueue()
    assert ready() == ["a"]
    take("a").ack(result="lower")
    assert ready() == ["A"]
    upper = take("A")
    assert upper.parent_results() == {"a": "lower"}
    upper.ack(result="upper")
    last = take("b")
    assert last.parent_results() == {"A": "upper"}
    last.ack()
    status = Workflow.status(run.pk)
    assert status["outcome"] == "succeeded"
    assert sorted(s["name"] for s in status["steps"]) == ["A", "a", "b"]


def test_a_diamond_runs_its_join_once_after_both_parents():
    workflow = Workflow("diamond")
    workflow.add("a", Q)
    workflow.add("b", Q, after=["a"])
    workflow.add("c", Q, after=["a"])
    workflow.add("d", Q, after=["b", "c"])
    run = workflow.enqueue()
    take("a").ack()
    assert ready() == ["b", "c"]
    b, c = take("b"), take("c")
    b.ack(result="B")
    assert ready() == []
    c.ack(result="C")
    d = take("d")
    assert d.parent_results() == {"b": "B", "c": "C"}
    d.ack()
    assert Workflow.status(run.pk)["outcome"] == "succeeded"


def test_a_steps_result_and_reason_are_kept_exactly_as_given():
    # The join's statements are written by hand: quotes, percent signs and non-ASCII text go as parameters.
    text = "100% 'done' %s \"q\" \\ ünïcödé ✓"
    workflow = Workflow("text")
    workflow.add("a", Q)
    workflow.add("b", Q, max_attempts=1)
    workflow.add("c", Q, after=["a", Dep("b", ignore_dead=True)])
    run = workflow.enqueue()
    assert take("a").ack(result={"text": text, "nested": [text, 1.5, None]})
    take("b").reject(requeue=False, reason=text)
    assert take("c").parent_results() == {"a": {"text": text, "nested": [text, 1.5, None]}, "b": None}
    steps = {s["name"]: s for s in Workflow.status(run.pk)["steps"]}
    assert steps["b"]["state"] == "dead"
    assert text in steps["b"]["reason"]


def test_a_chord_body_gets_its_group_results_in_step_order():
    run = django_dbqueue.workflows.chord("sum", [Step(f"part{n}", Q, n) for n in range(5)], Step("total", Q)).enqueue()
    for n in reversed(range(5)):  # finished in the other order
        take(f"part{n}").ack(result=n * 10)
    total = take("total")
    assert list(total.parent_results().items()) == [(f"part{n}", n * 10) for n in range(5)]
    total.ack()
    assert WorkflowRun.objects.get(pk=run.pk).outcome == "succeeded"


def test_a_sub_workflow_is_inlined_with_prefixed_names():
    inner = Workflow("inner")
    inner.add("x", Q)
    inner.add("y", Q, after=["x"])
    inner.add("z", Q, after=["x"])
    outer = Workflow("outer")
    outer.add("first", Q)
    outer.add("sub", inner, after=["first"])
    outer.add("last", Q, after=["sub"])
    outer.enqueue()
    take("first").ack()
    take("sub.x").ack()
    assert ready() == ["sub.y", "sub.z"]
    take("sub.y").ack()
    assert ready() == ["sub.z"]
    take("sub.z").ack()
    assert list(take("last").parent_results()) == ["sub.y", "sub.z"]


def test_an_ordinary_ack_runs_no_workflow_statement():
    workflow = Workflow("w")
    workflow.add("a", Q)
    workflow.enqueue()
    django_dbqueue.enqueue(Q, {"plain": True})
    claimed = django_dbqueue.claim(Q, 2)
    plain = next(m for m in claimed if "dbqueue_step" not in m.headers)
    step = next(m for m in claimed if "dbqueue_step" in m.headers)
    with CaptureQueriesContext(connection) as plain_ack:
        assert plain.ack()
    assert not [q for q in plain_ack.captured_queries if "workflow" in q["sql"]]
    with CaptureQueriesContext(connection) as step_ack:
        assert step.ack()
    assert [q for q in step_ack.captured_queries if "workflow" in q["sql"]]


def test_acks_of_a_batch_settle_their_steps():
    workflow = Workflow("batch")
    workflow.group(Step("a", Q), Step("b", Q))
    workflow.add("c", Q, after=["a", "b"])
    run = workflow.enqueue()
    django_dbqueue.enqueue(Q, {"plain": True})
    claimed = django_dbqueue.claim(Q, 3)
    assert django_dbqueue.ack_many(claimed, results={m.pk: m.pk for m in claimed}) == [True] * 3
    assert ready() == ["c"]
    c = take("c")
    assert set(c.parent_results()) == {"a", "b"}
    assert WorkflowRun.objects.get(pk=run.pk).open_steps == 1


@pytest.mark.parametrize("rows", ["as read", "reversed"])
def test_the_children_a_batch_releases_are_enqueued_in_their_declared_order(monkeypatch, rows):
    # x is declared before y, but y's parent comes first among the edges read by parent: the children are
    # enqueued (their ids, hence their claim order among equals) in the order they were declared, in
    # whatever order the database's plan returns the edges (reversed: as another plan could).
    if rows == "reversed":
        read = joins._rows
        monkeypatch.setattr(joins, "_rows", lambda cursor: list(reversed(read(cursor))))
    workflow = Workflow("order")
    workflow.group(Step("b", Q), Step("c", Q))
    workflow.add("x", Q, after=["c"])
    workflow.add("y", Q, after=["b"])
    workflow.enqueue()
    claimed = django_dbqueue.claim(Q, 2)
    assert sorted(m.headers["dbqueue_step"][1] for m in claimed) == ["b", "c"]
    assert django_dbqueue.ack_many(claimed) == [True, True]
    released = Message.objects.filter(queue=Q).order_by("pk")
    assert [m.headers["dbqueue_step"][1] for m in released] == ["x", "y"]


def test_a_batch_of_step_acks_settles_together_in_as_many_statements_as_a_pair():
    workflow = Workflow("fan")
    parents = workflow.group(*(Step(f"p{n}", Q) for n in range(13)))
    workflow.add("join", Q, after=parents)
    run = workflow.enqueue()
    counts, left = [], 13
    for size in (2, 10):
        claimed = django_dbqueue.claim(Q, size)
        with CaptureQueriesContext(connection) as acks:
            assert django_dbqueue.ack_many(claimed) == [True] * size
        counts.append(len(acks.captured_queries))
        left -= size
        assert len(ready()) == left and "join" not in ready()
    assert counts[0] == counts[1]  # one UPDATE of the join by the batch's count, not one transaction per step
    assert WorkflowStep.objects.get(workflow_id=run.pk, name="join").pending == 1
    assert django_dbqueue.ack_many(django_dbqueue.claim(Q, 5)) == [True]
    assert ready() == ["join"]
    assert WorkflowRun.objects.get(pk=run.pk).open_steps == 1


def test_children_released_together_keep_each_its_own_options_payload_and_headers():
    # Children alike but for their payload are copied from the first one built; the others are built alone.
    workflow = Workflow("shapes")
    workflow.add("root", Q)
    workflow.group(*(Step(f"hi{n}", Q, {"n": n}, priority=5, headers={"h": n}) for n in range(3)), after=["root"])
    workflow.group(*(Step(f"later{n}", Q, [n], delay=3600) for n in range(2)), after=["root"])
    workflow.add("keyed", Q, "k", after=["root"], key="the-key", kind="special")
    workflow.enqueue()
    assert django_dbqueue.ack_many(django_dbqueue.claim(Q, 1)) == [True]
    live = {m.headers["dbqueue_step"][1]: m for m in Message.objects.filter(queue=Q)}
    assert sorted(live) == ["hi0", "hi1", "hi2", "keyed", "later0", "later1"]
    for n in range(3):
        m = live[f"hi{n}"]
        assert (m.payload, m.priority, m.headers["h"], m.kind, m.key) == ({"n": n}, 5, n, "", None)
    for n in range(2):
        m = live[f"later{n}"]
        assert (m.payload, m.priority, "h" in m.headers) == ([n], 0, False)
        assert m.available_at - m.created_at > timedelta(minutes=59)
    assert (live["keyed"].key, live["keyed"].kind, live["keyed"].payload) == ("the-key", "special", "k")
    assert len({m.pk for m in live.values()}) == 6


def test_a_large_workflow_refreshes_the_statistics_after_commit_and_a_failure_there_is_only_logged(monkeypatch, caplog):
    refreshed = []

    def analyze(using, table):
        refreshed.append((table, connection.in_atomic_block))
        raise errors.pop(0)

    errors = [OperationalError("injected: lock timeout"), RuntimeError("injected: not a database error")]
    monkeypatch.setattr(table, "ANALYZE_STEPS", 3)
    monkeypatch.setattr(table, "analyze_now", analyze)
    small = Workflow("small")
    small.group(Step("a", Q), Step("b", Q))
    small.enqueue()
    assert refreshed == []  # fewer steps than ANALYZE_STEPS
    big = Workflow("big")
    big.group(*(Step(f"s{n}", Q) for n in range(3)))
    run = big.enqueue()
    # Both tables, once the workflow's transaction committed; the failures did not undo it.
    assert refreshed == [("dbqueue_workflow_step", False), ("dbqueue_workflow_edge", False)]
    assert WorkflowRun.objects.filter(pk=run.pk).exists() and len(ready()) == 5
    assert caplog.text.count("could not refresh the statistics of dbqueue_workflow_") == 2


def test_the_refresh_waits_a_bounded_time_for_a_table_another_session_holds(monkeypatch, caplog):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's ANALYZE; elsewhere the refresh runs no statement")
    import psycopg

    monkeypatch.setattr(table, "ANALYZE_STEPS", 3)
    with psycopg.connect(**connection.get_connection_params()) as holder:  # the fault: a VACUUM, a migration
        holder.execute("LOCK TABLE dbqueue_workflow_step IN SHARE UPDATE EXCLUSIVE MODE")
        big = Workflow("big")
        big.group(*(Step(f"s{n}", Q) for n in range(3)))
        started = time.monotonic()
        run = big.enqueue()
        waited = time.monotonic() - started
    assert waited < 10  # about ANALYZE_LOCK_TIMEOUT_MS, not until the holder lets go
    assert "could not refresh the statistics of dbqueue_workflow_step" in caplog.text
    assert "lock timeout" in caplog.text
    assert "could not refresh the statistics of dbqueue_workflow_edge" not in caplog.text  # the other table was free
    assert WorkflowRun.objects.filter(pk=run.pk).exists() and len(ready()) == 3


def test_a_parent_of_more_children_than_one_statement_marks_enqueues_each_as_its_own_message():
    workflow = Workflow("wide")
    workflow.add("root", Q)
    workflow.group(*(Step(f"c{n}", Q, {"n": n}) for n in range(1001)), after=["root"])  # two chunks of the CASE
    run = workflow.enqueue()
    assert django_dbqueue.ack_many(django_dbqueue.claim(Q, 1)) == [True]
    steps = WorkflowStep.objects.filter(workflow_id=run.pk).exclude(name="root")
    assert set(steps.values_list("state", "pending")) == {("enqueued", 0)}
    live = {m.pk: (m.headers["dbqueue_step"][1], m.payload) for m in Message.objects.filter(queue=Q)}
    # Each step names its own message, which carries the step's name and payload.
    assert live == {s.message_id: (s.name, {"n": int(s.name[1:])}) for s in steps}
    assert len(live) == 1001


# --- the policies -----------------------------------------------------------------------


def diamond(**policy):
    workflow = Workflow("p", **policy)
    workflow.add("a", Q, max_attempts=1)
    workflow.add("b", Q, after=["a"])
    workflow.add("c", Q, after=["b"])
    return workflow


def test_a_dead_dependency_cancels_its_dependents_and_theirs_naming_it():
    run = diamond().enqueue()
    take("a").fail("boom", retry=False)
    status = Workflow.status(run.pk)
    states = {s["name"]: (s["state"], s["reason"]) for s in status["steps"]}
    assert states["a"][0] == "dead"
    assert states["b"] == ("cancelled", "dependency 'a' ended dead")
    assert states["c"] == ("cancelled", "dependency 'a' ended cancelled")
    assert (status["state"], status["outcome"]) == ("finished", "failed")
    assert ready() == []


@pytest.mark.parametrize("where", ["workflow", "step", "dep"])
def test_ignore_dead_lets_the_dependent_run(where):
    workflow = Workflow("p", ignore_dead=where == "workflow")
    workflow.add("a", Q, max_attempts=1)
    if where == "dep":
        workflow.add("b", Q, after=[Dep("a", ignore_dead=True)])
    else:
        workflow.add("b", Q, after=["a"], ignore_dead=where == "step")
    run = workflow.enqueue()
    take("a").reject(requeue=False, reason="no")
    b = take("b")
    assert b.parent_results() == {"a": None}
    b.ack()
    assert Workflow.status(run.pk)["outcome"] == "failed"  # a step died, the rest ran


def test_ignore_dead_does_not_ignore_a_cancel():
    workflow = Workflow("p")
    workflow.add("a", Q)
    workflow.add("b", Q, after=[Dep("a", ignore_dead=True)])
    run = workflow.enqueue()
    cancel(Message.objects.get(queue=Q).pk)
    assert {s["name"]: s["state"] for s in Workflow.status(run.pk)["steps"]} == {"a": "cancelled", "b": "cancelled"}


def test_ignore_cancelled_lets_the_dependent_run():
    workflow = Workflow("p")
    workflow.add("a", Q)
    workflow.add("b", Q, after=["a"], ignore_cancelled=True)
    workflow.enqueue()
    assert cancel(Message.objects.get(queue=Q).pk)
    assert ready() == ["b"]


def test_ignore_expired_lets_the_dependent_run_and_the_default_does_not():
    past = timezone.now() - timedelta(seconds=1)
    workflow = Workflow("p")
    workflow.add("a", Q, expires_at=past)
    workflow.add("tolerant", Q, after=["a"], ignore_expired=True)
    workflow.add("strict", Q, after=["a"])
    run = workflow.enqueue()
    Reaper().run_once()
    assert ready() == ["tolerant"]
    steps = {s["name"]: (s["state"], s["reason"]) for s in Workflow.status(run.pk)["steps"]}
    assert steps["a"][0] == "expired"
    assert steps["strict"] == ("cancelled", "dependency 'a' ended expired")


# --- cancel, replay ---------------------------------------------------------------------


def test_cancel_a_running_workflow():
    workflow = Workflow("c")
    workflow.group(Step("running", Q), Step("queued", Q))
    workflow.add("waiting", Q, after=["running", "queued"])
    run = workflow.enqueue()
    running = take("running")
    assert Workflow.cancel(run.pk, by="ops") == 2
    states = {s["name"]: s["state"] for s in Workflow.status(run.pk)["steps"]}
    assert states == {"running": "enqueued", "queued": "cancelled", "waiting": "cancelled"}
    running.refresh_from_db()
    assert running.cancel_requested_at is not None  # asked to stop, as any running message
    assert running.archive_cancelled()
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("finished", "cancelled")
    assert Message.objects.count() == 0


def test_replaying_a_dead_step_resumes_the_workflow():
    run = diamond().enqueue()
    take("a").fail("boom", retry=False)
    assert Workflow.status(run.pk)["outcome"] == "failed"
    replay(ArchivedMessage.objects.get(outcome=Outcome.DEAD))
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("running", "")
    assert [s["state"] for s in status["steps"]] == ["enqueued", "waiting", "waiting"]
    take("a").ack()
    take("b").ack()
    take("c").ack()
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("finished", "succeeded")


def test_replaying_a_step_whose_end_a_child_tolerated_makes_the_child_wait_for_it_again():
    """Found by tests/test_workflow_properties.py: 'join' tolerates a's dead letter and waits for b. After a's
    replay, a's second end must not count twice: 'join' still waits for b."""
    workflow = Workflow("tolerant")
    workflow.add("a", Q, max_attempts=1)
    workflow.add("b", Q)
    workflow.add("join", Q, after=[Dep("a", ignore_dead=True), "b"])
    run = workflow.enqueue()
    b = take("b")
    take("a").fail("boom", retry=False)
    replay(ArchivedMessage.objects.get(outcome=Outcome.DEAD))
    assert WorkflowStep.objects.get(workflow=run, name="join").pending == 2
    take("a").ack()
    assert ready() == []  # join waits for b, still running
    b.ack()
    take("join").ack()
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("finished", "succeeded")


def test_a_replay_leaves_cancelled_a_step_that_another_dependency_still_dooms():
    """Found by tests/test_workflow_properties.py: 'join' was cancelled by a's dead letter, and b died too.
    Replaying a must not make 'join' wait for ever on the dead b: it stays cancelled, now for b, and b's own
    replay brings it back."""
    workflow = Workflow("doomed twice")
    workflow.add("a", Q, max_attempts=1)
    workflow.add("b", Q, max_attempts=1)
    workflow.add("join", Q, after=["a", "b"])
    workflow.add("after", Q, after=["join"])
    run = workflow.enqueue()
    take("a").fail("boom", retry=False)
    take("b").fail("boom", retry=False)
    replay(ArchivedMessage.objects.get(outcome=Outcome.DEAD, headers__dbqueue_step=[run.pk, "a"]))
    steps = {s["name"]: (s["state"], s["reason"]) for s in Workflow.status(run.pk)["steps"]}
    assert steps["join"] == ("cancelled", "dependency 'b' ended dead")
    assert steps["after"] == ("cancelled", "dependency 'b' ended cancelled")
    take("a").ack()
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("finished", "failed")  # nothing waits for ever
    replay(ArchivedMessage.objects.get(outcome=Outcome.DEAD, headers__dbqueue_step=[run.pk, "b"]))
    assert [s["state"] for s in Workflow.status(run.pk)["steps"]] == ["acked", "enqueued", "waiting", "waiting"]
    take("b").ack()
    take("join").ack()
    take("after").ack()
    status = Workflow.status(run.pk)
    assert (status["state"], status["outcome"]) == ("finished", "succeeded")


def test_a_replay_brings_back_a_step_declared_before_the_parent_it_was_cancelled_through():
    """``after=`` may name a step declared later: 'c' (after b) comes before 'b' (after a). a's dead letter
    cancels b, and c through b; a's replay decides b first, then c, and both wait again."""
    workflow = Workflow("forward")
    workflow.add("a", Q, max_attempts=1)
    workflow.add("c", Q, after=["b"])
    workflow.add("b", Q, after=["a"])
    run = workflow.enqueue()
    take("a").fail("boom", retry=False)
    replay(ArchivedMessage.objects.get(outcome=Outcome.DEAD))
    steps = {s["name"]: (s["state"], s["reason"]) for s in Workflow.status(run.pk)["steps"]}
    assert steps == {"a": ("enqueued", ""), "c": ("waiting", ""), "b": ("waiting", "")}
    for name in ("a", "b", "c"):
        take(name).ack()
    assert Workflow.status(run.pk)["outcome"] == "succeeded"


def test_a_step_that_tolerated_a_cascade_cancel_waits_again_after_the_replay():
    """s0's cancel cancels s1; s3 tolerates s1's cancel and waits for s2. Replaying s0 reopens s1, so s3
    waits for s1 again: it runs after s1 and s2, not before s2."""
    workflow = Workflow("cascade")
    workflow.add("s0", Q)
    workflow.add("s1", Q, after=["s0"])
    workflow.add("s2", Q)
    workflow.add("s3", Q, after=[Dep("s1", ignore_cancelled=True), "s2"])
    run = workflow.enqueue()
    cancel(WorkflowStep.objects.get(workflow=run, name="s0").message_id, by="ops")
    assert WorkflowStep.objects.get(workflow=run, name="s3").pending == 1
    replay(ArchivedMessage.objects.get(outcome=Outcome.CANCELLED))
    assert WorkflowStep.objects.get(workflow=run, name="s3").pending == 2
    s2 = take("s2")
    take("s0").ack()
    take("s1").ack()
    assert ready() == []  # s3 still waits for s2
    s2.ack()
    take("s3").ack()
    assert Workflow.status(run.pk)["state"] == "finished"


def test_a_replay_that_reopens_a_fan_out_runs_as_many_statements_whatever_its_width():
    """The cancelled steps' dependencies are read in one locked statement and the steps written by outcome,
    and so are the waiting children whose count the replay changes: not one statement each. Reopening a
    10,000-step fan-out must not take 20,000 round trips."""

    def replay_statements(width: int) -> int:
        workflow = Workflow(f"fan-{width}")
        workflow.add("a", Q, max_attempts=1)
        workflow.add("b", Q)
        for i in range(width):  # half of them also wait for b, so two pending counts come back
            workflow.add(f"c{i}", Q, after=["a", "b"] if i % 2 else ["a"])
            # These tolerate a's dead letter and wait for b: after the replay they wait for a again.
            workflow.add(f"d{i}", Q, after=[Dep("a", ignore_dead=True), "b"])
        run = workflow.enqueue()
        take("a").fail("boom", retry=False)
        dead = ArchivedMessage.objects.get(outcome=Outcome.DEAD)
        with CaptureQueriesContext(connection) as queries:
            replay(dead)
        steps = WorkflowStep.objects.filter(workflow=run)
        assert {s.name: s.pending for s in steps.exclude(name__in=["a", "b"])} == {
            **{f"c{i}": 2 if i % 2 else 1 for i in range(width)},
            **{f"d{i}": 2 for i in range(width)},
        }
        take("b").ack()
        take("a").ack()
        assert sorted(ready()) == sorted([f"c{i}" for i in range(width)] + [f"d{i}" for i in range(width)])
        for message in Message.objects.filter(queue=Q):
            message.delete()
        ArchivedMessage.objects.all().delete()
        # The statements on the steps and their edges: not, say, the nudge addresses read once a second.
        tables = (WorkflowStep._meta.db_table, WorkflowEdge._meta.db_table)
        return sum(any(table in query["sql"] for table in tables) for query in queries.captured_queries)

    assert replay_statements(4) == replay_statements(40)


def lock_waits() -> int:
    """How many sessions wait for a row lock now (PostgreSQL, MariaDB/MySQL)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        elif connection.mysql_is_mariadb:  # its innodb_trx does not list a locking read's wait: a stuck one
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.processlist"
                " WHERE command = 'Query' AND time_ms > 300 AND info LIKE '%%FOR UPDATE%%'"
            )
        else:
            cursor.execute("SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'")
        return cursor.fetchone()[0]


def replay_at_once(monkeypatch, first: str, second: str) -> None:
    """Replay the dead steps ``first`` and ``second`` in two threads: ``first``'s transaction stays open
    until ``second``'s waits for a row lock, then both commit."""
    real = table.reopen
    reopened, go = threading.Event(), threading.Event()

    def held_open(using, headers, old, new):
        real(using, headers, old, new)
        if headers["dbqueue_step"][1] == first:
            reopened.set()
            go.wait(60)

    monkeypatch.setattr(table, "reopen", held_open)
    rows = {r.headers["dbqueue_step"][1]: r for r in ArchivedMessage.objects.filter(outcome=Outcome.DEAD)}
    errors: list[BaseException] = []

    def replay_in_thread(name):
        try:
            replay(rows[name])
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=replay_in_thread, args=(first,))]
    threads[0].start()
    assert reopened.wait(60)
    threads.append(threading.Thread(target=replay_in_thread, args=(second,)))
    threads[1].start()
    wait_for_lock = time.monotonic() + 60
    while not lock_waits() and time.monotonic() < wait_for_lock:
        time.sleep(0.05)
    waited = lock_waits()
    go.set()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    assert waited, f"{second}'s replay never waited for {first}'s: the race was not met"


two_writers = pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has one writer: no two replays at once")


@two_writers
def test_two_replays_at_once_each_see_the_other(monkeypatch):
    """a and y died; c (after both) was cancelled by a. y's replay holds its transaction open while a's
    runs: a's reads y's row locked, waits, and sees y enqueued, so c waits for both (it used to be left
    cancelled for y's dead letter, which y's replay had already looked past)."""
    workflow = Workflow("race")
    workflow.add("a", Q, max_attempts=1)
    workflow.add("y", Q, max_attempts=1)
    workflow.add("c", Q, after=["a", "y"])
    run = workflow.enqueue()
    take("a").fail("boom", retry=False)
    take("y").fail("boom", retry=False)
    replay_at_once(monkeypatch, "y", "a")
    steps = {s["name"]: s["state"] for s in Workflow.status(run.pk)["steps"]}
    assert steps == {"a": "enqueued", "y": "enqueued", "c": "waiting"}
    for name in ("a", "y", "c"):
        take(name).ack()
    assert Workflow.status(run.pk)["outcome"] == "succeeded"


@two_writers
def test_a_replay_decides_again_a_step_another_replay_handed_to_it(monkeypatch):
    """b died, cancelling w (after c and b); a died, cancelling c (after a). b's replay finds w still doomed
    by c, and hands w to a's end (cause 'a') while a's replay waits for c's row. On PostgreSQL a's first
    search could not see w (its rows are picked at its start): it searches again, and w waits for c."""
    workflow = Workflow("handed")
    workflow.add("a", Q, max_attempts=1)
    workflow.add("b", Q, max_attempts=1)
    workflow.add("c", Q, after=["a"])
    workflow.add("w", Q, after=["c", "b"])
    run = workflow.enqueue()
    take("b").fail("boom", retry=False)
    take("a").fail("boom", retry=False)
    replay_at_once(monkeypatch, "b", "a")
    steps = {s["name"]: (s["state"], s["reason"]) for s in Workflow.status(run.pk)["steps"]}
    assert steps == {"a": ("enqueued", ""), "b": ("enqueued", ""), "c": ("waiting", ""), "w": ("waiting", "")}
    for name in ("a", "b", "c", "w"):
        take(name).ack()
    assert Workflow.status(run.pk)["outcome"] == "succeeded"


@two_writers
def test_a_step_reopened_before_a_dependency_handed_over_later_waits_for_it(monkeypatch):
    """As above, with v after a and w (tolerating w's cancel). a's first round reopens v while w still
    reads cancelled (handed to a by b's replay), so v waits for a alone; its second round reopens w. v
    must then wait for w too: it was left waiting for a alone, and ran before w (found by a review)."""
    workflow = Workflow("handed-late")
    workflow.add("a", Q, max_attempts=1)
    workflow.add("b", Q, max_attempts=1)
    workflow.add("c", Q, after=["a"])
    workflow.add("w", Q, after=["c", "b"])
    workflow.add("v", Q, after=["a", Dep("w", ignore_cancelled=True)])
    run = workflow.enqueue()
    take("b").fail("boom", retry=False)
    take("a").fail("boom", retry=False)
    replay_at_once(monkeypatch, "b", "a")
    steps = {s.name: (s.state, s.pending) for s in WorkflowStep.objects.filter(workflow=run)}
    assert steps["w"] == ("waiting", 2) and steps["v"] == ("waiting", 2), steps
    take("a").ack()
    take("b").ack()
    take("c").ack()
    assert ready() == ["w"]  # v waits for w
    take("w").ack()
    take("v").ack()
    assert Workflow.status(run.pk)["outcome"] == "succeeded"


# --- results' bounds ------------------------------------------------------------------------


def test_a_result_too_big_to_keep_is_refused_by_name_when_read(monkeypatch):
    monkeypatch.setattr(table, "MAX_RESULT_BYTES", 100)
    django_dbqueue.workflows.chain("big", Step("a", Q), Step("b", Q)).enqueue()
    take("a").ack(result="x" * 200)
    with pytest.raises(InvalidOption, match=r"step 'a' returned a result that was not kept: .*limit is 100"):
        take("b").parent_results()


def test_parent_results_past_their_bound_are_refused(monkeypatch):
    monkeypatch.setattr(table, "MAX_PARENT_RESULTS_BYTES", 50)
    django_dbqueue.workflows.chord("big", [Step("a", Q), Step("b", Q)], Step("c", Q)).enqueue()
    take("a").ack(result="x" * 30)
    take("b").ack(result="y" * 30)
    with pytest.raises(InvalidOption, match="parents pass 50 bytes of JSON \\(at step 'b'\\)"):
        take("c").parent_results()


def test_an_ordinary_message_has_no_parent_results():
    with pytest.raises(InvalidOption, match="is not a workflow step"):
        django_dbqueue.enqueue(Q, {}).parent_results()


# --- the reaper -----------------------------------------------------------------------


def test_the_reaper_settles_a_step_archived_outside_the_finishing_paths():
    run = django_dbqueue.workflows.chain("sql", Step("a", Q), Step("b", Q)).enqueue()
    message = Message.objects.get(queue=Q)
    # A plain SQL consumer's ack: the live row deleted, an archive row written, no join.
    ArchivedMessage.from_live(message, Outcome.ACKED, result="by SQL").save()
    Message.objects.filter(pk=message.pk)._raw_delete("default")
    assert ready() == []
    report = Reaper().run_once()
    assert report.steps_settled == 1
    assert take("b").parent_results() == {"a": "by SQL"}
    assert Reaper().run_once().steps_settled == 0
    assert WorkflowRun.objects.get(pk=run.pk).open_steps == 1


def test_the_reaper_deletes_finished_workflows_past_retention(settings):
    settings.DBQUEUE = {"RETENTION_DAYS": 1}
    old = django_dbqueue.workflows.chain("old", Step("a", Q)).enqueue()
    take("a").ack()
    live = django_dbqueue.workflows.chain("live", Step("b", Q)).enqueue()
    WorkflowRun.objects.filter(pk__in=[old.pk, live.pk]).update(created_at=timezone.now() - timedelta(days=3))
    WorkflowRun.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(days=2))
    assert Reaper().run_once().workflows_pruned == 1
    assert list(WorkflowRun.objects.values_list("pk", flat=True)) == [live.pk]
    assert not WorkflowStep.objects.filter(workflow_id=old.pk).exists()


def test_a_step_whose_workflow_is_gone_is_reported_and_nothing_runs(caplog):
    django_dbqueue.workflows.chain("orphan", Step("a", Q), Step("b", Q)).enqueue()
    a = take("a")
    WorkflowEdge.objects.all().delete()
    WorkflowStep.objects.all().delete()
    WorkflowRun.objects.all().delete()
    assert a.ack()
    assert "whose rows are gone" in caplog.text
    assert Message.objects.count() == 0


# --- the signal and the counter ---------------------------------------------------------


def test_workflow_finished_is_sent_once_with_the_outcome():
    heard = []

    def receiver(sender, **kwargs):
        heard.append((sender, kwargs["workflow"], kwargs["name"], kwargs["outcome"]))

    django_dbqueue.signals.workflow_finished.connect(receiver)
    try:
        run = django_dbqueue.workflows.chain("signalled", Step("a", Q), Step("b", Q)).enqueue()
        take("a").ack()
        assert heard == []
        take("b").ack()
        failed = diamond().enqueue()
        take("a").fail("boom", retry=False)
    finally:
        django_dbqueue.signals.workflow_finished.disconnect(receiver)
    assert heard == [(WorkflowRun, run.pk, "signalled", "succeeded"), (WorkflowRun, failed.pk, "p", "failed")]


def test_the_prometheus_counter_counts_workflows_by_outcome():
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    from django_dbqueue.metrics import instruments

    def count(outcome):
        return REGISTRY.get_sample_value("dbqueue_workflows_finished_total", {"outcome": outcome}) or 0

    before = count("cancelled")
    instruments.connect()
    try:
        workflow = Workflow("counted")
        workflow.add("a", Q)
        run = workflow.enqueue()
        Workflow.cancel(run.pk)
    finally:
        instruments.disconnect()
    assert count("cancelled") == before + 1


def test_queuestats_lists_workflows_in_progress():
    from io import StringIO

    from django.core.management import call_command

    running = django_dbqueue.workflows.chain("invoice-9", Step("a", Q), Step("b", Q)).enqueue()
    done = django_dbqueue.workflows.chain("done", Step("x", Q)).enqueue()
    take("x").ack()
    out = StringIO()
    call_command("queuestats", stdout=out)
    assert "Workflows in progress (1)" in out.getvalue()
    assert f"#{running.pk} invoice-9  2 step(s) open" in out.getvalue()
    assert f"#{done.pk} " not in out.getvalue()
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    data = __import__("json").loads(out.getvalue())
    assert (data["workflows_running"], [w["name"] for w in data["workflows"]]) == (1, ["invoice-9"])


def test_a_workflow_runs_in_the_immediate_mode(dbqueue, handler):
    seen = []

    @handler("wf-immediate")
    def step(message):
        seen.append(message.headers["dbqueue_step"][1])
        return len(seen)

    with dbqueue.immediate():
        run = django_dbqueue.workflows.chord(
            "now", [Step("a", "wf-immediate"), Step("b", "wf-immediate")], Step("c", "wf-immediate")
        ).enqueue()
    assert sorted(seen[:2]) == ["a", "b"] and seen[2] == "c"
    assert Workflow.status(run.pk)["outcome"] == "succeeded"
    assert [s["result"] for s in Workflow.status(run.pk)["steps"]][2] == 3


def test_the_enqueued_workflow_carries_its_database_times():
    run = django_dbqueue.workflows.chain("timed", Step("a", Q)).enqueue()
    assert abs(run.created_at - timezone.now()) < timedelta(minutes=5)
    assert run.created_at == WorkflowRun.objects.get(pk=run.pk).created_at
